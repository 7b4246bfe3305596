/* Spine integration tests: the real server and real client processes.
 * Sessions stay alive through heartbeats, dead clients are reaped within
 * ttl + 1 s, a server restart is noticed and the session re-opened, many
 * clients at once. */
#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <errno.h>
#include <sys/un.h>
#include <sys/socket.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "harness.h"

START_TEST(idle_session_outlives_ttl)
{
	kvt_server s;
	/* under valgrind a 500 ms lease was once lost on the 2-core CI machine
	 * (the session re-opened): there the lease is 1.5 s, still six of them */
	bool slow = getenv("KVT_SERVER_WRAPPER") != NULL;
	kvt_server_init(&s, "--ttl-ms", slow ? "1500" : "500", "--heartbeat-ms", "100", NULL);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	kvs_client *c = kvt_client(&s, "eng", KVS_ROLE_WORKER, 0, 1, NULL, NULL);
	ck_assert_ptr_nonnull(c);
	uint64_t sid = kvs_client_session(c);
	/* counted once ours is the only session: the harness's start-up
	 * probe, opened while a sanitizer build of the server is still
	 * prefaulting L1, can outlive this 500 ms lease (its open now also
	 * attaches a job lane); the ASan CI run also once counted a reap of a
	 * session that was still open when reaped0 was read (reaped 1 at the
	 * start, 2 at the end, ours kept), so wait for the others to go first.
	 * A reap of ours after that still fails below. */
	ck_assert(KVT_WAIT(kvt_stat(c, "sessions") == 1, 5000));
	uint64_t reaped0 = kvt_stat(c, "sessions_reaped");
	sleep(slow ? 9 : 3); /* six lease lengths, no application traffic */
	ck_assert_uint_eq(kvs_client_session(c), sid);
	ck_assert_uint_eq(kvs_client_reconnects(c), 0);
	ck_assert_uint_eq(kvt_stat(c, "sessions_reaped"), reaped0);
	ck_assert_uint_eq(kvt_stat(c, "sessions"), 1);
	kvs_client_close(c);
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
}
END_TEST

START_TEST(killed_client_is_reaped)
{
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "1000", "--heartbeat-ms", "200", NULL);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	kvs_client *obs = kvt_client(&s, "observer", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert_ptr_nonnull(obs);
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t child = fork();
	if (child == 0) {
		kvs_client *c = kvt_client(&s, "victim", KVS_ROLE_WORKER, 0, 1, NULL, NULL);
		char b = c ? 'y' : 'n';
		if (write(pfd[1], &b, 1) != 1)
			_exit(1);
		for (;;)
			pause();
	}
	char b = 0;
	ck_assert_int_eq(read(pfd[0], &b, 1), 1);
	ck_assert_int_eq(b, 'y');
	/* the harness's start-up probe says bye; under load that may lag */
	ck_assert(KVT_WAIT(kvt_stat(obs, "sessions") == 2, 3000));
	sleep(2); /* alive through heartbeats well past the ttl */
	ck_assert_uint_eq(kvt_stat(obs, "sessions"), 2);
	kill(child, SIGKILL);
	waitpid(child, NULL, 0);
	uint64_t t0 = kvt_now_ms();
	ck_assert(KVT_WAIT(kvt_stat(obs, "sessions") == 1, 3000));
	uint64_t took = kvt_now_ms() - t0;
	fprintf(stderr, "killed client reaped after %llu ms (ttl 1000)\n", (unsigned long long)took);
	ck_assert_uint_le(took, 1000 + 1000);
	ck_assert_uint_eq(kvt_stat(obs, "sessions_reaped"), 1);
	kvs_client_close(obs);
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
}
END_TEST

static atomic_int reconnected;
static void on_event(const kvs_event *ev, void *arg)
{
	(void)arg;
	if (ev->type == KVS_EVENT_RECONNECTED)
		atomic_fetch_add(&reconnected, 1);
}

START_TEST(server_restart_is_noticed)
{
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "2000", "--heartbeat-ms", "100", NULL);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	atomic_store(&reconnected, 0);
	kvs_client *c = kvt_client(&s, "eng", KVS_ROLE_WORKER, 0, 1, on_event, NULL);
	ck_assert_ptr_nonnull(c);
	uint64_t sid = kvs_client_session(c);
	/* restart between two heartbeats */
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	ck_assert(KVT_WAIT(atomic_load(&reconnected) == 1, 5000));
	ck_assert_uint_ne(kvs_client_session(c), sid);
	ck_assert_uint_eq(kvs_client_reconnects(c), 1);
	/* the re-opened session works */
	ck_assert_uint_ge(kvt_stat(c, "sessions"), 1);
	/* and a kill -9 restart too */
	kvt_server_kill(&s);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	ck_assert(KVT_WAIT(atomic_load(&reconnected) == 2, 5000));
	ck_assert_uint_ne(kvt_stat(c, "sessions"), UINT64_MAX);
	kvs_client_close(c);
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
}
END_TEST

#define N_CLIENTS 48
START_TEST(many_clients)
{
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "2000", "--heartbeat-ms", "100", NULL);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	int fds0 = kvt_fd_count(s.pid);
	kvs_client *c[N_CLIENTS];
	for (int i = 0; i < N_CLIENTS; i++) {
		char eng[32];
		snprintf(eng, sizeof(eng), "eng%d", i / 8);
		c[i] = kvt_client(&s, eng, KVS_ROLE_WORKER, (uint32_t)(i % 8), 8, NULL, NULL);
		ck_assert_ptr_nonnull(c[i]);
	}
	ck_assert(KVT_WAIT(kvt_stat(c[0], "sessions") == N_CLIENTS, 3000));
	sleep(1);
	for (int i = 0; i < N_CLIENTS; i++)
		ck_assert_uint_eq(kvt_stat(c[i], "sessions"), N_CLIENTS);
	for (int i = 0; i < N_CLIENTS; i++)
		kvs_client_close(c[i]);
	kvs_client *o = kvt_client(&s, "o", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert(KVT_WAIT(kvt_stat(o, "sessions") == 1, 3000));
	ck_assert_uint_eq(kvt_stat(o, "sessions_reaped"), 0);
	kvs_client_close(o);
	ck_assert(KVT_WAIT(kvt_fd_count(s.pid) <= fds0, 2000));
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
}
END_TEST

/* No server: the open fails within its time-out and says why
 * (kvs_last_error); a listener that never answers the hello times out. */
START_TEST(no_server_fails_fast)
{
	kvt_server s;
	kvt_server_init(&s, NULL);
	kvs_client_config cfg = {.broker_dir = s.run, .engine = "e", .ns = "n",
				 .role = KVS_ROLE_WORKER, .rank = 0, .world = 1, .timeout_ms = 300};
	kvs_client *c = NULL;
	uint64_t t0 = kvt_now_ms();
	ck_assert_int_eq(kvs_client_open(&cfg, &c), -ENOENT); /* no directory */
	ck_assert_ptr_nonnull(strstr(kvs_last_error(), "does not exist"));
	mkdir(s.run, 0700);
	ck_assert_int_eq(kvs_client_open(&cfg, &c), -ECONNREFUSED); /* no socket */
	ck_assert_ptr_nonnull(strstr(kvs_last_error(), "is not there"));
	ck_assert_ptr_null(c);
	ck_assert_uint_lt(kvt_now_ms() - t0, 2000);
	/* something listens but never speaks ZMTP: the hello times out */
	int l = socket(AF_UNIX, SOCK_STREAM, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	ck_assert_int_lt(strlen(s.run) + 12, sizeof(sa.sun_path));
	memcpy(sa.sun_path, s.run, strlen(s.run));
	memcpy(sa.sun_path + strlen(s.run), "/kvside.zmq", 12);
	ck_assert_int_eq(bind(l, (struct sockaddr *)&sa, sizeof(sa)), 0);
	ck_assert_int_eq(listen(l, 8), 0);
	t0 = kvt_now_ms();
	ck_assert_int_eq(kvs_client_open(&cfg, &c), KVS_E_TIMEOUT);
	ck_assert_ptr_nonnull(strstr(kvs_last_error(), "no answer from ipc://"));
	ck_assert_uint_lt(kvt_now_ms() - t0, 2000);
	close(l);
	kvt_server_cleanup(&s);
}
END_TEST

static Suite *spine_suite(void)
{
	Suite *s = suite_create("spine");
	TCase *tc = tcase_create("sessions");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, idle_session_outlives_ttl);
	tcase_add_test(tc, killed_client_is_reaped);
	tcase_add_test(tc, server_restart_is_noticed);
	tcase_add_test(tc, many_clients);
	tcase_add_test(tc, no_server_fails_fast);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(spine_suite)
