/* The persistent L2 tier end to end: store, commit, restart (SIGTERM and
 * kill -9), hits from L2, byte-exact retrieve into other blocks, corruption
 * turning into counted misses. Real server, 4 real rank processes. */
#include <check.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "harness.h"
#include "rank.h"

#define W 4
#define N 8
#define OBJS_PER_CHUNK (W * 2)

typedef struct world {
	kvt_server s;
	char l2[300];
	kvt_rank r[W];
	kvs_client *sched;
} world;

static void world_up(world *w)
{
	kvt_server_init(&w->s, "--ttl-ms", "3000", "--heartbeat-ms", "100", "--l1-size", "64M", NULL);
	snprintf(w->l2, sizeof(w->l2), "%s/l2", w->s.dir);
	snprintf(w->s.extra[w->s.n_extra++], sizeof(w->s.extra[0]), "--l2-path");
	snprintf(w->s.extra[w->s.n_extra++], sizeof(w->s.extra[0]), "%s", w->l2);
	snprintf(w->s.extra[w->s.n_extra++], sizeof(w->s.extra[0]), "--l2-size");
	snprintf(w->s.extra[w->s.n_extra++], sizeof(w->s.extra[0]), "256M");
	ck_assert_int_eq(kvt_server_start(&w->s), 0);
	w->sched = kvt_client(&w->s, "E", KVS_ROLE_SCHEDULER, 0, W, NULL, NULL);
	ck_assert_ptr_nonnull(w->sched);
	for (uint32_t i = 0; i < W; i++)
		ck_assert_int_eq(kvt_rank_start(&w->r[i], &w->s, "E", i, W), 0);
}

static void world_down(world *w)
{
	for (uint32_t i = 0; i < W; i++)
		kvt_rank_stop(&w->r[i]);
	kvs_client_close(w->sched);
	ck_assert_int_eq(kvt_server_stop(&w->s), 0);
	kvt_server_cleanup(&w->s);
}

static void all_do(world *w, kvt_cmd cmd, int want)
{
	for (uint32_t i = 0; i < W; i++) {
		kvt_res res;
		ck_assert_int_eq(kvt_rank_do(&w->r[i], &cmd, &res), 0);
		ck_assert_msg(res.code == want, "rank %u op %d: %s, want %s", i, cmd.op, kvs_strerror(res.code),
			      kvs_strerror(want));
	}
}

static uint64_t lookup(kvs_client *c, uint32_t prompt, uint32_t n, uint8_t *tiers)
{
	uint8_t keys[64 * 32];
	for (uint32_t k = 0; k < n; k++)
		kvt_key_p(prompt, k, keys + 32 * k);
	uint64_t hits = 99;
	if (kvs_lookup(c, keys, n, false, 0, 3000, &hits, tiers) != 0)
		return UINT64_MAX;
	return hits;
}

static void wait_reconnected(world *w, uint64_t times)
{
	for (uint32_t i = 0; i < W; i++) {
		kvt_res res = {0};
		kvt_cmd c = {.op = KVT_STATE};
		ck_assert(KVT_WAIT(kvt_rank_do(&w->r[i], &c, &res) == 0 && res.value >= times, 8000));
	}
	ck_assert(KVT_WAIT(kvt_stat(w->sched, "registrations") == W, 5000));
}

static void retrieve_verify(world *w, uint32_t prompt, uint32_t n, uint64_t job)
{
	all_do(w, (kvt_cmd){.op = KVT_RESET}, 0);
	all_do(w, (kvt_cmd){.op = KVT_RETRIEVE, .job = job, .prompt = prompt, .n_keys = n, .dst_base = 32}, 0);
	all_do(w, (kvt_cmd){.op = KVT_COMPLETE, .job = job, .ok = 1}, 0);
	for (uint32_t i = 0; i < W; i++) {
		kvt_res res;
		kvt_cmd v = {.op = KVT_VERIFY, .n_keys = n, .src_base = 0, .dst_base = 32};
		ck_assert_int_eq(kvt_rank_do(&w->r[i], &v, &res), 0);
		ck_assert_msg(res.value == 0, "rank %u: %llu bytes differ", i, (unsigned long long)res.value);
	}
}

START_TEST(restart_serves_from_l2)
{
	world w;
	world_up(&w);
	all_do(&w, (kvt_cmd){.op = KVT_STORE, .job = 1, .n_keys = N}, 0);
	all_do(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 1, .ok = 1}, 0);
	int st;
	ck_assert_int_eq(kvs_job_wait(w.sched, 1, 5000, &st), 0);
	ck_assert_int_eq(st, KVS_JOB_COMMITTED);
	ck_assert(KVT_WAIT(kvt_stat(w.sched, "l2_writes_committed") == N * OBJS_PER_CHUNK, 5000));
	ck_assert_uint_eq(kvt_stat(w.sched, "l2_objects"), N * OBJS_PER_CHUNK);
	ck_assert_int_eq(kvt_server_stop(&w.s), 0); /* SIGTERM */
	/* the scheduler asks right away: geometry comes from L2, not from ranks */
	uint64_t t0 = kvt_now_ms();
	ck_assert_int_eq(kvt_server_start(&w.s), 0);
	uint8_t tiers[N];
	ck_assert(KVT_WAIT(lookup(w.sched, 0, N, tiers) == N, 5000));
	fprintf(stderr, "restart to first L2 hit: %llu ms\n", (unsigned long long)(kvt_now_ms() - t0));
	for (int i = 0; i < N; i++)
		ck_assert_int_eq(tiers[i], KVS_TIER_L2);
	wait_reconnected(&w, 1);
	/* byte-exact into other blocks, promoted through L1 */
	retrieve_verify(&w, 0, N, 2);
	ck_assert_uint_eq(kvt_stat(w.sched, "l2_promotions"), N * OBJS_PER_CHUNK);
	ck_assert_uint_eq(lookup(w.sched, 0, N, tiers), N);
	ck_assert_int_eq(tiers[0], KVS_TIER_L1); /* promoted */
	ck_assert_uint_eq(kvt_stat(w.sched, "l2_checksum_failures"), 0);
	/* prefetch promotes in the background */
	all_do(&w, (kvt_cmd){.op = KVT_STORE, .job = 3, .prompt = 1, .n_keys = 2}, 0);
	all_do(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 3, .ok = 1}, 0);
	ck_assert(KVT_WAIT(kvt_stat(w.sched, "l2_writes_committed") >= N * OBJS_PER_CHUNK + 2 * OBJS_PER_CHUNK, 5000) ||
		  kvt_stat(w.sched, "l2_objects") == (N + 2) * OBJS_PER_CHUNK);
	world_down(&w);
}
END_TEST

typedef struct killer {
	world *w;
	int delay_us;
	uint64_t observed; /* l2_writes_committed read just before the kill */
	atomic_int fired;
} killer;

static void *killer_main(void *p)
{
	killer *k = p;
	usleep((useconds_t)k->delay_us);
	kvs_client *c = kvt_client(&k->w->s, "K", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	k->observed = c ? kvt_stat(c, "l2_writes_committed") : 0;
	if (k->observed == UINT64_MAX)
		k->observed = 0;
	kill(k->w->s.pid, SIGKILL);
	atomic_store(&k->fired, 1);
	kvs_client_close(c);
	return NULL;
}

START_TEST(kill9_rounds)
{
	world w;
	world_up(&w);
	srandom(7);
	uint64_t total_durable = 0;
	for (uint32_t round = 1; round <= 20; round++) {
		killer k = {.w = &w, .delay_us = (int)(random() % 400000)};
		pthread_t t;
		pthread_create(&t, NULL, killer_main, &k);
		/* one-chunk store jobs in chunk order until the server dies */
		for (uint32_t c = 0; c < N && !atomic_load(&k.fired); c++) {
			uint64_t job = round * 100 + c;
			kvt_cmd s = {.op = KVT_STORE, .job = job, .prompt = round, .first_key = c, .n_keys = 1,
				     .block_chunk = c, .timeout_ms = 2000};
			kvt_cmd done = {.op = KVT_COMPLETE, .job = job, .ok = 1, .timeout_ms = 2000};
			for (uint32_t i = 0; i < W; i++) {
				kvt_res res;
				kvt_rank_do(&w.r[i], &s, &res);
			}
			for (uint32_t i = 0; i < W; i++) {
				kvt_res res;
				kvt_rank_do(&w.r[i], &done, &res);
			}
			int st;
			kvs_job_wait(w.sched, job, 2000, &st);
		}
		pthread_join(t, NULL);
		waitpid(w.s.pid, NULL, 0);
		w.s.pid = 0;
		/* writes are committed in queue order, which is chunk order here */
		uint32_t durable = (uint32_t)(k.observed / OBJS_PER_CHUNK);
		ck_assert_int_eq(kvt_server_start(&w.s), 0);
		uint8_t tiers[N];
		uint64_t hits = UINT64_MAX;
		/* the scheduler's session re-opens by itself first */
		ck_assert(KVT_WAIT((hits = lookup(w.sched, round, N, tiers)) != UINT64_MAX, 5000));
		ck_assert_msg(hits != UINT64_MAX && hits >= durable, "round %u: %llu hits, %u durable", round,
			      (unsigned long long)hits, durable);
		wait_reconnected(&w, round);
		if (hits) {
			/* everything served is byte-exact: never corrupt */
			retrieve_verify(&w, round, (uint32_t)hits, round * 100 + 99);
		}
		ck_assert_uint_eq(kvt_stat(w.sched, "l2_checksum_failures"), 0);
		total_durable += durable;
	}
	fprintf(stderr, "20 kill -9 rounds: %llu chunks known durable at kill time, all served byte-exact\n",
		(unsigned long long)total_durable);
	world_down(&w);
}
END_TEST

/* Finds needle in the file and flips one byte there; returns 0 if found. */
static int corrupt_file(const char *path, const uint8_t *needle, size_t n)
{
	int fd = open(path, O_RDWR);
	if (fd < 0)
		return -1;
	struct stat st;
	fstat(fd, &st);
	uint8_t *m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	int r = -1;
	if (m != MAP_FAILED) {
		uint8_t *hit = memmem(m, (size_t)st.st_size, needle, n);
		if (hit) {
			hit[n / 2] ^= 0x5a;
			r = 0;
		}
		msync(m, (size_t)st.st_size, MS_SYNC);
		munmap(m, (size_t)st.st_size);
	}
	close(fd);
	return r;
}

START_TEST(corruption_is_a_counted_miss)
{
	world w;
	world_up(&w);
	all_do(&w, (kvt_cmd){.op = KVT_STORE, .job = 1, .n_keys = 2}, 0);
	all_do(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 1, .ok = 1}, 0);
	ck_assert(KVT_WAIT(kvt_stat(w.sched, "l2_writes_committed") == 2 * OBJS_PER_CHUNK, 5000));
	/* rank 2's chunk 1, group 0 starts with block 4 of layer 0 */
	kvt_res peek;
	kvt_cmd pc = {.op = KVT_PEEK, .src_base = 4};
	ck_assert_int_eq(kvt_rank_do(&w.r[2], &pc, &peek), 0);
	ck_assert_int_eq(kvt_server_stop(&w.s), 0);
	char path[400];
	snprintf(path, sizeof(path), "%s/data.mdb", w.l2);
	ck_assert_int_eq(corrupt_file(path, peek.data, 64), 0);
	ck_assert_int_eq(kvt_server_start(&w.s), 0);
	wait_reconnected(&w, 1);
	/* presence is decided on headers: both chunks still look cached */
	ck_assert_uint_eq(lookup(w.sched, 0, 2, NULL), 2);
	/* reading chunk 1 back on rank 2 fails the checksum: a miss, nothing written */
	all_do(&w, (kvt_cmd){.op = KVT_RESET}, 0);
	kvt_res res;
	kvt_cmd rc = {.op = KVT_RETRIEVE, .job = 2, .n_keys = 2, .dst_base = 32};
	ck_assert_int_eq(kvt_rank_do(&w.r[2], &rc, &res), 0);
	ck_assert_int_eq(res.code, KVS_E_MISS);
	kvt_cmd v = {.op = KVT_VERIFY, .n_keys = 0};
	ck_assert_int_eq(kvt_rank_do(&w.r[2], &v, &res), 0);
	ck_assert_uint_eq(res.value, 0);
	ck_assert_uint_eq(kvt_stat(w.sched, "l2_checksum_failures"), 1);
	/* the corrupt object is dropped: lookup now stops before chunk 1 */
	ck_assert(KVT_WAIT(lookup(w.sched, 0, 2, NULL) == 1, 5000));
	ck_assert_uint_eq(kvt_stat(w.sched, "l2_objects"), 2 * OBJS_PER_CHUNK - 1);
	/* chunk 0 still serves byte-exact */
	retrieve_verify(&w, 0, 1, 3);
	world_down(&w);
}
END_TEST

static Suite *persist_suite(void)
{
	Suite *s = suite_create("persist");
	TCase *tc = tcase_create("l2");
	tcase_set_timeout(tc, 240);
	tcase_add_test(tc, restart_serves_from_l2);
	tcase_add_test(tc, corruption_is_a_counted_miss);
	tcase_add_test(tc, kill9_rounds);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(persist_suite)
