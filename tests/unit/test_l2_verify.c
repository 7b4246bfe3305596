/* Unit tests for the structural check of data.mdb (storage/kvs_l2_verify.c,
 * issue 33 #1): real L2 files written by kvs_l2 (objects inline and on
 * overflow pages, evictions, a clear, a free list) pass it at every reopen;
 * each kind of damage it claims to find is made by hand in a copy and found,
 * named, and set aside by kvs_l2_open; a damaged overflow-run header (which
 * it does not read) is caught by the writer before LMDB frees by it; and
 * random damage (seeded) never lets
 * a kvs_l2 session that reads, writes and evicts die of a signal in a forked
 * child — with the check on. The same sessions with the check off are the
 * control: how many of them die is printed (main before the check). */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_error.h"
#include "kvs_l2.h"
#include "kvs_l2_verify.h"

#define GEOM 0x77aa55cc33ee1100ull
#define MIB (1ull << 20)
#define WAIT_MS 5000 /* a session that waits longer has wedged */
#define PSZ 4096u /* LMDB's page size on this machine (checked from the meta page) */

static char g_base[64];
static pid_t g_parent;

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(p);
}

static void rm_base(void)
{
	if (getpid() == g_parent && g_base[0])
		nftw(g_base, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

typedef struct fx {
	char dir[128];
	int efd;
	kvs_l2_config cfg;
	kvs_l2 *l2;
} fx;

static void fx_init(fx *f, uint64_t size, const char *dir)
{
	memset(f, 0, sizeof(*f));
	if (dir) {
		snprintf(f->dir, sizeof(f->dir), "%s", dir);
	} else {
		snprintf(f->dir, sizeof(f->dir), "%s/t-XXXXXX", g_base);
		ck_assert_ptr_nonnull(mkdtemp(f->dir));
	}
	f->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	ck_assert_int_ge(f->efd, 0);
	kvs_l2_config_defaults(&f->cfg);
	f->cfg.path = f->dir;
	f->cfg.size = size;
	f->cfg.sync = KVS_L2_SYNC_NONE;
	f->cfg.efd = f->efd;
}

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Reaps want completions (any op); returns how many writes failed. Usable in
 * a forked child (no ck_assert: returns -1 on a time-out). */
static int reap(fx *f, uint32_t want)
{
	kvs_l2_done d[64];
	uint32_t got = 0;
	int failed = 0;
	int64_t deadline = now_ms() + WAIT_MS;
	while (got < want) {
		uint32_t n = kvs_l2_reap(f->l2, d, want - got < 64 ? want - got : 64);
		for (uint32_t i = 0; i < n; i++)
			failed += d[i].result != 0;
		got += n;
		if (got == want)
			break;
		int64_t left = deadline - now_ms();
		if (left <= 0)
			return -1;
		struct pollfd p = {.fd = f->efd, .events = POLLIN};
		if (poll(&p, 1, (int)left) > 0) {
			uint64_t v;
			ssize_t r = read(f->efd, &v, sizeof(v));
			(void)r;
		}
	}
	return failed;
}

static kvs_objkey mkkey(uint32_t id)
{
	kvs_objkey k;
	memset(&k, 0, sizeof(k));
	memcpy(k.chunk, &id, sizeof(id));
	k.chunk[31] = 0x5a;
	memset(k.ns, 0x33, sizeof(k.ns));
	k.world = 2;
	k.rank = 1;
	return k;
}

/* Sizes that give inline records, one-page and many-page overflow runs. */
static uint64_t obj_len(uint32_t id)
{
	static const uint64_t lens[] = {100, 1500, 3000, 9000, 40000, 300000};
	return lens[id % 6];
}

static void fill(uint8_t *p, uint64_t len, uint64_t seed)
{
	uint64_t x = (seed + 1) * 0xd1342543de82ef95ull;
	for (uint64_t i = 0; i < len; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		p[i] = (uint8_t)x;
	}
}

/* Writes objects [first, first + n), 16 in flight (the L2 reads each from
 * its buffer until it completes); returns the failed writes, or -1 (a
 * time-out or a queueing failure). */
static int write_objects(fx *f, uint32_t first, uint32_t n)
{
	enum { BATCH = 16 };
	static uint8_t buf[BATCH][300000];
	int failed = 0;
	for (uint32_t i = first; i < first + n; i += BATCH) {
		uint32_t b = first + n - i < BATCH ? first + n - i : BATCH;
		for (uint32_t j = 0; j < b; j++) {
			fill(buf[j], obj_len(i + j), i + j);
			kvs_objkey k = mkkey(i + j);
			if (kvs_l2_write(f->l2, &k, GEOM, buf[j], obj_len(i + j), NULL) != 0)
				return -1;
		}
		int r = reap(f, b);
		if (r < 0)
			return -1;
		failed += r;
	}
	return failed;
}

/* Reads back every object of [first, first + n) that L2 holds; returns the
 * wrong ones (a served object whose bytes differ), or -1. */
static int read_objects(fx *f, uint32_t first, uint32_t n, uint32_t *ret_hits)
{
	static uint8_t buf[300000], want[300000];
	int wrong = 0;
	*ret_hits = 0;
	for (uint32_t i = first; i < first + n; i++) {
		kvs_objkey k = mkkey(i);
		uint64_t len = 0;
		if (kvs_l2_contains(f->l2, &k, GEOM, &len) != 0)
			continue;
		if (len != obj_len(i))
			return -1;
		memset(buf, 0xee, len);
		if (kvs_l2_read(f->l2, &k, GEOM, buf, len, NULL) != 0)
			return -1;
		kvs_l2_done d;
		int64_t deadline = now_ms() + WAIT_MS;
		while (kvs_l2_reap(f->l2, &d, 1) == 0) {
			if (now_ms() > deadline)
				return -1;
			struct pollfd p = {.fd = f->efd, .events = POLLIN};
			if (poll(&p, 1, 100) > 0) {
				uint64_t v;
				ssize_t r = read(f->efd, &v, sizeof(v));
				(void)r;
			}
		}
		if (d.op != KVS_L2_READ)
			return -1;
		if (d.result != 0)
			continue;
		fill(want, len, i);
		wrong += memcmp(buf, want, len) != 0;
		(*ret_hits)++;
	}
	return wrong;
}

static void path_of(char *p, size_t cap, const char *dir) { snprintf(p, cap, "%s/data.mdb", dir); }

static int verify_dir(const char *dir, kvs_l2_verify_report *rep, char *why, size_t cap)
{
	char p[200];
	path_of(p, sizeof(p), dir);
	return kvs_l2_verify(p, rep, why, cap);
}

/* ---- healthy files ---------------------------------------------------------- */

/* Five rounds of 250 objects (avg. 59 KB) that overflow a 24 MiB L2 (evictions, so a free list
 * and reused pages), one clear: the file passes after each close, and the
 * next open keeps it and reports what the check covered. */
START_TEST(healthy_files_pass)
{
	fx f;
	fx_init(&f, 24 * MIB, NULL);
	uint32_t id = 0;
	for (int round = 0; round < 5; round++) {
		ck_assert_int_eq(kvs_l2_open(&f.cfg, &f.l2), 0);
		kvs_l2_stats st;
		kvs_l2_get_stats(f.l2, &st);
		ck_assert_uint_eq(st.corrupt_recoveries, 0);
		if (round > 0) {
			ck_assert_uint_gt(st.verify_bytes, 0);
			ck_assert_uint_gt(st.objects, 0);
		}
		if (round == 3)
			ck_assert_int_eq(kvs_l2_clear(f.l2), 0);
		ck_assert_int_eq(write_objects(&f, id, 250), 0);
		id += 250;
		uint32_t hits;
		ck_assert_int_eq(read_objects(&f, 0, id, &hits), 0);
		kvs_l2_get_stats(f.l2, &st);
		if (round != 0 && round != 3) /* 14 MiB, then 29, 44, clear + 14, 29 */
			ck_assert_uint_gt(st.evictions, 0);
		kvs_l2_close(f.l2);
		kvs_l2_verify_report rep;
		char why[200];
		int rc = verify_dir(f.dir, &rep, why, sizeof(why));
		ck_assert_msg(rc == 0, "round %d: a healthy file found damaged: %s", round, why);
		ck_assert_uint_gt(rep.pages_read, 0);
		ck_assert_uint_gt(rep.entries, 0);
		ck_assert_uint_le(rep.pages_marked, rep.used_bytes / PSZ - 2);
		if (round >= 1)
			ck_assert_uint_gt(rep.free_pages, 0);
	}
	close(f.efd);
}
END_TEST

/* ---- damage made by hand ----------------------------------------------------- */

static uint8_t *g_pristine;
static size_t g_pristine_len;

static uint16_t r16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static void w16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static uint64_t r64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return v;
}
static void w64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* An L2 of 400 objects (inline and overflow), some deleted by eviction:
 * written once, its data.mdb kept in memory. */
static void make_pristine(void)
{
	if (g_pristine)
		return;
	fx f;
	fx_init(&f, 16 * MIB, NULL);
	ck_assert_int_eq(kvs_l2_open(&f.cfg, &f.l2), 0);
	ck_assert_int_eq(write_objects(&f, 0, 400), 0);
	kvs_l2_close(f.l2);
	close(f.efd);
	char p[200];
	path_of(p, sizeof(p), f.dir);
	int fd = open(p, O_RDONLY);
	ck_assert_int_ge(fd, 0);
	struct stat sb;
	ck_assert_int_eq(fstat(fd, &sb), 0);
	g_pristine_len = (size_t)sb.st_size;
	g_pristine = malloc(g_pristine_len);
	ck_assert_ptr_nonnull(g_pristine);
	ck_assert_int_eq(pread(fd, g_pristine, g_pristine_len, 0), (ssize_t)g_pristine_len);
	close(fd);
	ck_assert_uint_eq(r64(g_pristine + 16 + 24) & 0xffffffffu, PSZ); /* the meta's page size */
}

static uint64_t last_pg(const uint8_t *m)
{
	/* the meta with the higher txnid; last_pg at 120, txnid at 128 of MDB_meta */
	const uint8_t *a = m + 16, *b = m + PSZ + 16;
	return r64(r64(a + 128) < r64(b + 128) ? b + 120 : a + 120);
}

/* The record of a named database in the main database's root leaf (the
 * four names fit one leaf): its node's data (an MDB_db of 48 bytes). */
static uint8_t *named_db(uint8_t *m, const char *name)
{
	const uint8_t *a = m + 16, *b = m + PSZ + 16;
	const uint8_t *meta = r64(a + 128) < r64(b + 128) ? b : a;
	uint64_t root = r64(meta + 24 + 48 + 40); /* mm_dbs[MAIN_DBI].md_root */
	uint8_t *p = m + root * PSZ;
	ck_assert_uint_eq(r16(p + 10), 2);
	unsigned nkeys = (r16(p + 12) - 16u) / 2;
	for (unsigned i = 0; i < nkeys; i++) {
		uint8_t *n = p + r16(p + 16 + 2 * i);
		if (r16(n + 6) == strlen(name) && memcmp(n + 8, name, strlen(name)) == 0)
			return n + 8 + r16(n + 6);
	}
	ck_abort_msg("no database %s", name);
	return NULL;
}

/* Pages of the obj tree: its root (a branch: 400 objects need two levels),
 * the leaf under the root's second node, and the overflow run of that
 * leaf's first big value. */
static void obj_pages(uint8_t *m, uint64_t *branch, uint64_t *leaf, uint64_t *ovf, kvs_objkey *ovf_key)
{
	const uint8_t *db = named_db(m, "obj");
	ck_assert_uint_eq(r16(db + 6), 2); /* depth */
	*branch = r64(db + 40);
	const uint8_t *bp = m + *branch * PSZ, *n = bp + r16(bp + 18);
	*leaf = r16(n) | (uint64_t)r16(n + 2) << 16;
	const uint8_t *lp = m + *leaf * PSZ;
	ck_assert_uint_eq(r16(lp + 10), 2);
	*ovf = 0;
	unsigned nkeys = (r16(lp + 12) - 16u) / 2;
	for (unsigned i = 0; i < nkeys && !*ovf; i++) {
		const uint8_t *x = lp + r16(lp + 16 + 2 * i);
		if (r16(x + 4) & 1) {
			*ovf = r64(x + 8 + r16(x + 6));
			ck_assert_uint_eq(r16(x + 6), sizeof(*ovf_key));
			memcpy(ovf_key, x + 8, sizeof(*ovf_key));
		}
	}
	ck_assert_uint_ne(*ovf, 0);
}

/* The kinds of damage the check names. Each edits a copy of the pristine
 * file; *what: a phrase of the reason the check must give. */
enum {
	D_PGNO, D_FLAGS, D_BOUNDS, D_NODE_OFF, D_CHILD_FAR, D_CYCLE, D_OVERFLOW_RUN, D_ORDER, D_META, D_COUNT,
	D_FREE_IN_USE, D_TRUNCATED, D_N
};

static const char *damage(uint8_t *m, size_t *len, int kind)
{
	uint64_t leaf, branch, ovf;
	kvs_objkey ok;
	obj_pages(m, &branch, &leaf, &ovf, &ok);
	uint8_t *lp = m + leaf * PSZ, *bp = m + branch * PSZ;
	switch (kind) {
	case D_PGNO:
		w64(lp, leaf + 1);
		return "says it is page";
	case D_FLAGS:
		w16(lp + 10, 4);
		return "has flags";
	case D_BOUNDS:
		w16(lp + 12, (uint16_t)(r16(lp + 14) + 2));
		return "bounds";
	case D_NODE_OFF:
		w16(lp + 16, 18);
		return "outside the page's nodes";
	case D_CHILD_FAR: {
		uint8_t *n = bp + r16(bp + 16);
		w16(n, 0xfff0), w16(n + 2, 0x00ff);
		return "outside the";
	}
	case D_CYCLE: {
		uint8_t *n = bp + r16(bp + 18); /* the second child: its own page */
		w16(n, (uint16_t)branch), w16(n + 2, (uint16_t)(branch >> 16));
		return "reached twice";
	}
	case D_OVERFLOW_RUN: {
		/* the leaf's first big value now starts on the leaf itself */
		for (unsigned i = 0; i < (r16(lp + 12) - 16u) / 2; i++) {
			uint8_t *x = lp + r16(lp + 16 + 2 * i);
			if (r16(x + 4) & 1) {
				w64(x + 8 + r16(x + 6), leaf);
				return "reached twice";
			}
		}
		return NULL;
	}
	case D_ORDER: {
		uint16_t a = r16(lp + 16), b = r16(lp + 18);
		w16(lp + 16, b), w16(lp + 18, a);
		return "out of order";
	}
	case D_META:
		m[16] ^= 0x55; /* meta page 0's magic */
		return "meta page 0";
	case D_COUNT: {
		uint8_t *db = named_db(m, "obj");
		w64(db + 32, r64(db + 32) + 1); /* md_entries */
		return "the database records";
	}
	case D_FREE_IN_USE: {
		/* the free list's first record (an inline page list) lists the
		 * leaf page in use */
		const uint8_t *a = m + 16, *b = m + PSZ + 16;
		const uint8_t *meta = r64(a + 128) < r64(b + 128) ? b : a;
		ck_assert_uint_eq(r16(meta + 24 + 6), 1); /* a one-level free list */
		uint8_t *p = m + r64(meta + 24 + 40) * PSZ, *n = NULL;
		for (unsigned i = 0; i < (r16(p + 12) - 16u) / 2 && !n; i++) {
			uint8_t *x = p + r16(p + 16 + 2 * i);
			if (r16(x + 4) == 0 && r64(x + 16) >= 1) /* inline, one page or more */
				n = x;
		}
		ck_assert_msg(n != NULL, "no inline free-list record");
		w64(n + 24, leaf);
		return "reached twice";
	}
	case D_TRUNCATED:
		*len = (last_pg(m) / 2) * PSZ;
		return "the file holds";
	}
	return NULL;
}

static void write_file(const char *dir, const uint8_t *m, size_t len)
{
	char p[200];
	path_of(p, sizeof(p), dir);
	int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	ck_assert_int_ge(fd, 0);
	/* sparse, like the file LMDB wrote: only pages holding a non-zero byte */
	ck_assert_int_eq(ftruncate(fd, (off_t)len), 0);
	static const uint8_t zero[PSZ];
	for (size_t off = 0; off < len; off += PSZ) {
		size_t n = len - off < PSZ ? len - off : PSZ;
		if (memcmp(m + off, zero, n) != 0)
			ck_assert_int_eq(pwrite(fd, m + off, n, (off_t)off), (ssize_t)n);
	}
	close(fd);
}

START_TEST(each_damage_found)
{
	const int kind = _i;
	make_pristine();
	uint8_t *m = malloc(g_pristine_len);
	ck_assert_ptr_nonnull(m);
	memcpy(m, g_pristine, g_pristine_len);
	size_t len = g_pristine_len;
	const char *what = damage(m, &len, kind);
	fx f;
	fx_init(&f, 16 * MIB, NULL);
	write_file(f.dir, g_pristine, g_pristine_len);
	kvs_l2_verify_report rep;
	char why[200];
	ck_assert_int_eq(verify_dir(f.dir, &rep, why, sizeof(why)), 0); /* the copy before the damage */
	write_file(f.dir, m, len);
	int rc = verify_dir(f.dir, &rep, why, sizeof(why));
	ck_assert_msg(rc == KVS_L2_VERIFY_DAMAGED && strstr(why, what), "damage %d: rc %d, why \"%s\", want \"%s\"",
		      kind, rc, why, what);
	/* the open sets it aside and serves empty */
	ck_assert_int_eq(kvs_l2_open(&f.cfg, &f.l2), 0);
	kvs_l2_stats st;
	kvs_l2_get_stats(f.l2, &st);
	ck_assert_uint_eq(st.corrupt_recoveries, 1);
	ck_assert_uint_eq(st.objects, 0);
	ck_assert_int_eq(write_objects(&f, 1000, 3), 0);
	uint32_t hits;
	ck_assert_int_eq(read_objects(&f, 1000, 3, &hits), 0);
	ck_assert_uint_eq(hits, 3);
	kvs_l2_close(f.l2);
	close(f.efd);
	free(m);
}
END_TEST

/* The first page of a big value's overflow run is not read by the walk (one
 * read per object on a cold disk): damaged, the file opens, and the writer
 * refuses to free or reuse the run by it (LMDB would free the pages the
 * damaged count names) — the write of that object fails, nothing faults,
 * and the next open sets the file aside. */
START_TEST(overflow_header_checked_before_free)
{
	make_pristine();
	uint8_t *m = malloc(g_pristine_len);
	ck_assert_ptr_nonnull(m);
	memcpy(m, g_pristine, g_pristine_len);
	uint64_t leaf, branch, ovf;
	kvs_objkey key;
	obj_pages(m, &branch, &leaf, &ovf, &key);
	w64(m + ovf * PSZ, ovf + 7); /* the run's page number */
	m[ovf * PSZ + 12] ^= 0x40;   /* and its page count */
	fx f;
	fx_init(&f, 16 * MIB, NULL);
	write_file(f.dir, m, g_pristine_len);
	kvs_l2_verify_report rep;
	char why[200];
	ck_assert_int_eq(verify_dir(f.dir, &rep, why, sizeof(why)), 0);
	ck_assert_int_eq(kvs_l2_open(&f.cfg, &f.l2), 0);
	kvs_l2_stats st;
	kvs_l2_get_stats(f.l2, &st);
	ck_assert_uint_eq(st.corrupt_recoveries, 0);
	uint32_t id;
	memcpy(&id, key.chunk, sizeof(id));
	ck_assert_int_eq(write_objects(&f, id, 1), 1); /* an overwrite of that object: refused */
	kvs_l2_close(f.l2);
	ck_assert_int_eq(kvs_l2_open(&f.cfg, &f.l2), 0);
	kvs_l2_get_stats(f.l2, &st);
	ck_assert_uint_eq(st.corrupt_recoveries, 1);
	kvs_l2_close(f.l2);
	close(f.efd);
	free(m);
}
END_TEST

/* ---- random damage --------------------------------------------------------- */

static uint64_t rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/* Random bytes over random spans of 1-3 pages: B-tree pages, the first
 * page of overflow runs, or any page in use (seeded). */
static void random_damage(uint8_t *m, uint64_t seed)
{
	uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1, last = last_pg(m);
	int n = 1 + (int)(rnd(&s) % 3);
	for (int i = 0; i < n; i++) {
		uint64_t pg = 0, r = rnd(&s) % 4;
		for (int tries = 0; tries < 64 && !pg; tries++) {
			uint64_t c = 2 + rnd(&s) % (last - 1);
			unsigned fl = r16(m + c * PSZ + 10);
			if (r64(m + c * PSZ) == c && (r == 3 || (r <= 1 ? (fl == 1 || fl == 2) : fl == 4)))
				pg = c;
		}
		if (!pg)
			pg = 2 + rnd(&s) % (last - 1);
		uint64_t off, len;
		if (rnd(&s) % 4 == 0) {
			off = 0, len = PSZ;
		} else {
			off = rnd(&s) % (PSZ - 16);
			len = 1 + rnd(&s) % (PSZ - off < 512 ? PSZ - off : 512);
		}
		for (uint64_t b = 0; b < len; b++)
			m[pg * PSZ + off + b] = (uint8_t)rnd(&s);
	}
}

/* A session on the file in dir: open, read back every object, write new
 * ones until the L2 evicts, close, open again, read again. Exit 0 (served,
 * nothing wrong), 3 (a wrong byte served), 4 (a time-out), 5 (open failed). */
static int session(const char *dir, bool verify)
{
	fx f;
	fx_init(&f, 16 * MIB, dir);
	f.cfg.verify = verify;
	for (int pass = 0; pass < 2; pass++) {
		if (kvs_l2_open(&f.cfg, &f.l2) != 0)
			return 5;
		uint32_t hits;
		int wrong = read_objects(&f, 0, 400, &hits);
		if (wrong > 0)
			return 3;
		if (wrong < 0)
			return 4;
		if (write_objects(&f, 2000 + 100 * (uint32_t)pass, 30) < 0)
			return 4;
		kvs_l2_close(f.l2);
	}
	return 0;
}

/* Seeds of random damage; for each, the session in a forked child with the
 * check on must never die of a signal (goal 0 of N) nor serve a wrong byte.
 * The control (the check off) is printed. */
START_TEST(random_damage_never_kills)
{
	make_pristine();
	int seeds = getenv("KVT_L2_VERIFY_SEEDS") ? atoi(getenv("KVT_L2_VERIFY_SEEDS")) : 24;
	uint8_t *m = malloc(g_pristine_len);
	ck_assert_ptr_nonnull(m);
	int found = 0, died[2] = {0, 0}, wrong[2] = {0, 0}, other[2] = {0, 0};
	char failures[2000] = "";
	for (int seed = 1; seed <= seeds; seed++) {
		memcpy(m, g_pristine, g_pristine_len);
		random_damage(m, (uint64_t)seed);
		for (int check = 1; check >= 0; check--) {
			char dir[128];
			snprintf(dir, sizeof(dir), "%s/r-%d-%d", g_base, seed, check);
			ck_assert_int_eq(mkdir(dir, 0700), 0);
			write_file(dir, m, g_pristine_len);
			if (check) {
				kvs_l2_verify_report rep;
				char why[200];
				found += verify_dir(dir, &rep, why, sizeof(why)) == KVS_L2_VERIFY_DAMAGED;
			}
			fflush(NULL);
			pid_t pid = fork();
			ck_assert_int_ge(pid, 0);
			if (pid == 0) {
				/* quiet: the session's log lines are not the test's */
				int null = open("/dev/null", O_WRONLY);
				dup2(null, 2);
				_exit(session(dir, check));
			}
			int ws;
			int64_t t0 = now_ms();
			ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
			if (getenv("KVT_L2_VERIFY_TRACE"))
				fprintf(stderr, "seed %d check %d: status 0x%x in %lld ms\n", seed, check, ws,
					(long long)(now_ms() - t0));
			if (WIFSIGNALED(ws)) {
				died[check]++;
				if (check)
					snprintf(failures + strlen(failures), sizeof(failures) - strlen(failures),
						 " seed %d: signal %d;", seed, WTERMSIG(ws));
			} else if (WEXITSTATUS(ws) == 3) {
				wrong[check]++;
				snprintf(failures + strlen(failures), sizeof(failures) - strlen(failures),
					 " seed %d (check %s): a wrong byte;", seed, check ? "on" : "off");
			} else if (WEXITSTATUS(ws) != 0) {
				other[check]++;
				if (check)
					snprintf(failures + strlen(failures), sizeof(failures) - strlen(failures),
						 " seed %d: exit %d;", seed, WEXITSTATUS(ws));
			}
			char cmd[200];
			snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
			ck_assert_int_eq(system(cmd), 0);
		}
	}
	fprintf(stderr,
		"# l2-verify random damage: %d seeds, %d found damaged by the check; with the check: %d died, %d "
		"served a wrong byte, %d failed otherwise; without it (control): %d died, %d served a wrong byte, %d "
		"failed otherwise\n",
		seeds, found, died[1], wrong[1], other[1], died[0], wrong[0], other[0]);
	free(m);
	ck_assert_msg(died[1] == 0 && wrong[1] == 0 && other[1] == 0 && wrong[0] == 0, "%s", failures);
}
END_TEST

static Suite *l2_verify_suite(void)
{
	g_parent = getpid();
	/* on tmpfs where there is one: the many small L2 sessions here must not
	 * wait behind other tests' fsyncs on a shared disk */
	struct stat sb;
	snprintf(g_base, sizeof(g_base), "%s/kvs-test-l2v-XXXXXX",
		 stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
	if (!mkdtemp(g_base)) {
		perror("mkdtemp");
		exit(1);
	}
	atexit(rm_base);
	Suite *s = suite_create("l2_verify");
	TCase *tc = tcase_create("verify");
	tcase_set_timeout(tc, getenv("KVT_L2_VERIFY_SEEDS") ? 3600 : 110);
	tcase_add_test(tc, healthy_files_pass);
	tcase_add_loop_test(tc, each_damage_found, 0, D_N);
	tcase_add_test(tc, overflow_header_checked_before_free);
	tcase_add_test(tc, random_damage_never_kills);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(l2_verify_suite)
