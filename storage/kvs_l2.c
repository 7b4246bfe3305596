/* L2 tier over LMDB: writer thread with group commit, reader thread with
 * checksum verification, batched LRU stamps, watermark eviction; records
 * bound to their key, disk space allocated ahead of LMDB, and crash-loop
 * detection through a small state file. See kvs_l2.h for the contract and
 * docs/architecture.md §6 for the design. */
#include "kvs_l2.h"

#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvs_cq.h"
#include "kvs_error.h"

#define KVS_LOG_COMPONENT "l2"
#include "kvs_log.h"

#define HDR_BYTES 96
/* 2: the header holds the full object key and the checksum is seeded with
 * the header's hash (1: namespace digest only, data-only checksum). Records
 * of another version are misses and are deleted when found. */
#define FORMAT_VERSION 2
#define MAX_TOUCHES 65536
#define HIGH_PCT 85
#define LOW_PCT 70
/* the pages in use (objects' overflow pages, B-trees) may reach this much of
 * `size` before eviction, whatever the byte count says; the map itself is
 * RESERVE_PCT larger than `size`, so an evicting transaction always has
 * pages to copy-on-write into */
#define PAGES_HIGH_PCT 95
#define PAGES_LOW_PCT 80
#define RESERVE_PCT 6
/* runs in a row dying inside a write transaction (each after the first
 * before committing any) that make the next open set the environment aside */
#define STRIKES_MAX 2
#define STATE_FILE "l2.state"

/* On-disk object header (little-endian host order; the format version
 * guards layout changes). */
typedef struct l2_hdr {
	char magic[4];     /* "KVL2" */
	uint16_t version;  /* FORMAT_VERSION */
	uint16_t flags;
	uint64_t geom;     /* geometry fingerprint of the group's layout */
	uint64_t len;      /* data bytes following the header */
	uint64_t checksum; /* XXH3-64 of the data, seeded with XXH3-64 of this header (checksum 0) */
	kvs_objkey key;    /* the key the record was written under */
} l2_hdr;
_Static_assert(sizeof(l2_hdr) == HDR_BYTES, "header must stay 96 bytes");
_Static_assert(offsetof(l2_hdr, key) == 32, "header layout");

/* How the last run that opened this environment ended (STATE_FILE, 16
 * bytes). Single bytes are rewritten in place with pwrite and never synced:
 * the file must survive the death of the process, not a power loss. */
typedef struct l2_state {
	char magic[8];   /* "KVL2RUN1" */
	uint8_t open;    /* a process has the environment open (cleared by a clean close) */
	uint8_t in_txn;  /* ... and is inside a write transaction */
	uint8_t fault;   /* a fatal signal (its number) hit a thread inside L2 work, or FAULT_LMDB */
	uint8_t strikes; /* deaths inside a write transaction in a row, no commit between them */
	uint8_t pad[4];
} l2_state;
_Static_assert(sizeof(l2_state) == 16, "state layout");
#define FAULT_LMDB 0xff /* LMDB reported corruption (MDB_CORRUPTED, MDB_PAGE_NOTFOUND, MDB_PANIC) */

typedef struct l2_item {
	struct l2_item *next;
	int op;
	kvs_objkey key;
	uint64_t geom;
	const void *src; /* write */
	void *dst;       /* read */
	uint64_t len;
	void *cookie;
	int result;
	uint64_t group; /* write: its write-behind group (0 = none) and its place in it */
	uint32_t idx;
	uint8_t *owned; /* META: key (mkey bytes) then value, owned by the item */
	uint32_t mkey;
} l2_item;

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
	pthread_t writer, reader;
	bool writer_started, reader_started;
	uint64_t clock; /* writer-owned logical time */
	uint64_t psize; /* LMDB page size */
	kvs_objkey *evicted; /* writer-owned: keys evicted by the transaction in progress */
	uint32_t n_evicted, cap_evicted;
	/* crash-loop detection (l2_state) */
	int state_fd;
	pthread_mutex_t state_mu;
	uint32_t txn_depth; /* write transactions open now (guarded by state_mu) */
	bool committed;     /* a write transaction of this run has committed (state_mu) */
	atomic_int inject;  /* kvs__l2_inject */
	kvs_ratelimit rl_commit, rl_disk, rl_bad, rl_corrupt;
	kvs_l2_stats st; /* guarded by mu */
};

void kvs_l2_config_defaults(kvs_l2_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = 16ull << 30;
	cfg->sync = KVS_L2_SYNC_FULL;
	cfg->queue_max = 65536; /* the byte bound (queue_max_bytes) usually binds first */
	cfg->queue_max_bytes = 1ull << 30;
	cfg->batch_max = 256;
	cfg->batch_bytes = 256ull << 20;
	cfg->batch_ms = 2;
	cfg->efd = -1;
}

static void list_push(l2_list *l, l2_item *it)
{
	it->next = NULL;
	if (l->tail)
		l->tail->next = it;
	else
		l->head = it;
	l->tail = it;
	l->n++;
	l->bytes += it->len;
}

/* Removes it (whose predecessor is prev, NULL for the head) from l. */
static void list_unlink(l2_list *l, l2_item *prev, l2_item *it)
{
	if (prev)
		prev->next = it->next;
	else
		l->head = it->next;
	if (l->tail == it)
		l->tail = prev;
	it->next = NULL;
	l->n--;
	l->bytes -= it->len;
}

/* The pending write to drop next (mu held): the oldest group's tail. Writes
 * of one group (a job's objects) are queued together; the one with the
 * highest idx (latest chunk) goes first, so what reaches the disk of a
 * group is always a prefix of it, never a suffix without its head. */
static l2_item *drop_victim(l2_list *wq, l2_item **ret_prev)
{
	l2_item *head = wq->head, *best = NULL, *best_prev = NULL, *prev = NULL;
	if (!head || head->op != KVS_L2_WRITE)
		return NULL;
	for (l2_item *it = head; it; prev = it, it = it->next) {
		if (it->op != KVS_L2_WRITE || it->group != head->group || (it != head && !head->group))
			break;
		if (!best || it->idx >= best->idx)
			best = it, best_prev = prev;
	}
	*ret_prev = best_prev;
	return best;
}

static l2_item *list_pop(l2_list *l)
{
	l2_item *it = l->head;
	if (!it)
		return NULL;
	l->head = it->next;
	if (!l->head)
		l->tail = NULL;
	l->n--;
	l->bytes -= it->len;
	return it;
}

/* The completion-queue item (loop thread): completions go to on_done. */
static void l2_ready(kvs_cq_item *it)
{
	kvs_l2 *l2 = (kvs_l2 *)((char *)it - offsetof(kvs_l2, ready));
	atomic_store(&l2->ready_posted, false); /* before reaping: later ones post again */
	kvs_l2_done d[64];
	uint32_t n;
	while ((n = kvs_l2_reap(l2, d, 64)) > 0)
		for (uint32_t i = 0; i < n; i++)
			l2->cfg.on_done(l2->cfg.done_arg, &d[i]);
}

static void signal_owner(kvs_l2 *l2)
{
	if (l2->cfg.cq) {
		if (!atomic_exchange(&l2->ready_posted, true))
			kvs_cq_post(l2->cfg.cq, &l2->ready);
	} else if (l2->cfg.efd >= 0) {
		uint64_t one = 1;
		ssize_t w = write(l2->cfg.efd, &one, sizeof(one));
		(void)w;
	}
}

/* mu held */
static void complete(kvs_l2 *l2, l2_item *it, int result)
{
	it->result = result;
	list_push(&l2->done, it);
}

static int lmdb_err(int rc) { return rc > 0 ? -rc : rc; }

/* LMDB errors that mean the file is damaged, not that it is busy or full. */
static bool corrupt_err(int rc)
{
	return rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND || rc == MDB_PANIC || rc == MDB_INVALID ||
	       rc == MDB_VERSION_MISMATCH || rc == MDB_INCOMPATIBLE;
}

/* ---- crash-loop detection --------------------------------------------------
 * The state file records whether a run is inside a write transaction, and
 * the fatal-signal handler records a signal that hits a thread doing L2 work
 * (tl_state_fd set). kvs_l2_open reads how the last run ended (§6). */

static _Thread_local int tl_state_fd = -1; /* this thread is inside L2 work */
static _Thread_local bool tl_l2_thread;     /* the writer or reader: all its work is L2 work */
static struct sigaction fatal_prev[NSIG];   /* the handlers installed before ours */
static const int fatal_sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

/* Async-signal-safe: pwrite, sigaction, raise. */
static void on_fatal(int sig, siginfo_t *si, void *ctx)
{
	int fd = tl_state_fd;
	if (fd >= 0) {
		uint8_t b = (uint8_t)sig;
		ssize_t w = pwrite(fd, &b, 1, offsetof(l2_state, fault));
		(void)w;
	}
	const struct sigaction *p = &fatal_prev[sig];
	if ((p->sa_flags & SA_SIGINFO) && p->sa_sigaction) {
		p->sa_sigaction(sig, si, ctx);
		return;
	}
	if (!(p->sa_flags & SA_SIGINFO) && p->sa_handler != SIG_DFL && p->sa_handler != SIG_IGN) {
		p->sa_handler(sig);
		return;
	}
	/* the default action: taken when the handler returns (the signal is
	 * blocked until then) */
	struct sigaction dfl = {.sa_handler = SIG_DFL};
	sigemptyset(&dfl.sa_mask);
	sigaction(sig, &dfl, NULL);
	raise(sig);
}

static void install_fatal(void)
{
	for (size_t i = 0; i < sizeof(fatal_sigs) / sizeof(fatal_sigs[0]); i++) {
		struct sigaction sa = {.sa_sigaction = on_fatal, .sa_flags = SA_SIGINFO | SA_ONSTACK};
		sigemptyset(&sa.sa_mask);
		sigaction(fatal_sigs[i], &sa, &fatal_prev[fatal_sigs[i]]);
	}
}

static const char *sig_name(int sig)
{
	switch (sig) {
	case SIGSEGV: return "SIGSEGV";
	case SIGBUS: return "SIGBUS";
	case SIGILL: return "SIGILL";
	case SIGFPE: return "SIGFPE";
	case SIGABRT: return "SIGABRT";
	default: return "a fatal signal";
	}
}

static void state_put(kvs_l2 *l2, size_t off, uint8_t v)
{
	if (l2->state_fd < 0)
		return;
	ssize_t w = pwrite(l2->state_fd, &v, 1, (off_t)off);
	(void)w;
}

/* Enters or leaves L2 work on this thread (the signal handler's marker);
 * write transactions also set in_txn in the state file, and the first one
 * of the run that commits clears the strikes. */
static void work_enter(kvs_l2 *l2, bool write)
{
	tl_state_fd = l2->state_fd;
	if (!write)
		return;
	pthread_mutex_lock(&l2->state_mu);
	if (l2->txn_depth++ == 0)
		state_put(l2, offsetof(l2_state, in_txn), 1);
	pthread_mutex_unlock(&l2->state_mu);
}

static void work_leave(kvs_l2 *l2, bool write, bool committed)
{
	if (write) {
		pthread_mutex_lock(&l2->state_mu);
		if (committed && !l2->committed) {
			l2->committed = true;
			state_put(l2, offsetof(l2_state, strikes), 0);
		}
		if (--l2->txn_depth == 0)
			state_put(l2, offsetof(l2_state, in_txn), 0);
		pthread_mutex_unlock(&l2->state_mu);
	}
	if (!tl_l2_thread)
		tl_state_fd = -1;
}

/* An LMDB error that means a damaged file: the next open sets it aside. */
static void note_lmdb_error(kvs_l2 *l2, int rc, const char *what)
{
	if (!corrupt_err(rc))
		return;
	state_put(l2, offsetof(l2_state, fault), FAULT_LMDB);
	kvs_err_rl(&l2->rl_corrupt, "L2 %s: %s: %s; the environment is damaged and will be set aside at the next start",
		   l2->path, what, mdb_strerror(rc));
}

/* Moves data.mdb aside as data.mdb.corrupt-<UTC time> and removes lock.mdb,
 * so that the next mdb_env_open creates an empty environment. */
static int set_aside(kvs_l2 *l2, const char *why)
{
	char from[600], to[700], lock[600], stamp[32];
	snprintf(from, sizeof(from), "%s/data.mdb", l2->path);
	snprintf(lock, sizeof(lock), "%s/lock.mdb", l2->path);
	time_t now = time(NULL);
	struct tm tm;
	gmtime_r(&now, &tm);
	strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", &tm);
	snprintf(to, sizeof(to), "%s.corrupt-%s", from, stamp);
	for (int i = 2; access(to, F_OK) == 0 && i < 1000; i++)
		snprintf(to, sizeof(to), "%s.corrupt-%s-%d", from, stamp, i);
	if (rename(from, to) < 0) {
		int e = errno;
		if (e != ENOENT) {
			kvs_err("L2 %s is corrupt (%s) and cannot be moved aside to %s: %s", l2->path, why, to,
				strerror(e));
			return -e;
		}
		snprintf(to, sizeof(to), "(no data.mdb to move)");
	}
	if (unlink(lock) < 0 && errno != ENOENT)
		kvs_warn("cannot remove %s: %s", lock, strerror(errno));
	kvs_err("L2 %s is corrupt (%s): moved data.mdb aside to %s, starting with an empty L2", l2->path, why, to);
	l2->st.corrupt_recoveries++;
	state_put(l2, offsetof(l2_state, fault), 0);
	state_put(l2, offsetof(l2_state, strikes), 0);
	return 0;
}

/* Opens the state file and decides from the last run's record whether the
 * environment must be set aside: *ret_why says why (or stays NULL). Marks
 * this run open. The state file is an aid: without it (an error opening it)
 * the L2 works, without crash-loop detection. */
static void state_open(kvs_l2 *l2, const char **ret_why, char *buf, size_t cap)
{
	char p[600];
	snprintf(p, sizeof(p), "%s/" STATE_FILE, l2->path);
	l2->state_fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (l2->state_fd < 0) {
		kvs_warn("cannot open %s: %s; no crash-loop detection for this L2", p, strerror(errno));
		return;
	}
	l2_state prev, cur = {.magic = "KVL2RUN1", .open = 1};
	if (pread(l2->state_fd, &prev, sizeof(prev), 0) != (ssize_t)sizeof(prev) ||
	    memcmp(prev.magic, "KVL2RUN1", 8) != 0)
		memset(&prev, 0, sizeof(prev)); /* a new environment, or an unreadable record */
	/* what calls for a set-aside stays recorded until set_aside succeeds:
	 * a start that dies (or fails) before that tries again */
	cur.fault = prev.fault;
	if (prev.fault == FAULT_LMDB) {
		snprintf(buf, cap, "the previous run met LMDB errors that mean a damaged file");
		*ret_why = buf;
	} else if (prev.fault) {
		snprintf(buf, cap, "the previous run died of %s inside L2 work", sig_name(prev.fault));
		*ret_why = buf;
	} else if (prev.open && prev.in_txn) {
		cur.strikes = (uint8_t)(prev.strikes < 0xff ? prev.strikes + 1 : 0xff);
		if (cur.strikes >= STRIKES_MAX) {
			snprintf(buf, cap, "%u runs in a row died inside a write transaction, the last before committing any",
				 (unsigned)cur.strikes);
			*ret_why = buf;
		} else {
			kvs_warn("L2 %s: the previous run died inside a write transaction; kept (strike %u: the file is "
				 "set aside when %u runs in a row die so, the later ones before committing any)",
				 l2->path, (unsigned)cur.strikes, (unsigned)STRIKES_MAX);
		}
	} else if (prev.open) {
		kvs_info("L2 %s: the previous run was not closed cleanly (outside L2 write work); kept", l2->path);
	}
	ssize_t w = pwrite(l2->state_fd, &cur, sizeof(cur), 0);
	(void)w;
}

/* A clean close: not open, no transaction, no strikes — a recorded fault
 * stays for the next open. */
static void state_close(kvs_l2 *l2)
{
	if (l2->state_fd < 0)
		return;
	state_put(l2, offsetof(l2_state, in_txn), 0);
	state_put(l2, offsetof(l2_state, strikes), 0);
	state_put(l2, offsetof(l2_state, open), 0);
	close(l2->state_fd);
	l2->state_fd = -1;
}

/* ---- records ------------------------------------------------------------------ */

/* Fingerprint of a value as found: its size and header bytes. */
static uint64_t value_fp(const MDB_val *v)
{
	return XXH3_64bits(v->mv_data, v->mv_size < HDR_BYTES ? v->mv_size : HDR_BYTES) ^ v->mv_size;
}

/* The checksum's seed: XXH3-64 of the header with the checksum field 0 and
 * the key the object is written or read under — so the checksum binds the
 * data to that key too, beside the header's key field. */
static uint64_t hdr_seed(const l2_hdr *h, const kvs_objkey *key)
{
	l2_hdr z = *h;
	z.checksum = 0;
	z.key = *key;
	return XXH3_64bits(&z, sizeof(z));
}

enum { HDR_OK, HDR_BAD, HDR_KEY, HDR_GEOM };

/* Classifies a record found under key: HDR_BAD (too short, another magic or
 * format version, length field not the value's: unusable by anyone),
 * HDR_KEY (written under another key), HDR_GEOM (another geometry), or
 * HDR_OK with *h filled. */
static int check_hdr(const MDB_val *v, const kvs_objkey *key, uint64_t geom, l2_hdr *h)
{
	if (v->mv_size < HDR_BYTES)
		return HDR_BAD;
	memcpy(h, v->mv_data, HDR_BYTES);
	if (memcmp(h->magic, "KVL2", 4) != 0 || h->version != FORMAT_VERSION || h->len != v->mv_size - HDR_BYTES)
		return HDR_BAD;
	if (memcmp(&h->key, key, sizeof(*key)) != 0)
		return HDR_KEY;
	if (h->geom != geom)
		return HDR_GEOM;
	return HDR_OK;
}

/* A reader found the record under key unusable: count it, queue its
 * deletion (the writer deletes it only if it is still the same value). */
static void drop_found(kvs_l2 *l2, const kvs_objkey *key, const MDB_val *v, int why)
{
	uint64_t fp = value_fp(v);
	pthread_mutex_lock(&l2->mu);
	if (why == HDR_KEY)
		l2->st.key_mismatches++;
	else if (why == HDR_BAD)
		l2->st.header_mismatches++;
	else
		l2->st.checksum_failures++;
	if (l2->n_drops < MAX_TOUCHES)
		l2->drops[l2->n_drops++] = (l2_drop){.key = *key, .fp = fp}; /* never served: delete it */
	pthread_cond_signal(&l2->wcv);
	pthread_mutex_unlock(&l2->mu);
	kvs_warn_rl(&l2->rl_bad, "%s: record dropped",
		    why == HDR_KEY ? "record found under another object's key"
		    : why == HDR_BAD ? "record of another format version or with a damaged header"
				     : "checksum mismatch");
}

/* ---- metadata helpers (writer txn) ---------------------------------------- */

static uint64_t meta_get(MDB_txn *txn, MDB_dbi dbi, const char *name)
{
	MDB_val k = {strlen(name), (void *)name}, v;
	uint64_t x = 0;
	if (mdb_get(txn, dbi, &k, &v) == 0 && v.mv_size == 8)
		memcpy(&x, v.mv_data, 8);
	return x;
}

static int meta_put(MDB_txn *txn, MDB_dbi dbi, const char *name, uint64_t x)
{
	MDB_val k = {strlen(name), (void *)name}, v = {8, &x};
	return mdb_put(txn, dbi, &k, &v, 0);
}

static void lru_key(uint8_t out[8 + sizeof(kvs_objkey)], uint64_t stamp, const kvs_objkey *key)
{
	for (int i = 0; i < 8; i++)
		out[i] = (uint8_t)(stamp >> (56 - 8 * i)); /* big-endian: cursor order = age */
	memcpy(out + 8, key, sizeof(*key));
}

/* Removes an object and its stamps; returns the value bytes freed (0 if absent). */
static uint64_t del_object(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key)
{
	MDB_val k = {sizeof(*key), (void *)key}, v;
	uint64_t freed = 0;
	if (mdb_get(txn, l2->obj, &k, &v) == 0) {
		freed = v.mv_size;
		mdb_del(txn, l2->obj, &k, NULL);
	}
	if (mdb_get(txn, l2->atime, &k, &v) == 0 && v.mv_size == 8) {
		uint64_t stamp;
		memcpy(&stamp, v.mv_data, 8);
		uint8_t lk[8 + sizeof(kvs_objkey)];
		lru_key(lk, stamp, key);
		MDB_val lv = {sizeof(lk), lk};
		mdb_del(txn, l2->lru, &lv, NULL);
		mdb_del(txn, l2->atime, &k, NULL);
	}
	return freed;
}

static int stamp(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key)
{
	MDB_val k = {sizeof(*key), (void *)key}, v;
	uint8_t lk[8 + sizeof(kvs_objkey)];
	if (mdb_get(txn, l2->atime, &k, &v) == 0 && v.mv_size == 8) {
		uint64_t old;
		memcpy(&old, v.mv_data, 8);
		lru_key(lk, old, key);
		MDB_val lv = {sizeof(lk), lk};
		mdb_del(txn, l2->lru, &lv, NULL);
	}
	uint64_t now = ++l2->clock;
	lru_key(lk, now, key);
	MDB_val lv = {sizeof(lk), lk}, empty = {0, NULL};
	MDB_val sv = {8, &now};
	int rc = mdb_put(txn, l2->lru, &lv, &empty, 0);
	if (!rc)
		rc = mdb_put(txn, l2->atime, &k, &sv, 0);
	return rc;
}

/* Bytes of the map the databases occupy now (branch, leaf and overflow
 * pages; free pages not counted): what fills the map, whatever the objects'
 * byte count says (an object of 32 KiB + header takes 9 pages). */
static uint64_t used_bytes(kvs_l2 *l2, MDB_txn *txn)
{
	MDB_dbi dbs[4] = {l2->obj, l2->lru, l2->atime, l2->meta};
	uint64_t pages = 0;
	for (int i = 0; i < 4; i++) {
		MDB_stat st;
		if (mdb_stat(txn, dbs[i], &st) == 0)
			pages += st.ms_branch_pages + st.ms_leaf_pages + st.ms_overflow_pages;
	}
	return pages * l2->psize;
}

/* Map bytes one object of len data bytes takes (its overflow pages). */
static uint64_t obj_pages_bytes(const kvs_l2 *l2, uint64_t len)
{
	uint64_t need = HDR_BYTES + len + 16; /* node header */
	return (need + l2->psize - 1) / l2->psize * l2->psize;
}

/* Deletes least-recently-used objects until *bytes <= target and the pages
 * in use are at most page_target, or until they freed max_freed bytes; adds
 * their number to *evicted (counted by the caller once the transaction
 * commits). */
static int evict_to(kvs_l2 *l2, MDB_txn *txn, uint64_t *bytes, uint64_t *objects, uint64_t target,
		    uint64_t page_target, uint64_t max_freed, uint64_t *evicted)
{
	uint64_t start = *bytes;
	MDB_cursor *cur;
	int rc = mdb_cursor_open(txn, l2->lru, &cur);
	if (rc)
		return rc;
	uint64_t n = 0;
	MDB_val k, v;
	while ((*bytes > target || used_bytes(l2, txn) > page_target) && start - *bytes < max_freed &&
	       (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST)) == 0) {
		kvs_objkey key;
		if (k.mv_size != 8 + sizeof(key)) {
			mdb_cursor_del(cur, 0);
			continue;
		}
		memcpy(&key, (uint8_t *)k.mv_data + 8, sizeof(key));
		mdb_cursor_del(cur, 0);
		MDB_val ok = {sizeof(key), &key}, ov;
		if (mdb_get(txn, l2->obj, &ok, &ov) == 0) {
			*bytes -= ov.mv_size < *bytes ? ov.mv_size : *bytes;
			if (*objects)
				(*objects)--;
			mdb_del(txn, l2->obj, &ok, NULL);
			n++;
			if (l2->cfg.report_evictions && l2->n_evicted == l2->cap_evicted) {
				uint32_t cap = l2->cap_evicted ? 2 * l2->cap_evicted : 256;
				kvs_objkey *nk = realloc(l2->evicted, cap * sizeof(*nk));
				if (nk) {
					l2->evicted = nk;
					l2->cap_evicted = cap;
				}
			}
			if (l2->cfg.report_evictions && l2->n_evicted < l2->cap_evicted)
				l2->evicted[l2->n_evicted++] = key; /* reported once committed */
		}
		mdb_del(txn, l2->atime, &ok, NULL);
	}
	mdb_cursor_close(cur);
	*evicted += n;
	return rc == MDB_NOTFOUND ? 0 : rc;
}

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
static void find_map_base(kvs_l2 *l2, uint64_t mapsize)
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

static uint64_t round_pages(const kvs_l2 *l2, uint64_t x) { return (x + l2->psize - 1) / l2->psize * l2->psize; }

/* Capacity the watermarks work against for a map of this size. */
static void set_capacity(kvs_l2 *l2)
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
		find_map_base(l2, info.me_mapsize);
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
	set_capacity(l2);
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
static void disk_reserve(kvs_l2 *l2, uint64_t incoming)
{
	if (!l2->falloc || l2->broken)
		return;
	MDB_envinfo info;
	mdb_env_info(l2->env, &info);
	uint64_t next = ((uint64_t)info.me_last_pgno + 1) * l2->psize;
	uint64_t need = round_pages(l2, next + incoming + l2->slack), ahead = need + l2->slack;
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
static void disk_open(kvs_l2 *l2)
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
	disk_reserve(l2, 0);
}

/* ---- writer ------------------------------------------------------------------- */

/* Altstack for the fault handler on the writer and reader threads, so that
 * even a stack overflow inside L2 work is noted. */
static void *altstack_on(void)
{
	stack_t ss = {.ss_size = 64 << 10};
	ss.ss_sp = malloc(ss.ss_size);
	if (ss.ss_sp && sigaltstack(&ss, NULL) != 0) {
		free(ss.ss_sp);
		ss.ss_sp = NULL;
	}
	return ss.ss_sp;
}

static void altstack_off(void *sp)
{
	if (!sp)
		return;
	stack_t ss = {.ss_flags = SS_DISABLE};
	sigaltstack(&ss, NULL);
	free(sp);
}

/* One group commit: the batch's objects, pending stamps and drops, evicting
 * down to the watermarks or to evict_target (at most evict_max bytes).
 * Returns 0 or an LMDB error (nothing of the batch committed). */
static int write_batch(kvs_l2 *l2, l2_item *batch, uint32_t nb, const kvs_objkey *touches, uint32_t nt,
		       const l2_drop *drops, uint32_t nd, uint64_t evict_target, uint64_t evict_max)
{
	uint64_t incoming = 0, incoming_pages = 0, evicted = 0;
	uint32_t n_objects = 0;
	for (uint32_t i = 0; i < nb; i++)
		if (batch[i].op == KVS_L2_WRITE) {
			incoming += HDR_BYTES + batch[i].len;
			incoming_pages += obj_pages_bytes(l2, batch[i].len);
			n_objects++;
		}
	disk_reserve(l2, incoming_pages);
	if (l2->broken)
		return MDB_PANIC;
	MDB_txn *txn;
	l2->n_evicted = 0;
	int rc = mdb_txn_begin(l2->env, NULL, 0, &txn);
	if (rc)
		return rc;
	work_enter(l2, true);
	uint64_t bytes = meta_get(txn, l2->meta, "bytes");
	uint64_t objects = meta_get(txn, l2->meta, "objects");
	l2->clock = meta_get(txn, l2->meta, "clock");
	uint64_t size = l2->capacity;
	uint64_t high = size / 100 * HIGH_PCT;
	for (uint32_t i = 0; i < nd; i++) {
		/* only the value the reader found: a record rewritten since stays */
		MDB_val k = {sizeof(drops[i].key), (void *)&drops[i].key}, v;
		if (mdb_get(txn, l2->obj, &k, &v) != 0 || value_fp(&v) != drops[i].fp)
			continue;
		uint64_t f = del_object(l2, txn, &drops[i].key);
		if (f) {
			bytes -= f < bytes ? f : bytes;
			objects -= objects ? 1 : 0;
		}
	}
	/* stamps before eviction: an access recorded before this batch must
	 * keep its object from counting as least recently used */
	for (uint32_t i = 0; i < nt; i++) {
		MDB_val k = {sizeof(touches[i]), (void *)&touches[i]}, v;
		if (mdb_get(txn, l2->obj, &k, &v) == 0 && (rc = stamp(l2, txn, &touches[i])) != 0)
			goto abort;
	}
	/* watermarks over object bytes and over the pages actually in use: the
	 * page count is what runs the map full (issue 16: small objects whose
	 * pages cost 12 % more than their bytes wedged the map at 85 % bytes) */
	uint64_t used = used_bytes(l2, txn);
	if (bytes + incoming > high || used + incoming_pages > size / 100 * PAGES_HIGH_PCT || evict_target < bytes ||
	    evict_target < used) {
		uint64_t target = size / 100 * LOW_PCT, ptarget = size / 100 * PAGES_LOW_PCT;
		if (evict_target < target)
			target = evict_target;
		if (evict_target < ptarget)
			ptarget = evict_target;
		ptarget = ptarget > incoming_pages ? ptarget - incoming_pages : 0;
		target = target > incoming ? target - incoming : 0;
		if ((rc = evict_to(l2, txn, &bytes, &objects, target, ptarget, evict_max, &evicted)) != 0)
			goto abort;
	}
	for (uint32_t i = 0; i < nb; i++) {
		l2_item *it = &batch[i];
		if (it->op == KVS_L2_META) {
			uint8_t mk[2 + 64] = {'m', ':'};
			memcpy(mk + 2, it->owned, it->mkey);
			MDB_val k = {2 + it->mkey, mk}, v = {it->len, it->owned + it->mkey};
			if ((rc = mdb_put(txn, l2->meta, &k, &v, 0)) != 0)
				goto abort;
			continue;
		}
		uint64_t freed = del_object(l2, txn, &it->key); /* overwrite = replace */
		if (freed) {
			bytes -= freed < bytes ? freed : bytes;
			objects -= objects ? 1 : 0;
		}
		MDB_val k = {sizeof(it->key), &it->key}, v = {HDR_BYTES + it->len, NULL};
		if ((rc = mdb_put(txn, l2->obj, &k, &v, MDB_RESERVE)) != 0)
			goto abort;
		l2_hdr h = {.magic = {'K', 'V', 'L', '2'}, .version = FORMAT_VERSION, .geom = it->geom,
			    .len = it->len, .key = it->key};
		uint64_t seed = hdr_seed(&h, &it->key);
		/* copy in slices and hash what was just copied, while it is in cache */
		uint8_t *dst = (uint8_t *)v.mv_data + HDR_BYTES;
		const uint8_t *src = it->src;
		if (l2->map_base) {
			/* MDB_RESERVE gave space in the map; fill it with pwrite at the
			 * same file offset rather than memcpy into the mapping: the page
			 * cache is shared, so the map sees the bytes, and the kernel's
			 * write path avoids a page fault (read of a hole + mkwrite) per
			 * 4 KiB page, 2x faster here. The commit's msync flushes them
			 * before the meta page, as with memcpy. */
			h.checksum = XXH3_64bits_withSeed(src, it->len, seed);
			off_t foff = (off_t)(dst - l2->map_base);
			for (uint64_t done = 0; done < it->len;) {
				ssize_t w = pwrite(l2->fd, src + done, it->len - done, foff + (off_t)done);
				if (w <= 0) {
					/* the errno itself (ENOSPC: "No space left on
					 * device"), not a blanket EIO */
					rc = w < 0 ? errno : ENOSPC;
					if (rc == EINTR)
						continue;
					goto abort;
				}
				done += (uint64_t)w;
			}
		} else {
			XXH3_state_t *xs = XXH3_createState();
			if (!xs) {
				rc = ENOMEM;
				goto abort;
			}
			XXH3_64bits_reset_withSeed(xs, seed);
			for (uint64_t off = 0; off < it->len;) {
				uint64_t n = it->len - off < (256u << 10) ? it->len - off : (256u << 10);
				memcpy(dst + off, src + off, n);
				XXH3_64bits_update(xs, dst + off, n);
				off += n;
			}
			h.checksum = XXH3_64bits_digest(xs);
			XXH3_freeState(xs);
		}
		memcpy(v.mv_data, &h, HDR_BYTES);
		bytes += HDR_BYTES + it->len;
		objects++;
		if ((rc = stamp(l2, txn, &it->key)) != 0)
			goto abort;
	}
	if ((rc = meta_put(txn, l2->meta, "bytes", bytes)) || (rc = meta_put(txn, l2->meta, "objects", objects)) ||
	    (rc = meta_put(txn, l2->meta, "clock", l2->clock)))
		goto abort;
	if (n_objects) {
		int f = atomic_exchange(&l2->inject, KVS_L2_INJECT_NONE);
		if (f == KVS_L2_INJECT_KILL)
			raise(SIGKILL);
		else if (f == KVS_L2_INJECT_SEGV)
			raise(SIGSEGV);
	}
	rc = mdb_txn_commit(txn);
	work_leave(l2, true, rc == 0);
	if (rc)
		return rc;
	pthread_mutex_lock(&l2->mu);
	l2->st.bytes = bytes;
	l2->st.objects = objects;
	l2->st.evictions += evicted;
	/* report the evictions now that they are durable */
	for (uint32_t i = 0; i < l2->n_evicted; i++) {
		l2_item *it = calloc(1, sizeof(*it));
		if (!it)
			break;
		it->op = KVS_L2_EVICTED;
		it->key = l2->evicted[i];
		list_push(&l2->done, it);
	}
	pthread_mutex_unlock(&l2->mu);
	if (l2->n_evicted)
		signal_owner(l2);
	l2->n_evicted = 0;
	return 0;
abort:
	mdb_txn_abort(txn);
	work_leave(l2, true, false);
	return rc;
}

/* MDB_MAP_FULL although the watermarks left room: the free pages are too
 * scattered for the batch (an object takes contiguous pages), or a full disk
 * capped the map. Evicts least-recently-used objects until twice the
 * batch's pages, and at least 1/32 of the capacity, are free — in small
 * transactions: the list of pages a transaction frees is itself an LMDB
 * record that needs contiguous pages, so one big eviction can fail where
 * small ones commit (issue 16: "evict to half" in one transaction wedged a
 * fragmented 256 MiB map for good). A step that fails is halved, one that
 * commits doubled (up to 32 MiB). Then one empty commit, because LMDB hands
 * out the pages a commit freed only from the second commit after it. */
static void evict_for(kvs_l2 *l2, uint64_t incoming_pages)
{
	uint64_t want = 2 * incoming_pages > l2->capacity / 32 ? 2 * incoming_pages : l2->capacity / 32;
	uint64_t step = 2ull << 20, freed = 0;
	while (freed < want) {
		pthread_mutex_lock(&l2->mu);
		uint64_t before = l2->st.bytes;
		pthread_mutex_unlock(&l2->mu);
		int rc = write_batch(l2, NULL, 0, NULL, 0, NULL, 0, 0, step);
		if (rc == MDB_MAP_FULL && step > l2->psize) {
			step /= 2;
			continue;
		}
		pthread_mutex_lock(&l2->mu);
		uint64_t after = l2->st.bytes;
		pthread_mutex_unlock(&l2->mu);
		if (rc || after >= before)
			break; /* nothing more to evict, or not even one object can go */
		freed += before - after;
		if (step < (32ull << 20))
			step *= 2;
	}
	write_batch(l2, NULL, 0, NULL, 0, NULL, 0, UINT64_MAX, UINT64_MAX);
}

static void *writer_main(void *arg)
{
	kvs_l2 *l2 = arg;
	void *alt = altstack_on();
	tl_l2_thread = true; /* a fault anywhere on this thread is noted */
	tl_state_fd = l2->state_fd;
	l2_item *batch = calloc(l2->cfg.batch_max, sizeof(*batch));
	l2_item **orig = calloc(l2->cfg.batch_max, sizeof(*orig));
	kvs_objkey *touches = calloc(MAX_TOUCHES, sizeof(*touches));
	l2_drop *drops = calloc(MAX_TOUCHES, sizeof(*drops));
	if (!batch || !orig || !touches || !drops) {
		kvs_err("writer cannot start: out of memory");
		free(batch);
		free(orig);
		free(touches);
		free(drops);
		altstack_off(alt);
		return NULL;
	}
	pthread_mutex_lock(&l2->mu);
	for (;;) {
		while (!l2->wq.n && !l2->n_touches && !l2->n_drops && !l2->stop)
			pthread_cond_wait(&l2->wcv, &l2->mu);
		if (l2->stop && !l2->wq.n && !l2->n_touches && !l2->n_drops)
			break;
		/* group commit: wait briefly for the batch to fill */
		if (l2->wq.n < l2->cfg.batch_max && l2->wq.bytes < l2->cfg.batch_bytes && !l2->stop &&
		    l2->cfg.batch_ms) {
			struct timespec ts;
			clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_sec += l2->cfg.batch_ms / 1000; /* tv_nsec must stay below 1 s */
			ts.tv_nsec += (long)(l2->cfg.batch_ms % 1000) * 1000000L;
			if (ts.tv_nsec >= 1000000000L) {
				ts.tv_sec++;
				ts.tv_nsec -= 1000000000L;
			}
			pthread_cond_timedwait(&l2->wcv, &l2->mu, &ts);
		}
		/* the batch stays small against the capacity (see kvs_l2_open),
		 * which a full disk may have lowered */
		uint64_t bmax = l2->cfg.batch_bytes < l2->capacity / 32 ? l2->cfg.batch_bytes : l2->capacity / 32;
		uint32_t nb = 0;
		uint64_t bb = 0;
		while (nb < l2->cfg.batch_max && l2->wq.head && (nb == 0 || bb + l2->wq.head->len <= bmax)) {
			l2_item *it = list_pop(&l2->wq);
			orig[nb] = it;
			batch[nb++] = *it;
			bb += it->len;
		}
		uint32_t nt = l2->n_touches, nd = l2->n_drops;
		memcpy(touches, l2->touches, nt * sizeof(*touches));
		memcpy(drops, l2->drops, nd * sizeof(*drops));
		l2->n_touches = l2->n_drops = 0;
		l2->st.queue_depth = l2->wq.n;
		l2->st.queue_bytes = l2->wq.bytes;
		pthread_mutex_unlock(&l2->mu);

		int rc = write_batch(l2, batch, nb, touches, nt, drops, nd, UINT64_MAX, UINT64_MAX);
		if (rc == MDB_MAP_FULL) {
			pthread_mutex_lock(&l2->mu);
			l2->st.map_full_retries++;
			pthread_mutex_unlock(&l2->mu);
			uint64_t pages = 0;
			for (uint32_t i = 0; i < nb; i++)
				if (batch[i].op == KVS_L2_WRITE)
					pages += obj_pages_bytes(l2, batch[i].len);
			evict_for(l2, pages);
			rc = write_batch(l2, batch, nb, touches, nt, drops, nd, UINT64_MAX, UINT64_MAX);
		}
		if (rc == MDB_MAP_FULL && l2->map_now < l2->map_full)
			rc = ENOSPC; /* the map is what the full disk holds: say so */
		if (rc) {
			note_lmdb_error(l2, rc, "group commit");
			kvs_warn_rl(&l2->rl_commit, "L2 %s: group commit of %u objects failed: %s", l2->path, nb,
				    mdb_strerror(rc));
		}

		pthread_mutex_lock(&l2->mu);
		l2->st.write_batches++;
		for (uint32_t i = 0; i < nb; i++) {
			if (orig[i]->op == KVS_L2_META) {
				free(orig[i]->owned);
				free(orig[i]);
				continue;
			}
			if (rc)
				l2->st.write_errors++;
			else
				l2->st.writes++, l2->st.writes_committed++;
			complete(l2, orig[i], rc ? KVS_E_NOSPACE : 0);
		}
		if (nb)
			signal_owner(l2);
	}
	pthread_mutex_unlock(&l2->mu);
	free(batch);
	free(orig);
	free(touches);
	free(drops);
	altstack_off(alt);
	return NULL;
}

/* ---- reader ------------------------------------------------------------------- */

/* A read transaction on a thread other than the writer: holds the map lock
 * (no resize meanwhile) and marks L2 work for the fault handler. */
static int rtxn_begin(kvs_l2 *l2, MDB_txn **txn)
{
	pthread_rwlock_rdlock(&l2->maplock);
	int rc = l2->broken ? MDB_PANIC : mdb_txn_begin(l2->env, NULL, MDB_RDONLY, txn);
	if (rc) {
		pthread_rwlock_unlock(&l2->maplock);
		return rc;
	}
	work_enter(l2, false);
	return 0;
}

static void rtxn_end(kvs_l2 *l2, MDB_txn *txn)
{
	mdb_txn_abort(txn);
	work_leave(l2, false, false);
	pthread_rwlock_unlock(&l2->maplock);
}

static int read_one(kvs_l2 *l2, MDB_txn *txn, l2_item *it)
{
	MDB_val k = {sizeof(it->key), &it->key}, v;
	int rc = mdb_get(txn, l2->obj, &k, &v);
	if (rc) {
		if (rc != MDB_NOTFOUND)
			note_lmdb_error(l2, rc, "read");
		return KVS_E_MISS;
	}
	l2_hdr h;
	int c = check_hdr(&v, &it->key, it->geom, &h);
	if (c == HDR_BAD || c == HDR_KEY) {
		drop_found(l2, &it->key, &v, c);
		return KVS_E_MISS;
	}
	if (c == HDR_GEOM || h.len != it->len) {
		pthread_mutex_lock(&l2->mu);
		l2->st.header_mismatches++;
		pthread_mutex_unlock(&l2->mu);
		return KVS_E_MISS;
	}
	const uint8_t *src = (const uint8_t *)v.mv_data + HDR_BYTES;
	uint8_t *dst = it->dst;
	XXH3_state_t *xs = XXH3_createState();
	if (!xs)
		return KVS_E_INTERNAL;
	XXH3_64bits_reset_withSeed(xs, hdr_seed(&h, &it->key));
	for (uint64_t off = 0; off < h.len;) {
		uint64_t n = h.len - off < (256u << 10) ? h.len - off : (256u << 10);
		memcpy(dst + off, src + off, n);
		XXH3_64bits_update(xs, dst + off, n);
		off += n;
	}
	uint64_t sum = XXH3_64bits_digest(xs);
	XXH3_freeState(xs);
	if (sum != h.checksum) {
		drop_found(l2, &it->key, &v, HDR_OK);
		return KVS_E_MISS;
	}
	return 0;
}

static void *reader_main(void *arg)
{
	kvs_l2 *l2 = arg;
	void *alt = altstack_on();
	tl_l2_thread = true;
	tl_state_fd = l2->state_fd;
	pthread_mutex_lock(&l2->mu);
	for (;;) {
		while (!l2->rq.n && !l2->stop)
			pthread_cond_wait(&l2->rcv, &l2->mu);
		if (!l2->rq.n)
			break;
		l2_item *it = list_pop(&l2->rq);
		pthread_mutex_unlock(&l2->mu);
		MDB_txn *txn;
		int r = rtxn_begin(l2, &txn);
		if (r == 0) {
			r = read_one(l2, txn, it);
			rtxn_end(l2, txn);
		} else {
			r = KVS_E_MISS;
		}
		pthread_mutex_lock(&l2->mu);
		l2->st.reads++;
		if (r)
			l2->st.read_misses++;
		complete(l2, it, r);
		signal_owner(l2);
	}
	pthread_mutex_unlock(&l2->mu);
	altstack_off(alt);
	return NULL;
}

/* ---- open and close ------------------------------------------------------------- */

/* Reads the environment's structure without writing: the four databases
 * exist (or none, in a new environment) and the first and last entries of
 * each can be reached. LMDB asserts and aborts when a *write* meets some
 * damaged pages, so this runs before the first write transaction. */
static int env_check(kvs_l2 *l2)
{
	static const char *names[4] = {"obj", "lru", "atime", "meta"};
	MDB_txn *txn;
	int rc = mdb_txn_begin(l2->env, NULL, MDB_RDONLY, &txn);
	if (rc)
		return rc;
	MDB_dbi main;
	MDB_stat ms;
	if ((rc = mdb_dbi_open(txn, NULL, 0, &main)) || (rc = mdb_stat(txn, main, &ms)))
		goto out;
	int found = 0;
	for (int i = 0; i < 4 && !rc; i++) {
		MDB_dbi d;
		MDB_cursor *cur;
		MDB_val k, v;
		int r = mdb_dbi_open(txn, names[i], 0, &d);
		if (r == MDB_NOTFOUND)
			continue;
		if (r || (r = mdb_cursor_open(txn, d, &cur))) {
			rc = r;
			break;
		}
		found++;
		if ((r = mdb_cursor_get(cur, &k, &v, MDB_FIRST)) == 0)
			r = mdb_cursor_get(cur, &k, &v, MDB_LAST);
		mdb_cursor_close(cur);
		if (r && r != MDB_NOTFOUND)
			rc = r;
	}
	/* the four are created together: some missing, or none in a main
	 * database that has entries, is not an environment of ours intact */
	if (!rc && found != 4 && (found || ms.ms_entries))
		rc = MDB_CORRUPTED;
out:
	mdb_txn_abort(txn);
	return rc;
}

/* Creates the environment handle, opens data.mdb, checks it and opens the
 * databases; on failure nothing stays open. */
static int env_open(kvs_l2 *l2)
{
	int rc;
	if ((rc = mdb_env_create(&l2->env)) != 0)
		return rc;
	mdb_env_set_maxdbs(l2->env, 4);
	mdb_env_set_maxreaders(l2->env, 64);
	if ((rc = mdb_env_set_mapsize(l2->env, l2->map_full)) != 0)
		goto fail;
	/* WRITEMAP: MDB_RESERVE hands out space straight in the map, so an
	 * object is copied once, from L1 into the page cache */
	unsigned flags = MDB_NOTLS | MDB_NORDAHEAD | MDB_WRITEMAP;
	if (l2->cfg.sync == KVS_L2_SYNC_NOMETA)
		flags |= MDB_NOMETASYNC;
	else if (l2->cfg.sync == KVS_L2_SYNC_NONE)
		flags |= MDB_NOSYNC;
	work_enter(l2, false); /* a fault from here on is noted */
	if ((rc = mdb_env_open(l2->env, l2->path, flags, 0600)) != 0)
		goto fail;
	MDB_stat est;
	mdb_env_stat(l2->env, &est);
	l2->psize = est.ms_psize ? est.ms_psize : 4096;
	int dead = 0;
	mdb_reader_check(l2->env, &dead); /* slots of a killed earlier process */
	if ((rc = env_check(l2)) != 0)
		goto fail;
	MDB_txn *txn;
	if ((rc = mdb_txn_begin(l2->env, NULL, 0, &txn)) != 0)
		goto fail;
	work_enter(l2, true);
	if ((rc = mdb_dbi_open(txn, "obj", MDB_CREATE, &l2->obj)) ||
	    (rc = mdb_dbi_open(txn, "lru", MDB_CREATE, &l2->lru)) ||
	    (rc = mdb_dbi_open(txn, "atime", MDB_CREATE, &l2->atime)) ||
	    (rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &l2->meta))) {
		mdb_txn_abort(txn);
		work_leave(l2, true, false);
		goto fail;
	}
	l2->st.bytes = meta_get(txn, l2->meta, "bytes");
	l2->st.objects = meta_get(txn, l2->meta, "objects");
	l2->clock = meta_get(txn, l2->meta, "clock");
	rc = mdb_txn_commit(txn);
	/* not a commit of the run's work: the strikes stay until the writer's */
	work_leave(l2, true, false);
	if (rc)
		goto fail;
	work_leave(l2, false, false);
	return 0;
fail:
	work_leave(l2, false, false);
	mdb_env_close(l2->env);
	l2->env = NULL;
	return rc;
}

int kvs_l2_open(const kvs_l2_config *cfg, kvs_l2 **ret)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	pthread_once(&once, install_fatal);
	int rc;
	kvs_l2 *l2 = calloc(1, sizeof(*l2));
	if (!l2)
		return -ENOMEM;
	l2->cfg = *cfg;
	l2->ready.done = l2_ready;
	l2->state_fd = -1;
	l2->fd = -1;
	if (!l2->cfg.batch_max)
		l2->cfg.batch_max = 256;
	if (!l2->cfg.queue_max)
		l2->cfg.queue_max = 4096;
	snprintf(l2->path, sizeof(l2->path), "%s", cfg->path);
	pthread_mutex_init(&l2->mu, NULL);
	pthread_mutex_init(&l2->state_mu, NULL);
	pthread_cond_init(&l2->wcv, NULL);
	pthread_cond_init(&l2->rcv, NULL);
	pthread_rwlockattr_t ra;
	pthread_rwlockattr_init(&ra);
	/* a resize must not wait behind a stream of reads */
	pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
	pthread_rwlock_init(&l2->maplock, &ra);
	pthread_rwlockattr_destroy(&ra);
	l2->rl_commit.interval_ms = l2->rl_disk.interval_ms = KVS_RATELIMIT_MS;
	l2->rl_bad.interval_ms = l2->rl_corrupt.interval_ms = KVS_RATELIMIT_MS;
	l2->map_full = cfg->size + cfg->size / 100 * RESERVE_PCT;
	l2->touches = calloc(MAX_TOUCHES, sizeof(*l2->touches));
	l2->drops = calloc(MAX_TOUCHES, sizeof(*l2->drops));
	if (!l2->touches || !l2->drops) {
		rc = -ENOMEM;
		goto err_free;
	}
	struct stat sb;
	if (mkdir(cfg->path, 0700) < 0 && errno != EEXIST) {
		rc = -errno;
		kvs_err("cannot create %s: %s", cfg->path, strerror(errno));
		goto err_free;
	}
	rc = stat(cfg->path, &sb) < 0 ? -errno : !S_ISDIR(sb.st_mode) ? -ENOTDIR : 0;
	if (rc) {
		kvs_err("cannot open L2 at %s: %s", cfg->path, strerror(-rc));
		goto err_free;
	}
	/* a corrupt environment never crash-loops: set it aside when the last
	 * run(s) died in L2 work, or when it fails to open as damaged */
	const char *why = NULL;
	char whybuf[200];
	state_open(l2, &why, whybuf, sizeof(whybuf));
	if (why && (rc = set_aside(l2, why)) != 0)
		goto err_free;
	rc = env_open(l2);
	if (rc && corrupt_err(rc) && !l2->st.corrupt_recoveries) {
		snprintf(whybuf, sizeof(whybuf), "opening it failed: %s", mdb_strerror(rc));
		if ((rc = set_aside(l2, whybuf)) != 0)
			goto err_free;
		rc = env_open(l2);
	}
	if (rc)
		goto err_lmdb;
	MDB_envinfo info;
	mdb_env_info(l2->env, &info);
	/* an existing environment may be larger: its capacity is its map less
	 * the reserve */
	if (info.me_mapsize > l2->map_full + l2->psize) {
		l2->cfg.size = info.me_mapsize - info.me_mapsize * RESERVE_PCT / (100 + RESERVE_PCT);
		l2->map_full = info.me_mapsize;
	}
	l2->map_now = info.me_mapsize;
	set_capacity(l2);
	/* blocks allocated ahead of LMDB's next page: a fraction of the size,
	 * more than the B-tree pages an evicting transaction touches */
	l2->slack = round_pages(l2, l2->cfg.size / 64 < (1u << 20) ? (1u << 20)
				    : l2->cfg.size / 64 > (1ull << 30) ? (1ull << 30) : l2->cfg.size / 64);
	if (mdb_env_get_fd(l2->env, &l2->fd) == 0) {
		find_map_base(l2, info.me_mapsize);
		disk_open(l2);
	}
	/* A commit needs free pages for its batch beside those of the last
	 * snapshot and those the previous commit freed (LMDB reuses freed pages
	 * only two transactions later), so a batch must stay small against the
	 * map, or it fails with MDB_MAP_FULL however much is evicted. */
	if (l2->cfg.batch_bytes > l2->cfg.size / 32)
		l2->cfg.batch_bytes = l2->cfg.size / 32;
	if ((rc = pthread_create(&l2->writer, NULL, writer_main, l2)) != 0) {
		rc = -rc;
		goto err_env;
	}
	l2->writer_started = true;
	if ((rc = pthread_create(&l2->reader, NULL, reader_main, l2)) != 0) {
		rc = -rc;
		kvs_l2_close(l2);
		return rc;
	}
	l2->reader_started = true;
	kvs_info("L2 %s: %llu objects, %llu MiB of %llu MiB, sync %s", cfg->path,
		 (unsigned long long)l2->st.objects, (unsigned long long)(l2->st.bytes >> 20),
		 (unsigned long long)(l2->capacity >> 20),
		 cfg->sync == KVS_L2_SYNC_FULL ? "full" : cfg->sync == KVS_L2_SYNC_NOMETA ? "nometa" : "none");
	*ret = l2;
	return 0;

err_env:
	mdb_env_close(l2->env);
	goto err_state;
err_lmdb:
	kvs_err("cannot open L2 at %s: %s", cfg->path, mdb_strerror(rc));
	rc = lmdb_err(rc);
err_state:
	state_close(l2);
err_free:
	if (l2->state_fd >= 0)
		close(l2->state_fd);
	free(l2->touches);
	free(l2->drops);
	pthread_rwlock_destroy(&l2->maplock);
	pthread_cond_destroy(&l2->wcv);
	pthread_cond_destroy(&l2->rcv);
	pthread_mutex_destroy(&l2->state_mu);
	pthread_mutex_destroy(&l2->mu);
	free(l2);
	return rc;
}

void kvs_l2_close(kvs_l2 *l2)
{
	if (!l2)
		return;
	pthread_mutex_lock(&l2->mu);
	l2->stop = true;
	pthread_cond_broadcast(&l2->wcv);
	pthread_cond_broadcast(&l2->rcv);
	pthread_mutex_unlock(&l2->mu);
	if (l2->writer_started)
		pthread_join(l2->writer, NULL);
	if (l2->reader_started)
		pthread_join(l2->reader, NULL);
	l2_item *it;
	while ((it = list_pop(&l2->done)) != NULL)
		free(it);
	mdb_env_close(l2->env);
	state_close(l2);
	free(l2->touches);
	free(l2->evicted);
	free(l2->drops);
	pthread_rwlock_destroy(&l2->maplock);
	pthread_cond_destroy(&l2->wcv);
	pthread_cond_destroy(&l2->rcv);
	pthread_mutex_destroy(&l2->state_mu);
	pthread_mutex_destroy(&l2->mu);
	free(l2);
}

/* ---- owner API ----------------------------------------------------------------- */

int kvs_l2_contains(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, uint64_t *ret_len)
{
	MDB_txn *txn;
	if (rtxn_begin(l2, &txn) != 0)
		return KVS_E_MISS;
	MDB_val k = {sizeof(*key), (void *)key}, v;
	l2_hdr h;
	int r = KVS_E_MISS;
	int rc = mdb_get(txn, l2->obj, &k, &v);
	if (rc == 0) {
		int c = check_hdr(&v, key, geom, &h);
		if (c == HDR_OK) {
			if (ret_len)
				*ret_len = h.len;
			r = 0;
		} else if (c == HDR_GEOM) {
			pthread_mutex_lock(&l2->mu);
			l2->st.header_mismatches++;
			pthread_mutex_unlock(&l2->mu);
			r = KVS_E_GEOMETRY;
		} else {
			drop_found(l2, key, &v, c);
		}
	} else if (rc != MDB_NOTFOUND) {
		note_lmdb_error(l2, rc, "presence check");
	}
	rtxn_end(l2, txn);
	return r;
}

int kvs_l2_write(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		 void *cookie)
{
	return kvs_l2_write_in(l2, key, geom, data, len, cookie, 0, 0);
}

int kvs_l2_write_in(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		    void *cookie, uint64_t group, uint32_t idx)
{
	l2_item *it = calloc(1, sizeof(*it));
	if (!it)
		return -ENOMEM;
	*it = (l2_item){.op = KVS_L2_WRITE, .key = *key, .geom = geom, .src = data, .len = len,
			.cookie = cookie, .group = group, .idx = idx};
	pthread_mutex_lock(&l2->mu);
	bool dropped = false;
	/* the disk cannot keep up: drop the oldest pending writes (their
	 * group's tail first), never block */
	l2_item *prev, *old;
	while ((l2->wq.n >= l2->cfg.queue_max || l2->wq.bytes + len > l2->cfg.queue_max_bytes) &&
	       (old = drop_victim(&l2->wq, &prev)) != NULL) {
		list_unlink(&l2->wq, prev, old);
		l2->st.write_drops++;
		complete(l2, old, KVS_E_NOSPACE);
		dropped = true;
	}
	list_push(&l2->wq, it);
	l2->st.queue_depth = l2->wq.n;
	l2->st.queue_bytes = l2->wq.bytes;
	pthread_cond_signal(&l2->wcv);
	if (dropped)
		signal_owner(l2);
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

uint32_t kvs_l2_shed(kvs_l2 *l2, uint64_t bytes, void **cookies, uint32_t cap)
{
	uint32_t n = 0;
	uint64_t freed = 0;
	pthread_mutex_lock(&l2->mu);
	l2_item *prev, *old;
	while (freed < bytes && n < cap && (old = drop_victim(&l2->wq, &prev)) != NULL) {
		list_unlink(&l2->wq, prev, old);
		l2->st.write_drops++;
		freed += old->len;
		cookies[n++] = old->cookie;
		free(old);
	}
	l2->st.queue_depth = l2->wq.n;
	l2->st.queue_bytes = l2->wq.bytes;
	pthread_mutex_unlock(&l2->mu);
	return n;
}

int kvs_l2_read(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, void *dst, uint64_t len, void *cookie)
{
	l2_item *it = calloc(1, sizeof(*it));
	if (!it)
		return -ENOMEM;
	*it = (l2_item){.op = KVS_L2_READ, .key = *key, .geom = geom, .dst = dst, .len = len, .cookie = cookie};
	pthread_mutex_lock(&l2->mu);
	list_push(&l2->rq, it);
	pthread_cond_signal(&l2->rcv);
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

int kvs_l2_put_meta(kvs_l2 *l2, const void *key, uint32_t klen, const void *val, uint32_t vlen)
{
	if (klen > 64 || vlen > 4096)
		return -EINVAL;
	l2_item *it = calloc(1, sizeof(*it));
	uint8_t *buf = malloc(klen + vlen + 1);
	if (!it || !buf) {
		free(it);
		free(buf);
		return -ENOMEM;
	}
	memcpy(buf, key, klen);
	memcpy(buf + klen, val, vlen);
	*it = (l2_item){.op = KVS_L2_META, .owned = buf, .mkey = klen, .len = vlen};
	pthread_mutex_lock(&l2->mu);
	list_push(&l2->wq, it);
	pthread_cond_signal(&l2->wcv);
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

int kvs_l2_get_meta(kvs_l2 *l2, const void *key, uint32_t klen, void *buf, uint32_t cap, uint32_t *ret_len)
{
	if (klen > 64)
		return -EINVAL;
	uint8_t mk[2 + 64] = {'m', ':'};
	memcpy(mk + 2, key, klen);
	MDB_txn *txn;
	if (rtxn_begin(l2, &txn) != 0)
		return KVS_E_MISS;
	MDB_val k = {2 + klen, mk}, v;
	int r = KVS_E_MISS;
	if (mdb_get(txn, l2->meta, &k, &v) == 0) {
		uint32_t n = v.mv_size < cap ? (uint32_t)v.mv_size : cap;
		memcpy(buf, v.mv_data, n);
		*ret_len = (uint32_t)v.mv_size;
		r = 0;
	}
	rtxn_end(l2, txn);
	return r;
}

void kvs_l2_touch(kvs_l2 *l2, const kvs_objkey *key)
{
	pthread_mutex_lock(&l2->mu);
	if (l2->n_touches < MAX_TOUCHES)
		l2->touches[l2->n_touches++] = *key; /* beyond that, stamps are lost: LRU is approximate */
	pthread_mutex_unlock(&l2->mu);
}

uint32_t kvs_l2_reap(kvs_l2 *l2, kvs_l2_done *out, uint32_t cap)
{
	uint32_t n = 0;
	pthread_mutex_lock(&l2->mu);
	while (n < cap && l2->done.head) {
		l2_item *it = list_pop(&l2->done);
		out[n++] = (kvs_l2_done){.op = it->op, .key = it->key, .result = it->result, .cookie = it->cookie};
		free(it);
	}
	pthread_mutex_unlock(&l2->mu);
	return n;
}

int kvs_l2_clear(kvs_l2 *l2)
{
	MDB_txn *txn;
	/* a write transaction off the writer thread: it holds the map lock
	 * like a read, so that no resize happens under it */
	pthread_rwlock_rdlock(&l2->maplock);
	int rc = l2->broken ? MDB_PANIC : mdb_txn_begin(l2->env, NULL, 0, &txn);
	if (rc) {
		pthread_rwlock_unlock(&l2->maplock);
		return lmdb_err(rc);
	}
	work_enter(l2, true);
	if ((rc = mdb_drop(txn, l2->obj, 0)) || (rc = mdb_drop(txn, l2->lru, 0)) ||
	    (rc = mdb_drop(txn, l2->atime, 0)) || (rc = meta_put(txn, l2->meta, "bytes", 0)) ||
	    (rc = meta_put(txn, l2->meta, "objects", 0)))
		mdb_txn_abort(txn);
	else
		rc = mdb_txn_commit(txn);
	work_leave(l2, true, rc == 0);
	pthread_rwlock_unlock(&l2->maplock);
	if (rc) {
		note_lmdb_error(l2, rc, "clear");
		return lmdb_err(rc);
	}
	pthread_mutex_lock(&l2->mu);
	l2->st.bytes = l2->st.objects = 0;
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

void kvs_l2_get_stats(kvs_l2 *l2, kvs_l2_stats *st)
{
	pthread_mutex_lock(&l2->mu);
	*st = l2->st;
	st->queue_depth = l2->wq.n;
	st->queue_bytes = l2->wq.bytes;
	pthread_mutex_unlock(&l2->mu);
}

const char *kvs_l2_path(const kvs_l2 *l2) { return l2->path; }

void kvs__l2_inject(kvs_l2 *l2, int what) { atomic_store(&l2->inject, what); }
