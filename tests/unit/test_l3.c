/* Unit tests for the L3 tier (storage/kvs_l3.c) through its backend seam,
 * with an in-memory store as the backend (no Redis: tests/l3 runs the tier
 * on a real cluster). The completions come back through a real completion
 * queue, run here as the server's loop runs it.
 *
 * Covers: write then read byte-exact, unsplit and split at and around the
 * part size (parts written last-to-first, part 0 last); probes (present with
 * the right geometry and length, absent otherwise, remembered by
 * kvs_l3_known); every refused record — a flipped data byte, another key in
 * the header, another version, another geometry, a truncated value, a value
 * longer than the object, a missing part, a value that is no record — a miss,
 * counted, deleted (not when of another geometry), the L1 buffer's bytes
 * never trusted; a store that cannot be reached (requests fail at once with
 * -EHOSTDOWN; a later connect succeeds); the write queue's bound (the oldest
 * job's latest chunk dropped first, completed with KVS_E_NOSPACE) and
 * kvs_l3_shed (cookies back, no completion); the second-hit policy; bad
 * configurations refused. */
#include <check.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_cq.h"
#include "kvs_error.h"
#include "kvs_l3.h"
#include "kvs_record.h"

#define GEOM 0x5eed5eed00000001ull
#define MAXV 512

/* ---- the in-memory backend ----------------------------------------------------- */

typedef struct mval {
	uint8_t key[160];
	size_t klen;
	uint8_t *val;
	size_t vlen;
} mval;

static struct {
	pthread_mutex_t mu;
	mval v[MAXV];
	int n;
	bool down;          /* open fails */
	int opens;
	int puts, gets, heads, dels;
	char put_order[64][160]; /* keys in put order (for the part order check) */
	size_t put_klen[64];
	pthread_mutex_t gate; /* held by a test: puts wait on it */
} m = {.mu = PTHREAD_MUTEX_INITIALIZER, .gate = PTHREAD_MUTEX_INITIALIZER};

static mval *find(const void *key, size_t klen)
{
	for (int i = 0; i < m.n; i++)
		if (m.v[i].klen == klen && memcmp(m.v[i].key, key, klen) == 0)
			return &m.v[i];
	return NULL;
}

static int f_open(const kvs_l3_config *cfg, void **conn, char *err, size_t errlen)
{
	pthread_mutex_lock(&m.mu);
	m.opens++;
	bool down = m.down;
	pthread_mutex_unlock(&m.mu);
	if (down) {
		snprintf(err, errlen, "fake store down");
		return -EHOSTDOWN;
	}
	*conn = &m;
	return 0;
}

static void f_close(void *conn) { (void)conn; }

static int f_put(void *conn, const void *key, size_t klen, const void *val, size_t vlen)
{
	pthread_mutex_lock(&m.gate);
	pthread_mutex_unlock(&m.gate);
	pthread_mutex_lock(&m.mu);
	if (m.puts < 64) {
		memcpy(m.put_order[m.puts], key, klen);
		m.put_klen[m.puts] = klen;
	}
	m.puts++;
	mval *e = find(key, klen);
	if (!e) {
		ck_assert_int_lt(m.n, MAXV);
		e = &m.v[m.n++];
		memcpy(e->key, key, klen);
		e->klen = klen;
		e->val = NULL;
	}
	free(e->val);
	e->val = malloc(vlen ? vlen : 1);
	memcpy(e->val, val, vlen);
	e->vlen = vlen;
	pthread_mutex_unlock(&m.mu);
	return 0;
}

static int f_get2(void *conn, const void *key, size_t klen, void *a, size_t alen, void *b, size_t blen,
		  size_t *ret_len)
{
	pthread_mutex_lock(&m.mu);
	m.gets++;
	mval *e = find(key, klen);
	int r = 0;
	if (!e) {
		r = KVS_E_MISS;
	} else if (e->vlen > alen + blen) {
		*ret_len = e->vlen;
		r = KVS_E_LIMIT;
	} else {
		size_t na = e->vlen < alen ? e->vlen : alen;
		memcpy(a, e->val, na);
		if (e->vlen > na)
			memcpy(b, e->val + na, e->vlen - na);
		*ret_len = e->vlen;
	}
	pthread_mutex_unlock(&m.mu);
	return r;
}

static int f_head_many(void *conn, const void *const *keys, const size_t *klens, size_t n, size_t hlen,
		       void *const *bufs, size_t *lens)
{
	pthread_mutex_lock(&m.mu);
	m.heads++;
	for (size_t i = 0; i < n; i++) {
		mval *e = find(keys[i], klens[i]);
		lens[i] = e ? (e->vlen < hlen ? e->vlen : hlen) : 0;
		if (e)
			memcpy(bufs[i], e->val, lens[i]);
	}
	pthread_mutex_unlock(&m.mu);
	return 0;
}

static int f_del(void *conn, const void *key, size_t klen)
{
	pthread_mutex_lock(&m.mu);
	m.dels++;
	mval *e = find(key, klen);
	int r = KVS_E_MISS;
	if (e) {
		free(e->val);
		*e = m.v[--m.n];
		r = 0;
	}
	pthread_mutex_unlock(&m.mu);
	return r;
}

static const char *f_last_error(void *conn) { return ""; }
static void f_stats(void *conn, kvs_l3_backend_stats *st) { st->refreshes += 1; }

static const kvs_l3_backend fake = {"fake", f_open, f_close, f_put, f_get2, f_head_many, f_del, f_last_error,
				    f_stats};

static void fake_reset(void)
{
	pthread_mutex_lock(&m.mu);
	for (int i = 0; i < m.n; i++)
		free(m.v[i].val);
	m.n = 0;
	m.down = false;
	m.opens = m.puts = m.gets = m.heads = m.dels = 0;
	pthread_mutex_unlock(&m.mu);
}

/* ---- fixture: the tier, a completion queue, collected completions ---------- */

typedef struct got {
	int op, result;
	kvs_objkey key;
	void *cookie;
	uint32_t n;
	bool present[64];
} got;

static struct {
	kvs_cq *cq;
	kvs_l3 *l3;
	got done[256];
	int n_done;
} f;

static void on_done(void *arg, const kvs_l3_done *d)
{
	ck_assert_int_lt(f.n_done, 256);
	got *g = &f.done[f.n_done++];
	*g = (got){.op = d->op, .result = d->result, .key = d->key, .cookie = d->cookie, .n = d->n};
	for (uint32_t i = 0; i < d->n && i < 64; i++)
		g->present[i] = d->present[i];
}

static void open_with(uint64_t part, int policy, uint32_t queue_max)
{
	fake_reset();
	f.n_done = 0;
	ck_assert_int_eq(kvs_cq_create(&f.cq), 0);
	kvs_l3_config c;
	kvs_l3_config_defaults(&c);
	c.backend = &fake;
	c.seeds = "fake:1";
	c.prefix = "t:";
	c.part_bytes = part;
	c.write_policy = policy;
	if (queue_max)
		c.queue_max = queue_max;
	c.cq = f.cq;
	c.on_done = on_done;
	char err[200];
	ck_assert_msg(kvs_l3_open(&c, &f.l3, err, sizeof(err)) == 0, "%s", err);
}

static void close_all(void)
{
	kvs_l3_close(f.l3);
	kvs_cq_destroy(f.cq);
	fake_reset();
}

/* Runs the queue until n completions have come (or 5 s). */
static void wait_done(int n)
{
	for (int i = 0; i < 500 && f.n_done < n; i++) {
		struct pollfd p = {kvs_cq_fd(f.cq), POLLIN, 0};
		poll(&p, 1, 10);
		kvs_cq_run(f.cq);
	}
	ck_assert_int_ge(f.n_done, n);
}

static kvs_objkey okey(int i)
{
	kvs_objkey k;
	memset(&k, 0, sizeof(k));
	for (size_t b = 0; b < sizeof(k); b++)
		((uint8_t *)&k)[b] = (uint8_t)(i * 31 + b * 7 + 1);
	return k;
}

static void fill(uint8_t *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)((i * 131u + seed * 17u) ^ (i >> 9));
}

static int write_sync(int i, const uint8_t *data, uint64_t len)
{
	kvs_objkey k = okey(i);
	int before = f.n_done;
	ck_assert_int_eq(kvs_l3_write_in(f.l3, &k, GEOM, data, len, (void *)(intptr_t)(1000 + i), 0, 0), 0);
	wait_done(before + 1);
	ck_assert_int_eq(f.done[before].op, KVS_L3_WRITE);
	return f.done[before].result;
}

static int read_sync(int i, uint8_t *dst, uint64_t len, uint64_t geom)
{
	kvs_objkey k = okey(i);
	int before = f.n_done;
	ck_assert_int_eq(kvs_l3_read(f.l3, &k, geom, dst, len, dst), 0);
	wait_done(before + 1);
	ck_assert_int_eq(f.done[before].op, KVS_L3_READ);
	ck_assert_ptr_eq(f.done[before].cookie, dst);
	return f.done[before].result;
}

/* The value of part `part` of object i in the fake store. */
static mval *stored(int i, uint32_t part)
{
	kvs_objkey k = okey(i);
	uint8_t key[160];
	memcpy(key, "t:", 2);
	memcpy(key + 2, &k, 64);
	size_t n = 66;
	if (part)
		n += (size_t)sprintf((char *)key + n, "#%u", part);
	return find(key, n);
}

/* ---- cases ---------------------------------------------------------------------- */

START_TEST(roundtrip_sizes)
{
	const uint64_t P = 64 << 10;
	open_with(P, KVS_L3_WRITE_ALL, 0);
	const uint64_t sizes[] = {1, 4096, P - 96 - 1, P - 96, P - 96 + 1, P, 3 * P + 5, 5 * P - 96};
	static uint8_t src[6 << 16], dst[6 << 16];
	for (int i = 0; i < (int)(sizeof(sizes) / sizeof(sizes[0])); i++) {
		fill(src, sizes[i], (unsigned)i);
		ck_assert_int_eq(write_sync(i, src, sizes[i]), 0);
		/* parts: 1 + ceil((len - (P - 96)) / P) when split; part 0 holds the header */
		uint64_t parts = sizes[i] + 96 <= P ? 1 : 1 + (sizes[i] - (P - 96) + P - 1) / P;
		mval *p0 = stored(i, 0);
		ck_assert_ptr_nonnull(p0);
		kvs_record_hdr h;
		memcpy(&h, p0->val, sizeof(h));
		ck_assert_uint_eq(h.len, sizes[i]);
		ck_assert_uint_eq(h.flags, parts > 1 ? 16 : 0);
		ck_assert_uint_eq(p0->vlen, parts > 1 ? P : sizes[i] + 96);
		for (uint32_t k = 1; k < parts; k++)
			ck_assert_ptr_nonnull(stored(i, k));
		ck_assert_ptr_null(stored(i, (uint32_t)parts));
		memset(dst, 0xaa, sizeof(dst));
		ck_assert_int_eq(read_sync(i, dst, sizes[i], GEOM), 0);
		ck_assert(memcmp(dst, src, sizes[i]) == 0);
		ck_assert_uint_eq(dst[sizes[i]], 0xaa);
	}
	/* part 0 is written last */
	pthread_mutex_lock(&m.mu);
	m.puts = 0;
	pthread_mutex_unlock(&m.mu);
	fill(src, 3 * P, 9);
	ck_assert_int_eq(write_sync(50, src, 3 * P), 0);
	ck_assert_int_eq(m.puts, 4);
	ck_assert_uint_eq(m.put_klen[3], 66);
	ck_assert_uint_gt(m.put_klen[0], 66);
	kvs_l3_stats st;
	kvs_l3_get_stats(f.l3, &st);
	ck_assert_uint_eq(st.writes, 9);
	ck_assert_uint_eq(st.reads, 8);
	ck_assert_uint_eq(st.read_misses + st.read_errors + st.corrupt, 0);
	ck_assert_uint_eq(st.connected, 3);
	close_all();
}
END_TEST

START_TEST(probe_and_known)
{
	open_with(64 << 10, KVS_L3_WRITE_ALL, 0);
	static uint8_t src[8192];
	fill(src, sizeof(src), 3);
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(write_sync(i, src, sizeof(src)), 0);
	kvs_objkey keys[8];
	uint64_t geoms[8], lens[8];
	for (int i = 0; i < 8; i++)
		keys[i] = okey(i), geoms[i] = GEOM, lens[i] = sizeof(src);
	geoms[2] = GEOM + 1; /* another layout: not present for this one */
	lens[3] = sizeof(src) - 1; /* another length */
	int before = f.n_done;
	ck_assert_int_eq(kvs_l3_probe(f.l3, keys, geoms, lens, 8, &f), 0);
	wait_done(before + 1);
	got *g = &f.done[before];
	ck_assert_int_eq(g->op, KVS_L3_PROBE);
	ck_assert_int_eq(g->result, 0);
	ck_assert_uint_eq(g->n, 8);
	bool want[8] = {true, true, false, false, false, false, false, false};
	for (int i = 0; i < 8; i++)
		ck_assert_msg(g->present[i] == want[i], "present[%d] = %d", i, g->present[i]);
	/* own writes and the probe's answers are remembered; the misfits not */
	ck_assert(kvs_l3_known(f.l3, &keys[0], GEOM, sizeof(src)));
	ck_assert(kvs_l3_known(f.l3, &keys[3], GEOM, sizeof(src))); /* written by this tier */
	ck_assert(!kvs_l3_known(f.l3, &keys[0], GEOM + 1, sizeof(src)));
	ck_assert(!kvs_l3_known(f.l3, &keys[5], GEOM, sizeof(src)));
	kvs_l3_stats st;
	kvs_l3_get_stats(f.l3, &st);
	ck_assert_uint_eq(st.probes, 1);
	ck_assert_uint_eq(st.probe_keys, 8);
	ck_assert_uint_eq(st.probe_hits, 2);
	ck_assert_uint_eq(st.corrupt, 2); /* the header of another layout and of another length */
	close_all();
}
END_TEST

enum { FLIP_DATA, OTHER_KEY, OTHER_VERSION, OTHER_GEOM, TRUNCATED, LONGER, PART_MISSING, NOT_A_RECORD };

START_TEST(refused_records)
{
	const uint64_t P = 64 << 10, LEN = 2 * P;
	open_with(P, KVS_L3_WRITE_ALL, 0);
	static uint8_t src[2 << 16], dst[2 << 16];
	int how = _i;
	fill(src, LEN, 5);
	ck_assert_int_eq(write_sync(7, src, LEN), 0);
	ck_assert_int_eq(write_sync(8, src, LEN), 0);
	pthread_mutex_lock(&m.mu);
	mval *p0 = stored(7, 0);
	kvs_record_hdr h;
	memcpy(&h, p0->val, sizeof(h));
	switch (how) {
	case FLIP_DATA:
		stored(7, 1)->val[100] ^= 1;
		break;
	case OTHER_KEY: /* object 8's record (valid for its key) put under 7's */
		free(p0->val);
		p0->vlen = stored(8, 0)->vlen;
		p0->val = malloc(p0->vlen);
		memcpy(p0->val, stored(8, 0)->val, p0->vlen);
		break;
	case OTHER_VERSION:
		h.version = 1;
		memcpy(p0->val, &h, sizeof(h));
		break;
	case OTHER_GEOM:
		break; /* read below with another geometry */
	case TRUNCATED:
		p0->vlen -= 10;
		break;
	case LONGER: { /* not split, and longer than the object */
		uint8_t *v = malloc(LEN + 200);
		h.flags = 0;
		memcpy(v, &h, sizeof(h));
		free(p0->val);
		p0->val = v;
		p0->vlen = LEN + 200;
		break;
	}
	case PART_MISSING: {
		mval *p1 = stored(7, 1);
		free(p1->val);
		*p1 = m.v[--m.n];
		break;
	}
	case NOT_A_RECORD:
		memset(p0->val, 'x', p0->vlen);
		break;
	}
	pthread_mutex_unlock(&m.mu);
	memset(dst, 0, sizeof(dst));
	ck_assert_int_eq(read_sync(7, dst, LEN, how == OTHER_GEOM ? GEOM + 1 : GEOM), KVS_E_MISS);
	kvs_l3_stats st;
	kvs_l3_get_stats(f.l3, &st);
	ck_assert_uint_eq(st.corrupt, 1);
	ck_assert_uint_eq(st.read_misses, 1);
	/* deleted (part 0), unless it was another layout's */
	pthread_mutex_lock(&m.mu);
	bool still = stored(7, 0) != NULL;
	pthread_mutex_unlock(&m.mu);
	ck_assert_int_eq(still, how == OTHER_GEOM);
	/* the untouched neighbour still reads */
	ck_assert_int_eq(read_sync(8, dst, LEN, GEOM), 0);
	ck_assert(memcmp(dst, src, LEN) == 0);
	close_all();
}
END_TEST

START_TEST(store_down_then_up)
{
	fake_reset();
	m.down = true;
	f.n_done = 0;
	ck_assert_int_eq(kvs_cq_create(&f.cq), 0);
	kvs_l3_config c;
	kvs_l3_config_defaults(&c);
	c.backend = &fake, c.seeds = "fake:1", c.cq = f.cq, c.on_done = on_done;
	char err[200];
	ck_assert_int_eq(kvs_l3_open(&c, &f.l3, err, sizeof(err)), 0); /* open does not wait for the store */
	static uint8_t buf[4096];
	kvs_objkey k = okey(1);
	uint64_t g = GEOM, l = sizeof(buf);
	ck_assert_int_eq(kvs_l3_probe(f.l3, &k, &g, &l, 1, NULL), 0);
	ck_assert_int_eq(kvs_l3_read(f.l3, &k, GEOM, buf, sizeof(buf), buf), 0);
	ck_assert_int_eq(kvs_l3_write_in(f.l3, &k, GEOM, buf, sizeof(buf), buf, 0, 0), 0);
	wait_done(3);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(f.done[i].result, -EHOSTDOWN);
	kvs_l3_stats st;
	kvs_l3_get_stats(f.l3, &st);
	ck_assert_uint_eq(st.connected, 0);
	ck_assert_uint_eq(st.probe_errors, 1);
	ck_assert_uint_eq(st.read_errors, 1);
	ck_assert_uint_eq(st.write_errors, 1);
	/* the store comes up: the next request after a second connects */
	pthread_mutex_lock(&m.mu);
	m.down = false;
	pthread_mutex_unlock(&m.mu);
	usleep(1100 * 1000);
	ck_assert_int_eq(write_sync(1, buf, sizeof(buf)), 0);
	close_all();
}
END_TEST

START_TEST(queue_bound_and_shed)
{
	open_with(64 << 10, KVS_L3_WRITE_ALL, 4);
	static uint8_t buf[4096];
	/* hold the writer on its first put so the queue fills behind it */
	pthread_mutex_lock(&m.gate);
	kvs_objkey k0 = okey(100);
	ck_assert_int_eq(kvs_l3_write_in(f.l3, &k0, GEOM, buf, sizeof(buf), (void *)1, 1, 0), 0);
	usleep(100 * 1000); /* the writer took it and waits on the gate */
	/* job 2: chunks 0..2, job 3: chunks 0..2 -> 6 queued, bound 4: job 2 loses 2 then 1 */
	for (int job = 2; job <= 3; job++)
		for (uint32_t c = 0; c < 3; c++) {
			kvs_objkey k = okey(job * 10 + (int)c);
			ck_assert_int_eq(kvs_l3_write_in(f.l3, &k, GEOM, buf, sizeof(buf),
							 (void *)(intptr_t)(job * 10 + (int)c), (uint64_t)job, c), 0);
		}
	kvs_cq_run(f.cq);
	ck_assert_int_eq(f.n_done, 2);
	ck_assert_ptr_eq(f.done[0].cookie, (void *)22);
	ck_assert_int_eq(f.done[0].result, KVS_E_NOSPACE);
	ck_assert_ptr_eq(f.done[1].cookie, (void *)21);
	/* shed: the same order, cookies back, no completion */
	void *cookies[8];
	ck_assert_uint_eq(kvs_l3_shed(f.l3, 2 * sizeof(buf), cookies, 8), 2);
	ck_assert_ptr_eq(cookies[0], (void *)20);
	ck_assert_ptr_eq(cookies[1], (void *)32);
	kvs_l3_stats st;
	kvs_l3_get_stats(f.l3, &st);
	ck_assert_uint_eq(st.write_drops, 4);
	ck_assert_uint_eq(st.queue_depth, 2);
	ck_assert_uint_eq(st.queue_bytes, 2 * sizeof(buf));
	pthread_mutex_unlock(&m.gate);
	wait_done(5); /* job 1's and job 3's two left */
	for (int i = 2; i < 5; i++)
		ck_assert_int_eq(f.done[i].result, 0);
	ck_assert_int_eq(f.n_done, 5);
	close_all();
}
END_TEST

START_TEST(second_hit)
{
	open_with(64 << 10, KVS_L3_WRITE_SECOND_HIT, 0);
	kvs_objkey a = okey(1), b = okey(2);
	ck_assert(!kvs_l3_admit(f.l3, &a));
	ck_assert(!kvs_l3_admit(f.l3, &b));
	ck_assert(kvs_l3_admit(f.l3, &a));
	ck_assert(!kvs_l3_admit(f.l3, &a)); /* counted again from its next use */
	static uint8_t buf[512];
	ck_assert_int_eq(write_sync(2, buf, sizeof(buf)), 0);
	ck_assert(!kvs_l3_admit(f.l3, &b)); /* held by L3 now: never again */
	close_all();
	open_with(64 << 10, KVS_L3_WRITE_NONE, 0);
	ck_assert(!kvs_l3_admit(f.l3, &a));
	ck_assert(!kvs_l3_admit(f.l3, &a));
	close_all();
	open_with(64 << 10, KVS_L3_WRITE_ALL, 0);
	ck_assert(kvs_l3_admit(f.l3, &a));
	close_all();
}
END_TEST

START_TEST(bad_config)
{
	kvs_l3_config c;
	kvs_l3 *l3 = NULL;
	char err[200];
	kvs_l3_config_defaults(&c);
	c.seeds = "x:1";
	ck_assert_int_eq(kvs_l3_open(&c, &l3, err, sizeof(err)), -EINVAL); /* no backend */
	ck_assert(strstr(err, "hiredis") != NULL);
	c.backend = &fake;
	c.part_bytes = (64 << 10) + 1;
	ck_assert_int_eq(kvs_l3_open(&c, &l3, err, sizeof(err)), -EINVAL);
	ck_assert(strstr(err, "power of two") != NULL);
	c.part_bytes = 32 << 10;
	ck_assert_int_eq(kvs_l3_open(&c, &l3, err, sizeof(err)), -EINVAL);
	c.part_bytes = 8 << 20;
	c.prefix = "0123456789012345678901234567890123456789012345678901234567890123";
	ck_assert_int_eq(kvs_l3_open(&c, &l3, err, sizeof(err)), -EINVAL);
	c.prefix = "ok:";
	c.seeds = "";
	ck_assert_int_eq(kvs_l3_open(&c, &l3, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(l3);
}
END_TEST

static Suite *l3_suite(void)
{
	Suite *s = suite_create("l3");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, roundtrip_sizes);
	tcase_add_test(tc, probe_and_known);
	tcase_add_loop_test(tc, refused_records, FLIP_DATA, NOT_A_RECORD + 1);
	tcase_add_test(tc, store_down_then_up);
	tcase_add_test(tc, queue_bound_and_shed);
	tcase_add_test(tc, second_hit);
	tcase_add_test(tc, bad_config);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(l3_suite)
