/* Operating the server end to end: the Prometheus endpoint scraped and
 * parsed strictly after real traffic (2 rank processes + a scheduler), the
 * health and readiness endpoints, the admin op (drain / resume / clear) with
 * its job-level semantics, and kvside-ctl's output and exit codes
 * ($KVS_CTL) against the real server. */
#include <arpa/inet.h>
#include <check.h>
#include <ctype.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "harness.h"
#include "rank.h"

#define W 2
#define N 4

typedef struct world {
	kvt_server s;
	kvt_rank r[W];
	kvs_client *sched;
	unsigned port;
} world;

static void world_up(world *w, const char *engine)
{
	kvt_server_init(&w->s, "--ttl-ms", "3000", "--heartbeat-ms", "100", "--l1-size", "64M", NULL);
	ck_assert_int_eq(kvt_server_start(&w->s), 0);
	w->sched = kvt_client(&w->s, engine, KVS_ROLE_SCHEDULER, 0, W, NULL, NULL);
	ck_assert_ptr_nonnull(w->sched);
	for (uint32_t i = 0; i < W; i++)
		ck_assert_int_eq(kvt_rank_start(&w->r[i], &w->s, engine, i, W), 0);
	uint64_t port = kvt_stat(w->sched, "metrics_port");
	ck_assert_uint_gt(port, 0);
	ck_assert_uint_lt(port, 65536);
	w->port = (unsigned)port;
}

static void world_down(world *w)
{
	for (uint32_t i = 0; i < W; i++)
		kvt_rank_stop(&w->r[i]);
	kvs_client_close(w->sched);
	ck_assert_int_eq(kvt_server_stop(&w->s), 0);
	kvt_server_cleanup(&w->s);
}

static kvt_res rank_do(world *w, uint32_t i, kvt_cmd c)
{
	kvt_res res;
	ck_assert_int_eq(kvt_rank_do(&w->r[i], &c, &res), 0);
	return res;
}

static void all_ok(world *w, kvt_cmd c)
{
	for (uint32_t i = 0; i < W; i++) {
		kvt_res r = rank_do(w, i, c);
		ck_assert_msg(r.code == 0, "rank %u op %d job %llu: %s", i, c.op, (unsigned long long)c.job,
			      kvs_strerror(r.code));
	}
}

static int wait_job(world *w, uint64_t job)
{
	int st = -1;
	ck_assert_int_eq(kvs_job_wait(w->sched, job, 5000, &st), 0);
	return st;
}

/* ---- HTTP ------------------------------------------------------------------------- */

/* One HTTP/1.0 request; returns the status, the body in body (cap bytes). */
static int http(unsigned port, const char *method, const char *path, char *body, size_t cap)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	ck_assert_int_ge(fd, 0);
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	char rq[256];
	int n = snprintf(rq, sizeof(rq), "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", method, path);
	ck_assert_int_eq(write(fd, rq, (size_t)n), n);
	static char resp[1 << 20];
	size_t len = 0;
	for (;;) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		ck_assert_msg(poll(&p, 1, 5000) == 1, "no HTTP answer in 5 s");
		ssize_t k = read(fd, resp + len, sizeof(resp) - 1 - len);
		ck_assert_int_ge(k, 0);
		if (k == 0)
			break;
		len += (size_t)k;
	}
	close(fd);
	resp[len] = '\0';
	int status = 0;
	ck_assert_int_eq(sscanf(resp, "HTTP/1.%*d %d", &status), 1);
	const char *b = strstr(resp, "\r\n\r\n");
	ck_assert_ptr_nonnull(b);
	snprintf(body, cap, "%s", b + 4);
	return status;
}

/* ---- a strict reader of the Prometheus text format (version 0.0.4) ----------------- */

#define MAX_SERIES 2048
typedef struct prom {
	int n;
	struct { char key[256]; double v; } s[MAX_SERIES]; /* key: name{labels} as written */
	int n_fam;
	struct { char name[128], type[16]; bool help, samples; } fam[512];
} prom;

static bool name_ok(const char *s, size_t n)
{
	if (!n || !(isalpha((unsigned char)s[0]) || s[0] == '_' || s[0] == ':'))
		return false;
	for (size_t i = 1; i < n; i++)
		if (!(isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == ':'))
			return false;
	return true;
}

static int fam_find(prom *p, const char *name, size_t n)
{
	for (int i = 0; i < p->n_fam; i++)
		if (strlen(p->fam[i].name) == n && memcmp(p->fam[i].name, name, n) == 0)
			return i;
	return -1;
}

static int fam_get(prom *p, const char *name, size_t n)
{
	int i = fam_find(p, name, n);
	if (i >= 0)
		return i;
	ck_assert_int_lt(p->n_fam, 512);
	i = p->n_fam++;
	memset(&p->fam[i], 0, sizeof(p->fam[i]));
	memcpy(p->fam[i].name, name, n);
	return i;
}

/* Parses text, failing the test at the first line that breaks the format:
 * HELP/TYPE at most once per family and before its samples, known types,
 * valid metric and label names, quoted label values with valid escapes,
 * numeric values, no duplicate series, a newline at the end. */
static void prom_parse(const char *text, prom *p)
{
	memset(p, 0, sizeof(*p));
	size_t tl = strlen(text);
	ck_assert_msg(tl > 0 && text[tl - 1] == '\n', "exposition must end with a newline");
	int lineno = 0;
	for (const char *line = text; *line; ) {
		const char *eol = strchr(line, '\n');
		size_t len = (size_t)(eol - line);
		char l[1024];
		ck_assert_uint_lt(len, sizeof(l));
		memcpy(l, line, len);
		l[len] = '\0';
		line = eol + 1;
		lineno++;
		if (len == 0)
			continue;
		if (l[0] == '#') {
			char kind[8], name[200];
			int off = 0;
			if (sscanf(l, "# %7s %199s %n", kind, name, &off) < 2)
				continue; /* a plain comment */
			bool help = strcmp(kind, "HELP") == 0, type = strcmp(kind, "TYPE") == 0;
			if (!help && !type)
				continue;
			ck_assert_msg(name_ok(name, strlen(name)), "line %d: bad name '%s'", lineno, name);
			int f = fam_get(p, name, strlen(name));
			ck_assert_msg(!p->fam[f].samples, "line %d: %s after samples of %s", lineno, kind, name);
			if (help) {
				ck_assert_msg(!p->fam[f].help, "line %d: second HELP for %s", lineno, name);
				p->fam[f].help = true;
				ck_assert_msg(off > 0 && l[off], "line %d: empty HELP", lineno);
			} else {
				ck_assert_msg(!p->fam[f].type[0], "line %d: second TYPE for %s", lineno, name);
				const char *t = l + off;
				ck_assert_msg(strcmp(t, "counter") == 0 || strcmp(t, "gauge") == 0 ||
					      strcmp(t, "untyped") == 0 || strcmp(t, "histogram") == 0 ||
					      strcmp(t, "summary") == 0, "line %d: type '%s'", lineno, t);
				snprintf(p->fam[f].type, sizeof(p->fam[f].type), "%s", t);
			}
			continue;
		}
		/* sample: name[{labels}] value */
		size_t nl = strcspn(l, "{ ");
		ck_assert_msg(name_ok(l, nl), "line %d: bad metric name in '%s'", lineno, l);
		int f = fam_find(p, l, nl);
		ck_assert_msg(f >= 0 && p->fam[f].type[0], "line %d: sample without TYPE: '%s'", lineno, l);
		p->fam[f].samples = true;
		const char *c = l + nl;
		if (*c == '{') {
			c++;
			while (*c != '}') {
				size_t ln = strcspn(c, "=");
				ck_assert_msg(name_ok(c, ln), "line %d: bad label name", lineno);
				c += ln;
				ck_assert_msg(c[0] == '=' && c[1] == '"', "line %d: label value not quoted", lineno);
				c += 2;
				while (*c && *c != '"') {
					if (*c == '\\') {
						ck_assert_msg(c[1] == '\\' || c[1] == '"' || c[1] == 'n',
							      "line %d: bad escape", lineno);
						c++;
					}
					c++;
				}
				ck_assert_msg(*c == '"', "line %d: unterminated label value", lineno);
				c++;
				if (*c == ',')
					c++;
				else
					ck_assert_msg(*c == '}', "line %d: expected , or }", lineno);
			}
			c++;
		}
		ck_assert_msg(*c == ' ', "line %d: no space before the value", lineno);
		size_t kl = (size_t)(c - l);
		char *end;
		double v = strtod(c + 1, &end);
		ck_assert_msg(end != c + 1 && (*end == '\0' || *end == ' '), "line %d: bad value '%s'", lineno, c + 1);
		for (int i = 0; i < p->n; i++)
			ck_assert_msg(!(strlen(p->s[i].key) == kl && memcmp(p->s[i].key, l, kl) == 0),
				      "line %d: duplicate series", lineno);
		ck_assert_int_lt(p->n, MAX_SERIES);
		ck_assert_uint_lt(kl, sizeof(p->s[0].key));
		memcpy(p->s[p->n].key, l, kl);
		p->s[p->n].key[kl] = '\0';
		p->s[p->n++].v = v;
	}
}

/* Value of a series (name{labels} exactly as written), or -1 if absent. */
static double prom_get(const prom *p, const char *key)
{
	for (int i = 0; i < p->n; i++)
		if (strcmp(p->s[i].key, key) == 0)
			return p->s[i].v;
	return -1;
}

static const char *prom_type(prom *p, const char *name)
{
	int f = fam_find(p, name, strlen(name));
	return f >= 0 ? p->fam[f].type : "";
}

static prom P;
static char body[1 << 20];

static void scrape(world *w)
{
	ck_assert_int_eq(http(w->port, "GET", "/metrics", body, sizeof(body)), 200);
	prom_parse(body, &P);
}

/* Scrapes until the series has the value (the snapshot follows within a tick). */
static bool scrape_until(world *w, const char *key, double want)
{
	for (int i = 0; i < 100; i++) {
		scrape(w);
		if (prom_get(&P, key) == want)
			return true;
		usleep(20000);
	}
	fprintf(stderr, "%s = %g, want %g\n", key, prom_get(&P, key), want);
	return false;
}

START_TEST(metrics_scrape_and_health)
{
	world w;
	world_up(&w, "M");
	char b[4096];
	ck_assert_int_eq(http(w.port, "GET", "/healthz", b, sizeof(b)), 200);
	ck_assert_str_eq(b, "ok\n");
	ck_assert_int_eq(http(w.port, "GET", "/readyz", b, sizeof(b)), 200);
	ck_assert_int_eq(http(w.port, "GET", "/nope", b, sizeof(b)), 404);
	ck_assert_int_eq(http(w.port, "POST", "/metrics", b, sizeof(b)), 405);

	/* traffic: a store job on both ranks, a lookup, a retrieve, one error */
	all_ok(&w, (kvt_cmd){.op = KVT_STORE, .job = 1, .n_keys = N, .src_base = 0});
	all_ok(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 1, .ok = 1});
	ck_assert_int_eq(wait_job(&w, 1), KVS_JOB_COMMITTED);
	uint8_t keys[N * 32];
	for (uint32_t k = 0; k < N; k++)
		kvt_key(k, keys + 32 * k);
	uint64_t hits = 0;
	ck_assert_int_eq(kvs_lookup(w.sched, keys, N, false, 0, 3000, &hits, NULL), 0);
	ck_assert_uint_eq(hits, N);
	all_ok(&w, (kvt_cmd){.op = KVT_RETRIEVE, .job = 2, .n_keys = N, .dst_base = 32});
	all_ok(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 2, .ok = 1});
	ck_assert_int_eq(wait_job(&w, 2), KVS_JOB_COMMITTED);
	kvt_res bad = rank_do(&w, 0, (kvt_cmd){.op = KVT_COMPLETE, .job = 999, .ok = 1});
	ck_assert_int_eq(bad.code, KVS_E_JOB_STATE);

	ck_assert(scrape_until(&w, "kvside_errors_total{op=\"complete\",code=\"E_JOB_STATE\"}", 1));
	/* the families, their types and the values the traffic implies */
	ck_assert_str_eq(prom_type(&P, "kvside_requests_total"), "counter");
	ck_assert_str_eq(prom_type(&P, "kvside_sessions"), "gauge");
	ck_assert_str_eq(prom_type(&P, "kvside_lookup_hits_total"), "counter");
	ck_assert_str_eq(prom_type(&P, "kvside_loop_busy_seconds_total"), "counter");
	ck_assert(prom_get(&P, "kvside_requests_total{op=\"store\"}") == W);
	ck_assert(prom_get(&P, "kvside_requests_total{op=\"retrieve\"}") == W);
	ck_assert(prom_get(&P, "kvside_requests_total{op=\"complete\"}") == 2 * W + 1);
	ck_assert(prom_get(&P, "kvside_requests_total{op=\"register\"}") == W);
	ck_assert(prom_get(&P, "kvside_requests_total{op=\"lookup\"}") == 1);
	ck_assert(prom_get(&P, "kvside_jobs_finished_total{state=\"committed\"}") == 2);
	ck_assert(prom_get(&P, "kvside_jobs_finished_total{state=\"aborted\"}") == 0);
	ck_assert(prom_get(&P, "kvside_jobs{state=\"open\"}") == 0);
	ck_assert(prom_get(&P, "kvside_retained_blocks") == 0);
	ck_assert(prom_get(&P, "kvside_sessions") == 1 + W);
	ck_assert(prom_get(&P, "kvside_registrations") == W);
	ck_assert(prom_get(&P, "kvside_imports") == 2 * W);
	ck_assert(prom_get(&P, "kvside_lookup_hits_total{tier=\"l1\"}") == N);
	ck_assert(prom_get(&P, "kvside_lookup_hits_total{tier=\"l2\"}") == 0);
	/* group 0: 5 layers x 4 blocks x 1024 B, group 1: 3 x 2 x 2048 per chunk and rank */
	double obj_bytes = 5 * 4 * 1024 + 3 * 2 * 2048;
	ck_assert(prom_get(&P, "kvside_copy_bytes_total{engine=\"host\"}") == 2 * W * N * obj_bytes);
	ck_assert(prom_get(&P, "kvside_job_copy_bytes_total") == 2 * W * N * obj_bytes);
	ck_assert(prom_get(&P, "kvside_l1_used_bytes") > 0);
	ck_assert(prom_get(&P, "kvside_l1_capacity_bytes") == 64 << 20);
	ck_assert(prom_get(&P, "kvside_l1_objects{state=\"any\"}") == W * N * 2);
	ck_assert(prom_get(&P, "kvside_evictions_total{tier=\"l1\"}") == 0);
	ck_assert(prom_get(&P, "kvside_l2_enabled") == 0);
	ck_assert(prom_get(&P, "kvside_l2_queue_depth") == 0);
	ck_assert(prom_get(&P, "kvside_l2_write_drops_total") == 0);
	ck_assert(prom_get(&P, "kvside_aliases") >= 0);
	ck_assert(prom_get(&P, "kvside_draining") == 0);
	/* which server answered: its pid and epoch label build_info, its start
	 * and uptime are gauges (stats: server_*) */
	char bi[160];
	snprintf(bi, sizeof(bi), "kvside_build_info{version=\"0.1.0\",pid=\"%llu\",epoch=\"%016llx\"}",
		 (unsigned long long)kvt_stat(w.sched, "server_pid"), (unsigned long long)kvt_stat(w.sched, "server_epoch"));
	ck_assert_msg(prom_get(&P, bi) == 1, "missing %s", bi);
	ck_assert(prom_get(&P, "kvside_uptime_seconds") > 0);
	double started = prom_get(&P, "kvside_start_time_seconds");
	ck_assert(started > 1.7e9 && started <= (double)time(NULL) + 1);
	ck_assert_uint_eq(kvt_stat(w.sched, "server_version"), 1000); /* 0.1.0 */
	double age = prom_get(&P, "kvside_main_loop_tick_age_seconds");
	ck_assert(age >= 0 && age < 1.0);
	/* the errors.* counters of stats are not exported twice */
	ck_assert_ptr_null(strstr(body, "errors_E_"));

	/* readiness follows drain; health does not */
	kvs_admin_info a;
	ck_assert_int_eq(kvs_admin(w.sched, KVS_ADMIN_DRAIN, 0, 3000, &a), 0);
	ck_assert(scrape_until(&w, "kvside_draining", 1));
	ck_assert_int_eq(http(w.port, "GET", "/readyz", b, sizeof(b)), 503);
	ck_assert_ptr_nonnull(strstr(b, "draining"));
	ck_assert_int_eq(http(w.port, "GET", "/healthz", b, sizeof(b)), 200);
	ck_assert_int_eq(kvs_admin(w.sched, KVS_ADMIN_RESUME, 0, 3000, &a), 0);
	ck_assert(scrape_until(&w, "kvside_draining", 0));
	ck_assert_int_eq(http(w.port, "GET", "/readyz", b, sizeof(b)), 200);
	world_down(&w);
}
END_TEST

START_TEST(metrics_off_and_port_clash)
{
	/* off: no port */
	kvt_server s;
	kvt_server_init(&s, "--metrics-listen", "off", NULL);
	ck_assert_int_eq(kvt_server_start(&s), 0);
	kvs_client *c = kvt_client(&s, "X", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert_uint_eq(kvt_stat(c, "metrics_port"), 0);
	/* a port already taken: the second server runs, without metrics */
	world w;
	world_up(&w, "Y");
	char port[32];
	snprintf(port, sizeof(port), "127.0.0.1:%u", w.port);
	kvt_server s2;
	kvt_server_init(&s2, "--metrics-listen", port, NULL);
	ck_assert_int_eq(kvt_server_start(&s2), 0);
	kvs_client *c2 = kvt_client(&s2, "X", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	ck_assert_ptr_nonnull(c2);
	ck_assert_uint_eq(kvt_stat(c2, "metrics_port"), 0);
	kvs_client_close(c2);
	ck_assert_int_eq(kvt_server_stop(&s2), 0);
	kvt_server_cleanup(&s2);
	kvs_client_close(c);
	ck_assert_int_eq(kvt_server_stop(&s), 0);
	kvt_server_cleanup(&s);
	world_down(&w);
}
END_TEST

/* ---- kvside-ctl -------------------------------------------------------------------- */

static char ctl_out[1 << 16];

/* Runs $KVS_CTL --broker-dir <run> args...; stdout+stderr in ctl_out. */
static int ctl(world *w, ...)
{
	const char *exe = getenv("KVS_CTL");
	ck_assert_msg(exe != NULL, "KVS_CTL not set");
	const char *argv[40];
	int n = 0;
	argv[n++] = exe;
	va_list ap;
	va_start(ap, w);
	const char *a;
	while ((a = va_arg(ap, const char *)) != NULL && n < 36)
		argv[n++] = a;
	va_end(ap);
	if (w) {
		argv[n++] = "--broker-dir";
		argv[n++] = w->s.run;
	}
	argv[n] = NULL;
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t pid = fork();
	if (pid == 0) {
		dup2(pfd[1], 1);
		dup2(pfd[1], 2);
		close(pfd[0]);
		execv(exe, (char *const *)argv);
		_exit(127);
	}
	close(pfd[1]);
	size_t len = 0;
	ssize_t k;
	while (len + 1 < sizeof(ctl_out) && (k = read(pfd[0], ctl_out + len, sizeof(ctl_out) - 1 - len)) > 0)
		len += (size_t)k;
	ctl_out[len] = '\0';
	close(pfd[0]);
	int st;
	waitpid(pid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#define CTL_EXPECT(rc, needle, ...)                                                         \
	do {                                                                                \
		int rc_ = ctl(__VA_ARGS__, NULL);                                           \
		ck_assert_msg(rc_ == (rc), "exit %d, want %d: %s", rc_, (rc), ctl_out);     \
		ck_assert_msg(strstr(ctl_out, needle), "'%s' lacks '%s'", ctl_out, needle); \
	} while (0)

START_TEST(drain_resume_clear)
{
	world w;
	world_up(&w, "D");
	/* job 1 half started: rank 0 sent its part, rank 1 not yet */
	ck_assert_int_eq(rank_do(&w, 0, (kvt_cmd){.op = KVT_STORE, .job = 1, .n_keys = N}).code, 0);
	CTL_EXPECT(0, "serving, 1 jobs open", &w, "status");
	/* drain with a short wait: times out, exit 4, new jobs refused */
	CTL_EXPECT(4, "1 jobs still open", &w, "drain", "--wait", "300");
	CTL_EXPECT(0, "\"draining\":true", &w, "status", "--json");
	kvt_res r = rank_do(&w, 0, (kvt_cmd){.op = KVT_STORE, .job = 2, .first_key = 8, .n_keys = N});
	ck_assert_int_eq(r.code, KVS_E_BUSY);
	r = rank_do(&w, 1, (kvt_cmd){.op = KVT_RETRIEVE, .job = 3, .n_keys = N, .dst_base = 32});
	ck_assert_int_eq(r.code, KVS_E_BUSY);
	/* clear is refused while a job is open: exit 1 with the server's reason */
	CTL_EXPECT(1, "jobs open (drain first)", &w, "clear");
	CTL_EXPECT(1, "\"code\":\"E_BUSY\"", &w, "clear", "--json");
	/* the open job's other part is still served, and it commits */
	ck_assert_int_eq(rank_do(&w, 1, (kvt_cmd){.op = KVT_STORE, .job = 1, .n_keys = N}).code, 0);
	all_ok(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 1, .ok = 1});
	ck_assert_int_eq(wait_job(&w, 1), KVS_JOB_COMMITTED);
	/* a repeat of the terminal job is answered with its state, not refused */
	r = rank_do(&w, 0, (kvt_cmd){.op = KVT_STORE, .job = 1, .n_keys = N});
	ck_assert_int_eq(r.code, 0);
	ck_assert_int_eq(r.state, KVS_JOB_COMMITTED);
	CTL_EXPECT(0, "drained: no job open", &w, "drain", "--wait", "2000");
	CTL_EXPECT(0, "\"drained\":true", &w, "drain", "--json");

	/* a drain that waits, answered when the job finishes */
	CTL_EXPECT(0, "resumed", &w, "resume");
	ck_assert_int_eq(rank_do(&w, 0, (kvt_cmd){.op = KVT_STORE, .job = 4, .first_key = 4, .n_keys = N}).code, 0);
	CTL_EXPECT(0, "job 4 ", &w, "jobs", "--engine", "D");
	CTL_EXPECT(0, "\"state\":\"open\"", &w, "jobs", "4", "--engine", "D", "--json");
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t bg = fork();
	if (bg == 0) {
		int rc = ctl(&w, "drain", "--wait", "10000", "--json", NULL);
		ssize_t wr = write(pfd[1], ctl_out, strlen(ctl_out) + 1);
		(void)wr;
		_exit(rc);
	}
	close(pfd[1]);
	/* the drain request is waiting: the new job 5 is refused meanwhile */
	ck_assert(KVT_WAIT(kvt_stat(w.sched, "draining") == 1, 5000));
	usleep(200000);
	ck_assert_int_eq(rank_do(&w, 1, (kvt_cmd){.op = KVT_STORE, .job = 5, .n_keys = N}).code, KVS_E_BUSY);
	ck_assert_int_eq(rank_do(&w, 1, (kvt_cmd){.op = KVT_STORE, .job = 4, .first_key = 4, .n_keys = N}).code, 0);
	all_ok(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 4, .ok = 1});
	ck_assert_int_eq(wait_job(&w, 4), KVS_JOB_COMMITTED);
	int st;
	ck_assert_int_eq(waitpid(bg, &st, 0), bg);
	char out[4096] = "";
	ssize_t rd = read(pfd[0], out, sizeof(out) - 1);
	ck_assert_int_gt(rd, 0);
	close(pfd[0]);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "drain exit %d: %s", WEXITSTATUS(st), out);
	ck_assert_ptr_nonnull(strstr(out, "\"drained\":true"));
	unsigned long waited = 0;
	const char *wm = strstr(out, "\"waited_ms\":");
	ck_assert_ptr_nonnull(wm);
	waited = strtoul(wm + 12, NULL, 10);
	ck_assert_uint_ge(waited, 200);

	/* lookup by tokens (the test prompt: 1000 + 7 i), then clear drops it all */
	/* a range is consecutive ids (another prompt: no hits); the real one
	 * goes through a file */
	char toks[64];
	snprintf(toks, sizeof(toks), "%u-%u", 1000u, 1000u + 8 * KVT_CHUNK_TOKENS - 1);
	char path[400];
	snprintf(path, sizeof(path), "%s/tokens.txt", w.s.dir);
	FILE *f = fopen(path, "w");
	for (uint32_t i = 0; i < 8 * KVT_CHUNK_TOKENS; i++)
		fprintf(f, "%u%c", 1000 + i * 7, i % 16 == 15 ? '\n' : ',');
	fclose(f);
	CTL_EXPECT(0, "8 of 8 leading chunks cached (8 in L1, 0 only in L2)", &w, "lookup", "--tokens-file",
		   path, "--namespace", "test-model", "--world", "2", "--chunk-tokens", "64");
	CTL_EXPECT(0, "0 of 8", &w, "lookup", "--tokens", toks, "--namespace", "test-model", "--world", "2",
		   "--chunk-tokens", "64");
	char hex[65];
	uint8_t key0[32];
	kvt_key(0, key0);
	for (int i = 0; i < 32; i++)
		snprintf(hex + 2 * i, 3, "%02x", key0[i]);
	CTL_EXPECT(0, "\"hits\":1,\"tiers\":[\"l1\"]", &w, "lookup", hex, "--namespace", "test-model",
		   "--world", "2", "--json");
	CTL_EXPECT(0, "cleared: 32 L1 objects (0 pinned ones kept), 0 L2 objects", &w, "clear");
	CTL_EXPECT(0, "0 of 8", &w, "lookup", "--tokens-file", path, "--namespace", "test-model",
		   "--world", "2", "--chunk-tokens", "64");
	ck_assert_uint_eq(kvt_stat(w.sched, "l1_objects"), 0);
	/* still draining: nothing new gets in until resume */
	ck_assert_int_eq(rank_do(&w, 0, (kvt_cmd){.op = KVT_STORE, .job = 6, .n_keys = N}).code, KVS_E_BUSY);
	CTL_EXPECT(0, "resumed", &w, "resume");
	all_ok(&w, (kvt_cmd){.op = KVT_STORE, .job = 6, .n_keys = N});
	all_ok(&w, (kvt_cmd){.op = KVT_COMPLETE, .job = 6, .ok = 1});
	ck_assert_int_eq(wait_job(&w, 6), KVS_JOB_COMMITTED);
	ck_assert_uint_eq(kvt_stat(w.sched, "retained_blocks"), 0);
	world_down(&w);
}
END_TEST

START_TEST(ctl_exit_codes)
{
	world w;
	world_up(&w, "C");
	/* 0 and the shape of the output */
	CTL_EXPECT(0, "metrics_port", &w, "stats");
	CTL_EXPECT(0, "{\"ok\":true,\"counters\":{\"server_pid\":", &w, "stats", "--json");
	CTL_EXPECT(0, "serving", &w, "status");
	CTL_EXPECT(0, "Exit status", NULL, "--help");
	CTL_EXPECT(0, "kvside-ctl 0.1.0", NULL, "--version");
	/* 2: usage errors never reach the server */
	CTL_EXPECT(2, "no command", &w, "--json");
	CTL_EXPECT(2, "unknown command 'reboot'", &w, "reboot");
	CTL_EXPECT(2, "", &w, "stats", "--bogus");
	CTL_EXPECT(2, "unexpected argument", &w, "status", "extra");
	CTL_EXPECT(2, "64-digit hex key", &w, "lookup", "abcd");
	CTL_EXPECT(2, "needs keys", &w, "lookup");
	CTL_EXPECT(2, "--tokens", &w, "lookup", "--tokens", "1,x");
	CTL_EXPECT(2, "fewer tokens than one chunk", &w, "lookup", "--tokens", "1-10");
	CTL_EXPECT(2, "--wait", &w, "drain", "--wait", "soon");
	CTL_EXPECT(2, "not a job id", &w, "jobs", "seven");
	/* 3: nobody there */
	char gone[400];
	snprintf(gone, sizeof(gone), "%s/nobody", w.s.dir);
	CTL_EXPECT(3, "cannot reach kvside-server", NULL, "status", "--broker-dir", gone, "--timeout", "300");
	CTL_EXPECT(3, "\"ok\":false", NULL, "stats", "--json", "--broker-dir", gone, "--timeout", "300");
	/* --config finds the server through its YAML file */
	char cfg[400], yaml[600];
	snprintf(cfg, sizeof(cfg), "%s/kvside.yaml", w.s.dir);
	snprintf(yaml, sizeof(yaml), "broker-dir: %s\nl1-size: 64M\n", w.s.run);
	FILE *f = fopen(cfg, "w");
	fputs(yaml, f);
	fclose(f);
	CTL_EXPECT(0, "serving", NULL, "status", "--config", cfg);
	CTL_EXPECT(2, "nobody: No such file", NULL, "status", "--config", gone);
	/* 1 and 4 are covered by drain_resume_clear; the server is unharmed */
	ck_assert_uint_eq(kvt_stat(w.sched, "jobs_open"), 0);
	world_down(&w);
}
END_TEST

static Suite *ops_suite(void)
{
	Suite *s = suite_create("ops");
	TCase *tc = tcase_create("ops");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, metrics_scrape_and_health);
	tcase_add_test(tc, metrics_off_and_port_clash);
	tcase_add_test(tc, drain_resume_clear);
	tcase_add_test(tc, ctl_exit_codes);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(ops_suite)
