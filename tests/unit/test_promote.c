/* Unit tests for promotions (server/promote.c), with no server: a small L1
 * and a real L2 in a temporary directory; the L2's read completions are
 * reaped here and fed to kvs_promote_done the way the main loop does.
 * Covers kvs_promote_locate (L1, L2, absent, another length or geometry, a
 * store in flight, a promotion running, no L2 at all), one promotion shared
 * by two waiters each called back with the object pinned once for it, a
 * promotion nobody waits for, failed reads (absent record, corrupt data, a
 * record of another length) calling every waiter with NULL and KVS_E_MISS and
 * leaving nothing reserved, a start refused while a store of the same key is
 * reserved (KVS_E_MISS) or when L1 is full (KVS_E_NOSPACE), a running
 * promotion of another geometry or length never offered as a source, and
 * the counters. */
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
#include <unistd.h>

#include "check_main.h"
#include "kvs_error.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "promote.h"

#define GEOM 0x9e0e0e0e0e0e0001ull
#define PAGE KVS_L1_PAGE
#define MIB (1ull << 20)

/* ---- temporary directories (removed by the parent process at exit) ------- */

static char g_base[64];
static pid_t g_parent;

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb, (void)flag, (void)ftw;
	return remove(p);
}

static void rm_rf(const char *dir) { nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static void rm_base(void)
{
	if (getpid() == g_parent && g_base[0])
		rm_rf(g_base);
}

/* ---- fixture ------------------------------------------------------------------ */

typedef struct fx {
	char dir[128];
	int efd;
	kvs_l1 *l1;
	kvs_l2 *l2;
	kvs_promote *pr;
} fx;

static void l2_open(fx *f)
{
	kvs_l2_config c;
	kvs_l2_config_defaults(&c);
	c.path = f->dir;
	c.size = 64 * MIB;
	c.sync = KVS_L2_SYNC_NONE;
	c.efd = f->efd;
	ck_assert_int_eq(kvs_l2_open(&c, &f->l2), 0);
}

static void fx_init(fx *f, uint64_t l1_size, bool with_l2)
{
	memset(f, 0, sizeof(*f));
	snprintf(f->dir, sizeof(f->dir), "%s/t-XXXXXX", g_base);
	ck_assert_ptr_nonnull(mkdtemp(f->dir));
	f->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	ck_assert_int_ge(f->efd, 0);
	kvs_l1_config c = {.size = l1_size};
	ck_assert_int_eq(kvs_l1_create(&c, &f->l1), 0);
	if (with_l2)
		l2_open(f);
	ck_assert_int_eq(kvs_promote_create(f->l1, f->l2, NULL, &f->pr), 0);
}

static kvs_l1_stats l1st(fx *f)
{
	kvs_l1_stats st;
	kvs_l1_get_stats(f->l1, &st);
	return st;
}

/* Nothing reserved or pinned, the L1 consistent, no promotion running. */
static void assert_idle(fx *f)
{
	kvs_l1_stats st = l1st(f);
	ck_assert_uint_eq(st.objects_reserved, 0);
	ck_assert_uint_eq(st.bytes_reserved, 0);
	ck_assert_uint_eq(st.bytes_evictable, st.bytes_allocated);
	ck_assert_int_eq(kvs_l1_check(f->l1), 0);
	ck_assert_uint_eq(kvs_promote_pending(f->pr), 0);
}

static void fx_done(fx *f)
{
	assert_idle(f);
	if (f->l2) {
		kvs_l2_done extra;
		ck_assert_uint_eq(kvs_l2_reap(f->l2, &extra, 1), 0); /* every completion was handled */
	}
	kvs_promote_destroy(f->pr);
	kvs_l2_close(f->l2);
	kvs_l1_destroy(f->l1);
	close(f->efd);
	rm_rf(f->dir);
}

static kvs_promote_stats pst(fx *f)
{
	kvs_promote_stats st;
	kvs_promote_get_stats(f->pr, &st);
	return st;
}

static kvs_objkey mkkey(uint32_t id)
{
	kvs_objkey k;
	memset(&k, 0, sizeof(k));
	memcpy(k.chunk, &id, sizeof(id));
	k.chunk[31] = 0x3c;
	memset(k.ns, 0x42, sizeof(k.ns));
	k.world = 2;
	k.rank = 1;
	k.group = 7;
	return k;
}

static void fill(uint8_t *p, uint64_t len, uint64_t seed)
{
	uint64_t x = (seed + 1) * 0xd1342543de82ef95ull;
	for (uint64_t i = 0; i < len; i += 8) {
		x += 0x9e3779b97f4a7c15ull;
		uint64_t z = x;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		z ^= z >> 31;
		uint64_t n = len - i < 8 ? len - i : 8;
		memcpy(p + i, &z, n);
	}
}

static uint8_t *mkdata(uint64_t len, uint64_t seed)
{
	uint8_t *p = malloc(len);
	ck_assert_ptr_nonnull(p);
	fill(p, len, seed);
	return p;
}

/* The next L2 completion. Blocks on the eventfd: a lost completion hangs
 * the test until the test case's timeout fails it. */
static kvs_l2_done next_done(fx *f)
{
	kvs_l2_done d;
	while (kvs_l2_reap(f->l2, &d, 1) == 0) {
		struct pollfd p = {.fd = f->efd, .events = POLLIN};
		ck_assert_int_eq(poll(&p, 1, -1), 1);
		uint64_t v;
		ck_assert_int_eq(read(f->efd, &v, sizeof(v)), (ssize_t)sizeof(v));
	}
	return d;
}

/* Writes an object to L2 and waits until it is committed there. */
static void l2_put(fx *f, const kvs_objkey *k, uint64_t geom, const uint8_t *data, uint64_t len)
{
	ck_assert_int_eq(kvs_l2_write(f->l2, k, geom, data, len, (void *)(uintptr_t)0x77), 0);
	kvs_l2_done d = next_done(f);
	ck_assert_int_eq(d.op, KVS_L2_WRITE);
	ck_assert_int_eq(d.result, 0);
	ck_assert_ptr_eq(d.cookie, (void *)(uintptr_t)0x77);
}

/* Reaps one read completion and hands it to the promotion table (the main
 * loop's job); returns its result. */
static int feed(fx *f)
{
	kvs_l2_done d = next_done(f);
	ck_assert_int_eq(d.op, KVS_L2_READ);
	kvs_promote_done(f->pr, d.cookie, d.result);
	return d.result;
}

/* A committed L1 object. */
static kvs_l1_obj *l1_put(fx *f, const kvs_objkey *k, uint64_t len)
{
	kvs_l1_obj *o;
	ck_assert_int_eq(kvs_l1_reserve(f->l1, k, len, &o), 0);
	fill(kvs_l1_data(o), len, 5);
	kvs_l1_commit(f->l1, o);
	return o;
}

static int locate(fx *f, const kvs_objkey *k, uint64_t geom, uint64_t len, kvs_l1_obj **o)
{
	*o = (kvs_l1_obj *)(uintptr_t)0x1; /* must be overwritten */
	return kvs_promote_locate(f->pr, k, geom, len, o, NULL);
}

/* ---- waiters ---------------------------------------------------------------- */

typedef struct waiter {
	fx *f;
	int calls;
	kvs_l1_obj *obj;
	int result;
	uint32_t pins_at_call; /* of obj, during the callback */
	int state_at_call;
	const kvs_objkey *key;
	bool key_visible; /* kvs_l1_get(key) == obj during the callback */
	bool running_at_call;
} waiter;

static void on_promoted(void *arg, kvs_l1_obj *obj, int result)
{
	waiter *w = arg;
	w->calls++;
	w->obj = obj;
	w->result = result;
	if (obj) {
		w->pins_at_call = kvs_l1_pins(obj);
		w->state_at_call = kvs_l1_state(obj);
	}
	w->key_visible = kvs_l1_get(w->f->l1, w->key) == obj;
	w->running_at_call = kvs_promote_running(w->f->pr, w->key);
}

/* ---- locate ------------------------------------------------------------------ */

START_TEST(locate_tiers)
{
	fx f;
	fx_init(&f, 16 * PAGE, true);
	kvs_objkey k1 = mkkey(1), k2 = mkkey(2), k3 = mkkey(3), k4 = mkkey(4);
	kvs_l1_obj *o;
	/* in L1 with the wanted length: 0 and the object (not pinned) */
	kvs_l1_obj *o1 = l1_put(&f, &k1, 4096);
	ck_assert_int_eq(locate(&f, &k1, GEOM, 4096, &o), 0);
	ck_assert_ptr_eq(o, o1);
	ck_assert_uint_eq(kvs_l1_pins(o1), 0);
	/* in L1 with another length: never copied from */
	ck_assert_int_eq(locate(&f, &k1, GEOM, 4095, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	ck_assert_int_eq(locate(&f, &k1, GEOM, 8192, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	/* in L2 only: 0 without an object; another length or geometry: a miss */
	uint8_t *d2 = mkdata(5000, 2);
	l2_put(&f, &k2, GEOM, d2, 5000);
	ck_assert_int_eq(locate(&f, &k2, GEOM, 5000, &o), 0);
	ck_assert_ptr_null(o);
	ck_assert_int_eq(locate(&f, &k2, GEOM, 4999, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	ck_assert_int_eq(locate(&f, &k2, GEOM + 1, 5000, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	/* absent */
	ck_assert_int_eq(locate(&f, &k3, GEOM, 4096, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	/* only reserved in L1 (a store in flight), not in L2: a miss */
	kvs_l1_obj *r4;
	ck_assert_int_eq(kvs_l1_reserve(f.l1, &k4, 4096, &r4), 0);
	ck_assert_int_eq(locate(&f, &k4, GEOM, 4096, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	kvs_l1_abort(f.l1, r4);
	/* both tiers: L1 wins */
	l2_put(&f, &k1, GEOM, d2, 4096);
	ck_assert_int_eq(locate(&f, &k1, GEOM, 4096, &o), 0);
	ck_assert_ptr_eq(o, o1);
	/* locate starts nothing */
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 0);
	ck_assert_uint_eq(pst(&f).promotions, 0);
	free(d2);
	fx_done(&f);
}
END_TEST

/* While a promotion runs, the object is found even if L2 cannot serve it;
 * once the read failed, it is not. */
START_TEST(locate_running)
{
	fx f;
	fx_init(&f, 16 * PAGE, true);
	kvs_objkey k = mkkey(9);
	kvs_l1_obj *o;
	ck_assert_int_eq(locate(&f, &k, GEOM, 4096, &o), KVS_E_MISS);
	int err = 0;
	kvs_l1_obj *t = kvs_promote_start(f.pr, &k, GEOM, 4096, &err);
	ck_assert_ptr_nonnull(t);
	ck_assert(kvs_promote_running(f.pr, &k));
	ck_assert_int_eq(locate(&f, &k, GEOM, 4096, &o), 0);
	ck_assert_ptr_null(o);
	ck_assert_int_eq(feed(&f), KVS_E_MISS);
	ck_assert(!kvs_promote_running(f.pr, &k));
	ck_assert_int_eq(locate(&f, &k, GEOM, 4096, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	fx_done(&f);
}
END_TEST

START_TEST(no_l2)
{
	fx f;
	fx_init(&f, 16 * PAGE, false);
	kvs_objkey k1 = mkkey(1), k2 = mkkey(2);
	kvs_l1_obj *o, *o1 = l1_put(&f, &k1, 100);
	ck_assert_int_eq(locate(&f, &k1, GEOM, 100, &o), 0);
	ck_assert_ptr_eq(o, o1);
	ck_assert_int_eq(locate(&f, &k2, GEOM, 100, &o), KVS_E_MISS);
	ck_assert_ptr_null(o);
	int err = 0;
	ck_assert_ptr_null(kvs_promote_start(f.pr, &k2, GEOM, 100, &err));
	ck_assert_int_eq(err, KVS_E_MISS);
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 0);
	ck_assert_uint_eq(l1st(&f).objects, 1);
	fx_done(&f);
}
END_TEST

/* ---- promotions ---------------------------------------------------------------- */

START_TEST(two_waiters)
{
	fx f;
	fx_init(&f, 16 * PAGE, true);
	const uint64_t len = 3 * PAGE + 100;
	kvs_objkey k = mkkey(5), other = mkkey(6);
	uint8_t *data = mkdata(len, 55);
	l2_put(&f, &k, GEOM, data, len);
	int err = 0;
	kvs_l1_obj *t = kvs_promote_start(f.pr, &k, GEOM, len, &err);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(kvs_l1_state(t), KVS_L1_RESERVED);
	ck_assert_uint_eq(kvs_l1_len(t), len);
	ck_assert_mem_eq(kvs_l1_key(t), &k, sizeof(k));
	ck_assert_ptr_null(kvs_l1_get(f.l1, &k)); /* not visible before the read ends */
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 1);
	ck_assert(kvs_promote_running(f.pr, &k));
	ck_assert(!kvs_promote_running(f.pr, &other));
	/* a second start finds the running promotion: one read, one object */
	ck_assert_ptr_eq(kvs_promote_start(f.pr, &k, GEOM, len, &err), t);
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 1);
	ck_assert_uint_eq(pst(&f).promotions, 1);
	ck_assert_uint_eq(l1st(&f).objects, 1);
	waiter w[2] = {{.f = &f, .key = &k}, {.f = &f, .key = &k}}, w3 = {.f = &f, .key = &other};
	ck_assert_int_eq(kvs_promote_wait(f.pr, &k, on_promoted, &w[0]), 0);
	ck_assert_int_eq(kvs_promote_wait(f.pr, &k, on_promoted, &w[1]), 0);
	ck_assert_int_eq(kvs_promote_wait(f.pr, &other, on_promoted, &w3), -ENOENT);
	ck_assert_int_eq(w[0].calls + w[1].calls, 0); /* nobody is called before the read ends */

	ck_assert_int_eq(feed(&f), 0);
	ck_assert_int_eq(w3.calls, 0);
	for (int i = 0; i < 2; i++) {
		ck_assert_int_eq(w[i].calls, 1);
		ck_assert_ptr_eq(w[i].obj, t);
		ck_assert_int_eq(w[i].result, 0);
		ck_assert_int_eq(w[i].state_at_call, KVS_L1_COMMITTED);
		ck_assert(w[i].key_visible);
		ck_assert(!w[i].running_at_call);
		ck_assert_uint_ge(w[i].pins_at_call, 1); /* pinned (once per waiter) when called */
	}
	ck_assert_uint_eq(kvs_l1_pins(t), 2);
	ck_assert_mem_eq(kvs_l1_data(t), data, len);
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 0);
	ck_assert(!kvs_promote_running(f.pr, &k));
	ck_assert_ptr_eq(kvs_l1_get(f.l1, &k), t);
	kvs_l1_obj *o;
	ck_assert_int_eq(locate(&f, &k, GEOM, len, &o), 0);
	ck_assert_ptr_eq(o, t);
	ck_assert_uint_eq(pst(&f).promotions, 1);
	ck_assert_uint_eq(pst(&f).failures, 0);
	ck_assert_int_eq(kvs_promote_wait(f.pr, &k, on_promoted, &w[0]), -ENOENT); /* over */
	/* both pins are the waiters' to drop */
	ck_assert_uint_eq(l1st(&f).bytes_evictable, 0);
	kvs_l1_unpin(f.l1, t);
	ck_assert_uint_eq(l1st(&f).bytes_evictable, 0);
	kvs_l1_unpin(f.l1, t);
	ck_assert_uint_eq(l1st(&f).bytes_evictable, 4 * PAGE);
	free(data);
	fx_done(&f);
}
END_TEST

/* A promotion nobody waits for (a prefetching lookup): committed, unpinned. */
START_TEST(no_waiter)
{
	fx f;
	fx_init(&f, 16 * PAGE, true);
	kvs_objkey k = mkkey(8);
	uint8_t *data = mkdata(1000, 8);
	l2_put(&f, &k, GEOM, data, 1000);
	int err = 0;
	kvs_l1_obj *t = kvs_promote_start(f.pr, &k, GEOM, 1000, &err);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(feed(&f), 0);
	ck_assert_ptr_eq(kvs_l1_get(f.l1, &k), t);
	ck_assert_uint_eq(kvs_l1_pins(t), 0);
	ck_assert_mem_eq(kvs_l1_data(t), data, 1000);
	free(data);
	fx_done(&f);
}
END_TEST

/* Writes a 64-byte-unique object, closes the L2, flips one bit of its data
 * in data.mdb, reopens the L2 (and the promotion table on it). */
static void corrupt(fx *f, const uint8_t *data, long at)
{
	kvs_promote_destroy(f->pr);
	kvs_l2_close(f->l2);
	char path[256];
	snprintf(path, sizeof(path), "%s/data.mdb", f->dir);
	int fd = open(path, O_RDWR);
	ck_assert_int_ge(fd, 0);
	struct stat sb;
	ck_assert_int_eq(fstat(fd, &sb), 0);
	uint8_t *buf = malloc((size_t)sb.st_size);
	ck_assert_ptr_nonnull(buf);
	ck_assert_int_eq(pread(fd, buf, (size_t)sb.st_size, 0), sb.st_size);
	uint8_t *p = memmem(buf, (size_t)sb.st_size, data + at, 64);
	ck_assert_ptr_nonnull(p);
	ck_assert_ptr_null(memmem(p + 1, (size_t)(buf + sb.st_size - p - 1), data + at, 64)); /* one copy */
	uint8_t b = (uint8_t)(*p ^ 0x10);
	ck_assert_int_eq(pwrite(fd, &b, 1, p - buf), 1);
	free(buf);
	close(fd);
	l2_open(f);
	ck_assert_int_eq(kvs_promote_create(f->l1, f->l2, NULL, &f->pr), 0);
}

/* case 0: no record; 1: the record's data corrupt; 2: a record of another
 * length (its header does not match the read) */
START_TEST(failed_read)
{
	const int c = _i;
	fx f;
	fx_init(&f, 16 * PAGE, true);
	kvs_objkey k = mkkey(20), nb = mkkey(21);
	const uint64_t len = 2 * PAGE;
	uint8_t *data = mkdata(len, 20);
	kvs_l1_obj *neighbour = l1_put(&f, &nb, PAGE);
	if (c == 1) {
		l2_put(&f, &k, GEOM, data, len);
		corrupt(&f, data, 5000);
	} else if (c == 2) {
		uint8_t *longer = mkdata(len + 8, 20);
		l2_put(&f, &k, GEOM, longer, len + 8);
		free(longer);
	}
	int err = 0;
	kvs_l1_obj *t = kvs_promote_start(f.pr, &k, GEOM, len, &err);
	ck_assert_ptr_nonnull(t);
	ck_assert_uint_eq(l1st(&f).objects_reserved, 1);
	waiter w[2] = {{.f = &f, .key = &k}, {.f = &f, .key = &k}};
	ck_assert_int_eq(kvs_promote_wait(f.pr, &k, on_promoted, &w[0]), 0);
	ck_assert_int_eq(kvs_promote_wait(f.pr, &k, on_promoted, &w[1]), 0);
	ck_assert_int_eq(feed(&f), KVS_E_MISS);
	for (int i = 0; i < 2; i++) {
		ck_assert_int_eq(w[i].calls, 1);
		ck_assert_ptr_null(w[i].obj);
		ck_assert_int_eq(w[i].result, KVS_E_MISS);
		ck_assert(!w[i].running_at_call);
		ck_assert(w[i].key_visible); /* kvs_l1_get(key) == NULL by then */
	}
	/* the reservation is gone, and nothing else was touched */
	ck_assert_ptr_null(kvs_l1_peek(f.l1, &k));
	ck_assert_uint_eq(l1st(&f).objects, 1);
	ck_assert_ptr_eq(kvs_l1_get(f.l1, &nb), neighbour);
	ck_assert_uint_eq(pst(&f).promotions, 1);
	ck_assert_uint_eq(pst(&f).failures, 1);
	assert_idle(&f);
	kvs_l2_stats ls;
	kvs_l2_get_stats(f.l2, &ls);
	ck_assert_uint_eq(ls.read_misses, 1);
	ck_assert_uint_eq(ls.checksum_failures, c == 1 ? 1 : 0);
	/* a good record afterwards is promoted again */
	l2_put(&f, &k, GEOM, data, len);
	t = kvs_promote_start(f.pr, &k, GEOM, len, &err);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(feed(&f), 0);
	ck_assert_mem_eq(kvs_l1_data(t), data, len);
	ck_assert_uint_eq(pst(&f).promotions, 2);
	ck_assert_uint_eq(pst(&f).failures, 1);
	free(data);
	fx_done(&f);
}
END_TEST

START_TEST(start_while_stored)
{
	fx f;
	fx_init(&f, 16 * PAGE, true);
	kvs_objkey k = mkkey(30);
	uint8_t *data = mkdata(PAGE, 30);
	l2_put(&f, &k, GEOM, data, PAGE);
	/* a store of the object holds its L1 reservation */
	kvs_l1_obj *store;
	ck_assert_int_eq(kvs_l1_reserve(f.l1, &k, PAGE, &store), 0);
	int err = 0;
	ck_assert_ptr_null(kvs_promote_start(f.pr, &k, GEOM, PAGE, &err));
	ck_assert_int_eq(err, KVS_E_MISS);
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 0);
	ck_assert(!kvs_promote_running(f.pr, &k));
	ck_assert_uint_eq(pst(&f).promotions, 0);
	waiter w = {.f = &f, .key = &k};
	ck_assert_int_eq(kvs_promote_wait(f.pr, &k, on_promoted, &w), -ENOENT);
	ck_assert_ptr_eq(kvs_l1_peek(f.l1, &k), store);
	ck_assert_int_eq(kvs_l1_state(store), KVS_L1_RESERVED);
	ck_assert_uint_eq(l1st(&f).objects, 1);
	/* once committed by its store it is in L1: nothing to promote (the
	 * caller locates first), and a start is refused without harm */
	kvs_l1_commit(f.l1, store);
	kvs_l1_obj *o;
	ck_assert_int_eq(locate(&f, &k, GEOM, PAGE, &o), 0);
	ck_assert_ptr_eq(o, store);
	err = 0;
	ck_assert_ptr_null(kvs_promote_start(f.pr, &k, GEOM, PAGE, &err));
	ck_assert_int_eq(err, KVS_E_INTERNAL);
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 0);
	ck_assert_ptr_eq(kvs_l1_get(f.l1, &k), store);
	ck_assert_uint_eq(l1st(&f).objects, 1);
	free(data);
	fx_done(&f);
}
END_TEST

START_TEST(start_l1_full)
{
	fx f;
	fx_init(&f, 2 * PAGE, true);
	kvs_objkey k = mkkey(40), a = mkkey(41), b = mkkey(42);
	uint8_t *data = mkdata(PAGE, 40);
	l2_put(&f, &k, GEOM, data, PAGE);
	/* L1 full of reservations: nothing evictable */
	kvs_l1_obj *ra, *rb;
	ck_assert_int_eq(kvs_l1_reserve(f.l1, &a, PAGE, &ra), 0);
	ck_assert_int_eq(kvs_l1_reserve(f.l1, &b, PAGE, &rb), 0);
	int err = 0;
	ck_assert_ptr_null(kvs_promote_start(f.pr, &k, GEOM, PAGE, &err));
	ck_assert_int_eq(err, KVS_E_NOSPACE);
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 0);
	ck_assert(!kvs_promote_running(f.pr, &k));
	ck_assert_uint_eq(pst(&f).promotions, 0);
	ck_assert_uint_eq(l1st(&f).objects_reserved, 2);
	/* larger than the arena, even with everything evictable */
	kvs_l1_commit(f.l1, ra);
	kvs_l1_commit(f.l1, rb);
	err = 0;
	ck_assert_ptr_null(kvs_promote_start(f.pr, &k, GEOM, 3 * PAGE, &err));
	ck_assert_int_eq(err, KVS_E_NOSPACE);
	ck_assert_uint_eq(l1st(&f).objects, 2);
	/* committed, unpinned objects make room */
	kvs_l1_obj *t = kvs_promote_start(f.pr, &k, GEOM, PAGE, &err);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(feed(&f), 0);
	ck_assert_mem_eq(kvs_l1_data(t), data, PAGE);
	free(data);
	fx_done(&f);
}
END_TEST

/* A promotion running for one layout is no source for another: the object
 * it fills has the other layout's length (or the same length and another
 * geometry), so locate reports a miss and start refuses it (KVS_E_MISS, as
 * for a store in flight) rather than handing out an object whose bytes a
 * retrieve would scatter with the wrong layout, past its end if longer. */
START_TEST(running_other_layout)
{
	fx f;
	fx_init(&f, 16 * PAGE, true);
	kvs_objkey k = mkkey(50);
	uint8_t *data = mkdata(PAGE, 50);
	l2_put(&f, &k, GEOM, data, PAGE);
	int err = 0;
	kvs_l1_obj *t = kvs_promote_start(f.pr, &k, GEOM, PAGE, &err);
	ck_assert_ptr_nonnull(t);
	kvs_l1_obj *o;
	/* the same layout: found, and the running promotion is shared */
	ck_assert_int_eq(locate(&f, &k, GEOM, PAGE, &o), 0);
	ck_assert_ptr_null(o);
	ck_assert_ptr_eq(kvs_promote_start(f.pr, &k, GEOM, PAGE, &err), t);
	/* another length, another geometry, or both */
	static const struct {
		uint64_t geom, len;
	} other[] = {{GEOM, 2 * PAGE}, {GEOM, PAGE - 8}, {GEOM + 1, PAGE}, {GEOM + 1, 2 * PAGE}};
	for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++) {
		ck_assert_int_eq(locate(&f, &k, other[i].geom, other[i].len, &o), KVS_E_MISS);
		ck_assert_ptr_null(o);
		err = 0;
		ck_assert_ptr_null(kvs_promote_start(f.pr, &k, other[i].geom, other[i].len, &err));
		ck_assert_int_eq(err, KVS_E_MISS);
	}
	ck_assert_uint_eq(kvs_promote_pending(f.pr), 1);
	ck_assert_uint_eq(pst(&f).promotions, 1);
	ck_assert_int_eq(feed(&f), 0);
	ck_assert_mem_eq(kvs_l1_data(t), data, PAGE);
	ck_assert_int_eq(locate(&f, &k, GEOM, 2 * PAGE, &o), KVS_E_MISS); /* in L1 now: same answer */
	free(data);
	fx_done(&f);
}
END_TEST

static Suite *promote_suite(void)
{
	g_parent = getpid();
	snprintf(g_base, sizeof(g_base), "/tmp/kvs-test-promote-XXXXXX");
	if (!mkdtemp(g_base)) {
		perror("mkdtemp");
		exit(EXIT_FAILURE);
	}
	atexit(rm_base);
	Suite *s = suite_create("promote");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, locate_tiers);
	tcase_add_test(tc, locate_running);
	tcase_add_test(tc, no_l2);
	tcase_add_test(tc, two_waiters);
	tcase_add_test(tc, no_waiter);
	tcase_add_loop_test(tc, failed_read, 0, 3);
	tcase_add_test(tc, start_while_stored);
	tcase_add_test(tc, start_l1_full);
	tcase_add_test(tc, running_other_layout);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(promote_suite)
