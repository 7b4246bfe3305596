/* kvs_l2 internals shared by the files of the L2 tier — not an API:
 * kvs_l2.c (queues, writer and reader threads, open and close, the owner
 * API), kvs_l2_db.c (record headers, reading a record into L1, metadata
 * counts, LRU stamps, eviction), kvs_l2_env.c (opening the environment,
 * crash-loop detection, setting a corrupt one aside) and kvs_l2_disk.c (the
 * map and the disk blocks under it, writeback ahead of the commit). */
#ifndef KVS_L2_IMPL_H
#define KVS_L2_IMPL_H

#include <lmdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvs_cq.h"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "kvs_record.h"

/* records: storage/kvs_record.h (the format shared with L3) */
#define HDR_BYTES KVS_RECORD_HDR_BYTES
#define FORMAT_VERSION KVS_RECORD_VERSION
#define MAX_TOUCHES 65536
/* a read lands in L1 in slices this large, each hashed while in cache */
#define READ_SLICE (256u << 10)
/* the writer hashes and writes an object in slices this large (1 MiB: a
 * pwrite per 256 KiB cost more in system calls than re-reading a cooler
 * slice costs the hash; measured, docs/benchmarks.md issue 18) */
#define WRITE_SLICE (1024u << 10)
/* the writer starts the disk on runs of written records this large (1 and
 * 8 MiB measured; 8 slightly ahead) */
#define KICK_BYTES (8u << 20)
#define HIGH_PCT 85
#define LOW_PCT 70
/* the pages in use (objects' overflow pages, B-trees) may reach this much of
 * `size` before eviction, whatever the byte count says; the map itself is
 * RESERVE_PCT larger than `size`, so an evicting transaction always has
 * pages to copy-on-write into */
#define PAGES_HIGH_PCT 95
#define PAGES_LOW_PCT 80
#define RESERVE_PCT 6

typedef kvs_record_hdr l2_hdr;

typedef struct l2_item l2_item; /* kvs_l2.c */

typedef struct l2_list {
	l2_item *head, *tail;
	uint64_t n, bytes;
} l2_list;

/* A record to delete, found unusable by a reader: fp fingerprints the value
 * as it was found, so that a record rewritten since is not deleted. */
typedef struct l2_drop {
	kvs_objkey key;
	uint64_t fp;
} l2_drop;

/* Invariants: every queued item is on exactly one of wq, rq, done, or in a
 * thread's hands; bytes (guarded by mu) equals the sum of value sizes in the
 * obj database as of the last commit. Every page a write transaction may
 * touch lies below alloc_end while the map is capped (map_now < map_full):
 * the map ends there. */
struct kvs_l2 {
	kvs_l2_config cfg;
	char path[512];
	MDB_env *env;
	MDB_dbi obj, lru, atime, meta;
	pthread_mutex_t mu;
	pthread_cond_t wcv, rcv;
	l2_list wq, rq, done;
	kvs_cq_item ready;        /* posted to cfg.cq when done has entries */
	atomic_bool ready_posted; /* ready is on the queue */
	kvs_objkey *touches; /* pending access stamps */
	uint32_t n_touches;
	l2_drop *drops; /* records found unusable by readers: delete them */
	uint32_t n_drops;
	bool stop;
	/* Map and disk. Any transaction but the writer's holds maplock for
	 * reading; the writer holds it for writing while it resizes the map
	 * (LMDB unmaps and maps again: no transaction may be open). */
	pthread_rwlock_t maplock;
	bool broken;       /* a resize failed: the environment has no map (guarded by maplock) */
	uint8_t *map_base; /* the environment's map (WRITEMAP) and data file */
	int fd;
	uint64_t map_full;  /* the map wanted: size + reserve (or an existing larger one) */
	uint64_t map_now;   /* writer-owned: the map in effect, smaller while a full disk caps it */
	uint64_t alloc_end; /* writer-owned: data.mdb bytes known to have blocks on disk */
	uint64_t slack;     /* bytes allocated ahead of LMDB's next page beyond a batch */
	uint64_t capacity;  /* writer-owned: what the watermarks take as the size */
	bool falloc;        /* the file system preallocates (fallocate) */
	pthread_t writer, readers[KVS_L2_MAX_READERS];
	bool writer_started;
	uint32_t n_readers; /* reader threads started */
	uint64_t clock; /* writer-owned logical time */
	uint64_t psize; /* LMDB page size */
	kvs_record_hasher *wxs; /* writer-owned: the checksum state of put_object */
	uint64_t kick_lo, kick_hi; /* writer-owned: file range written, its writeback not yet started */
	kvs_objkey *evicted; /* writer-owned: keys evicted by the transaction in progress */
	uint32_t n_evicted, cap_evicted;
	/* crash-loop detection (l2_state) */
	int state_fd;
	int dir_lock; /* kvs_dirlock on the directory: one server per L2, held until kvs_l2_close's end */
	pthread_mutex_t state_mu;
	uint32_t txn_depth; /* write transactions open now (guarded by state_mu) */
	bool committed;     /* a write transaction of this run has committed (state_mu) */
	atomic_int inject;  /* kvs__l2_inject */
	kvs_ratelimit rl_commit, rl_disk, rl_bad, rl_corrupt;
	uint32_t suspect_fails; /* writer: commits failed in a way only damage explains (kvs_l2.c) */
	char damage[200];       /* the damage the open's structural check found ("" if none) */
	kvs_l2_stats st; /* guarded by mu */
};

/* ---- kvs_l2_db.c: records and the databases (inside a transaction) ---- */

enum { HDR_OK = KVS_RECORD_OK, HDR_BAD = KVS_RECORD_BAD, HDR_KEY = KVS_RECORD_KEY, HDR_GEOM = KVS_RECORD_GEOM };
uint64_t kvs__l2_value_fp(const MDB_val *v);
int kvs__l2_check_hdr(const MDB_val *v, const kvs_objkey *key, uint64_t geom, l2_hdr *h);
void kvs__l2_drop_found(kvs_l2 *l2, const kvs_objkey *key, const MDB_val *v, int why);
uint64_t kvs__l2_meta_get(MDB_txn *txn, MDB_dbi dbi, const char *name);
int kvs__l2_meta_put(MDB_txn *txn, MDB_dbi dbi, const char *name, uint64_t x);
/* An object's value v (from the map): if it has an overflow run, is the
 * run's first page what LMDB will free or reuse it by (its number, flags, a
 * page count that holds v inside the map)? 0, or MDB_CORRUPTED (noted: the
 * file is set aside at the next start). Writer: before a delete or an
 * overwrite. */
int kvs__l2_check_overflow(kvs_l2 *l2, const MDB_val *v);
int kvs__l2_del_object(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key, uint64_t *freed);
int kvs__l2_stamp(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key);
uint64_t kvs__l2_used_bytes(kvs_l2 *l2, MDB_txn *txn);
/* Reads the object under key into dst (len bytes), verified (header, key,
 * geometry, checksum); 0, KVS_E_MISS or KVS_E_INTERNAL. xs: the calling
 * reader thread's hasher. */
int kvs__l2_read_record(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key, uint64_t geom, void *dst, uint64_t len,
			kvs_record_hasher *xs);
uint64_t kvs__l2_obj_pages(const kvs_l2 *l2, uint64_t len);
int kvs__l2_evict_to(kvs_l2 *l2, MDB_txn *txn, uint64_t *bytes, uint64_t *objects, uint64_t target,
		     uint64_t page_target, uint64_t max_freed, uint64_t *evicted);

/* ---- kvs_l2_env.c: opening, crash-loop detection ---- */

bool kvs__l2_corrupt_err(int rc);
void kvs__l2_install_fatal(void);
void kvs__l2_work_enter(kvs_l2 *l2, bool write);
void kvs__l2_work_leave(kvs_l2 *l2, bool write, bool committed);
void kvs__l2_note_error(kvs_l2 *l2, int rc, const char *what);
int kvs__l2_set_aside(kvs_l2 *l2, const char *why);
void kvs__l2_state_open(kvs_l2 *l2, const char **ret_why, char *buf, size_t cap);
void kvs__l2_state_close(kvs_l2 *l2);
int kvs__l2_env_open(kvs_l2 *l2);
/* The writer and reader threads: all their work is L2 work (the fault
 * handler's marker), on an alternate signal stack; end frees it. */
void *kvs__l2_thread_begin(kvs_l2 *l2);
void kvs__l2_thread_end(void *alt);

/* ---- kvs_l2_disk.c: the map and the disk blocks under it ---- */

void kvs__l2_find_map_base(kvs_l2 *l2, uint64_t mapsize);
uint64_t kvs__l2_round_pages(const kvs_l2 *l2, uint64_t x);
void kvs__l2_set_capacity(kvs_l2 *l2);
void kvs__l2_disk_reserve(kvs_l2 *l2, uint64_t incoming);
void kvs__l2_disk_open(kvs_l2 *l2);
/* Writer: starts writeback of the record at file offset off (len bytes),
 * gathering contiguous records into runs; flush starts what is gathered. */
void kvs__l2_writeback_kick(kvs_l2 *l2, uint64_t off, uint64_t len, bool flush);

#endif
