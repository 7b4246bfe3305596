/* Integration-test harness: starts the real kvside-server binary (path in
 * $KVS_SERVER) in a private temporary run directory, opens real clients,
 * counts the server's fds, stops or kills it. */
#ifndef KVT_HARNESS_H
#define KVT_HARNESS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvside.h"

typedef struct kvt_server {
	pid_t pid;
	char dir[256];    /* temp dir, removed by kvt_server_cleanup */
	char run[300];    /* broker dir */
	char extra[16][320];
	int n_extra;
} kvt_server;

/* Prepares a temp dir and extra server args ("--ttl-ms", "500", ...; NULL-terminated). */
void kvt_server_init(kvt_server *s, ...);
/* Starts the server and waits until it answers a hello (5 s). 0 or -1. */
int kvt_server_start(kvt_server *s);
/* SIGTERM, waits up to 10 s; returns the exit status (or -1). */
int kvt_server_stop(kvt_server *s);
void kvt_server_kill(kvt_server *s);
void kvt_server_cleanup(kvt_server *s);
int kvt_fd_count(pid_t pid);

/* Opens a client to s; NULL on failure. */
kvs_client *kvt_client(kvt_server *s, const char *engine, int role, uint32_t rank,
		       uint32_t world, kvs_event_fn ev, void *arg);
/* Counter by name from the server (UINT64_MAX on failure). */
uint64_t kvt_stat(kvs_client *c, const char *name);
uint64_t kvt_now_ms(void);
/* One exchange with a child process over its command/result pipes: writes
 * cmd (unless NULL), then waits up to timeout_ms for exactly res_len bytes.
 * 0, or -1 on a short write, timeout or short read. */
int kvt_pipe_call(int cmd_fd, int res_fd, const void *cmd, size_t cmd_len, void *res, size_t res_len,
		  int timeout_ms);
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
