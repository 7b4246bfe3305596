/* The memory this server may use (memroom.c): the least of the kernel's
 * MemAvailable and, for each memory cgroup (v2, or v1) from the process's
 * own up to the root, its limit less its usage, page cache not counted as
 * used (memory.stat "file", v1 "total_cache": a restart finds the last
 * run's L2 pages still charged, and the kernel reclaims them before it
 * kills). Read once at start-up, to
 * check l1-size against it before the arena is faulted in: a prefault past
 * a cgroup's limit is an OOM kill with no line in the log.
 *
 * Test hooks: KVS_TEST_MEMINFO names a file read in place of
 * /proc/meminfo, KVS_TEST_CGROUP_ROOT a directory read in place of
 * /sys/fs/cgroup. */
#ifndef KVS_MEMROOM_H
#define KVS_MEMROOM_H

#include <stddef.h>
#include <stdint.h>

/* Returns the bytes this process may still take (UINT64_MAX when nothing
 * could be read) and writes into WHERE what bounds them ("MemAvailable",
 * "cgroup /sys/fs/cgroup/x: limit 512 MiB, 3 MiB in use"). */
uint64_t kvs_memroom(char *where, size_t cap);

#endif
