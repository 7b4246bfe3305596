/* kvside-bench startup (issue 18): what ranks see in the first seconds of a
 * server with a large L1. For each L1 size: the server starts, 1 s later
 * `--ranks` rank processes (their KV memory already allocated on the GPU)
 * open sessions and register CUDA memory at once, then store jobs of one
 * 32 MiB chunk per rank back to back until 6 s after the start. A probe
 * client asks for a counter every 20 ms throughout: its largest round trip
 * is the longest the main loop left requests (heartbeats among them)
 * unanswered. Rows per size: the slowest register, the largest probe round
 * trip, sessions lost, the first store job against the median of the later
 * ones, when jobs first reach 0.9 of the steady speed for good, and when L1
 * was pinned. With --check the mode fails unless register <= 100 ms, round
 * trip <= 1 s and no session was lost (the GPU suite's no-stall test). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#if KVS_HAVE_CUDA
#include "kvs_cuda.h"
#endif

#if KVS_HAVE_CUDA
#define SU_JOBS 1536 /* about 4 s of jobs at 50 GB/s: past the 2 s mark */
#define SU_LAYERS 8
#define SU_BPC 16
#define SU_NB 64
#define SU_BLOCK (256u << 10)
#define SU_WIN 0.1 /* s: the throughput windows */

typedef struct su_cmd {
	double t_go, t_end; /* kvb_now() clock, shared by the processes */
	uint64_t run;
	uint32_t world;
} su_cmd;

typedef struct su_out {
	int rc, stage;          /* stage: 1 alloc, 2 hello, 3 register, 4 job */
	double t_reg0, t_reg1;  /* register sent, answered */
	uint32_t n_jobs;
	double j0[SU_JOBS], j1[SU_JOBS];
} su_out;

typedef struct su_arg {
	const kvt_server *s;
	uint32_t rank;
} su_arg;

static void su_child(void *arg, int cmd_fd, int res_fd)
{
	const su_arg *a = arg;
	static su_out out;
	memset(&out, 0, sizeof(out));
	uint64_t size = (uint64_t)SU_LAYERS * SU_NB * SU_BLOCK;
	kvs_alloc al = {.fd = -1, .size = size};
	uint64_t base = 0;
	uint8_t *mem = kvs_cuda_alloc(size, 0, NULL);
	out.stage = 1;
	out.rc = !mem || kvs_cuda_export(mem, &al, &base) != 0;
	su_cmd cmd;
	if (read(cmd_fd, &cmd, sizeof(cmd)) != sizeof(cmd))
		_exit(1);
	while (!out.rc && kvb_now() < cmd.t_go)
		usleep(200);
	kvs_client *c = NULL;
	if (!out.rc) {
		out.stage = 2;
		c = kvt_client(a->s, "bench", KVS_ROLE_WORKER, a->rank, cmd.world, NULL, NULL);
		out.rc = !c;
	}
	if (!out.rc) {
		out.stage = 3;
		kvs_group gr = {.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = SU_BPC,
				.window_chunks = -1, .null_block = -1};
		kvs_layer ly[SU_LAYERS];
		for (uint32_t l = 0; l < SU_LAYERS; l++)
			ly[l] = (kvs_layer){.group = 0, .alloc = 0,
					    .offset = (uint64_t)l * SU_NB * SU_BLOCK + (uint64_t)(uintptr_t)mem - base,
					    .num_blocks = SU_NB, .block_stride = SU_BLOCK, .block_bytes = SU_BLOCK};
		kvs_registration_desc d = {.device_type = KVS_DEV_CUDA, .allocs = &al, .n_allocs = 1, .groups = &gr,
					   .n_groups = 1, .layers = ly, .n_layers = SU_LAYERS};
		kvs_cuda_device_uuid(0, d.device_uuid);
		uint64_t h;
		out.t_reg0 = kvb_now();
		out.rc = kvs_register(c, &d, 60000, &h);
		out.t_reg1 = kvb_now();
		close(al.fd);
	}
	/* store jobs: every rank stores its part of the same job (one chunk of
	 * SU_LAYERS x SU_BPC blocks of 256 KiB = 32 MiB per rank), fresh keys */
	uint8_t key[32];
	int64_t ids[SU_BPC];
	for (uint32_t b = 0; b < SU_BPC; b++)
		ids[b] = b * 2; /* every other block: gathers, as the gpu mode */
	const int64_t *lists[1] = {ids};
	uint32_t len = SU_BPC;
	kvs_blocks bl = {.n_groups = 1, .ids = lists, .len = &len};
	while (!out.rc && out.n_jobs < SU_JOBS && kvb_now() < cmd.t_end) {
		out.stage = 4;
		uint32_t j = out.n_jobs;
		uint64_t job = cmd.run * 1000000 + j;
		kvb_key(cmd.run, j, key);
		int st = 0;
		out.j0[j] = kvb_now();
		out.rc = kvs_store(c, job, key, 1, &bl, NULL, 60000, &st) != 0 ||
			 kvs_complete(c, job, true, 60000, &st) != 0 || kvs_job_wait(c, job, 60000, &st) != 0 ||
			 st != KVS_JOB_COMMITTED;
		out.j1[j] = kvb_now();
		if (!out.rc)
			out.n_jobs++;
	}
	/* stay until told: the parent reads counters before the sessions close */
	if (write(res_fd, &out, sizeof(out)) != sizeof(out))
		_exit(1);
	if (read(cmd_fd, &cmd, sizeof(cmd)) < 0)
		_exit(1);
	kvs_client_close(c);
	_exit(0);
}

typedef struct probe {
	kvs_client *c;
	atomic_bool stop;
	double t0, max_rtt, t_max_rtt, t_pinned;
	uint64_t capacity;
	uint32_t n;
} probe;

static void *probe_main(void *arg)
{
	probe *p = arg;
	while (!atomic_load(&p->stop)) {
		double t = kvb_now();
		uint64_t v = kvt_stat_ms(p->c, "cuda_pinned_bytes", 30000);
		double rtt = kvb_now() - t;
		if (rtt > p->max_rtt) {
			p->max_rtt = rtt;
			p->t_max_rtt = t - p->t0;
		}
		if (!p->t_pinned && v != UINT64_MAX && v >= p->capacity)
			p->t_pinned = kvb_now() - p->t0;
		p->n++;
		usleep(20000);
	}
	return NULL;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* One L1 size; 0 when it ran and (with check) met the targets. */
static int startup_one(const kvb_opts *o, uint64_t gib, bool check)
{
	char l1[32], nm[160];
	snprintf(l1, sizeof(l1), "%llu", (unsigned long long)(gib << 30));
	char *extra[16] = {"--l1-size", l1, "--heartbeat-ms", "1000", "--ttl-ms", "10000", NULL};
	/* KVB_STARTUP_ARGS: more server arguments, blank-separated (experiments) */
	static char more[256];
	const char *ma = getenv("KVB_STARTUP_ARGS");
	if (ma) {
		snprintf(more, sizeof(more), "%s", ma);
		int k = 6;
		for (char *sv = NULL, *t = strtok_r(more, " ", &sv); t && k < 15; t = strtok_r(NULL, " ", &sv))
			extra[k++] = t;
		extra[k] = NULL;
	}
	kvt_server s;
	if (kvt_server_init_in(&s, o->dir, extra) != 0)
		return 1;
	s.exe = o->server;
	s.log_level = "warn";
	s.ns = "bench-model";
	s.timeout_ms = 60000;
	uint32_t n = o->ranks;
	su_arg args[64];
	kvt_proc procs[64];
	for (uint32_t r = 0; r < n; r++) {
		args[r] = (su_arg){.s = &s, .rank = r};
		if (kvt_proc_start(&procs[r], su_child, &args[r], NULL, 0) != 0)
			return 1;
	}
	usleep(1500000); /* the ranks allocate their GPU memory before the server starts */
	if (kvt_server_start(&s) != 0) {
		fprintf(stderr, "startup: server did not start\n");
		return 1;
	}
	double t0 = kvb_now();
	probe pr = {.t0 = t0, .capacity = gib << 30};
	pr.c = kvt_client(&s, "probe", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	pthread_t pt;
	bool probing = pr.c && pthread_create(&pt, NULL, probe_main, &pr) == 0;
	su_cmd cmd = {.t_go = t0 + 1.0, .t_end = t0 + 6.0, .run = 900 + gib, .world = n};
	for (uint32_t r = 0; r < n; r++)
		if (write(procs[r].cmd_fd, &cmd, sizeof(cmd)) != sizeof(cmd))
			return 1;
	static su_out outs[64];
	int failed = 0;
	for (uint32_t r = 0; r < n; r++)
		if (kvt_proc_call(&procs[r], NULL, 0, &outs[r], sizeof(outs[r]), 120000) != 0 || outs[r].rc) {
			fprintf(stderr, "startup %lluG: rank %u failed at stage %d\n", (unsigned long long)gib, r,
				outs[r].stage);
			failed++;
		}
	/* pinning may still run: give the probe until 20 s after start to see it end */
	while (probing && !pr.t_pinned && kvb_now() < t0 + 20)
		usleep(50000);
	atomic_store(&pr.stop, true);
	if (probing)
		pthread_join(pt, NULL);
	uint64_t reaped = pr.c ? kvt_stat(pr.c, "sessions_reaped") : UINT64_MAX;
	if (pr.c) /* what the copies met: parts that waited for pinning, evictions */
		kvb_note("startup L1 %lluG at the end: cuda_pin_waits %llu, cuda_gate_waits %llu, cuda_pinned_bytes %llu MiB, "
			 "l1_withheld_bytes %llu MiB, l1_evictions %llu, cuda_fallback_copies %llu", (unsigned long long)gib,
			 (unsigned long long)kvt_stat(pr.c, "cuda_pin_waits"),
			 (unsigned long long)kvt_stat(pr.c, "cuda_gate_waits"),
			 (unsigned long long)(kvt_stat(pr.c, "cuda_pinned_bytes") >> 20),
			 (unsigned long long)(kvt_stat(pr.c, "l1_withheld_bytes") >> 20),
			 (unsigned long long)kvt_stat(pr.c, "l1_evictions"),
			 (unsigned long long)kvt_stat(pr.c, "cuda_fallback_copies"));
	for (uint32_t r = 0; r < n; r++)
		kvt_proc_stop(&procs[r], &cmd, sizeof(cmd));
	kvs_client_close(pr.c);
	kvt_server_stop(&s);
	kvt_server_cleanup(&s);

	double reg_max = 0;
	uint32_t min_jobs = SU_JOBS;
	for (uint32_t r = 0; r < n; r++) {
		double d = outs[r].t_reg1 - outs[r].t_reg0;
		reg_max = d > reg_max ? d : reg_max;
		min_jobs = outs[r].n_jobs < min_jobs ? outs[r].n_jobs : min_jobs;
	}
	/* job j of every rank is one job: it can commit only once the last rank
	 * sent its part, so its time runs from there to the last rank's
	 * job_done (the ranks' register skew is not the job's) */
	static double lat[SU_JOBS], srt[SU_JOBS], t_end[SU_JOBS];
	for (uint32_t j = 0; j < min_jobs; j++) {
		double start = 0;
		t_end[j] = 0;
		for (uint32_t r = 0; r < n; r++) {
			start = outs[r].j0[j] > start ? outs[r].j0[j] : start;
			t_end[j] = outs[r].j1[j] - t0 > t_end[j] ? outs[r].j1[j] - t0 : t_end[j];
		}
		lat[j] = t_end[j] + t0 - start;
	}
	double later_med = 0, steady = 0, t_fast = -1, t_win = -1;
	if (min_jobs >= 4) {
		memcpy(srt, lat + 1, (min_jobs - 1) * sizeof(double));
		qsort(srt, min_jobs - 1, sizeof(double), cmp_d);
		later_med = srt[(min_jobs - 1) / 2];
		/* steady: the median job of the second half */
		uint32_t h = min_jobs / 2;
		memcpy(srt, lat + h, (min_jobs - h) * sizeof(double));
		qsort(srt, min_jobs - h, sizeof(double), cmp_d);
		steady = srt[(min_jobs - h) / 2];
		/* the end of the last job slower than steady / 0.9: from there on
		 * every job ran at >= 0.9 of the steady speed */
		t_fast = cmd.t_go - t0;
		for (uint32_t j = 0; j < min_jobs; j++)
			if (lat[j] > steady / 0.9)
				t_fast = t_end[j];
		/* throughput: the bytes of the jobs ending in each 100 ms window
		 * against the steady speed; from the end of the last window below
		 * 0.9 of it on, the copies ran at >= 0.9 of steady speed (a lone
		 * slow job among a window's 30-40 does not count, as it does for
		 * t_fast). Windows from the first job to the last whole one. */
		double w0 = cmd.t_go - t0, last = t_end[min_jobs - 1];
		uint32_t jw = 0, slow_after2 = 0;
		t_win = w0;
		for (double w = w0; w + SU_WIN <= last; w += SU_WIN) {
			uint32_t k = 0;
			while (jw < min_jobs && t_end[jw] < w + SU_WIN) {
				k += t_end[jw] >= w;
				jw++;
			}
			if (k * steady < 0.9 * SU_WIN)
				t_win = w + SU_WIN;
		}
		uint32_t slow_s[6] = {0}, all_s[6] = {0};
		for (uint32_t j = 0; j < min_jobs; j++) {
			bool slow = lat[j] > steady / 0.9;
			slow_after2 += t_end[j] > 2.0 && slow;
			int b = (int)t_end[j];
			if (b >= 0 && b < 6)
				slow_s[b] += slow, all_s[b]++;
		}
		kvb_note("startup L1 %lluG: slow jobs / jobs ending in each second from 1 s: %u/%u %u/%u %u/%u %u/%u %u/%u",
			 (unsigned long long)gib, slow_s[1], all_s[1], slow_s[2], all_s[2], slow_s[3], all_s[3], slow_s[4],
			 all_s[4], slow_s[5], all_s[5]);
		kvb_note("startup L1 %lluG: jobs slower than steady / 0.9 ending after 2 s: %u of %u", (unsigned long long)gib,
			 slow_after2, min_jobs);
	}
	uint64_t lost = (reaped == UINT64_MAX ? 0 : reaped) + (uint64_t)failed;
	double bytes_job = (double)n * SU_LAYERS * SU_BPC * SU_BLOCK;
	snprintf(nm, sizeof(nm), "startup L1 %lluG: slowest register (%u ranks at 1 s)", (unsigned long long)gib, n);
	kvb_result(nm, reg_max * 1e3, "ms", 0, "<= 100 ms");
	snprintf(nm, sizeof(nm), "startup L1 %lluG: largest request round trip, start to 6 s (probe every 20 ms)",
		 (unsigned long long)gib);
	kvb_result(nm, pr.max_rtt * 1e3, "ms", 0, "<= 1000 ms");
	snprintf(nm, sizeof(nm), "startup L1 %lluG: sessions lost (reaped + failed ranks)", (unsigned long long)gib);
	kvb_result(nm, (double)lost, "", 0, "0");
	snprintf(nm, sizeof(nm), "startup L1 %lluG: first store job (%.0f MiB, all ranks)", (unsigned long long)gib,
		 bytes_job / 1048576);
	kvb_result(nm, min_jobs ? lat[0] * 1e3 : 0, "ms", later_med * 1e3, "<= 1.5 x median of later jobs");
	snprintf(nm, sizeof(nm), "startup L1 %lluG: store jobs at >= 0.9 of steady speed from", (unsigned long long)gib);
	kvb_result(nm, t_fast, "s after start", 0, "<= 2 s");
	snprintf(nm, sizeof(nm), "startup L1 %lluG: store throughput (100 ms windows) >= 0.9 of steady from",
		 (unsigned long long)gib);
	kvb_result(nm, t_win, "s after start", 0, "<= 2 s");
	snprintf(nm, sizeof(nm), "startup L1 %lluG: steady store speed (median job, second half)", (unsigned long long)gib);
	kvb_result(nm, steady > 0 ? bytes_job / steady / 1e9 : 0, "GB/s", 0, "");
	snprintf(nm, sizeof(nm), "startup L1 %lluG: L1 pinned (cuda_pinned_bytes = L1) at", (unsigned long long)gib);
	if (pr.t_pinned > 0)
		kvb_result(nm, pr.t_pinned, "s after start", 0, "");
	else /* the probe never saw it within 20 s */
		kvb_note("startup L1 %lluG: L1 not wholly pinned 20 s after start", (unsigned long long)gib);
	kvb_note("startup L1 %lluG: %u store jobs per rank; first job %.1f ms, later median %.1f ms; largest probe "
		 "round trip %.0f ms at %.2f s; %u probes", (unsigned long long)gib, min_jobs,
		 min_jobs ? lat[0] * 1e3 : 0, later_med * 1e3, pr.max_rtt * 1e3, pr.t_max_rtt, pr.n);
	if (failed || min_jobs == 0)
		return 1;
	if (check && (reg_max > 0.1 || pr.max_rtt > 1.0 || lost)) {
		fprintf(stderr, "startup %lluG: FAILED: register %.0f ms, round trip %.0f ms, %llu sessions lost\n",
			(unsigned long long)gib, reg_max * 1e3, pr.max_rtt * 1e3, (unsigned long long)lost);
		return 1;
	}
	return 0;
}

static void gpu_check_child(void *arg, int cmd_fd, int res_fd)
{
	(void)arg, (void)cmd_fd;
	int ok = kvs_cuda()->ok && kvs_cuda()->n_devices > 0;
	_exit(write(res_fd, &ok, sizeof(ok)) == sizeof(ok) ? 0 : 1);
}

int kvb_mode_startup(const kvb_opts *o)
{
	/* asked in a child: the parent stays CUDA-free to fork the ranks */
	int ok = 0;
	kvt_proc cp;
	if (kvt_proc_start(&cp, gpu_check_child, NULL, NULL, 0) == 0) {
		if (read(cp.res_fd, &ok, sizeof(ok)) != sizeof(ok))
			ok = 0;
		kvt_proc_wait(&cp);
	}
	if (!ok) {
		kvb_note("startup: no GPU in this run: nothing measured");
		fprintf(stderr, "startup: no GPU (skipped)\n");
		return 0;
	}
	const char *sz = o->sizes ? o->sizes : "8,32,96";
	int rc = 0;
	for (const char *p = sz; *p;) {
		char *end;
		uint64_t gib = strtoull(p, &end, 10);
		if (strncmp(p, "max", 3) == 0) {
			/* the largest L1 this machine allows with room for the rest:
			 * three quarters of physical memory */
			long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
			gib = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz / 4 * 3 >> 30 : 8;
			end = (char *)p + 3;
		} else if (end == p) {
			break;
		}
		if (gib)
			rc |= startup_one(o, gib, o->check);
		p = *end == ',' ? end + 1 : end;
	}
	return rc;
}
#else
int kvb_mode_startup(const kvb_opts *o)
{
	(void)o;
	kvb_note("startup: built without CUDA headers: nothing measured");
	return 0;
}
#endif
