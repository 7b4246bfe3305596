/* kvs_rcluster's private header: the client's state, shared by
 * kvs_rcluster.c (key slots, the slot map, routing, the public calls) and
 * kvs_rcluster_node.c (nodes, connections, waits bounded by the time-outs).
 * Not installed; nothing outside these two files includes it. */
#ifndef KVS_RCLUSTER_IMPL_H
#define KVS_RCLUSTER_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

#include "kvs_rcluster.h"

#define NODE_NONE UINT16_MAX
#define MAX_NODES 4096 /* distinct addresses ever seen; far above any real cluster */
#define HOST_MAX 256
#define RC_STALE (-ECONNRESET) /* internal: a reused connection failed; reopen once */
#define DOWN_MAX_SHIFT 3 /* a node failing again and again is left alone up to 8 x down_ms */

typedef struct rnode {
	char host[HOST_MAX];
	int port;
	redisContext *ctx;  /* NULL until first use, and after any failure */
	bool used;          /* ctx has answered a command (a failure then may be a stale connection) */
	uint32_t tmo_ms;    /* the socket time-out now set on ctx (0: none set yet) */
	int64_t down_until; /* monotonic ms; not contacted before it. ctx != NULL implies not down */
	uint32_t fails;     /* failures since its last answer: the down period doubles with each */
	char why[120];      /* the failure that marked it down */
} rnode;

/* One entry of the last CLUSTER SLOTS read. A MOVED since then changes the
 * slot map only, not these (so replicas here may be stale for that slot). */
typedef struct rrange {
	uint16_t start, end; /* inclusive */
	uint16_t master;
	uint16_t n_replicas;
	uint16_t *replicas;
} rrange;

typedef struct rstats {
	_Atomic uint64_t calls, commands, bytes_out, bytes_in, moved, ask, refreshes, refresh_failures;
	_Atomic uint64_t connects, nodes_down, errors, timeouts, nodes;
} rstats;

struct kvs_rcluster {
	kvs_rcluster_config cfg; /* seeds NULL; user/password point at the copies below */
	char *user, *password;
	/* Nodes are never removed: an index stays valid for the client's life
	 * (the table holds every address seen, at most MAX_NODES). */
	rnode *nodes;
	uint32_t n_nodes, cap_nodes;
	uint16_t slot[KVS_RCLUSTER_SLOTS]; /* master of each slot (a nodes index) or NODE_NONE */
	rrange *ranges;
	uint32_t n_ranges;
	int64_t last_refresh;    /* ms of the last refresh attempt (rate limit) */
	uint32_t refresh_cursor; /* the node that answered the last refresh: asked first next time */
	char err[384];
	rstats st; /* written by the owner thread only, read by any (get_stats) */
};

/* Counters have one writer: a relaxed load and store, no locked add. */
#define CNT(c, f, v)                                                                                    \
	atomic_store_explicit(&(c)->st.f, atomic_load_explicit(&(c)->st.f, memory_order_relaxed) + (v),  \
			      memory_order_relaxed)

/* ---- kvs_rcluster_node.c ---------------------------------------------------- */

int64_t kvs__rcl_now_ms(void);
/* Sets the text kvs_rcluster_last_error returns. */
__attribute__((format(printf, 2, 3))) void kvs__rcl_set_err(kvs_rcluster *c, const char *fmt, ...);
/* "host:port" or "[v6]:port" (the host may be empty): 0 or -EINVAL. */
int kvs__rcl_parse_hostport(const char *s, size_t len, char host[HOST_MAX], int *ret_port);
/* The node's index, added if new; NODE_NONE if the table cannot grow. */
uint16_t kvs__rcl_node_get(kvs_rcluster *c, const char *host, int port);
/* Closes the node's connection, if any (the node is not marked down). */
void kvs__rcl_node_drop(rnode *n);
/* Opens ni's connection if it has none (and authenticates): 0, -EHOSTDOWN at
 * once while the node is down, KVS_E_TIMEOUT, KVS_E_AUTH, -ENOMEM. */
int kvs__rcl_node_connect(kvs_rcluster *c, uint32_t ni, int64_t deadline);
/* Appends a command to ni's (open) connection's output: 0 or -ENOMEM. */
int kvs__rcl_append(kvs_rcluster *c, uint32_t ni, int argc, const char **argv, const size_t *lens);
/* Writes ni's pending output / reads its next reply, each wait bounded by
 * io_timeout_ms and the deadline. Failures: KVS_E_TIMEOUT (the node is marked
 * down), RC_STALE (a connection that had answered before failed: dropped,
 * the caller may reopen once), -EHOSTDOWN (a new connection failed: marked
 * down), -ENOMEM. The connection is closed after any failure. */
int kvs__rcl_conn_flush(kvs_rcluster *c, uint32_t ni, int64_t deadline);
int kvs__rcl_conn_read(kvs_rcluster *c, uint32_t ni, int64_t deadline, redisReply **ret);
/* One command on ni (ASKING first if asking), its reply (error replies
 * included) into *ret; a stale connection is reopened once. Codes as above,
 * RC_STALE excepted. */
int kvs__rcl_node_exec(kvs_rcluster *c, uint32_t ni, bool asking, int argc, const char **argv,
		       const size_t *lens, size_t payload, int64_t deadline, redisReply **ret);
/* Is r an error reply whose first word is prefix? */
bool kvs__rcl_err_is(const redisReply *r, const char *prefix);
/* The code for an error reply that is not a redirection (text to last_error). */
int kvs__rcl_reply_error(kvs_rcluster *c, uint32_t ni, const redisReply *r);

#endif
