/* Out of file descriptors, libzmq aborts the process: its ipc and tcp
 * listeners assert that accept(2) failed only with the errors they expect,
 * and EMFILE is not among them (libzmq 4.3, ipc_listener.cpp: "Too many open
 * files"). A peer that opens connections until the server's fd limit is
 * reached would end every engine's session on the host.
 *
 * This file, linked into the kvside-server executable only, defines accept
 * and accept4: the dynamic linker binds libzmq's calls (and the broker's)
 * to them. They call the kernel directly and, when it answers EMFILE or
 * ENFILE, shed the connection waiting on the listener with the classic
 * reserve descriptor (close the reserve, accept, close the peer, reopen the
 * reserve) and report EAGAIN, which every caller handles: the peer sees its
 * connection closed, the server goes on, and kvs_accept_shed counts it
 * (stat accepts_shed). The sessions of peers already connected are not
 * touched; the fd-hungry paths of the server's own (the broker's parked
 * fds) are bounded by the limit already (broker.c). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "server.h"

static pthread_mutex_t reserve_mu = PTHREAD_MUTEX_INITIALIZER;
static int reserve_fd = -1;

void kvs_fdguard_init(void)
{
	pthread_mutex_lock(&reserve_mu);
	if (reserve_fd < 0)
		reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	pthread_mutex_unlock(&reserve_mu);
}

static int guarded(int fd, struct sockaddr *addr, socklen_t *len, int flags)
{
	int r = (int)syscall(SYS_accept4, fd, addr, len, flags);
	if (r >= 0 || (errno != EMFILE && errno != ENFILE))
		return r;
	pthread_mutex_lock(&reserve_mu);
	if (reserve_fd >= 0) {
		close(reserve_fd);
		reserve_fd = -1;
	}
	int c = (int)syscall(SYS_accept4, fd, NULL, NULL, SOCK_CLOEXEC);
	if (c >= 0)
		close(c);
	reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	pthread_mutex_unlock(&reserve_mu);
	if (c >= 0)
		atomic_fetch_add(&kvs_accept_shed, 1);
	errno = EAGAIN;
	return -1;
}

/* glibc's prototypes (a transparent union of sockaddr pointers under
 * _GNU_SOURCE) */
int accept4(int fd, __SOCKADDR_ARG addr, socklen_t *__restrict len, int flags)
{
	return guarded(fd, addr.__sockaddr__, len, flags);
}

int accept(int fd, __SOCKADDR_ARG addr, socklen_t *__restrict len) { return guarded(fd, addr.__sockaddr__, len, 0); }
