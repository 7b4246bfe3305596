/* The fork/pipe core of the simulated rank processes; see harness.h. */
#include "harness.h"

#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/wait.h>
#include <unistd.h>

/* Parent-side fds a forked child must not keep: every running child's pipe
 * ends (else a child whose test died would never see EOF) and what callers
 * track (the other ranks' memfds). */
static int tracked[256];
static int n_tracked;

void kvt_proc_track(int fd)
{
	if (n_tracked < (int)(sizeof(tracked) / sizeof(tracked[0])))
		tracked[n_tracked++] = fd;
}

void kvt_proc_untrack(int fd)
{
	for (int i = 0; i < n_tracked; i++)
		if (tracked[i] == fd) {
			tracked[i] = tracked[--n_tracked];
			return;
		}
}

int kvt_proc_start(kvt_proc *p, kvt_proc_fn fn, void *arg, const int *keep, int n_keep)
{
	int cp[2], rp[2];
	p->pid = 0;
	if (pipe(cp))
		return -1;
	if (pipe(rp)) {
		close(cp[0]);
		close(cp[1]);
		return -1;
	}
	kvt_proc_track(cp[1]);
	kvt_proc_track(rp[0]);
	pid_t pid = fork();
	if (pid < 0) {
		kvt_proc_untrack(cp[1]);
		kvt_proc_untrack(rp[0]);
		close(cp[0]), close(cp[1]), close(rp[0]), close(rp[1]);
		return -1;
	}
	if (pid == 0) {
		for (int i = 0; i < n_tracked; i++) { /* cp[1] and rp[0] among them */
			bool own = false;
			for (int k = 0; k < n_keep; k++)
				own |= tracked[i] == keep[k];
			if (!own)
				close(tracked[i]);
		}
		fn(arg, cp[0], rp[1]);
		_exit(0);
	}
	close(cp[0]);
	close(rp[1]);
	p->pid = pid;
	p->cmd_fd = cp[1];
	p->res_fd = rp[0];
	return 0;
}

int kvt_proc_call(kvt_proc *p, const void *cmd, size_t cmd_len, void *res, size_t res_len, int timeout_ms)
{
	if (cmd && write(p->cmd_fd, cmd, cmd_len) != (ssize_t)cmd_len)
		return -1;
	struct pollfd pf = {.fd = p->res_fd, .events = POLLIN};
	if (poll(&pf, 1, timeout_ms) != 1 || read(p->res_fd, res, res_len) != (ssize_t)res_len)
		return -1;
	return 0;
}

static void close_pipes(kvt_proc *p)
{
	kvt_proc_untrack(p->cmd_fd);
	kvt_proc_untrack(p->res_fd);
	close(p->cmd_fd);
	close(p->res_fd);
	p->pid = 0;
}

void kvt_proc_kill(kvt_proc *p)
{
	if (p->pid <= 0)
		return;
	kill(p->pid, SIGKILL);
	waitpid(p->pid, NULL, 0);
	close_pipes(p);
}

void kvt_proc_stop(kvt_proc *p, const void *exit_cmd, size_t exit_len)
{
	if (p->pid <= 0)
		return;
	bool gone = false;
	if (write(p->cmd_fd, exit_cmd, exit_len) == (ssize_t)exit_len)
		for (int i = 0; i < 500 && !gone; i++) {
			gone = waitpid(p->pid, NULL, WNOHANG) == p->pid;
			if (!gone)
				usleep(10000);
		}
	if (!gone)
		kvt_proc_kill(p);
	else
		close_pipes(p);
}

int kvt_proc_wait(kvt_proc *p)
{
	if (p->pid <= 0)
		return -1;
	int st = -1;
	if (waitpid(p->pid, &st, 0) != p->pid)
		st = -1;
	close_pipes(p);
	return st;
}
