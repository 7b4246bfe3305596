/* A register that is slow on the server (issue 18) against the real server:
 * KVS_TEST_REGISTER_DELAY_MS makes the server's register work take 1.5 s on
 * its setup thread, a stand-in for a CUDA driver held by pinning at
 * start-up. While it is pending, another client's requests are answered at
 * once (the loop does not wait: the largest round trip stays far below the
 * delay), and a store and complete the same session sends before the
 * register's reply are held and handled after it, in order: the store finds
 * the registration and the job commits. No session is reaped or re-opened. */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "harness.h"

#define DELAY_MS 1500
#define NB 16
#define BLOCK 4096u
#define BPC 4

typedef struct reg_thr {
	kvs_client *c;
	kvs_registration_desc *d;
	int rc;
	uint64_t t_done;
} reg_thr;

static void *reg_main(void *arg)
{
	reg_thr *t = arg;
	uint64_t h;
	t->rc = kvs_register(t->c, t->d, 10000, &h);
	t->t_done = kvt_now_ms();
	return NULL;
}

typedef struct codes {
	atomic_int n, part, complete;
} codes;

static void on_part(const kvs_result *r, void *arg)
{
	codes *c = arg;
	atomic_store(&c->part, r->code);
	atomic_fetch_add(&c->n, 1);
}

static void on_complete(const kvs_result *r, void *arg)
{
	codes *c = arg;
	atomic_store(&c->complete, r->code);
	atomic_fetch_add(&c->n, 1);
}

START_TEST(pending_register_holds_nothing_up)
{
	char d[16];
	snprintf(d, sizeof(d), "%d", DELAY_MS);
	setenv("KVS_TEST_REGISTER_DELAY_MS", d, 1);
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "2000", "--heartbeat-ms", "100", NULL);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	unsetenv("KVS_TEST_REGISTER_DELAY_MS");
	kvs_client *c = kvt_client(&s, "eng", KVS_ROLE_WORKER, 0, 1, NULL, NULL);
	kvs_client *probe = kvt_client(&s, "probe", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert_ptr_nonnull(c);
	ck_assert_ptr_nonnull(probe);

	kvs_alloc al = {.fd = -1, .size = (uint64_t)NB * BLOCK};
	uint8_t *mem;
	ck_assert_int_eq(kvs_memfd_create("kvt-regdefer", al.size, &al.fd, (void **)&mem), 0);
	memset(mem, 0x5A, al.size);
	kvs_group gr = {.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = BPC,
			.window_chunks = -1, .null_block = -1};
	kvs_layer ly = {.group = 0, .alloc = 0, .offset = 0, .num_blocks = NB, .block_stride = BLOCK,
			.block_bytes = BLOCK};
	kvs_registration_desc rd = {.device_type = KVS_DEV_HOST, .allocs = &al, .n_allocs = 1, .groups = &gr,
				    .n_groups = 1, .layers = &ly, .n_layers = 1};
	reg_thr rt = {.c = c, .d = &rd};
	uint64_t t0 = kvt_now_ms();
	pthread_t th;
	ck_assert_int_eq(pthread_create(&th, NULL, reg_main, &rt), 0);

	/* sent while the register is pending on the server: held behind it */
	usleep(300000);
	uint8_t key[32];
	memset(key, 7, sizeof(key));
	int64_t ids[BPC] = {0, 1, 2, 3};
	const int64_t *lists[1] = {ids};
	uint32_t len = BPC;
	kvs_blocks bl = {.n_groups = 1, .ids = lists, .len = &len};
	codes cd = {0};
	ck_assert_int_eq(kvs_store_async(c, 42, key, 1, &bl, NULL, 10000, on_part, &cd), 0);
	ck_assert_int_eq(kvs_complete_async(c, 42, true, 10000, on_complete, &cd), 0);

	/* the loop answers others meanwhile */
	uint64_t worst = 0, probes = 0;
	while (kvt_now_ms() - t0 < DELAY_MS - 200) {
		uint64_t a = kvt_now_ms();
		ck_assert_uint_ne(kvt_stat(probe, "sessions"), UINT64_MAX);
		uint64_t rtt = kvt_now_ms() - a;
		worst = rtt > worst ? rtt : worst;
		probes++;
		usleep(20000);
	}
	pthread_join(th, NULL);
	ck_assert_int_eq(rt.rc, 0);
	ck_assert_uint_ge(rt.t_done - t0, DELAY_MS - 50); /* it was pending that long */
	ck_assert_uint_gt(probes, 10);
	ck_assert_msg(worst < DELAY_MS / 3, "a request waited %llu ms while a register was pending",
		      (unsigned long long)worst);

	int st = 0;
	ck_assert_int_eq(kvs_job_wait(c, 42, 10000, &st), 0);
	ck_assert_int_eq(st, KVS_JOB_COMMITTED);
	ck_assert(KVT_WAIT(atomic_load(&cd.n) == 2, 5000));
	ck_assert_int_eq(atomic_load(&cd.part), 0);
	ck_assert_int_eq(atomic_load(&cd.complete), 0);
	ck_assert_uint_eq(kvt_stat(probe, "sessions_reaped"), 0);
	ck_assert_uint_eq(kvs_client_reconnects(c), 0);
	ck_assert_uint_eq(kvt_stat(probe, "l1_objects"), 1);

	kvs_client_close(c);
	kvs_client_close(probe);
	close(al.fd);
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
}
END_TEST

/* The CUDA engine is made on the setup thread after the socket is bound
 * (issue 18: the driver's start kept restart -> first L2 hit above 250 ms).
 * KVS_TEST_ENGINE_DELAY_MS makes that take 1.5 s. Meanwhile the server
 * answers at once, a host-memory register goes through, and a CUDA register
 * waits for the engine instead of being refused for a missing GPU too early:
 * here, without a GPU, it is answered E_DEVICE only once the engine is known
 * to be absent, and the session's request behind it is held and answered
 * after it. */
START_TEST(cuda_register_waits_for_the_engine)
{
	setenv("KVS_TEST_ENGINE_DELAY_MS", "1500", 1);
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "2000", "--heartbeat-ms", "100", NULL);
	uint64_t t0 = kvt_now_ms();
	ck_assert_int_eq(kvt_server_start(&s), 0);
	unsetenv("KVS_TEST_ENGINE_DELAY_MS");
	ck_assert_msg(kvt_now_ms() - t0 < 1200, "the server listened only after %llu ms",
		      (unsigned long long)(kvt_now_ms() - t0));
	kvs_client *gpu = kvt_client(&s, "eng", KVS_ROLE_WORKER, 0, 2, NULL, NULL);
	kvs_client *host = kvt_client(&s, "eng2", KVS_ROLE_WORKER, 0, 1, NULL, NULL);
	kvs_client *probe = kvt_client(&s, "probe", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert_ptr_nonnull(gpu);
	ck_assert_ptr_nonnull(host);
	ck_assert_ptr_nonnull(probe);
	bool had_gpu = kvt_stat(probe, "cuda_available") == 1; /* engine made already: no pending window */

	kvs_group gr = {.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = BPC,
			.window_chunks = -1, .null_block = -1};
	kvs_layer ly = {.group = 0, .alloc = 0, .offset = 0, .num_blocks = NB, .block_stride = BLOCK,
			.block_bytes = BLOCK};
	/* a CUDA register by legacy IPC handle: no fd, no broker, nothing the
	 * client needs a GPU for */
	kvs_alloc ga = {.fd = -1, .size = (uint64_t)NB * BLOCK};
	memset(ga.ipc_handle, 0x11, sizeof(ga.ipc_handle));
	kvs_registration_desc gd = {.device_type = KVS_DEV_CUDA, .allocs = &ga, .n_allocs = 1, .groups = &gr,
				    .n_groups = 1, .layers = &ly, .n_layers = 1};
	reg_thr rt = {.c = gpu, .d = &gd};
	pthread_t th;
	ck_assert_int_eq(pthread_create(&th, NULL, reg_main, &rt), 0);
	usleep(100000);
	codes cd = {0};
	ck_assert_int_eq(kvs_complete_async(gpu, 77, true, 10000, on_complete, &cd), 0); /* held behind it */

	/* host memory registers at once, and the loop answers */
	kvs_alloc al = {.fd = -1, .size = (uint64_t)NB * BLOCK};
	uint8_t *mem;
	ck_assert_int_eq(kvs_memfd_create("kvt-engwait", al.size, &al.fd, (void **)&mem), 0);
	kvs_registration_desc hd = {.device_type = KVS_DEV_HOST, .allocs = &al, .n_allocs = 1, .groups = &gr,
				    .n_groups = 1, .layers = &ly, .n_layers = 1};
	uint64_t a = kvt_now_ms(), h;
	ck_assert_int_eq(kvs_register(host, &hd, 10000, &h), 0);
	uint64_t host_ms = kvt_now_ms() - a;
	a = kvt_now_ms();
	ck_assert_uint_ne(kvt_stat(probe, "sessions"), UINT64_MAX);
	uint64_t probe_ms = kvt_now_ms() - a;
	if (!had_gpu) {
		ck_assert_msg(host_ms < 500, "a host register took %llu ms while the engine was made",
			      (unsigned long long)host_ms);
		ck_assert_msg(probe_ms < 500, "a request took %llu ms while the engine was made",
			      (unsigned long long)probe_ms);
		ck_assert_uint_eq(kvt_stat(probe, "cuda_available"), 0);
	}

	pthread_join(th, NULL);
	if (kvt_stat(probe, "cuda_available") == 0) {
		ck_assert_int_eq(rt.rc, KVS_E_DEVICE); /* answered once the engine was known absent */
		if (!had_gpu)
			ck_assert_uint_ge(rt.t_done - t0, 1400);
	}
	/* the complete held behind the register was answered after it, in order */
	ck_assert(KVT_WAIT(atomic_load(&cd.n) == 1, 5000));
	ck_assert_int_ne(atomic_load(&cd.complete), 0); /* no such job part: refused, not lost */
	ck_assert_uint_eq(kvt_stat(probe, "sessions_reaped"), 0);

	kvs_client_close(gpu);
	kvs_client_close(host);
	kvs_client_close(probe);
	close(al.fd);
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
}
END_TEST

static Suite *regslow_suite(void)
{
	Suite *s = suite_create("regslow");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, pending_register_holds_nothing_up);
	tcase_add_test(tc, cuda_register_waits_for_the_engine);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(regslow_suite)
