/* The benchmark modes. Every figure is reported beside a baseline measured
 * in the same run on the same machine. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench.h"
#include "kvs_l2.h"
#if KVS_HAVE_CUDA
#include "kvs_cuda.h"
#endif

/* ---- rank processes ------------------------------------------------------- */

typedef struct geo {
	uint32_t layers, bpc, nb;
	uint64_t block;
	bool cuda; /* KV region in GPU memory (kvs_cuda_alloc) instead of a memfd */
	bool spread; /* cuda: rank r on GPU r % devices */
} geo;

typedef struct rank_ctx {
	int dev; /* cuda: the GPU */
	kvs_client *c;
	uint8_t *mem;
	int fd;
	uint64_t size;
	geo g;
	bool one_msg; /* store jobs: the complete on the part (kvs_store_complete_async) */
} rank_ctx;

static int rank_setup(const kvt_server *s, const char *engine, uint32_t rank, uint32_t world, geo g, rank_ctx *r)
{
	memset(r, 0, sizeof(*r));
	r->g = g;
	r->c = kvt_client(s, engine, KVS_ROLE_WORKER, rank, world, NULL, NULL);
	if (!r->c)
		return -1;
	r->size = (uint64_t)g.layers * g.nb * g.block;
	kvs_alloc al = {.fd = -1, .size = r->size};
	uint64_t base = 0;
	if (g.cuda) {
		r->dev = 0;
#if KVS_HAVE_CUDA
		if (g.spread && kvs_cuda()->ok && kvs_cuda()->n_devices > 0)
			r->dev = (int)(rank % (uint32_t)kvs_cuda()->n_devices);
#endif
		r->mem = kvs_cuda_alloc(r->size, r->dev, NULL);
		if (!r->mem || kvs_cuda_export(r->mem, &al, &base) != 0)
			return -1;
	} else {
		if (kvs_memfd_create("bench", r->size, &r->fd, (void **)&r->mem) != 0)
			return -1;
		uint64_t x = 0x9E3779B97F4A7C15ull * (rank + 7);
		for (uint64_t i = 0; i + 8 <= r->size; i += 8) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			memcpy(r->mem + i, &x, 8);
		}
		al.fd = r->fd;
	}
	kvs_group gr = {.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = g.bpc,
			.window_chunks = -1, .null_block = -1};
	kvs_layer *ly = calloc(g.layers, sizeof(*ly));
	for (uint32_t l = 0; l < g.layers; l++)
		ly[l] = (kvs_layer){.group = 0, .alloc = 0, .offset = (uint64_t)l * g.nb * g.block,
				    .num_blocks = g.nb, .block_stride = g.block, .block_bytes = g.block};
	kvs_registration_desc d = {.device_type = g.cuda ? KVS_DEV_CUDA : KVS_DEV_HOST, .allocs = &al, .n_allocs = 1,
				   .groups = &gr, .n_groups = 1, .layers = ly, .n_layers = g.layers};
	if (g.cuda) {
		kvs_cuda_device_uuid(r->dev, d.device_uuid);
		for (uint32_t l = 0; l < g.layers; l++)
			ly[l].offset += (uint64_t)(uintptr_t)r->mem - base;
	}
	uint64_t h;
	int rc = kvs_register(r->c, &d, 30000, &h);
	if (g.cuda)
		close(al.fd);
	free(ly);
	return rc;
}

/* The replies of a job's part and complete (callbacks on the I/O thread). */
typedef struct replies {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int left, err;
	double t_part; /* when the part's reply came */
} replies;

static void reply_err(const kvs_result *res, void *arg)
{
	replies *w = arg;
	pthread_mutex_lock(&w->mu);
	if (res->code)
		w->err = res->code;
	w->left--;
	pthread_cond_signal(&w->cv);
	pthread_mutex_unlock(&w->mu);
}

static void part_reply(const kvs_result *res, void *arg)
{
	((replies *)arg)->t_part = kvb_now();
	reply_err(res, arg);
}

/* One job of n_keys keys (key ids key0..), blocks id(k, b) = base + stride*(k*bpc+b). */
static int run_job(rank_ctx *r, bool store, uint64_t job, uint64_t run, uint64_t key0, uint32_t n_keys,
		   uint32_t base, uint32_t stride, double *ret_reply)
{
	double t0 = kvb_now();
	uint8_t *keys = malloc((size_t)n_keys * 32);
	int64_t *ids = malloc((size_t)n_keys * r->g.bpc * sizeof(int64_t));
	for (uint32_t k = 0; k < n_keys; k++) {
		kvb_key(run, key0 + k, keys + 32 * k);
		for (uint32_t b = 0; b < r->g.bpc; b++)
			ids[k * r->g.bpc + b] = base + (int64_t)stride * (k * r->g.bpc + b);
	}
	const int64_t *lists[1] = {ids};
	uint32_t len = n_keys * r->g.bpc;
	kvs_blocks bl = {.n_groups = 1, .ids = lists, .len = &len};
	/* what an engine does: the part and its complete go out back to back
	 * (the server keeps a session's messages in order and finalises once the
	 * copy is done), then the rank waits for job_done */
	bool one = store && r->one_msg; /* or in one message, answered at the job's end */
	replies w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .left = one ? 1 : 2};
	int st = 0, rc = one ? kvs_store_complete_async(r->c, job, keys, n_keys, &bl, NULL, 30000, part_reply, &w)
		: store	? kvs_store_async(r->c, job, keys, n_keys, &bl, NULL, 30000, part_reply, &w)
			: kvs_retrieve_async(r->c, job, keys, n_keys, &bl, 0, 30000, part_reply, &w);
	bool part_queued = rc == 0, complete_queued = one;
	if (part_queued && !one)
		complete_queued = (rc = kvs_complete_async(r->c, job, true, 30000, reply_err, &w)) == 0;
	/* a call that was not queued never calls back; the part's reply may be
	 * counting down already, hence the lock */
	pthread_mutex_lock(&w.mu);
	w.left -= !part_queued + !complete_queued;
	pthread_mutex_unlock(&w.mu);
	if (!rc)
		rc = kvs_job_wait(r->c, job, 30000, &st);
	/* the complete's reply may trail job_done: wait for both callbacks */
	pthread_mutex_lock(&w.mu);
	while (w.left > 0)
		pthread_cond_wait(&w.cv, &w.mu);
	pthread_mutex_unlock(&w.mu);
	if (!rc && (st != KVS_JOB_COMMITTED || w.err))
		rc = -1;
	if (ret_reply)
		*ret_reply = w.t_part - t0;
	free(keys);
	free(ids);
	return rc;
}

typedef struct rank_out {
	int rc;
	double t_store; /* control_child, wb_child: the stores' time */
	double at_store[2], at_retrieve[2]; /* copy_child: each phase's start and end (kvb_now) */
	uint32_t n_lat;
	double lat_store[512], lat_retrieve[512];
	double reply_store[512], reply_retrieve[512]; /* part sent -> its reply */
} rank_out;

typedef struct copy_cfg {
	geo g;
	uint32_t chunks, jobs, ranks;
	uint64_t run;
	uint32_t inflight; /* jobs in flight per rank (threads); 0/1 = one at a time */
	bool one_msg;      /* store jobs: the complete on the part */
	uint32_t barriers; /* rank_fn stops this many times: writes an int (rc), waits for go */
} copy_cfg;

typedef struct lane {
	rank_ctx *r;
	const copy_cfg *cc;
	rank_out *out;
	bool store;
	uint32_t first;
	int rc;
} lane;

/* One of cc->inflight threads of a rank: jobs first, first + inflight, ... */
static void *lane_main(void *arg)
{
	lane *l = arg;
	const copy_cfg *cc = l->cc;
	uint32_t step = cc->inflight ? cc->inflight : 1;
	for (uint32_t j = l->first; j < cc->jobs && !l->rc; j += step) {
		double t = kvb_now();
		uint64_t job = cc->run * 1000000 + (l->store ? 0 : 500000) + j;
		l->rc = run_job(l->r, l->store, job, cc->run, (uint64_t)j * cc->chunks, cc->chunks, l->store ? 0 : 1, 2,
				&(l->store ? l->out->reply_store : l->out->reply_retrieve)[j % 512]);
		(l->store ? l->out->lat_store : l->out->lat_retrieve)[j % 512] = kvb_now() - t;
	}
	return NULL;
}

static int run_lanes(rank_ctx *r, const copy_cfg *cc, rank_out *out, bool store)
{
	uint32_t k = cc->inflight > 1 ? cc->inflight : 1;
	lane ln[16];
	pthread_t th[16];
	if (k > 16)
		k = 16;
	for (uint32_t i = 0; i < k; i++) {
		ln[i] = (lane){.r = r, .cc = cc, .out = out, .store = store, .first = i};
		pthread_create(&th[i], NULL, lane_main, &ln[i]);
	}
	int rc = 0;
	for (uint32_t i = 0; i < k; i++) {
		pthread_join(th[i], NULL);
		rc |= ln[i].rc;
	}
	return rc;
}

static void copy_child(const kvt_server *s, const copy_cfg *cc, uint32_t rank, int go_fd, int out_fd)
{
	rank_ctx r;
	rank_out out = {0};
	out.rc = rank_setup(s, "bench", rank, cc->ranks, cc->g, &r);
	char b;
	if (write(out_fd, &out.rc, sizeof(out.rc)) < 0 || read(go_fd, &b, 1) != 1)
		_exit(1);
	/* gather every other block: what a real block table looks like */
	out.at_store[0] = kvb_now();
	if (!out.rc)
		out.rc = run_lanes(&r, cc, &out, true);
	out.at_store[1] = kvb_now();
	/* every rank's stores ended before any retrieve starts (cc->barriers
	 * is 1): the retrieve phase is measured alone, not beside the slowest
	 * ranks' last stores */
	if (write(out_fd, &out.rc, sizeof(out.rc)) < 0 || read(go_fd, &b, 1) != 1)
		_exit(1);
	out.at_retrieve[0] = kvb_now();
	if (!out.rc)
		out.rc = run_lanes(&r, cc, &out, false);
	out.at_retrieve[1] = kvb_now();
	out.n_lat = cc->jobs < 512 ? cc->jobs : 512;
	if (write(out_fd, &out, sizeof(out)) != sizeof(out))
		_exit(1);
	kvs_client_close(r.c);
	_exit(0);
}

typedef void (*rank_fn)(const kvt_server *, const copy_cfg *, uint32_t, int, int);

typedef struct rank_arg {
	const kvt_server *s;
	const copy_cfg *cc;
	uint32_t rank;
	rank_fn fn;
} rank_arg;

static void rank_entry(void *arg, int go_fd, int out_fd)
{
	rank_arg *a = arg;
	a->fn(a->s, a->cc, a->rank, go_fd, out_fd);
}

/* Forks cc->ranks children running fn (kvt_proc: go on the command pipe,
 * setup code and then rank_out on the result pipe), releases them
 * together, collects. */
static int run_ranks(const kvt_server *s, const copy_cfg *cc, rank_fn fn, rank_out *outs)
{
	kvt_proc p[64];
	for (uint32_t i = 0; i < cc->ranks; i++) {
		rank_arg a = {.s = s, .cc = cc, .rank = i, .fn = fn};
		if (kvt_proc_start(&p[i], rank_entry, &a, NULL, 0) != 0) {
			while (i-- > 0)
				kvt_proc_kill(&p[i]);
			return -1;
		}
	}
	int rc = 0;
	for (uint32_t i = 0; i < cc->ranks; i++) {
		int r = -1;
		if (read(p[i].res_fd, &r, sizeof(r)) != sizeof(r) || r)
			rc = -1;
	}
	for (uint32_t k = 0; k <= cc->barriers; k++) {
		for (uint32_t i = 0; i < cc->ranks; i++)
			if (write(p[i].cmd_fd, "g", 1) != 1)
				rc = -1;
		for (uint32_t i = 0; k < cc->barriers && i < cc->ranks; i++) {
			int r = -1;
			if (read(p[i].res_fd, &r, sizeof(r)) != sizeof(r) || r)
				rc = -1;
		}
	}
	for (uint32_t i = 0; i < cc->ranks; i++) {
		if (read(p[i].res_fd, &outs[i], sizeof(outs[i])) != sizeof(outs[i]) || outs[i].rc)
			rc = -1;
		kvt_proc_wait(&p[i]);
	}
	return rc;
}

/* Single-thread gather memcpy of the same pattern into a warm destination
 * as large as the run's data (not cache-resident): the host baseline. */
static double memcpy_gather_gbs(geo g, uint32_t chunks, double seconds, uint64_t dst_bytes)
{
	uint64_t sz = (uint64_t)g.layers * g.nb * g.block;
	uint64_t job = (uint64_t)g.layers * chunks * g.bpc * g.block;
	if (dst_bytes < job)
		dst_bytes = job;
	uint8_t *src = malloc(sz), *dst = malloc(dst_bytes);
	memset(src, 1, sz);
	memset(dst, 2, dst_bytes);
	uint64_t bytes = 0, off = 0;
	double t0 = kvb_now();
	do {
		if (off + job > dst_bytes)
			off = 0;
		uint8_t *d = dst + off;
		off += job;
		for (uint32_t k = 0; k < chunks; k++)
			for (uint32_t l = 0; l < g.layers; l++)
				for (uint32_t b = 0; b < g.bpc; b++) {
					uint64_t id = 2ull * (k * g.bpc + b);
					memcpy(d, src + (uint64_t)l * g.nb * g.block + id * g.block, g.block);
					d += g.block;
				}
		bytes += job;
	} while (kvb_now() - t0 < seconds);
	double gbs = (double)bytes / (kvb_now() - t0) / 1e9;
	free(src);
	free(dst);
	return gbs;
}

/* One large memcpy of the same total: the one-copy ceiling of this host. */
static double memcpy_one_gbs(uint64_t bytes, double seconds)
{
	uint8_t *a = malloc(bytes), *b = malloc(bytes);
	memset(a, 1, bytes);
	memset(b, 2, bytes);
	uint64_t total = 0;
	double t0 = kvb_now();
	do {
		memcpy(b, a, bytes);
		total += bytes;
	} while (kvb_now() - t0 < seconds);
	double gbs = (double)total / (kvb_now() - t0) / 1e9;
	free(a);
	free(b);
	return gbs;
}

/* Sizes one copy configuration: 4 layers, 16 blocks per chunk (1 at 1 MiB
 * and above), about per_job bytes per rank per job (at most 4096 chunks),
 * about per_rank bytes per rank in all (at least 2 jobs), a region twice the
 * gathered blocks (every other block) plus the retrieve destinations. */
static uint64_t copy_size(copy_cfg *cc, uint64_t block, uint64_t per_job, uint64_t per_rank)
{
	cc->g.block = block;
	cc->g.layers = 4;
	cc->g.bpc = block >= (1u << 20) ? 1 : 16;
	uint64_t chunk_bytes = (uint64_t)cc->g.layers * cc->g.bpc * block;
	cc->chunks = (uint32_t)(per_job / chunk_bytes ? per_job / chunk_bytes : 1);
	if (cc->chunks > 4096)
		cc->chunks = 4096;
	cc->jobs = (uint32_t)(per_rank / (chunk_bytes * cc->chunks));
	if (cc->jobs < 2)
		cc->jobs = 2;
	cc->g.nb = 4 * cc->chunks * cc->g.bpc;
	return chunk_bytes;
}

/* A phase's time: first start to last end over the ranks (one clock,
 * CLOCK_MONOTONIC; the phases are apart: copy_child's barrier). */
static double phase_span(const rank_out *outs, uint32_t ranks, bool store)
{
	double a = 0, z = 0;
	for (uint32_t i = 0; i < ranks; i++) {
		const double *t = store ? outs[i].at_store : outs[i].at_retrieve;
		a = i == 0 || t[0] < a ? t[0] : a;
		z = t[1] > z ? t[1] : z;
	}
	return z - a;
}

/* Runs cc's ranks; returns the bytes moved by all ranks in each direction
 * and each phase's time (phase_span), or -1. */
static int copy_measure(const kvt_server *s, const copy_cfg *cc, uint64_t chunk_bytes, const char *mode,
			rank_out *outs, double *bytes, double *ts, double *tr)
{
	copy_cfg c1 = *cc;
	c1.barriers = 1;
	if (run_ranks(s, &c1, copy_child, outs) != 0) {
		fprintf(stderr, "%s: a rank failed at block %llu\n", mode, (unsigned long long)cc->g.block);
		return -1;
	}
	*bytes = (double)chunk_bytes * cc->chunks * cc->jobs * cc->ranks;
	*ts = phase_span(outs, cc->ranks, true);
	*tr = phase_span(outs, cc->ranks, false);
	return 0;
}

int kvb_mode_copy(const kvb_opts *o)
{
	static const uint64_t blocks[] = {16 << 10, 64 << 10, 256 << 10, 2 << 20};
	int rc = 0;
	uint64_t per_job = o->quick ? (2u << 20) : (8u << 20); /* per rank */
	uint64_t per_rank = o->quick ? (16u << 20) : (256u << 20);
	char l1[32];
	snprintf(l1, sizeof(l1), "%llu", (unsigned long long)(o->l1_size ? o->l1_size : 4ull << 30));
	kvt_server s;
	if (kvb_server_start(o, &s, "--l1-size", l1, NULL) != 0) {
		fprintf(stderr, "copy: server did not start\n");
		return 1;
	}
	kvb_note("copy engine cuda: no GPU in this run (host engine only); cuda rows are produced by the GPU script");
	for (size_t bi = 0; bi < sizeof(blocks) / sizeof(blocks[0]); bi++) {
		copy_cfg cc = {.ranks = o->ranks, .run = 100 + bi, .inflight = o->inflight};
		uint64_t chunk_bytes = copy_size(&cc, blocks[bi], per_job, per_rank);
		rank_out outs[64];
		double bytes, ts, tr;
		if (copy_measure(&s, &cc, chunk_bytes, "copy", outs, &bytes, &ts, &tr) != 0) {
			rc = 1;
			continue;
		}
		double base = memcpy_gather_gbs(cc.g, cc.chunks, o->quick ? 0.1 : 0.5, per_rank);
		double one = memcpy_one_gbs(chunk_bytes * cc.chunks, o->quick ? 0.1 : 0.5);
		char nm[96];
		snprintf(nm, sizeof(nm), "copy host store %lluK blocks, %u ranks", (unsigned long long)(cc.g.block >> 10), cc.ranks);
		kvb_result(nm, bytes / ts / 1e9, "GB/s", base, ">= 0.70 x memcpy");
		snprintf(nm, sizeof(nm), "copy host retrieve %lluK blocks, %u ranks", (unsigned long long)(cc.g.block >> 10), cc.ranks);
		kvb_result(nm, bytes / tr / 1e9, "GB/s", base, "");
		snprintf(nm, sizeof(nm), "copy host one-memcpy ceiling %llu KiB", (unsigned long long)(chunk_bytes * cc.chunks >> 10));
		kvb_result(nm, one, "GB/s", 0, "");
		snprintf(nm, sizeof(nm), "copy store job p50 (%lluK, %llu KiB/rank)", (unsigned long long)(cc.g.block >> 10),
			 (unsigned long long)(chunk_bytes * cc.chunks >> 10));
		kvb_result(nm, kvb_pct(outs[0].lat_store, outs[0].n_lat, 0.5) * 1e3, "ms", 0, "");
		snprintf(nm, sizeof(nm), "copy store job p99 (%lluK)", (unsigned long long)(cc.g.block >> 10));
		kvb_result(nm, kvb_pct(outs[0].lat_store, outs[0].n_lat, 0.99) * 1e3, "ms", 0, "");
		snprintf(nm, sizeof(nm), "copy retrieve job p50 (%lluK)", (unsigned long long)(cc.g.block >> 10));
		kvb_result(nm, kvb_pct(outs[0].lat_retrieve, outs[0].n_lat, 0.5) * 1e3, "ms", 0, "");
		snprintf(nm, sizeof(nm), "copy retrieve job p99 (%lluK)", (unsigned long long)(cc.g.block >> 10));
		kvb_result(nm, kvb_pct(outs[0].lat_retrieve, outs[0].n_lat, 0.99) * 1e3, "ms", 0, "");
	}
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);
	return rc;
}

/* ---- control plane ------------------------------------------------------------ */

static void control_child(const kvt_server *s, const copy_cfg *cc, uint32_t rank, int go_fd, int out_fd)
{
	rank_ctx r;
	rank_out out = {0};
	out.rc = rank_setup(s, "ctl", rank, cc->ranks, cc->g, &r);
	r.one_msg = cc->one_msg;
	char b;
	if (write(out_fd, &out.rc, sizeof(out.rc)) < 0 || read(go_fd, &b, 1) != 1)
		_exit(1);
	double t0 = kvb_now();
	for (uint32_t j = 0; j < cc->jobs && !out.rc; j++) {
		double t = kvb_now();
		out.rc = run_job(&r, true, cc->run * 1000000 + j, cc->run, j, 1, 0, 1, NULL);
		out.lat_store[j % 512] = kvb_now() - t;
	}
	out.t_store = kvb_now() - t0;
	out.n_lat = cc->jobs < 512 ? cc->jobs : 512;
	if (write(out_fd, &out, sizeof(out)) != sizeof(out))
		_exit(1);
	kvs_client_close(r.c);
	_exit(0);
}

typedef struct echo_srv {
	void *ctx, *router;
	volatile int stop;
} echo_srv;

static void *echo_main(void *p)
{
	echo_srv *e = p;
	while (!e->stop) {
		zmq_pollitem_t it = {.socket = e->router, .events = ZMQ_POLLIN};
		if (zmq_poll(&it, 1, 50) <= 0)
			continue;
		zmq_msg_t id, body;
		zmq_msg_init(&id);
		zmq_msg_init(&body);
		zmq_msg_recv(&id, e->router, 0);
		zmq_msg_recv(&body, e->router, 0);
		zmq_msg_send(&id, e->router, ZMQ_SNDMORE);
		zmq_msg_send(&body, e->router, 0);
	}
	return NULL;
}

/* Raw DEALER/ROUTER echo round trip of a message of len bytes (seconds). */
static double zmq_echo_rtt(const char *dir, size_t len, uint32_t n)
{
	echo_srv e = {0};
	char ep[400];
	snprintf(ep, sizeof(ep), "ipc://%s/echo-%d", dir, (int)getpid());
	e.ctx = zmq_ctx_new();
	e.router = zmq_socket(e.ctx, ZMQ_ROUTER);
	zmq_bind(e.router, ep);
	pthread_t t;
	pthread_create(&t, NULL, echo_main, &e);
	void *d = zmq_socket(e.ctx, ZMQ_DEALER);
	zmq_connect(d, ep);
	char *buf = calloc(1, len), *rb = malloc(len + 16);
	double t0 = 0;
	for (uint32_t i = 0; i < n + 10; i++) {
		if (i == 10)
			t0 = kvb_now();
		zmq_send(d, buf, len, 0);
		zmq_recv(d, rb, len + 16, 0);
	}
	double rtt = (kvb_now() - t0) / n;
	e.stop = 1;
	pthread_join(t, NULL);
	int z = 0;
	zmq_setsockopt(d, ZMQ_LINGER, &z, sizeof(z));
	zmq_setsockopt(e.router, ZMQ_LINGER, &z, sizeof(z));
	zmq_close(d);
	zmq_close(e.router);
	zmq_ctx_term(e.ctx);
	free(buf);
	free(rb);
	return rtt;
}

/* Responsiveness of the main loop while a rank stores 2 MiB jobs back to
 * back: stats round trips (the loop decodes, collects ~90 counters,
 * encodes) sampled every 2 ms, with write-behind to an L2 that fsyncs every
 * group commit, or without L2 (the baseline). */
typedef struct hb_ctx {
	const kvt_server *s;
	copy_cfg cc;
	rank_out outs[64];
	int rc;
	atomic_int done;
} hb_ctx;

static void *hb_load(void *p)
{
	hb_ctx *h = p;
	h->rc = run_ranks(h->s, &h->cc, control_child, h->outs);
	atomic_store(&h->done, 1);
	return NULL;
}

static int hb_measure(const kvb_opts *o, bool l2, double *p50, double *p99, uint64_t *l2_writes)
{
	kvt_server s;
	char l2dir[600];
	snprintf(l2dir, sizeof(l2dir), "%s/hb-l2-%d", o->dir, (int)getpid());
	int r = l2 ? kvb_server_start(o, &s, "--l1-size", "268435456", "--l2-path", l2dir, "--l2-size", "4294967296",
				      "--l2-sync", "full", NULL)
		   : kvb_server_start(o, &s, "--l1-size", "268435456", NULL);
	if (r != 0)
		return -1;
	kvs_client *sc = kvt_client(&s, "hb", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	uint32_t jobs = o->quick ? 40 : 800;
	hb_ctx *h = calloc(1, sizeof(*h));
	double *lat = calloc(8192, sizeof(*lat));
	uint32_t n = 0;
	pthread_t t;
	if (!sc || !h || !lat) {
		r = -1;
		goto out;
	}
	h->s = &s;
	h->cc = (copy_cfg){.ranks = 1, .run = l2 ? 951 : 950, .jobs = jobs,
			   .g = {.layers = 1, .bpc = 32, .nb = 32 * (jobs + 1), .block = 64 << 10}};
	pthread_create(&t, NULL, hb_load, h);
	kvs_stat_out st[256];
	uint32_t ns;
	while (!atomic_load(&h->done) && n < 8192) {
		double t0 = kvb_now();
		if (kvs_stats(sc, 5000, st, 256, &ns) == 0)
			lat[n++] = kvb_now() - t0;
		usleep(2000);
	}
	pthread_join(t, NULL);
	r = h->rc || n < 10 ? -1 : 0;
	*p50 = n ? kvb_pct(lat, n, 0.5) : 0;
	*p99 = n ? kvb_pct(lat, n, 0.99) : 0;
	*l2_writes = kvb_stat(sc, "l2_writes_committed");
out:
	free(h);
	free(lat);
	kvs_client_close(sc);
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);
	return r;
}

int kvb_mode_control(const kvb_opts *o)
{
	kvt_server s;
	if (kvb_server_start(o, &s, "--l1-size", "1073741824", NULL) != 0)
		return 1;
	int rc = 0;
	/* KVB_CONTROL_TINY / KVB_CONTROL_BIG: other job counts (profiling one phase;
	 * the big phase's rank memory grows with it: 2 MiB per job and rank) */
	const char *jt = getenv("KVB_CONTROL_TINY"), *jb = getenv("KVB_CONTROL_BIG");
	uint32_t jobs = o->quick ? 100 : jt && atoi(jt) > 0 ? (uint32_t)atoi(jt) : 2000;
	/* tiny jobs: one 4 KiB block, one rank */
	copy_cfg tiny = {.ranks = 1, .run = 900, .jobs = jobs, .g = {.layers = 1, .bpc = 1, .nb = jobs + 1, .block = 4096}};
	rank_out outs[64], one[64];
	copy_cfg tiny1 = tiny;
	tiny1.run = 902;
	tiny1.one_msg = true;
	if (run_ranks(&s, &tiny, control_child, outs) == 0 && run_ranks(&s, &tiny1, control_child, one) == 0) {
		double rtt = zmq_echo_rtt(o->dir, 200, jobs);
		kvb_result("control tiny jobs per second (store+complete+job_done, 1 rank)", jobs / outs[0].t_store, "jobs/s",
			   1.0 / rtt, "");
		kvb_result("control tiny job p50 latency", kvb_pct(outs[0].lat_store, outs[0].n_lat, 0.5) * 1e6, "us",
			   rtt * 1e6, "");
		kvb_result("control tiny jobs per second, complete on the part (one request, one reply)",
			   jobs / one[0].t_store, "jobs/s", 1.0 / rtt, ">= 0.80 x echo");
		kvb_result("control tiny job p50 latency, complete on the part", kvb_pct(one[0].lat_store, one[0].n_lat, 0.5) * 1e6,
			   "us", rtt * 1e6, "");
		kvb_note("control baseline: one raw ZeroMQ DEALER/ROUTER echo round trip of a 200-byte message (%.1f us); "
			 "a job is store and complete sent back to back, their replies, and the job_done push; with the "
			 "complete on the part (kvs_store_complete_async) one store whose reply comes at the job's end",
			 rtt * 1e6);
	} else {
		rc = 1;
	}
	/* 2 MiB-per-rank jobs: overhead beyond the copy itself */
	uint32_t jobs2 = o->quick ? 20 : jb && atoi(jb) > 0 ? (uint32_t)atoi(jb) : 200;
	copy_cfg big = {.ranks = o->ranks, .run = 901, .jobs = jobs2,
			.g = {.layers = 1, .bpc = 32, .nb = 32 * (jobs2 + 1), .block = 64 << 10}};
	kvs_client *sc = kvt_client(&s, "ctl", KVS_ROLE_SCHEDULER, 0, o->ranks, NULL, NULL);
	uint64_t busy0 = sc ? kvb_stat(sc, "loop_busy_us") : 0;
	copy_cfg big1 = big;
	big1.run = 903;
	big1.one_msg = true;
	uint64_t busy1 = 0;
	if (sc && run_ranks(&s, &big, control_child, outs) == 0 &&
	    (busy1 = kvb_stat(sc, "loop_busy_us"), run_ranks(&s, &big1, control_child, one) == 0)) {
		uint64_t busy = busy1 - busy0, busy_one = kvb_stat(sc, "loop_busy_us") - busy1;
		geo g1 = {.layers = 1, .bpc = 32, .nb = 64, .block = 64 << 10};
		double gbs = memcpy_gather_gbs(g1, 1, o->quick ? 0.1 : 0.5, 256ull << 20);
		double copy_s = (double)(2 << 20) * o->ranks / (gbs * 1e9); /* the job's bytes, one memcpy thread */
		double per_job = (double)busy * 1e-6 / jobs2, per_job1 = (double)busy_one * 1e-6 / jobs2;
		double p50 = kvb_pct(outs[0].lat_store, outs[0].n_lat, 0.5);
		kvb_result("control 2 MiB/rank job p50 latency (end to end)", p50 * 1e3, "ms", copy_s * 1e3, "");
		kvb_result("control 2 MiB/rank job: server main-loop time per job", per_job * 1e6, "us", copy_s * 1e6, "");
		kvb_result("control 2 MiB/rank job: control overhead / copy time", per_job / copy_s * 100, "%", 0, "< 3 %");
		kvb_result("control 2 MiB/rank job, complete on the part: p50 latency",
			   kvb_pct(one[0].lat_store, one[0].n_lat, 0.5) * 1e3, "ms", copy_s * 1e3, "");
		kvb_result("control 2 MiB/rank job, complete on the part: control overhead / copy time",
			   per_job1 / copy_s * 100, "%", 0, "< 3 %");
		kvb_note("control overhead = main-loop busy time per job (decode, plan, bookkeeping, replies; all %u ranks) "
			 "over the job's copy time at the same-run single-thread gather memcpy rate (%.2f GB/s); end-to-end "
			 "latency adds the client's messages through the libkvside I/O thread", o->ranks, gbs);
	} else {
		rc = 1;
	}
	kvs_client_close(sc);
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);
	/* the loop under write-behind load (issue 16 #11): within 2x of no L2 */
	double a50, a99, b50, b99;
	uint64_t w0, w1;
	if (hb_measure(o, false, &b50, &b99, &w0) == 0 && hb_measure(o, true, &a50, &a99, &w1) == 0) {
		kvb_result("control stats round trip p50 under write-behind load (L2, fsync)", a50 * 1e3, "ms", b50 * 1e3, "");
		kvb_result("control stats round trip p99 under write-behind load (L2, fsync)", a99 * 1e3, "ms", b99 * 1e3,
			   "<= 2 x without L2");
		kvb_note("control under load: one rank storing 2 MiB jobs back to back through a 256 MiB L1; a stats "
			 "request every 2 ms; baseline the same without L2 (%llu objects written behind in the L2 run)",
			 (unsigned long long)w1);
	} else {
		rc = 1;
	}
	return rc;
}

/* ---- L2 --------------------------------------------------------------------- */

/* Completions come back as in the server: through a completion queue,
 * whose item the L2 posts once until it runs (one wakeup for many). */
typedef struct l2_sink {
	kvs_cq *cq;
	uint32_t got;
	int errs;
} l2_sink;

static l2_sink sink;

static void l2_sink_done(void *arg, const kvs_l2_done *d)
{
	l2_sink *k = arg;
	k->got++;
	k->errs += d->result != 0;
}

/* Opens L2 with a fresh completion queue; l2_sink_close closes both (the
 * L2's queue item may still be posted after its last completion, and must
 * not run once the L2 is gone: the queue is destroyed with it). */
static int l2_sink_open(kvs_l2_config *cfg, kvs_l2 **ret)
{
	sink = (l2_sink){0};
	if (kvs_cq_create(&sink.cq) != 0)
		return -1;
	cfg->cq = sink.cq;
	cfg->on_done = l2_sink_done;
	cfg->done_arg = &sink;
	if (kvs_l2_open(cfg, ret) != 0) {
		kvs_cq_destroy(sink.cq);
		return -1;
	}
	return 0;
}

static void l2_sink_close(kvs_l2 *l2)
{
	kvs_l2_close(l2);
	kvs_cq_destroy(sink.cq);
	sink.cq = NULL;
}

static int l2_wait(kvs_l2 *l2, uint32_t want, int *errs)
{
	(void)l2;
	while (sink.got < want) {
		struct pollfd p = {.fd = kvs_cq_fd(sink.cq), .events = POLLIN};
		if (poll(&p, 1, 60000) != 1)
			return -1;
		kvs_cq_run(sink.cq);
	}
	sink.got -= want;
	*errs += sink.errs;
	sink.errs = 0;
	return 0;
}

/* Reads objects 0..n-1 of run 77 into dst[i] with `readers` reader threads
 * (a fresh open: a fresh map, as after a restart); seconds, or -1. */
static double l2_read_pass(kvs_l2_config cfg, uint32_t readers, uint8_t **dst, uint32_t n, uint64_t sz, int *errs)
{
	cfg.readers = readers;
	kvs_l2 *l2;
	if (l2_sink_open(&cfg, &l2) != 0)
		return -1;
	double t0 = kvb_now();
	for (uint32_t i = 0; i < n; i++) {
		kvs_objkey k = {0};
		kvb_key(77, i, k.chunk);
		kvs_l2_read(l2, &k, 1, dst[i], sz, NULL);
	}
	int r = l2_wait(l2, n, errs);
	double t = kvb_now() - t0;
	l2_sink_close(l2);
	return r ? -1 : t;
}

int kvb_mode_l2(const kvb_opts *o)
{
	uint32_t n = o->quick ? 64 : 512;
	uint64_t sz = 1 << 20;
	char dir[300], raw[320];
	snprintf(dir, sizeof(dir), "%s/l2bench-XXXXXX", o->dir);
	if (!mkdtemp(dir))
		return 1;
	/* reads land in objects reserved in a real L1 whose arena is faulted
	 * in first, as the server's is (l1_prefaulted_bytes) */
	kvs_l1_config l1c = {.size = (uint64_t)n * sz + (64u << 20)};
	kvs_l1 *l1;
	if (kvs_l1_create(&l1c, &l1) != 0)
		return 1;
	uint64_t arena_len;
	uint8_t *arena = kvs_l1_arena(l1, &arena_len);
	for (uint64_t i = 0; i < arena_len; i += 4096)
		arena[i] = 1;
	uint8_t **dst = calloc(n, sizeof(*dst));
	for (uint32_t i = 0; i < n; i++) {
		kvs_objkey k = {0};
		kvb_key(78, i, k.chunk);
		kvs_l1_obj *ob;
		if (kvs_l1_reserve(l1, &k, sz, &ob) != 0)
			return 1;
		dst[i] = kvs_l1_data(ob);
	}
	uint8_t *data = malloc(sz * 16);
	for (uint64_t i = 0; i < sz * 16; i++)
		data[i] = (uint8_t)(i * 131 + (i >> 12));
	kvs_l2_config cfg;
	kvs_l2_config_defaults(&cfg);
	char path[320];
	snprintf(path, sizeof(path), "%s/env", dir);
	cfg.path = path;
	cfg.size = 16ull << 30; /* sparse; large enough that group commits are not capped */
	uint32_t readers = cfg.readers;
	kvs_l2 *l2;
	if (l2_sink_open(&cfg, &l2) != 0)
		return 1;
	int errs = 0;
	/* writes: rounds of n new objects to L2 and n MiB to a fresh raw file
	 * (sequential write() + fsync per 256 MiB, the L2 group-commit size,
	 * and at the end), alternating which goes first; medians. This disk's
	 * write rate swings by 3x from one second to the next (a shared
	 * virtual disk), so one pair of runs says little. */
	uint32_t rounds = o->quick ? 1 : 5;
	double tws[8], rws[8];
	for (uint32_t r = 0; r < rounds; r++) {
		for (int pass = 0; pass < 2; pass++) {
			if ((pass == 0) == (r % 2 == 0)) {
				snprintf(raw, sizeof(raw), "%s/raw-%u.bin", dir, r);
				int fd = open(raw, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
				double t0 = kvb_now();
				for (uint32_t i = 0; i < n; i++) {
					if (write(fd, data + (i % 16) * sz, sz) != (ssize_t)sz)
						errs++;
					if ((i + 1) % 256 == 0)
						fsync(fd);
				}
				fsync(fd);
				rws[r] = kvb_now() - t0;
				close(fd);
			} else {
				double t0 = kvb_now();
				for (uint32_t i = 0; i < n; i++) {
					kvs_objkey k = {0};
					kvb_key(77 + r, i, k.chunk);
					kvs_l2_write(l2, &k, 1, data + (i % 16) * sz, sz, NULL);
				}
				l2_wait(l2, n, &errs);
				tws[r] = kvb_now() - t0;
			}
		}
	}
	/* each round's ratio against its own neighbour too: the disk drifts */
	double wratio[8];
	for (uint32_t r = 0; r < rounds; r++)
		wratio[r] = rws[r] / tws[r];
	double wr = kvb_pct(wratio, rounds, 0.5);
	double tw = kvb_pct(tws, rounds, 0.5), rw = kvb_pct(rws, rounds, 0.5);
	kvs_l2_stats st;
	kvs_l2_get_stats(l2, &st);
	l2_sink_close(l2);
	/* reads, interleaved rounds, medians: L2 with the default reader
	 * threads, L2 with one, and the raw read of the same bytes from the
	 * page cache (the last raw file) into the same L1 objects */
	double trs[8], tr1s[8], rrs[8];
	uint32_t rr_rounds = o->quick ? 1 : 3;
	for (uint32_t r = 0; r < rr_rounds; r++) {
		trs[r] = l2_read_pass(cfg, readers, dst, n, sz, &errs);
		tr1s[r] = l2_read_pass(cfg, 1, dst, n, sz, &errs);
		for (uint32_t i = 0; i < n; i++)
			if (memcmp(dst[i], data + (i % 16) * sz, sz) != 0)
				errs++;
		int fd = open(raw, O_RDONLY | O_CLOEXEC);
		double t0 = kvb_now();
		for (uint32_t i = 0; i < n; i++)
			if (read(fd, dst[i], sz) != (ssize_t)sz)
				errs++;
		rrs[r] = kvb_now() - t0;
		close(fd);
	}
	double rratio[8], rratio1[8];
	for (uint32_t r = 0; r < rr_rounds; r++) {
		rratio[r] = trs[r] > 0 ? rrs[r] / trs[r] : 0;
		rratio1[r] = tr1s[r] > 0 ? rrs[r] / tr1s[r] : 0;
	}
	double rq = kvb_pct(rratio, rr_rounds, 0.5), rq1 = kvb_pct(rratio1, rr_rounds, 0.5);
	double tr = kvb_pct(trs, rr_rounds, 0.5), tr1 = kvb_pct(tr1s, rr_rounds, 0.5), rr = kvb_pct(rrs, rr_rounds, 0.5);
	double mb = (double)n * sz / 1e9;
	char nm[128];
	kvb_result("l2 write (LMDB group commit, sync full, 1 MiB objects)", mb / tw, "GB/s", mb / rw, ">= 0.90 x raw write + fsync");
	snprintf(nm, sizeof(nm), "l2 read (checksum verified, into L1, %u reader threads)", readers);
	kvb_result(nm, tr > 0 ? mb / tr : 0, "GB/s", mb / rr, ">= 0.80 x raw page-cache read");
	kvb_result("l2 read (checksum verified, into L1, 1 reader thread)", tr1 > 0 ? mb / tr1 : 0, "GB/s", mb / rr, "");
	kvb_result("l2 write / raw write + fsync, median of the rounds' own ratios", wr, "ratio", 1, ">= 0.90");
	snprintf(nm, sizeof(nm), "l2 read (%u reader threads) / raw read, median of the rounds' own ratios", readers);
	kvb_result(nm, rq, "ratio", 1, ">= 0.80");
	kvb_result("l2 read (1 reader thread) / raw read, median of the rounds' own ratios", rq1, "ratio", 1, "");
	kvb_note("l2: %u rounds of %u objects of 1 MiB (%llu group commits), medians; write baseline = the same bytes "
		 "by sequential write() + fsync per 256 MiB to a fresh file in the same directory, alternating with the "
		 "L2 round; read baseline = one read() per object of such a file from the page cache into the same "
		 "pre-faulted L1 objects (one thread); each L2 read pass opens the environment afresh (a fresh map); "
		 "%u interleaved read rounds, medians", rounds, n, (unsigned long long)st.write_batches, rr_rounds);
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (system(cmd) != 0)
		errs++;
	free(data);
	free(dst);
	kvs_l1_destroy(l1);
	return errs || tr < 0 || tr1 < 0 ? 1 : 0;
}

/* ---- write-behind under sustained stores (issue 18) ------------------------ */

/* Shared by the writebehind ranks (MAP_SHARED, set before they fork): the
 * first job index that no rank starts. */
static _Atomic uint32_t *wb_stop_at;

/* A rank storing jobs of cc->chunks objects back to back for cc->jobs
 * seconds (every rank stores its part of the same jobs; a job completes
 * once all parts are in, so the ranks move in lockstep): rank 0 decides the
 * end, after job j, as j + 2 — no other rank can have started j + 2 then,
 * since j + 1 needs rank 0's part. t_store = the time it stored, n_lat =
 * the jobs it stored. */
static void wb_child(const kvt_server *s, const copy_cfg *cc, uint32_t rank, int go_fd, int out_fd)
{
	rank_ctx r;
	rank_out out = {0};
	out.rc = rank_setup(s, "wb", rank, cc->ranks, cc->g, &r);
	char b;
	if (write(out_fd, &out.rc, sizeof(out.rc)) < 0 || read(go_fd, &b, 1) != 1)
		_exit(1);
	double t0 = kvb_now();
	uint32_t j = 0;
	for (; !out.rc && j < atomic_load(wb_stop_at); j++) {
		out.rc = run_job(&r, true, cc->run * 1000000 + j, cc->run, (uint64_t)j * cc->chunks, cc->chunks, 0, 1, NULL);
		if (out.rc)
			fprintf(stderr, "writebehind: rank %u job %u: %s\n", rank, j, kvs_strerror(out.rc));
		if (rank == 0 && kvb_now() - t0 >= cc->jobs && atomic_load(wb_stop_at) == UINT32_MAX)
			atomic_store(wb_stop_at, j + 2);
	}
	out.t_store = kvb_now() - t0;
	out.n_lat = j;
	if (write(out_fd, &out, sizeof(out)) != sizeof(out))
		_exit(1);
	kvs_client_close(r.c);
	_exit(0);
}

/* The raw disk write rate: bytes by sequential write() + fsync per
 * 256 MiB to a fresh file in dir (removed after); GB/s or -1. */
static double raw_write_gbs(const char *dir, uint64_t bytes)
{
	char path[400];
	snprintf(path, sizeof(path), "%s/raw-XXXXXX", dir);
	int fd = mkstemp(path);
	if (fd < 0)
		return -1;
	uint64_t chunk = 1 << 20;
	uint8_t *buf = malloc(chunk);
	for (uint64_t i = 0; i < chunk; i++)
		buf[i] = (uint8_t)(i * 131 + (i >> 12));
	double t0 = kvb_now();
	int bad = 0;
	for (uint64_t done = 0; done < bytes; done += chunk) {
		if (write(fd, buf, chunk) != (ssize_t)chunk)
			bad = 1;
		if ((done / chunk + 1) % 256 == 0)
			fsync(fd);
	}
	fsync(fd);
	double t = kvb_now() - t0;
	close(fd);
	unlink(path);
	free(buf);
	return bad ? -1 : (double)bytes / t / 1e9;
}

int kvb_mode_writebehind(const kvb_opts *o)
{
	char l2p[320], l1[32], l2s[32];
	snprintf(l2p, sizeof(l2p), "%s/wb-l2-%d", o->dir, (int)getpid());
	uint64_t l1b = o->l1_size ? o->l1_size : (o->gpu_ranks ? (16ull << 30) : (1ull << 30));
	snprintf(l1, sizeof(l1), "%llu", (unsigned long long)l1b);
	snprintf(l2s, sizeof(l2s), "%llu", (unsigned long long)(o->l2_size ? o->l2_size : (16ull << 30)));
	uint32_t seconds = o->quick ? 1 : 8;
	/* 1 MiB objects (16 blocks of 64 KiB), 8 per job */
	copy_cfg cc = {.ranks = o->ranks, .run = 97, .jobs = seconds, .chunks = 8,
		       .g = {.layers = 1, .bpc = 16, .nb = 16 * 8, .block = 64 << 10, .cuda = o->gpu_ranks}};
	uint64_t obj = (uint64_t)cc.g.layers * cc.g.bpc * cc.g.block;
	/* the raw rate before and after the L2 run, as many bytes as the disk
	 * takes in a few seconds */
	uint64_t raw_bytes = o->quick ? (128ull << 20) : (2048ull << 20);
	double raw0 = raw_write_gbs(o->dir, raw_bytes);
	kvt_server s;
	if (kvb_server_start(o, &s, "--l1-size", l1, "--l2-path", l2p, "--l2-size", l2s, "--l2-sync", "full", NULL))
		return 1;
	kvs_client *sc = kvt_client(&s, "wb", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	for (int w = 0; sc && o->gpu_ranks && w < 3000 && kvb_stat(sc, "cuda_pinned_bytes") < kvb_stat(sc, "l1_capacity"); w++)
		usleep(10000);
	rank_out outs[64];
	wb_stop_at = mmap(NULL, sizeof(*wb_stop_at), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (wb_stop_at == MAP_FAILED)
		return 1;
	atomic_store(wb_stop_at, UINT32_MAX);
	uint64_t c0 = sc ? kvb_stat(sc, "l2_writes_committed") : 0, b0 = sc ? kvb_stat(sc, "l2_write_batches") : 0;
	int rc = !sc || run_ranks(&s, &cc, wb_child, outs) != 0;
	uint64_t c1 = kvb_stat(sc, "l2_writes_committed"), d1 = kvb_stat(sc, "l2_write_drops");
	uint64_t b1 = kvb_stat(sc, "l2_write_batches");
	double win = 0;
	uint64_t stored = 0;
	for (uint32_t i = 0; !rc && i < cc.ranks; i++) {
		win = outs[i].t_store > win ? outs[i].t_store : win;
		stored += (uint64_t)outs[i].n_lat * cc.chunks;
	}
	munmap(wb_stop_at, sizeof(*wb_stop_at));
	/* then the queue drains: every stored object is committed or dropped */
	double t0 = kvb_now();
	for (int w = 0; !rc && w < 6000 && kvb_stat(sc, "l2_writes_committed") + kvb_stat(sc, "l2_write_drops") < stored; w++)
		usleep(10000);
	double drain = kvb_now() - t0;
	uint64_t c2 = kvb_stat(sc, "l2_writes_committed"), d2 = kvb_stat(sc, "l2_write_drops");
	kvs_client_close(sc);
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", l2p);
	if (system(cmd) != 0)
		rc = 1;
	double raw1 = raw_write_gbs(o->dir, raw_bytes);
	if (rc || raw0 < 0 || raw1 < 0 || win <= 0) {
		fprintf(stderr, "writebehind: failed (ranks %s, raw %.3f / %.3f GB/s)\n", rc ? "failed" : "ok", raw0, raw1);
		return 1;
	}
	double raw = (raw0 + raw1) / 2, commit = (double)(c1 - c0) * obj / win / 1e9;
	char nm[200];
	snprintf(nm, sizeof(nm), "l2 write-behind commit rate during sustained stores (%u %s ranks, %llu MiB objects)",
		 cc.ranks, o->gpu_ranks ? "GPU" : "host-memory", (unsigned long long)(obj >> 20));
	kvb_result(nm, commit, "GB/s", raw, ">= 0.80 x raw write + fsync");
	kvb_result("l2 write-behind: store rate offered (same window)", (double)stored * obj / win / 1e9, "GB/s", 0, "");
	kvb_result("l2 write-behind: objects dropped of those stored", (double)d2, "objects", (double)stored, "");
	kvb_note("writebehind: %u s of back-to-back store jobs (8 objects each) by %u ranks through a %llu MiB L1 "
		 "(--l2-sync full); %llu objects stored, %llu committed and %llu dropped in the window (%llu group "
		 "commits), then %llu committed and %llu dropped in all after %.1f s of draining; raw = sequential "
		 "write() + fsync per 256 MiB of %llu MiB to a fresh file in the same directory, %.3f GB/s before the "
		 "L2 run and %.3f after (mean)", seconds, cc.ranks, (unsigned long long)(l1b >> 20),
		 (unsigned long long)stored, (unsigned long long)(c1 - c0), (unsigned long long)d1,
		 (unsigned long long)(b1 - b0), (unsigned long long)c2, (unsigned long long)d2, drain,
		 (unsigned long long)(raw_bytes >> 20), raw0, raw1);
	return 0;
}

/* ---- trace replay -------------------------------------------------------------- */

typedef struct treq {
	uint32_t n;
	uint32_t *ids;
} treq;

static treq *load_trace(const char *path, uint32_t limit, uint32_t *ret_n, uint32_t *ret_max)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return NULL;
	treq *r = NULL;
	uint32_t n = 0, cap = 0, mx = 0;
	char *line = NULL;
	size_t lcap = 0;
	while (getline(&line, &lcap, f) > 0 && (!limit || n < limit)) {
		char *p = strstr(line, "\"hash_ids\"");
		if (!p || !(p = strchr(p, '[')))
			continue;
		if (n == cap) {
			cap = cap ? 2 * cap : 1024;
			r = realloc(r, cap * sizeof(*r));
		}
		treq *q = &r[n++];
		q->n = 0;
		q->ids = NULL;
		uint32_t qc = 0;
		for (p++; *p && *p != ']';) {
			char *e;
			unsigned long v = strtoul(p, &e, 10);
			if (e == p) {
				p++;
				continue;
			}
			if (q->n == qc) {
				qc = qc ? 2 * qc : 64;
				q->ids = realloc(q->ids, qc * sizeof(uint32_t));
			}
			q->ids[q->n++] = (uint32_t)v;
			p = e;
		}
		if (q->n > 4096)
			q->n = 4096; /* one message's key limit */
		mx = q->n > mx ? q->n : mx;
	}
	free(line);
	fclose(f);
	*ret_n = n;
	*ret_max = mx;
	return r;
}

/* The trace the options name: --trace-requests of it (300 with --quick, else
 * all), or NULL after saying why (mode names the caller). */
static treq *trace_for(const kvb_opts *o, const char *mode, uint32_t *ret_n, uint32_t *ret_max)
{
	uint32_t limit = o->trace_requests ? o->trace_requests : (o->quick ? 300 : 0);
	treq *tr = load_trace(o->trace, limit, ret_n, ret_max);
	if (!tr)
		fprintf(stderr, "%s: cannot read %s\n", mode, o->trace);
	return tr;
}

/* One replay of the trace through a fresh server with an L1 of l1b bytes (and
 * L2 when o->l2_size): lookup with prefetch, retrieve the hit, store the
 * rest, one rank, 4 KiB per 512-token block. *hits are the hit blocks. */
typedef struct trace_run {
	uint64_t hits, bytes;
	double *lat; /* nreq request latencies (caller's) */
	double elapsed;
} trace_run;

static int trace_replay(const kvb_opts *o, const treq *tr, uint32_t nreq, uint32_t mx, uint64_t l1b,
			trace_run *out)
{
	geo g = {.layers = 1, .bpc = 1, .nb = 2 * mx + 2, .block = 4096};
	char l1[32], l2s[32], l2p[320];
	snprintf(l1, sizeof(l1), "%llu", (unsigned long long)l1b);
	snprintf(l2s, sizeof(l2s), "%llu", (unsigned long long)(o->l2_size ? o->l2_size : (1ull << 30)));
	kvt_server s;
	int rc;
	snprintf(l2p, sizeof(l2p), "%s/trace-l2-%d", o->dir, (int)getpid());
	if (o->l2_size)
		rc = kvb_server_start(o, &s, "--l1-size", l1, "--l2-path", l2p, "--l2-size", l2s, NULL);
	else
		rc = kvb_server_start(o, &s, "--l1-size", l1, NULL);
	if (rc)
		return 1;
	rank_ctx r;
	kvs_client *sched = kvt_client(&s, "trace", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	if (!sched || rank_setup(&s, "trace", 0, 1, g, &r) != 0)
		return 1;
	uint64_t hits = 0, bytes = 0, job = 1;
	uint8_t *keys = malloc(32ull * mx);
	int64_t *ids = malloc(sizeof(int64_t) * mx);
	double t0 = kvb_now();
	for (uint32_t i = 0; i < nreq && !rc; i++) {
		const treq *q = &tr[i];
		for (uint32_t k = 0; k < q->n; k++)
			kvb_key(4242, q->ids[k], keys + 32 * k);
		double t = kvb_now();
		uint64_t h = 0;
		if ((rc = kvs_lookup(sched, keys, q->n, true, 0, 30000, &h, NULL)) != 0)
			break;
		const int64_t *lists[1] = {ids};
		uint32_t len;
		kvs_blocks bl = {.n_groups = 1, .ids = lists, .len = &len};
		int st;
		if (h) {
			for (uint32_t k = 0; k < h; k++)
				ids[k] = mx + 1 + k;
			len = (uint32_t)h;
			rc = kvs_retrieve(r.c, job, keys, (uint32_t)h, &bl, 0, 30000, &st);
			if (rc == KVS_E_MISS) { /* evicted between lookup and retrieve: count as a miss */
				h = 0;
				rc = 0;
				kvs_complete(r.c, job, false, 30000, &st);
			} else if (!rc) {
				rc = kvs_complete(r.c, job, true, 30000, &st);
			}
			job++;
			bytes += h * g.block;
		}
		if (!rc && h < q->n) {
			for (uint32_t k = 0; k < q->n - h; k++)
				ids[k] = k;
			len = q->n - (uint32_t)h;
			rc = kvs_store(r.c, job, keys + 32 * h, len, &bl, NULL, 30000, &st);
			if (!rc)
				rc = kvs_complete(r.c, job, true, 30000, &st);
			if (!rc)
				rc = kvs_job_wait(r.c, job, 30000, &st);
			if (rc == KVS_E_NOSPACE)
				rc = 0;
			job++;
			bytes += (q->n - h) * g.block;
		}
		hits += h;
		out->lat[i] = kvb_now() - t;
	}
	out->elapsed = kvb_now() - t0;
	out->hits = hits;
	out->bytes = bytes;
	kvs_client_close(r.c);
	kvs_client_close(sched);
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", l2p);
	if (system(cmd) != 0)
		rc = rc ? rc : 1;
	free(keys);
	free(ids);
	return rc;
}

static void trace_free(treq *tr, uint32_t nreq)
{
	for (uint32_t i = 0; i < nreq; i++)
		free(tr[i].ids);
	free(tr);
}

static uint32_t trace_max_id(const treq *tr, uint32_t nreq)
{
	uint32_t maxid = 0;
	for (uint32_t i = 0; i < nreq; i++)
		for (uint32_t k = 0; k < tr[i].n; k++)
			maxid = tr[i].ids[k] > maxid ? tr[i].ids[k] : maxid;
	return maxid;
}

int kvb_mode_trace(const kvb_opts *o)
{
	uint32_t nreq, mx;
	treq *tr = trace_for(o, "trace", &nreq, &mx);
	if (!tr)
		return 1;
	/* infinite-cache bound: a request hits its leading run of ids seen before */
	uint8_t *seen = calloc(trace_max_id(tr, nreq) + 1, 1);
	uint64_t total = 0, bound_hits = 0;
	for (uint32_t i = 0; i < nreq; i++) {
		uint32_t h = 0;
		while (h < tr[i].n && seen[tr[i].ids[h]])
			h++;
		bound_hits += h;
		total += tr[i].n;
		for (uint32_t k = 0; k < tr[i].n; k++)
			seen[tr[i].ids[k]] = 1;
	}
	uint64_t l1b = o->l1_size ? o->l1_size : (256ull << 20);
	double *lat = malloc(sizeof(double) * (nreq ? nreq : 1));
	trace_run tr_out = {.lat = lat};
	int rc = trace_replay(o, tr, nreq, mx, l1b, &tr_out);
	double el = tr_out.elapsed;
	double ratio = total ? (double)tr_out.hits / total : 0, bound = total ? (double)bound_hits / total : 0;
	char nm[128];
	snprintf(nm, sizeof(nm), "trace prefix hit ratio (%u requests, L1 %llu MiB%s)", nreq,
		 (unsigned long long)(l1b >> 20), o->l2_size ? " + L2" : "");
	kvb_result(nm, ratio, "ratio", bound, "<= bound; = bound when it all fits");
	kvb_result("trace bytes moved", (double)tr_out.bytes / 1e9, "GB", 0, "");
	kvb_result("trace throughput", (double)tr_out.bytes / el / 1e9, "GB/s", 0, "");
	kvb_result("trace requests per second", nreq / el, "req/s", 0, "");
	kvb_result("trace p99 request latency (lookup + retrieve + store jobs)", kvb_pct(lat, nreq, 0.99) * 1e3, "ms", 0, "");
	kvb_note("trace: %s, %u requests replayed as fast as possible (timestamps compressed to zero), 4 KiB per "
		 "512-token block, infinite-cache bound %.4f", o->trace, nreq, bound);
	int bad = ratio > bound + 1e-12 || (o->expect_bound && ratio + 1e-12 < bound);
	if (bad)
		fprintf(stderr, "trace: hit ratio %.6f vs bound %.6f violates the expectation\n", ratio, bound);
	trace_free(tr, nreq);
	free(seen);
	free(lat);
	return rc || bad;
}

/* ---- trace against an LRU simulation ----------------------------------------------- */

/* The prefix hit ratio of an LRU cache of cap blocks over the trace, where a
 * request hits its leading run of cached blocks and then uses every one of
 * its blocks (hits and stored misses alike become the most recently used, in
 * request order). An intrusive doubly linked list over block ids. */
static uint64_t lru_hits(const treq *tr, uint32_t nreq, uint32_t maxid, uint64_t cap)
{
	uint32_t *prev = malloc((maxid + 2) * sizeof(uint32_t)), *next = malloc((maxid + 2) * sizeof(uint32_t));
	uint8_t *in = calloc(maxid + 1, 1);
	const uint32_t NIL = maxid + 1; /* sentinel: next[NIL] = LRU end, prev[NIL] = MRU end */
	prev[NIL] = next[NIL] = NIL;
	uint64_t n = 0, hits = 0;
#define UNLINK(x) (next[prev[x]] = next[x], prev[next[x]] = prev[x])
#define PUSH_MRU(x) (prev[x] = prev[NIL], next[x] = NIL, next[prev[NIL]] = x, prev[NIL] = x)
	for (uint32_t i = 0; i < nreq; i++) {
		uint32_t h = 0;
		while (h < tr[i].n && in[tr[i].ids[h]])
			h++;
		hits += h;
		for (uint32_t k = 0; k < tr[i].n; k++) {
			uint32_t x = tr[i].ids[k];
			if (in[x]) {
				UNLINK(x);
			} else {
				if (n == cap) { /* evict the least recently used */
					uint32_t v = next[NIL];
					UNLINK(v);
					in[v] = 0;
					n--;
				}
				if (cap == 0)
					continue;
				in[x] = 1;
				n++;
			}
			PUSH_MRU(x);
		}
	}
#undef UNLINK
#undef PUSH_MRU
	free(prev);
	free(next);
	free(in);
	return hits;
}

/* The trace at L1 capacities of 25, 50 and 100 % of its footprint (distinct
 * blocks x 4 KiB), each beside the LRU simulation of the same capacity
 * computed in the same run: kvside should never do worse than LRU. */
int kvb_mode_trace_lru(const kvb_opts *o)
{
	uint32_t nreq, mx;
	treq *tr = trace_for(o, "trace-lru", &nreq, &mx);
	if (!tr)
		return 1;
	uint32_t maxid = trace_max_id(tr, nreq);
	uint8_t *seen = calloc(maxid + 1, 1);
	uint64_t distinct = 0, total = 0;
	for (uint32_t i = 0; i < nreq; i++)
		for (uint32_t k = 0; k < tr[i].n; k++) {
			distinct += !seen[tr[i].ids[k]];
			seen[tr[i].ids[k]] = 1;
			total++;
		}
	free(seen);
	double *lat = malloc(sizeof(double) * (nreq ? nreq : 1));
	int rc = 0, bad = 0;
	static const int pct[] = {25, 50, 100};
	for (int c = 0; c < 3 && !rc; c++) {
		/* L1 in whole MiB (at least 1, its minimum), and LRU with the same block count */
		uint64_t l1b = ((distinct * 4096 * (uint64_t)pct[c] / 100 + (1u << 20) - 1) >> 20) << 20;
		if (l1b < (1u << 20))
			l1b = 1u << 20;
		uint64_t cap = l1b / 4096;
		uint64_t lh = lru_hits(tr, nreq, maxid, cap);
		trace_run out = {.lat = lat};
		rc = trace_replay(o, tr, nreq, mx, l1b, &out);
		double ratio = total ? (double)out.hits / total : 0, lru = total ? (double)lh / total : 0;
		char nm[160];
		snprintf(nm, sizeof(nm), "trace hit ratio, L1 %d %% of the footprint (%llu MiB, %u requests)", pct[c],
			 (unsigned long long)(l1b >> 20), nreq);
		kvb_result(nm, ratio, "ratio", lru, ">= LRU of the same capacity");
		if (!rc && ratio + 1e-9 < lru) {
			fprintf(stderr, "trace-lru: %s: %.6f below LRU %.6f\n", nm, ratio, lru);
			bad = o->expect_bound;
		}
	}
	kvb_note("trace-lru: %s, %llu distinct 512-token blocks of 4 KiB (footprint %.1f MiB), %llu block "
		 "references; LRU simulated over blocks with the same capacity in blocks as the L1 bytes / 4 KiB",
		 o->trace, (unsigned long long)distinct, distinct * 4096.0 / (1 << 20), (unsigned long long)total);
	trace_free(tr, nreq);
	free(lat);
	return rc || bad;
}

/* ---- restart and memory --------------------------------------------------------- */

/* Stores n 4 KiB objects through one rank, jobs of up to 4096 keys; with
 * sc given, lets the L2 write queue drain between jobs (no drops). */
static int fill(kvs_client *sc, rank_ctx *r, uint64_t run, uint64_t n)
{
	for (uint64_t done = 0, j = 0; done < n; j++) {
		uint32_t k = (uint32_t)(n - done < 4096 ? n - done : 4096);
		int rc = run_job(r, true, run * 1000000 + j, run, done, k, 0, 1, NULL);
		if (rc)
			return rc;
		done += k;
		for (int w = 0; sc && w < 3000 && kvb_stat(sc, "l2_queue_depth") > 0; w++)
			usleep(10000);
	}
	return 0;
}

/* Polls for the server's ZeroMQ socket file: when it appears, the server
 * is listening (bound after its modules, L2 included, are open). */
typedef struct listen_probe {
	char path[400];
	double t0, at;
	atomic_int stop;
} listen_probe;

static void *listen_probe_main(void *p)
{
	listen_probe *lp = p;
	while (!atomic_load(&lp->stop) && kvb_now() - lp->t0 < 20) {
		if (access(lp->path, F_OK) == 0) {
			lp->at = kvb_now() - lp->t0;
			break;
		}
		usleep(500);
	}
	return NULL;
}

int kvb_mode_restart(const kvb_opts *o)
{
	/* 4 KiB objects: 200,000 take 1.6 GB of disk (two LMDB pages each) */
	uint64_t sizes[2] = {o->quick ? 500 : 20000, o->quick ? 5000 : 200000};
	int rc = 0;
	for (int i = 0; i < 2 && !rc; i++) {
		char l2p[320];
		snprintf(l2p, sizeof(l2p), "%s/restart-l2-%d-%d", o->dir, (int)getpid(), i);
		kvt_server s;
		if (kvb_server_start(o, &s, "--l1-size", "1073741824", "--l2-path", l2p, "--l2-size", "4294967296", NULL))
			return 1;
		geo g = {.layers = 1, .bpc = 1, .nb = 4096, .block = 4096};
		rank_ctx r;
		kvs_client *sc = kvt_client(&s, "restart", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
		if (!sc || rank_setup(&s, "restart", 0, 1, g, &r) || fill(sc, &r, 555 + i, sizes[i])) {
			rc = 1;
			break;
		}
		for (int w = 0; w < 6000 && kvb_stat(sc, "l2_writes_committed") + kvb_stat(sc, "l2_write_drops") < sizes[i]; w++)
			usleep(10000);
		if (kvb_stat(sc, "l2_write_drops"))
			kvb_note("restart: %llu L2 writes dropped while filling", (unsigned long long)kvb_stat(sc, "l2_write_drops"));
		kvs_client_close(r.c);
		kvs_client_close(sc);
		/* kill -9 once write-behind caught up: nothing flushed at exit */
		kvt_server_kill(&s);
		/* restart: time from exec to the first L2 hit seen by a fresh
		 * client (the same run dir and arguments) */
		listen_probe lp = {.at = -1};
		snprintf(lp.path, sizeof(lp.path), "%s/kvside.zmq", s.run);
		unlink(lp.path); /* the killed server's: the probe must see the new one */
		pthread_t lpt;
		double t0 = kvb_now();
		lp.t0 = t0;
		pthread_create(&lpt, NULL, listen_probe_main, &lp);
		if (kvt_server_spawn(&s) != 0) {
			atomic_store(&lp.stop, 1);
			pthread_join(lpt, NULL);
			rc = 1;
			break;
		}
		uint8_t key[32];
		kvb_key(555 + i, 0, key);
		double hit_at = -1, conn_at = -1;
		while (kvb_now() - t0 < 20) {
			kvs_client *c = kvt_client(&s, "restart", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
			uint64_t h = 0;
			if (c && conn_at < 0)
				conn_at = kvb_now() - t0;
			if (c && kvs_lookup(c, key, 1, false, 0, 2000, &h, NULL) == 0 && h == 1)
				hit_at = kvb_now() - t0;
			kvs_client_close(c);
			if (hit_at >= 0)
				break;
			usleep(2000);
		}
		atomic_store(&lp.stop, 1);
		pthread_join(lpt, NULL);
		/* completeness (issue 33 #4): every object committed before the
		 * kill looked up, 256 keys a lookup */
		uint64_t hits = 0;
		double all_at = -1;
		kvs_client *c = hit_at >= 0 ? kvt_client(&s, "restart", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL) : NULL;
		uint8_t (*keys)[32] = c ? malloc(256 * 32) : NULL;
		for (uint64_t j = 0; keys && j < sizes[i]; j += 256) {
			uint32_t n = (uint32_t)(sizes[i] - j < 256 ? sizes[i] - j : 256);
			for (uint32_t k = 0; k < n; k++)
				kvb_key(555 + i, j + k, keys[k]);
			uint64_t h = 0;
			if (kvs_lookup(c, keys[0], n, false, 0, 5000, &h, NULL) == 0)
				hits += h;
		}
		if (keys)
			all_at = kvb_now() - t0;
		double verify_ms = c ? kvb_stat(c, "l2_verify_us") / 1e3 : -1;
		free(keys);
		kvs_client_close(c);
		char nm[96];
		snprintf(nm, sizeof(nm), "restart: objects hit after a kill -9, of %llu committed", (unsigned long long)sizes[i]);
		kvb_result(nm, sizes[i] ? (double)hits / (double)sizes[i] : 0, "fraction", 0, ">= 0.99");
		snprintf(nm, sizeof(nm), "restart to every object looked up, %llu objects in L2", (unsigned long long)sizes[i]);
		kvb_result(nm, all_at * 1e3, "ms", 0, "");
		snprintf(nm, sizeof(nm), "restart: structural check of data.mdb, %llu objects in L2", (unsigned long long)sizes[i]);
		kvb_result(nm, verify_ms, "ms", 0, "");
		if (hits * 100 < sizes[i] * 99)
			rc = 1;
		snprintf(nm, sizeof(nm), "restart to first L2 hit, %llu objects in L2", (unsigned long long)sizes[i]);
		kvb_result(nm, hit_at * 1e3, "ms", 0, "<= 250 ms");
		snprintf(nm, sizeof(nm), "restart to listening (socket bound), %llu objects in L2", (unsigned long long)sizes[i]);
		kvb_result(nm, lp.at * 1e3, "ms", 0, "");
		kvb_note("restart, %llu objects: listening at %.1f ms, the first client connected (hello answered) at "
			 "%.1f ms, first hit at %.1f ms", (unsigned long long)sizes[i], lp.at * 1e3, conn_at * 1e3, hit_at * 1e3);
		if (hit_at < 0)
			rc = 1;
		kvt_server_stop(&s);
		kvt_server_cleanup(&s);
		char cmd[400];
		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", l2p);
		if (system(cmd) != 0)
			rc = 1;
	}
	kvb_note("restart: the server SIGKILLed once write-behind committed every object; measured from fork/exec of "
		 "kvside-server to a lookup answered with a hit by a new client (includes client connect + hello), and "
		 "to every object looked up (256 keys a lookup, one client)");
	return rc;
}

/* Asks for stats every millisecond and keeps the largest round trip of
 * each phase: 0 before the rank leaves, 1 from then on (2 stops). */
typedef struct pinger {
	kvs_client *c;
	atomic_int phase;
	double max[2];
	uint32_t n[2];
	int rc;
} pinger;

static void *pinger_main(void *p)
{
	pinger *pg = p;
	kvs_stat_out st[8];
	uint32_t ns;
	int ph;
	while ((ph = atomic_load(&pg->phase)) < 2) {
		double t0 = kvb_now();
		if (kvs_stats(pg->c, 10000, st, 8, &ns) != 0) {
			pg->rc = -1;
			break;
		}
		double dt = kvb_now() - t0;
		pg->max[ph] = dt > pg->max[ph] ? dt : pg->max[ph];
		pg->n[ph]++;
		usleep(1000);
	}
	return NULL;
}

/* A rank registers gib GiB of host memory, store jobs read all of it, then
 * it says bye and drops its memory (an engine that exits): the server's
 * release of that registration unmaps what its copies touched and closes
 * the memfd's last reference, which frees the memory. Meanwhile another
 * session asks for stats every millisecond: *before is the largest round
 * trip in the 0.5 s before the bye, *after the largest from the bye until
 * 0.5 s after the registration is gone. */
static int release_stall(const kvb_opts *o, uint32_t gib, double *before, double *after)
{
	kvt_server s;
	if (kvb_server_start(o, &s, "--l1-size", "1073741824", NULL))
		return -1;
	int rc = -1;
	geo g = {.layers = 1, .bpc = 32, .nb = gib * 16384u, .block = 64 << 10};
	rank_ctx r;
	pinger pg = {0};
	pthread_t t;
	bool started = false;
	kvs_client *sc = kvt_client(&s, "rel", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	if (!sc || rank_setup(&s, "rel", 0, 1, g, &r))
		goto out;
	for (uint32_t k = 0; k < g.nb / g.bpc; k += 256) /* 512 MiB per job: every page read */
		if (run_job(&r, true, 4242000000ull + k, 4242, k, 256, k * g.bpc, 1, NULL))
			goto out;
	pg.c = sc;
	if (pthread_create(&t, NULL, pinger_main, &pg))
		goto out;
	started = true;
	usleep(500000);
	atomic_store(&pg.phase, 1);
	kvs_client_close(r.c);
	r.c = NULL;
	munmap(r.mem, r.size);
	close(r.fd);
	for (int w = 0; w < 3000 && kvb_stat(sc, "registrations") != 0; w++) /* it goes at the bye */
		usleep(5000);
	usleep(500000);
	rc = 0;
out:
	if (started) {
		atomic_store(&pg.phase, 2);
		pthread_join(t, NULL);
		rc = pg.rc || !pg.n[0] || !pg.n[1] ? -1 : rc;
	}
	*before = pg.max[0];
	*after = pg.max[1];
	kvs_client_close(r.c);
	kvs_client_close(sc);
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);
	return rc;
}

int kvb_mode_memory(const kvb_opts *o)
{
	uint64_t sizes[2] = {o->quick ? 10000 : 100000, o->quick ? 100000 : 1000000};
	int rc = 0;
	for (int i = 0; i < 2 && !rc; i++) {
		char l1[32];
		snprintf(l1, sizeof(l1), "%llu", (unsigned long long)(sizes[i] * 4096 + (64ull << 20)));
		kvt_server s;
		if (kvb_server_start(o, &s, "--l1-size", l1, NULL))
			return 1;
		long rss0 = kvb_server_rss_kib(&s);
		geo g = {.layers = 1, .bpc = 1, .nb = 4096, .block = 4096};
		rank_ctx r;
		kvs_client *sc = kvt_client(&s, "mem", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
		if (!sc || rank_setup(&s, "mem", 0, 1, g, &r) || fill(NULL, &r, 777 + i, sizes[i])) {
			rc = 1;
			break;
		}
		uint64_t objs = kvb_stat(sc, "l1_objects"), meta = kvb_stat(sc, "l1_meta_bytes");
		long rss = kvb_server_rss_kib(&s);
		char nm[96];
		snprintf(nm, sizeof(nm), "memory: server RSS with %llu objects", (unsigned long long)objs);
		kvb_result(nm, (double)rss / 1024.0, "MiB", (double)rss0 / 1024.0, "");
		snprintf(nm, sizeof(nm), "memory: L1 metadata per object (%llu objects)", (unsigned long long)objs);
		kvb_result(nm, objs ? (double)meta / objs : 0, "bytes", 0, "<= 200 bytes");
		/* the arena is faulted in at start-up (rss0 includes it): growth is metadata */
		double over = (double)(rss - rss0) * 1024.0 / (double)(objs ? objs : 1);
		snprintf(nm, sizeof(nm), "memory: RSS growth per object, arena pre-faulted (%llu objects)", (unsigned long long)objs);
		kvb_result(nm, over, "bytes", 0, "<= 200 bytes");
		kvs_client_close(r.c);
		kvs_client_close(sc);
		kvt_server_stop(&s);
		kvt_server_cleanup(&s);
	}
	uint32_t gib = o->quick ? 1 : 4;
	double before, after;
	if (!rc && release_stall(o, gib, &before, &after) == 0) {
		char nm[128];
		snprintf(nm, sizeof(nm), "memory: largest stats round trip while a rank's %u GiB is released", gib);
		kvb_result(nm, after * 1e3, "ms", before * 1e3, "");
		kvb_note("release: one rank registers %u GiB of host memory, store jobs read every page, then it says "
			 "bye and drops its memfd, so the server's unmap and close free it; another session asks "
			 "for stats every ms; baseline: the largest round trip in the 0.5 s before the bye", gib);
	} else if (!rc) {
		rc = 1;
	}
	return rc;
}

/* ---- GPU copy engine ------------------------------------------------------ */
#if KVS_HAVE_CUDA

/* Same-run GPU baselines, measured in a child process (the parent never
 * initialises CUDA: it forks the ranks). Per block size: the one-copy DMA
 * ceiling, one cuMemcpyAsync per block, cuMemcpyBatchAsync. */
typedef struct gpu_base {
	double d2h, h2d;
	int n_dev;
	double dev_d2h[8], dev_h2d[8]; /* each GPU's own ceiling */
	double all_d2h, all_h2d;       /* every GPU at once: what the host sustains */
	double per_block[8], batch[8];
	int ok;
} gpu_base;

static double gbs_of(uint64_t bytes, float ms) { return (double)bytes / (ms * 1e-3) / 1e9; }

static void gpu_baselines(const uint64_t *blocks, int nb, gpu_base *out)
{
	const kvs_cuda_api *cu = kvs_cuda();
	memset(out, 0, sizeof(*out));
	if (!cu->ok)
		return;
	CUdevice d;
	CUcontext c;
	cu->cuDeviceGet(&d, 0);
	cu->cuDevicePrimaryCtxRetain(&c, d);
	cu->cuCtxSetCurrent(c);
	const uint64_t total = 512ull << 20;
	/* every GPU's own one-copy ceiling, one GPU at a time */
	out->n_dev = cu->n_devices < 8 ? cu->n_devices : 8;
	for (int g = 0; g < out->n_dev; g++) {
		CUdevice dg;
		CUcontext cg;
		CUdeviceptr dd;
		void *hh;
		CUstream sg;
		CUevent a0, a1;
		float t;
		if (cu->cuDeviceGet(&dg, g) || cu->cuDevicePrimaryCtxRetain(&cg, dg) || cu->cuCtxSetCurrent(cg) ||
		    cu->cuMemAlloc(&dd, total) || cu->cuMemAllocHost(&hh, total) || cu->cuStreamCreate(&sg, 0) ||
		    cu->cuEventCreate(&a0, 0) || cu->cuEventCreate(&a1, 0))
			continue;
		for (int rep = 0; rep < 2; rep++) {
			cu->cuEventRecord(a0, sg);
			cu->cuMemcpyDtoHAsync(hh, dd, total, sg);
			cu->cuEventRecord(a1, sg);
			cu->cuEventSynchronize(a1);
			cu->cuEventElapsedTime(&t, a0, a1);
			out->dev_d2h[g] = gbs_of(total, t);
			cu->cuEventRecord(a0, sg);
			cu->cuMemcpyHtoDAsync(dd, hh, total, sg);
			cu->cuEventRecord(a1, sg);
			cu->cuEventSynchronize(a1);
			cu->cuEventElapsedTime(&t, a0, a1);
			out->dev_h2d[g] = gbs_of(total, t);
		}
		cu->cuMemFree(dd);
		cu->cuMemFreeHost(hh);
		cu->cuStreamDestroy(sg);
		cu->cuEventDestroy(a0);
		cu->cuEventDestroy(a1);
	}
	/* every GPU at once (one 512 MiB copy each, started together) */
	if (out->n_dev > 1) {
		CUdeviceptr dd[8];
		void *hh[8];
		CUstream sg[8];
		CUcontext cg[8];
		int ok = 1;
		for (int g = 0; g < out->n_dev && ok; g++) {
			CUdevice dg;
			ok = !cu->cuDeviceGet(&dg, g) && !cu->cuDevicePrimaryCtxRetain(&cg[g], dg) &&
			     !cu->cuCtxSetCurrent(cg[g]) && !cu->cuMemAlloc(&dd[g], total) &&
			     !cu->cuMemAllocHost(&hh[g], total) && !cu->cuStreamCreate(&sg[g], 0);
		}
		for (int dir = 0; dir < 2 && ok; dir++)
			for (int rep = 0; rep < 2; rep++) {
				double t0 = kvb_now();
				for (int g = 0; g < out->n_dev; g++) {
					cu->cuCtxSetCurrent(cg[g]);
					if (dir == 0)
						cu->cuMemcpyDtoHAsync(hh[g], dd[g], total, sg[g]);
					else
						cu->cuMemcpyHtoDAsync(dd[g], hh[g], total, sg[g]);
				}
				for (int g = 0; g < out->n_dev; g++) {
					cu->cuCtxSetCurrent(cg[g]);
					cu->cuStreamSynchronize(sg[g]);
				}
				double gbs = (double)total * out->n_dev / (kvb_now() - t0) / 1e9;
				if (dir == 0)
					out->all_d2h = gbs;
				else
					out->all_h2d = gbs;
			}
	}
	cu->cuCtxSetCurrent(c);
	CUdeviceptr dev;
	void *host;
	CUstream st;
	CUevent e0, e1;
	if (cu->cuMemAlloc(&dev, 2 * total) || cu->cuMemAllocHost(&host, total) || cu->cuStreamCreate(&st, 0) ||
	    cu->cuEventCreate(&e0, 0) || cu->cuEventCreate(&e1, 0))
		return;
	float ms;
	for (int rep = 0; rep < 2; rep++) { /* first round warms up */
		cu->cuEventRecord(e0, st);
		cu->cuMemcpyDtoHAsync(host, dev, total, st);
		cu->cuEventRecord(e1, st);
		cu->cuEventSynchronize(e1);
		cu->cuEventElapsedTime(&ms, e0, e1);
		out->d2h = gbs_of(total, ms);
		cu->cuEventRecord(e0, st);
		cu->cuMemcpyHtoDAsync(dev, host, total, st);
		cu->cuEventRecord(e1, st);
		cu->cuEventSynchronize(e1);
		cu->cuEventElapsedTime(&ms, e0, e1);
		out->h2d = gbs_of(total, ms);
	}
	for (int b = 0; b < nb; b++) {
		uint64_t bs = blocks[b], n = total / bs;
		/* gather every other block of the device buffer into the host buffer */
		cu->cuEventRecord(e0, st);
		for (uint64_t i = 0; i < n; i++)
			cu->cuMemcpyAsync((CUdeviceptr)(uintptr_t)host + i * bs, dev + 2 * i * bs, bs, st);
		cu->cuEventRecord(e1, st);
		cu->cuEventSynchronize(e1);
		cu->cuEventElapsedTime(&ms, e0, e1);
		out->per_block[b] = gbs_of(n * bs, ms);
		if (cu->cuMemcpyBatchAsync) {
			CUdeviceptr *dst = malloc(n * sizeof(*dst)), *src = malloc(n * sizeof(*src));
			size_t *sz = malloc(n * sizeof(*sz));
			for (uint64_t i = 0; i < n; i++) {
				dst[i] = (CUdeviceptr)(uintptr_t)host + i * bs;
				src[i] = dev + 2 * i * bs;
				sz[i] = bs;
			}
			CUmemcpyAttributes at = {.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM};
			size_t idx = 0;
			cu->cuEventRecord(e0, st);
			for (uint64_t i = 0; i < n; i += 4096) {
				size_t k = n - i < 4096 ? n - i : 4096;
				cu->cuMemcpyBatchAsync(dst + i, src + i, sz + i, k, &at, &idx, 1, st);
			}
			cu->cuEventRecord(e1, st);
			cu->cuEventSynchronize(e1);
			cu->cuEventElapsedTime(&ms, e0, e1);
			out->batch[b] = gbs_of(n * bs, ms);
			free(dst);
			free(src);
			free(sz);
		}
	}
	out->ok = 1;
}

typedef struct gpu_blocks {
	const uint64_t *blocks;
	int nb;
} gpu_blocks;

static void baselines_child(void *arg, int cmd_fd, int res_fd)
{
	const gpu_blocks *g = arg;
	gpu_base b;
	(void)cmd_fd;
	gpu_baselines(g->blocks, g->nb, &b);
	if (write(res_fd, &b, sizeof(b)) != sizeof(b))
		_exit(1);
	_exit(0);
}

int kvb_mode_gpu(const kvb_opts *o)
{
	uint64_t blocks[8] = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20};
	int nb = 5;
	if (o->gpu_blocks) {
		nb = 0;
		for (const char *p = o->gpu_blocks; *p && nb < 8;) {
			unsigned kib;
			int used;
			if (sscanf(p, "%u%n", &kib, &used) != 1 || kib < 4 || kib > (64u << 10) || (kib & 3)) {
				fprintf(stderr, "gpu: bad --gpu-blocks '%s' (want KiB,...)\n", o->gpu_blocks);
				return 2;
			}
			blocks[nb++] = (uint64_t)kib << 10;
			p += used;
			if (*p == ',')
				p++;
		}
	}
	/* baselines in a child: the parent must stay CUDA-free to fork ranks */
	gpu_blocks gbk = {.blocks = blocks, .nb = nb};
	gpu_base gb = {0};
	kvt_proc bp;
	if (kvt_proc_start(&bp, baselines_child, &gbk, NULL, 0) != 0)
		return 1;
	if (read(bp.res_fd, &gb, sizeof(gb)) != sizeof(gb))
		gb.ok = 0;
	kvt_proc_wait(&bp);
	if (!gb.ok) {
		kvb_note("gpu: no GPU in this run: the cuda copy modes report nothing");
		fprintf(stderr, "gpu: no GPU (cuda modes skipped)\n");
		return 0;
	}
	kvb_result("gpu DMA ceiling D2H (one 512 MiB cuMemcpyAsync)", gb.d2h, "GB/s", 0, "");
	kvb_result("gpu DMA ceiling H2D (one 512 MiB cuMemcpyAsync)", gb.h2d, "GB/s", 0, "");
	if (gb.n_dev > 1) {
		kvb_result("gpu all GPUs at once DMA D2H (512 MiB each)", gb.all_d2h, "GB/s", 0, "");
		kvb_result("gpu all GPUs at once DMA H2D (512 MiB each)", gb.all_h2d, "GB/s", 0, "");
	}
	double sum_d2h = 0, sum_h2d = 0;
	for (int g = 0; g < gb.n_dev; g++) {
		char nm[96];
		snprintf(nm, sizeof(nm), "gpu %d own DMA ceiling D2H", g);
		kvb_result(nm, gb.dev_d2h[g], "GB/s", 0, "");
		snprintf(nm, sizeof(nm), "gpu %d own DMA ceiling H2D", g);
		kvb_result(nm, gb.dev_h2d[g], "GB/s", 0, "");
		if ((uint32_t)g < o->ranks) {
			sum_d2h += gb.dev_d2h[g];
			sum_h2d += gb.dev_h2d[g];
		}
	}
	char l1[32];
	snprintf(l1, sizeof(l1), "%llu", (unsigned long long)(o->l1_size ? o->l1_size : 16ull << 30));
	kvt_server s;
	if (kvb_server_start(o, &s, "--l1-size", l1, NULL) != 0)
		return 1;
	kvs_client *sc = kvt_client(&s, "bench", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	for (int w = 0; sc && w < 3000 && kvb_stat(sc, "cuda_pinned_bytes") < kvb_stat(sc, "l1_capacity"); w++)
		usleep(10000);
	int rc = 0;
	uint32_t rank_counts[8] = {1, 1, 4, 4};
	uint32_t inflights[8] = {1, 2, 1, 2};
	int n_cfg = 4;
	if (o->gpu_cfg) {
		n_cfg = 0;
		for (const char *p = o->gpu_cfg; *p && n_cfg < 8;) {
			unsigned r, k;
			int used;
			if (sscanf(p, "%ux%u%n", &r, &k, &used) != 2 || r < 1 || r > 64 || k < 1 || k > 16) {
				fprintf(stderr, "gpu: bad --gpu-cfg '%s' (want RxI,...)\n", o->gpu_cfg);
				return 2;
			}
			rank_counts[n_cfg] = r;
			inflights[n_cfg++] = k;
			p += used;
			if (*p == ',')
				p++;
		}
	}
	uint32_t spread_ranks[2] = {o->ranks, o->ranks}, spread_infl[2] = {1, 2};
	if (o->spread) {
		kvb_note("gpu --spread: rank r on GPU r %% %d; aggregate GB/s against the sum of the ranks' GPUs' own "
			 "ceilings (%.1f GB/s D2H, %.1f GB/s H2D)", gb.n_dev, sum_d2h, sum_h2d);
		n_cfg = 2;
	}
	for (int ri = 0; ri < n_cfg; ri++) {
		for (int bi = 0; bi < nb; bi++) {
			copy_cfg cc = {.ranks = o->spread ? spread_ranks[ri] : rank_counts[ri], .run = 200 + ri * 10 + (uint64_t)bi,
				       .inflight = o->spread ? spread_infl[ri] : (inflights[ri] > o->inflight ? inflights[ri] : o->inflight)};
			cc.g.spread = o->spread;
			cc.g.cuda = true;
			/* 8 GiB per configuration whatever the rank count (128 jobs for
			 * a lone rank, 32 per rank for four): filling and draining the
			 * pipeline is not what is measured, and a run lasts long
			 * enough (~0.16 s) to be repeatable */
			uint64_t chunk_bytes = copy_size(&cc, blocks[bi], o->quick ? (16u << 20) : (64u << 20),
							 (o->quick ? (256ull << 20) : (8192ull << 20)) / cc.ranks);
			rank_out outs[64];
			double bytes, ts, tr;
			static const char *const cnt[] = {"job_parts", "job_part_us", "cuda_parts", "cuda_part_us",
							  "loop_busy_us", "cuda_submit_us", "cuda_dma_copies"};
			uint64_t c0[7], c1[7];
			for (int i = 0; i < 7; i++)
				c0[i] = kvb_stat(sc, cnt[i]);
			if (copy_measure(&s, &cc, chunk_bytes, "gpu", outs, &bytes, &ts, &tr) != 0) {
				rc = 1;
				continue;
			}
			for (int i = 0; i < 7; i++)
				c1[i] = kvb_stat(sc, cnt[i]) - c0[i];
			char nm[160];
			snprintf(nm, sizeof(nm), "gpu store %lluK blocks, %u rank(s) x %u in flight", (unsigned long long)(cc.g.block >> 10),
				 cc.ranks, cc.inflight ? cc.inflight : 1);
			kvb_result(nm, bytes / ts / 1e9, "GB/s", o->spread ? sum_d2h : gb.d2h, ">= 0.90 x DMA ceiling");
			snprintf(nm, sizeof(nm), "gpu retrieve %lluK blocks, %u rank(s) x %u in flight", (unsigned long long)(cc.g.block >> 10),
				 cc.ranks, cc.inflight ? cc.inflight : 1);
			kvb_result(nm, bytes / tr / 1e9, "GB/s", o->spread ? sum_h2d : gb.h2d, ">= 0.90 x DMA ceiling");
			if (ri == 0 && !o->spread) {
				snprintf(nm, sizeof(nm), "gpu baseline: one cuMemcpyAsync per %lluK block (D2H)", (unsigned long long)(cc.g.block >> 10));
				kvb_result(nm, gb.per_block[bi], "GB/s", gb.d2h, "");
				if (gb.batch[bi] > 0) {
					snprintf(nm, sizeof(nm), "gpu baseline: cuMemcpyBatchAsync %lluK blocks (D2H)", (unsigned long long)(cc.g.block >> 10));
					kvb_result(nm, gb.batch[bi], "GB/s", gb.d2h, "");
				}
			}
			snprintf(nm, sizeof(nm), "gpu store job p50 (%lluK, %u rank(s) x %u, %llu MiB/rank)", (unsigned long long)(cc.g.block >> 10),
				 cc.ranks, cc.inflight ? cc.inflight : 1, (unsigned long long)(chunk_bytes * cc.chunks >> 20));
			kvb_result(nm, kvb_pct(outs[0].lat_store, outs[0].n_lat, 0.5) * 1e3, "ms", 0, "");
			if (cc.ranks == 1 && cc.inflight <= 1 && !o->spread && c1[0] && c1[2]) {
				/* where a lone job's time goes: the copy (queued -> callback,
				 * server side), the loop accepting the part, the rest is
				 * messaging and completion */
				snprintf(nm, sizeof(nm), "gpu %lluK 1x1 breakdown: store job p50 / part reply p50 / copy per part / loop per part",
					 (unsigned long long)(cc.g.block >> 10));
				char v[160];
				snprintf(v, sizeof(v), "%.0f / %.0f / %.0f / %.0f us", kvb_pct(outs[0].lat_store, outs[0].n_lat, 0.5) * 1e6,
					 kvb_pct(outs[0].reply_store, outs[0].n_lat, 0.5) * 1e6, (double)c1[3] / (double)c1[2],
					 (double)c1[1] / (double)c1[0]);
				kvb_note("%s: %s (retrieve job p50 %.0f us, reply p50 %.0f us; loop busy %.0f us per part, of which "
					 "driver calls %.0f us; %.1f DMA runs per part)", nm, v,
					 kvb_pct(outs[0].lat_retrieve, outs[0].n_lat, 0.5) * 1e6,
					 kvb_pct(outs[0].reply_retrieve, outs[0].n_lat, 0.5) * 1e6, (double)c1[4] / (double)c1[0],
					 (double)c1[5] / (double)c1[2], (double)c1[6] / (double)c1[2]);
			}
		}
	}
	kvb_note("gpu: store/retrieve GB/s are whole jobs end to end (store + complete + job_done, all ranks), "
		 "gathering every other block; the ceiling is one 512 MiB cuMemcpyAsync between device and pinned memory");
	kvs_client_close(sc);
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);
	return rc;
}
#else
int kvb_mode_gpu(const kvb_opts *o)
{
	(void)o;
	kvb_note("gpu: built without CUDA headers: the cuda copy modes report nothing");
	return 0;
}
#endif

/* ---- L3: the shared tier on a Redis Cluster (issue 17) ---------------------------- */

#if KVB_HAVE_HIREDIS
#include <hiredis/hiredis.h>

#include "kvs_rcluster.h"
#include "kvs_record.h"

/* The cluster the mode uses: o->l3_redis, or one it starts with
 * tests/l3/redis_cluster.py ($KVS_RCLUSTER_HELPER) and stops at the end. */
typedef struct l3_cluster {
	char dir[300];
	char seeds[1024];
} l3_cluster;

static int l3_cluster_start(const kvb_opts *o, l3_cluster *cl)
{
	memset(cl, 0, sizeof(*cl));
	if (o->l3_redis) {
		snprintf(cl->seeds, sizeof(cl->seeds), "%s", o->l3_redis);
		return 0;
	}
	const char *helper = getenv("KVS_RCLUSTER_HELPER") ? getenv("KVS_RCLUSTER_HELPER") : "tests/l3/redis_cluster.py";
	snprintf(cl->dir, sizeof(cl->dir), "%s/kvb-l3-cluster-XXXXXX", o->dir);
	if (!mkdtemp(cl->dir))
		return -1;
	char cmd[900];
	snprintf(cmd, sizeof(cmd), "%s %s start %s --masters %u --replicas 0", getenv("KVS_PYTHON") ? getenv("KVS_PYTHON") : "python3",
		 helper, cl->dir, o->l3_masters == 3 ? 3u : 1u);
	FILE *p = popen(cmd, "r");
	if (!p || !fgets(cl->seeds, sizeof(cl->seeds), p)) {
		int st = p ? pclose(p) : -1;
		cl->dir[0] = '\0';
		return WIFEXITED(st) && WEXITSTATUS(st) == 77 ? 77 : -1;
	}
	pclose(p);
	cl->seeds[strcspn(cl->seeds, "\n")] = '\0';
	return 0;
}

static void l3_cluster_stop(l3_cluster *cl)
{
	if (!cl->dir[0])
		return;
	const char *helper = getenv("KVS_RCLUSTER_HELPER") ? getenv("KVS_RCLUSTER_HELPER") : "tests/l3/redis_cluster.py";
	char cmd[1000];
	snprintf(cmd, sizeof(cmd), "%s %s stop %s >/dev/null 2>&1; rm -rf '%s'",
		 getenv("KVS_PYTHON") ? getenv("KVS_PYTHON") : "python3", helper, cl->dir, cl->dir);
	if (system(cmd) != 0)
		fprintf(stderr, "l3: could not stop the cluster in %s\n", cl->dir);
	cl->dir[0] = '\0';
}

/* Raw hiredis on the node that owns each key (the slot map read once with
 * kvs_rcluster; one connection per node, as the server's L3 worker has). */
typedef struct raw_redis {
	kvs_rcluster *rc;
	char node[8][300];
	redisContext *ctx[8];
	int n;
} raw_redis;

static redisContext *raw_for(raw_redis *r, const void *key, size_t klen)
{
	char node[300];
	if (kvs_rcluster_slot_node(r->rc, kvs_rcluster_keyslot(key, klen), node, sizeof(node)) != 0)
		return NULL;
	for (int i = 0; i < r->n; i++)
		if (!strcmp(r->node[i], node))
			return r->ctx[i];
	if (r->n == 8)
		return NULL;
	char host[300];
	snprintf(host, sizeof(host), "%s", node);
	char *colon = strrchr(host, ':');
	if (!colon)
		return NULL;
	*colon = '\0';
	struct timeval tv = {10, 0};
	redisContext *c = redisConnectWithTimeout(host, atoi(colon + 1), tv);
	if (!c || c->err) {
		redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, tv);
	snprintf(r->node[r->n], sizeof(r->node[0]), "%s", node);
	r->ctx[r->n] = c;
	return r->ctx[r->n++];
}

static void raw_close(raw_redis *r)
{
	for (int i = 0; i < r->n; i++)
		redisFree(r->ctx[i]);
	kvs_rcluster_close(r->rc);
}

/* SET (or GET, copied into buf) of n values of len bytes under "kvbraw:<run>:<i>"
 * keys (i from first) as long as the tier's (prefix + 64 bytes); seconds, or -1. */
static double raw_pass(raw_redis *r, bool set, uint64_t run, uint32_t first, uint32_t n, const uint8_t *val,
		       uint8_t *buf, size_t len)
{
	double t0 = kvb_now();
	for (uint32_t i = first; i < first + n; i++) {
		char key[72];
		memset(key, 'k', sizeof(key));
		int kl = snprintf(key, sizeof(key), "kvbraw:%llu:%u:", (unsigned long long)run, i);
		key[kl] = 'k';
		redisContext *c = raw_for(r, key, sizeof(key));
		if (!c)
			return -1;
		const char *av[3] = {set ? "SET" : "GET", key, (const char *)val};
		size_t al[3] = {3, sizeof(key), len};
		redisReply *rr = redisCommandArgv(c, set ? 3 : 2, av, al);
		bool ok = rr && (set ? rr->type == REDIS_REPLY_STATUS : rr->type == REDIS_REPLY_STRING && (size_t)rr->len == len);
		if (ok && !set)
			memcpy(buf, rr->str, len);
		if (rr)
			freeReplyObject(rr);
		if (!ok)
			return -1;
	}
	return kvb_now() - t0;
}

/* Until the server's write-behind has dealt with `want` objects (written,
 * failed or dropped) and its queue is empty; false after 120 s or when the
 * counters are missing. Not exact (the trace): also done once the queue is
 * empty and the count has not moved for 3 polls (the server skips objects
 * L3 is known to hold, so fewer than `want` may ever be written). */
static bool l3_drained_x(kvs_client *sc, uint64_t want, bool exact)
{
	uint64_t last = UINT64_MAX;
	int still = 0;
	for (int i = 0; i < 120000; i++) {
		kvs_stat_out st[256];
		uint32_t n = 0;
		if (kvs_stats(sc, 10000, st, 256, &n) != 0)
			return false;
		uint64_t w = kvs_stat_find(st, n, "l3_writes"), e = kvs_stat_find(st, n, "l3_write_errors"),
			 d = kvs_stat_find(st, n, "l3_write_drops"), q = kvs_stat_find(st, n, "l3_queue_bytes");
		if (w == UINT64_MAX || e == UINT64_MAX || d == UINT64_MAX || q == UINT64_MAX)
			return false;
		if (w + e + d >= want && q == 0)
			return true;
		still = q == 0 && w + e + d == last ? still + 1 : 0;
		if (!exact && still >= 3)
			return true;
		last = w + e + d;
		usleep(1000);
	}
	return false;
}

static bool l3_drained(kvs_client *sc, uint64_t want) { return l3_drained_x(sc, want, true); }

static int l3_server_start(const kvb_opts *o, kvt_server *s, const char *seeds, const char *l1)
{
	return kvb_server_start(o, s, "--l1-size", l1, "--l3-redis", seeds, "--l3-lookup-ms",
				o->l3_lookup_ms ? o->l3_lookup_ms : "100", NULL);
}

/* Throughput: objects stored on s1 and written behind to L3, then looked up
 * and retrieved on s2 (promoted from L3), beside raw SET/GET of the same
 * sizes on the same nodes. */
static int l3_throughput(const kvb_opts *o, const char *seeds)
{
	const uint32_t chunks = 16;                      /* per job: 16 MiB */
	geo g = {.layers = 1, .bpc = 16, .nb = 2 * chunks * 16 + 2, .block = 64 << 10};
	const uint64_t obj = (uint64_t)g.layers * g.bpc * g.block; /* 1 MiB */
	uint32_t jobs = o->quick ? 2 : 16, rounds = o->quick ? 1 : 3, n = jobs * chunks;
	char l1[32];
	/* every round stays in s2's L1; s1's write-behind queue is capped at L1 / 4
	 * (server/loop.c), and one round is queued at once */
	uint64_t l1b = (rounds > 4 ? rounds : 4) * n * obj + (64ull << 20);
	snprintf(l1, sizeof(l1), "%llu", (unsigned long long)l1b);
	kvt_server s1, s2;
	if (l3_server_start(o, &s1, seeds, l1) != 0)
		return 1;
	if (l3_server_start(o, &s2, seeds, l1) != 0) {
		kvt_server_stop(&s1);
		kvt_server_cleanup(&s1);
		return 1;
	}
	int rc = 0;
	rank_ctx r1 = {0}, r2 = {0};
	raw_redis raw = {0};
	kvs_client *sc1 = kvt_client(&s1, "l3w", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	kvs_client *sc2 = kvt_client(&s2, "l3r", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	kvs_rcluster_config cfg;
	kvs_rcluster_config_defaults(&cfg);
	cfg.seeds = seeds;
	cfg.io_timeout_ms = 10000;
	char err[300];
	uint8_t *val = malloc(obj + KVS_RECORD_HDR_BYTES), *buf = malloc(obj + KVS_RECORD_HDR_BYTES);
	uint8_t *keys = malloc(32ull * chunks);
	if (!sc1 || !sc2 || !val || !buf || !keys || rank_setup(&s1, "l3w", 0, 1, g, &r1) != 0 ||
	    rank_setup(&s2, "l3r", 0, 1, g, &r2) != 0 || kvs_rcluster_open(&cfg, &raw.rc, err, sizeof(err)) != 0) {
		fprintf(stderr, "l3: setup failed\n");
		rc = 1;
		goto out;
	}
	memset(val, 0x5a, obj + KVS_RECORD_HDR_BYTES);
	memset(buf, 0, obj + KVS_RECORD_HDR_BYTES);
	double tw = 0, tr = 0, rw = 0, rr = 0;
	uint64_t written = 0, job = 1, bad = 0;
	/* job by job, kvside and raw back to back, alternating which goes first,
	 * so that a busy machine slows both alike; times summed */
	for (uint32_t round = 0; round < rounds && !rc; round++) {
		uint64_t run = 970 + round;
		/* write: a job stored on s1, timed until its objects are in L3 */
		for (uint32_t j = 0; j < jobs && !rc; j++)
			for (int turn = 0; turn < 2 && !rc; turn++) {
				bool ours = (turn == 0) == ((j + round) % 2 == 0);
				double t0 = kvb_now();
				if (!ours) {
					double t = raw_pass(&raw, true, run, j * chunks, chunks, val, buf, obj + KVS_RECORD_HDR_BYTES);
					rc |= t < 0;
					rw += t;
					continue;
				}
				rc = run_job(&r1, true, job++, run, (uint64_t)j * chunks, chunks, 0, 2, NULL);
				written += chunks;
				if (!rc && !l3_drained(sc1, written)) {
					fprintf(stderr, "l3: server 1 did not write %llu objects behind\n", (unsigned long long)written);
					rc = 1;
				}
				tw += kvb_now() - t0;
			}
		if (!rc && (kvb_stat(sc1, "l3_write_drops") || kvb_stat(sc1, "l3_write_errors"))) {
			fprintf(stderr, "l3: server 1 dropped %llu and failed %llu writes: the figure would be wrong\n",
				(unsigned long long)kvb_stat(sc1, "l3_write_drops"), (unsigned long long)kvb_stat(sc1, "l3_write_errors"));
			rc = 1;
		}
		/* read: lookup + retrieve on s2, every object from L3; the odd
		 * destination blocks are wiped first, then must equal the even
		 * source blocks (s2's rank memory starts as s1's: same seed) */
		for (uint32_t j = 0; j < jobs && !rc; j++)
			for (int turn = 0; turn < 2 && !rc; turn++) {
				bool ours = (turn == 0) == ((j + round) % 2 == 0);
				if (!ours) {
					double t = raw_pass(&raw, false, run, j * chunks, chunks, val, buf, obj + KVS_RECORD_HDR_BYTES);
					rc |= t < 0;
					rr += t;
					continue;
				}
				for (uint32_t k = 0; k < chunks; k++)
					kvb_key(run, (uint64_t)j * chunks + k, keys + 32 * k);
				for (uint32_t b = 0; b < chunks * g.bpc; b++)
					memset(r2.mem + (uint64_t)(1 + 2 * b) * g.block, 0, g.block);
				double t0 = kvb_now();
				uint64_t h = 0;
				uint8_t tiers[64];
				if ((rc = kvs_lookup(sc2, keys, chunks, false, 0, 30000, &h, tiers)) != 0)
					break;
				if (h != chunks || tiers[0] != KVS_TIER_L3) {
					fprintf(stderr, "l3: server 2 lookup: %llu of %u hits, tier %u (server 1: l3_writes %llu "
						"l3_write_drops %llu; server 2: l3_probe_keys %llu l3_probe_hits %llu "
						"l3_lookup_timeouts %llu)\n", (unsigned long long)h, chunks, tiers[0],
						(unsigned long long)kvb_stat(sc1, "l3_writes"),
						(unsigned long long)kvb_stat(sc1, "l3_write_drops"),
						(unsigned long long)kvb_stat(sc2, "l3_probe_keys"),
						(unsigned long long)kvb_stat(sc2, "l3_probe_hits"),
						(unsigned long long)kvb_stat(sc2, "l3_lookup_timeouts"));
					rc = 1;
					break;
				}
				rc = run_job(&r2, false, job++, run, (uint64_t)j * chunks, chunks, 1, 2, NULL);
				tr += kvb_now() - t0;
				for (uint32_t b = 0; b < chunks * g.bpc && !rc; b++)
					bad += memcmp(r2.mem + (uint64_t)(1 + 2 * b) * g.block, r2.mem + (uint64_t)(2 * b) * g.block,
						      g.block) != 0;
			}
	}
	if (bad) {
		fprintf(stderr, "l3: %llu blocks retrieved from L3 differ from what was stored\n", (unsigned long long)bad);
		rc = 1;
	}
	if (!rc) {
		double gb = (double)rounds * n * obj / 1e9;
		kvb_result("l3 write (store on server 1 until written behind, 1 MiB objects)", gb / tw, "GB/s", gb / rw,
			   ">= 0.80 x raw SET");
		kvb_result("l3 read (lookup + retrieve on server 2, from L3)", gb / tr, "GB/s", gb / rr,
			   ">= 0.80 x raw GET");
		kvb_note("l3: %u x %u objects of 1 MiB in jobs of %u; write: a store job on server 1 until its l3_writes "
			 "count it; read: lookup + retrieve job on server 2 (L3 -> L1 -> rank memory, byte-checked)",
			 rounds, n, chunks);
		kvb_note("l3 baseline: raw hiredis SET, GET + copy of the same number of values of the record's size "
			 "(1 MiB + 96 B), same node(s), one connection per node; job by job, alternating which goes first");
		kvb_note("l3 counters: server 1 l3_write_bytes %llu, l3_write_errors %llu, l3_write_drops %llu; server 2 "
			 "l3_reads %llu, l3_read_errors %llu, l3_corrupt %llu", (unsigned long long)kvb_stat(sc1, "l3_write_bytes"),
			 (unsigned long long)kvb_stat(sc1, "l3_write_errors"), (unsigned long long)kvb_stat(sc1, "l3_write_drops"),
			 (unsigned long long)kvb_stat(sc2, "l3_reads"), (unsigned long long)kvb_stat(sc2, "l3_read_errors"),
			 (unsigned long long)kvb_stat(sc2, "l3_corrupt"));
	}
out:
	raw_close(&raw);
	free(val);
	free(buf);
	free(keys);
	kvs_client_close(r1.c);
	kvs_client_close(r2.c);
	kvs_client_close(sc1);
	kvs_client_close(sc2);
	kvt_server_stop(&s1);
	kvt_server_stop(&s2);
	kvt_server_cleanup(&s1);
	kvt_server_cleanup(&s2);
	return rc;
}

/* One server of a trace replay: its scheduler and rank, and how many objects
 * it has stored (for the write-behind drain). */
typedef struct tsrv {
	kvt_server s;
	kvs_client *sched;
	rank_ctx r;
	uint64_t job, stored;
	bool l3;
} tsrv;

/* Replays tr[0..nreq) over n servers, request i on server i % n: lookup,
 * retrieve the hit, store the rest, and (L3) wait until that server's
 * write-behind has written what it stored, so that the next request, on
 * another server, can find it (the replay compresses time to zero; a real
 * trace leaves seconds between requests). *ret_hits: chunks hit. */
static int trace_l3_replay(tsrv *sv, uint32_t n, const treq *tr, uint32_t nreq, uint32_t mx, uint64_t block,
			   uint64_t *ret_hits, uint64_t *ret_l3_tier, uint32_t *looked, uint32_t *got)
{
	uint8_t *keys = malloc(32ull * mx), *tiers = malloc(mx);
	int64_t *ids = malloc(sizeof(int64_t) * mx);
	uint64_t hits = 0, l3t = 0;
	int rc = 0;
	(void)block;
	for (uint32_t i = 0; i < nreq && !rc; i++) {
		tsrv *v = &sv[i % n];
		const treq *q = &tr[i];
		for (uint32_t k = 0; k < q->n; k++)
			kvb_key(4242, q->ids[k], keys + 32 * k);
		uint64_t h = 0;
		if ((rc = kvs_lookup(v->sched, keys, q->n, false, 0, 30000, &h, tiers)) != 0)
			break;
		looked[i] = (uint32_t)h;
		const int64_t *lists[1] = {ids};
		uint32_t len;
		kvs_blocks bl = {.n_groups = 1, .ids = lists, .len = &len};
		int st;
		if (h) {
			for (uint32_t k = 0; k < h; k++) {
				ids[k] = mx + 1 + k;
				l3t += tiers[k] == KVS_TIER_L3;
			}
			len = (uint32_t)h;
			rc = kvs_retrieve(v->r.c, v->job, keys, (uint32_t)h, &bl, 0, 30000, &st);
			if (rc == KVS_E_MISS) { /* gone between lookup and retrieve: a miss */
				h = 0;
				rc = 0;
				kvs_complete(v->r.c, v->job, false, 30000, &st);
			} else if (!rc) {
				rc = kvs_complete(v->r.c, v->job, true, 30000, &st);
			}
			v->job++;
		}
		if (!rc && h < q->n) {
			for (uint32_t k = 0; k < q->n - h; k++)
				ids[k] = k;
			len = q->n - (uint32_t)h;
			rc = kvs_store(v->r.c, v->job, keys + 32 * h, len, &bl, NULL, 30000, &st);
			if (!rc)
				rc = kvs_complete(v->r.c, v->job, true, 30000, &st);
			if (!rc)
				rc = kvs_job_wait(v->r.c, v->job, 30000, &st);
			if (rc == KVS_E_NOSPACE)
				rc = 0;
			v->job++;
			v->stored += len;
			if (!rc && v->l3 && !l3_drained_x(v->sched, v->stored, false)) {
				fprintf(stderr, "trace l3: write-behind did not drain\n");
				rc = 1;
			}
		}
		got[i] = (uint32_t)h;
		hits += h;
	}
	free(keys);
	free(tiers);
	free(ids);
	*ret_hits = hits;
	*ret_l3_tier = l3t;
	return rc;
}

static int l3_trace(const kvb_opts *o, const char *seeds)
{
	uint32_t nreq, mx;
	treq *tr = trace_for(o, "trace", &nreq, &mx);
	if (!tr)
		return 1;
	uint64_t total = 0;
	for (uint32_t i = 0; i < nreq; i++)
		total += tr[i].n;
	geo g = {.layers = 1, .bpc = 1, .nb = 2 * mx + 2, .block = 4096};
	char l1[32];
	snprintf(l1, sizeof(l1), "%llu", (unsigned long long)(o->l1_size ? o->l1_size : (256ull << 20)));
	tsrv sv[2];
	memset(sv, 0, sizeof(sv));
	int rc = 0;
	uint64_t hits1 = 0, hits2 = 0, l3t1 = 0, l3t2 = 0;
	double t1 = 0, t2 = 0;
	uint32_t *look[2], *got[2];
	for (int k = 0; k < 2; k++) {
		look[k] = calloc(nreq ? nreq : 1, sizeof(uint32_t));
		got[k] = calloc(nreq ? nreq : 1, sizeof(uint32_t));
	}
	/* one server holding everything (no L3), then two sharing L3 */
	for (int pass = 0; pass < 2 && !rc; pass++) {
		uint32_t n = pass ? 2 : 1;
		for (uint32_t k = 0; k < n && !rc; k++) {
			tsrv *v = &sv[k];
			v->l3 = pass == 1;
			v->job = 1;
			v->stored = 0;
			rc = v->l3 ? l3_server_start(o, &v->s, seeds, l1) : kvb_server_start(o, &v->s, "--l1-size", l1, NULL);
			if (rc)
				break;
			v->sched = kvt_client(&v->s, "trace", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
			if (!v->sched || rank_setup(&v->s, "trace", 0, 1, g, &v->r) != 0)
				rc = 1;
		}
		double t0 = kvb_now();
		if (!rc)
			rc = trace_l3_replay(sv, n, tr, nreq, mx, g.block, pass ? &hits2 : &hits1, pass ? &l3t2 : &l3t1,
					     look[pass], got[pass]);
		*(pass ? &t2 : &t1) = kvb_now() - t0;
		if (pass && !rc) {
			uint64_t to = kvb_stat(sv[0].sched, "l3_lookup_timeouts") + kvb_stat(sv[1].sched, "l3_lookup_timeouts");
			uint64_t co = kvb_stat(sv[0].sched, "l3_corrupt") + kvb_stat(sv[1].sched, "l3_corrupt");
			kvb_note("trace l3: %llu hit chunks had tier l3; l3_lookup_timeouts %llu, l3_corrupt %llu (both servers)",
				 (unsigned long long)l3t2, (unsigned long long)to, (unsigned long long)co);
		}
		for (uint32_t k = 0; k < n; k++) {
			kvs_client_close(sv[k].r.c);
			kvs_client_close(sv[k].sched);
			kvt_server_stop(&sv[k].s);
			kvt_server_cleanup(&sv[k].s);
			memset(&sv[k], 0, sizeof(sv[k]));
		}
	}
	double r1 = total ? (double)hits1 / total : 0, r2 = total ? (double)hits2 / total : 0;
	int bad = 0;
	/* where two servers hit less than one: the lookup, or the retrieve after it */
	uint64_t short_lookup = 0, short_chunks = 0, lost_retrieve = 0, lost_chunks = 0;
	for (uint32_t i = 0; i < nreq && !rc; i++) {
		if (look[1][i] < got[0][i]) {
			short_lookup++;
			short_chunks += got[0][i] - look[1][i];
		} else if (got[1][i] < got[0][i]) {
			lost_retrieve++;
			lost_chunks += got[0][i] - got[1][i];
		}
		if (getenv("KVB_VERBOSE") && got[1][i] != got[0][i])
			fprintf(stderr, "trace l3: request %u (%u ids, server %u): one server %u, two: lookup %u, served %u\n", i,
				tr[i].n, i % 2, got[0][i], look[1][i], got[1][i]);
	}
	if (!rc)
		kvb_note("trace l3: two servers hit less than one in %llu requests by the lookup (%llu chunks) and in %llu by "
			 "a retrieve that missed after the lookup hit (%llu chunks)", (unsigned long long)short_lookup,
			 (unsigned long long)short_chunks, (unsigned long long)lost_retrieve, (unsigned long long)lost_chunks);
	for (int k = 0; k < 2; k++) {
		free(look[k]);
		free(got[k]);
	}
	if (!rc) {
		char nm[128];
		snprintf(nm, sizeof(nm), "trace hit ratio, 2 servers sharing L3 (%u requests alternating)", nreq);
		kvb_result(nm, r2, "ratio", r1, ">= 0.98 x one server");
		kvb_result("trace requests per second, 2 servers + L3 (write-behind drained per request)", nreq / t2,
			   "req/s", nreq / t1, "");
		kvb_note("trace l3: %u requests, 4 KiB per block, L1 %s B per server; baseline: one server without L3 "
			 "(hit ratio %.4f); with L3 request i goes to server i %% 2, which then waits until its write-behind "
			 "has written what it stored", nreq, l1, r1);
		bad = r2 < 0.98 * r1 - 1e-12 || l3t2 == 0;
		if (bad)
			fprintf(stderr, "trace l3: hit ratio %.6f with two servers vs %.6f on one (%llu l3 tiers)\n", r2, r1,
				(unsigned long long)l3t2);
	}
	for (uint32_t i = 0; i < nreq; i++)
		free(tr[i].ids);
	free(tr);
	return rc || bad;
}

int kvb_mode_l3(const kvb_opts *o)
{
	l3_cluster cl;
	int r = l3_cluster_start(o, &cl);
	if (r == 77) {
		kvb_note("l3: redis-server not found: skipped");
		return 77;
	}
	if (r) {
		fprintf(stderr, "l3: could not start a Redis Cluster\n");
		return 1;
	}
	kvb_note("l3: cluster %s (%s)", cl.seeds, o->l3_redis ? "given" : o->l3_masters == 3 ? "3 masters, started here" :
		 "1 master holding every slot, started here");
	int rc = l3_throughput(o, cl.seeds);
	rc |= l3_trace(o, cl.seeds);
	l3_cluster_stop(&cl);
	return rc;
}
#else
int kvb_mode_l3(const kvb_opts *o)
{
	(void)o;
	kvb_note("l3: built without hiredis: skipped");
	return 77;
}
#endif
