/* One live server per directory (kvs_dirlock.h). */
#include "kvs_dirlock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

/* The pid the holder wrote, or 0 when the file holds none yet (the holder
 * is between its flock and its write). */
static long holder_pid(int fd)
{
	char buf[32];
	ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	char *end;
	long pid = strtol(buf, &end, 10);
	return pid > 0 && (*end == '\n' || *end == 0) ? pid : 0;
}

int kvs_dirlock_take(const char *dir, const char *name, const char *what, char *why, size_t cap)
{
	char path[4096];
	if ((size_t)snprintf(path, sizeof(path), "%s/%s", dir, name) >= sizeof(path)) {
		snprintf(why, cap, "%s %s: path too long", what, dir);
		return -ENAMETOOLONG;
	}
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0) {
		int e = errno;
		snprintf(why, cap, "cannot open the lock file %s: %s", path, strerror(e));
		return -e;
	}
	if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
		int e = errno;
		if (e == EWOULDBLOCK) {
			long pid = holder_pid(fd);
			if (pid)
				snprintf(why, cap, "%s %s is in use by kvside-server pid %ld (%s): one server per "
					 "directory; stop it first, or give this one another directory", what, dir, pid, path);
			else
				snprintf(why, cap, "%s %s is in use by another kvside-server (%s): one server per "
					 "directory; stop it first, or give this one another directory", what, dir, path);
			e = EBUSY;
		} else {
			snprintf(why, cap, "cannot lock %s: %s", path, strerror(e));
		}
		close(fd);
		return -e;
	}
	char pid[24];
	int n = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
	if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, (size_t)n, 0) != n) {
		int e = errno ? errno : EIO;
		snprintf(why, cap, "cannot write %s: %s", path, strerror(e));
		close(fd);
		return -e;
	}
	return fd;
}

void kvs_dirlock_drop(int fd)
{
	if (fd >= 0)
		close(fd); /* the lock goes with the last reference */
}
