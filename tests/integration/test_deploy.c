/* The deployment shape of the sidecar container, without a container
 * engine: kvside-server runs in its own mount and PID namespace
 * (`unshare --mount --pid --fork --mount-proc`), started by the container's
 * entrypoint (configs/entrypoint.sh, $KVS_ENTRYPOINT) as PID 1, seeing its
 * own filesystem where the host's test directory was, except the broker
 * directory, which is bind-mounted at the same path (the shared volume).
 * The ranks and the scheduler run outside, in the host namespaces: register
 * memfds, store, lookup, retrieve into other blocks, byte-exact; kvside-ctl
 * from outside; SIGTERM to the container's PID 1 stops it cleanly.
 *
 * Needs root (mount and PID namespaces) and util-linux unshare: otherwise the
 * test is skipped (exit 77) with the reason. CI runs as root. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check_main.h"
#include "harness.h"
#include "rank.h"

#define W 2
#define N 4

/* Runs in the new namespaces (sh -c): stage the volume, hide the host's test
 * directory under an empty tmpfs, put the volume back at the same path, then
 * become the container's entrypoint. $1 is the broker directory. */
static const char ns_script[] =
	"set -eu\n"
	"P=$1; shift\n"
	"parent=$(dirname \"$P\")\n"
	"mount --make-rprivate /\n"
	"mount -t tmpfs kvside-stage /mnt\n"
	"mkdir /mnt/vol\n"
	"mount --bind \"$P\" /mnt/vol\n"
	"mount -t tmpfs -o mode=0755 kvside-container \"$parent\"\n"
	"mkdir -p \"$P\"\n"
	"mount --move /mnt/vol \"$P\"\n"
	"umount /mnt\n"
	"if [ -e \"$parent/host-only\" ]; then echo 'host files visible' >&2; exit 1; fi\n"
	"exec \"$KVS_ENTRYPOINT\" \"$@\"\n";

static kvt_server S;
static pid_t unshare_pid, srv_pid;

static pid_t child_of(pid_t pid)
{
	char path[64], buf[64] = "";
	snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid, (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	if (!fgets(buf, sizeof(buf), f))
		buf[0] = '\0';
	fclose(f);
	return buf[0] ? (pid_t)atoi(buf) : -1;
}

static void ns_link(pid_t pid, const char *ns, char *out, size_t cap)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/ns/%s", (int)pid, ns);
	ssize_t n = readlink(path, out, cap - 1);
	ck_assert_int_gt(n, 0);
	out[n] = '\0';
}

static void start_container(void)
{
	kvt_server_init(&S, NULL);
	char marker[400];
	snprintf(marker, sizeof(marker), "%s/host-only", S.dir);
	int fd = open(marker, O_CREAT | O_WRONLY, 0600);
	ck_assert_int_ge(fd, 0);
	close(fd);
	ck_assert_int_eq(mkdir(S.run, 0700), 0);
	unshare_pid = fork();
	ck_assert_int_ge(unshare_pid, 0);
	if (unshare_pid == 0) {
		setenv("KVSIDE_SERVER", getenv("KVS_SERVER"), 1);
		setenv("KVSIDE_BROKER_DIR", S.run, 1);
		setenv("KVSIDE_CONFIG", "/nonexistent", 1);
		execlp("unshare", "unshare", "--mount", "--pid", "--fork", "--mount-proc",
		       "--propagation", "private", "/bin/sh", "-c", ns_script, "sh", S.run,
		       "--log-level", "warn", "--metrics-listen", "127.0.0.1:0", "--l1-size", "64M",
		       "--ttl-ms", "3000", "--heartbeat-ms", "100", "--no-prefault", (char *)NULL);
		_exit(127);
	}
	/* the server's sockets appear in the volume, seen from the host */
	char zmq[400];
	snprintf(zmq, sizeof(zmq), "%s/kvside.zmq", S.run);
	ck_assert_msg(KVT_WAIT(access(zmq, F_OK) == 0, 10000), "no %s from inside the namespaces", zmq);
	srv_pid = child_of(unshare_pid);
	ck_assert_int_gt(srv_pid, 0);
}

START_TEST(server_in_its_own_namespaces)
{
	start_container();
	/* the server runs in other mount and PID namespaces, as PID 1 there */
	char a[128], b[128];
	ns_link(srv_pid, "mnt", a, sizeof(a));
	ns_link(getpid(), "mnt", b, sizeof(b));
	ck_assert_str_ne(a, b);
	ns_link(srv_pid, "pid", a, sizeof(a));
	ns_link(getpid(), "pid", b, sizeof(b));
	ck_assert_str_ne(a, b);
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/status", (int)srv_pid);
	FILE *f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	bool pid1 = false;
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, "NSpid:", 6) == 0) {
			char *last = strrchr(line, '\t');
			pid1 = last && atoi(last + 1) == 1;
		}
	fclose(f);
	ck_assert_msg(pid1, "the server is not PID 1 of its namespace");
	fprintf(stderr, "server: host pid %d, PID 1 in its namespace, %s vs ours %s\n", (int)srv_pid, a, b);
	snprintf(path, sizeof(path), "/proc/%d/exe", (int)srv_pid);
	ssize_t n = readlink(path, line, sizeof(line) - 1);
	ck_assert_int_gt(n, 0);
	line[n] = '\0';
	ck_assert_ptr_nonnull(strstr(line, "kvside-server"));

	/* ranks and scheduler outside, through the shared directory only */
	kvs_client *sched = kvt_client(&S, "dep", KVS_ROLE_SCHEDULER, 0, W, NULL, NULL);
	ck_assert_ptr_nonnull(sched);
	kvt_rank r[W];
	for (uint32_t i = 0; i < W; i++)
		ck_assert_int_eq(kvt_rank_start(&r[i], &S, "dep", i, W), 0);
	ck_assert_uint_eq(kvt_stat(sched, "registrations"), W);
	ck_assert_uint_eq(kvt_stat(sched, "imports"), 2 * W);
	kvt_cmd cmds[] = {
		{.op = KVT_STORE, .job = 1, .n_keys = N, .src_base = 0},
		{.op = KVT_COMPLETE, .job = 1, .ok = 1},
	};
	for (size_t c = 0; c < 2; c++)
		for (uint32_t i = 0; i < W; i++) {
			kvt_res res;
			ck_assert_int_eq(kvt_rank_do(&r[i], &cmds[c], &res), 0);
			ck_assert_msg(res.code == 0, "rank %u: %s", i, kvs_strerror(res.code));
		}
	int st = -1;
	ck_assert_int_eq(kvs_job_wait(sched, 1, 5000, &st), 0);
	ck_assert_int_eq(st, KVS_JOB_COMMITTED);
	uint8_t keys[N * 32];
	for (uint32_t k = 0; k < N; k++)
		kvt_key(k, keys + 32 * k);
	uint64_t hits = 0;
	ck_assert_int_eq(kvs_lookup(sched, keys, N, false, 0, 3000, &hits, NULL), 0);
	ck_assert_uint_eq(hits, N);
	kvt_cmd back[] = {
		{.op = KVT_RETRIEVE, .job = 2, .n_keys = N, .dst_base = 32},
		{.op = KVT_COMPLETE, .job = 2, .ok = 1},
		{.op = KVT_VERIFY, .n_keys = N, .src_base = 0, .dst_base = 32},
	};
	for (size_t c = 0; c < 3; c++)
		for (uint32_t i = 0; i < W; i++) {
			kvt_res res;
			ck_assert_int_eq(kvt_rank_do(&r[i], &back[c], &res), 0);
			ck_assert_msg(res.code == 0, "rank %u: %s", i, kvs_strerror(res.code));
			if (back[c].op == KVT_VERIFY)
				ck_assert_msg(res.value == 0, "rank %u: %llu bytes differ", i,
					      (unsigned long long)res.value);
		}
	ck_assert_uint_eq(kvt_stat(sched, "retained_blocks"), 0);
	fprintf(stderr, "%d ranks outside: stored, looked up (%llu hits), retrieved byte-exact\n", W,
		(unsigned long long)hits);

	/* the operator's command works from outside too */
	const char *ctl = getenv("KVS_CTL");
	if (ctl) {
		char cmd[800];
		snprintf(cmd, sizeof(cmd), "'%s' --broker-dir '%s' status >/dev/null", ctl, S.run);
		ck_assert_int_eq(system(cmd), 0);
	}

	for (uint32_t i = 0; i < W; i++)
		kvt_rank_stop(&r[i]);
	kvs_client_close(sched);
	/* SIGTERM to the container's PID 1 (what `podman stop` does): clean exit */
	ck_assert_int_eq(kill(srv_pid, SIGTERM), 0);
	int ws;
	ck_assert_int_eq(waitpid(unshare_pid, &ws, 0), unshare_pid);
	ck_assert_msg(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "container exit status %d", ws);
	/* it cleaned up inside the volume */
	char sock[400];
	snprintf(sock, sizeof(sock), "%s/kvside.zmq", S.run);
	ck_assert_int_ne(access(sock, F_OK), 0);
	S.pid = 0;
	kvt_server_cleanup(&S);
}
END_TEST

/* The entrypoint refuses a volume the sidecar's UID does not own (the
 * broker would refuse the engine's fds later, far less clearly). */
START_TEST(entrypoint_checks_the_volume)
{
	char dir[] = "/tmp/kvt-ep-XXXXXX", cmd[1200];
	ck_assert_ptr_nonnull(mkdtemp(dir));
	ck_assert_int_eq(chown(dir, 12345, 12345), 0);
	snprintf(cmd, sizeof(cmd), "KVSIDE_BROKER_DIR='%s' KVSIDE_SERVER=/bin/false '%s' 2>'%s.err'", dir,
		 getenv("KVS_ENTRYPOINT"), dir);
	int st = system(cmd);
	ck_assert(WIFEXITED(st));
	ck_assert_int_eq(WEXITSTATUS(st), 78);
	char err[600] = "", path[64];
	snprintf(path, sizeof(path), "%s.err", dir);
	FILE *f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	size_t n = fread(err, 1, sizeof(err) - 1, f);
	err[n] = '\0';
	fclose(f);
	ck_assert_msg(strstr(err, "belongs to uid 12345 but kvside runs as uid 0"), "%s", err);
	/* owned by us: it execs the server with the broker directory */
	ck_assert_int_eq(chown(dir, 0, 0), 0);
	snprintf(cmd, sizeof(cmd), "KVSIDE_BROKER_DIR='%s' KVSIDE_CONFIG=/nonexistent KVSIDE_SERVER='%s' "
		 "'%s' --print-config > '%s.err'", dir, getenv("KVS_SERVER"), getenv("KVS_ENTRYPOINT"), dir);
	ck_assert_int_eq(system(cmd), 0);
	f = fopen(path, "r");
	n = fread(err, 1, sizeof(err) - 1, f);
	err[n] = '\0';
	fclose(f);
	char want[128];
	snprintf(want, sizeof(want), "broker-dir: \"%s\"", dir);
	ck_assert_msg(strstr(err, want), "%s", err);
	struct stat sb;
	ck_assert_int_eq(stat(dir, &sb), 0);
	ck_assert_int_eq(sb.st_mode & 0777, 0700);
	unlink(path);
	rmdir(dir);
}
END_TEST

static Suite *deploy_suite(void)
{
	Suite *s = suite_create("deploy");
	TCase *tc = tcase_create("deploy");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, server_in_its_own_namespaces);
	tcase_add_test(tc, entrypoint_checks_the_volume);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	if (geteuid() != 0) {
		printf("SKIP: needs root for mount and PID namespaces (unshare); CI runs as root\n");
		return 77;
	}
	if (!getenv("KVS_ENTRYPOINT") || !getenv("KVS_SERVER")) {
		printf("FAIL: KVS_ENTRYPOINT and KVS_SERVER must be set\n");
		return 1;
	}
	if (system("unshare --mount --pid --fork --mount-proc true >/dev/null 2>&1") != 0) {
		printf("SKIP: `unshare --mount --pid --fork` does not work here (util-linux missing, "
		       "or no CAP_SYS_ADMIN in this container)\n");
		return 77;
	}
	SRunner *sr = srunner_create(deploy_suite());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
