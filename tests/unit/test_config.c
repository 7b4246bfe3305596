/* Unit tests for the server settings (server/config.c): every kind of value
 * from YAML, the errors (each must name the setting and the line), the
 * printed form read back, the example file holding the defaults, and the
 * precedence of the command line over the file in the real binary
 * ($KVS_SERVER --config F ... --print-config). */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "config.h"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "server.h"

static char tmpdir[64];

static void setup(void)
{
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvt-config-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void teardown(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
	ck_assert_int_eq(system(cmd), 0);
}

/* Writes text to a fresh file in tmpdir; returns its path (a static buffer,
 * overwritten by the next call). */
static const char *file_with(const char *text)
{
	static char path[128];
	static int seq;
	snprintf(path, sizeof(path), "%s/c%d.yaml", tmpdir, seq++);
	FILE *f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fputs(text, f);
	fclose(f);
	return path;
}

static void all_equal(const kvs_server_config *a, const kvs_server_config *b)
{
	for (const kvs_config_key *k = kvs_config_keys(); k->name; k++) {
		char x[600], y[600];
		kvs_config_format(a, k, x, sizeof(x));
		kvs_config_format(b, k, y, sizeof(y));
		ck_assert_msg(strcmp(x, y) == 0, "%s: '%s' != '%s'", k->name, x, y);
	}
}

START_TEST(good_every_kind)
{
	kvs_server_config c;
	kvs_server_config_defaults(&c);
	char err[512] = "";
	const char *p = file_with(
		"# a comment\n"
		"listen: tcp://127.0.0.1:5555\n"
		"broker-dir: '/run/kvside'\n"
		"l1-size: 16G\n"
		"ttl-ms: 20000\n"
		"heartbeat_ms: 500   # underscores work too\n"
		"job-deadline-ms: 90000\n"
		"fd-park-ms: 1000\n"
		"drain-ms: 100\n"
		"copy-threads: 8\n"
		"terminal-jobs: 1024\n"
		"prefault: no\n"
		"allow-uid: 1000\n"
		"l2-path: \"/var/lib/kvside/l2\"\n"
		"l2-size: 512MiB\n"
		"l2-sync: nometa\n"
		"metrics-listen: '[::1]:9100'\n"
		"metrics-stall-ms: 3000\n"
		"log-level: debug\n"
		"log-format: json\n");
	int r = kvs_config_load(&c, p, err, sizeof(err));
	ck_assert_msg(r == 0, "%s", err);
	ck_assert_int_eq(c.log_format, KVS_LOG_JSON);
	ck_assert_str_eq(c.listen, "tcp://127.0.0.1:5555");
	ck_assert_str_eq(c.broker_dir, "/run/kvside");
	ck_assert_uint_eq(c.l1_size, 16ull << 30);
	ck_assert_uint_eq(c.ttl_ms, 20000);
	ck_assert_uint_eq(c.heartbeat_ms, 500);
	ck_assert_uint_eq(c.job_deadline_ms, 90000);
	ck_assert_uint_eq(c.fd_park_ms, 1000);
	ck_assert_uint_eq(c.drain_ms, 100);
	ck_assert_uint_eq(c.copy_threads, 8);
	ck_assert_uint_eq(c.terminal_jobs, 1024);
	ck_assert(!c.l1_prefault);
	ck_assert_int_eq(c.allow_uid, 1000);
	ck_assert_str_eq(c.l2_path, "/var/lib/kvside/l2");
	ck_assert_uint_eq(c.l2_size, 512ull << 20);
	ck_assert_int_eq(c.l2_sync, KVS_L2_SYNC_NOMETA);
	ck_assert_str_eq(c.metrics_listen, "[::1]:9100");
	ck_assert_uint_eq(c.metrics_stall_ms, 3000);
	ck_assert_int_eq(c.log_level, KVS_LOG_DEBUG);
	ck_assert_int_eq(kvs_config_check(&c, err, sizeof(err)), 0);
}
END_TEST

START_TEST(good_partial_empty_and_nulls)
{
	kvs_server_config d, c;
	kvs_server_config_defaults(&d);
	c = d;
	char err[512];
	/* empty file, comments only, an explicit empty document: nothing changes */
	ck_assert_int_eq(kvs_config_load(&c, file_with(""), err, sizeof(err)), 0);
	ck_assert_int_eq(kvs_config_load(&c, file_with("# nothing\n\n"), err, sizeof(err)), 0);
	ck_assert_int_eq(kvs_config_load(&c, file_with("---\n{}\n...\n"), err, sizeof(err)), 0);
	all_equal(&c, &d);
	/* only the named settings change; null means empty / none where allowed */
	ck_assert_int_eq(kvs_config_load(&c, file_with("l1-size: 3M\nallow-uid: 7\n"), err, sizeof(err)), 0);
	ck_assert_int_eq(kvs_config_load(&c, file_with("allow-uid: ~\nl2-path:\nmetrics-listen: off\n"),
					 err, sizeof(err)), 0);
	ck_assert_uint_eq(c.l1_size, 3ull << 20);
	ck_assert_int_eq(c.allow_uid, -1);
	ck_assert_str_eq(c.l2_path, "");
	ck_assert_str_eq(c.metrics_listen, "");
	ck_assert_uint_eq(c.ttl_ms, d.ttl_ms);
	/* flow style is YAML too */
	ck_assert_int_eq(kvs_config_load(&c, file_with("{ttl-ms: 4000, prefault: false}\n"), err, sizeof(err)), 0);
	ck_assert_uint_eq(c.ttl_ms, 4000);
	ck_assert(!c.l1_prefault);
}
END_TEST

/* Each bad file must fail with -EINVAL and a message holding every needle. */
static const struct {
	const char *yaml;
	const char *needle[3];
} bad[] = {
	{"l1-size: 1G\nl1-sise: 2G\n", {":2:", "unknown setting 'l1-sise'"}},
	{"l1-size: 12X\n", {":1:", "l1-size", "'12X'"}},
	{"l1-size: 1K\n", {":1:", "l1-size", "between 1M"}},
	{"l1-size: -1G\n", {":1:", "l1-size"}},
	{"l1-size: 99999999999999999999\n", {":1:", "l1-size"}},
	{"l1-size:\n", {":1:", "l1-size", "no value"}},
	{"ttl-ms: 0\n", {":1:", "ttl-ms", "between 1 and 86400000"}},
	{"\n\nttl-ms: 10s\n", {":3:", "ttl-ms", "'10s'"}},
	{"copy-threads: 65\n", {":1:", "copy-threads"}},
	{"copy-spin-us: 10001\n", {":1:", "copy-spin-us", "between 0 and 10000"}},
	{"terminal-jobs: 0\n", {":1:", "terminal-jobs"}},
	{"prefault: maybe\n", {":1:", "prefault", "true or false"}},
	{"allow-uid: root\n", {":1:", "allow-uid"}},
	{"l2-sync: always\n", {":1:", "l2-sync", "full, nometa, none"}},
	{"log-level: verbose\n", {":1:", "log-level"}},
	{"log-format: xml\n", {":1:", "log-format", "text, json"}},
	{"broker-dir: ''\n", {":1:", "broker-dir", "empty"}},
	{"metrics-listen: 9464\n", {":1:", "metrics-listen", "HOST:PORT"}},
	{"metrics-listen: 'localhost:99999'\n", {":1:", "metrics-listen"}},
	{"metrics-listen: '::1:80'\n", {":1:", "metrics-listen"}},
	{"ttl-ms: 1000\nttl-ms: 2000\n", {":2:", "ttl-ms", "set twice"}},
	{"ttl-ms: 1000\nttl_ms: 2000\n", {":2:", "ttl-ms", "set twice"}},
	{"l1-size:\n  value: 1G\n", {":2:", "l1-size", "a mapping"}},
	{"listen: [a, b]\n", {":1:", "listen", "a list"}},
	{"- l1-size: 1G\n", {":1:", "expected a mapping"}},
	{"just text\n", {":1:", "expected a mapping"}},
	{"l1-size: 1G\n---\nl1-size: 2G\n", {":2:", "more than one"}},
	{"l1-size: [1G\n", {"l1-size", "a list"}},
	{"l1-size: \"1G\n", {"syntax error", "l1-size"}},
	{"l1-size: 1G\nttl-ms: 1: 2\n", {":2:", "syntax error"}},
	{"log-level: &x info\nl2-sync: *x\n", {":2:", "l2-sync", "an alias"}},
	/* a NUL inside a double-quoted string would cut the C string short */
	{"broker-dir: \"/tmp/kvs-x\\0/../../etc\"\n", {":1:", "broker-dir", "NUL"}},
	{"ttl-ms: 1000\nl2-path: \"/tmp/a\\0b\"\n", {":2:", "l2-path", "NUL"}},
	{"\"ttl-ms\\0x\": 1000\n", {":1:", "NUL"}},
};

START_TEST(bad_values_name_the_setting)
{
	kvs_server_config c;
	kvs_server_config_defaults(&c);
	char err[512];
	const char *p = file_with(bad[_i].yaml);
	err[0] = '\0';
	int r = kvs_config_load(&c, p, err, sizeof(err));
	ck_assert_msg(r == -EINVAL, "case %d: %d (%s)", _i, r, err);
	ck_assert_msg(strstr(err, p) == err, "case %d: message '%s' does not start with the path", _i, err);
	for (int n = 0; n < 3 && bad[_i].needle[n]; n++)
		ck_assert_msg(strstr(err, bad[_i].needle[n]), "case %d: '%s' lacks '%s'", _i, err,
			      bad[_i].needle[n]);
}
END_TEST

START_TEST(missing_file_and_set)
{
	kvs_server_config c;
	kvs_server_config_defaults(&c);
	char err[256];
	ck_assert_int_eq(kvs_config_load(&c, "/nonexistent/kvside.yaml", err, sizeof(err)), -ENOENT);
	ck_assert_ptr_nonnull(strstr(err, "/nonexistent/kvside.yaml"));
	ck_assert_int_eq(kvs_config_set(&c, "no-such", "1", err, sizeof(err)), -ENOENT);
	ck_assert_ptr_nonnull(strstr(err, "no-such"));
	/* failures leave the value untouched */
	uint64_t before = c.l1_size;
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", "1Q", err, sizeof(err)), -EINVAL);
	ck_assert_uint_eq(c.l1_size, before);
	/* suffix spellings */
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", "2048K", err, sizeof(err)), 0);
	ck_assert_uint_eq(c.l1_size, 2ull << 20);
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", "2MB", err, sizeof(err)), 0);
	ck_assert_uint_eq(c.l1_size, 2ull << 20);
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", "1Ti", err, sizeof(err)), 0);
	ck_assert_uint_eq(c.l1_size, 1ull << 40);
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", "3145728", err, sizeof(err)), 0);
	ck_assert_uint_eq(c.l1_size, 3ull << 20);
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", " 2M", err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", "+2M", err, sizeof(err)), -EINVAL);
	/* a string one byte too long for its field */
	char longv[600];
	memset(longv, 'a', sizeof(longv) - 1);
	longv[sizeof(longv) - 1] = '\0';
	ck_assert_int_eq(kvs_config_set(&c, "l2-path", longv, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "l2-path"));
}
END_TEST

START_TEST(cross_check)
{
	kvs_server_config c;
	kvs_server_config_defaults(&c);
	char err[256];
	c.heartbeat_ms = c.ttl_ms;
	ck_assert_int_eq(kvs_config_check(&c, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "heartbeat-ms"));
	ck_assert_ptr_nonnull(strstr(err, "ttl-ms"));
}
END_TEST

START_TEST(hostport)
{
	char h[64];
	unsigned port;
	ck_assert_int_eq(kvs_config_hostport("127.0.0.1:9464", h, sizeof(h), &port), 0);
	ck_assert_str_eq(h, "127.0.0.1");
	ck_assert_uint_eq(port, 9464);
	ck_assert_int_eq(kvs_config_hostport("[::1]:0", h, sizeof(h), &port), 0);
	ck_assert_str_eq(h, "::1");
	ck_assert_uint_eq(port, 0);
	ck_assert_int_eq(kvs_config_hostport("localhost:80", h, sizeof(h), &port), 0);
	ck_assert_str_eq(h, "localhost");
	ck_assert_int_eq(kvs_config_hostport(":80", h, sizeof(h), &port), -EINVAL);
	ck_assert_int_eq(kvs_config_hostport("host:", h, sizeof(h), &port), -EINVAL);
	ck_assert_int_eq(kvs_config_hostport("host:65536", h, sizeof(h), &port), -EINVAL);
	ck_assert_int_eq(kvs_config_hostport("[::1:80", h, sizeof(h), &port), -EINVAL);
	ck_assert_int_eq(kvs_config_hostport("[]:80", h, sizeof(h), &port), -EINVAL);
}
END_TEST

START_TEST(print_reads_back)
{
	kvs_server_config c, d;
	kvs_server_config_defaults(&c);
	char err[512];
	/* awkward strings survive quoting */
	ck_assert_int_eq(kvs_config_set(&c, "l2-path", "/tmp/a \"b\" \\c: #d", err, sizeof(err)), 0);
	ck_assert_int_eq(kvs_config_set(&c, "l1-size", "3145729", err, sizeof(err)), 0);
	ck_assert_int_eq(kvs_config_set(&c, "allow-uid", "0", err, sizeof(err)), 0);
	ck_assert_int_eq(kvs_config_set(&c, "l2-sync", "none", err, sizeof(err)), 0);
	char path[128];
	snprintf(path, sizeof(path), "%s/printed.yaml", tmpdir);
	FILE *f = fopen(path, "w");
	kvs_config_print(f, &c);
	fclose(f);
	memset(&d, 0, sizeof(d));
	kvs_server_config_defaults(&d);
	int r = kvs_config_load(&d, path, err, sizeof(err));
	ck_assert_msg(r == 0, "%s", err);
	all_equal(&c, &d);
	ck_assert_str_eq(d.l2_path, "/tmp/a \"b\" \\c: #d");
}
END_TEST

START_TEST(example_file_holds_the_defaults)
{
	const char *ex = getenv("KVS_EXAMPLE_CONFIG");
	ck_assert_msg(ex != NULL, "KVS_EXAMPLE_CONFIG not set");
	kvs_server_config d, c;
	kvs_server_config_defaults(&d);
	memset(&c, 0, sizeof(c));
	kvs_server_config_defaults(&c);
	/* start from values that differ everywhere, so every setting must be in the file */
	char err[512];
	for (const kvs_config_key *k = kvs_config_keys(); k->name; k++) {
		static const struct { const char *name, *val; } odd[] = {
			{"listen", "tcp://127.0.0.1:1"}, {"l1-size", "3M"}, {"ttl-ms", "7"},
			{"heartbeat-ms", "3"}, {"job-deadline-ms", "7"}, {"fd-park-ms", "7"},
			{"drain-ms", "7"}, {"copy-threads", "7"}, {"terminal-jobs", "7"},
			{"prefault", "false"}, {"allow-uid", "7"}, {"l2-path", "/x"}, {"l2-size", "5M"},
			{"l2-sync", "none"}, {"metrics-listen", "127.0.0.1:7"},
			{"metrics-stall-ms", "7"}, {"log-level", "error"}, {"log-format", "json"}, {"cuda-staging", "7M"},
			{"cuda-stage-min", "7K"}, {"max-sessions", "7"}, {"max-peer-queue", "7M"},
			{"max-queued", "9M"}, {"insecure-tcp", "true"}, {"authorized-keys", "/x"},
			{"copy-spin-us", "7"}};
		for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++)
			if (strcmp(odd[i].name, k->name) == 0)
				ck_assert_int_eq(kvs_config_set(&c, k->name, odd[i].val, err, sizeof(err)), 0);
	}
	int r = kvs_config_load(&c, ex, err, sizeof(err));
	ck_assert_msg(r == 0, "%s", err);
	/* broker-dir is commented out in the example: its default depends on
	 * the environment */
	snprintf(c.broker_dir, sizeof(c.broker_dir), "%s", d.broker_dir);
	snprintf(c.state_dir, sizeof(c.state_dir), "%s", d.state_dir); /* likewise */
	all_equal(&c, &d);
}
END_TEST

/* Runs the server binary with args; returns its exit status and its output. */
static int run_server(char *out, size_t cap, const char *const *args)
{
	const char *exe = getenv("KVS_SERVER");
	ck_assert_msg(exe != NULL, "KVS_SERVER not set");
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		const char *argv[32];
		int n = 0;
		argv[n++] = exe;
		for (; args[n - 1] && n < 31; n++)
			argv[n] = args[n - 1];
		argv[n] = NULL;
		dup2(pfd[1], 1);
		dup2(pfd[1], 2);
		close(pfd[0]);
		execv(exe, (char *const *)argv);
		_exit(127);
	}
	close(pfd[1]);
	size_t len = 0;
	ssize_t k;
	while (len + 1 < cap && (k = read(pfd[0], out + len, cap - 1 - len)) > 0)
		len += (size_t)k;
	out[len] = '\0';
	close(pfd[0]);
	int st;
	waitpid(pid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(command_line_overrides_file)
{
	char out[8192];
	char f[128];
	snprintf(f, sizeof(f), "%s", file_with("l1-size: 2G\nttl-ms: 5000\nlog-level: warn\nl2-sync: none\n"));
	/* the file applies; the command line wins wherever it is given */
	const char *a1[] = {"--config", f, "--l1-size", "3G", "--print-config", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a1), 0);
	ck_assert_ptr_nonnull(strstr(out, "\nl1-size: 3G\n"));
	ck_assert_ptr_nonnull(strstr(out, "\nttl-ms: 5000\n"));
	ck_assert_ptr_nonnull(strstr(out, "\nlog-level: warn\n"));
	ck_assert_ptr_nonnull(strstr(out, "\nl2-sync: none\n"));
	const char *a2[] = {"--l1-size", "3G", "--no-prefault", "--config", f, "--print-config", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a2), 0);
	ck_assert_ptr_nonnull(strstr(out, "\nl1-size: 3G\n"));
	ck_assert_ptr_nonnull(strstr(out, "\nprefault: false\n"));
	ck_assert_ptr_nonnull(strstr(out, "\nttl-ms: 5000\n"));
	/* the printed configuration, used as a file, prints the same */
	char printed[8192], again[8192];
	snprintf(printed, sizeof(printed), "%s", out);
	const char *p2 = file_with(printed);
	const char *a3[] = {"--config", p2, "--print-config", NULL};
	ck_assert_int_eq(run_server(again, sizeof(again), a3), 0);
	ck_assert_str_eq(again, printed);
	/* a bad file stops start-up with exit 2, naming the setting and line */
	const char *bf = file_with("ttl-ms: 100\ncopy-threads: lots\n");
	const char *a4[] = {"--config", bf, "--print-config", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a4), 2);
	ck_assert_ptr_nonnull(strstr(out, ":2: copy-threads: 'lots'"));
	/* a bad command-line value too */
	const char *a5[] = {"--config", f, "--ttl-ms", "soon", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a5), 2);
	ck_assert_ptr_nonnull(strstr(out, "--ttl-ms: 'soon'"));
	/* rules between settings apply to the merged result */
	const char *a6[] = {"--config", f, "--heartbeat-ms", "5000", "--print-config", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a6), 2);
	ck_assert_ptr_nonnull(strstr(out, "heartbeat-ms (5000) must be below ttl-ms (5000)"));
	const char *a7[] = {"--config", "/nonexistent.yaml", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a7), 2);
	ck_assert_ptr_nonnull(strstr(out, "/nonexistent.yaml"));
	/* a secret is said to be set, never printed */
	const char *a8[] = {"--config", f, "--l3-password", "s3cret-word", "--print-config", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a8), 0);
	ck_assert_ptr_nonnull(strstr(out, "\n# l3-password: set, not printed\n"));
	ck_assert_ptr_null(strstr(out, "s3cret-word"));
	const char *a9[] = {"--config", f, "--print-config", NULL};
	ck_assert_int_eq(run_server(out, sizeof(out), a9), 0);
	ck_assert_ptr_nonnull(strstr(out, "\nl3-password: \"\"\n"));
}
END_TEST

static Suite *config_suite(void)
{
	Suite *s = suite_create("config");
	TCase *tc = tcase_create("config");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, good_every_kind);
	tcase_add_test(tc, good_partial_empty_and_nulls);
	tcase_add_loop_test(tc, bad_values_name_the_setting, 0, (int)(sizeof(bad) / sizeof(bad[0])));
	tcase_add_test(tc, missing_file_and_set);
	tcase_add_test(tc, cross_check);
	tcase_add_test(tc, hostport);
	tcase_add_test(tc, print_reads_back);
	tcase_add_test(tc, example_file_holds_the_defaults);
	tcase_add_test(tc, command_line_overrides_file);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(config_suite)
