/* Unit tests for the intrusive hash table (common/kvs_htab.c): basic
 * put/get/del, -EEXIST, growth, backward-shift deletion checked against a
 * reference array under random operations, and iteration with deletion. */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "kvs_htab.h"

/* Cheap checks for hot loops: Check's ck_assert_* report every passing
 * assertion to the parent process, which costs a write() each. */
#define REQUIRE(c)                                                             \
	do {                                                                   \
		if (!(c))                                                      \
			ck_abort_msg("line %d: %s", __LINE__, #c);             \
	} while (0)
#define EQ_PTR(a, b)                                                           \
	do {                                                                   \
		const void *a_ = (a), *b_ = (b);                               \
		if (a_ != b_)                                                  \
			ck_abort_msg("line %d: %s == %s: %p != %p", __LINE__,  \
				     #a, #b, a_, b_);                          \
	} while (0)
#define EQ_N(a, b)                                                             \
	do {                                                                   \
		long long a_ = (long long)(a), b_ = (long long)(b);            \
		if (a_ != b_)                                                  \
			ck_abort_msg("line %d: %s == %s: %lld != %lld",        \
				     __LINE__, #a, #b, a_, b_);                \
	} while (0)

/* The key sits in the middle of the struct so key_off matters. */
typedef struct ent {
	uint32_t before;
	uint8_t key[12];
	uint32_t idx;
	unsigned visits;
} ent;

static void set_key(ent *e, uint32_t k)
{
	memset(e->key, 0, sizeof(e->key));
	memcpy(e->key, &k, sizeof(k));
	e->key[11] = (uint8_t)(k * 7 + 1);
	e->idx = k;
	e->before = 0xdeadbeef;
	e->visits = 0;
}

static void key_bytes(uint8_t out[12], uint32_t k)
{
	ent e;
	set_key(&e, k);
	memcpy(out, e.key, 12);
}

static kvs_htab *mk(void)
{
	kvs_htab *t = NULL;
	EQ_N(kvs_htab_create(12, offsetof(ent, key), &t), 0);
	REQUIRE(t != NULL);
	EQ_N(kvs_htab_count(t), 0);
	return t;
}

static uint64_t rng_state = 0x853c49e6748fea9bull;
static uint64_t rnd(void)
{
	uint64_t x = rng_state;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return rng_state = x;
}

START_TEST(test_basic)
{
	kvs_htab *t = mk();
	ent a, b, a2;
	set_key(&a, 1);
	set_key(&b, 2);
	set_key(&a2, 1); /* same key, other object */
	uint8_t k[12];

	key_bytes(k, 1);
	EQ_PTR(kvs_htab_get(t, k), NULL);
	EQ_PTR(kvs_htab_del(t, k), NULL);
	EQ_N(kvs_htab_put(t, &a), 0);
	EQ_N(kvs_htab_put(t, &b), 0);
	EQ_N(kvs_htab_count(t), 2);
	EQ_PTR(kvs_htab_get(t, k), &a);
	EQ_PTR(kvs_htab_get(t, a2.key), &a); /* lookup by key bytes, not pointer */

	/* a second value with the same key is refused and changes nothing */
	EQ_N(kvs_htab_put(t, &a2), -EEXIST);
	EQ_N(kvs_htab_put(t, &a), -EEXIST);
	EQ_N(kvs_htab_count(t), 2);
	EQ_PTR(kvs_htab_get(t, k), &a);

	/* keys differing in one byte are different keys */
	key_bytes(k, 1);
	k[5] ^= 1;
	EQ_PTR(kvs_htab_get(t, k), NULL);
	k[5] ^= 1;

	EQ_PTR(kvs_htab_del(t, k), &a);
	EQ_N(kvs_htab_count(t), 1);
	EQ_PTR(kvs_htab_get(t, k), NULL);
	EQ_PTR(kvs_htab_del(t, k), NULL);
	EQ_PTR(kvs_htab_get(t, b.key), &b);
	/* the key is free again */
	EQ_N(kvs_htab_put(t, &a2), 0);
	EQ_PTR(kvs_htab_get(t, k), &a2);
	EQ_PTR(kvs_htab_del(t, b.key), &b);
	EQ_PTR(kvs_htab_del(t, a2.key), &a2);
	EQ_N(kvs_htab_count(t), 0);
	size_t pos = 0;
	EQ_PTR(kvs_htab_next(t, &pos), NULL);
	/* the values are untouched */
	EQ_N(a.before, 0xdeadbeef);
	EQ_N(a.idx, 1);
	kvs_htab_destroy(t);
	kvs_htab_destroy(NULL);
}
END_TEST

START_TEST(test_key_at_offset_zero_long_key)
{
	/* 32-byte keys at offset 0, as chunk keys are stored */
	struct ck {
		uint8_t key[32];
		int v;
	} e[64];
	kvs_htab *t = NULL;
	EQ_N(kvs_htab_create(32, 0, &t), 0);
	for (int i = 0; i < 64; i++) {
		memset(e[i].key, 0x11, 32);
		e[i].key[31] = (uint8_t)i; /* differ only in the last byte */
		e[i].v = i;
		EQ_N(kvs_htab_put(t, &e[i]), 0);
	}
	for (int i = 0; i < 64; i++) {
		struct ck *f = kvs_htab_get(t, e[i].key);
		EQ_PTR(f, &e[i]);
	}
	EQ_N(kvs_htab_count(t), 64);
	kvs_htab_destroy(t);
}
END_TEST

#define BIG 100000

START_TEST(test_growth)
{
	ent *v = calloc(BIG, sizeof(*v));
	REQUIRE(v != NULL);
	kvs_htab *t = mk();
	for (uint32_t i = 0; i < BIG; i++) {
		set_key(&v[i], i * 2654435761u);
		EQ_N(kvs_htab_put(t, &v[i]), 0);
		EQ_N(kvs_htab_count(t), i + 1);
		/* early entries stay findable across every resize */
		if ((i & (i - 1)) == 0)
			for (uint32_t j = 0; j <= i; j++)
				EQ_PTR(kvs_htab_get(t, v[j].key), &v[j]);
	}
	for (uint32_t i = 0; i < BIG; i++)
		EQ_PTR(kvs_htab_get(t, v[i].key), &v[i]);
	/* re-inserting any of them is refused */
	for (uint32_t i = 0; i < BIG; i += 997)
		EQ_N(kvs_htab_put(t, &v[i]), -EEXIST);
	EQ_N(kvs_htab_count(t), BIG);
	/* absent keys are absent (bytes 4..10 of every stored key are zero) */
	for (uint32_t i = 0; i < BIG; i += 7) {
		uint8_t k[12];
		memcpy(k, v[i].key, 12);
		k[4 + i % 7] = 1;
		EQ_PTR(kvs_htab_get(t, k), NULL);
	}
	/* delete every other one: the rest stay findable */
	for (uint32_t i = 0; i < BIG; i += 2)
		EQ_PTR(kvs_htab_del(t, v[i].key), &v[i]);
	EQ_N(kvs_htab_count(t), BIG / 2);
	for (uint32_t i = 0; i < BIG; i++) {
		void *f = kvs_htab_get(t, v[i].key);
		if (i % 2)
			EQ_PTR(f, &v[i]);
		else
			EQ_PTR(f, NULL);
	}
	/* iteration sees each remaining value exactly once */
	size_t pos = 0, n = 0;
	ent *e;
	while ((e = kvs_htab_next(t, &pos)) != NULL) {
		EQ_N(e->idx % 2, 1);
		EQ_N(e->visits, 0);
		e->visits++;
		n++;
	}
	EQ_N(n, BIG / 2);
	for (uint32_t i = 1; i < BIG; i += 2)
		EQ_N(v[i].visits, 1);
	/* empty it */
	for (uint32_t i = 1; i < BIG; i += 2)
		EQ_PTR(kvs_htab_del(t, v[i].key), &v[i]);
	EQ_N(kvs_htab_count(t), 0);
	pos = 0;
	EQ_PTR(kvs_htab_next(t, &pos), NULL);
	kvs_htab_destroy(t);
	free(v);
}
END_TEST

/* Random put/get/del against a reference "present" array. A small key space
 * keeps the table small (16 slots for up to 11 keys), so probe runs are long
 * and wrap around the end, which is where backward shifting goes wrong. */
static void random_ops(uint32_t nkeys, int ops, int full_check_every)
{
	ent *v = calloc(nkeys, sizeof(*v));
	bool *present = calloc(nkeys, sizeof(*present));
	REQUIRE(v != NULL);
	REQUIRE(present != NULL);
	for (uint32_t i = 0; i < nkeys; i++)
		set_key(&v[i], i * 40503u + 17);
	kvs_htab *t = mk();
	size_t count = 0;
	for (int op = 0; op < ops; op++) {
		uint32_t k = (uint32_t)(rnd() % nkeys);
		switch (rnd() % 3) {
		case 0:
			EQ_N(kvs_htab_put(t, &v[k]), present[k] ? -EEXIST : 0);
			if (!present[k])
				count++;
			present[k] = true;
			break;
		case 1:
			EQ_PTR(kvs_htab_del(t, v[k].key), present[k] ? &v[k] : NULL);
			if (present[k])
				count--;
			present[k] = false;
			break;
		default:
			EQ_PTR(kvs_htab_get(t, v[k].key), present[k] ? &v[k] : NULL);
			break;
		}
		EQ_N(kvs_htab_count(t), count);
		if (op % full_check_every == 0) {
			for (uint32_t i = 0; i < nkeys; i++)
				EQ_PTR(kvs_htab_get(t, v[i].key), present[i] ? &v[i] : NULL);
			size_t pos = 0, n = 0;
			ent *e;
			while ((e = kvs_htab_next(t, &pos)) != NULL) {
				REQUIRE(e >= v && e < v + nkeys);
				REQUIRE(present[e - v]);
				n++;
			}
			EQ_N(n, count);
		}
	}
	kvs_htab_destroy(t);
	free(v);
	free(present);
}

START_TEST(test_random_small)
{
	/* a fresh table (fresh SipHash key) each round */
	for (int round = 0; round < 200; round++)
		random_ops(11, 400, 1);
}
END_TEST

START_TEST(test_random_large)
{
	random_ops(5000, 200000, 997);
}
END_TEST

/* Iteration deleting a subset with kvs_htab_iter_del: every value is
 * visited (a kept value may be visited twice when a shift wraps), deleted
 * values are gone, kept ones still findable. */
static void iter_del_round(uint32_t n, int mode)
{
	ent *v = calloc(n, sizeof(*v));
	REQUIRE(v != NULL);
	kvs_htab *t = mk();
	for (uint32_t i = 0; i < n; i++) {
		set_key(&v[i], (uint32_t)rnd());
		v[i].idx = i;
		if (kvs_htab_put(t, &v[i]) != 0) { /* astronomically unlikely duplicate */
			set_key(&v[i], 0x80000000u + i);
			v[i].idx = i;
			EQ_N(kvs_htab_put(t, &v[i]), 0);
		}
	}
	size_t pos = 0;
	ent *e;
	size_t deleted = 0;
	while ((e = kvs_htab_next(t, &pos)) != NULL) {
		e->visits++;
		bool del = mode == 0 ? true : mode == 1 ? (e->idx % 2 == 0) : (rnd() % 3 == 0);
		if (del && e->visits == 1) {
			REQUIRE(pos >= 1);
			kvs_htab_iter_del(t, &pos);
			deleted++;
			e->before = 0; /* mark deleted */
		} else {
			/* a deleted value is never returned again */
			REQUIRE(e->before != 0);
		}
	}
	EQ_N(kvs_htab_count(t), n - deleted);
	for (uint32_t i = 0; i < n; i++) {
		if (v[i].visits < 1 || v[i].visits > 2)
			ck_abort_msg("value %u visited %u times", i, v[i].visits);
		if (v[i].before == 0)
			EQ_N(v[i].visits, 1);
		void *f = kvs_htab_get(t, v[i].key);
		EQ_PTR(f, v[i].before == 0 ? NULL : &v[i]);
	}
	if (mode == 0)
		EQ_N(kvs_htab_count(t), 0);
	/* a plain pass over what is left sees it exactly once */
	for (uint32_t i = 0; i < n; i++)
		v[i].visits = 0;
	pos = 0;
	size_t seen = 0;
	while ((e = kvs_htab_next(t, &pos)) != NULL) {
		EQ_N(e->visits, 0);
		e->visits++;
		seen++;
	}
	EQ_N(seen, n - deleted);
	kvs_htab_destroy(t);
	free(v);
}

START_TEST(test_iter_del)
{
	for (int mode = 0; mode < 3; mode++) {
		for (int round = 0; round < 300; round++)
			iter_del_round(11, mode); /* 16 slots: wrapping runs are common */
		for (int round = 0; round < 5; round++)
			iter_del_round(20000, mode);
	}
}
END_TEST

static Suite *htab_suite(void)
{
	Suite *s = suite_create("htab");
	TCase *tc = tcase_create("htab");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_basic);
	tcase_add_test(tc, test_key_at_offset_zero_long_key);
	tcase_add_test(tc, test_growth);
	tcase_add_test(tc, test_random_small);
	tcase_add_test(tc, test_random_large);
	tcase_add_test(tc, test_iter_del);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(htab_suite)
