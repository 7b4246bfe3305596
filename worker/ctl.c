/* kvside-ctl: the operator's command for a running kvside-server (stats,
 * lookup, jobs, drain, resume, clear, status), with --json output and exit
 * codes scripts can test. It talks to the server through libkvside like any
 * client: one short-lived session (role scheduler). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "kvs_config.h"
#include "kvs_log.h"
#include "kvs_proto.h"
#include "kvside.h"

enum { EXIT_OK = 0, EXIT_SERVER = 1, EXIT_USAGE = 2, EXIT_UNREACHABLE = 3, EXIT_DRAIN_TIMEOUT = 4 };

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: kvside-ctl [options] COMMAND [args]\n"
		"Operator commands for a running kvside-server.\n\n"
		"Commands:\n"
		"  stats                     the server's counters\n"
		"  status                    draining or not, jobs open\n"
		"  lookup KEYHEX...          leading chunks cached for these 32-byte keys (64 hex digits)\n"
		"  lookup --tokens LIST      ... for the chunk keys of a token sequence: ids separated by\n"
		"                            commas or spaces, A-B for a range (--tokens-file FILE too)\n"
		"  jobs [JOB...]             state of these jobs of --engine, or its open jobs\n"
		"  drain                     refuse new jobs, wait for open ones (--wait MS), report\n"
		"  resume                    accept new jobs again\n"
		"  clear                     drop the L1 and L2 contents (refused while jobs are open)\n\n"
		"Options:\n"
		"  --broker-dir DIR          the server's run directory (default as the server's)\n"
		"  --endpoint ENDPOINT       the server's ZeroMQ endpoint (default ipc://DIR/kvside.zmq)\n"
		"  --curve-server-key KEY    a tcp:// server's public key (Z85; first line of its server.key)\n"
		"  --curve-keys FILE         this client's CURVE key pair: public then secret key (Z85);\n"
		"                            operator commands need the key listed `admin` (authorized-keys)\n"
		"  --config FILE             take broker-dir (and an ipc listen) from the server's YAML file\n"
		"  --namespace NS            namespace for lookup keys and geometry (default kvside-ctl)\n"
		"  --engine NAME             engine whose jobs `jobs` shows (default kvside-ctl)\n"
		"  --world N                 world of the engine, for lookup (default 1)\n"
		"  --chunk-tokens N          tokens per chunk for --tokens (default 256)\n"
		"  --wait MS                 drain: how long to wait for open jobs (default 30000)\n"
		"  --timeout MS              to reach the server and for each answer (default 5000)\n"
		"  --json                    print one JSON object\n"
		"  --help, --version\n\n"
		"Exit status: 0 ok, 1 the server answered with an error, 2 usage error,\n"
		"3 server unreachable, 4 drain timed out with jobs still open.\n");
}

static bool json;

static int fail_usage(const char *fmt, const char *arg)
{
	fprintf(stderr, "kvside-ctl: ");
	fprintf(stderr, fmt, arg);
	fprintf(stderr, " (see --help)\n");
	return EXIT_USAGE;
}

static int server_error(const char *what, int r, const char *msg)
{
	if (json)
		printf("{\"ok\":false,\"code\":\"%s\",\"error\":\"%s\"}\n", kvs_error_name(r),
		       msg && *msg ? msg : kvs_strerror(r));
	fprintf(stderr, "kvside-ctl: %s: %s (%s)\n", what, msg && *msg ? msg : kvs_strerror(r),
		kvs_error_is_project(r) ? kvs_error_name(r) : "system error");
	return r == KVS_E_TIMEOUT ? EXIT_UNREACHABLE : EXIT_SERVER;
}

static void json_str(const char *s)
{
	putchar('"');
	for (; *s; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\')
			printf("\\%c", c);
		else if (c < 0x20)
			printf("\\u%04x", c);
		else
			putchar(c);
	}
	putchar('"');
}

static bool parse_u64(const char *s, uint64_t *out)
{
	char *end;
	if (*s < '0' || *s > '9')
		return false;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || *end)
		return false;
	*out = v;
	return true;
}

/* Token ids: separated by commas/whitespace; "A-B" is the range A..B. */
static int parse_tokens(const char *text, uint32_t **toks, size_t *n, size_t *cap)
{
	const char *p = text;
	while (*p) {
		if (*p == ',' || *p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') {
			p++;
			continue;
		}
		char *end;
		errno = 0;
		unsigned long a = strtoul(p, &end, 10), b;
		if (end == p || errno || a > UINT32_MAX)
			return -1;
		b = a;
		if (*end == '-') {
			p = end + 1;
			b = strtoul(p, &end, 10);
			if (end == p || errno || b > UINT32_MAX || b < a || b - a > (1ul << 26))
				return -1;
		}
		for (unsigned long t = a; t <= b; t++) {
			if (*n == *cap) {
				size_t nc = *cap ? 2 * *cap : 4096;
				uint32_t *q = realloc(*toks, nc * sizeof(*q));
				if (!q)
					return -1;
				*toks = q;
				*cap = nc;
			}
			(*toks)[(*n)++] = (uint32_t)t;
		}
		p = end;
		if (*p && *p != ',' && *p != ' ' && *p != '\n' && *p != '\t' && *p != '\r')
			return -1;
	}
	return 0;
}

static bool parse_hex_key(const char *s, uint8_t out[KVS_KEY_LEN])
{
	if (strlen(s) != 2 * KVS_KEY_LEN)
		return false;
	for (int i = 0; i < KVS_KEY_LEN; i++) {
		unsigned v;
		char h[3] = {s[2 * i], s[2 * i + 1], 0};
		char *end;
		v = (unsigned)strtoul(h, &end, 16);
		if (*end)
			return false;
		out[i] = (uint8_t)v;
	}
	return true;
}

static int cmd_stats(kvs_client *c, int timeout)
{
	static kvs_stat_out st[KVS_MAX_COUNTERS];
	uint32_t n = 0;
	int r = kvs_stats(c, timeout, st, KVS_MAX_COUNTERS, &n);
	if (r)
		return server_error("stats", r, NULL);
	if (json) {
		printf("{\"ok\":true,\"counters\":{");
		for (uint32_t i = 0; i < n; i++) {
			printf(i ? "," : "");
			json_str(st[i].name);
			printf(":%" PRIu64, st[i].value);
		}
		printf("}}\n");
	} else {
		for (uint32_t i = 0; i < n; i++)
			printf("%-32s %" PRIu64 "\n", st[i].name, st[i].value);
	}
	return EXIT_OK;
}

static void print_admin(const kvs_admin_info *a)
{
	if (json) {
		printf("{\"ok\":true,\"cmd\":\"%s\",\"draining\":%s,\"jobs_open\":%" PRIu64,
		       kvs_admin_cmd_name(a->cmd), a->draining ? "true" : "false", a->jobs_open);
		if (a->cmd == KVS_ADMIN_DRAIN)
			printf(",\"drained\":%s,\"waited_ms\":%" PRIu64, a->drained ? "true" : "false",
			       a->waited_ms);
		if (a->cmd == KVS_ADMIN_CLEAR)
			printf(",\"cleared_l1\":%" PRIu64 ",\"cleared_l2\":%" PRIu64 ",\"kept_l1\":%" PRIu64,
			       a->cleared_l1, a->cleared_l2, a->kept_l1);
		printf("}\n");
		return;
	}
	switch (a->cmd) {
	case KVS_ADMIN_DRAIN:
		if (a->drained)
			printf("drained: no job open after %" PRIu64 " ms; new jobs are refused until "
			       "`kvside-ctl resume`\n", a->waited_ms);
		else
			printf("drain timed out after %" PRIu64 " ms: %" PRIu64 " jobs still open; new jobs "
			       "stay refused\n", a->waited_ms, a->jobs_open);
		break;
	case KVS_ADMIN_CLEAR:
		printf("cleared: %" PRIu64 " L1 objects (%" PRIu64 " pinned ones kept), %" PRIu64
		       " L2 objects\n", a->cleared_l1, a->kept_l1, a->cleared_l2);
		break;
	case KVS_ADMIN_RESUME:
		printf("resumed: accepting new jobs (%" PRIu64 " open)\n", a->jobs_open);
		break;
	default:
		printf("%s, %" PRIu64 " jobs open\n", a->draining ? "draining (new jobs refused)" : "serving",
		       a->jobs_open);
	}
}

static int cmd_admin(kvs_client *c, int cmd, uint32_t wait_ms, int timeout)
{
	kvs_admin_info a;
	/* the server answers a drain by wait_ms at the latest */
	int r = kvs_admin(c, cmd, wait_ms, cmd == KVS_ADMIN_DRAIN ? (int)wait_ms + timeout : timeout, &a);
	if (r)
		return server_error(kvs_admin_cmd_name(cmd), r, a.msg);
	print_admin(&a);
	if (cmd == KVS_ADMIN_DRAIN && !a.drained)
		return EXIT_DRAIN_TIMEOUT;
	return EXIT_OK;
}

static int cmd_jobs(kvs_client *c, char **ids, int n_ids, int timeout)
{
	uint64_t jobs[KVS_MAX_JOBS_QUERY];
	if (n_ids > KVS_MAX_JOBS_QUERY)
		return fail_usage("%s", "too many job ids");
	for (int i = 0; i < n_ids; i++)
		if (!parse_u64(ids[i], &jobs[i]))
			return fail_usage("'%s' is not a job id", ids[i]);
	static kvs_job_info_out out[KVS_MAX_JOBS_QUERY];
	uint32_t n = 0;
	int r = kvs_job_status(c, jobs, (uint32_t)n_ids, timeout, out, KVS_MAX_JOBS_QUERY, &n);
	if (r)
		return server_error("jobs", r, NULL);
	kvs_admin_info a = {0};
	r = kvs_admin(c, KVS_ADMIN_STATUS, 0, timeout, &a);
	if (r)
		return server_error("status", r, a.msg);
	if (json) {
		printf("{\"ok\":true,\"jobs_open\":%" PRIu64 ",\"draining\":%s,\"jobs\":[", a.jobs_open,
		       a.draining ? "true" : "false");
		for (uint32_t i = 0; i < n; i++) {
			printf("%s{\"job\":%" PRIu64 ",\"state\":\"%s\",\"ranks_done\":%u,\"reason\":",
			       i ? "," : "", out[i].job, kvs_state_name(out[i].state), out[i].ranks_done);
			json_str(out[i].reason);
			printf("}");
		}
		printf("]}\n");
	} else {
		printf("%" PRIu64 " jobs open on the server (all engines)%s\n", a.jobs_open,
		       a.draining ? "; draining" : "");
		for (uint32_t i = 0; i < n; i++)
			printf("job %-20" PRIu64 " %-9s ranks done %-4u %s\n", out[i].job,
			       kvs_state_name(out[i].state), out[i].ranks_done, out[i].reason);
	}
	return EXIT_OK;
}

static int cmd_lookup(kvs_client *c, const uint8_t *keys, uint32_t n, int timeout)
{
	uint64_t hits = 0;
	uint8_t *tiers = calloc(n ? n : 1, 1);
	if (!tiers)
		return EXIT_SERVER;
	int r = kvs_lookup(c, keys, n, false, 0, timeout, &hits, tiers);
	if (r) {
		free(tiers);
		return server_error("lookup", r, NULL);
	}
	if (json) {
		printf("{\"ok\":true,\"keys\":%u,\"hits\":%" PRIu64 ",\"tiers\":[", n, hits);
		for (uint64_t i = 0; i < hits; i++)
			printf("%s\"%s\"", i ? "," : "", kvs_tier_name(tiers[i]));
		printf("],\"key_hex\":[");
		for (uint32_t i = 0; i < n; i++) {
			printf("%s\"", i ? "," : "");
			for (int b = 0; b < KVS_KEY_LEN; b++)
				printf("%02x", keys[(size_t)i * KVS_KEY_LEN + b]);
			printf("\"");
		}
		printf("]}\n");
	} else {
		printf("%" PRIu64 " of %u leading chunks cached", hits, n);
		if (hits) {
			uint64_t l2 = 0, l3 = 0;
			for (uint64_t i = 0; i < hits; i++) {
				l2 += tiers[i] == KVS_TIER_L2;
				l3 += tiers[i] == KVS_TIER_L3;
			}
			printf(" (%" PRIu64 " in L1, %" PRIu64 " only in L2", hits - l2 - l3, l2);
			if (l3)
				printf(", %" PRIu64 " in L3", l3);
			printf(")");
		}
		printf("\n");
	}
	free(tiers);
	return EXIT_OK;
}

static char *read_file(const char *path)
{
	FILE *f = fopen(path, "r");
	if (!f)
		return NULL;
	size_t cap = 1 << 16, n = 0;
	char *b = malloc(cap);
	size_t k;
	while (b && (k = fread(b + n, 1, cap - n - 1, f)) > 0) {
		n += k;
		if (n + 1 == cap) {
			char *q = realloc(b, cap *= 2);
			if (!q) {
				free(b);
				b = NULL;
			}
			b = q;
		}
	}
	fclose(f);
	if (b)
		b[n] = '\0';
	return b;
}

/* The command line, once parsed. */
typedef struct ctl_opts {
	const char *broker, *endpoint, *ns, *engine;
	const char *tokens_arg, *tokens_file;
	const char *curve_server_key;      /* --curve-server-key */
	char curve_pub[64], curve_sec[64]; /* --curve-keys FILE: "public secret", Z85 */
	uint64_t world, chunk, wait_ms, timeout;
	char cfg_broker[600], cfg_listen[600]; /* from --config */
} ctl_opts;

/* --config FILE: broker-dir and listen from the server's YAML file, unless
 * --broker-dir / --endpoint came first. */
static int read_server_config(const char *path, ctl_opts *o)
{
	char err[512];
	kvs_server_config *sc = kvs_config_new();
	if (!sc || kvs_config_load(sc, path, err, sizeof(err)) < 0) {
		fprintf(stderr, "kvside-ctl: %s\n", sc ? err : "out of memory");
		free(sc);
		return EXIT_USAGE;
	}
	kvs_config_format(sc, kvs_config_find("broker-dir"), o->cfg_broker, sizeof(o->cfg_broker));
	kvs_config_format(sc, kvs_config_find("listen"), o->cfg_listen, sizeof(o->cfg_listen));
	free(sc);
	if (o->cfg_broker[0] && !o->broker)
		o->broker = o->cfg_broker;
	/* a tcp:// listen is bound beside the ipc endpoint: locally, ipc */
	if (o->cfg_listen[0] && !o->endpoint && strncmp(o->cfg_listen, "tcp://", 6) != 0)
		o->endpoint = o->cfg_listen;
	return -1;
}

/* Fills *o from the options (optind is left at the command).
 * @return -1 to go on, or the exit status (--help, --version, usage errors). */
static int parse_options(int argc, char **argv, ctl_opts *o)
{
	enum { O_BROKER = 1, O_ENDPOINT, O_CONFIG, O_NS, O_ENGINE, O_WORLD, O_CHUNK, O_WAIT, O_TIMEOUT,
	       O_JSON, O_TOKENS, O_TOKFILE, O_HELP, O_VERSION, O_CURVE_SERVER, O_CURVE_KEYS };
	static const struct option opts[] = {
		{"broker-dir", required_argument, NULL, O_BROKER},
		{"endpoint", required_argument, NULL, O_ENDPOINT},
		{"curve-server-key", required_argument, NULL, O_CURVE_SERVER},
		{"curve-keys", required_argument, NULL, O_CURVE_KEYS},
		{"config", required_argument, NULL, O_CONFIG},
		{"namespace", required_argument, NULL, O_NS},
		{"engine", required_argument, NULL, O_ENGINE},
		{"world", required_argument, NULL, O_WORLD},
		{"chunk-tokens", required_argument, NULL, O_CHUNK},
		{"wait", required_argument, NULL, O_WAIT},
		{"timeout", required_argument, NULL, O_TIMEOUT},
		{"json", no_argument, NULL, O_JSON},
		{"tokens", required_argument, NULL, O_TOKENS},
		{"tokens-file", required_argument, NULL, O_TOKFILE},
		{"help", no_argument, NULL, O_HELP},
		{"version", no_argument, NULL, O_VERSION},
		{NULL, 0, NULL, 0},
	};
	int c, r;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case O_BROKER: o->broker = optarg; break;
		case O_ENDPOINT: o->endpoint = optarg; break;
		case O_CURVE_SERVER: o->curve_server_key = optarg; break;
		case O_CURVE_KEYS: {
			FILE *f = fopen(optarg, "r");
			int ok = f && fscanf(f, "%63s %63s", o->curve_pub, o->curve_sec) == 2;
			if (f)
				fclose(f);
			if (!ok)
				return fail_usage("--curve-keys: '%s' does not hold a public and a secret key (Z85)", optarg);
			break;
		}
		case O_CONFIG:
			if ((r = read_server_config(optarg, o)) >= 0)
				return r;
			break;
		case O_NS: o->ns = optarg; break;
		case O_ENGINE: o->engine = optarg; break;
		case O_WORLD:
			if (!parse_u64(optarg, &o->world) || o->world == 0 || o->world > 65536)
				return fail_usage("--world: '%s' is not 1 .. 65536", optarg);
			break;
		case O_CHUNK:
			if (!parse_u64(optarg, &o->chunk) || o->chunk == 0 || o->chunk > (1u << 20))
				return fail_usage("--chunk-tokens: '%s' is not a positive count", optarg);
			break;
		case O_WAIT:
			if (!parse_u64(optarg, &o->wait_ms) || o->wait_ms > 3600000)
				return fail_usage("--wait: '%s' is not 0 .. 3600000 ms", optarg);
			break;
		case O_TIMEOUT:
			if (!parse_u64(optarg, &o->timeout) || o->timeout == 0 || o->timeout > 3600000)
				return fail_usage("--timeout: '%s' is not 1 .. 3600000 ms", optarg);
			break;
		case O_JSON: json = true; break;
		case O_TOKENS: o->tokens_arg = optarg; break;
		case O_TOKFILE: o->tokens_file = optarg; break;
		case O_HELP: usage(stdout); return EXIT_OK;
		case O_VERSION: printf("kvside-ctl %s (protocol v%d)\n", KVS_VERSION, KVS_PROTO_VERSION); return EXIT_OK;
		default: usage(stderr); return EXIT_USAGE;
		}
	}
	return -1;
}

/* The keys of `lookup`: the chunk keys of --tokens / --tokens-file, or the
 * hex keys given as arguments. Computed before connecting: a usage error
 * never waits for the server.
 * @return -1 and *ret_keys (the caller frees) / *ret_n set, or the exit status. */
static int lookup_keys(const ctl_opts *o, char **rest, int n_rest, uint8_t **ret_keys, uint32_t *ret_n)
{
	uint8_t *keys;
	if (!o->tokens_arg && !o->tokens_file) {
		if (n_rest == 0)
			return fail_usage("%s", "lookup needs keys (hex) or --tokens");
		if (n_rest > KVS_MAX_KEYS)
			return fail_usage("%s", "too many keys");
		keys = malloc((size_t)n_rest * KVS_KEY_LEN);
		if (!keys)
			return EXIT_SERVER;
		for (int i = 0; i < n_rest; i++)
			if (!parse_hex_key(rest[i], keys + (size_t)i * KVS_KEY_LEN)) {
				free(keys);
				return fail_usage("'%s' is not a 64-digit hex key", rest[i]);
			}
		*ret_keys = keys;
		*ret_n = (uint32_t)n_rest;
		return -1;
	}
	uint32_t *toks = NULL;
	size_t nt = 0, capt = 0;
	if (o->tokens_arg && parse_tokens(o->tokens_arg, &toks, &nt, &capt) < 0) {
		free(toks);
		return fail_usage("--tokens: cannot read '%s'", o->tokens_arg);
	}
	if (o->tokens_file) {
		char *text = read_file(o->tokens_file);
		int bad = !text || parse_tokens(text, &toks, &nt, &capt) < 0;
		free(text);
		if (bad) {
			free(toks);
			return fail_usage("--tokens-file: cannot read '%s'", o->tokens_file);
		}
	}
	if (n_rest) {
		free(toks);
		return fail_usage("%s", "give keys or tokens, not both");
	}
	size_t max = nt / o->chunk;
	if (max == 0) {
		free(toks);
		return fail_usage("%s", "fewer tokens than one chunk (--chunk-tokens)");
	}
	if (max > KVS_MAX_KEYS)
		max = KVS_MAX_KEYS;
	keys = malloc(max * KVS_KEY_LEN);
	long k = keys ? kvs_keys_for_tokens(o->ns, toks, nt, (uint32_t)o->chunk, keys, max) : -ENOMEM;
	free(toks);
	if (k < 0) {
		free(keys);
		return fail_usage("%s", "cannot compute chunk keys");
	}
	*ret_keys = keys;
	*ret_n = (uint32_t)k;
	return -1;
}

int main(int argc, char **argv)
{
	ctl_opts o = {.ns = "kvside-ctl", .engine = "kvside-ctl", .world = 1, .chunk = 256, .wait_ms = 30000,
		      .timeout = 5000};
	int rc = parse_options(argc, argv, &o);
	if (rc >= 0)
		return rc;
	if (optind >= argc)
		return fail_usage("%s", "no command given");
	const char *cmd = argv[optind++];
	char **rest = argv + optind;
	int n_rest = argc - optind;
	int admin = kvs_admin_cmd_from_name(cmd);
	bool is_lookup = strcmp(cmd, "lookup") == 0, is_jobs = strcmp(cmd, "jobs") == 0;
	if (admin < 0 && !is_lookup && !is_jobs && strcmp(cmd, "stats") != 0)
		return fail_usage("unknown command '%s'", cmd);
	if (!is_lookup && !is_jobs && n_rest)
		return fail_usage("unexpected argument '%s'", rest[0]);
	if ((o.tokens_arg || o.tokens_file) && !is_lookup)
		return fail_usage("%s", "--tokens and --tokens-file are for lookup");
	uint8_t *keys = NULL;
	uint32_t n_keys = 0;
	if (is_lookup && (rc = lookup_keys(&o, rest, n_rest, &keys, &n_keys)) >= 0)
		return rc;

	kvs_log_set_level(KVS_LOG_ERROR);
	kvs_client_config cfg = {.endpoint = o.endpoint, .broker_dir = o.broker, .engine = o.engine, .ns = o.ns,
				 .role = KVS_ROLE_SCHEDULER, .rank = 0, .world = (uint32_t)o.world,
				 .timeout_ms = (int)o.timeout};
	if (o.curve_server_key || o.curve_pub[0]) {
		if (!o.curve_server_key || !o.curve_pub[0])
			return fail_usage("%s", "--curve-server-key and --curve-keys go together");
		cfg.curve_server_key = o.curve_server_key;
		cfg.curve_public_key = o.curve_pub;
		cfg.curve_secret_key = o.curve_sec;
	}
	kvs_client *cl = NULL;
	int r = kvs_client_open(&cfg, &cl);
	if (r) {
		free(keys);
		if (json)
			printf("{\"ok\":false,\"code\":\"%s\",\"error\":\"server unreachable\"}\n",
			       kvs_error_name(r)); /* the cause in words goes to stderr */
		const char *why = kvs_last_error();
		fprintf(stderr, "kvside-ctl: cannot reach kvside-server at %s: %s\n",
			o.endpoint ? o.endpoint : (o.broker ? o.broker : "its default run directory"),
			why[0] ? why : kvs_strerror(r));
		return r == KVS_E_TIMEOUT || r == -EINVAL || r == -ENOENT || r == -EACCES || r == -ECONNREFUSED
			       ? EXIT_UNREACHABLE : EXIT_SERVER;
	}
	if (is_lookup)
		rc = cmd_lookup(cl, keys, n_keys, (int)o.timeout);
	else if (is_jobs)
		rc = cmd_jobs(cl, rest, n_rest, (int)o.timeout);
	else if (admin >= 0)
		rc = cmd_admin(cl, admin, (uint32_t)o.wait_ms, (int)o.timeout);
	else
		rc = cmd_stats(cl, (int)o.timeout);
	free(keys);
	kvs_client_close(cl);
	return rc;
}
