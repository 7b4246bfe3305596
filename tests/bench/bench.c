/* kvside-bench: drives a real kvside-server through libkvside with real rank
 * processes and reports each figure next to a baseline measured in the same
 * run. Usage: kvside-bench MODE... [options]; see usage(). */
#include "bench.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct res {
	char name[96];
	double value, baseline;
	char unit[16], target[48];
} res;

static res results[256];
static int n_results;
static char notes[32][256];
static int n_notes;

double kvb_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void kvb_result(const char *name, double value, const char *unit, double baseline, const char *target)
{
	if (n_results >= 256)
		return;
	res *r = &results[n_results++];
	snprintf(r->name, sizeof(r->name), "%s", name);
	snprintf(r->unit, sizeof(r->unit), "%s", unit);
	snprintf(r->target, sizeof(r->target), "%s", target ? target : "");
	r->value = value;
	r->baseline = baseline;
	fprintf(stderr, "  %-52s %12.3f %s\n", name, value, unit);
}

void kvb_note(const char *fmt, ...)
{
	if (n_notes >= 32)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(notes[n_notes++], sizeof(notes[0]), fmt, ap);
	va_end(ap);
	fprintf(stderr, "  note: %s\n", notes[n_notes - 1]);
}

void kvb_print(const kvb_opts *o)
{
	if (o->json) {
		printf("[\n");
		for (int i = 0; i < n_results; i++) {
			res *r = &results[i];
			printf("  {\"name\": \"%s\", \"value\": %.6g, \"unit\": \"%s\", ", r->name, r->value, r->unit);
			if (r->baseline > 0)
				printf("\"baseline\": %.6g, \"ratio\": %.4f, ", r->baseline, r->value / r->baseline);
			else
				printf("\"baseline\": null, \"ratio\": null, ");
			printf("\"target\": %s%s%s}%s\n", r->target[0] ? "\"" : "", r->target[0] ? r->target : "null",
			       r->target[0] ? "\"" : "", i + 1 < n_results ? "," : "");
		}
		printf("]\n");
		return;
	}
	printf("| result | value | baseline (same run) | ratio | target |\n|---|---:|---:|---:|---|\n");
	for (int i = 0; i < n_results; i++) {
		res *r = &results[i];
		char b[48] = "-", ra[24] = "-";
		if (r->baseline > 0) {
			snprintf(b, sizeof(b), "%.3f %s", r->baseline, r->unit);
			snprintf(ra, sizeof(ra), "%.2f", r->value / r->baseline);
		}
		printf("| %s | %.3f %s | %s | %s | %s |\n", r->name, r->value, r->unit, b, ra,
		       r->target[0] ? r->target : "-");
	}
	for (int i = 0; i < n_notes; i++)
		printf("\n- %s", notes[i]);
	if (n_notes)
		printf("\n");
}

double kvb_pct(double *v, uint32_t n, double p)
{
	if (!n)
		return 0;
	for (uint32_t i = 1; i < n; i++) /* small n: insertion sort */
		for (uint32_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
			double t = v[j];
			v[j] = v[j - 1];
			v[j - 1] = t;
		}
	uint32_t k = (uint32_t)ceil(p * n) - 1;
	return v[k < n ? k : n - 1];
}

void kvb_key(uint64_t a, uint64_t b, uint8_t out[32])
{
	uint64_t in[2] = {a, b};
	crypto_generichash(out, 32, (const uint8_t *)in, sizeof(in), NULL, 0);
}

int kvb_server_start(const kvb_opts *o, kvt_server *s, ...)
{
	char *extra[KVT_MAX_EXTRA + 1];
	int n = 0;
	va_list ap;
	va_start(ap, s);
	char *a;
	while ((a = va_arg(ap, char *)) != NULL && n < KVT_MAX_EXTRA)
		extra[n++] = a;
	va_end(ap);
	extra[n] = NULL;
	if (kvt_server_init_in(s, o->dir, extra) != 0)
		return -1;
	s->exe = o->server;
	s->log_level = "error";
	s->ns = "bench-model";
	s->timeout_ms = 30000;
	if (kvt_server_start(s) != 0)
		return -1;
	/* measure a warm server: let the L1 arena fault in first, or, with a
	 * GPU, be pinned (which faults it in; the server skips the prefault) */
	kvs_client *c = kvt_client(s, "probe", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	for (int k = 0; c && k < 3000; k++) {
		uint64_t cap = kvb_stat(c, "l1_capacity"), pf = kvb_stat(c, "l1_prefaulted_bytes");
		if (pf == UINT64_MAX)
			break;
		bool faulted = pf >= cap || kvb_stat(c, "l1_prefault_active") == 0;
		bool pinned = kvb_stat(c, "cuda_starting") == 0 &&
			      (kvb_stat(c, "cuda_available") == 0 || kvb_stat(c, "cuda_pinned_bytes") >= cap);
		if (faulted && pinned)
			break;
		usleep(10000);
	}
	kvs_client_close(c);
	return 0;
}

long kvb_server_rss_kib(const kvt_server *s)
{
	char p[64], line[256];
	snprintf(p, sizeof(p), "/proc/%d/status", (int)s->pid);
	FILE *f = fopen(p, "r");
	long kib = -1;
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
			break;
	if (f)
		fclose(f);
	return kib;
}

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: kvside-bench MODE... [options]\n"
		"Modes: copy control l2 writebehind trace restart memory gpu l3 all   (gpu: the cuda engine; reports no GPU\n"
		"       cleanly; l3: two servers sharing a Redis Cluster tier, beside raw hiredis, and the trace over both)\n"
		"       trace-lru (not in all): the trace at L1 = 25/50/100 %% of its footprint beside LRU\n"
		"       startup (not in all): 4 ranks register CUDA memory 1 s after a start with a large L1\n"
		"       (needs up to 96 GiB of RAM; reports no GPU cleanly)\n"
		"  --server PATH     kvside-server binary (default: $KVS_SERVER or build/server/kvside-server)\n"
		"  --trace FILE      Mooncake-format trace (default ../shared/data/synthetic_trace.jsonl)\n"
		"  --trace-requests N  replay only the first N requests\n"
		"  --expect-bound    trace: exit 1 unless the hit ratio equals the infinite-cache bound;\n"
		"                    trace-lru: exit 1 if a hit ratio is below LRU's\n"
		"  --dir DIR         work directory on the disk to measure (default /tmp)\n"
		"  --ranks N         rank processes (default 4)\n"
		"  --l1-size BYTES   --l2-size BYTES\n"
		"  --quick           smoke sizes (seconds)\n"
		"  --inflight N      copy: jobs in flight per rank (default 1; gpu adds a 4-rank x 2 row)\n"
		"  --spread          gpu: rank r on GPU r %% devices, --ranks ranks only, per-GPU ceilings\n"
		"  --gpu-cfg LIST    gpu: ranks x jobs in flight to run, e.g. 1x1,4x1 (default 1x1,1x2,4x1,4x2)\n"
		"  --gpu-blocks LIST gpu: block sizes in KiB (default 4,16,64,256,2048)\n"
		"  --gpu-ranks       writebehind: the ranks' KV cache in GPU memory (needs CUDA) instead of host memory\n"
		"  --json            one JSON object per result\n"
		"  --l3-redis SEEDS  l3: an existing cluster (default: start one with tests/l3/redis_cluster.py,\n"
		"                    $KVS_RCLUSTER_HELPER)\n"
		"  --l3-masters N    l3: masters of the cluster it starts, 1 (default) or 3\n"
		"  --l3-lookup-ms MS l3: the servers' l3-lookup-ms (default 100)\n"
		"  --sizes LIST      startup: L1 sizes in GiB (default 8,32,96)\n"
		"  --check           startup: exit 1 unless every register took <= 100 ms, no request waited\n"
		"                    > 1 s and no session was lost\n");
}

int main(int argc, char **argv)
{
	kvb_opts o = {.ranks = 4, .dir = "/tmp", .l1_size = 0, .l2_size = 0};
	o.server = getenv("KVS_SERVER") ? getenv("KVS_SERVER") : "build/server/kvside-server";
	o.trace = "../shared/data/synthetic_trace.jsonl";
	static const struct option lo[] = {
		{"server", 1, NULL, 's'}, {"trace", 1, NULL, 't'}, {"dir", 1, NULL, 'd'},
		{"ranks", 1, NULL, 'r'}, {"quick", 0, NULL, 'q'}, {"json", 0, NULL, 'j'},
		{"l1-size", 1, NULL, '1'}, {"l2-size", 1, NULL, '2'}, {"trace-requests", 1, NULL, 'n'},
		{"expect-bound", 0, NULL, 'b'}, {"inflight", 1, NULL, 'i'}, {"spread", 0, NULL, 'S'}, {"help", 0, NULL, 'h'},
		{"l3-redis", 1, NULL, 'R'}, {"l3-masters", 1, NULL, 'M'}, {"l3-lookup-ms", 1, NULL, 'L'},
		{"sizes", 1, NULL, 'z'}, {"check", 0, NULL, 'c'}, {"gpu-ranks", 0, NULL, 'G'}, {"gpu-cfg", 1, NULL, 'g'}, {"gpu-blocks", 1, NULL, 'B'}, {NULL, 0, NULL, 0}};
	int c;
	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case 's': o.server = optarg; break;
		case 't': o.trace = optarg; break;
		case 'd': o.dir = optarg; break;
		case 'r': o.ranks = (uint32_t)atoi(optarg); break;
		case 'q': o.quick = true; break;
		case 'j': o.json = true; break;
		case '1': o.l1_size = strtoull(optarg, NULL, 10); break;
		case '2': o.l2_size = strtoull(optarg, NULL, 10); break;
		case 'n': o.trace_requests = (uint32_t)atoi(optarg); break;
		case 'b': o.expect_bound = true; break;
		case 'i': o.inflight = (uint32_t)atoi(optarg); break;
		case 'S': o.spread = true; break;
		case 'R': o.l3_redis = optarg; break;
		case 'M': o.l3_masters = (uint32_t)atoi(optarg); break;
		case 'L': o.l3_lookup_ms = optarg; break;
		case 'z': o.sizes = optarg; break;
		case 'c': o.check = true; break;
		case 'G': o.gpu_ranks = true; break;
		case 'g': o.gpu_cfg = optarg; break;
		case 'B': o.gpu_blocks = optarg; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (optind >= argc || o.ranks < 1 || o.ranks > 64) {
		usage(stderr);
		return 2;
	}
	if (sodium_init() < 0)
		return 1;
	signal(SIGPIPE, SIG_IGN);
	int rc = 0;
	for (int i = optind; i < argc; i++) {
		const char *m = argv[i];
		bool all = strcmp(m, "all") == 0;
		int r = 0;
		fprintf(stderr, "== %s\n", m);
		if (all || strcmp(m, "copy") == 0)
			r |= kvb_mode_copy(&o);
		if (all || strcmp(m, "control") == 0)
			r |= kvb_mode_control(&o);
		if (all || strcmp(m, "l2") == 0)
			r |= kvb_mode_l2(&o);
		if (all || strcmp(m, "writebehind") == 0)
			r |= kvb_mode_writebehind(&o);
		if (all || strcmp(m, "trace") == 0)
			r |= kvb_mode_trace(&o);
		if (strcmp(m, "trace-lru") == 0) /* three replays of the trace: asked for by name only */
			r |= kvb_mode_trace_lru(&o);
		if (all || strcmp(m, "restart") == 0)
			r |= kvb_mode_restart(&o);
		if (all || strcmp(m, "memory") == 0)
			r |= kvb_mode_memory(&o);
		if (all || strcmp(m, "gpu") == 0)
			r |= kvb_mode_gpu(&o);
		if (all || strcmp(m, "l3") == 0) {
			int r3 = kvb_mode_l3(&o);
			if (r3 == 77 && !all && optind + 1 == argc) {
				kvb_print(&o);
				return 77; /* the meson skip code: nothing to run here */
			}
			r |= r3 == 77 ? 0 : r3;
		}
		if (strcmp(m, "startup") == 0)
			r |= kvb_mode_startup(&o);
		if (!all && !strstr(" copy control l2 writebehind trace trace-lru restart memory gpu l3 startup ", m)) {
			fprintf(stderr, "unknown mode %s\n", m);
			return 2;
		}
		rc |= r;
	}
	kvb_print(&o);
	return rc ? 1 : 0;
}
