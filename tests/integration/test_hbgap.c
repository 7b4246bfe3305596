/* Heartbeats through a server restart (issue 15): 4 rank processes, each with
 * one registration of 16 memfd allocations, survive a kill -9 restart of the
 * real server. Each re-registers by itself (a broker push of its 16 fds and a
 * `register`) while its I/O thread keeps attending to heartbeats: the largest
 * delay between a heartbeat falling due and the I/O thread getting to it
 * (client stat client_heartbeat_delay_max_us, measured by libkvside) stays
 * under one heartbeat interval (50 ms). Twice: on a plain server, and on one
 * whose loop is slow to answer (see throttle_main) during the restore.
 *
 * The client before issue 15 pushed each fd from the I/O thread with a
 * blocking connect / send / reply wait, one connection per fd: on the 2-core
 * development machine its worst heartbeat per run was 228-543 ms late on the
 * slow server (10 runs of 10 failed) and up to 23 ms on the plain one; this
 * client's stay within 1-18 ms. Also checked: all 16 fds of a registration
 * travel in one broker record, and every registration is back afterwards. */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "harness.h"

#define RANKS 4
#define ALLOCS 16
#define ALLOC_BYTES (64u << 10)
#define HB_MS 100 /* heartbeat interval the server advises */

enum { CMD_STATS = 1, CMD_RECONNECTS, CMD_EXIT };

/* What a rank reports: its client's counters. */
typedef struct rank_res {
	int code;
	uint64_t reconnects;
	uint64_t hb_delay_max_us, heartbeats, broker_records, broker_fds;
} rank_res;

typedef struct rank {
	pid_t pid;
	int cmd, res;
} rank;

static int register_all(kvs_client *c)
{
	kvs_alloc al[ALLOCS];
	kvs_layer ly[ALLOCS];
	for (int i = 0; i < ALLOCS; i++) {
		void *p;
		if (kvs_memfd_create("kvt-hbgap", ALLOC_BYTES, &al[i].fd, &p) != 0)
			return -1;
		memset(p, i, ALLOC_BYTES);
		al[i].size = ALLOC_BYTES;
		memset(al[i].alloc_id, 0, 16); /* the library draws one */
		al[i].follows = false;
		/* one layer per allocation: 16 blocks of 4 KiB */
		ly[i] = (kvs_layer){.group = 0, .alloc = (uint32_t)i, .offset = 0, .num_blocks = 16,
				    .block_stride = 4096, .block_bytes = 4096};
	}
	kvs_group gr = {.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16,
			.blocks_per_chunk = 4, .window_chunks = -1, .null_block = -1};
	kvs_registration_desc d = {.device_type = KVS_DEV_HOST, .allocs = al, .n_allocs = ALLOCS,
				   .groups = &gr, .n_groups = 1, .layers = ly, .n_layers = ALLOCS};
	uint64_t h;
	int r = kvs_register(c, &d, 10000, &h);
	for (int i = 0; i < ALLOCS; i++)
		close(al[i].fd); /* the library keeps duplicates */
	return r;
}

static void stats_of(kvs_client *c, rank_res *res)
{
	static kvs_stat_out st[512];
	uint32_t n = 0;
	res->code = kvs_stats(c, 5000, st, 512, &n);
	res->reconnects = kvs_client_reconnects(c);
	res->hb_delay_max_us = kvs_stat_find(st, n, "client_heartbeat_delay_max_us");
	res->heartbeats = kvs_stat_find(st, n, "client_heartbeats");
	res->broker_records = kvs_stat_find(st, n, "client_broker_records");
	res->broker_fds = kvs_stat_find(st, n, "client_broker_fds");
}

static void rank_main(kvt_server *s, uint32_t r, int cmd_fd, int res_fd)
{
	kvs_client *c = kvt_client(s, "hbgap", KVS_ROLE_WORKER, r, RANKS, NULL, NULL);
	rank_res res = {.code = c ? register_all(c) : -1};
	if (write(res_fd, &res, sizeof(res)) != sizeof(res))
		_exit(2);
	int op;
	while (read(cmd_fd, &op, sizeof(op)) == sizeof(op) && op != CMD_EXIT) {
		memset(&res, 0, sizeof(res));
		if (op == CMD_STATS)
			stats_of(c, &res);
		else /* CMD_RECONNECTS: without asking the server */
			res.reconnects = kvs_client_reconnects(c);
		if (write(res_fd, &res, sizeof(res)) != sizeof(res))
			_exit(3);
	}
	kvs_client_close(c);
	_exit(0);
}

static void rank_start(rank *k, kvt_server *s, uint32_t r)
{
	int cp[2], rp[2];
	ck_assert_int_eq(pipe(cp), 0);
	ck_assert_int_eq(pipe(rp), 0);
	k->pid = fork();
	ck_assert_int_ge(k->pid, 0);
	if (k->pid == 0) {
		close(cp[1]);
		close(rp[0]);
		rank_main(s, r, cp[0], rp[1]);
	}
	close(cp[0]);
	close(rp[1]);
	k->cmd = cp[1];
	k->res = rp[0];
}

/* One exchange with a rank over its pipes (the harness's kvt_proc_call). */
static int rank_call(rank *k, const void *cmd, size_t cmd_len, void *res, size_t res_len, int timeout_ms)
{
	kvt_proc p = {.pid = k->pid, .cmd_fd = k->cmd, .res_fd = k->res};
	return kvt_proc_call(&p, cmd, cmd_len, res, res_len, timeout_ms);
}

static rank_res rank_stats(rank *k)
{
	int op = CMD_STATS;
	rank_res res;
	ck_assert_int_eq(rank_call(k, &op, sizeof(op), &res, sizeof(res), 10000), 0);
	ck_assert_int_eq(res.code, 0);
	return res;
}

static void rank_stop(rank *k)
{
	int op = CMD_EXIT;
	if (write(k->cmd, &op, sizeof(op)) != sizeof(op))
		kill(k->pid, SIGKILL);
	int st = 0;
	ck_assert_int_eq(waitpid(k->pid, &st, 0), k->pid);
	ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	close(k->cmd);
	close(k->res);
}

/* Slows the server down the way a loop stuck in long work is slow (an L2
 * presence check of many keys, a device synchronize): stopped 40 ms, then
 * running for 0.5 ms, over and over (SIGSTOP / SIGCONT), from the moment it is
 * started until the test says stop. A client that waits for the broker's
 * answers on its I/O thread waits about one window per answer. */
#define THROTTLE_STOP_US 40000
#define THROTTLE_RUN_US 500
typedef struct throttle {
	kvt_server *s; /* its pid is read once kvt_server_start has forked */
	atomic_bool stop;
	pthread_t thr;
} throttle;

static void *throttle_main(void *arg)
{
	throttle *t = arg;
	while (!atomic_load(&t->stop)) {
		pid_t pid = __atomic_load_n(&t->s->pid, __ATOMIC_RELAXED);
		if (pid > 0)
			kill(pid, SIGSTOP);
		usleep(THROTTLE_STOP_US);
		if (pid > 0)
			kill(pid, SIGCONT);
		usleep(THROTTLE_RUN_US);
	}
	return NULL;
}

static bool all_reconnected(rank *k)
{
	for (uint32_t r = 0; r < RANKS; r++) {
		int op = CMD_RECONNECTS;
		rank_res res;
		ck_assert_int_eq(rank_call(&k[r], &op, sizeof(op), &res, sizeof(res), 10000), 0);
		if (res.reconnects < 1)
			return false;
	}
	return true;
}

static void restart_case(bool slow)
{
	kvt_server s;
	char hb[16];
	snprintf(hb, sizeof(hb), "%d", HB_MS);
	/* no prefault, small L1: the server's start-up should not eat the CPU the
	 * ranks' I/O threads need to be on time */
	kvt_server_init(&s, "--ttl-ms", "3000", "--heartbeat-ms", hb, "--l1-size", "64M",
			"--no-prefault", NULL);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	kvs_client *obs = kvt_client(&s, "hbgap-observer", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert_ptr_nonnull(obs);

	rank k[RANKS];
	for (uint32_t r = 0; r < RANKS; r++)
		rank_start(&k[r], &s, r);
	for (uint32_t r = 0; r < RANKS; r++) {
		rank_res res;
		ck_assert_int_eq(rank_call(&k[r], NULL, 0, &res, sizeof(res), 20000), 0);
		ck_assert_int_eq(res.code, 0);
	}
	ck_assert_uint_eq(kvt_stat(obs, "registrations"), RANKS);
	ck_assert_uint_eq(kvt_stat(obs, "imports"), RANKS * ALLOCS);
	for (uint32_t r = 0; r < RANKS; r++) {
		rank_res res = rank_stats(&k[r]);
		/* all 16 fds of the registration in one record, and one
		 * record before it: the job lane's socket (protocol.md §18) */
		ck_assert_uint_eq(res.broker_records, 2);
		ck_assert_uint_eq(res.broker_fds, ALLOCS + 1);
	}
	kvs_client_close(obs);

	kvt_server_kill(&s);
	throttle t = {.s = &s};
	atomic_init(&t.stop, false);
	/* under a wrapper (valgrind) the server starts too slowly to be slowed
	 * down further before it answers: throttled once it is up */
	bool wrapped = getenv("KVT_SERVER_WRAPPER") != NULL;
	if (slow && !wrapped)
		ck_assert_int_eq(pthread_create(&t.thr, NULL, throttle_main, &t), 0);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	if (slow && wrapped)
		ck_assert_int_eq(pthread_create(&t.thr, NULL, throttle_main, &t), 0);
	if (slow) {
		/* the whole restore runs on the slow server */
		bool ok = KVT_WAIT(all_reconnected(k), 20000);
		atomic_store(&t.stop, true);
		pthread_join(t.thr, NULL);
		kill(s.pid, SIGCONT);
		ck_assert_msg(ok, "the ranks did not re-open their sessions on the slow server");
	}
	obs = kvt_client(&s, "hbgap-observer", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert_ptr_nonnull(obs);
	/* every rank re-opens and re-registers by itself */
	ck_assert(KVT_WAIT(kvt_stat(obs, "registrations") == RANKS, 15000));
	ck_assert_uint_eq(kvt_stat(obs, "imports"), RANKS * ALLOCS);
	ck_assert(KVT_WAIT(kvt_stat(obs, "parked_fds") == 0, 5000));
	/* some heartbeats of the new sessions, so a late one would have shown */
	usleep(10 * (useconds_t)HB_MS * 1000);
	uint64_t worst = 0;
	for (uint32_t r = 0; r < RANKS; r++) {
		rank_res res = rank_stats(&k[r]);
		fprintf(stderr, "%s server, rank %u: reconnects %llu, heartbeats %llu, largest heartbeat "
			"delay %llu us (interval %d ms), broker records %llu, fds %llu\n",
			slow ? "slow" : "plain", r, (unsigned long long)res.reconnects,
			(unsigned long long)res.heartbeats, (unsigned long long)res.hb_delay_max_us, HB_MS,
			(unsigned long long)res.broker_records, (unsigned long long)res.broker_fds);
		ck_assert_uint_eq(res.reconnects, 1);
		ck_assert_uint_ne(res.hb_delay_max_us, UINT64_MAX);
		/* the registration and the lane, before and after the restart */
		ck_assert_uint_eq(res.broker_records, 4);
		ck_assert_uint_eq(res.broker_fds, 2 * ALLOCS + 2);
		if (res.hb_delay_max_us > worst)
			worst = res.hb_delay_max_us;
	}
	ck_assert_msg(worst < (uint64_t)HB_MS * 1000, "a heartbeat was %llu us late (interval %d ms)",
		      (unsigned long long)worst, HB_MS);
	ck_assert_uint_eq(kvt_stat(obs, "sessions_reaped"), 0);

	for (uint32_t r = 0; r < RANKS; r++)
		rank_stop(&k[r]);
	kvs_client_close(obs);
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
}

START_TEST(restart_keeps_heartbeats_on_time) { restart_case(false); }
END_TEST

START_TEST(restart_on_a_slow_server_keeps_heartbeats_on_time) { restart_case(true); }
END_TEST

static Suite *hbgap_suite(void)
{
	Suite *s = suite_create("heartbeat_gap");
	TCase *tc = tcase_create("restart");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, restart_keeps_heartbeats_on_time);
	tcase_add_test(tc, restart_on_a_slow_server_keeps_heartbeats_on_time);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(hbgap_suite)
