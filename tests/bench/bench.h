/* kvside-bench internals: result records, the server and rank-process
 * plumbing shared by the modes. */
#ifndef KVB_BENCH_H
#define KVB_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

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
} kvb_opts;

/* One result line. baseline 0 = none; target "" = none. */
void kvb_result(const char *name, double value, const char *unit, double baseline, const char *target);
void kvb_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void kvb_print(const kvb_opts *o);

typedef struct kvb_server {
	pid_t pid;
	char dir[256], run[300];
} kvb_server;

/* Starts kvside-server (extra args NULL-terminated) in a fresh run dir under
 * o->dir and waits for a hello. Returns 0 or -1. */
int kvb_server_start(const kvb_opts *o, kvb_server *s, ...);
int kvb_server_start_v(const kvb_opts *o, kvb_server *s, char *const *extra);
void kvb_server_stop(kvb_server *s, bool hard);
long kvb_server_rss_kib(const kvb_server *s);

kvs_client *kvb_client(const kvb_server *s, const char *engine, int role, uint32_t rank, uint32_t world);
uint64_t kvb_stat(kvs_client *c, const char *name);

double kvb_now(void); /* seconds, monotonic */
void kvb_key(uint64_t a, uint64_t b, uint8_t out[32]);
double kvb_pct(double *v, uint32_t n, double p); /* sorts v */

int kvb_mode_copy(const kvb_opts *o);
int kvb_mode_control(const kvb_opts *o);
int kvb_mode_l2(const kvb_opts *o);
int kvb_mode_trace(const kvb_opts *o);
int kvb_mode_restart(const kvb_opts *o);
int kvb_mode_memory(const kvb_opts *o);
int kvb_mode_gpu(const kvb_opts *o);

#endif
