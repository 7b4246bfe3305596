/* kvside-bench internals: options, result records, and the bench's way of
 * using the test harness (server, clients and rank processes: harness.h). */
#ifndef KVB_BENCH_H
#define KVB_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "harness.h"
#include "kvside.h"

typedef struct kvb_opts {
	const char *server;  /* kvside-server binary */
	const char *trace;   /* Mooncake-format trace */
	const char *dir;     /* work dir (L2, raw-disk files) */
	uint32_t ranks;
	bool quick;          /* smoke: tiny sizes, seconds not minutes */
	bool json;
	uint64_t l1_size, l2_size;
	uint32_t trace_requests; /* 0 = all */
	bool expect_bound;   /* trace: fail unless the hit ratio equals the bound */
	uint32_t inflight;   /* copy: jobs in flight per rank (default 1) */
	bool spread;         /* gpu: rank r on GPU r % devices */
	const char *l3_redis; /* l3: seeds of an existing cluster (NULL: start one) */
	uint32_t l3_masters;  /* l3: masters of the cluster it starts (1 or 3) */
	const char *l3_lookup_ms; /* l3: the servers' l3-lookup-ms (NULL: 100) */
	const char *sizes;   /* startup: L1 sizes in GiB, "8,32,96" */
	bool check;          /* startup: exit 1 unless the no-stall targets hold */
	bool gpu_ranks;      /* writebehind: the ranks' KV in GPU memory (cuda engine) */
	const char *gpu_cfg; /* gpu: "RxI,..." configurations (NULL: 1x1,1x2,4x1,4x2) */
	const char *gpu_blocks; /* gpu: block sizes in KiB, "4,16,..." (NULL: 4,16,64,256,2048) */
} kvb_opts;

/* One result line. baseline 0 = none; target "" = none. */
void kvb_result(const char *name, double value, const char *unit, double baseline, const char *target);
void kvb_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void kvb_print(const kvb_opts *o);

/* The server and its clients come from the test harness (harness.h), set
 * up the bench's way: run dir under o->dir, o->server, --log-level error,
 * namespace "bench-model", 30 s requests. kvb_server_start also waits until
 * the L1 arena is faulted in, so that every mode measures a warm server.
 * Extra server args NULL-terminated. 0 or -1. */
int kvb_server_start(const kvb_opts *o, kvt_server *s, ...);
long kvb_server_rss_kib(const kvt_server *s);
/* A counter (UINT64_MAX on failure); the bench waits up to 10 s for it. */
static inline uint64_t kvb_stat(kvs_client *c, const char *name) { return kvt_stat_ms(c, name, 10000); }

double kvb_now(void); /* seconds, monotonic */
void kvb_key(uint64_t a, uint64_t b, uint8_t out[32]);
double kvb_pct(double *v, uint32_t n, double p); /* sorts v */

int kvb_mode_copy(const kvb_opts *o);
int kvb_mode_control(const kvb_opts *o);
int kvb_mode_l2(const kvb_opts *o);
int kvb_mode_trace(const kvb_opts *o);
int kvb_mode_trace_lru(const kvb_opts *o);
int kvb_mode_restart(const kvb_opts *o);
int kvb_mode_memory(const kvb_opts *o);
int kvb_mode_gpu(const kvb_opts *o);
/* 77 when it cannot run here (no hiredis, no redis-server) */
int kvb_mode_l3(const kvb_opts *o);
int kvb_mode_startup(const kvb_opts *o);
int kvb_mode_writebehind(const kvb_opts *o);

#endif
