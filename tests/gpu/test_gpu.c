/* GPU suite: the real server with its CUDA engine and 4 real rank processes
 * on one GPU, each with its own shareable cuMem allocation of 1 GiB of random
 * data registered as 6 layer views (2 groups, one with a padded stride).
 * Store -> lookup -> retrieve into disjoint blocks -> byte-exact, bytes
 * outside the destinations untouched; import dedup; unregister/register in
 * one server process; a rank killed mid-store; restart with L2.
 * Exits 77 (skip) where the server finds no GPU. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_util.h"

#define W 4
#define ALLOC (1ull << 30)
#define G0_LAYERS 4
#define G0_BYTES (64u << 10)
#define G0_STRIDE (68u << 10) /* padded */
#define G0_NB 1024
#define G1_LAYERS 2
#define G1_BYTES (16u << 10)
#define G1_NB 4096
#define BPC 16
#define G1_OFF ((uint64_t)G0_LAYERS * G0_NB * G0_STRIDE)
/* group 2: recurrent (Mamba/GDN-like) state, one block per chunk at the
 * chunk's end boundary, 2 layers, another block size, padded stride */
#define G2_LAYERS 2
#define G2_BYTES (8u << 10)
#define G2_STRIDE (9u << 10)
#define G2_NB 256
#define G2_OFF (G1_OFF + (uint64_t)G1_LAYERS * G1_NB * G1_BYTES)

enum { C_STORE = 1, C_RETRIEVE, C_COMPLETE, C_VERIFY, C_UNREG, C_REG, C_STATE, C_EXIT };
typedef struct cmd {
	int op;
	uint64_t job;
	uint32_t n, src, dst;
	int ok;
} cmd;
typedef struct res {
	int code, state;
	uint64_t value;
} res;

static uint64_t layer_off(int g, int l)
{
	return g == 0 ? (uint64_t)l * G0_NB * G0_STRIDE
	     : g == 1 ? G1_OFF + (uint64_t)l * G1_NB * G1_BYTES
		      : G2_OFF + (uint64_t)l * G2_NB * G2_STRIDE;
}
static uint64_t blk(int g, int l, uint64_t id)
{
	return layer_off(g, l) + id * (g == 0 ? G0_STRIDE : g == 1 ? G1_BYTES : G2_STRIDE);
}

static void key_of(uint32_t k, uint8_t out[32])
{
	uint32_t tokens[256 * 64];
	for (uint32_t i = 0; i < (k + 1) * 256; i++)
		tokens[i] = 7 + i * 13;
	uint8_t keys[64 * 32];
	kvs_keys_for_tokens("test-model", tokens, (k + 1) * 256, 256, keys, 64);
	memcpy(out, keys + 32 * k, 32);
}

/* KVS_GPU_SPREAD=1: rank r uses GPU r % devices (multi-GPU qualification) */
static int rank_device(uint32_t rank)
{
	const char *sp = getenv("KVS_GPU_SPREAD");
	int n = kvs_cuda()->ok ? kvs_cuda()->n_devices : 1;
	return sp && atoi(sp) && n > 0 ? (int)(rank % (uint32_t)n) : 0;
}

typedef struct rk {
	kvs_client *c;
	uint8_t *dev;   /* device pointer */
	uint8_t *orig;  /* host copy of the initial content */
	uint64_t handle;
	uint32_t rank;
} rk;

static int reg(rk *r)
{
	kvs_alloc al[G0_LAYERS + G1_LAYERS + G2_LAYERS];
	kvs_layer ly[G0_LAYERS + G1_LAYERS + G2_LAYERS];
	uint64_t base = 0;
	int n = 0;
	for (int g = 0; g < 3; g++)
		for (int l = 0; l < (g == 0 ? G0_LAYERS : g == 1 ? G1_LAYERS : G2_LAYERS); l++) {
			/* one allocation entry per layer tensor, as an engine would
			 * send them: the server dedups them into one import */
			int rc = kvs_cuda_export(r->dev + layer_off(g, l), &al[n], &base);
			if (rc)
				return rc;
			ly[n] = (kvs_layer){.group = (uint32_t)g, .alloc = (uint32_t)n,
					    .offset = (uint64_t)(uintptr_t)r->dev + layer_off(g, l) - base,
					    .num_blocks = g == 0 ? G0_NB : g == 1 ? G1_NB : G2_NB,
					    .block_stride = g == 0 ? G0_STRIDE : g == 1 ? G1_BYTES : G2_STRIDE,
					    .block_bytes = g == 0 ? G0_BYTES : g == 1 ? G1_BYTES : G2_BYTES};
			n++;
		}
	kvs_group gr[3] = {{.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = BPC,
			    .window_chunks = -1, .null_block = -1},
			   {.id = 1, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = BPC,
			    .window_chunks = -1, .null_block = -1},
			   {.id = 2, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 16 * BPC, .blocks_per_chunk = 1,
			    .window_chunks = -1, .null_block = -1}};
	kvs_registration_desc d = {.device_type = KVS_DEV_CUDA, .allocs = al, .n_allocs = (uint32_t)n, .groups = gr,
				   .n_groups = 3, .layers = ly, .n_layers = (uint32_t)n};
	kvs_cuda_device_uuid(rank_device(r->rank), d.device_uuid);
	int rc = kvs_register(r->c, &d, 20000, &r->handle);
	for (int i = 0; i < n; i++)
		close(al[i].fd);
	return rc;
}

static int job(rk *r, bool store, const cmd *c, int *state)
{
	uint8_t keys[64 * 32];
	int64_t l0[64 * BPC], l1[64 * BPC], l2[64];
	for (uint32_t k = 0; k < c->n; k++) {
		key_of(k, keys + 32 * k);
		for (uint32_t b = 0; b < BPC; b++) {
			l0[k * BPC + b] = (store ? c->src : c->dst) + k * BPC + b;
			l1[k * BPC + b] = (store ? c->src : c->dst) * 4 + k * BPC + b;
		}
		/* the state at the end of chunk k; a retrieve writes only the
		 * last chunk's */
		l2[k] = (store ? c->src : c->dst) / 4 + k;
	}
	const int64_t *ids[3] = {l0, l1, l2};
	uint32_t lens[3] = {c->n * BPC, c->n * BPC, c->n};
	kvs_blocks bl = {.n_groups = 3, .ids = ids, .len = lens};
	return store ? kvs_store(r->c, c->job, keys, c->n, &bl, NULL, 20000, state)
		     : kvs_retrieve(r->c, c->job, keys, c->n, &bl, 0, 20000, state);
}

static uint64_t verify(rk *r, const cmd *c)
{
	const kvs_cuda_api *cu = kvs_cuda();
	uint8_t *now = malloc(ALLOC), *exp = malloc(ALLOC);
	memcpy(exp, r->orig, ALLOC);
	for (uint32_t k = 0; k < c->n; k++)
		for (uint32_t b = 0; b < BPC; b++) {
			for (int l = 0; l < G0_LAYERS; l++)
				memcpy(exp + blk(0, l, c->dst + k * BPC + b), r->orig + blk(0, l, c->src + k * BPC + b), G0_BYTES);
			for (int l = 0; l < G1_LAYERS; l++)
				memcpy(exp + blk(1, l, c->dst * 4 + k * BPC + b), r->orig + blk(1, l, c->src * 4 + k * BPC + b), G1_BYTES);
		}
	if (c->n) /* recurrent: only the last chunk's state, block_bytes (not the padding) */
		for (int l = 0; l < G2_LAYERS; l++)
			memcpy(exp + blk(2, l, c->dst / 4 + c->n - 1), r->orig + blk(2, l, c->src / 4 + c->n - 1), G2_BYTES);
	cu->cuMemcpyDtoH(now, (CUdeviceptr)(uintptr_t)r->dev, ALLOC);
	uint64_t diff = 0;
	if (c->ok) { /* destinations only */
		for (uint32_t k = 0; k < c->n; k++)
			for (uint32_t b = 0; b < BPC; b++) {
				for (int l = 0; l < G0_LAYERS; l++) {
					uint64_t o = blk(0, l, c->dst + k * BPC + b);
					diff += memcmp(now + o, exp + o, G0_BYTES) != 0;
				}
				for (int l = 0; l < G1_LAYERS; l++) {
					uint64_t o = blk(1, l, c->dst * 4 + k * BPC + b);
					diff += memcmp(now + o, exp + o, G1_BYTES) != 0;
				}
			}
		for (int l = 0; c->n && l < G2_LAYERS; l++) {
			uint64_t o = blk(2, l, c->dst / 4 + c->n - 1);
			diff += memcmp(now + o, exp + o, G2_BYTES) != 0;
		}
	} else {
		for (uint64_t i = 0; i < ALLOC; i += 8)
			diff += memcmp(now + i, exp + i, 8) != 0;
	}
	free(now);
	free(exp);
	return diff;
}

/* legacy: the rank's KV memory comes from cuMemAlloc (no VMM handle, as
 * cudaMalloc): it is registered through a CUDA IPC handle, not an fd */
static bool legacy;
static const char *engine = "G";
static uint32_t world = W;

typedef struct prank_arg {
	kvt_server *s;
	uint32_t rank;
} prank_arg;

static void rank_main(kvt_server *s, uint32_t rank, int cfd, int rfd)
{
	rk r = {.rank = rank};
	res out = {0};
	r.c = kvt_client(s, engine, KVS_ROLE_WORKER, rank, world, NULL, NULL);
	if (legacy) {
		const kvs_cuda_api *cu = kvs_cuda();
		CUdevice d;
		CUcontext ctx;
		CUdeviceptr p = 0;
		if (cu->ok && cu->cuDeviceGet(&d, 0) == CUDA_SUCCESS && cu->cuDevicePrimaryCtxRetain(&ctx, d) == CUDA_SUCCESS &&
		    cu->cuCtxSetCurrent(ctx) == CUDA_SUCCESS && cu->cuMemAlloc(&p, ALLOC) == CUDA_SUCCESS)
			r.dev = (uint8_t *)(uintptr_t)p;
	} else {
		r.dev = kvs_cuda_alloc(ALLOC, rank_device(rank), NULL);
		if (r.dev)
			fprintf(stderr, "rank %u: 1 GiB on GPU %d\n", rank, rank_device(rank));
	}
	r.orig = malloc(ALLOC);
	if (!r.c || !r.dev || !r.orig) {
		out.code = -1;
	} else {
		uint64_t x = 0x9E3779B97F4A7C15ull * (rank + 1);
		for (uint64_t i = 0; i < ALLOC; i += 8) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			memcpy(r.orig + i, &x, 8);
		}
		kvs_cuda()->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)r.dev, r.orig, ALLOC);
		out.code = reg(&r);
	}
	if (write(rfd, &out, sizeof(out)) != sizeof(out))
		_exit(1);
	cmd c;
	while (read(cfd, &c, sizeof(c)) == sizeof(c)) {
		memset(&out, 0, sizeof(out));
		switch (c.op) {
		case C_STORE: out.code = job(&r, true, &c, &out.state); break;
		case C_RETRIEVE: out.code = job(&r, false, &c, &out.state); break;
		case C_COMPLETE: out.code = kvs_complete(r.c, c.job, c.ok, 20000, &out.state); break;
		case C_VERIFY: out.value = verify(&r, &c); break;
		case C_UNREG: out.code = kvs_unregister(r.c, r.handle, 20000); break;
		case C_REG: out.code = reg(&r); break;
		case C_STATE: out.value = kvs_client_reconnects(r.c); break;
		case C_EXIT:
			kvs_client_close(r.c);
			if (!legacy)
				kvs_cuda_free(r.dev, ALLOC, rank_device(rank), NULL);
			_exit(0);
		}
		if (write(rfd, &out, sizeof(out)) != sizeof(out))
			_exit(1);
	}
	_exit(0);
}

typedef kvt_proc prank;

static void rank_entry(void *arg, int cfd, int rfd)
{
	const prank_arg *a = arg;
	rank_main(a->s, a->rank, cfd, rfd);
}

static int start_rank(prank *p, kvt_server *s, uint32_t rank)
{
	prank_arg a = {.s = s, .rank = rank};
	if (kvt_proc_start(p, rank_entry, &a, NULL, 0) != 0)
		return -1;
	res r;
	if (kvt_proc_call(p, NULL, 0, &r, sizeof(r), 60000) != 0)
		return -1;
	return r.code;
}

static res do1(prank *p, cmd c)
{
	res r = {.code = -999};
	if (write(p->cmd_fd, &c, sizeof(c)) != sizeof(c))
		return r;
	if (kvt_proc_call(p, NULL, 0, &r, sizeof(r), 60000) != 0)
		r.code = -998;
	return r;
}

static void all(prank *p, int n, cmd c, int want)
{
	for (int i = 0; i < n; i++) {
		res r = do1(&p[i], c);
		CHECK(r.code == want, "rank %d op %d job %llu: %s (want %s)", i, c.op, (unsigned long long)c.job,
		      kvs_strerror(r.code), kvs_strerror(want));
	}
}

static int wait_job(kvs_client *sc, uint64_t job)
{
	int st = -1;
	if (kvs_job_wait(sc, job, 20000, &st) != 0)
		return -1;
	return st;
}

int main(void)
{
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "1500", "--heartbeat-ms", "200", "--l1-size", "2G", "--l2-size", "4G", NULL);
	snprintf(s.extra[s.n_extra++], sizeof(s.extra[0]), "--l2-path");
	snprintf(s.extra[s.n_extra++], sizeof(s.extra[0]), "%s/l2", s.dir);
	if (kvt_server_start(&s) != 0) {
		fprintf(stderr, "server did not start\n");
		return 1;
	}
	kvs_client *sc = kvt_client(&s, "G", KVS_ROLE_SCHEDULER, 0, W, NULL, NULL);
	/* the engine is made after the socket is bound (architecture.md §16.4) */
	for (int i = 0; sc && i < 1500 && kvt_stat(sc, "cuda_starting") == 1; i++)
		usleep(10000);
	if (!sc || kvt_stat(sc, "cuda_available") != 1) {
		printf("SKIP: the server found no usable GPU (cuda_available=0)\n");
		kvs_client_close(sc);
		kvt_server_stop(&s);
		kvt_server_cleanup(&s);
		return 77;
	}
	/* the L1 arena is pinned in the background: let it finish */
	KVT_WAIT(kvt_stat(sc, "cuda_pinned_bytes") >= kvt_stat(sc, "l1_capacity"), 30000);
	prank p[W];
	for (int i = 0; i < W; i++)
		CHECK(start_rank(&p[i], &s, (uint32_t)i) == 0, "rank %d did not register", i);
	/* import dedup: 6 layer views over one allocation per rank */
	CHECK(kvt_stat(sc, "imports") == W, "imports %llu", (unsigned long long)kvt_stat(sc, "imports"));
	CHECK(kvt_stat(sc, "aliases") == W * 7, "aliases %llu", (unsigned long long)kvt_stat(sc, "aliases"));
	printf("registered: imports=%llu aliases=%llu (4 ranks x 8 layer views over 1 allocation each; groups: "
	       "full attention, full attention, recurrent state)\n",
	       (unsigned long long)kvt_stat(sc, "imports"), (unsigned long long)kvt_stat(sc, "aliases"));

	/* store 16 chunks (every group, every rank), lookup, retrieve elsewhere */
	all(p, W, (cmd){.op = C_STORE, .job = 1, .n = 16, .src = 0}, 0);
	all(p, W, (cmd){.op = C_COMPLETE, .job = 1, .ok = 1}, 0);
	CHECK(wait_job(sc, 1) == KVS_JOB_COMMITTED, "store job not committed");
	uint8_t keys[16 * 32];
	for (int k = 0; k < 16; k++)
		key_of((uint32_t)k, keys + 32 * k);
	uint64_t hits = 0;
	CHECK(kvs_lookup(sc, keys, 16, false, 0, 5000, &hits, NULL) == 0 && hits == 16, "lookup hits %llu", (unsigned long long)hits);
	all(p, W, (cmd){.op = C_RETRIEVE, .job = 2, .n = 16, .dst = 512}, 0);
	all(p, W, (cmd){.op = C_COMPLETE, .job = 2, .ok = 1}, 0);
	CHECK(wait_job(sc, 2) == KVS_JOB_COMMITTED, "retrieve job not committed");
	for (int i = 0; i < W; i++) {
		res r = do1(&p[i], (cmd){.op = C_VERIFY, .n = 16, .src = 0, .dst = 512});
		CHECK(r.value == 0, "rank %d: %llu 8-byte words differ after retrieve", i, (unsigned long long)r.value);
	}
	printf("store -> lookup (16 hits) -> retrieve into disjoint blocks: byte-exact on %d ranks (the recurrent "
	       "group: only the last chunk's state written), rest untouched\n", W);
	CHECK(kvt_stat(sc, "cuda_errors") == 0, "cuda errors");
	/* every reply left the loop before it slept (a reply of a part that
	 * kvs_cuda_poll completed once waited for the 50 ms tick) */
	CHECK(kvt_stat(sc, "lane_late_flushes") == 0, "lane_late_flushes %llu",
	      (unsigned long long)kvt_stat(sc, "lane_late_flushes"));
	printf("cuda stats: tasks=%llu kernel_launches=%llu fallback_copies=%llu staged_parts=%llu staged_rounds=%llu\n",
	       (unsigned long long)kvt_stat(sc, "cuda_tasks"), (unsigned long long)kvt_stat(sc, "cuda_kernel_launches"),
	       (unsigned long long)kvt_stat(sc, "cuda_fallback_copies"), (unsigned long long)kvt_stat(sc, "cuda_staged_parts"),
	       (unsigned long long)kvt_stat(sc, "cuda_staged_rounds"));
	/* gpu-run.sh runs the suite once per copy path: make sure it took it */
	const char *smin = getenv("KVS_CUDA_STAGE_MIN"), *sbytes = getenv("KVS_CUDA_STAGE_BYTES");
	if (sbytes && strcmp(sbytes, "0") == 0)
		CHECK(kvt_stat(sc, "cuda_staged_parts") == 0, "staging disabled, yet parts were staged");
	else if (smin && strcmp(smin, "0") == 0)
		CHECK(kvt_stat(sc, "cuda_staged_parts") >= 2 * W, "staging forced, yet only %llu parts staged",
		      (unsigned long long)kvt_stat(sc, "cuda_staged_parts"));
	/* staging memory: one block of slots per registration, made at register
	 * (issue 18: not by the first staged part), and one for the retrieve
	 * pipe of the device they share (made with its first registration) */
	uint64_t per = sbytes ? strtoull(sbytes, NULL, 10) : 32ull << 20, held = kvt_stat(sc, "cuda_staging_bytes");
	per = per < 16384 ? 0 : per / 4 / 4096 * 4096 * 4;
	/* one pipe per device the ranks use: one device unless KVS_GPU_SPREAD
	 * (rank_device would initialise CUDA here, in the process that forks
	 * the ranks, and CUDA does not survive a fork) */
	const char *spread = getenv("KVS_GPU_SPREAD");
	bool one_dev = !spread || !atoi(spread);
	CHECK(per ? (one_dev ? held == per * (W + 1) : held > per * W && held <= 2 * per * W && held % per == 0)
		  : held == 0,
	      "staging memory held %llu (per registration %llu, staged parts %llu)", (unsigned long long)held,
	      (unsigned long long)per, (unsigned long long)kvt_stat(sc, "cuda_staged_parts"));

	/* unregister then register again, same server process */
	all(p, W, (cmd){.op = C_UNREG}, 0);
	CHECK(KVT_WAIT(kvt_stat(sc, "imports") == 0, 5000), "imports after unregister: %llu", (unsigned long long)kvt_stat(sc, "imports"));
	/* released on the setup thread, after the reply */
	CHECK(KVT_WAIT(kvt_stat(sc, "cuda_staging_bytes") == 0, 5000), "staging memory after unregister: %llu",
	      (unsigned long long)kvt_stat(sc, "cuda_staging_bytes"));
	all(p, W, (cmd){.op = C_REG}, 0);
	CHECK(kvt_stat(sc, "imports") == W, "imports after re-register");
	all(p, W, (cmd){.op = C_RETRIEVE, .job = 3, .n = 16, .dst = 512}, 0);
	all(p, W, (cmd){.op = C_COMPLETE, .job = 3, .ok = 1}, 0);
	CHECK(wait_job(sc, 3) == KVS_JOB_COMMITTED, "retrieve after re-register");
	printf("unregister -> imports 0 -> register again -> retrieve: ok\n");

	/* a rank killed mid-store: the job aborts, its mappings go with its session */
	all(p, W - 1, (cmd){.op = C_STORE, .job = 4, .n = 4, .src = 128}, 0);
	res r3 = do1(&p[W - 1], (cmd){.op = C_STORE, .job = 4, .n = 4, .src = 128});
	CHECK(r3.code == 0, "rank 3 store");
	kvt_proc_kill(&p[W - 1]);
	CHECK(wait_job(sc, 4) == KVS_JOB_ABORTED, "job 4 not aborted");
	CHECK(KVT_WAIT(kvt_stat(sc, "imports") == W - 1, 5000), "killed rank's import not released: %llu",
	      (unsigned long long)kvt_stat(sc, "imports"));
	CHECK(kvt_stat(sc, "retained_blocks") == 0, "retained blocks left");
	printf("rank killed mid-store: job aborted, its import released (imports=%llu)\n",
	       (unsigned long long)kvt_stat(sc, "imports"));
	CHECK(start_rank(&p[W - 1], &s, W - 1) == 0, "replacement rank");

	/* restart: L2 serves a chunk stored before it, into GPU memory */
	KVT_WAIT(kvt_stat(sc, "l2_queue_depth") == 0, 10000);
	int st = kvt_server_stop(&s);
	CHECK(st == 0, "server exit %d", st);
	CHECK(kvt_server_start(&s) == 0, "restart");
	KVT_WAIT(kvt_stat(sc, "registrations") == W, 15000);
	CHECK(kvt_stat(sc, "registrations") == W, "ranks did not re-register: %llu", (unsigned long long)kvt_stat(sc, "registrations"));
	hits = 0;
	kvs_lookup(sc, keys, 16, false, 0, 5000, &hits, NULL);
	CHECK(hits == 16, "after restart lookup hits %llu", (unsigned long long)hits);
	/* the replacement rank 3 was seeded like the one it replaces */
	all(p, W, (cmd){.op = C_RETRIEVE, .job = 5, .n = 16, .dst = 768}, 0);
	all(p, W, (cmd){.op = C_COMPLETE, .job = 5, .ok = 1}, 0);
	CHECK(wait_job(sc, 5) == KVS_JOB_COMMITTED, "retrieve after restart");
	for (int i = 0; i < W; i++) {
		res r = do1(&p[i], (cmd){.op = C_VERIFY, .n = 16, .src = 0, .dst = 768, .ok = 1});
		CHECK(r.value == 0, "rank %d: %llu blocks differ after the L2 retrieve", i, (unsigned long long)r.value);
	}
	printf("restart: lookup hits %llu from L2, retrieve into GPU committed\n", (unsigned long long)hits);

	/* memory without a VMM handle (cuMemAlloc, like cudaMalloc): legacy IPC */
	legacy = true;
	engine = "L";
	world = 1;
	kvs_client *lsc = kvt_client(&s, "L", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	prank lp;
	CHECK(start_rank(&lp, &s, 0) == 0, "legacy rank did not register");
	do1(&lp, (cmd){.op = C_STORE, .job = 100, .n = 16, .src = 0});
	res lr = do1(&lp, (cmd){.op = C_COMPLETE, .job = 100, .ok = 1});
	CHECK(lr.code == 0 && wait_job(lsc, 100) == KVS_JOB_COMMITTED, "legacy store");
	do1(&lp, (cmd){.op = C_RETRIEVE, .job = 101, .n = 16, .dst = 512});
	do1(&lp, (cmd){.op = C_COMPLETE, .job = 101, .ok = 1});
	CHECK(wait_job(lsc, 101) == KVS_JOB_COMMITTED, "legacy retrieve");
	lr = do1(&lp, (cmd){.op = C_VERIFY, .n = 16, .src = 0, .dst = 512});
	CHECK(lr.value == 0, "legacy memory: %llu words differ", (unsigned long long)lr.value);
	printf("cuMemAlloc'd (legacy, CUDA IPC) memory: store -> retrieve byte-exact, rest untouched\n");
	do1(&lp, (cmd){.op = C_EXIT});
	kvt_proc_wait(&lp);
	kvs_client_close(lsc);
	for (int i = 0; i < W; i++)
		do1(&p[i], (cmd){.op = C_EXIT});
	for (int i = 0; i < W; i++)
		kvt_proc_wait(&p[i]);
	return gpu_finish(&s, sc);
}
