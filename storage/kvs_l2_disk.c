/* The L2 map and the disk blocks under it: a full file system must not
 * fault a write through the map (docs/architecture.md §6, Disk space). See
 * kvs_l2_impl.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <sys/statvfs.h>

#define KVS_LOG_COMPONENT "l2"
#include "kvs_l2_impl.h"

/* ---- map and disk -----------------------------------------------------------
 * With MDB_WRITEMAP, LMDB writes pages through a shared mapping of a sparse
 * data.mdb. On a full file system the page fault that would give a page its
 * block fails, and the kernel sends SIGBUS — there is no error code to
 * handle (issue 16 #7). So the writer allocates the file's blocks ahead of
 * LMDB's next page (fallocate) before each transaction, and when the file
 * system refuses, it shrinks the map to the blocks the file holds: LMDB then
 * answers MDB_MAP_FULL, the writer evicts and retries, as with a full map.
 * While capped, each batch asks the file system (fstatvfs) whether there is
 * room again and grows the map back. */

/* LMDB does not say where it mapped data.mdb: find the mapping. */
void kvs__l2_find_map_base(kvs_l2 *l2, uint64_t mapsize)
{
	l2->map_base = NULL;
	char want[600], line[1024], real[4096];
	snprintf(want, sizeof(want), "%s/data.mdb", l2->path);
	const char *w = realpath(want, real) ? real : want;
	FILE *mf = fopen("/proc/self/maps", "r");
	while (mf && fgets(line, sizeof(line), mf)) {
		unsigned long lo, hi;
		char path[4096] = "";
		if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %4095s", &lo, &hi, path) >= 2 && strcmp(path, w) == 0 &&
		    (uint64_t)(hi - lo) >= mapsize) {
			l2->map_base = (uint8_t *)lo;
			break;
		}
	}
	if (mf)
		fclose(mf);
}

uint64_t kvs__l2_round_pages(const kvs_l2 *l2, uint64_t x) { return (x + l2->psize - 1) / l2->psize * l2->psize; }

/* Capacity the watermarks work against for a map of this size. */
void kvs__l2_set_capacity(kvs_l2 *l2)
{
	l2->capacity = l2->map_now >= l2->map_full ? l2->cfg.size
						   : l2->map_now - l2->map_now * RESERVE_PCT / (100 + RESERVE_PCT);
	pthread_mutex_lock(&l2->mu);
	l2->st.map_size = l2->capacity;
	pthread_mutex_unlock(&l2->mu);
}

/* Resizes the map (writer thread, between its transactions; at open before
 * the threads start). LMDB rounds a size below the pages in use up. */
static int remap(kvs_l2 *l2, uint64_t size)
{
	pthread_rwlock_wrlock(&l2->maplock);
	int rc = mdb_env_set_mapsize(l2->env, size);
	MDB_envinfo info;
	if (rc == 0) {
		mdb_env_info(l2->env, &info);
		l2->map_now = info.me_mapsize;
		kvs__l2_find_map_base(l2, info.me_mapsize);
	} else if (rc != EINVAL) {
		/* LMDB unmapped the old map and could not map again (EINVAL: a
		 * write transaction was open, nothing changed — not expected) */
		l2->broken = true;
		l2->map_base = NULL;
	}
	pthread_rwlock_unlock(&l2->maplock);
	if (rc) {
		kvs_err("L2 %s: cannot resize the map to %llu bytes: %s; L2 stops working", l2->path,
			(unsigned long long)size, mdb_strerror(rc));
		return rc;
	}
	kvs__l2_set_capacity(l2);
	return 0;
}

static int falloc(kvs_l2 *l2, uint64_t from, uint64_t to)
{
	if (to <= from)
		return 0;
	int r;
	do
		r = fallocate(l2->fd, 0, (off_t)from, (off_t)(to - from));
	while (r < 0 && errno == EINTR);
	return r < 0 ? errno : 0;
}

/* Before a write transaction that brings `incoming` bytes of pages: makes
 * sure data.mdb has blocks for them and for the B-tree pages around them
 * (slack), or caps the map at the blocks it has. */
void kvs__l2_disk_reserve(kvs_l2 *l2, uint64_t incoming)
{
	if (!l2->falloc || l2->broken)
		return;
	MDB_envinfo info;
	mdb_env_info(l2->env, &info);
	uint64_t next = ((uint64_t)info.me_last_pgno + 1) * l2->psize;
	uint64_t need = kvs__l2_round_pages(l2, next + incoming + l2->slack), ahead = need + l2->slack;
	if (need > l2->map_full)
		need = l2->map_full;
	if (ahead > l2->map_full)
		ahead = l2->map_full;
	bool capped = l2->map_now < l2->map_full;
	int err = 0;
	if (!capped && need > l2->alloc_end) {
		if ((err = falloc(l2, l2->alloc_end, ahead)) == 0)
			l2->alloc_end = ahead;
		else if ((err == ENOSPC || err == EDQUOT) && (err = falloc(l2, l2->alloc_end, need)) == 0)
			l2->alloc_end = need;
	} else if (capped) {
		/* has the file system room again? (no allocation is tried, and
		 * none fails, while it has not) */
		struct statvfs vfs;
		if (fstatvfs(l2->fd, &vfs) == 0) {
			uint64_t avail = (uint64_t)vfs.f_bavail * vfs.f_frsize;
			if (avail > 2 * l2->slack) {
				uint64_t to = (l2->alloc_end + avail - l2->slack) / l2->psize * l2->psize;
				if (to > l2->map_full)
					to = l2->map_full;
				if (falloc(l2, l2->alloc_end, to) == 0)
					l2->alloc_end = to;
			}
		}
	}
	if (err == EOPNOTSUPP) {
		l2->falloc = false;
		kvs_warn("L2 %s: the file system cannot preallocate (fallocate): if it fills up, a write into the map "
			 "faults (SIGBUS) and the next start sets the file aside",
			 l2->path);
		return;
	}
	if (err && err != ENOSPC && err != EDQUOT) {
		kvs_warn_rl(&l2->rl_disk, "L2 %s: cannot allocate disk blocks: %s", l2->path, strerror(err));
		return;
	}
	if (err) {
		pthread_mutex_lock(&l2->mu);
		l2->st.disk_full++;
		pthread_mutex_unlock(&l2->mu);
		kvs_warn_rl(&l2->rl_disk,
			    "L2 %s: %s: L2 stops growing at %llu MiB of disk and evicts least-recently-used objects "
			    "to keep writing; it grows again when the file system has room",
			    l2->path, strerror(err), (unsigned long long)(l2->alloc_end >> 20));
	}
	uint64_t want = (capped || err) && l2->alloc_end < l2->map_full ? l2->alloc_end : l2->map_full;
	if (want != l2->map_now) {
		remap(l2, want);
		/* LMDB keeps at least the pages in use, and those have blocks */
		if (l2->map_now > l2->alloc_end && l2->map_now < l2->map_full)
			l2->alloc_end = l2->map_now;
		if (!err && want == l2->map_full)
			kvs_warn("L2 %s: the file system has room again: capacity back to %llu MiB", l2->path,
				 (unsigned long long)(l2->capacity >> 20));
	}
}

/* At open: warns when the file system is smaller than l2-size, and
 * allocates the blocks of the pages in use and the first slack. */
void kvs__l2_disk_open(kvs_l2 *l2)
{
	struct statvfs vfs;
	struct stat sb;
	if (fstatvfs(l2->fd, &vfs) == 0 && fstat(l2->fd, &sb) == 0) {
		uint64_t total = (uint64_t)vfs.f_blocks * vfs.f_frsize, avail = (uint64_t)vfs.f_bavail * vfs.f_frsize;
		uint64_t mine = (uint64_t)sb.st_blocks * 512;
		const char *then = "when it is full, L2 stops growing (its capacity is then what the disk holds) and "
				   "evicts least-recently-used objects to keep writing";
		if (total < l2->cfg.size)
			kvs_warn("L2 %s: the file system holds %llu MiB in all, less than l2-size (%llu MiB): %s", l2->path,
				 (unsigned long long)(total >> 20), (unsigned long long)(l2->cfg.size >> 20), then);
		else if (avail + mine < l2->cfg.size)
			kvs_warn("L2 %s: the file system has %llu MiB free and L2 holds %llu MiB, less than l2-size "
				 "(%llu MiB): %s",
				 l2->path, (unsigned long long)(avail >> 20), (unsigned long long)(mine >> 20),
				 (unsigned long long)(l2->cfg.size >> 20), then);
	}
	MDB_envinfo info;
	mdb_env_info(l2->env, &info);
	uint64_t next = ((uint64_t)info.me_last_pgno + 1) * l2->psize;
	/* the pages in use have blocks (LMDB wrote them); make sure of it, as
	 * a copied file may have become sparse */
	int err = falloc(l2, 0, next);
	if (err == EOPNOTSUPP) {
		l2->falloc = false;
		kvs_warn("L2 %s: the file system cannot preallocate (fallocate): if it fills up, a write into the map "
			 "faults (SIGBUS) and the next start sets the file aside",
			 l2->path);
		return;
	}
	l2->falloc = true;
	l2->alloc_end = err ? 0 : next;
	/* lock.mdb is a shared mapping too (the reader table): its blocks now */
	char lock[600];
	snprintf(lock, sizeof(lock), "%s/lock.mdb", l2->path);
	int lfd = open(lock, O_RDWR | O_CLOEXEC);
	if (lfd >= 0) {
		if (fstat(lfd, &sb) == 0 && sb.st_size > 0 && fallocate(lfd, 0, 0, sb.st_size) < 0)
			kvs_warn("L2 %s: cannot allocate the blocks of lock.mdb: %s", l2->path, strerror(errno));
		close(lfd);
	}
	kvs__l2_disk_reserve(l2, 0);
}

/* ---- writeback ahead of the commit ------------------------------------------ */

/* Starts the disk writing a record as soon as it is complete, so that the
 * disk works while the writer copies the rest of the batch instead of only
 * in the commit's sync (issue 18: the writer copied, then waited for the
 * disk, then copied the next batch while the disk idled). Contiguous
 * records are gathered into runs of at least KICK_BYTES; flush sends what
 * is gathered. The range runs from the record's first page (LMDB's page
 * header and ours, written through the map just before) to its last: an
 * overflow page belongs to one value, and this transaction touches it no
 * more, so no page starts writeback only to be dirtied again. Pages of an
 * uncommitted transaction on disk are harmless (copy-on-write: the
 * committed meta page references none of them); the commit's sync still
 * waits for all of them. SYNC_FILE_RANGE_WRITE only queues the I/O. */
void kvs__l2_writeback_kick(kvs_l2 *l2, uint64_t off, uint64_t len, bool flush)
{
	if (len) {
		uint64_t lo = off / l2->psize * l2->psize, hi = off + len;
		if (l2->kick_hi != l2->kick_lo && (lo > l2->kick_hi || hi < l2->kick_lo)) {
			/* not contiguous with the run gathered: send that first */
			kvs__l2_writeback_kick(l2, 0, 0, true);
		}
		if (l2->kick_hi == l2->kick_lo) {
			l2->kick_lo = lo;
			l2->kick_hi = hi;
		} else {
			l2->kick_lo = lo < l2->kick_lo ? lo : l2->kick_lo;
			l2->kick_hi = hi > l2->kick_hi ? hi : l2->kick_hi;
		}
	}
	if (l2->kick_hi > l2->kick_lo && (flush || l2->kick_hi - l2->kick_lo >= KICK_BYTES)) {
		(void)sync_file_range(l2->fd, (off_t)l2->kick_lo, (off_t)(l2->kick_hi - l2->kick_lo), SYNC_FILE_RANGE_WRITE);
		l2->kick_lo = l2->kick_hi = 0;
	}
}
