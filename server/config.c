/* Settings of kvside-server: the table, the one setter both the command line
 * and the YAML file go through, the YAML reader (libyaml events: one mapping
 * of scalars) and the YAML writer behind --print-config. */
#include "config.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "copy_host.h"
#include "kvs_l2.h"
#include "kvs_l3.h"
#include "kvs_log.h"
#include "server.h"

#define F(field) offsetof(kvs_server_config, field)
#define STRF(field) F(field), sizeof(((kvs_server_config *)0)->field)
#define DAY_MS 86400000ull

static const kvs_config_key keys[] = {
	{"listen", KVS_CFG_STR, STRF(listen), 0, 0, "ENDPOINT",
	 "ZeroMQ endpoint to bind (\"\": ipc://BROKER_DIR/kvside.zmq)"},
	{"broker-dir", KVS_CFG_STR, F(broker_dir), sizeof(((kvs_server_config *)0)->broker_dir) - 16,
	 1, 0, "DIR", "private run directory of the fd broker (and of the default endpoint)"},
	{"l1-size", KVS_CFG_SIZE, F(l1_size), 0, 1ull << 20, 8ull << 40, "BYTES",
	 "DRAM tier size, suffixes K M G"},
	{"l1-size-clamp", KVS_CFG_BOOL, F(l1_size_clamp), 0, 0, 0, "BOOL",
	 "l1-size above the memory this server may use (MemAvailable, its memory cgroup's limit): take what there "
	 "is (true) or refuse to start (false)"},
	{"ttl-ms", KVS_CFG_MS, F(ttl_ms), 0, 1, DAY_MS, "MS", "session lease"},
	{"heartbeat-ms", KVS_CFG_MS, F(heartbeat_ms), 0, 1, DAY_MS, "MS",
	 "heartbeat period advised to clients (below ttl-ms)"},
	{"job-deadline-ms", KVS_CFG_MS, F(job_deadline_ms), 0, 1, DAY_MS, "MS",
	 "jobs abort after this long"},
	{"fd-park-ms", KVS_CFG_MS, F(fd_park_ms), 0, 1, DAY_MS, "MS",
	 "unclaimed broker fds close after this long"},
	{"drain-ms", KVS_CFG_MS, F(drain_ms), 0, 1, DAY_MS, "MS",
	 "unregister waits this long for leases"},
	{"copy-threads", KVS_CFG_COUNT, F(copy_threads), sizeof(uint32_t), 1, 64, "N",
	 "host copy threads"},
	{"terminal-jobs", KVS_CFG_COUNT, F(terminal_jobs), sizeof(uint32_t), 1, 1u << 24, "N",
	 "terminal job ids remembered to answer repeats"},
	{"max-sessions", KVS_CFG_COUNT, F(max_sessions), sizeof(uint32_t), 1, 1u << 20, "N",
	 "open sessions at most; a hello beyond it gets E_LIMIT"},
	{"max-peer-queue", KVS_CFG_SIZE, F(max_peer_queue), 0, 64ull << 10, 1ull << 40, "BYTES",
	 "replies waiting for one peer at most; a peer over it is cut off and its sessions closed"},
	{"max-queued", KVS_CFG_SIZE, F(max_queued), 0, 1ull << 20, 1ull << 44, "BYTES",
	 "replies waiting for all peers at most (the peer being sent to is cut off beyond it)"},
	{"insecure-tcp", KVS_CFG_BOOL, F(insecure_tcp), 0, 0, 0, "BOOL",
	 "a tcp:// listen without CURVE: anyone who reaches the port can use the cache (default: CURVE keys)"},
	{"state-dir", KVS_CFG_STR, STRF(state_dir), 1, 0, "DIR",
	 "the server's CURVE key pair for tcp:// (server.key, created at first start)"},
	{"authorized-keys", KVS_CFG_STR, STRF(authorized_keys), 0, 0, "FILE",
	 "client public keys admitted on tcp://, one z85 key per line, `admin` after it for operators "
	 "(\"\": STATE_DIR/authorized_keys)"},
	{"prefault", KVS_CFG_BOOL, F(l1_prefault), 0, 0, 0, "BOOL",
	 "fault the L1 arena in at start-up, in the background"},
	{"allow-unsealed-memory", KVS_CFG_BOOL, F(allow_unsealed), 0, 0, 0, "BOOL",
	 "accept host memfds that cannot be sealed against shrinking (a shrink fails the copy, never the server)"},
	{"allow-uid", KVS_CFG_UID, F(allow_uid), 0, 0, 0x7fffffff, "UID",
	 "also accept broker peers with this UID (none: only the server's own)"},
	{"l2-path", KVS_CFG_STR, STRF(l2_path), 0, 0, "DIR",
	 "LMDB directory of the persistent L2 tier (\"\": no L2)"},
	{"l2-size", KVS_CFG_SIZE, F(l2_size), 0, 4ull << 20, 1ull << 50, "BYTES",
	 "L2 capacity (LMDB map size), suffixes K M G"},
	{"l2-sync", KVS_CFG_SYNC, F(l2_sync), 0, 0, 0, "MODE",
	 "full: fsync every group commit; nometa: power loss may lose the last commit; none: "
	 "process crashes lose nothing committed, power loss may lose recent commits"},
	{"l2-verify", KVS_CFG_BOOL, F(l2_verify), 0, 0, 0, "BOOL",
	 "walk data.mdb's structure at start, before LMDB maps it; a damaged file is set aside (off: trust the file)"},
	{"l3-redis", KVS_CFG_STR, STRF(l3_redis), 0, 0, "HOST:PORT[,...]",
	 "seed nodes of the Redis Cluster holding the shared L3 tier (\"\": no L3)"},
	{"l3-user", KVS_CFG_STR, STRF(l3_user), 0, 0, "USER", "ACL user for the L3 cluster (\"\": the password alone)"},
	{"l3-password", KVS_CFG_STR, STRF(l3_password), 0, 0, "PASSWORD",
	 "password for the L3 cluster, sent in clear (no TLS): keep the cluster on a private network"},
	{"l3-prefix", KVS_CFG_STR, STRF(l3_prefix), 0, 0, "TEXT",
	 "prefix of kvside's keys in the L3 cluster (servers sharing a cache use the same)"},
	{"l3-write", KVS_CFG_L3WRITE, F(l3_write), 0, 0, 0, "POLICY",
	 "all: write every stored chunk behind to L3; none: read only; second-hit: at its second use"},
	{"l3-part-bytes", KVS_CFG_SIZE, F(l3_part_bytes), 0, 64ull << 10, 512ull << 20, "BYTES",
	 "largest L3 value (a power of two); larger objects are split into parts"},
	{"l3-timeout-ms", KVS_CFG_MS, F(l3_timeout_ms), 0, 1, 60000, "MS",
	 "one wait for an L3 node; one L3 call takes at most twice this"},
	{"l3-lookup-ms", KVS_CFG_MS, F(l3_lookup_ms), 0, 1, 60000, "MS",
	 "a lookup waits at most this long for L3 before answering from L1 and L2 alone"},
	{"metrics-listen", KVS_CFG_STR, STRF(metrics_listen), 0, 0, "HOST:PORT",
	 "HTTP endpoint for /metrics and /healthz (\"\" or off: disabled; port 0: any free port)"},
	{"metrics-stall-ms", KVS_CFG_MS, F(metrics_stall_ms), 0, 1, DAY_MS, "MS",
	 "/healthz fails when the main loop has not ticked for this long"},
	{"log-level", KVS_CFG_LEVEL, F(log_level), 0, 0, 0, "LEVEL", "error, warn, info, debug"},
	{"kv-events", KVS_CFG_STR, STRF(kv_events), 0, 0, "ENDPOINT",
	 "ZeroMQ PUB endpoint publishing KV events in vLLM's format (\"\": off)"},
	{"kv-events-replay", KVS_CFG_STR, STRF(kv_events_replay), 0, 0, "ENDPOINT",
	 "ZeroMQ ROUTER endpoint replaying recent KV-event batches (\"\": none)"},
	{"kv-events-topic", KVS_CFG_STR, STRF(kv_events_topic), 0, 0, "TOPIC", "topic frame of every KV-event batch"},
	{"kv-events-buffer", KVS_CFG_COUNT, F(kv_events_buffer), sizeof(uint32_t), 1, 1u << 20, "N",
	 "KV-event batches kept for replay"},
	{"kv-events-buffer-bytes", KVS_CFG_SIZE, F(kv_events_buffer_bytes), 0, 64ull << 10, 16ull << 30, "BYTES",
	 "payload bytes those batches may hold (the oldest go first)"},
	{"log-format", KVS_CFG_LOGFMT, F(log_format), 0, 0, 0, "FORMAT",
	 "text (ISO 8601 UTC time, level, module, message) or json (one object per line)"},
	{"cuda-staging", KVS_CFG_SIZE, F(cuda_staging), 0, 0, 1ull << 40, "BYTES",
	 "device memory per GPU registration for staged copies, 4 slots (0: kernel only)"},
	{"cuda-stage-min", KVS_CFG_SIZE, F(cuda_stage_min), 0, 0, 1ull << 40, "BYTES",
	 "stage a job part when its L1 runs average at least this"},
	{"copy-wave", KVS_CFG_SIZE, F(copy_wave), 0, 0, 1ull << 40, "BYTES",
	 "a long job part goes to its copy engine in waves while the rest is planned: the first this "
	 "large, each next up to 1.5x the last and 8x this (0: whole parts)"},
	{"cuda-poll-us", KVS_CFG_COUNT, F(cuda_poll_us), sizeof(uint32_t), 0, 10000000, "US",
	 "the loop polls a GPU copy's end instead of sleeping for this long after queueing it (0: host functions only)"},
	{"copy-spin-us", KVS_CFG_COUNT, F(copy_spin_us), sizeof(uint32_t), 0, KVS_COPY_SPIN_MAX_US, "US",
	 "a host copy thread polls for the next task this long before it sleeps, on machines with 8 or more "
	 "CPUs (0: never)"},
	{NULL, 0, 0, 0, 0, 0, NULL, NULL},
};

_Static_assert(sizeof(keys) / sizeof(keys[0]) <= 64, "kvs_config_load tracks at most 64 settings");

static const char *const level_names[] = {"error", "warn", "info", "debug"};
_Static_assert(KVS_LOG_ERROR == 0 && KVS_LOG_DEBUG == 3, "level_names follows enum kvs_log_level");
static const char *const logfmt_names[] = {"text", "json"};
_Static_assert(KVS_LOG_TEXT == 0 && KVS_LOG_JSON == 1, "logfmt_names follows enum kvs_log_format");
static const char *const sync_names[] = {"full", "nometa", "none"};
static const char *const l3write_names[] = {"all", "none", "second-hit"};
_Static_assert(KVS_L3_WRITE_ALL == 0 && KVS_L3_WRITE_NONE == 1 && KVS_L3_WRITE_SECOND_HIT == 2,
	       "l3write_names follows enum kvs_l3_write_policy");
_Static_assert(KVS_L2_SYNC_FULL == 0 && KVS_L2_SYNC_NOMETA == 1 && KVS_L2_SYNC_NONE == 2,
	       "sync_names follows enum kvs_l2_sync");

const kvs_config_key *kvs_config_keys(void) { return keys; }

kvs_server_config *kvs_config_new(void) { return calloc(1, sizeof(kvs_server_config)); }

const kvs_config_key *kvs_config_find(const char *name)
{
	for (const kvs_config_key *k = keys; k->name; k++) {
		size_t n = strlen(k->name);
		if (strlen(name) != n)
			continue;
		size_t i = 0;
		for (; i < n; i++) {
			char c = name[i] == '_' ? '-' : name[i];
			if (c != k->name[i])
				break;
		}
		if (i == n)
			return k;
	}
	return NULL;
}

/* Unsigned decimal, optionally with a K/M/G suffix (then "i", "iB" or "B"
 * may follow). Rejects signs, spaces, overflow and trailing text. */
static int parse_u64(const char *s, bool sizes, uint64_t *out)
{
	if (*s < '0' || *s > '9')
		return -1;
	errno = 0;
	char *end;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno)
		return -1;
	unsigned shift = 0;
	if (sizes && *end) {
		switch (*end) {
		case 'k': case 'K': shift = 10; break;
		case 'm': case 'M': shift = 20; break;
		case 'g': case 'G': shift = 30; break;
		case 't': case 'T': shift = 40; break;
		default: return -1;
		}
		end++;
		if (end[0] == 'i' && end[1] == 'B')
			end += 2;
		else if (end[0] == 'i' || end[0] == 'B')
			end++;
	}
	if (*end || (shift && v > (UINT64_MAX >> shift)))
		return -1;
	*out = (uint64_t)v << shift;
	return 0;
}

static int parse_bool(const char *s)
{
	static const char *const t[] = {"true", "yes", "on", "1"};
	static const char *const f[] = {"false", "no", "off", "0"};
	for (int i = 0; i < 4; i++) {
		if (strcasecmp(s, t[i]) == 0)
			return 1;
		if (strcasecmp(s, f[i]) == 0)
			return 0;
	}
	return -1;
}

static int index_of(const char *const *names, int n, const char *s)
{
	for (int i = 0; i < n; i++)
		if (strcmp(s, names[i]) == 0)
			return i;
	return -1;
}

static void size_text(uint64_t v, char *buf, size_t cap)
{
	static const char sfx[] = "TGMK";
	for (int i = 0; i < 4; i++) {
		unsigned shift = 40 - 10 * (unsigned)i;
		if (v && (v & ((1ull << shift) - 1)) == 0) {
			snprintf(buf, cap, "%llu%c", (unsigned long long)(v >> shift), sfx[i]);
			return;
		}
	}
	snprintf(buf, cap, "%llu", (unsigned long long)v);
}

int kvs_config_hostport(const char *s, char *host, size_t cap, unsigned *ret_port)
{
	const char *colon = strrchr(s, ':');
	const char *h = s, *he = colon;
	if (!colon || colon == s)
		return -EINVAL;
	if (*s == '[') {
		if (colon[-1] != ']' || colon - s < 3)
			return -EINVAL;
		h = s + 1, he = colon - 1;
	} else if (memchr(s, ':', (size_t)(colon - s))) {
		return -EINVAL; /* a bare IPv6 address needs brackets */
	}
	uint64_t port;
	if ((size_t)(he - h) >= cap || parse_u64(colon + 1, false, &port) || port > 65535)
		return -EINVAL;
	memcpy(host, h, (size_t)(he - h));
	host[he - h] = '\0';
	*ret_port = (unsigned)port;
	return 0;
}

#define BAD(...) (snprintf(err, cap, __VA_ARGS__), -EINVAL)

int kvs_config_set(kvs_server_config *cfg, const char *name, const char *value, char *err,
		   size_t cap)
{
	const kvs_config_key *k = kvs_config_find(name);
	if (!k) {
		snprintf(err, cap, "unknown setting '%s'", name);
		return -ENOENT;
	}
	char *field = (char *)cfg + k->off;
	uint64_t v = 0;
	switch (k->type) {
	case KVS_CFG_STR: {
		size_t n = strlen(value);
		if (n >= k->cap)
			return BAD("%s: longer than %zu bytes", k->name, k->cap - 1);
		if (k->min && n == 0)
			return BAD("%s: must not be empty", k->name);
		if (k->off == F(metrics_listen)) {
			char host[128];
			unsigned port;
			if (strcmp(value, "off") == 0)
				value = "";
			else if (*value && kvs_config_hostport(value, host, sizeof(host), &port) < 0)
				return BAD("%s: '%s' is not HOST:PORT (IPv6 as [ADDR]:PORT), \"\" or off",
					   k->name, value);
		}
		memcpy(field, value, strlen(value) + 1);
		return 0;
	}
	case KVS_CFG_SIZE:
		if (parse_u64(value, true, &v) || v < k->min || v > k->max) {
			char lo[32], hi[32];
			size_text(k->min, lo, sizeof(lo));
			size_text(k->max, hi, sizeof(hi));
			return BAD("%s: '%s' is not a size between %s and %s (suffixes K M G)", k->name,
				   value, lo, hi);
		}
		memcpy(field, &v, sizeof(v));
		return 0;
	case KVS_CFG_MS:
	case KVS_CFG_COUNT:
		if (parse_u64(value, false, &v) || v < k->min || v > k->max)
			return BAD("%s: '%s' is not an integer between %llu and %llu", k->name, value,
				   k->min, k->max);
		if (k->type == KVS_CFG_MS) {
			memcpy(field, &v, sizeof(v));
		} else {
			uint32_t w = (uint32_t)v;
			memcpy(field, &w, sizeof(w));
		}
		return 0;
	case KVS_CFG_UID: {
		long uid;
		if (!*value || strcmp(value, "none") == 0 || strcmp(value, "-1") == 0)
			uid = -1;
		else if (parse_u64(value, false, &v) == 0 && v <= k->max)
			uid = (long)v;
		else
			return BAD("%s: '%s' is not a UID (0 .. %llu) or none", k->name, value, k->max);
		memcpy(field, &uid, sizeof(uid));
		return 0;
	}
	case KVS_CFG_LEVEL: {
		int lv = index_of(level_names, 4, value);
		if (lv < 0)
			return BAD("%s: '%s' is not one of error, warn, info, debug", k->name, value);
		memcpy(field, &lv, sizeof(lv));
		return 0;
	}
	case KVS_CFG_LOGFMT: {
		int f = index_of(logfmt_names, 2, value);
		if (f < 0)
			return BAD("%s: '%s' is not one of text, json", k->name, value);
		memcpy(field, &f, sizeof(f));
		return 0;
	}
	case KVS_CFG_SYNC: {
		int m = index_of(sync_names, 3, value);
		if (m < 0)
			return BAD("%s: '%s' is not one of full, nometa, none", k->name, value);
		memcpy(field, &m, sizeof(m));
		return 0;
	}
	case KVS_CFG_L3WRITE: {
		int m = index_of(l3write_names, 3, value);
		if (m < 0)
			return BAD("%s: '%s' is not one of all, none, second-hit", k->name, value);
		memcpy(field, &m, sizeof(m));
		return 0;
	}
	case KVS_CFG_BOOL: {
		int b = parse_bool(value);
		if (b < 0)
			return BAD("%s: '%s' is not true or false", k->name, value);
		*(bool *)field = b;
		return 0;
	}
	}
	return BAD("%s: unsupported setting type", k->name);
}

int kvs_config_check(const kvs_server_config *cfg, char *err, size_t cap)
{
	if (cfg->heartbeat_ms >= cfg->ttl_ms)
		return BAD("heartbeat-ms (%llu) must be below ttl-ms (%llu)",
			   (unsigned long long)cfg->heartbeat_ms, (unsigned long long)cfg->ttl_ms);
	return 0;
}

void kvs_config_format(const kvs_server_config *cfg, const kvs_config_key *k, char *buf, size_t cap)
{
	const char *field = (const char *)cfg + k->off;
	uint64_t v;
	uint32_t w;
	int i;
	long uid;
	switch (k->type) {
	case KVS_CFG_STR:
		snprintf(buf, cap, "%s", field);
		return;
	case KVS_CFG_SIZE:
		memcpy(&v, field, sizeof(v));
		size_text(v, buf, cap);
		return;
	case KVS_CFG_MS:
		memcpy(&v, field, sizeof(v));
		snprintf(buf, cap, "%llu", (unsigned long long)v);
		return;
	case KVS_CFG_COUNT:
		memcpy(&w, field, sizeof(w));
		snprintf(buf, cap, "%u", w);
		return;
	case KVS_CFG_UID:
		memcpy(&uid, field, sizeof(uid));
		if (uid < 0)
			snprintf(buf, cap, "none");
		else
			snprintf(buf, cap, "%ld", uid);
		return;
	case KVS_CFG_LEVEL:
		memcpy(&i, field, sizeof(i));
		snprintf(buf, cap, "%s", i >= 0 && i < 4 ? level_names[i] : "info");
		return;
	case KVS_CFG_LOGFMT:
		memcpy(&i, field, sizeof(i));
		snprintf(buf, cap, "%s", i == KVS_LOG_JSON ? "json" : "text");
		return;
	case KVS_CFG_SYNC:
		memcpy(&i, field, sizeof(i));
		snprintf(buf, cap, "%s", i >= 0 && i < 3 ? sync_names[i] : "full");
		return;
	case KVS_CFG_L3WRITE:
		memcpy(&i, field, sizeof(i));
		snprintf(buf, cap, "%s", i >= 0 && i < 3 ? l3write_names[i] : "all");
		return;
	case KVS_CFG_BOOL:
		snprintf(buf, cap, "%s", *(const bool *)field ? "true" : "false");
		return;
	}
	buf[0] = '\0';
}

/* A YAML double-quoted scalar. */
static void print_quoted(FILE *f, const char *s)
{
	fputc('"', f);
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\')
			fprintf(f, "\\%c", c);
		else if (c < 0x20 || c == 0x7f)
			fprintf(f, "\\x%02x", c);
		else
			fputc(c, f);
	}
	fputc('"', f);
}

void kvs_config_print(FILE *f, const kvs_server_config *cfg)
{
	fprintf(f, "# kvside-server effective configuration\n");
	for (const kvs_config_key *k = keys; k->name; k++) {
		char buf[600];
		kvs_config_format(cfg, k, buf, sizeof(buf));
		if (strcmp(k->name, "l3-password") == 0 && buf[0]) {
			/* a secret: said to be set, never printed (the output is
			 * pasted into tickets and logs) */
			fprintf(f, "# l3-password: set, not printed\n");
			continue;
		}
		fprintf(f, "%s: ", k->name);
		if (k->type == KVS_CFG_STR)
			print_quoted(f, buf);
		else
			fputs(buf, f);
		fputc('\n', f);
	}
}

/* ---- the YAML reader --------------------------------------------------------- */

static bool is_null(const yaml_event_t *ev)
{
	if (ev->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
		return false;
	const char *v = (const char *)ev->data.scalar.value;
	return !*v || strcmp(v, "~") == 0 || strcmp(v, "null") == 0 || strcmp(v, "Null") == 0 ||
	       strcmp(v, "NULL") == 0;
}

static const char *event_what(yaml_event_type_t t)
{
	switch (t) {
	case YAML_SEQUENCE_START_EVENT: return "a list";
	case YAML_MAPPING_START_EVENT: return "a mapping";
	case YAML_ALIAS_EVENT: return "an alias";
	default: return "not a scalar";
	}
}

int kvs_config_load(kvs_server_config *cfg, const char *path, char *err, size_t cap)
{
	FILE *f = fopen(path, "r");
	if (!f) {
		int e = errno;
		snprintf(err, cap, "%s: %s", path, strerror(e));
		return -e;
	}
	yaml_parser_t p;
	if (!yaml_parser_initialize(&p)) {
		fclose(f);
		snprintf(err, cap, "%s: cannot start the YAML parser", path);
		return -ENOMEM;
	}
	yaml_parser_set_input_file(&p, f);
	/* state: 0 before the mapping, 1 expecting a key, 2 after the mapping */
	int state = 0, r = 0, docs = 0;
	bool seen[64] = {false};
	bool done = false;
	while (!done && r == 0) {
		yaml_event_t ev;
		if (!yaml_parser_parse(&p, &ev)) {
			r = -EINVAL;
			snprintf(err, cap, "%s:%zu: YAML syntax error: %s", path,
				 p.problem_mark.line + 1, p.problem ? p.problem : "unknown");
			break;
		}
		size_t line = ev.start_mark.line + 1;
		switch (ev.type) {
		case YAML_STREAM_START_EVENT:
		case YAML_DOCUMENT_END_EVENT:
			break;
		case YAML_DOCUMENT_START_EVENT:
			if (++docs > 1) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: more than one YAML document", path, line);
			}
			break;
		case YAML_STREAM_END_EVENT:
			done = true;
			break;
		case YAML_MAPPING_START_EVENT:
			if (state != 0) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: nested mapping where a setting name was expected",
					 path, line);
			}
			state = 1;
			break;
		case YAML_MAPPING_END_EVENT:
			state = 2;
			break;
		case YAML_SCALAR_EVENT: {
			if (state != 1) {
				/* an empty file is a stream without documents; a bare
				 * scalar document is not a configuration */
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: expected a mapping of setting: value", path, line);
				break;
			}
			if (memchr(ev.data.scalar.value, '\0', ev.data.scalar.length)) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: a setting's name contains a NUL character", path, line);
				break;
			}
			char name[64];
			snprintf(name, sizeof(name), "%s", (const char *)ev.data.scalar.value);
			const kvs_config_key *k = kvs_config_find(name);
			if (!k || strlen((const char *)ev.data.scalar.value) >= sizeof(name)) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: unknown setting '%s'", path, line, name);
				break;
			}
			size_t idx = (size_t)(k - keys);
			if (seen[idx]) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: %s: set twice", path, line, k->name);
				break;
			}
			seen[idx] = true;
			yaml_event_t val;
			if (!yaml_parser_parse(&p, &val)) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: YAML syntax error in the value of %s: %s", path,
					 p.problem_mark.line + 1, k->name, p.problem ? p.problem : "unknown");
				break;
			}
			line = val.start_mark.line + 1;
			if (val.type != YAML_SCALAR_EVENT) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: %s: expected a single value, got %s", path, line,
					 k->name, event_what(val.type));
			} else if (memchr(val.data.scalar.value, '\0', val.data.scalar.length)) {
				/* ("\0" in a double-quoted string): the C string would end
				 * there and the rest be silently cut */
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: %s: the value contains a NUL character", path, line,
					 k->name);
			} else if (is_null(&val) && k->type != KVS_CFG_STR && k->type != KVS_CFG_UID) {
				r = -EINVAL;
				snprintf(err, cap, "%s:%zu: %s: no value", path, line, k->name);
			} else {
				char msg[256];
				const char *text = is_null(&val) ? "" : (const char *)val.data.scalar.value;
				if (kvs_config_set(cfg, k->name, text, msg, sizeof(msg)) < 0) {
					r = -EINVAL;
					snprintf(err, cap, "%s:%zu: %s", path, line, msg);
				}
			}
			yaml_event_delete(&val);
			break;
		}
		default:
			r = -EINVAL;
			snprintf(err, cap, "%s:%zu: expected a mapping of setting: value, got %s", path,
				 line, event_what(ev.type));
			break;
		}
		yaml_event_delete(&ev);
	}
	yaml_parser_delete(&p);
	fclose(f);
	return r;
}
