/* Integration-test harness; see harness.h. */
#include "harness.h"

#include <errno.h>
#include <dirent.h>
#include <poll.h>
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

void kvt_server_init(kvt_server *s, ...)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->dir, sizeof(s->dir), "/tmp/kvt-XXXXXX");
	if (!mkdtemp(s->dir))
		abort();
	snprintf(s->run, sizeof(s->run), "%s/run", s->dir);
	va_list ap;
	va_start(ap, s);
	const char *a;
	while ((a = va_arg(ap, const char *)) != NULL && s->n_extra < 16)
		snprintf(s->extra[s->n_extra++], sizeof(s->extra[0]), "%s", a);
	va_end(ap);
}

int kvt_server_start(kvt_server *s)
{
	const char *exe = getenv("KVS_SERVER");
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
		if (!getenv("KVT_VERBOSE")) {
			argv[n++] = "--log-level";
			argv[n++] = "warn";
		}
		argv[n] = NULL;
		execvp(argv[0], argv);
		_exit(127);
	}
	s->pid = pid;
	uint64_t deadline = kvt_now_ms() + (getenv("KVT_SERVER_WRAPPER") ? 30000 : 5000);
	while (kvt_now_ms() < deadline) {
		char path[400];
		snprintf(path, sizeof(path), "%s/kvside.zmq", s->run);
		if (access(path, F_OK) == 0) {
			kvs_client *c = kvt_client(s, "probe", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
			if (c) {
				kvs_client_close(c);
				return 0;
			}
		}
		int st;
		if (waitpid(pid, &st, WNOHANG) == pid) {
			s->pid = 0;
			return -1;
		}
		usleep(20000);
	}
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

kvs_client *kvt_client(kvt_server *s, const char *engine, int role, uint32_t rank, uint32_t world,
		       kvs_event_fn ev, void *arg)
{
	kvs_client_config cfg = {.broker_dir = s->run, .engine = engine, .ns = "test-model",
				 .role = role, .rank = rank, .world = world, .timeout_ms = 3000,
				 .on_event = ev, .event_arg = arg};
	kvs_client *c = NULL;
	if (kvs_client_open(&cfg, &c) != 0)
		return NULL;
	return c;
}

uint64_t kvt_stat(kvs_client *c, const char *name)
{
	kvs_stat_out st[256];
	uint32_t n = 0;
	if (kvs_stats(c, 3000, st, 256, &n) != 0)
		return UINT64_MAX;
	return kvs_stat_find(st, n, name);
}

int kvt_pipe_call(int cmd_fd, int res_fd, const void *cmd, size_t cmd_len, void *res, size_t res_len,
		  int timeout_ms)
{
	if (cmd && write(cmd_fd, cmd, cmd_len) != (ssize_t)cmd_len)
		return -1;
	struct pollfd p = {.fd = res_fd, .events = POLLIN};
	if (poll(&p, 1, timeout_ms) != 1 || read(res_fd, res, res_len) != (ssize_t)res_len)
		return -1;
	return 0;
}
