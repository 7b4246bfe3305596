/* One live server per directory: an exclusive flock(2) on a lock file in it
 * (the broker directory's "kvside-server.lock", the L2 directory's
 * "l2.lock"). The kernel drops the lock when its holder dies in any way, so
 * a stale file from a killed server never blocks a restart; the file is
 * never removed (removing it would let two servers lock two different
 * files). The holder writes its pid into the file for the message a second
 * server prints.
 *
 * Ownership: the fd returned belongs to the caller, who keeps it open for
 * as long as it owns the directory and passes it to kvs_dirlock_drop. A
 * child made by fork shares the lock (the same open file description);
 * exec drops it (O_CLOEXEC). */
#ifndef KVS_DIRLOCK_H
#define KVS_DIRLOCK_H

#include <stddef.h>

/* Locks DIR/NAME (created 0600 if missing). Returns the lock's fd, or
 * -EBUSY with WHY "<what> DIR is in use by kvside-server pid N" when another
 * live process holds it, or another negative errno with WHY naming the
 * file and the error. WHAT names the directory's role ("broker directory",
 * "L2 directory"). */
int kvs_dirlock_take(const char *dir, const char *name, const char *what, char *why, size_t cap);

/* Releases a lock taken by kvs_dirlock_take (fd < 0: nothing). */
void kvs_dirlock_drop(int fd);

#endif
