/* The Redis Cluster client (storage/kvs_rcluster.c) against a real 3-master +
 * 3-replica Redis Cluster started by this test (tests/l3/redis_cluster.py):
 * key slots as Redis computes them, binary keys over every slot range (each
 * key on the node the map names), values of 0 B to 8 MiB and one larger than
 * the buffer, MOVED during a resharding done under traffic, ASK during a
 * migration done by hand, a redirection loop cut at 5, AUTH on a cluster
 * with a password (right, wrong and missing credentials), exists_many with
 * one master stopped (the others' keys answered), a master SIGKILLed under
 * traffic (no wrong bytes, commands resume after the promotion), the whole
 * cluster stopped and then killed (every call fails within its time-out).
 *
 * The cases share the cluster and run in order (the last ones break it);
 * each runs in its own process (Check's fork mode). Exit 77 (skip) without
 * redis-server. Timings are asserted only as "failed within the time-out". */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
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

extern char **environ;

#define MAXN 8
#define IO_MS 500
#define OP_MS 1000

static char g_dir[256];   /* the test's temp dir; the clusters live in g_dir/main, g_dir/auth */
static char g_seeds[512]; /* the main cluster's */
static int g_port[MAXN], g_n;
static pid_t g_pid[MAXN];
static pid_t g_main_pid;
static const char *g_helper;

/* ---- small tools ---------------------------------------------------------- */

static double now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
	uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
	for (size_t i = 0; i < n; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		p[i] = (uint8_t)(x >> 24);
	}
}

static int run_helper(const char *fmt, ...)
{
	char args[512], cmd[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(args, sizeof(args), fmt, ap);
	va_end(ap);
	snprintf(cmd, sizeof(cmd), "%s %s %s", getenv("KVS_PYTHON") ? getenv("KVS_PYTHON") : "python3", g_helper, args);
	int st = system(cmd);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* reads DIR/cluster.txt into seeds, ports, pids; returns the node count */
static int read_cluster(const char *dir, char *seeds, size_t slen, int *ports, pid_t *pids)
{
	char path[300], line[600];
	snprintf(path, sizeof(path), "%s/cluster.txt", dir);
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	int n = 0;
	while (fgets(line, sizeof(line), f)) {
		int port, pid;
		char s[512];
		if (sscanf(line, "seeds %511s", s) == 1)
			snprintf(seeds, slen, "%s", s);
		else if (sscanf(line, "node %d %d", &port, &pid) == 2 && n < MAXN)
			ports[n] = port, pids[n] = pid, n++;
	}
	fclose(f);
	return n;
}

static void kill_cluster(const char *sub)
{
	char d[300], seeds[512];
	int ports[MAXN];
	pid_t pids[MAXN];
	snprintf(d, sizeof(d), "%s/%s", g_dir, sub);
	int n = read_cluster(d, seeds, sizeof(seeds), ports, pids);
	for (int i = 0; i < n; i++)
		kill(pids[i], SIGKILL);
}

static void cleanup(void)
{
	if (getpid() != g_main_pid || !g_dir[0])
		return;
	kill_cluster("main");
	kill_cluster("auth");
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", g_dir);
}

static void on_signal(int sig)
{
	/* the redis servers share our process group: take them down with us */
	signal(SIGTERM, SIG_DFL);
	kill(0, SIGKILL);
	_exit(128 + sig);
}

static kvs_rcluster *open_client(const char *seeds, const char *user, const char *pass)
{
	kvs_rcluster_config cfg;
	kvs_rcluster_config_defaults(&cfg);
	cfg.seeds = seeds, cfg.user = user, cfg.password = pass;
	cfg.connect_timeout_ms = 200, cfg.io_timeout_ms = IO_MS, cfg.op_timeout_ms = OP_MS;
	cfg.refresh_min_ms = 100, cfg.down_ms = 500;
	kvs_rcluster *c = NULL;
	char err[512];
	int rc = kvs_rcluster_open(&cfg, &c, err, sizeof(err));
	ck_assert_msg(rc == 0, "open %s: %s (%s)", seeds, kvs_strerror(rc), err);
	return c;
}

/* One command on one node over a fresh raw connection (NULL if none answers). */
static redisReply *raw(int port, const char *fmt, ...)
{
	struct timeval tv = {1, 0};
	redisContext *ctx = redisConnectWithTimeout("127.0.0.1", port, tv);
	if (!ctx || ctx->err) {
		redisFree(ctx);
		return NULL;
	}
	redisSetTimeout(ctx, tv);
	va_list ap;
	va_start(ap, fmt);
	redisReply *r = redisvCommand(ctx, fmt, ap);
	va_end(ap);
	redisFree(ctx);
	return r;
}

static int raw_int(int port, const char *fmt, ...)
{
	struct timeval tv = {1, 0};
	redisContext *ctx = redisConnectWithTimeout("127.0.0.1", port, tv);
	ck_assert_msg(ctx && !ctx->err, "connect %d", port);
	va_list ap;
	va_start(ap, fmt);
	redisReply *r = redisvCommand(ctx, fmt, ap);
	va_end(ap);
	ck_assert_msg(r && r->type == REDIS_REPLY_INTEGER, "port %d: %s", port, r && r->str ? r->str : "no reply");
	int v = (int)r->integer;
	freeReplyObject(r);
	redisFree(ctx);
	return v;
}

static void raw_ok(int port, const char *fmt, ...)
{
	struct timeval tv = {2, 0};
	redisContext *ctx = redisConnectWithTimeout("127.0.0.1", port, tv);
	ck_assert_msg(ctx && !ctx->err, "connect %d", port);
	redisSetTimeout(ctx, tv);
	va_list ap;
	va_start(ap, fmt);
	redisReply *r = redisvCommand(ctx, fmt, ap);
	va_end(ap);
	ck_assert_msg(r && r->type == REDIS_REPLY_STATUS, "port %d %s: %s", port, fmt, r && r->str ? r->str : "no reply");
	freeReplyObject(r);
	redisFree(ctx);
}

/* The master port of a slot from CLUSTER SLOTS of the first live node; 0 if none. */
static int slot_owner(int slot)
{
	for (int i = 0; i < g_n; i++) {
		redisReply *r = raw(g_port[i], "CLUSTER SLOTS");
		if (!r)
			continue;
		int port = 0;
		if (r->type == REDIS_REPLY_ARRAY)
			for (size_t k = 0; k < r->elements; k++) {
				redisReply *e = r->element[k];
				if (e->element[0]->integer <= slot && slot <= e->element[1]->integer)
					port = (int)e->element[2]->element[1]->integer;
			}
		bool answered = r->type == REDIS_REPLY_ARRAY;
		freeReplyObject(r);
		if (answered)
			return port;
	}
	return 0;
}

/* Until every node that answers says cluster_state:ok (a killed node is
 * skipped); returns the milliseconds waited. */
static double wait_cluster_ok(double limit_ms)
{
	double t0 = now_ms();
	for (;;) {
		bool ok = true;
		for (int i = 0; i < g_n && ok; i++) {
			redisReply *r = raw(g_port[i], "CLUSTER INFO");
			if (r)
				ok = r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok");
			freeReplyObject(r);
		}
		if (ok)
			return now_ms() - t0;
		ck_assert_msg(now_ms() - t0 < limit_ms, "cluster_state not ok after %.0f ms", limit_ms);
		usleep(50000);
	}
}

static pid_t pid_of(int port)
{
	for (int i = 0; i < g_n; i++)
		if (g_port[i] == port)
			return g_pid[i];
	return 0;
}

static void node_id(int port, char id[64])
{
	redisReply *r = raw(port, "CLUSTER MYID");
	ck_assert_msg(r && r->type == REDIS_REPLY_STRING, "CLUSTER MYID on %d", port);
	snprintf(id, 64, "%s", r->str);
	freeReplyObject(r);
}

static int masters(int *out)
{
	int n = 0;
	for (int s = 0; s < 16384; s += 1000) {
		int p = slot_owner(s);
		bool seen = false;
		for (int i = 0; i < n; i++)
			seen |= out[i] == p;
		if (!seen && p)
			out[n++] = p;
	}
	int p = slot_owner(16383);
	bool seen = false;
	for (int i = 0; i < n; i++)
		seen |= out[i] == p;
	if (!seen && p)
		out[n++] = p;
	return n;
}

static void flush_all(void)
{
	int m[MAXN];
	int n = masters(m);
	for (int i = 0; i < n; i++)
		raw_ok(m[i], "FLUSHALL");
}

static int client_port(kvs_rcluster *c, uint16_t slot)
{
	char hp[300];
	ck_assert_int_eq(kvs_rcluster_slot_node(c, slot, hp, sizeof(hp)), 0);
	return atoi(strrchr(hp, ':') + 1);
}

/* ---- cases ---------------------------------------------------------------- */

/* kvs_rcluster_keyslot gives the slot Redis itself computes (CLUSTER KEYSLOT),
 * for binary keys with and without braces. */
START_TEST(keyslot_matches_redis)
{
	struct timeval tv = {2, 0};
	redisContext *ctx = redisConnectWithTimeout("127.0.0.1", g_port[0], tv);
	ck_assert(ctx && !ctx->err);
	uint8_t k[64];
	for (int i = 0; i < 500; i++) {
		size_t len = (size_t)(i % 40);
		fill(k, len, (uint64_t)i + 1000);
		if (len > 4 && i % 3 == 0)
			k[i % len] = '{', k[(i * 7) % len] = '}';
		const char *argv[3] = {"CLUSTER", "KEYSLOT", (const char *)k};
		size_t lens[3] = {7, 7, len};
		redisReply *r = redisCommandArgv(ctx, 3, argv, lens);
		ck_assert(r && r->type == REDIS_REPLY_INTEGER);
		ck_assert_int_eq(kvs_rcluster_keyslot(k, len), r->integer);
		freeReplyObject(r);
	}
	redisFree(ctx);
}
END_TEST

#define NKEYS 600

/* Binary keys over every slot range: each lands on the node the client's map
 * names (checked on that node directly), the masters' key counts (redis-cli
 * DBSIZE) sum to the keys set, values come back byte-exact; exists_many with
 * absent keys mixed in; del. */
START_TEST(binary_keys_every_range)
{
	flush_all();
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	static uint8_t key[NKEYS][48], val[4096], got[4096];
	size_t klen[NKEYS];
	int per_master[MAXN] = {0}, mports[MAXN];
	int nm = masters(mports);
	ck_assert_int_eq(nm, 3);
	for (int i = 0; i < NKEYS; i++) {
		klen[i] = i == 0 ? 0 : (size_t)(1 + i % 47); /* key 0 is the empty key */
		fill(key[i], klen[i], (uint64_t)i);
		if (klen[i] > 2)
			key[i][0] = (uint8_t)i, key[i][1] = 0, key[i][2] = '\n'; /* NUL and newline inside: distinct, binary */
		size_t vl = (size_t)(i * 37) % sizeof(val);
		fill(val, vl, (uint64_t)i + 77);
		int rc = kvs_rcluster_set(c, key[i], klen[i], val, vl);
		ck_assert_msg(rc == 0, "set %d: %s (%s)", i, kvs_strerror(rc), kvs_rcluster_last_error(c));
		int port = client_port(c, kvs_rcluster_keyslot(key[i], klen[i]));
		ck_assert_int_eq(port, slot_owner(kvs_rcluster_keyslot(key[i], klen[i])));
		/* a node answers EXISTS for a slot it does not own with MOVED: 1 means it holds the key */
		ck_assert_int_eq(raw_int(port, "EXISTS %b", key[i], klen[i]), 1);
		for (int m = 0; m < nm; m++)
			per_master[m] += mports[m] == port;
	}
	int total = 0;
	for (int m = 0; m < nm; m++) {
		ck_assert_msg(per_master[m] > NKEYS / 6, "master %d holds %d keys", mports[m], per_master[m]);
		char cmd[200];
		snprintf(cmd, sizeof(cmd), "redis-cli -p %d DBSIZE", mports[m]);
		FILE *p = popen(cmd, "r");
		int n = -1;
		ck_assert(p && fscanf(p, "%d", &n) == 1);
		pclose(p);
		ck_assert_int_eq(n, per_master[m]);
		total += n;
	}
	ck_assert_int_eq(total, NKEYS);
	for (int i = 0; i < NKEYS; i++) {
		size_t vl = (size_t)(i * 37) % sizeof(val), len = 12345;
		fill(val, vl, (uint64_t)i + 77);
		int rc = kvs_rcluster_get(c, key[i], klen[i], got, sizeof(got), &len);
		ck_assert_msg(rc == 0, "get %d: %s (%s)", i, kvs_strerror(rc), kvs_rcluster_last_error(c));
		ck_assert_uint_eq(len, vl);
		ck_assert(memcmp(got, val, vl) == 0);
	}
	/* exists_many: the NKEYS keys, then NKEYS absent ones (a byte changed) */
	static const void *kp[2 * NKEYS];
	static size_t kl[2 * NKEYS];
	static uint8_t absent[NKEYS][49];
	static bool out[2 * NKEYS];
	for (int i = 0; i < NKEYS; i++) {
		kp[i] = key[i], kl[i] = klen[i];
		memcpy(absent[i], key[i], klen[i]);
		absent[i][klen[i]] = 0xff;
		kp[NKEYS + i] = absent[i], kl[NKEYS + i] = klen[i] + 1;
	}
	kvs_rcluster_stats s0, s1;
	kvs_rcluster_get_stats(c, &s0);
	ck_assert_int_eq(kvs_rcluster_exists_many(c, kp, kl, 2 * NKEYS, out), 0);
	for (int i = 0; i < 2 * NKEYS; i++)
		ck_assert_msg(out[i] == (i < NKEYS), "exists[%d] = %d", i, out[i]);
	kvs_rcluster_get_stats(c, &s1);
	ck_assert_uint_eq(s1.commands - s0.commands, 2 * NKEYS);
	ck_assert_uint_eq(s1.calls - s0.calls, 1);
	/* head_many: the first 16 bytes of each value (fewer for shorter ones),
	 * nothing for the absent keys, in one call */
	static uint8_t heads[2 * NKEYS][16];
	static void *hb[2 * NKEYS];
	static size_t hl[2 * NKEYS];
	for (int i = 0; i < 2 * NKEYS; i++)
		hb[i] = heads[i], hl[i] = 999;
	kvs_rcluster_get_stats(c, &s0);
	ck_assert_int_eq(kvs_rcluster_head_many(c, kp, kl, 2 * NKEYS, 16, hb, hl), 0);
	for (int i = 0; i < NKEYS; i++) {
		size_t vl = (size_t)(i * 37) % sizeof(val);
		fill(val, vl, (uint64_t)i + 77);
		ck_assert_uint_eq(hl[i], vl < 16 ? vl : 16);
		ck_assert(memcmp(heads[i], val, hl[i]) == 0);
		ck_assert_uint_eq(hl[NKEYS + i], 0);
	}
	kvs_rcluster_get_stats(c, &s1);
	ck_assert_uint_eq(s1.calls - s0.calls, 1);
	ck_assert_uint_eq(s1.commands - s0.commands, 2 * NKEYS);
	/* getv: a value scattered over two buffers; too small buffers: LIMIT, untouched */
	{
		int i = 100;
		size_t vl = (size_t)(i * 37) % sizeof(val), len = 0;
		ck_assert_uint_gt(vl, 40);
		fill(val, vl, (uint64_t)i + 77);
		uint8_t a[40], b[sizeof(val)];
		memset(b, 0xee, sizeof(b));
		struct iovec iov[2] = {{a, sizeof(a)}, {b, sizeof(b)}};
		ck_assert_int_eq(kvs_rcluster_getv(c, key[i], klen[i], iov, 2, &len), 0);
		ck_assert_uint_eq(len, vl);
		ck_assert(memcmp(a, val, 40) == 0 && memcmp(b, val + 40, vl - 40) == 0);
		ck_assert_uint_eq(b[vl - 40], 0xee);
		iov[1].iov_len = vl - 41;
		memset(b, 0xee, sizeof(b));
		ck_assert_int_eq(kvs_rcluster_getv(c, key[i], klen[i], iov, 2, &len), KVS_E_LIMIT);
		ck_assert_uint_eq(len, vl);
		ck_assert_uint_eq(b[0], 0xee);
	}
	/* del every other key */
	for (int i = 0; i < NKEYS; i += 2)
		ck_assert_int_eq(kvs_rcluster_del(c, key[i], klen[i]), 0);
	ck_assert_int_eq(kvs_rcluster_del(c, key[0], klen[0]), KVS_E_MISS);
	size_t len;
	ck_assert_int_eq(kvs_rcluster_get(c, key[2], klen[2], got, sizeof(got), &len), KVS_E_MISS);
	ck_assert_int_eq(kvs_rcluster_exists_many(c, kp, kl, NKEYS, out), 0);
	for (int i = 0; i < NKEYS; i++)
		ck_assert_int_eq(out[i], i % 2 == 1);
	kvs_rcluster_get_stats(c, &s1);
	ck_assert_uint_eq(s1.moved + s1.ask, 0);
	ck_assert_uint_eq(s1.errors, 0);
	ck_assert_uint_eq(s1.refreshes, 1);
	ck_assert_uint_eq(s1.connects, 3); /* one per master, opened lazily, reused */
	ck_assert_uint_eq(s1.nodes, 6);
	kvs_rcluster_close(c);
}
END_TEST

/* Values of 0 B, 1 B, 1 MiB, 8 MiB byte-exact; a value larger than the
 * buffer is refused with its size, the buffer untouched. */
START_TEST(value_sizes)
{
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	static const size_t sizes[] = {0, 1, 1 << 20, 8 << 20};
	size_t cap = (8 << 20) + 16;
	uint8_t *v = malloc(cap), *got = malloc(cap);
	ck_assert(v && got);
	for (size_t i = 0; i < 4; i++) {
		char key[32];
		int kl = snprintf(key, sizeof(key), "size:%zu", sizes[i]);
		fill(v, sizes[i], sizes[i] + 5);
		int rc = kvs_rcluster_set(c, key, (size_t)kl, v, sizes[i]);
		ck_assert_msg(rc == 0, "set %zu: %s (%s)", sizes[i], kvs_strerror(rc), kvs_rcluster_last_error(c));
		size_t len = 999;
		memset(got, 0xab, cap);
		ck_assert_int_eq(kvs_rcluster_get(c, key, (size_t)kl, got, cap, &len), 0);
		ck_assert_uint_eq(len, sizes[i]);
		ck_assert(memcmp(got, v, sizes[i]) == 0);
		ck_assert_uint_eq(got[sizes[i]], 0xab); /* nothing past the value */
		/* exactly the value's size fits */
		ck_assert_int_eq(kvs_rcluster_get(c, key, (size_t)kl, got, sizes[i], &len), 0);
		if (sizes[i] == 0)
			continue;
		/* one byte short: KVS_E_LIMIT, the size, the buffer untouched */
		memset(got, 0xab, cap);
		len = 0;
		ck_assert_int_eq(kvs_rcluster_get(c, key, (size_t)kl, got, sizes[i] - 1, &len), KVS_E_LIMIT);
		ck_assert_uint_eq(len, sizes[i]);
		for (size_t j = 0; j < sizes[i]; j += 4093)
			ck_assert_uint_eq(got[j], 0xab);
	}
	size_t len = 7;
	ck_assert_int_eq(kvs_rcluster_get(c, "size:none", 9, got, cap, &len), KVS_E_MISS);
	ck_assert_uint_eq(len, 7);
	kvs_rcluster_stats s;
	kvs_rcluster_get_stats(c, &s);
	ck_assert_uint_eq(s.errors, 0); /* a miss and a too-small buffer are answers */
	ck_assert_uint_ge(s.bytes_out, (1 << 20) + (8 << 20));
	free(v);
	free(got);
	kvs_rcluster_close(c);
}
END_TEST

static pid_t spawn_logged(const char *log, char *const argv[])
{
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	posix_spawn_file_actions_adddup2(&fa, 1, 2);
	pid_t pid;
	int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	ck_assert_msg(rc == 0, "spawn %s: %s", argv[0], strerror(rc));
	return pid;
}

#define NMOVE 300
#define MOVE_SLOTS 200

/* redis-cli --cluster reshard moves the first MOVE_SLOTS slots of the master
 * of slot 0 to another master while this loop reads and writes keys of those
 * slots: every answer byte-exact, no failure, MOVED followed (the map is
 * updated: a pass afterwards sees no more). */
START_TEST(moved_during_reshard)
{
	flush_all();
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	int src = slot_owner(0), dst = slot_owner(16383);
	ck_assert_int_ne(src, dst);
	char src_id[64], dst_id[64];
	node_id(src, src_id);
	node_id(dst, dst_id);
	static char key[NMOVE][24];
	static uint32_t ver[NMOVE];
	size_t kl[NMOVE];
	uint8_t v[2048], got[2048];
	int n = 0;
	for (uint32_t i = 0; n < NMOVE; i++) {
		char k[24];
		int l = snprintf(k, sizeof(k), "mv:%u", i);
		if (kvs_rcluster_keyslot(k, (size_t)l) >= MOVE_SLOTS)
			continue;
		memcpy(key[n], k, (size_t)l + 1);
		kl[n] = (size_t)l;
		fill(v, sizeof(v), (uint64_t)n << 8);
		ck_assert_int_eq(kvs_rcluster_set(c, key[n], kl[n], v, sizeof(v)), 0);
		n++;
	}
	char log[300], from[80], to[80], node[40];
	snprintf(log, sizeof(log), "%s/reshard.log", g_dir);
	snprintf(node, sizeof(node), "127.0.0.1:%d", src);
	snprintf(from, sizeof(from), "%s", src_id);
	snprintf(to, sizeof(to), "%s", dst_id);
	char *argv[] = {"redis-cli", "--cluster", "reshard", node, "--cluster-from", from, "--cluster-to", to,
			"--cluster-slots", "200", "--cluster-yes", "--cluster-pipeline", "5", NULL};
	pid_t pid = spawn_logged(log, argv);
	int st = -1, passes_after = 0, ops_during = 0;
	bool running = true;
	while (running || passes_after < 2) {
		for (int i = 0; i < NMOVE; i++) {
			size_t len = 0;
			if (i % 7 == 0) { /* writes too */
				ver[i]++;
				fill(v, sizeof(v), ((uint64_t)i << 8) + ver[i]);
				int rc = kvs_rcluster_set(c, key[i], kl[i], v, sizeof(v));
				ck_assert_msg(rc == 0, "set %s: %s (%s)", key[i], kvs_strerror(rc), kvs_rcluster_last_error(c));
			}
			int rc = kvs_rcluster_get(c, key[i], kl[i], got, sizeof(got), &len);
			ck_assert_msg(rc == 0, "get %s: %s (%s)", key[i], kvs_strerror(rc), kvs_rcluster_last_error(c));
			fill(v, sizeof(v), ((uint64_t)i << 8) + ver[i]);
			ck_assert(len == sizeof(v) && memcmp(got, v, len) == 0);
			ops_during += running;
		}
		if (running && waitpid(pid, &st, WNOHANG) == pid)
			running = false;
		else if (!running)
			passes_after++;
	}
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "redis-cli reshard failed (see %s)", log);
	kvs_rcluster_stats s1, s2;
	kvs_rcluster_get_stats(c, &s1);
	fprintf(stderr, "reshard: %d ops during it, %llu MOVED, %llu ASK followed, %llu errors\n", ops_during,
		(unsigned long long)s1.moved, (unsigned long long)s1.ask, (unsigned long long)s1.errors);
	ck_assert_uint_gt(s1.moved, 0);
	ck_assert_uint_eq(s1.errors, 0);
	for (int i = 0; i < NMOVE; i++) {
		uint16_t slot = kvs_rcluster_keyslot(key[i], kl[i]);
		ck_assert_int_eq(slot_owner(slot), dst);
		ck_assert_int_eq(client_port(c, slot), dst);
		ck_assert_int_eq(raw_int(dst, "EXISTS %s", key[i]), 1);
		size_t len;
		ck_assert_int_eq(kvs_rcluster_get(c, key[i], kl[i], got, sizeof(got), &len), 0);
	}
	kvs_rcluster_get_stats(c, &s2);
	ck_assert_uint_eq(s2.moved, s1.moved); /* the map was updated */
	kvs_rcluster_close(c);
}
END_TEST

#define NASK 40

static void migrate(int src, int dst, const char *key)
{
	raw_ok(src, "MIGRATE 127.0.0.1 %d %s 0 5000", dst, key);
}

/* A slot MIGRATING on its master and IMPORTING on another, half its keys
 * moved by hand: reads of moved keys, writes of new keys and DEL follow ASK
 * (ASKING + the command, once); the map keeps the source until the slot is
 * handed over, then a MOVED updates it. */
START_TEST(ask_during_migration)
{
	flush_all();
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	uint16_t slot = kvs_rcluster_keyslot("{ask}", 5);
	int src = slot_owner(slot), dst = 0, m[MAXN];
	int nm = masters(m);
	for (int i = 0; i < nm && !dst; i++)
		if (m[i] != src)
			dst = m[i];
	ck_assert(src && dst);
	char src_id[64], dst_id[64];
	node_id(src, src_id);
	node_id(dst, dst_id);
	char key[NASK][24];
	uint8_t v[512], got[512];
	for (int i = 0; i < NASK; i++) {
		snprintf(key[i], sizeof(key[i]), "{ask}:%d", i);
		ck_assert_uint_eq(kvs_rcluster_keyslot(key[i], strlen(key[i])), slot);
		fill(v, sizeof(v), (uint64_t)i + 300);
		ck_assert_int_eq(kvs_rcluster_set(c, key[i], strlen(key[i]), v, sizeof(v)), 0);
	}
	raw_ok(dst, "CLUSTER SETSLOT %d IMPORTING %s", slot, src_id);
	raw_ok(src, "CLUSTER SETSLOT %d MIGRATING %s", slot, dst_id);
	for (int i = 0; i < NASK / 2; i++)
		migrate(src, dst, key[i]);
	kvs_rcluster_stats s0, s1;
	kvs_rcluster_get_stats(c, &s0);
	for (int i = 0; i < NASK; i++) {
		size_t len = 0;
		int rc = kvs_rcluster_get(c, key[i], strlen(key[i]), got, sizeof(got), &len);
		ck_assert_msg(rc == 0, "get %s: %s (%s)", key[i], kvs_strerror(rc), kvs_rcluster_last_error(c));
		fill(v, sizeof(v), (uint64_t)i + 300);
		ck_assert(len == sizeof(v) && memcmp(got, v, len) == 0);
	}
	kvs_rcluster_get_stats(c, &s1);
	ck_assert_uint_eq(s1.ask - s0.ask, NASK / 2); /* the moved half only */
	ck_assert_uint_eq(s1.moved, 0);
	ck_assert_int_eq(client_port(c, slot), src); /* ASK leaves the map alone */
	/* a new key: absent on the source, so it goes to the importing node */
	ck_assert_int_eq(kvs_rcluster_set(c, "{ask}:new", 9, "fresh", 5), 0);
	redisReply *r = raw(src, "EXISTS {ask}:new"); /* the source answers ASK for keys it lacks */
	ck_assert_msg(r && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "ASK ", 4) == 0, "source: %s",
		      r && r->str ? r->str : "?");
	freeReplyObject(r);
	struct timeval tv = {2, 0};
	redisContext *ctx = redisConnectWithTimeout("127.0.0.1", dst, tv);
	ck_assert(ctx && !ctx->err);
	freeReplyObject(redisCommand(ctx, "ASKING"));
	r = redisCommand(ctx, "EXISTS {ask}:new");
	ck_assert(r && r->type == REDIS_REPLY_INTEGER && r->integer == 1);
	freeReplyObject(r);
	redisFree(ctx);
	/* exists_many over the slot, an absent key among them */
	const void *kp[NASK + 2];
	size_t kl[NASK + 2];
	bool out[NASK + 2];
	for (int i = 0; i < NASK; i++)
		kp[i] = key[i], kl[i] = strlen(key[i]);
	kp[NASK] = "{ask}:new", kl[NASK] = 9;
	kp[NASK + 1] = "{ask}:absent", kl[NASK + 1] = 12;
	ck_assert_int_eq(kvs_rcluster_exists_many(c, kp, kl, NASK + 2, out), 0);
	for (int i = 0; i < NASK + 2; i++)
		ck_assert_msg(out[i] == (i <= NASK), "exists[%d] = %d", i, out[i]);
	/* del of a moved key, then it is a miss (asked on both) */
	ck_assert_int_eq(kvs_rcluster_del(c, key[0], strlen(key[0])), 0);
	size_t len;
	ck_assert_int_eq(kvs_rcluster_get(c, key[0], strlen(key[0]), got, sizeof(got), &len), KVS_E_MISS);
	kvs_rcluster_get_stats(c, &s1);
	ck_assert_uint_eq(s1.moved, 0);
	ck_assert_uint_eq(s1.errors, 0);
	/* finish the migration: the rest of the keys, then the slot to dst everywhere */
	for (int i = NASK / 2; i < NASK; i++)
		migrate(src, dst, key[i]);
	raw_ok(dst, "CLUSTER SETSLOT %d NODE %s", slot, dst_id);
	raw_ok(src, "CLUSTER SETSLOT %d NODE %s", slot, dst_id);
	for (int i = 0; i < nm; i++)
		if (m[i] != src && m[i] != dst)
			raw_ok(m[i], "CLUSTER SETSLOT %d NODE %s", slot, dst_id);
	ck_assert_int_eq(kvs_rcluster_get(c, key[NASK - 1], strlen(key[NASK - 1]), got, sizeof(got), &len), 0);
	kvs_rcluster_get_stats(c, &s1);
	ck_assert_uint_eq(s1.moved, 1);
	ck_assert_int_eq(client_port(c, slot), dst);
	ck_assert_int_eq(kvs_rcluster_get(c, "{ask}:new", 9, got, sizeof(got), &len), 0);
	ck_assert(len == 5 && memcmp(got, "fresh", 5) == 0);
	kvs_rcluster_close(c);
}
END_TEST

/* A slot MIGRATING on its master towards a node that is not IMPORTING it:
 * a key absent from the source is sent on with ASK, the other node answers
 * MOVED back, and so on; the client gives up after KVS_RCLUSTER_MAX_REDIRECTS
 * with -ELOOP. STABLE ends it. */
START_TEST(redirect_loop)
{
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	uint16_t slot = kvs_rcluster_keyslot("{loop}", 6);
	int src = slot_owner(slot), dst = 0, m[MAXN];
	int nm = masters(m);
	for (int i = 0; i < nm && !dst; i++)
		if (m[i] != src)
			dst = m[i];
	char dst_id[64];
	node_id(dst, dst_id);
	raw_ok(src, "CLUSTER SETSLOT %d MIGRATING %s", slot, dst_id);
	uint8_t got[16];
	size_t len;
	int rc = kvs_rcluster_get(c, "{loop}:x", 8, got, sizeof(got), &len);
	const void *kp[1] = {"{loop}:y"};
	size_t kl[1] = {8};
	bool out[1] = {true};
	int rc2 = kvs_rcluster_exists_many(c, kp, kl, 1, out);
	kvs_rcluster_stats s;
	kvs_rcluster_get_stats(c, &s);
	fprintf(stderr, "redirect loop: %s (%s)\n", kvs_strerror(rc), kvs_rcluster_last_error(c));
	raw_ok(src, "CLUSTER SETSLOT %d STABLE", slot);
	ck_assert_int_eq(rc, -ELOOP);
	ck_assert_int_eq(rc2, -ELOOP);
	ck_assert(!out[0]);
	ck_assert_uint_eq(s.moved + s.ask, 2 * KVS_RCLUSTER_MAX_REDIRECTS); /* the sixth is not followed */
	ck_assert_int_eq(kvs_rcluster_get(c, "{loop}:x", 8, got, sizeof(got), &len), KVS_E_MISS);
	kvs_rcluster_close(c);
}
END_TEST

#define NPART 300

/* One master stopped for a moment (shorter than cluster-node-timeout, so no
 * failover): exists_many answers the keys of the other masters and fails
 * the stopped master's within the time-out (false, the call's error); once
 * it runs again and down_ms has passed, every key is answered. */
START_TEST(exists_many_partial)
{
	wait_cluster_ok(20000);
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	static char key[NPART][16];
	const void *kp[NPART];
	size_t kl[NPART];
	bool out[NPART];
	for (int i = 0; i < NPART; i++) {
		kl[i] = (size_t)snprintf(key[i], sizeof(key[i]), "pa:%d", i);
		kp[i] = key[i];
		ck_assert_int_eq(kvs_rcluster_set(c, key[i], kl[i], "v", 1), 0);
	}
	int stopped = slot_owner(0);
	ck_assert_int_eq(kill(pid_of(stopped), SIGSTOP), 0);
	double t0 = now_ms();
	int rc = kvs_rcluster_exists_many(c, kp, kl, NPART, out);
	double dt = now_ms() - t0;
	kill(pid_of(stopped), SIGCONT);
	ck_assert_msg(rc == KVS_E_TIMEOUT || rc == -EHOSTDOWN, "exists_many: %s", kvs_strerror(rc));
	int answered = 0;
	for (int i = 0; i < NPART; i++) {
		bool on_stopped = client_port(c, kvs_rcluster_keyslot(key[i], kl[i])) == stopped;
		ck_assert_msg(out[i] == !on_stopped, "key %d (on the stopped node: %d) = %d", i, on_stopped, out[i]);
		answered += out[i];
	}
	fprintf(stderr, "partial: %d of %d keys answered with one master stopped, in %.0f ms (%s)\n", answered, NPART,
		dt, kvs_rcluster_last_error(c));
	ck_assert_int_gt(answered, NPART / 2);
	ck_assert_double_lt(dt, OP_MS + 150.0);
	usleep(600 * 1000); /* down_ms */
	ck_assert_int_eq(kvs_rcluster_exists_many(c, kp, kl, NPART, out), 0);
	for (int i = 0; i < NPART; i++)
		ck_assert(out[i]);
	kvs_rcluster_close(c);
}
END_TEST

#define NFAIL 30000
enum { K_NONE, K_BEFORE, K_AFTER, K_UNSURE };

/* The slot range [lo, hi] around slot, from CLUSTER SLOTS of a live node. */
static void slot_range(int slot, int *lo, int *hi)
{
	*lo = *hi = -1;
	for (int i = 0; i < g_n && *lo < 0; i++) {
		redisReply *r = raw(g_port[i], "CLUSTER SLOTS");
		if (r && r->type == REDIS_REPLY_ARRAY)
			for (size_t k = 0; k < r->elements; k++) {
				redisReply *e = r->element[k];
				if (e->element[0]->integer <= slot && slot <= e->element[1]->integer)
					*lo = (int)e->element[0]->integer, *hi = (int)e->element[1]->integer;
			}
		freeReplyObject(r);
	}
	ck_assert_int_ge(*lo, 0);
}

/* A master SIGKILLed while a loop writes fresh keys and reads written ones:
 * every answer is byte-exact or a miss (a miss only for keys whose SET was
 * acknowledged before the kill or failed: asynchronous replication may lose
 * them), failures come within the time-out, and after the replica's promotion
 * writes to the dead master's slots succeed again. */
START_TEST(failover_under_traffic)
{
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	uint16_t vslot = kvs_rcluster_keyslot("{victim}", 8);
	int victim = slot_owner(vslot), lo, hi;
	ck_assert(victim);
	slot_range(vslot, &lo, &hi);
	static uint8_t state[NFAIL];
	static uint16_t vlen[NFAIL];
	uint8_t v[2100], got[2100];
	char k[32];
	int next = 0;
	unsigned long long wrong = 0, miss_before = 0, miss_unsure = 0, fails = 0, ok_after = 0;
	double worst = 0;
	for (; next < 1000; next++) { /* before the kill */
		int kl = snprintf(k, sizeof(k), "fo:%d", next);
		vlen[next] = (uint16_t)(100 + (next * 13) % 2000);
		fill(v, vlen[next], (uint64_t)next + 9000);
		ck_assert_int_eq(kvs_rcluster_set(c, k, (size_t)kl, v, vlen[next]), 0);
		state[next] = K_BEFORE;
	}
	ck_assert_int_eq(kill(pid_of(victim), SIGKILL), 0);
	double t_kill = now_ms(), t_promoted = 0, t_resumed = 0;
	int ok_victim_slots = 0;
	uint64_t x = 42;
	while (ok_victim_slots < 100) {
		ck_assert_msg(next < NFAIL && now_ms() - t_kill < 40000,
			      "writes to the dead master's slots did not resume (%d keys, %.0f ms, promoted: %s)", next,
			      now_ms() - t_kill, t_promoted ? "yes" : "no");
		/* a fresh key */
		int kl = snprintf(k, sizeof(k), "fo:%d", next);
		uint16_t slot = kvs_rcluster_keyslot(k, (size_t)kl);
		vlen[next] = (uint16_t)(100 + (next * 13) % 2000);
		fill(v, vlen[next], (uint64_t)next + 9000);
		double t0 = now_ms();
		int rc = kvs_rcluster_set(c, k, (size_t)kl, v, vlen[next]);
		double dt = now_ms() - t0;
		worst = dt > worst ? dt : worst;
		if (rc != 0)
			ck_assert_msg(rc == -EHOSTDOWN || rc == KVS_E_TIMEOUT, "set: %s (%s)", kvs_strerror(rc),
				      kvs_rcluster_last_error(c));
		state[next] = rc == 0 ? K_AFTER : K_UNSURE;
		bool failed = rc != 0;
		if (rc == 0 && slot >= lo && slot <= hi && ++ok_victim_slots == 1)
			t_resumed = now_ms();
		next++;
		/* a read of a random written key */
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		int i = (int)(x % (uint64_t)next);
		kl = snprintf(k, sizeof(k), "fo:%d", i);
		size_t len = 0;
		t0 = now_ms();
		rc = kvs_rcluster_get(c, k, (size_t)kl, got, sizeof(got), &len);
		dt = now_ms() - t0;
		worst = dt > worst ? dt : worst;
		fill(v, vlen[i], (uint64_t)i + 9000);
		if (rc == 0)
			wrong += len != vlen[i] || memcmp(got, v, len) != 0;
		else if (rc == KVS_E_MISS)
			ck_assert_msg(state[i] != K_AFTER, "key %d, acknowledged after the kill, is missing", i);
		else
			ck_assert_msg(rc == -EHOSTDOWN || rc == KVS_E_TIMEOUT, "get: %s (%s)", kvs_strerror(rc),
				      kvs_rcluster_last_error(c));
		failed |= rc != 0 && rc != KVS_E_MISS;
		fails += failed;
		if (failed)
			usleep(2000); /* pace the loop while calls fail fast */
		if (!t_promoted && next % 20 == 0) {
			int o = slot_owner(vslot);
			if (o && o != victim)
				t_promoted = now_ms();
		}
	}
	/* every node agrees again (a node may say CLUSTERDOWN for a moment after the promotion) */
	double settle = wait_cluster_ok(20000);
	/* every key: byte-exact or, if acknowledged before the kill (or failed), a miss */
	for (int i = 0; i < next; i++) {
		int kl = snprintf(k, sizeof(k), "fo:%d", i);
		size_t len = 0;
		int rc = kvs_rcluster_get(c, k, (size_t)kl, got, sizeof(got), &len);
		fill(v, vlen[i], (uint64_t)i + 9000);
		if (rc == 0) {
			wrong += len != vlen[i] || memcmp(got, v, len) != 0;
		} else {
			ck_assert_msg(rc == KVS_E_MISS, "get %d after the failover: %s (%s)", i, kvs_strerror(rc),
				      kvs_rcluster_last_error(c));
			ck_assert_msg(state[i] != K_AFTER, "key %d, acknowledged after the kill, is missing", i);
			miss_before += state[i] == K_BEFORE;
			miss_unsure += state[i] == K_UNSURE;
		}
		ok_after += rc == 0;
	}
	kvs_rcluster_stats s;
	kvs_rcluster_get_stats(c, &s);
	fprintf(stderr,
		"failover: promotion seen %.0f ms after the kill, writes to its slots resumed after %.0f ms; %llu"
		" iterations with a failed call, slowest call %.0f ms; %d keys: %llu read back, %llu wrong, misses:"
		" %llu acknowledged before the kill, %llu failed SETs; refreshes %llu, nodes down %llu, time-outs %llu;"
		" every node ok %.0f ms after the loop\n",
		t_promoted - t_kill, t_resumed - t_kill, fails, worst, next, ok_after, wrong, miss_before, miss_unsure,
		(unsigned long long)s.refreshes, (unsigned long long)s.nodes_down, (unsigned long long)s.timeouts,
		settle);
	ck_assert_uint_eq(wrong, 0);
	ck_assert_double_lt(worst, OP_MS + 250.0); /* no call waits beyond its time-out */
	ck_assert_uint_gt(s.refreshes, 1);
	kvs_rcluster_close(c);
}
END_TEST

/* Every live node stopped (SIGSTOP: connections are accepted by the kernel,
 * nothing answers): each call fails within 2 x io_timeout_ms, then calls
 * fail fast while the nodes are down; after SIGCONT, calls succeed again. */
START_TEST(cluster_stopped)
{
	wait_cluster_ok(20000);
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	char k[32];
	uint8_t got[64];
	for (int i = 0; i < 50; i++) { /* connections to every master, in use */
		int kl = snprintf(k, sizeof(k), "st:%d", i);
		ck_assert_int_eq(kvs_rcluster_set(c, k, (size_t)kl, "x", 1), 0);
	}
	for (int i = 0; i < g_n; i++)
		kill(g_pid[i], SIGSTOP);
	/* the verdicts wait until the nodes run again (a failed assertion ends the case) */
	double worst = 0;
	int bad_rc = 0, slow = -1, fast = 0;
	for (int i = 0; i < 30; i++) {
		int kl = snprintf(k, sizeof(k), "st:%d", i);
		size_t len;
		const void *kp[2] = {k, "st:40"};
		size_t kls[2] = {(size_t)kl, 5};
		bool out[2];
		double t0 = now_ms();
		int rc = i % 3 == 0 ? kvs_rcluster_get(c, k, (size_t)kl, got, sizeof(got), &len)
			 : i % 3 == 1 ? kvs_rcluster_set(c, k, (size_t)kl, "y", 1)
				      : kvs_rcluster_exists_many(c, kp, kls, 2, out);
		double dt = now_ms() - t0;
		if (dt > worst)
			worst = dt, slow = i;
		fast += dt < 10;
		if (rc != KVS_E_TIMEOUT && rc != -EHOSTDOWN)
			bad_rc = rc ? rc : 1;
	}
	kvs_rcluster_stats s;
	kvs_rcluster_get_stats(c, &s);
	fprintf(stderr, "stopped cluster: 30 calls failed, %d of them at once (< 10 ms), slowest %.0f ms (call %d),"
		" %llu time-outs, last: %s\n", fast, worst, slow, (unsigned long long)s.timeouts, kvs_rcluster_last_error(c));
	for (int i = 0; i < g_n; i++)
		kill(g_pid[i], SIGCONT);
	ck_assert_msg(bad_rc == 0, "a call answered %s", kvs_strerror(bad_rc));
	/* op_timeout_ms (2 x io_timeout_ms) bounds each call, a little scheduling aside */
	ck_assert_double_lt(worst, OP_MS + 150.0);
	ck_assert_uint_gt(s.timeouts, 0);
	double t0 = now_ms();
	int rc = -1;
	while (now_ms() - t0 < 30000) {
		size_t len;
		rc = kvs_rcluster_get(c, "st:1", 4, got, sizeof(got), &len);
		if (rc == 0 && (rc = kvs_rcluster_set(c, "st:2", 4, "z", 1)) == 0)
			break;
		usleep(50000);
	}
	ck_assert_msg(rc == 0, "no recovery after SIGCONT: %s (%s)", kvs_strerror(rc), kvs_rcluster_last_error(c));
	fprintf(stderr, "stopped cluster: calls succeed again %.0f ms after SIGCONT\n", now_ms() - t0);
	kvs_rcluster_close(c);
}
END_TEST

/* Every node killed: calls fail at once (connection refused) with
 * -EHOSTDOWN, well within the time-out; open fails clearly. */
START_TEST(cluster_killed)
{
	kvs_rcluster *c = open_client(g_seeds, NULL, NULL);
	for (int i = 0; i < g_n; i++)
		kill(g_pid[i], SIGKILL);
	usleep(100000);
	double worst = 0;
	char k[32];
	uint8_t got[64];
	for (int i = 0; i < 12; i++) {
		int kl = snprintf(k, sizeof(k), "kk:%d", i);
		size_t len;
		double t0 = now_ms();
		int rc = i % 2 ? kvs_rcluster_get(c, k, (size_t)kl, got, sizeof(got), &len)
			       : kvs_rcluster_del(c, k, (size_t)kl);
		double dt = now_ms() - t0;
		worst = dt > worst ? dt : worst;
		ck_assert_msg(rc == -EHOSTDOWN, "call %d: %s (%s)", i, kvs_strerror(rc), kvs_rcluster_last_error(c));
		ck_assert_double_lt(dt, 2 * IO_MS);
	}
	fprintf(stderr, "killed cluster: slowest failed call %.1f ms, last error: %s\n", worst,
		kvs_rcluster_last_error(c));
	kvs_rcluster_close(c);
	kvs_rcluster_config cfg;
	kvs_rcluster_config_defaults(&cfg);
	cfg.seeds = g_seeds;
	char err[1024];
	c = NULL;
	ck_assert_int_eq(kvs_rcluster_open(&cfg, &c, err, sizeof(err)), -EHOSTDOWN);
	ck_assert_msg(strstr(err, "refused"), "err: %s", err);
	ck_assert_ptr_null(c);
}
END_TEST

/* A cluster with requirepass/masterauth: the right password (alone, and as
 * user "default") works; a wrong one and none are refused with KVS_E_AUTH and
 * the server's words. */
START_TEST(auth_password)
{
	char d[300], seeds[512];
	int ports[MAXN];
	pid_t pids[MAXN];
	snprintf(d, sizeof(d), "%s/auth", g_dir);
	ck_assert_int_eq(run_helper("start %s --password kvs-secret > /dev/null", d), 0);
	ck_assert_int_eq(read_cluster(d, seeds, sizeof(seeds), ports, pids), 6);
	kvs_rcluster *c = open_client(seeds, NULL, "kvs-secret");
	uint8_t got[16];
	size_t len;
	for (int i = 0; i < 30; i++) {
		char k[16];
		int kl = snprintf(k, sizeof(k), "a:%d", i);
		ck_assert_int_eq(kvs_rcluster_set(c, k, (size_t)kl, k, (size_t)kl), 0);
		ck_assert_int_eq(kvs_rcluster_get(c, k, (size_t)kl, got, sizeof(got), &len), 0);
		ck_assert(len == (size_t)kl && memcmp(got, k, len) == 0);
	}
	kvs_rcluster_close(c);
	c = open_client(seeds, "default", "kvs-secret");
	ck_assert_int_eq(kvs_rcluster_get(c, "a:1", 3, got, sizeof(got), &len), 0);
	kvs_rcluster_close(c);

	kvs_rcluster_config cfg;
	kvs_rcluster_config_defaults(&cfg);
	cfg.seeds = seeds;
	cfg.password = "wrong";
	char err[600];
	c = NULL;
	ck_assert_int_eq(kvs_rcluster_open(&cfg, &c, err, sizeof(err)), KVS_E_AUTH);
	ck_assert_msg(strstr(err, "AUTH refused") && strstr(err, "WRONGPASS"), "err: %s", err);
	fprintf(stderr, "wrong password: %s\n", err);
	cfg.password = NULL;
	ck_assert_int_eq(kvs_rcluster_open(&cfg, &c, err, sizeof(err)), KVS_E_AUTH);
	ck_assert_msg(strstr(err, "NOAUTH"), "err: %s", err);
	fprintf(stderr, "no password: %s\n", err);
	ck_assert_ptr_null(c);
	ck_assert_int_eq(run_helper("stop %s", d), 0);
}
END_TEST

static void add(Suite *s, const char *name, const TTest *t, double timeout)
{
	TCase *tc = tcase_create(name);
	tcase_set_timeout(tc, timeout);
	tcase_add_test(tc, t);
	suite_add_tcase(s, tc);
}

int main(void)
{
	g_helper = getenv("KVS_RCLUSTER_HELPER");
	if (!g_helper) {
		fprintf(stderr, "KVS_RCLUSTER_HELPER (tests/l3/redis_cluster.py) not set\n");
		return 1;
	}
	g_main_pid = getpid();
	snprintf(g_dir, sizeof(g_dir), "/tmp/kvs-l3-XXXXXX");
	if (!mkdtemp(g_dir))
		return 1;
	atexit(cleanup);
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);
	double t0 = now_ms();
	int rc = run_helper("start %s/main > /dev/null", g_dir);
	if (rc == 77) {
		fprintf(stderr, "redis-server not found: skipped\n");
		return 77;
	}
	char d[300];
	snprintf(d, sizeof(d), "%s/main", g_dir);
	if (rc != 0 || (g_n = read_cluster(d, g_seeds, sizeof(g_seeds), g_port, g_pid)) != 6) {
		fprintf(stderr, "could not start the cluster (helper exit %d)\n", rc);
		return 1;
	}
	fprintf(stderr, "cluster up in %.1f s: %s\n", (now_ms() - t0) / 1e3, g_seeds);

	Suite *s = suite_create("l3-rcluster");
	add(s, "keyslot", keyslot_matches_redis, 30);
	add(s, "binary", binary_keys_every_range, 60);
	add(s, "sizes", value_sizes, 60);
	add(s, "moved", moved_during_reshard, 90);
	add(s, "ask", ask_during_migration, 60);
	add(s, "loop", redirect_loop, 30);
	add(s, "auth", auth_password, 90);
	add(s, "partial", exists_many_partial, 60);
	add(s, "failover", failover_under_traffic, 90);
	add(s, "stopped", cluster_stopped, 60);
	add(s, "killed", cluster_killed, 30);
	SRunner *sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	fprintf(stderr, "l3 suite: %.1f s\n", (now_ms() - t0) / 1e3);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
