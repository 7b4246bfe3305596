/* The server and client half of the test harness; see harness.h. */
#include "harness.h"

#include <errno.h>
#include <dirent.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

uint64_t kvt_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int server_init(kvt_server *s, const char *parent)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->dir, sizeof(s->dir), "%s/kvt-XXXXXX", parent);
	if (!mkdtemp(s->dir))
		return -1;
	snprintf(s->run, sizeof(s->run), "%s/run", s->dir);
	s->log_level = "warn";
	s->ns = "test-model";
	s->timeout_ms = 3000;
	return 0;
}

void kvt_server_init(kvt_server *s, ...)
{
	if (server_init(s, "/tmp") != 0)
		abort();
	va_list ap;
	va_start(ap, s);
	const char *a;
	while ((a = va_arg(ap, const char *)) != NULL && s->n_extra < KVT_MAX_EXTRA)
		snprintf(s->extra[s->n_extra++], sizeof(s->extra[0]), "%s", a);
	va_end(ap);
}

int kvt_server_init_in(kvt_server *s, const char *parent, char *const *extra)
{
	if (server_init(s, parent) != 0)
		return -1;
	for (int i = 0; extra && extra[i] && s->n_extra < KVT_MAX_EXTRA; i++)
		snprintf(s->extra[s->n_extra++], sizeof(s->extra[0]), "%s", extra[i]);
	return 0;
}

int kvt_server_spawn(kvt_server *s)
{
	const char *exe = s->exe ? s->exe : getenv("KVS_SERVER");
	if (!exe) {
		fprintf(stderr, "KVS_SERVER not set\n");
		return -1;
	}
	pid_t pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		char *argv[48];
		int n = 0;
		/* KVT_SERVER_WRAPPER (e.g. "valgrind --leak-check=full
		 * --error-exitcode=99") runs the server under a tool */
		char *wrap = getenv("KVT_SERVER_WRAPPER") ? strdup(getenv("KVT_SERVER_WRAPPER")) : NULL;
		for (char *tok = wrap ? strtok(wrap, " ") : NULL; tok && n < 20; tok = strtok(NULL, " "))
			argv[n++] = tok;
		argv[n++] = (char *)exe;
		argv[n++] = "--broker-dir";
		argv[n++] = s->run;
		/* each server its own metrics port (tests may override) */
		argv[n++] = "--metrics-listen";
		argv[n++] = "127.0.0.1:0";
		for (int i = 0; i < s->n_extra; i++)
			argv[n++] = s->extra[i];
		if (!getenv("KVT_VERBOSE") && s->log_level) {
			argv[n++] = "--log-level";
			argv[n++] = (char *)s->log_level;
		}
		argv[n] = NULL;
		execvp(argv[0], argv);
		_exit(127);
	}
	s->pid = pid;
	return 0;
}

int kvt_server_start(kvt_server *s)
{
	if (kvt_server_spawn(s) != 0)
		return -1;
	/* 20 s: an ASan server on a loaded two-core CI machine once took over 5 s
	 * to answer its first hello (the server exiting ends the wait at once) */
	uint64_t t0 = kvt_now_ms(), deadline = t0 + (getenv("KVT_SERVER_WRAPPER") ? 30000 : 20000);
	bool sock = false;
	while (kvt_now_ms() < deadline) {
		char path[400];
		snprintf(path, sizeof(path), "%s/kvside.zmq", s->run);
		if (access(path, F_OK) == 0) {
			sock = true;
			kvs_client *c = kvt_client(s, "probe", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
			if (c) {
				kvs_client_close(c);
				return 0;
			}
		}
		int st;
		if (waitpid(s->pid, &st, WNOHANG) == s->pid) {
			s->pid = 0;
			fprintf(stderr, "kvt_server_start: the server exited at start (wait status %d)\n", st);
			return -1;
		}
		usleep(20000);
	}
	fprintf(stderr, "kvt_server_start: no answer to a hello within %llu ms (socket %s)\n",
		(unsigned long long)(kvt_now_ms() - t0), sock ? "present" : "absent");
	return -1;
}

int kvt_server_stop(kvt_server *s)
{
	if (s->pid <= 0)
		return -1;
	kill(s->pid, SIGTERM);
	uint64_t deadline = kvt_now_ms() + 30000;
	int st = 0;
	while (kvt_now_ms() < deadline) {
		if (waitpid(s->pid, &st, WNOHANG) == s->pid) {
			s->pid = 0;
			return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
		}
		usleep(10000);
	}
	kvt_server_kill(s);
	return -1;
}

void kvt_server_kill(kvt_server *s)
{
	if (s->pid <= 0)
		return;
	kill(s->pid, SIGKILL);
	waitpid(s->pid, NULL, 0);
	s->pid = 0;
}

void kvt_server_cleanup(kvt_server *s)
{
	kvt_server_kill(s);
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->dir);
	if (system(cmd) != 0)
		fprintf(stderr, "cleanup of %s failed\n", s->dir);
}

int kvt_fd_count(pid_t pid)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	DIR *d = opendir(path);
	if (!d)
		return -1;
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d)) != NULL)
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n;
}

kvs_client *kvt_client(const kvt_server *s, const char *engine, int role, uint32_t rank, uint32_t world,
		       kvs_event_fn ev, void *arg)
{
	kvs_client_config cfg = {.broker_dir = s->run, .engine = engine, .ns = s->ns, .role = role,
				 .rank = rank, .world = world, .timeout_ms = s->timeout_ms,
				 .on_event = ev, .event_arg = arg};
	kvs_client *c = NULL;
	if (kvs_client_open(&cfg, &c) != 0)
		return NULL;
	return c;
}

kvs_client *kvt_client_ns(const kvt_server *s, const char *engine, const char *ns, int role, uint32_t rank,
			  uint32_t world)
{
	kvs_client_config cfg = {.broker_dir = s->run, .engine = engine, .ns = ns, .role = role,
				 .rank = rank, .world = world, .timeout_ms = s->timeout_ms};
	kvs_client *c = NULL;
	if (kvs_client_open(&cfg, &c) != 0)
		return NULL;
	return c;
}

uint64_t kvt_stat_ms(kvs_client *c, const char *name, int timeout_ms)
{
	kvs_stat_out st[256];
	uint32_t n = 0;
	if (kvs_stats(c, timeout_ms, st, 256, &n) != 0)
		return UINT64_MAX;
	return kvs_stat_find(st, n, name);
}

uint64_t kvt_stat(kvs_client *c, const char *name) { return kvt_stat_ms(c, name, 3000); }
