/* The test harness shared by the integration tests, the GPU test and
 * kvside-bench: starts the real kvside-server binary in a private temporary
 * run directory, opens real clients, reads counters, counts the server's fds,
 * stops or kills it; and the fork/pipe core of every simulated rank process
 * (kvt_proc: rank.c, hybrid_rank.c, the GPU test's and the bench's ranks). */
#ifndef KVT_HARNESS_H
#define KVT_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#include "kvside.h"

#define KVT_MAX_EXTRA 16

typedef struct kvt_server {
	pid_t pid;
	char dir[256];    /* temp dir, removed by kvt_server_cleanup */
	char run[300];    /* broker dir */
	char extra[KVT_MAX_EXTRA][320]; /* extra server arguments */
	int n_extra;
	/* Set by kvt_server_init*; a caller may change them before starting. */
	const char *exe;       /* server binary; NULL: $KVS_SERVER */
	const char *log_level; /* --log-level unless $KVT_VERBOSE is set: "warn" */
	const char *ns;        /* namespace of kvt_client: "test-model" */
	int timeout_ms;        /* request timeout of kvt_client: 3000 */
} kvt_server;

/* Prepares a temp dir under /tmp and extra server args ("--ttl-ms", "500",
 * ...; NULL-terminated). Aborts if the dir cannot be made. */
void kvt_server_init(kvt_server *s, ...);
/* The same with the temp dir under parent and the extra args as a
 * NULL-terminated array (or NULL). 0, or -1 if the dir cannot be made. */
int kvt_server_init_in(kvt_server *s, const char *parent, char *const *extra);
/* Forks and execs the server (under $KVT_SERVER_WRAPPER, e.g. "valgrind
 * --error-exitcode=99", when set) with --broker-dir, --metrics-listen
 * 127.0.0.1:0 (each server its own port; extra args may override), the
 * extra args and --log-level; returns at once. 0 or -1. */
int kvt_server_spawn(kvt_server *s);
/* kvt_server_spawn, then waits until the server answers a hello (20 s; 30 s
 * under a wrapper). 0 or -1 (the server exited or never answered; which of
 * the two is printed to stderr). */
int kvt_server_start(kvt_server *s);
/* SIGTERM, waits up to 30 s; returns the exit status (128 + signal when
 * killed by one), or -1 when there was no server or it had to be killed. */
int kvt_server_stop(kvt_server *s);
void kvt_server_kill(kvt_server *s);
/* Kills the server if still running and removes the temp dir. */
void kvt_server_cleanup(kvt_server *s);
int kvt_fd_count(pid_t pid);

/* Opens a client to s (namespace s->ns, request timeout s->timeout_ms);
 * NULL on failure. */
kvs_client *kvt_client(const kvt_server *s, const char *engine, int role, uint32_t rank,
		       uint32_t world, kvs_event_fn ev, void *arg);
/* The same with an explicit namespace and no event callback. */
kvs_client *kvt_client_ns(const kvt_server *s, const char *engine, const char *ns, int role, uint32_t rank,
			  uint32_t world);
/* Counter by name from the server (UINT64_MAX on failure), waiting up to
 * 3 s / timeout_ms for the stats reply. */
uint64_t kvt_stat(kvs_client *c, const char *name);
uint64_t kvt_stat_ms(kvs_client *c, const char *name, int timeout_ms);
uint64_t kvt_now_ms(void);

/* ---- rank processes: the fork/pipe core ---------------------------------- */

/* A forked child driven over two pipes: the parent writes commands to
 * cmd_fd and reads results from res_fd. */
typedef struct kvt_proc {
	pid_t pid;
	int cmd_fd, res_fd;
} kvt_proc;

/* The child's body: reads commands from cmd_fd, writes results to res_fd,
 * and must end with _exit() (never return). */
typedef void (*kvt_proc_fn)(void *arg, int cmd_fd, int res_fd);

/* Forks a child running fn(arg, ...). In the child, the parent-side pipe
 * ends of every other running kvt_proc and the fds given to kvt_proc_track
 * are closed first (so a child sees EOF when the test dies, and keeps no
 * other rank's memory), except the n_keep fds in keep. 0 or -1. */
int kvt_proc_start(kvt_proc *p, kvt_proc_fn fn, void *arg, const int *keep, int n_keep);
/* Fds of the parent (e.g. a rank's memfds) that other children must not
 * inherit; untrack before closing them. */
void kvt_proc_track(int fd);
void kvt_proc_untrack(int fd);
/* One exchange: writes cmd (unless NULL), then waits up to timeout_ms for
 * exactly res_len bytes. 0, or -1 on a short write, timeout or short read. */
int kvt_proc_call(kvt_proc *p, const void *cmd, size_t cmd_len, void *res, size_t res_len, int timeout_ms);
/* Sends exit_cmd, waits up to 5 s for the child to exit, kills it
 * otherwise; closes the pipes. No-op when the child is gone already. */
void kvt_proc_stop(kvt_proc *p, const void *exit_cmd, size_t exit_len);
/* SIGKILL, reap, close the pipes. */
void kvt_proc_kill(kvt_proc *p);
/* Waits for the child to exit by itself (no time limit), closes the pipes;
 * its wait status, or -1. */
int kvt_proc_wait(kvt_proc *p);

/* Polls cond until true or timeout_ms; evaluates to whether it became true. */
#define KVT_WAIT(cond, timeout_ms)                                                  \
	__extension__({                                                             \
		uint64_t kvt_deadline_ = kvt_now_ms() + (uint64_t)(timeout_ms);     \
		bool kvt_ok_;                                                       \
		while (!(kvt_ok_ = (cond)) && kvt_now_ms() < kvt_deadline_)         \
			usleep(10000);                                              \
		kvt_ok_;                                                            \
	})
#endif
