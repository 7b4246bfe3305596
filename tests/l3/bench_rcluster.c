/* kvs_rcluster SET/GET throughput beside raw hiredis on the same node, same
 * run: the cost of the cluster routing (slot, map, deadlines, the copy into
 * the caller's buffer) over plain redisCommandArgv. Keys share one hash tag,
 * so both paths talk to one node. Each key is written, then read, by both
 * clients back to back (alternating which goes first), so a busy machine
 * slows both alike; times are summed over all rounds (-v: every round).
 *
 *   bench_rcluster [--seeds HOST:PORT,...] [--size BYTES] [--count N] [--rounds R] [--quick] [-v]
 *
 * Without --seeds it starts a one-node cluster (all slots) with
 * tests/l3/redis_cluster.py ($KVS_RCLUSTER_HELPER) and stops it at the end.
 * Exit 77 without redis-server. No pass/fail on the figures. */
#include <errno.h>
#include <stdbool.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "kvs_error.h"
#include "kvs_rcluster.h"

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static char g_dir[128];

static void stop_cluster(void)
{
	if (!g_dir[0])
		return;
	char cmd[512];
	snprintf(cmd, sizeof(cmd), "%s %s stop %s >/dev/null 2>&1; rm -rf '%s'",
		 getenv("KVS_PYTHON") ? getenv("KVS_PYTHON") : "python3", getenv("KVS_RCLUSTER_HELPER"), g_dir, g_dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not stop the cluster in %s\n", g_dir);
	g_dir[0] = '\0';
}

static void on_signal(int sig)
{
	signal(SIGTERM, SIG_DFL);
	kill(0, SIGKILL); /* the redis server shares our process group */
	_exit(128 + sig);
}

enum { RC_SET, RC_GET, RAW_SET, RAW_GET, RAW_GET_NOCOPY, N_M };
static const char *const names[N_M] = {"kvs_rcluster SET", "kvs_rcluster GET", "raw hiredis SET",
				       "raw hiredis GET + copy", "raw hiredis GET (no copy)"};

int main(int argc, char **argv)
{
	const char *seeds = NULL;
	size_t size = 1 << 20;
	int count = 256, rounds = 5, verbose = 0;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--seeds") && i + 1 < argc)
			seeds = argv[++i];
		else if (!strcmp(argv[i], "--size") && i + 1 < argc)
			size = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--count") && i + 1 < argc)
			count = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
			rounds = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--quick"))
			count = 32, rounds = 2;
		else if (!strcmp(argv[i], "-v"))
			verbose = 1;
		else {
			fprintf(stderr, "usage: %s [--seeds S] [--size B] [--count N] [--rounds R] [--quick] [-v]\n",
				argv[0]);
			return 2;
		}
	}
	char seedbuf[256];
	if (!seeds) {
		const char *helper = getenv("KVS_RCLUSTER_HELPER");
		if (!helper) {
			fprintf(stderr, "no --seeds and no KVS_RCLUSTER_HELPER\n");
			return 2;
		}
		snprintf(g_dir, sizeof(g_dir), "/tmp/kvs-l3-bench-XXXXXX");
		if (!mkdtemp(g_dir))
			return 1;
		atexit(stop_cluster);
		signal(SIGTERM, on_signal);
		signal(SIGINT, on_signal);
		char cmd[512];
		snprintf(cmd, sizeof(cmd), "%s %s start %s --masters 1 --replicas 0",
			 getenv("KVS_PYTHON") ? getenv("KVS_PYTHON") : "python3", helper, g_dir);
		FILE *p = popen(cmd, "r");
		if (!p || !fgets(seedbuf, sizeof(seedbuf), p)) {
			int st = p ? pclose(p) : -1;
			if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
				fprintf(stderr, "redis-server not found: skipped\n");
				return 77;
			}
			fprintf(stderr, "could not start a cluster\n");
			return 1;
		}
		pclose(p);
		seedbuf[strcspn(seedbuf, "\n")] = '\0';
		seeds = seedbuf;
	}

	kvs_rcluster_config cfg;
	kvs_rcluster_config_defaults(&cfg);
	cfg.seeds = seeds;
	cfg.io_timeout_ms = 5000;
	kvs_rcluster *c = NULL;
	char err[512];
	int rc = kvs_rcluster_open(&cfg, &c, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "open %s: %s (%s)\n", seeds, kvs_strerror(rc), err);
		return 1;
	}
	char node[300];
	uint16_t slot = kvs_rcluster_keyslot("kvsbench", 8);
	if (kvs_rcluster_slot_node(c, slot, node, sizeof(node)) != 0) {
		fprintf(stderr, "no node for slot %u\n", slot);
		return 1;
	}
	char *colon = strrchr(node, ':');
	*colon = '\0';
	struct timeval tv = {5, 0};
	redisContext *raw = redisConnectWithTimeout(node, atoi(colon + 1), tv);
	if (!raw || raw->err) {
		fprintf(stderr, "connect %s:%s failed\n", node, colon + 1);
		return 1;
	}
	redisSetTimeout(raw, tv);

	uint8_t *val = malloc(size), *buf = malloc(size);
	char (*keys)[32] = calloc((size_t)count, 32);
	size_t *kl = calloc((size_t)count, sizeof(size_t));
	if (!val || !buf || !keys || !kl)
		return 1;
	for (size_t i = 0; i < size; i++)
		val[i] = (uint8_t)(i * 131 + 7);
	for (int i = 0; i < count; i++)
		kl[i] = (size_t)snprintf(keys[i], 32, "{kvsbench}:%d", i);

	/* Interleaved: each key is written (then read) by both clients back to
	 * back, in alternating order, so that a noisy machine slows both alike;
	 * each method's time is summed over every round. */
	double tsum[N_M] = {0};
	for (int r = 0; r < rounds; r++) {
		double t[N_M] = {0};
		for (int phase = 0; phase < 2; phase++) /* 0: SET, 1: GET */
			for (int i = 0; i < count; i++)
				for (int turn = 0; turn < 2; turn++) {
					bool ours = (turn == 0) == ((i + r) % 2 == 0);
					double t0 = now_s();
					if (phase == 0 && ours) {
						val[0] = (uint8_t)i;
						if ((rc = kvs_rcluster_set(c, keys[i], kl[i], val, size))) {
							fprintf(stderr, "set: %s (%s)\n", kvs_strerror(rc), kvs_rcluster_last_error(c));
							return 1;
						}
						t[RC_SET] += now_s() - t0;
					} else if (phase == 1 && ours) {
						size_t len;
						rc = kvs_rcluster_get(c, keys[i], kl[i], buf, size, &len);
						if (rc || len != size || buf[0] != (uint8_t)i) {
							fprintf(stderr, "get: %s (%s)\n", kvs_strerror(rc), kvs_rcluster_last_error(c));
							return 1;
						}
						t[RC_GET] += now_s() - t0;
					} else if (phase == 0) {
						const char *av[3] = {"SET", keys[i], (const char *)val};
						size_t al[3] = {3, kl[i], size};
						redisReply *rr = redisCommandArgv(raw, 3, av, al);
						if (!rr || rr->type != REDIS_REPLY_STATUS) {
							fprintf(stderr, "raw set failed\n");
							return 1;
						}
						freeReplyObject(rr);
						t[RAW_SET] += now_s() - t0;
					} else {
						/* raw GET twice: once copying into the buffer, once not */
						for (int copy = 1; copy >= 0; copy--) {
							t0 = now_s();
							const char *av[2] = {"GET", keys[i]};
							size_t al[2] = {3, kl[i]};
							redisReply *rr = redisCommandArgv(raw, 2, av, al);
							if (!rr || rr->type != REDIS_REPLY_STRING || rr->len != size) {
								fprintf(stderr, "raw get failed\n");
								return 1;
							}
							if (copy)
								memcpy(buf, rr->str, rr->len);
							freeReplyObject(rr);
							t[copy ? RAW_GET : RAW_GET_NOCOPY] += now_s() - t0;
						}
					}
				}
		for (int m = 0; m < N_M; m++) {
			tsum[m] += t[m];
			if (verbose)
				printf("round %d: %-26s %6.2f GB/s\n", r, names[m], (double)size * count / t[m] / 1e9);
		}
	}
	double gbs[N_M];
	for (int m = 0; m < N_M; m++)
		gbs[m] = (double)size * count * rounds / tsum[m] / 1e9;
	printf("%d x %zu-byte values x %d rounds, interleaved, one node (%s:%s)\n", count, size, rounds, node,
	       colon + 1);
	for (int m = 0; m < N_M; m++)
		printf("  %-26s %6.2f GB/s\n", names[m], gbs[m]);
	printf("  ratio SET kvs_rcluster / raw            %.2f\n", gbs[RC_SET] / gbs[RAW_SET]);
	printf("  ratio GET kvs_rcluster / raw + copy     %.2f\n", gbs[RC_GET] / gbs[RAW_GET]);
	printf("  ratio GET kvs_rcluster / raw (no copy)  %.2f\n", gbs[RC_GET] / gbs[RAW_GET_NOCOPY]);
	kvs_rcluster_stats st;
	kvs_rcluster_get_stats(c, &st);
	printf("  kvs_rcluster: %llu commands, %llu errors, %llu redirections\n", (unsigned long long)st.commands,
	       (unsigned long long)st.errors, (unsigned long long)(st.moved + st.ask));
	redisFree(raw);
	kvs_rcluster_close(c);
	free(val);
	free(buf);
	free(keys);
	free(kl);
	return 0;
}
