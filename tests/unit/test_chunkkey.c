/* Unit tests for chunk keys (common/kvs_chunkkey.c): golden vectors (computed
 * once and cross-checked against an independent BLAKE2b implementation of the
 * spec in kvs_chunkkey.h), identity across processes, the prefix property,
 * namespace separation, change propagation down the chain, partial trailing
 * chunks, argument errors and the max_keys cap. */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_chunkkey.h"

#define NS "llama-3-8b:v1"
#define KEY 32

static void hex(const uint8_t *k, char out[2 * KEY + 1])
{
	for (int i = 0; i < KEY; i++)
		snprintf(out + 2 * i, 3, "%02x", k[i]);
}

static void check_golden(const char *ns, const uint32_t *tokens, size_t n, uint32_t chunk,
			 const char *const *want, long n_want)
{
	uint8_t out[KEY * 8];
	memset(out, 0xee, sizeof(out));
	long r = kvs_chunk_keys(ns, strlen(ns), tokens, n, chunk, out, 8);
	ck_assert_int_eq(r, n_want);
	for (long i = 0; i < n_want; i++) {
		char h[2 * KEY + 1];
		hex(out + KEY * i, h);
		ck_assert_str_eq(h, want[i]);
	}
	/* nothing written past the last key */
	for (size_t i = (size_t)KEY * (size_t)n_want; i < sizeof(out); i++)
		ck_assert_uint_eq(out[i], 0xee);
}

START_TEST(golden_sequential)
{
	static const char *const want[] = {
		"66e48d15aa71c376e2d245ead377c784574a4b0e3b3349ac346c3e08e5df19cb",
		"38db133f8e5be3c958308c3ab3866eeac66e0d48fd4e2cc7bcd236ec70e62521",
		"233c7eb05f1118603c002ae685174b887b87aac8518eb40faa297586e938a9ad",
		"1cdbea76260c192bf2da2cc52f9ae1b87fb4a5fc24e727a99d25346148689e6f",
	};
	uint32_t t[1024];
	for (uint32_t i = 0; i < 1024; i++)
		t[i] = i;
	check_golden(NS, t, 1024, 256, want, 4);
}
END_TEST

START_TEST(golden_strided_partial)
{
	/* 600 tokens, chunk 128: 4 keys, the trailing 88 tokens get none */
	static const char *const want[] = {
		"9b38471da98512ded74ba0abb69ea63068ace0bdaf175a6982432c7d8338590a",
		"fe65bfdc1d94a4032242384fdda80bd1454615b926051eb5fa02934f77699474",
		"c22ca7a2429bc6eb50393dfc7957f6b45175e6d662150160cf9b250ecba68eff",
		"e61332a59b17c87269fb9a76a8dec18e0e77a4f7f661a3921267d51d49e63734",
	};
	uint32_t t[600];
	for (uint32_t i = 0; i < 600; i++)
		t[i] = i * 7 + 3;
	check_golden(NS, t, 600, 128, want, 4);
}
END_TEST

START_TEST(golden_empty_ns_wide_tokens)
{
	/* empty namespace; chunk 300 crosses the implementation's 256-token
	 * staging buffer; tokens with high bytes pin the little-endian encoding */
	static const char *const want[] = {
		"2eca2b5b64b96f7a8bcb324f0bc5ce08741dedad989bb8f3f1da69ddc3e1916b",
		"3aa6d2fd72c2d39a19273959fcc0e3ecef10334aaa0765b211d1920b1ad2d1b5",
		"c687ebb29cfcc9e9fcb02dd9e9ddb80f51f2ad7a7e0a461a63e12ec22d768e51",
		"9f467b13476c1301483fbd33e02006c68296ba2e06a678c87514a8e9d729ae72",
	};
	static const uint32_t pat[4] = {0xdeadbeefu, 0x01020304u, 0xffffffffu, 0};
	uint32_t t[1200];
	for (uint32_t i = 0; i < 1200; i++)
		t[i] = pat[i % 4];
	check_golden("", t, 1200, 300, want, 4);
}
END_TEST

START_TEST(same_across_processes)
{
	uint32_t t[1000];
	for (uint32_t i = 0; i < 1000; i++)
		t[i] = i * 2654435761u;
	int fds[2];
	ck_assert_int_eq(pipe(fds), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		close(fds[0]);
		uint8_t k[KEY * 7];
		long r = kvs_chunk_keys(NS, strlen(NS), t, 1000, 128, k, 7);
		if (r != 7)
			_exit(2);
		size_t off = 0;
		while (off < sizeof(k)) {
			ssize_t w = write(fds[1], k + off, sizeof(k) - off);
			if (w <= 0)
				_exit(3);
			off += (size_t)w;
		}
		_exit(0);
	}
	close(fds[1]);
	uint8_t child[KEY * 7], mine[KEY * 7];
	size_t off = 0;
	while (off < sizeof(child)) {
		ssize_t r = read(fds[0], child + off, sizeof(child) - off);
		ck_assert_int_gt(r, 0);
		off += (size_t)r;
	}
	char extra;
	ck_assert_int_eq(read(fds[0], &extra, 1), 0); /* exactly 7 keys */
	close(fds[0]);
	int status;
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status));
	ck_assert_int_eq(WEXITSTATUS(status), 0);
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 1000, 128, mine, 7), 7);
	ck_assert_mem_eq(child, mine, sizeof(mine));
	/* and repeatable within one process */
	uint8_t again[KEY * 7];
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 1000, 128, again, 7), 7);
	ck_assert_mem_eq(again, mine, sizeof(mine));
}
END_TEST

START_TEST(prefix_property)
{
	uint32_t t[2048];
	for (uint32_t i = 0; i < 2048; i++)
		t[i] = (i * 31u) ^ 0x5a5a5a5au;
	uint8_t full[KEY * 8];
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 2048, 256, full, 8), 8);
	for (size_t k = 0; k <= 8; k++) {
		uint8_t part[KEY * 8];
		/* the first k chunks plus a partial tail that must not matter */
		size_t n = k * 256 + (k < 8 ? 100 : 0);
		ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, n, 256, part, 8), (long)k);
		if (k)
			ck_assert_mem_eq(part, full, KEY * k);
	}
	/* all 8 keys distinct */
	for (int i = 0; i < 8; i++)
		for (int j = i + 1; j < 8; j++)
			ck_assert(memcmp(full + KEY * i, full + KEY * j, KEY) != 0);
}
END_TEST

START_TEST(namespaces_separate)
{
	uint32_t t[1024];
	for (uint32_t i = 0; i < 1024; i++)
		t[i] = i;
	static const char *const ns[] = {NS, "llama-3-8b:v2", "", "llama-3-8b:v1 "};
	uint8_t k[4][KEY * 4];
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(kvs_chunk_keys(ns[i], strlen(ns[i]), t, 1024, 256, k[i], 4), 4);
	for (int a = 0; a < 4; a++)
		for (int b = a + 1; b < 4; b++)
			for (int c = 0; c < 4; c++)
				ck_assert_msg(memcmp(k[a] + KEY * c, k[b] + KEY * c, KEY) != 0,
					      "ns %d and %d share key %d", a, b, c);
	/* ns_len counts: a prefix of the namespace string is another namespace */
	uint8_t shortns[KEY * 4];
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS) - 1, t, 1024, 256, shortns, 4), 4);
	for (int c = 0; c < 4; c++)
		ck_assert(memcmp(shortns + KEY * c, k[0] + KEY * c, KEY) != 0);
}
END_TEST

START_TEST(change_propagates_forward_only)
{
	uint32_t t[1024];
	for (uint32_t i = 0; i < 1024; i++)
		t[i] = i + 17;
	uint8_t base[KEY * 4];
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 1024, 256, base, 4), 4);
	for (int j = 0; j < 4; j++) {
		/* first, middle and last token of chunk j */
		static const int at[] = {0, 128, 255};
		for (int a = 0; a < 3; a++) {
			uint32_t u[1024];
			memcpy(u, t, sizeof(u));
			u[256 * j + at[a]] ^= 1u << (5 * a + j);
			uint8_t k[KEY * 4];
			ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), u, 1024, 256, k, 4), 4);
			for (int c = 0; c < 4; c++) {
				bool same = memcmp(k + KEY * c, base + KEY * c, KEY) == 0;
				ck_assert_msg(same == (c < j), "chunk %d token %d: key %d same=%d", j, at[a], c,
					      (int)same);
			}
		}
	}
	/* a changed token in the partial tail changes nothing */
	uint32_t v[1100];
	memcpy(v, t, sizeof(t));
	for (int i = 1024; i < 1100; i++)
		v[i] = 1;
	uint8_t k1[KEY * 5], k2[KEY * 5];
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), v, 1100, 256, k1, 5), 4);
	v[1099] = 2;
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), v, 1100, 256, k2, 5), 4);
	ck_assert_mem_eq(k1, k2, KEY * 4);
	ck_assert_mem_eq(k1, base, KEY * 4);
}
END_TEST

START_TEST(partial_chunks_get_no_key)
{
	uint32_t t[512];
	for (uint32_t i = 0; i < 512; i++)
		t[i] = i;
	uint8_t k[KEY * 4];
	memset(k, 0xee, sizeof(k));
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 255, 256, k, 4), 0);
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 0, 256, k, 4), 0);
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), NULL, 0, 256, k, 4), 0);
	for (size_t i = 0; i < sizeof(k); i++)
		ck_assert_uint_eq(k[i], 0xee);
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 256, 256, k, 4), 1);
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 511, 256, k, 4), 1);
	ck_assert_uint_eq(k[KEY], 0xee);
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 512, 256, k, 4), 2);
	/* chunk of one token: one key per token */
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 3, 1, k, 4), 3);
}
END_TEST

START_TEST(invalid_chunk)
{
	uint32_t t[16] = {0};
	uint8_t k[KEY];
	memset(k, 0xee, sizeof(k));
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 16, 0, k, 1), -EINVAL);
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 0, 0, k, 1), -EINVAL);
	for (size_t i = 0; i < sizeof(k); i++)
		ck_assert_uint_eq(k[i], 0xee);
}
END_TEST

START_TEST(max_keys_cap)
{
	uint32_t t[1024];
	for (uint32_t i = 0; i < 1024; i++)
		t[i] = i;
	uint8_t all[KEY * 4];
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 1024, 256, all, 4), 4);
	for (size_t cap = 0; cap <= 6; cap++) {
		uint8_t k[KEY * 7];
		memset(k, 0xee, sizeof(k));
		long want = cap < 4 ? (long)cap : 4;
		ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 1024, 256, k, cap), want);
		ck_assert_mem_eq(k, all, KEY * (size_t)want);
		for (size_t i = KEY * (size_t)want; i < sizeof(k); i++)
			ck_assert_uint_eq(k[i], 0xee);
	}
	/* max_keys 0 with a NULL out buffer writes nothing */
	ck_assert_int_eq(kvs_chunk_keys(NS, strlen(NS), t, 1024, 256, NULL, 0), 0);
}
END_TEST

static Suite *chunkkey_suite(void)
{
	Suite *s = suite_create("chunkkey");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, golden_sequential);
	tcase_add_test(tc, golden_strided_partial);
	tcase_add_test(tc, golden_empty_ns_wide_tokens);
	tcase_add_test(tc, same_across_processes);
	tcase_add_test(tc, prefix_property);
	tcase_add_test(tc, namespaces_separate);
	tcase_add_test(tc, change_propagates_forward_only);
	tcase_add_test(tc, partial_chunks_get_no_key);
	tcase_add_test(tc, invalid_chunk);
	tcase_add_test(tc, max_keys_cap);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(chunkkey_suite)
