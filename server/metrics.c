/* Metrics and health endpoint: a libmicrohttpd thread serving a snapshot the
 * main loop publishes every tick (see metrics.h for the threading rule), the
 * Prometheus text formatter, and the glue that builds the snapshot from the
 * server's `stats` counters. */
#include "metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "metrics"
#include "config.h"
#include "kvs_config.h"
#include "kvs_log.h"
#include "kvs_time.h"
#include "stats.h"
#include "server.h"

/* Connections at once, from one address, and the time one may stay open:
 * enough that the kubelet's probes and a few scrapers always find a slot
 * while up to CONN_PER_IP slow clients of one address hold theirs. */
#define CONN_MAX 64u
#define CONN_PER_IP 32u
#define CONN_DEADLINE_MS 5000u

struct kvs_metrics {
	struct MHD_Daemon *daemon;
	unsigned port;
	uint64_t stall_ms;
	char version[32];
	/* written by the main loop, read by the HTTP thread */
	pthread_mutex_t mu;          /* guards snap and published */
	kvs_metrics_snap snap;
	bool published;
	atomic_uint_fast64_t last_ms; /* kvs_now_ms() of the last publish */
	/* main-loop thread only: the copy-throughput window */
	uint64_t win_ms, win_all, win_host, bps_all, bps_host;
	kvs_metrics_snap *build;     /* scratch snapshot the loop fills */
	/* the open connections (MHD's notify callback adds and removes them, on
	 * the HTTP thread) and when each was accepted; the loop's publish shuts
	 * down those open longer than CONN_DEADLINE_MS, whatever they send: a
	 * client that trickles a header line every few seconds never meets
	 * MHD's idle time-out. An entry leaves the table before MHD closes its
	 * fd (the CLOSED notification comes first), and shutdown happens under
	 * conn_mu, so no closed or reused fd is shut down. */
	pthread_mutex_t conn_mu;
	struct { int fd; uint64_t since_ms; } conns[CONN_MAX];
	uint32_t n_conns;
	atomic_uint_fast64_t conns_cut; /* cum. connections shut down at the deadline */
};

/* ---- the Prometheus text format ---------------------------------------------------- */

typedef struct sbuf {
	char *p;
	size_t len, cap;
	bool oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
	for (int attempt = 0; attempt < 2 && !b->oom; attempt++) {
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
		va_end(ap);
		if (n < 0) {
			b->oom = true;
			return;
		}
		if (b->p && b->len + (size_t)n < b->cap) {
			b->len += (size_t)n;
			return;
		}
		size_t cap = b->cap ? b->cap : 16384;
		while (cap < b->len + (size_t)n + 1)
			cap *= 2;
		char *q = realloc(b->p, cap);
		if (!q) {
			b->oom = true;
			return;
		}
		b->p = q;
		b->cap = cap;
	}
}

/* One metric family: its samples come from `stats` counters by name. */
typedef struct family {
	const char *name; /* after the kvside_ prefix */
	const char *type; /* counter or gauge */
	const char *help;
	double scale;     /* 0: the counter as an integer; else value * scale */
	struct { const char *stat, *labels; } smp[4];
} family;

static const family families[] = {
	{"start_time_seconds", "gauge", "When this kvside-server started, in seconds since the Unix epoch.", 1e-3,
	 {{"server_start_unix_ms", ""}}},
	{"uptime_seconds", "gauge", "Seconds since this kvside-server started.", 1e-3, {{"server_uptime_ms", ""}}},
	{"sessions", "gauge", "Open client sessions.", 0, {{"sessions", ""}}},
	{"sessions_opened_total", "counter", "Sessions opened by hello.", 0, {{"sessions_opened", ""}}},
	{"lanes", "gauge", "Job lanes attached (local sessions talking over a socket pair).", 0, {{"lanes_open", ""}}},
	{"lane_requests_total", "counter", "Requests read from job lanes.", 0, {{"lane_requests", ""}}},
	{"lane_writes_total", "counter", "System calls that wrote replies to job lanes (one per lane and loop iteration).", 0,
	 {{"lane_writes", ""}}},
	{"lane_replies_total", "counter", "Replies and pushes for job lanes, by path.", 0,
	 {{"lane_replies", "path=\"lane\""}, {"lane_replies_diverted", "path=\"zeromq\""}}},
	{"lanes_closed_bad_total", "counter", "Job lanes closed for a bad frame or a read error.", 0,
	 {{"lanes_closed_bad", ""}}},
	{"sessions_reaped_total", "counter", "Sessions reaped after their lease expired.", 0,
	 {{"sessions_reaped", ""}}},
	{"registrations", "gauge", "Live registrations of KV memory.", 0, {{"registrations", ""}}},
	{"imports", "gauge", "Mapped allocations (memfd or cuMem imports).", 0, {{"imports", ""}}},
	{"aliases", "gauge", "Alias references to imports held by registrations.", 0, {{"aliases", ""}}},
	{"retained_blocks", "gauge", "Source blocks retained by open jobs (0 when no job is open).", 0,
	 {{"retained_blocks", ""}}},
	{"jobs", "gauge", "Jobs by state: open jobs, and terminal ids remembered to answer repeats.", 0,
	 {{"jobs_open", "state=\"open\""}, {"jobs_terminal_remembered", "state=\"remembered\""}}},
	{"jobs_finished_total", "counter", "Jobs that reached a terminal state, by state.", 0,
	 {{"jobs_committed", "state=\"committed\""}, {"jobs_aborted", "state=\"aborted\""}}},
	{"store_objects_total", "counter", "Objects copied into L1 by store parts.", 0,
	 {{"store_objects", ""}}},
	{"store_skipped_cached_total", "counter", "Store objects skipped because already cached.", 0,
	 {{"store_skipped_cached", ""}}},
	{"store_staged_total", "counter", "Store objects staged privately (racing stores).", 0,
	 {{"store_staged", ""}}},
	{"retrieve_objects_total", "counter", "Objects copied out of L1 by retrieve parts.", 0,
	 {{"retrieve_objects", ""}}},
	{"copy_waves_total", "counter", "Waves of long job parts given to a copy engine while the rest was planned.",
	 0, {{"copy_waves", ""}}},
	{"copy_bytes_total", "counter", "Bytes copied by a copy engine, by engine.", 0,
	 {{"copy_bytes_host", "engine=\"host\""}}},
	{"copy_throughput_bytes_per_second", "gauge",
	 "Copy throughput over the last second, by engine (all: every finished copy task).", 0,
	 {{"copy_bps_host", "engine=\"host\""}, {"copy_bps_all", "engine=\"all\""}}},
	{"job_copy_bytes_total", "counter", "Bytes of finished copy tasks, all engines and directions.",
	 0, {{"copy_bytes", ""}}},
	{"copy_direction_bytes_total", "counter",
	 "Bytes of finished copy tasks by direction (store: into L1, retrieve: out of L1) and engine.", 0,
	 {{"copy_bytes_store_host", "direction=\"store\",engine=\"host\""},
	  {"copy_bytes_retrieve_host", "direction=\"retrieve\",engine=\"host\""},
	  {"copy_bytes_store_cuda", "direction=\"store\",engine=\"cuda\""},
	  {"copy_bytes_retrieve_cuda", "direction=\"retrieve\",engine=\"cuda\""}}},
	{"lookups_total", "counter", "Lookup requests.", 0, {{"lookups", ""}}},
	{"lookup_keys_total", "counter", "Chunk keys asked by lookups.", 0, {{"lookup_keys", ""}}},
	{"lookup_hits_total", "counter", "Chunks found by lookups, by the tier that holds them.", 0,
	 {{"hits_l1", "tier=\"l1\""}, {"hits_l2", "tier=\"l2\""}, {"hits_l3", "tier=\"l3\""}}},
	{"lookup_misses_total", "counter", "Chunk keys asked by lookups and not counted as hits.", 0,
	 {{"misses", ""}}},
	{"lookup_pins_total", "counter", "L1 pins taken by lookups with pin_ms.", 0, {{"lookup_pins", ""}}},
	{"l2_promotions_total", "counter", "Objects read from L2 into L1.", 0, {{"l2_promotions", ""}}},
	{"l2_promotion_failures_total", "counter", "L2 to L1 promotions that failed.", 0,
	 {{"l2_promotion_failures", ""}}},
	{"l2_prefetches_total", "counter", "Promotions started by lookups with prefetch.", 0,
	 {{"l2_prefetches", ""}}},
	{"l1_capacity_bytes", "gauge", "Size of the L1 DRAM arena.", 0, {{"l1_capacity", ""}}},
	{"l1_used_bytes", "gauge", "L1 bytes held by reserved and committed objects.", 0,
	 {{"l1_bytes", ""}}},
	{"l1_reserved_bytes", "gauge", "L1 bytes held by reserved (in-flight) objects.", 0,
	 {{"l1_bytes_reserved", ""}}},
	{"l1_objects", "gauge", "L1 objects by state.", 0,
	 {{"l1_objects", "state=\"any\""}, {"l1_objects_reserved", "state=\"reserved\""}}},
	{"l1_chunks", "gauge", "Chunks with at least one L1 object.", 0, {{"l1_chunks", ""}}},
	{"l1_nospace_total", "counter", "L1 reservations refused for lack of evictable space.", 0,
	 {{"l1_nospace", ""}}},
	{"l1_metadata_bytes", "gauge", "Memory used by L1 metadata.", 0, {{"l1_meta_bytes", ""}}},
	{"l1_prefaulted_bytes", "gauge", "L1 arena bytes faulted in at start-up so far.", 0,
	 {{"l1_prefaulted_bytes", ""}}},
	{"l1_prefault_active", "gauge", "1 while the start-up prefault of L1 runs.", 0, {{"l1_prefault_active", ""}}},
	{"l1_withheld_bytes", "gauge", "L1 bytes not handed out yet (above the pinned prefix while the GPU engine pins).",
	 0, {{"l1_withheld_bytes", ""}}},
	{"evictions_total", "counter", "Objects evicted to make room, by tier.", 0,
	 {{"l1_evictions", "tier=\"l1\""}, {"l2_evictions", "tier=\"l2\""}}},
	{"evicted_bytes_total", "counter", "Bytes evicted from L1 to make room.", 0,
	 {{"l1_evicted_bytes", "tier=\"l1\""}}},
	{"l2_enabled", "gauge", "1 if the persistent L2 tier is configured.", 0, {{"l2_enabled", ""}}},
	{"l2_capacity_bytes", "gauge", "L2 capacity (l2-size, less while a full disk caps it).", 0,
	 {{"l2_capacity", ""}}},
	{"l2_used_bytes", "gauge", "L2 bytes held by objects and their headers.", 0, {{"l2_bytes", ""}}},
	{"l2_objects", "gauge", "Objects in L2.", 0, {{"l2_objects", ""}}},
	{"l2_writes_total", "counter", "Objects queued for writing to L2.", 0, {{"l2_writes", ""}}},
	{"l2_writes_committed_total", "counter", "L2 writes committed to disk.", 0,
	 {{"l2_writes_committed", ""}}},
	{"l2_write_batches_total", "counter", "L2 group commits.", 0, {{"l2_write_batches", ""}}},
	{"l2_write_drops_total", "counter", "Queued L2 writes dropped because the queue was full.", 0,
	 {{"l2_write_drops", ""}}},
	{"l2_write_errors_total", "counter", "L2 writes that failed.", 0, {{"l2_write_errors", ""}}},
	{"l2_queue_depth", "gauge", "Writes waiting in the L2 queue.", 0, {{"l2_queue_depth", ""}}},
	{"l2_queue_bytes", "gauge", "Bytes waiting in the L2 queue.", 0, {{"l2_queue_bytes", ""}}},
	{"l2_reads_total", "counter", "Objects read from L2.", 0, {{"l2_reads", ""}}},
	{"l2_read_misses_total", "counter", "L2 reads that found nothing usable.", 0,
	 {{"l2_read_misses", ""}}},
	{"l2_checksum_failures_total", "counter", "L2 objects whose checksum did not match (never served).",
	 0, {{"l2_checksum_failures", ""}}},
	{"l2_header_mismatches_total", "counter",
	 "L2 records of another geometry or format version, or with a damaged header.", 0,
	 {{"l2_header_mismatches", ""}}},
	{"l2_key_mismatches_total", "counter", "L2 records found under another object's key (deleted, never served).",
	 0, {{"l2_key_mismatches", ""}}},
	{"l2_map_full_retries_total", "counter", "L2 commits retried after the map filled up.", 0,
	 {{"l2_map_full_retries", ""}}},
	{"l2_disk_full_total", "counter", "Times the file system under L2 refused more space (L2 capacity capped).", 0,
	 {{"l2_disk_full", ""}}},
	{"l2_corrupt_recoveries_total", "counter", "Corrupt L2 files moved aside at start (L2 started empty).", 0,
	 {{"l2_corrupt_recoveries", ""}}},
	{"l2_verify_seconds", "gauge", "How long this start's structural check of data.mdb took.", 1e-6,
	 {{"l2_verify_us", ""}}},
	{"l3_enabled", "gauge", "1 if the shared L3 tier is configured.", 0, {{"l3_enabled", ""}}},
	{"l3_connected", "gauge", "L3 worker connections open (3 when the cluster is reachable).", 0,
	 {{"l3_connected", ""}}},
	{"l3_lookups_total", "counter", "Lookups that asked L3, by outcome.", 0,
	 {{"l3_lookups_deferred", "result=\"asked\""}, {"l3_lookup_timeouts", "result=\"late\""},
	  {"l3_lookups_skipped", "result=\"skipped\""}}},
	{"l3_probe_keys_total", "counter", "Objects asked of L3 by lookups.", 0, {{"l3_probe_keys", ""}}},
	{"l3_probe_hits_total", "counter", "Objects L3 held when asked.", 0, {{"l3_probe_hits", ""}}},
	{"l3_probe_errors_total", "counter", "L3 probes that failed (cluster down, time-out).", 0,
	 {{"l3_probe_errors", ""}}},
	{"l3_reads_total", "counter", "Objects read from L3 (promotions), by outcome.", 0,
	 {{"l3_reads", "result=\"all\""}, {"l3_read_misses", "result=\"miss\""},
	  {"l3_read_errors", "result=\"error\""}}},
	{"l3_read_bytes_total", "counter", "Object bytes read from L3.", 0, {{"l3_read_bytes", ""}}},
	{"l3_corrupt_total", "counter", "L3 records refused: header, key, geometry or checksum (never served).", 0,
	 {{"l3_corrupt", ""}}},
	{"l3_writes_total", "counter", "Objects written to L3.", 0, {{"l3_writes", ""}}},
	{"l3_write_bytes_total", "counter", "Object bytes written to L3.", 0, {{"l3_write_bytes", ""}}},
	{"l3_write_errors_total", "counter", "L3 writes that failed.", 0, {{"l3_write_errors", ""}}},
	{"l3_write_drops_total", "counter", "Queued L3 writes dropped (queue full or L1 needing room).", 0,
	 {{"l3_write_drops", ""}}},
	{"l3_queue_bytes", "gauge", "Bytes waiting in the L3 write-behind queue.", 0, {{"l3_queue_bytes", ""}}},
	{"l3_seconds_total", "counter", "Time L3 requests spent in the cluster, by kind.", 1e-6,
	 {{"l3_probe_us", "op=\"probe\""}, {"l3_read_us", "op=\"read\""}, {"l3_write_us", "op=\"write\""}}},
	{"l3_redirections_total", "counter", "Redis Cluster redirections followed.", 0,
	 {{"l3_moved", "kind=\"moved\""}, {"l3_ask", "kind=\"ask\""}}},
	{"l3_topology_refreshes_total", "counter", "Redis Cluster slot maps read.", 0, {{"l3_refreshes", ""}}},
	{"l3_nodes_down_total", "counter", "Times a Redis node was marked down.", 0, {{"l3_nodes_down", ""}}},
	{"broker_connections_total", "counter", "fd-broker connections, by outcome.", 0,
	 {{"broker_accepted", "result=\"accepted\""}, {"broker_rejected", "result=\"rejected\""}}},
	{"broker_fds_total", "counter", "fds received by the broker, by outcome.", 0,
	 {{"broker_parked", "result=\"parked\""}, {"broker_expired", "result=\"expired\""}}},
	{"parked_fds", "gauge", "fds parked by the broker, waiting for a register.", 0,
	 {{"parked_fds", ""}}},
	{"loop_busy_seconds_total", "counter", "Main-loop time spent handling events.", 1e-6,
	 {{"loop_busy_us", ""}}},
	{"cuda_available", "gauge", "1 if the CUDA copy engine is running.", 0, {{"cuda_available", ""}}},
	{"cuda_starting", "gauge", "1 while the CUDA copy engine is being made after a start.", 0,
	 {{"cuda_starting", ""}}},
	{"cuda_parts_polled_total", "counter", "GPU job parts whose end the main loop saw by polling.", 0,
	 {{"cuda_parts_polled", ""}}},
	{"cuda_pin_waits_total", "counter", "GPU job parts that waited for their L1 slices to be pinned.", 0,
	 {{"cuda_pin_waits", ""}}},
	{"cuda_gate_waits_total", "counter", "GPU job parts queued off the main loop after L1 pinning's driver calls.", 0,
	 {{"cuda_gate_waits", ""}}},
	{"cuda_devices", "gauge", "CUDA devices usable by the copy engine.", 0, {{"cuda_devices", ""}}},
	{"cuda_tasks_total", "counter", "Copy tasks run by the CUDA engine.", 0, {{"cuda_tasks", ""}}},
	{"cuda_kernel_launches_total", "counter", "Gather/scatter kernel launches.", 0,
	 {{"cuda_kernel_launches", ""}}},
	{"cuda_fallback_copies_total", "counter", "CUDA copies done without the kernel.", 0,
	 {{"cuda_fallback_copies", ""}}},
	{"cuda_dma_copies_total", "counter", "Runs sent to the DMA engine.", 0, {{"cuda_dma_copies", ""}}},
	{"cuda_staged_bytes_total", "counter", "Bytes copied through device staging (kernel + DMA).", 0,
	 {{"cuda_staged_bytes", ""}}},
	{"cuda_errors_total", "counter", "CUDA errors (each failed a job part).", 0, {{"cuda_errors", ""}}},
	{"cuda_staging_bytes", "gauge", "Device memory held for staged copies (all registrations and each GPU's retrieve pipe).", 0,
	 {{"cuda_staging_bytes", ""}}},
	{"cuda_pinned_bytes", "gauge", "L1 arena bytes registered with CUDA.", 0,
	 {{"cuda_pinned_bytes", ""}}},
	{"draining", "gauge", "1 while the server refuses new jobs (kvside-ctl drain).", 0,
	 {{"draining", ""}}},
};

static const struct kvs_metrics_sample *find(const kvs_metrics_snap *s, const char *name)
{
	for (uint32_t i = 0; i < s->n; i++)
		if (strcmp(s->s[i].name, name) == 0)
			return &s->s[i];
	return NULL;
}

/* Counters handled elsewhere, never exported under their generic name. */
static bool special(const char *name)
{
	return strncmp(name, "errors.", 7) == 0 || strcmp(name, "requests") == 0 ||
	       strcmp(name, "metrics_port") == 0 || strcmp(name, "server_pid") == 0 ||
	       strcmp(name, "server_epoch") == 0 || strcmp(name, "server_version") == 0; /* build_info's labels */
}

char *kvs_metrics_format(const kvs_metrics_snap *snap, uint64_t age_ms, const char *version)
{
	sbuf b = {0};
	bool used[KVS_METRICS_MAX_SAMPLES] = {false};
	const struct kvs_metrics_sample *pid = find(snap, "server_pid"), *ep = find(snap, "server_epoch");
	sb_printf(&b, "# HELP kvside_build_info Version, pid and epoch (the first 8 bytes of the replies' epoch, hex) "
		      "of the running kvside-server.\n"
		      "# TYPE kvside_build_info gauge\nkvside_build_info{version=\"%s\",pid=\"%llu\",epoch=\"%016llx\"} 1\n",
		  version, pid ? (unsigned long long)pid->value : 0ull, ep ? (unsigned long long)ep->value : 0ull);
	sb_printf(&b, "# HELP kvside_main_loop_tick_age_seconds Time since the main loop last "
		      "published these numbers.\n# TYPE kvside_main_loop_tick_age_seconds gauge\n"
		      "kvside_main_loop_tick_age_seconds %.3f\n", (double)age_ms / 1000.0);
	sb_printf(&b, "# HELP kvside_requests_total Requests received, by op (unknown: unreadable op).\n"
		      "# TYPE kvside_requests_total counter\n");
	for (int op = 0; op < KVS_OP_COUNT_; op++) {
		if (op == KVS_OP_JOB_DONE)
			continue; /* a push, never a request */
		sb_printf(&b, "kvside_requests_total{op=\"%s\"} %llu\n",
			  op ? kvs_op_name((kvs_op)op) : "unknown", (unsigned long long)snap->requests[op]);
	}
	sb_printf(&b, "# HELP kvside_errors_total Error replies, by op and code (series appear at "
		      "their first error).\n# TYPE kvside_errors_total counter\n");
	for (int op = 0; op < KVS_OP_COUNT_; op++)
		for (int e = 0; e < KVS_METRICS_NE; e++)
			if (snap->errors[op][e])
				sb_printf(&b, "kvside_errors_total{op=\"%s\",code=\"%s\"} %llu\n",
					  op ? kvs_op_name((kvs_op)op) : "unknown",
					  kvs_error_name(KVS_E_BASE + e),
					  (unsigned long long)snap->errors[op][e]);
	for (size_t f = 0; f < sizeof(families) / sizeof(families[0]); f++) {
		const family *F = &families[f];
		bool header = false;
		for (int i = 0; i < 4 && F->smp[i].stat; i++) {
			const struct kvs_metrics_sample *s = find(snap, F->smp[i].stat);
			if (!s)
				continue; /* not in this build (e.g. no CUDA) */
			used[s - snap->s] = true;
			if (!header) {
				sb_printf(&b, "# HELP kvside_%s %s\n# TYPE kvside_%s %s\n", F->name, F->help,
					  F->name, F->type);
				header = true;
			}
			const char *lb = F->smp[i].labels;
			if (F->scale)
				sb_printf(&b, "kvside_%s%s%s%s %.6f\n", F->name, *lb ? "{" : "", lb,
					  *lb ? "}" : "", (double)s->value * F->scale);
			else
				sb_printf(&b, "kvside_%s%s%s%s %llu\n", F->name, *lb ? "{" : "", lb,
					  *lb ? "}" : "", (unsigned long long)s->value);
		}
	}
	/* counters without a family of their own (added to `stats` later):
	 * exported as untyped kvside_stat_<name> */
	for (uint32_t i = 0; i < snap->n; i++) {
		if (used[i] || special(snap->s[i].name))
			continue;
		char nm[64];
		size_t k = 0;
		for (const char *p = snap->s[i].name; *p && k < sizeof(nm) - 1; p++)
			nm[k++] = ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
				   (*p >= '0' && *p <= '9')) ? *p : '_';
		nm[k] = '\0';
		sb_printf(&b, "# HELP kvside_stat_%s The stats counter %s.\n# TYPE kvside_stat_%s untyped\n"
			      "kvside_stat_%s %llu\n", nm, nm, nm, nm,
			  (unsigned long long)snap->s[i].value);
	}
	if (b.oom) {
		free(b.p);
		return NULL;
	}
	return b.p;
}

/* ---- the HTTP thread ----------------------------------------------------------------- */

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, char *body,
			       const char *ctype)
{
	struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
	if (!r) {
		free(body);
		return MHD_NO;
	}
	MHD_add_response_header(r, "Content-Type", ctype);
	MHD_add_response_header(r, "Cache-Control", "no-store");
	enum MHD_Result ret = MHD_queue_response(conn, status, r);
	MHD_destroy_response(r);
	return ret;
}

static enum MHD_Result text(struct MHD_Connection *conn, unsigned status, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static enum MHD_Result text(struct MHD_Connection *conn, unsigned status, const char *fmt, ...)
{
	char *body = NULL;
	va_list ap;
	va_start(ap, fmt);
	int n = vasprintf(&body, fmt, ap);
	va_end(ap);
	if (n < 0)
		return MHD_NO;
	return respond(conn, status, body, "text/plain; charset=utf-8");
}

/* Runs on the HTTP thread: reads only m->snap (under m->mu) and m->last_ms. */
static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
			      const char *method, const char *version, const char *upload,
			      size_t *upload_size, void **req_cls)
{
	(void)version;
	(void)upload;
	kvs_metrics *m = cls;
	if (*req_cls == NULL) { /* first call: headers only; answer on the next */
		*req_cls = m;
		return MHD_YES;
	}
	if (*upload_size) /* no request bodies here */
		return MHD_NO;
	if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
		return text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET and HEAD\n");
	uint64_t now = kvs_now_ms(), last = atomic_load(&m->last_ms);
	uint64_t age = now > last ? now - last : 0;
	bool stalled = age > m->stall_ms;
	if (strcmp(url, "/healthz") == 0 || strcmp(url, "/readyz") == 0) {
		pthread_mutex_lock(&m->mu);
		bool published = m->published, draining = m->snap.draining;
		pthread_mutex_unlock(&m->mu);
		if (!published)
			return text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "starting\n");
		if (stalled)
			return text(conn, MHD_HTTP_SERVICE_UNAVAILABLE,
				    "stalled: the main loop has not ticked for %llu ms (limit %llu ms)\n",
				    (unsigned long long)age, (unsigned long long)m->stall_ms);
		if (url[1] == 'r' && draining)
			return text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "draining: new jobs are refused\n");
		return text(conn, MHD_HTTP_OK, "ok\n");
	}
	if (strcmp(url, "/metrics") == 0) {
		kvs_metrics_snap *s = malloc(sizeof(*s));
		if (!s)
			return MHD_NO;
		pthread_mutex_lock(&m->mu);
		memcpy(s, &m->snap, sizeof(*s));
		pthread_mutex_unlock(&m->mu);
		char *body = kvs_metrics_format(s, age, m->version);
		free(s);
		if (!body)
			return MHD_NO;
		return respond(conn, MHD_HTTP_OK, body, "text/plain; version=0.0.4; charset=utf-8");
	}
	if (strcmp(url, "/") == 0)
		return text(conn, MHD_HTTP_OK, "kvside-server %s: /metrics /healthz /readyz\n", m->version);
	return text(conn, MHD_HTTP_NOT_FOUND, "not found: %s (try /metrics, /healthz, /readyz)\n", url);
}

/* HTTP thread: a connection opened or closed. */
static void notify_conn(void *cls, struct MHD_Connection *conn, void **socket_context,
			enum MHD_ConnectionNotificationCode toe)
{
	(void)socket_context;
	kvs_metrics *m = cls;
	const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
	if (!ci)
		return;
	int fd = ci->connect_fd;
	pthread_mutex_lock(&m->conn_mu);
	if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
		if (m->n_conns < CONN_MAX)
			m->conns[m->n_conns++].fd = fd, m->conns[m->n_conns - 1].since_ms = kvs_now_ms();
	} else {
		for (uint32_t i = 0; i < m->n_conns; i++)
			if (m->conns[i].fd == fd) {
				m->conns[i] = m->conns[--m->n_conns];
				break;
			}
	}
	pthread_mutex_unlock(&m->conn_mu);
}

/* Loop thread: connections past their deadline are shut down (MHD then
 * reads the end of the stream and closes them). */
static void cut_slow(kvs_metrics *m, uint64_t now_ms)
{
	pthread_mutex_lock(&m->conn_mu);
	/* a connection cut leaves the table now (its CLOSED notification then
	 * finds nothing): it is shut down once */
	for (uint32_t i = 0; i < m->n_conns;)
		if (now_ms > m->conns[i].since_ms && now_ms - m->conns[i].since_ms > CONN_DEADLINE_MS) {
			shutdown(m->conns[i].fd, SHUT_RDWR);
			atomic_fetch_add(&m->conns_cut, 1);
			m->conns[i] = m->conns[--m->n_conns];
		} else {
			i++;
		}
	pthread_mutex_unlock(&m->conn_mu);
}

uint64_t kvs_metrics_conns_cut(const kvs_metrics *m) { return m ? atomic_load(&m->conns_cut) : 0; }

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
	(void)cls;
	char line[256];
	vsnprintf(line, sizeof(line), fmt, ap);
	line[strcspn(line, "\n")] = '\0';
	kvs_warn("http: %s", line);
}

/* A listening TCP socket for "HOST:PORT"; the port it got in *ret_port. */
static int listen_on(const char *spec, unsigned *ret_port)
{
	char host[128], port[8];
	unsigned p;
	if (kvs_config_hostport(spec, host, sizeof(host), &p) < 0)
		return -EINVAL;
	snprintf(port, sizeof(port), "%u", p);
	struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				 .ai_flags = AI_NUMERICSERV}, *res;
	if (getaddrinfo(host, port, &hints, &res) != 0)
		return -EINVAL;
	int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		int e = -errno;
		freeaddrinfo(res);
		return e;
	}
	int one = 1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (res->ai_family == AF_INET6)
		setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
	if (bind(fd, res->ai_addr, res->ai_addrlen) < 0 || listen(fd, 64) < 0) {
		int e = -errno;
		close(fd);
		freeaddrinfo(res);
		return e;
	}
	freeaddrinfo(res);
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	getsockname(fd, (struct sockaddr *)&ss, &sl);
	*ret_port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
						   : ((struct sockaddr_in *)&ss)->sin_port);
	return fd;
}

int kvs_metrics_start(const kvs_metrics_config *cfg, kvs_metrics **ret)
{
	kvs_metrics *m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	m->build = calloc(1, sizeof(*m->build));
	if (!m->build) {
		free(m);
		return -ENOMEM;
	}
	m->stall_ms = cfg->stall_ms ? cfg->stall_ms : 2000;
	snprintf(m->version, sizeof(m->version), "%s", cfg->version ? cfg->version : "?");
	pthread_mutex_init(&m->mu, NULL);
	pthread_mutex_init(&m->conn_mu, NULL);
	atomic_init(&m->last_ms, 0);
	int fd = listen_on(cfg->listen, &m->port);
	if (fd < 0) {
		pthread_mutex_destroy(&m->mu);
		free(m->build);
		free(m);
		return fd;
	}
	/* one polling thread; a slow or stuck client costs one connection slot
	 * for CONN_DEADLINE_MS at most (cut_slow) */
	m->daemon = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG,
				     0, NULL, NULL, handle, m, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
				     MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_LIMIT, CONN_MAX,
				     MHD_OPTION_PER_IP_CONNECTION_LIMIT, CONN_PER_IP,
				     MHD_OPTION_NOTIFY_CONNECTION, notify_conn, m,
				     MHD_OPTION_CONNECTION_TIMEOUT, 10u, MHD_OPTION_END);
	if (!m->daemon) {
		close(fd);
		pthread_mutex_destroy(&m->conn_mu);
		pthread_mutex_destroy(&m->mu);
		free(m->build);
		free(m);
		return -ENOMEM;
	}
	*ret = m;
	return 0;
}

unsigned kvs_metrics_port(const kvs_metrics *m) { return m ? m->port : 0; }

void kvs_metrics_publish(kvs_metrics *m, const kvs_metrics_snap *snap, uint64_t now_ms)
{
	pthread_mutex_lock(&m->mu);
	memcpy(&m->snap, snap, sizeof(*snap));
	m->published = true;
	pthread_mutex_unlock(&m->mu);
	atomic_store(&m->last_ms, now_ms);
	cut_slow(m, now_ms);
}

void kvs_metrics_stop(kvs_metrics *m)
{
	if (!m)
		return;
	MHD_stop_daemon(m->daemon); /* joins the thread, closes the listening socket */
	pthread_mutex_destroy(&m->conn_mu);
	pthread_mutex_destroy(&m->mu);
	free(m->build);
	free(m);
}

/* ---- server glue ------------------------------------------------------------------------ */

void kvs__metrics_init(kvs_server *srv)
{
	const char *spec = srv->cfg.metrics_listen;
	if (!spec[0]) {
		kvs_info("metrics endpoint off");
		return;
	}
	kvs_metrics_config mc = {.listen = spec, .stall_ms = srv->cfg.metrics_stall_ms,
				 .version = KVS_VERSION};
	int r = kvs_metrics_start(&mc, &srv->metrics);
	if (r < 0) {
		kvs_err("metrics endpoint %s not started: %s; serving without /metrics and /healthz", spec,
			kvs_strerror(r));
		return;
	}
	srv->metrics_port = kvs_metrics_port(srv->metrics);
	kvs_info("metrics on http://%s (port %u): /metrics /healthz /readyz", spec, srv->metrics_port);
	kvs__metrics_tick(srv); /* /healthz is green from the start */
}

static void add(kvs_metrics_snap *s, const char *name, uint64_t v)
{
	if (s->n >= KVS_METRICS_MAX_SAMPLES)
		return;
	snprintf(s->s[s->n].name, sizeof(s->s[s->n].name), "%s", name);
	s->s[s->n++].value = v;
}

void kvs__metrics_tick(kvs_server *srv)
{
	kvs_metrics *m = srv->metrics;
	if (!m)
		return;
	srv->st.metrics_conns_cut = kvs_metrics_conns_cut(m); /* for stats (which cannot call here) */
	kvs_counter c[KVS_STATS_MAX];
	char names[KVS_METRICS_NE][32];
	uint32_t n = kvs__stats_collect(srv, c, names);
	kvs_metrics_snap *s = m->build;
	s->n = 0;
	uint64_t all = 0, host = 0;
	for (uint32_t i = 0; i < n; i++) {
		char nm[48];
		kvs_str_copy(nm, sizeof(nm), c[i].name);
		add(s, nm, c[i].value);
		if (strcmp(nm, "copy_bytes") == 0)
			all = c[i].value;
		else if (strcmp(nm, "copy_bytes_host") == 0)
			host = c[i].value;
	}
	/* throughput over windows of at least a second */
	uint64_t now = srv->now_ms;
	if (!m->win_ms) {
		m->win_ms = now, m->win_all = all, m->win_host = host;
	} else if (now - m->win_ms >= 1000) {
		uint64_t dt = now - m->win_ms;
		m->bps_all = (all - m->win_all) * 1000 / dt;
		m->bps_host = (host - m->win_host) * 1000 / dt;
		m->win_ms = now, m->win_all = all, m->win_host = host;
	}
	add(s, "copy_bps_all", m->bps_all);
	add(s, "copy_bps_host", m->bps_host);
	memcpy(s->requests, srv->st.requests_by_op, sizeof(s->requests));
	memcpy(s->errors, srv->st.errors_by_op, sizeof(s->errors));
	s->draining = srv->draining;
	kvs_metrics_publish(m, s, kvs_now_ms());
}

void kvs__metrics_fini(kvs_server *srv)
{
	kvs_metrics_stop(srv->metrics);
	srv->metrics = NULL;
	srv->metrics_port = 0;
}
