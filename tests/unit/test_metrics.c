/* Unit tests for the metrics endpoint (server/metrics.c) without a server:
 * the test thread plays the main loop and publishes snapshots, so a loop
 * that stops ticking can be simulated honestly (the HTTP thread keeps
 * running, only the publishes stop): /healthz goes 503 after stall_ms and
 * back to 200 at the next publish. Also: readiness, the text format, no torn
 * snapshots under concurrent publish and scrape, bind errors. */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_time.h"
#include "metrics.h"

static int http_get(unsigned port, int family, const char *path, char *body, size_t cap)
{
	int fd = socket(family, SOCK_STREAM, 0);
	ck_assert_int_ge(fd, 0);
	int r;
	if (family == AF_INET6) {
		struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port),
					  .sin6_addr = IN6ADDR_LOOPBACK_INIT};
		r = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
	} else {
		struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
		sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		r = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
	}
	ck_assert_int_eq(r, 0);
	char rq[256];
	int n = snprintf(rq, sizeof(rq), "GET %s HTTP/1.0\r\n\r\n", path);
	ck_assert_int_eq(write(fd, rq, (size_t)n), n);
	static _Thread_local char resp[1 << 18];
	size_t len = 0;
	for (;;) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		ck_assert_int_eq(poll(&p, 1, 5000), 1);
		ssize_t k = read(fd, resp + len, sizeof(resp) - 1 - len);
		ck_assert_int_ge(k, 0);
		if (k == 0)
			break;
		len += (size_t)k;
	}
	close(fd);
	resp[len] = '\0';
	int status = 0;
	ck_assert_int_eq(sscanf(resp, "HTTP/1.%*d %d", &status), 1);
	const char *b = strstr(resp, "\r\n\r\n");
	ck_assert_ptr_nonnull(b);
	snprintf(body, cap, "%s", b + 4);
	return status;
}

static kvs_metrics *start(uint64_t stall_ms)
{
	kvs_metrics_config c = {.listen = "127.0.0.1:0", .stall_ms = stall_ms, .version = "9.9.9"};
	kvs_metrics *m = NULL;
	ck_assert_int_eq(kvs_metrics_start(&c, &m), 0);
	ck_assert_uint_gt(kvs_metrics_port(m), 0);
	return m;
}

static void sample(kvs_metrics_snap *s, const char *name, uint64_t v)
{
	snprintf(s->s[s->n].name, sizeof(s->s[s->n].name), "%s", name);
	s->s[s->n++].value = v;
}

START_TEST(health_follows_the_publisher)
{
	kvs_metrics *m = start(300);
	unsigned port = kvs_metrics_port(m);
	char b[4096];
	/* nothing published yet */
	ck_assert_int_eq(http_get(port, AF_INET, "/healthz", b, sizeof(b)), 503);
	ck_assert_str_eq(b, "starting\n");
	static kvs_metrics_snap s;
	memset(&s, 0, sizeof(s));
	kvs_metrics_publish(m, &s, kvs_now_ms());
	ck_assert_int_eq(http_get(port, AF_INET, "/healthz", b, sizeof(b)), 200);
	ck_assert_str_eq(b, "ok\n");
	/* the "loop" stops publishing: within stall_ms still fine, then 503 */
	usleep(100000);
	ck_assert_int_eq(http_get(port, AF_INET, "/healthz", b, sizeof(b)), 200);
	usleep(350000);
	ck_assert_int_eq(http_get(port, AF_INET, "/healthz", b, sizeof(b)), 503);
	ck_assert_msg(strstr(b, "stalled: the main loop has not ticked for"), "%s", b);
	ck_assert_ptr_nonnull(strstr(b, "(limit 300 ms)"));
	ck_assert_int_eq(http_get(port, AF_INET, "/readyz", b, sizeof(b)), 503);
	/* metrics stay readable, and say how old they are */
	ck_assert_int_eq(http_get(port, AF_INET, "/metrics", b, sizeof(b)), 200);
	double age = -1;
	const char *a = strstr(b, "\nkvside_main_loop_tick_age_seconds ");
	ck_assert_ptr_nonnull(a);
	age = strtod(a + 35, NULL);
	ck_assert(age >= 0.4 && age < 5);
	/* ticking again: healthy at once */
	kvs_metrics_publish(m, &s, kvs_now_ms());
	ck_assert_int_eq(http_get(port, AF_INET, "/healthz", b, sizeof(b)), 200);
	/* readiness also follows draining */
	s.draining = true;
	kvs_metrics_publish(m, &s, kvs_now_ms());
	ck_assert_int_eq(http_get(port, AF_INET, "/readyz", b, sizeof(b)), 503);
	ck_assert_str_eq(b, "draining: new jobs are refused\n");
	ck_assert_int_eq(http_get(port, AF_INET, "/healthz", b, sizeof(b)), 200);
	s.draining = false;
	kvs_metrics_publish(m, &s, kvs_now_ms());
	ck_assert_int_eq(http_get(port, AF_INET, "/readyz", b, sizeof(b)), 200);
	ck_assert_int_eq(http_get(port, AF_INET, "/", b, sizeof(b)), 200);
	ck_assert_ptr_nonnull(strstr(b, "kvside-server 9.9.9"));
	ck_assert_int_eq(http_get(port, AF_INET, "/metrics/x", b, sizeof(b)), 404);
	kvs_metrics_stop(m);
}
END_TEST

START_TEST(format)
{
	static kvs_metrics_snap s;
	memset(&s, 0, sizeof(s));
	sample(&s, "sessions", 3);
	sample(&s, "hits_l1", 10);
	sample(&s, "hits_l2", 2);
	sample(&s, "loop_busy_us", 1500000);
	sample(&s, "errors.E_BADMSG", 4);   /* exported by op and code instead */
	sample(&s, "requests", 9);          /* likewise */
	sample(&s, "some.new-counter", 77); /* no family of its own */
	sample(&s, "server_pid", 4321);     /* build_info's labels */
	sample(&s, "server_epoch", 0xab12);
	sample(&s, "server_version", 1002003);
	sample(&s, "server_start_unix_ms", 1796400000500ull);
	sample(&s, "server_uptime_ms", 2500);
	s.requests[KVS_OP_STORE] = 5;
	s.requests[KVS_OP_NONE] = 1;
	s.errors[KVS_OP_STORE][KVS_E_NOSPACE - KVS_E_BASE] = 2;
	s.errors[KVS_OP_NONE][KVS_E_BADMSG - KVS_E_BASE] = 1;
	char *t = kvs_metrics_format(&s, 1234, "1.2.3");
	ck_assert_ptr_nonnull(t);
	static const char *const want[] = {
		"kvside_build_info{version=\"1.2.3\",pid=\"4321\",epoch=\"000000000000ab12\"} 1\n",
		"\nkvside_start_time_seconds 1796400000.500000\n",
		"\nkvside_uptime_seconds 2.500000\n",
		"\nkvside_main_loop_tick_age_seconds 1.234\n",
		"# TYPE kvside_requests_total counter\n",
		"\nkvside_requests_total{op=\"store\"} 5\n",
		"\nkvside_requests_total{op=\"unknown\"} 1\n",
		"\nkvside_requests_total{op=\"admin\"} 0\n",
		"\nkvside_errors_total{op=\"store\",code=\"E_NOSPACE\"} 2\n",
		"\nkvside_errors_total{op=\"unknown\",code=\"E_BADMSG\"} 1\n",
		"# HELP kvside_sessions Open client sessions.\n# TYPE kvside_sessions gauge\nkvside_sessions 3\n",
		"# TYPE kvside_lookup_hits_total counter\nkvside_lookup_hits_total{tier=\"l1\"} 10\n"
		"kvside_lookup_hits_total{tier=\"l2\"} 2\n",
		"\nkvside_loop_busy_seconds_total 1.500000\n",
		"# TYPE kvside_stat_some_new_counter untyped\nkvside_stat_some_new_counter 77\n",
	};
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
		ck_assert_msg(strstr(t, want[i]), "missing: %s", want[i]);
	ck_assert_ptr_null(strstr(t, "job_done"));       /* a push, never a request */
	ck_assert_ptr_null(strstr(t, "errors_E_BADMSG")); /* no duplicate of errors_total */
	ck_assert_ptr_null(strstr(t, "kvside_stat_requests"));
	ck_assert_ptr_null(strstr(t, "kvside_stat_server_")); /* pid, epoch, version: labels of build_info */
	ck_assert_ptr_null(strstr(t, "kvside_l2_queue_depth")); /* absent counters: no family */
	free(t);
}
END_TEST

/* A publisher writing snapshots whose every sample holds the same value,
 * and scrapers checking each scrape shows one value only. */
static atomic_bool stop_pub;
static void *publisher(void *arg)
{
	kvs_metrics *m = arg;
	static kvs_metrics_snap s;
	for (uint64_t v = 1; !atomic_load(&stop_pub); v++) {
		memset(&s, 0, sizeof(s));
		sample(&s, "sessions", v);
		sample(&s, "registrations", v);
		sample(&s, "imports", v);
		sample(&s, "l1_chunks", v);
		for (int op = 0; op < KVS_OP_COUNT_; op++)
			s.requests[op] = v;
		kvs_metrics_publish(m, &s, kvs_now_ms());
	}
	return NULL;
}

START_TEST(no_torn_snapshots)
{
	kvs_metrics *m = start(2000);
	pthread_t t;
	atomic_store(&stop_pub, false);
	ck_assert_int_eq(pthread_create(&t, NULL, publisher, m), 0);
	static char b[1 << 18];
	/* scrape once the first snapshot is in */
	for (int i = 0; i < 500 && http_get(kvs_metrics_port(m), AF_INET, "/healthz", b, sizeof(b)) != 200; i++)
		usleep(1000);
	uint64_t last = 0;
	for (int i = 0; i < 200; i++) {
		ck_assert_int_eq(http_get(kvs_metrics_port(m), AF_INET, "/metrics", b, sizeof(b)), 200);
		static const char *const keys[] = {"\nkvside_sessions ", "\nkvside_registrations ",
						   "\nkvside_imports ", "\nkvside_l1_chunks ",
						   "\nkvside_requests_total{op=\"hello\"} ",
						   "\nkvside_requests_total{op=\"admin\"} "};
		uint64_t v0 = 0;
		for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
			const char *p = strstr(b, keys[k]);
			ck_assert_ptr_nonnull(p);
			uint64_t v = strtoull(p + strlen(keys[k]), NULL, 10);
			if (k == 0)
				v0 = v;
			ck_assert_msg(v == v0, "torn snapshot: %s%llu vs %llu", keys[k], (unsigned long long)v,
				      (unsigned long long)v0);
		}
		ck_assert_uint_ge(v0, last); /* never goes back */
		last = v0;
	}
	atomic_store(&stop_pub, true);
	pthread_join(t, NULL);
	kvs_metrics_stop(m);
}
END_TEST

START_TEST(bind_errors)
{
	kvs_metrics *m = start(2000), *m2 = NULL;
	char spec[64];
	snprintf(spec, sizeof(spec), "127.0.0.1:%u", kvs_metrics_port(m));
	kvs_metrics_config c = {.listen = spec, .stall_ms = 1000};
	ck_assert_int_eq(kvs_metrics_start(&c, &m2), -EADDRINUSE);
	ck_assert_ptr_null(m2);
	c.listen = "127.0.0.1";
	ck_assert_int_eq(kvs_metrics_start(&c, &m2), -EINVAL);
	c.listen = "[::1:80";
	ck_assert_int_eq(kvs_metrics_start(&c, &m2), -EINVAL);
	ck_assert_ptr_null(m2);
	kvs_metrics_stop(m);
	kvs_metrics_stop(NULL);
	/* IPv6 loopback, where the kernel has it */
	c.listen = "[::1]:0";
	int r = kvs_metrics_start(&c, &m2);
	if (r == -EADDRNOTAVAIL || r == -EAFNOSUPPORT) {
		fprintf(stderr, "no IPv6 loopback here: skipped\n");
		return;
	}
	ck_assert_int_eq(r, 0);
	static kvs_metrics_snap s;
	kvs_metrics_publish(m2, &s, kvs_now_ms());
	char b[256];
	ck_assert_int_eq(http_get(kvs_metrics_port(m2), AF_INET6, "/healthz", b, sizeof(b)), 200);
	kvs_metrics_stop(m2);
}
END_TEST

static Suite *metrics_suite(void)
{
	Suite *s = suite_create("metrics");
	TCase *tc = tcase_create("metrics");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, health_follows_the_publisher);
	tcase_add_test(tc, format);
	tcase_add_test(tc, no_torn_snapshots);
	tcase_add_test(tc, bind_errors);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(metrics_suite)
