/* Unit tests for the Redis Cluster client's pure parts and its failures
 * without a cluster (storage/kvs_rcluster.c): CRC16 and key slots against the
 * Redis Cluster spec's vectors and hash-tag rules, seed parsing, a refused
 * seed, a seed that accepts but never answers (bounded by the time-outs).
 * Against a real cluster: tests/l3/test_rcluster.c (suite l3). */
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_error.h"
#include "kvs_rcluster.h"

static uint16_t slot_of(const char *s)
{
	return kvs_rcluster_keyslot(s, strlen(s));
}

START_TEST(crc16_vectors)
{
	/* the spec's check value for CRC16-XMODEM */
	ck_assert_uint_eq(kvs__rcluster_crc16("123456789", 9), 0x31C3);
	ck_assert_uint_eq(kvs__rcluster_crc16("", 0), 0);
	ck_assert_uint_eq(slot_of("123456789"), 0x31C3 % 16384);
	/* values Redis gives for CLUSTER KEYSLOT */
	ck_assert_uint_eq(slot_of("foo"), 12182);
	ck_assert_uint_eq(slot_of("bar"), 5061);
	ck_assert_uint_eq(slot_of(""), 0);
}
END_TEST

START_TEST(hash_tags)
{
	/* the spec's examples */
	ck_assert_uint_eq(slot_of("{user1000}.following"), slot_of("user1000"));
	ck_assert_uint_eq(slot_of("{user1000}.followers"), slot_of("user1000"));
	ck_assert_uint_eq(slot_of("foo{}{bar}"), kvs__rcluster_crc16("foo{}{bar}", 10) % 16384); /* empty tag: whole key */
	ck_assert_uint_eq(slot_of("foo{{bar}}zap"), slot_of("{bar"));                              /* first { to first } */
	ck_assert_uint_eq(slot_of("foo{bar}{zap}"), slot_of("bar"));                               /* first tag only */
	/* no closing brace, or only one: the whole key */
	ck_assert_uint_eq(slot_of("foo{bar"), kvs__rcluster_crc16("foo{bar", 7) % 16384);
	ck_assert_uint_eq(slot_of("}{x}"), slot_of("x"));
	ck_assert_uint_eq(slot_of("{}"), kvs__rcluster_crc16("{}", 2) % 16384);
	/* binary keys: a NUL is an ordinary byte, inside and outside a tag */
	const char k1[] = {'a', 0, '{', 'b', 0, '}', 'z'};
	const char t1[] = {'b', 0};
	ck_assert_uint_eq(kvs_rcluster_keyslot(k1, sizeof(k1)), kvs_rcluster_keyslot(t1, sizeof(t1)));
	const char k2[] = {0, 1, 0}; /* trailing NUL counts */
	ck_assert_uint_eq(kvs_rcluster_keyslot(k2, 3), kvs__rcluster_crc16(k2, 3) % 16384);
	ck_assert_uint_ne(kvs_rcluster_keyslot(k2, 3), kvs_rcluster_keyslot(k2, 2));
}
END_TEST

static int open_seeds(const char *seeds, kvs_rcluster **c, char *err, size_t len)
{
	kvs_rcluster_config cfg;
	kvs_rcluster_config_defaults(&cfg);
	cfg.seeds = seeds;
	cfg.connect_timeout_ms = 200;
	cfg.io_timeout_ms = 300;
	return kvs_rcluster_open(&cfg, c, err, len);
}

START_TEST(bad_seeds)
{
	static const char *const bad[] = {"", "localhost", "host:", ":7000", "host:0", "host:65536", "host:7x",
					  "a:1,,b:2", "[::1]7000", "h:123456"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		kvs_rcluster *c = (kvs_rcluster *)0x1;
		char err[200];
		ck_assert_int_eq(open_seeds(bad[i], &c, err, sizeof(err)), -EINVAL);
		ck_assert_ptr_eq(c, (kvs_rcluster *)0x1); /* untouched */
		ck_assert_msg(err[0], "no text for '%s'", bad[i]);
	}
	kvs_rcluster_config cfg = {0};
	kvs_rcluster *c = NULL;
	ck_assert_int_eq(kvs_rcluster_open(&cfg, &c, NULL, 0), -EINVAL);
	kvs_rcluster_close(NULL);
}
END_TEST

/* A loopback port with a listener that never accepts (backlog only: a
 * connect succeeds, nothing answers), or, closed, a port that refuses. */
static int listener(int *port, bool keep)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	ck_assert_int_ge(fd, 0);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t al = sizeof(a);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
	ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &al), 0);
	*port = ntohs(a.sin_port);
	if (keep) {
		ck_assert_int_eq(listen(fd, 16), 0);
		return fd;
	}
	close(fd);
	return -1;
}

static double ms_since(const struct timespec *t0)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

START_TEST(seed_refused)
{
	int port;
	listener(&port, false);
	char seeds[64], err[300];
	snprintf(seeds, sizeof(seeds), "127.0.0.1:%d", port);
	kvs_rcluster *c = NULL;
	struct timespec t0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ck_assert_int_eq(open_seeds(seeds, &c, err, sizeof(err)), -EHOSTDOWN);
	ck_assert_double_lt(ms_since(&t0), 200.0); /* refused at once: no waiting */
	ck_assert_ptr_null(c);
	ck_assert_msg(strstr(err, seeds) && strstr(err, "refused"), "err: %s", err);
}
END_TEST

START_TEST(seed_silent)
{
	int port, port2;
	int fd = listener(&port, true);
	listener(&port2, false);
	char seeds[80], err[400];
	snprintf(seeds, sizeof(seeds), "127.0.0.1:%d, 127.0.0.1:%d", port, port2);
	kvs_rcluster *c = NULL;
	struct timespec t0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ck_assert_int_eq(open_seeds(seeds, &c, err, sizeof(err)), -EHOSTDOWN);
	double ms = ms_since(&t0);
	/* the silent seed costs at most connect + io time-outs, the refusing one nothing */
	ck_assert_double_lt(ms, 200.0 + 300.0 + 100.0);
	ck_assert_msg(strstr(err, "no answer within the time-out") && strstr(err, "refused"), "err: %s", err);
	close(fd);
}
END_TEST

static Suite *rcluster_suite(void)
{
	Suite *s = suite_create("rcluster");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, crc16_vectors);
	tcase_add_test(tc, hash_tags);
	tcase_add_test(tc, bad_seeds);
	tcase_add_test(tc, seed_refused);
	tcase_add_test(tc, seed_silent);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(rcluster_suite)
