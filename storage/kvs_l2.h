/* kvs_l2: the persistent tier, one LMDB environment in a directory.
 *
 * An object is stored under its 64-byte kvs_objkey with a 96-byte header
 * (magic, format version 2, geometry fingerprint, length, checksum, and the
 * full object key again) followed by the data. The checksum is XXH3-64 of the
 * data seeded with XXH3-64 of the header, so it binds the bytes to the key
 * they were written under: a record found under another key (a swapped
 * overflow-page pointer, a misplaced record) is a miss, counted, deleted and
 * never served; so is a record of format version 1. Committed L1 objects
 * are written behind by one writer thread in group-commit transactions;
 * reader threads (cfg.readers) read objects back into L1 reservations with
 * pread, verifying the checksum on every read; reads complete in any order. Threads report back through a completion list and
 * the caller's eventfd.
 *
 * Threading: kvs_l2_open/close, the enqueue functions, kvs_l2_reap and
 * kvs_l2_contains are called by one owner thread (the server's main loop).
 * Data pointers handed to enqueue functions must stay valid until the
 * matching completion is reaped (the caller pins or reserves them).
 *
 * Capacity: `size` bounds the LMDB map. Above the high watermark (85 % of the
 * map in object bytes) the writer deletes least-recently-used objects down to
 * the low watermark (70 %). Access stamps are batched: kvs_l2_touch() queues
 * them and the writer applies them in its next transaction. A full map
 * (MDB_MAP_FULL) makes the writer evict harder and retry, never stall. A
 * full file system is the same: the writer allocates the file's blocks ahead
 * of LMDB, and when the file system refuses (ENOSPC) the map shrinks to the
 * blocks the file holds, so writing goes on by eviction; it grows back once
 * the file system has room again.
 *
 * Crash safety: LMDB is copy-on-write with two meta pages, so after a crash
 * (kill -9) the environment opens at the last committed transaction. What
 * a *power loss* may lose depends on the sync policy (see kvs_l2_sync). A
 * corrupt environment never crash-loops: an open that fails with an LMDB
 * corruption error, a previous run that died of a fatal signal inside L2 work,
 * or two consecutive runs that died inside a write transaction (the second
 * before committing any) make kvs_l2_open move data.mdb aside
 * (data.mdb.corrupt-<UTC time>) and start empty (docs/architecture.md §6).
 * For that, kvs_l2_open installs (once per process) a handler for SIGSEGV,
 * SIGBUS, SIGILL, SIGFPE and SIGABRT that notes the signal in <path>/l2.state
 * when it hits a thread inside L2 work, then hands the signal to the handler
 * installed before it (or the default action). */
#ifndef KVS_L2_H
#define KVS_L2_H

#include <stdbool.h>
#include <stdint.h>

#include "kvs_cq.h"
#include "kvs_l1.h"

enum kvs_l2_sync {
	KVS_L2_SYNC_FULL,   /* fsync data and meta at every group commit (default) */
	KVS_L2_SYNC_NOMETA, /* fsync data, not meta: power loss may lose the last commit */
	KVS_L2_SYNC_NONE,   /* no fsync: process crashes lose nothing committed; power loss may lose recent commits or corrupt the environment */
};

struct kvs_l2_done;

#define KVS_L2_MAX_READERS 16

typedef struct kvs_l2_config {
	const char *path;        /* environment directory (created 0700 if missing) */
	uint64_t size;           /* map size in bytes */
	int sync;                /* enum kvs_l2_sync */
	uint32_t queue_max;      /* pending writes before the oldest are dropped */
	uint64_t queue_max_bytes;
	uint32_t batch_max;      /* objects per group commit */
	uint64_t batch_bytes;    /* bytes per group commit */
	uint32_t batch_ms;       /* longest wait to fill a batch */
	uint32_t readers;        /* reader threads (default 4, at most KVS_L2_MAX_READERS; 0 = 1) */
	int efd;                 /* eventfd written when completions are ready (no cq) */
	/* With a completion queue: an item is posted when completions are ready,
	 * and running it hands each one to on_done (the loop thread). */
	struct kvs_cq *cq;
	void (*on_done)(void *arg, const struct kvs_l2_done *d);
	void *done_arg;
	bool report_evictions;   /* completions of op KVS_L2_EVICTED for every eviction */
	bool verify;             /* walk data.mdb's structure before opening it (kvs_l2_verify.h; default on) */
} kvs_l2_config;

void kvs_l2_config_defaults(kvs_l2_config *cfg);

typedef struct kvs_l2 kvs_l2;

/* Opens (or creates) the environment and starts the writer and reader
 * threads. No scan: an existing environment serves immediately. A corrupt
 * one (see "Crash safety" above) is moved aside, logged at error level and
 * counted (corrupt_recoveries), and the open goes on with an empty one.
 * Returns 0, -errno, or an LMDB error (see kvs_strerror): the directory
 * cannot be used, the corrupt file cannot be moved, or even a fresh
 * environment fails to open. */
int kvs_l2_open(const kvs_l2_config *cfg, kvs_l2 **ret);
/* Finishes queued writes (bounded by the queue), stops the threads, closes the
 * environment. Completions not yet reaped are discarded: the owner must have
 * reaped or must not care (shutdown). Accepts NULL. */
void kvs_l2_close(kvs_l2 *l2);

/* Is the object present with this geometry fingerprint? Reads the header
 * only. Returns 0 and *ret_len; KVS_E_MISS if absent, or if the record is
 * unusable — of another format version, a damaged header, or written under
 * another key (counted, and queued for deletion); KVS_E_GEOMETRY if present but
 * made for another geometry (counted; the caller treats it as a miss). */
int kvs_l2_contains(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, uint64_t *ret_len);

/* KVS_L2_EVICTED: not a request's completion but a report: the writer
 * deleted the object `key` (least recently used) in a committed transaction. */
enum kvs_l2_op { KVS_L2_WRITE = 1, KVS_L2_READ = 2, KVS_L2_META = 3, KVS_L2_EVICTED = 4 };

typedef struct kvs_l2_done {
	int op;       /* enum kvs_l2_op */
	kvs_objkey key; /* write, read, evicted: the object */
	int result;   /* 0; write: KVS_E_NOSPACE (dropped from the queue, or its group commit failed); read: KVS_E_MISS (absent, or unusable: checksum, key or header mismatch — such a record is deleted) */
	void *cookie; /* as given */
} kvs_l2_done;

/* Queues a write of len bytes at data under key. If the queue is full, the
 * oldest pending write is dropped (completed with KVS_E_NOSPACE, counted).
 * Returns 0 or -ENOMEM (nothing queued). */
int kvs_l2_write(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		 void *cookie);
/* The same, as member idx of a write-behind group (a job's objects, idx =
 * chunk position; group 0 = none): when pending writes must be dropped, the
 * oldest group loses its highest idx first, so L2 never gets a group's later
 * chunks without its earlier ones. Writes of one group are queued together. */
int kvs_l2_write_in(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		    void *cookie, uint64_t group, uint32_t idx);
/* Drops pending writes not yet taken by the writer (oldest group, tail
 * first) until `bytes` are freed or cap writes are dropped; their cookies go
 * to cookies[] and NO completion is reported for them (the caller releases
 * what they held now: the loop unpins their L1 objects to make room for a
 * store). Counted as write drops. Returns how many. */
uint32_t kvs_l2_shed(kvs_l2 *l2, uint64_t bytes, void **cookies, uint32_t cap);
/* Queues a read of the object into dst (exactly len bytes), verified against
 * the key, the geometry and the checksum; dst is written only when the header
 * matches. Returns 0 or -ENOMEM. */
int kvs_l2_read(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, void *dst, uint64_t len,
		void *cookie);
/* Small metadata records (e.g. the geometry of a namespace, so lookups after
 * a restart work before any rank re-registers). put is queued to the writer
 * (durable with its next group commit; completes as op KVS_L2_META with a
 * NULL cookie); get reads synchronously. Keys up to 64 bytes, values up to
 * 4 KiB. get returns 0 and *ret_len, or KVS_E_MISS. */
int kvs_l2_put_meta(kvs_l2 *l2, const void *key, uint32_t klen, const void *val, uint32_t vlen);
int kvs_l2_get_meta(kvs_l2 *l2, const void *key, uint32_t klen, void *buf, uint32_t cap, uint32_t *ret_len);
/* Records an access (applied by the writer in its next transaction). */
void kvs_l2_touch(kvs_l2 *l2, const kvs_objkey *key);
/* Takes up to cap completions; returns how many. */
uint32_t kvs_l2_reap(kvs_l2 *l2, kvs_l2_done *out, uint32_t cap);
/* Deletes every object (synchronously, from the owner thread). */
int kvs_l2_clear(kvs_l2 *l2);

typedef struct kvs_l2_stats {
	uint64_t map_size;                       /* capacity now: `size`, or less while a full file system caps it */
	uint64_t objects, bytes;                 /* bytes: object data + headers */
	uint64_t writes, write_batches, write_drops, write_errors;
	uint64_t reads, read_misses, checksum_failures, header_mismatches;
	uint64_t key_mismatches;                 /* records found under another object's key (deleted, never served) */
	uint64_t evictions, map_full_retries;
	uint64_t disk_full;                      /* allocations of data.mdb's blocks refused by the file system (ENOSPC) */
	uint64_t corrupt_recoveries;             /* times open moved a corrupt data.mdb aside (0 or 1 per open) */
	uint64_t verify_us, verify_bytes;        /* the open's structural check: its time, the bytes in use it covered */
	uint64_t queue_depth, queue_bytes;
	uint64_t writes_committed;               /* monotonic, in queue order */
} kvs_l2_stats;
void kvs_l2_get_stats(kvs_l2 *l2, kvs_l2_stats *st);

/* The environment directory (data.mdb lives inside). */
const char *kvs_l2_path(const kvs_l2 *l2);

/* Test hook (tests/unit/test_l2.c): the writer's next transaction that writes
 * objects dies inside the transaction, after its puts and before its commit —
 * KVS_L2_INJECT_KILL by SIGKILL (as a kill -9 would), KVS_L2_INJECT_SEGV by
 * SIGSEGV (as a fault on a corrupt page would). */
enum { KVS_L2_INJECT_NONE, KVS_L2_INJECT_KILL, KVS_L2_INJECT_SEGV };
void kvs__l2_inject(kvs_l2 *l2, int what);

#endif
