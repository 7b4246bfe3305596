/* Prometheus /metrics, /healthz and /readyz over HTTP (libmicrohttpd).
 *
 * The HTTP server runs on a thread of its own and never touches main-loop
 * state. The main loop publishes a snapshot of its counters once per tick
 * (kvs__metrics_tick, every KVS_TICK_MS): the snapshot is copied in under
 * the snapshot mutex and the publish time is stored in an atomic. The HTTP
 * thread copies the snapshot out under the same mutex and formats only that
 * copy; /healthz compares the publish time with the clock, so a main loop
 * that stops ticking (blocked, spinning, deadlocked) turns it into a 503
 * after stall_ms while the HTTP thread keeps answering. */
#ifndef KVS_METRICS_H
#define KVS_METRICS_H

#include <stdbool.h>
#include <stdint.h>

#include "kvs_error.h"
#include "kvs_proto.h"

#define KVS_METRICS_MAX_SAMPLES 256
#define KVS_METRICS_NE (KVS_E_LAST_ - KVS_E_BASE + 1)

/* What the main loop publishes. Plain data: copied whole. */
typedef struct kvs_metrics_snap {
	uint32_t n;
	struct kvs_metrics_sample {
		char name[48]; /* a `stats` counter name */
		uint64_t value;
	} s[KVS_METRICS_MAX_SAMPLES];
	uint64_t requests[KVS_OP_COUNT_];                  /* index 0: unreadable op */
	uint64_t errors[KVS_OP_COUNT_][KVS_METRICS_NE];    /* by op and code */
	bool draining;
} kvs_metrics_snap;

typedef struct kvs_metrics_config {
	const char *listen; /* HOST:PORT, IPv6 as [ADDR]:PORT; port 0 = any free port */
	uint64_t stall_ms;  /* /healthz fails after this long without a publish */
	const char *version;
} kvs_metrics_config;

typedef struct kvs_metrics kvs_metrics;

/* Binds the endpoint and starts the HTTP thread. Until the first publish,
 * /healthz answers 503 ("starting"). Returns 0, -EINVAL (bad listen text or
 * unresolvable host), -EADDRINUSE / -EACCES / ... (bind failed) or -ENOMEM.
 * *ret untouched on failure. */
int kvs_metrics_start(const kvs_metrics_config *cfg, kvs_metrics **ret);
/* The bound TCP port (useful with port 0). */
unsigned kvs_metrics_port(const kvs_metrics *m);
/* Connections shut down for staying open past the 5 s deadline (any thread). */
uint64_t kvs_metrics_conns_cut(const kvs_metrics *m);
/* Copies snap in (under the snapshot mutex) and records now_ms, a
 * kvs_now_ms() reading, as the time of the last sign of life. */
void kvs_metrics_publish(kvs_metrics *m, const kvs_metrics_snap *snap, uint64_t now_ms);
/* Stops the HTTP thread (waiting for requests in progress) and frees.
 * Accepts NULL. */
void kvs_metrics_stop(kvs_metrics *m);

/* Formats a snapshot in the Prometheus text format (exposed for tests).
 * Returns a malloc'd NUL-terminated buffer, or NULL. age_ms is the time
 * since the snapshot was published. */
char *kvs_metrics_format(const kvs_metrics_snap *snap, uint64_t age_ms, const char *version);

/* ---- server glue (main-loop thread) --------------------------------------- */
struct kvs_server;
/* Starts the endpoint of srv->cfg.metrics_listen, if any. A failure to bind
 * is logged and the server runs without metrics (they observe the cache;
 * they must not take it down): stats' metrics_port then reads 0. */
void kvs__metrics_init(struct kvs_server *srv);
/* Publishes the counters; called from the loop's tick. */
void kvs__metrics_tick(struct kvs_server *srv);
void kvs__metrics_fini(struct kvs_server *srv);

#endif
