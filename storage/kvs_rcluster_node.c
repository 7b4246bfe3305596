/* kvs_rcluster's nodes and connections: the node table, lazy connections
 * with AUTH, every wait bounded by io_timeout_ms and the call's deadline,
 * failures sorted into time-outs, stale connections and nodes down
 * (kvs_rcluster_impl.h). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "kvs_error.h"
#include "kvs_rcluster_impl.h"

int64_t kvs__rcl_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void kvs__rcl_set_err(kvs_rcluster *c, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
}

/* ---- nodes ---------------------------------------------------------------- */

/* "host:port", "[v6]:port"; an empty host is allowed (Redis 7 sends ":port"
 * for "the node you asked"). Returns 0 or -EINVAL. */
int kvs__rcl_parse_hostport(const char *s, size_t len, char host[HOST_MAX], int *ret_port)
{
	const char *colon, *h = s;
	size_t hl;
	if (len && s[0] == '[') {
		const char *rb = memchr(s, ']', len);
		if (!rb || (size_t)(rb - s) + 1 >= len || rb[1] != ':')
			return -EINVAL;
		h = s + 1, hl = (size_t)(rb - s) - 1, colon = rb + 1;
	} else {
		colon = NULL;
		for (size_t i = len; i > 0; i--)
			if (s[i - 1] == ':') {
				colon = s + i - 1;
				break;
			}
		if (!colon)
			return -EINVAL;
		hl = (size_t)(colon - s);
	}
	if (hl >= HOST_MAX)
		return -EINVAL;
	const char *p = colon + 1, *end = s + len;
	if (p == end || end - p > 5)
		return -EINVAL;
	int port = 0;
	for (; p < end; p++) {
		if (*p < '0' || *p > '9')
			return -EINVAL;
		port = port * 10 + (*p - '0');
	}
	if (port < 1 || port > 65535)
		return -EINVAL;
	memcpy(host, h, hl);
	host[hl] = '\0';
	*ret_port = port;
	return 0;
}

/* The node's index, added if new; NODE_NONE if the table cannot grow. */
uint16_t kvs__rcl_node_get(kvs_rcluster *c, const char *host, int port)
{
	for (uint32_t i = 0; i < c->n_nodes; i++)
		if (c->nodes[i].port == port && strcmp(c->nodes[i].host, host) == 0)
			return (uint16_t)i;
	if (c->n_nodes >= MAX_NODES)
		return NODE_NONE;
	if (c->n_nodes == c->cap_nodes) {
		uint32_t cap = c->cap_nodes ? c->cap_nodes * 2 : 16;
		rnode *n = realloc(c->nodes, cap * sizeof(*n));
		if (!n)
			return NODE_NONE;
		c->nodes = n, c->cap_nodes = cap;
	}
	rnode *n = &c->nodes[c->n_nodes];
	memset(n, 0, sizeof(*n));
	snprintf(n->host, sizeof(n->host), "%s", host);
	n->port = port;
	CNT(c, nodes, 1);
	return (uint16_t)c->n_nodes++;
}

void kvs__rcl_node_drop(rnode *n)
{
	if (n->ctx)
		redisFree(n->ctx);
	n->ctx = NULL;
	n->used = false;
	n->tmo_ms = 0;
}

/* Marks ni down; the failure's text (already in c->err, "host:port: why")
 * is kept for the fast failures that follow. */
static void node_down(kvs_rcluster *c, uint32_t ni)
{
	rnode *n = &c->nodes[ni];
	char pre[HOST_MAX + 16];
	int pl = snprintf(pre, sizeof(pre), "%s:%d: ", n->host, n->port);
	const char *why = strncmp(c->err, pre, (size_t)pl) == 0 ? c->err + pl : c->err;
	snprintf(n->why, sizeof(n->why), "%.*s", (int)sizeof(n->why) - 1, why);
	kvs__rcl_node_drop(n);
	uint32_t shift = n->fails < DOWN_MAX_SHIFT ? n->fails : DOWN_MAX_SHIFT;
	n->fails++;
	n->down_until = kvs__rcl_now_ms() + ((int64_t)c->cfg.down_ms << shift);
	CNT(c, nodes_down, 1);
}

/* ---- one connection: waits bounded by io_timeout_ms and the deadline ------- */

/* The call's time ran out before a wait could start: the connection may be
 * between a request and its reply, so it is dropped (the node is not blamed). */
static int deadline_out(kvs_rcluster *c, uint32_t ni)
{
	rnode *n = &c->nodes[ni];
	kvs__rcl_set_err(c, "%s:%d: the call's time (op_timeout_ms %u) ran out", n->host, n->port,
			 c->cfg.op_timeout_ms);
	kvs__rcl_node_drop(n);
	CNT(c, timeouts, 1);
	return KVS_E_TIMEOUT;
}

/* Sets the socket time-out to min(io_timeout_ms, time left), touching the
 * socket only when that changes (so not at all while time is plentiful). */
static int set_wait(kvs_rcluster *c, uint32_t ni, int64_t deadline)
{
	rnode *n = &c->nodes[ni];
	int64_t left = deadline - kvs__rcl_now_ms();
	if (left <= 0)
		return deadline_out(c, ni);
	uint32_t want = left < c->cfg.io_timeout_ms ? (uint32_t)left : c->cfg.io_timeout_ms;
	if (want != n->tmo_ms) {
		struct timeval tv = {.tv_sec = want / 1000, .tv_usec = (suseconds_t)(want % 1000) * 1000};
		if (redisSetTimeout(n->ctx, tv) != REDIS_OK) {
			kvs__rcl_set_err(c, "%s:%d: setting the socket time-out: %s", n->host, n->port, n->ctx->errstr);
			kvs__rcl_node_drop(n);
			return -EHOSTDOWN;
		}
		n->tmo_ms = want;
	}
	return 0;
}

/* A hiredis call on ni's context failed (e: errno right after it). A time-out
 * or a failure on a new connection marks the node down; a failure on a
 * connection that has worked before drops it only (RC_STALE: the caller
 * reopens once). */
static int ctx_failed(kvs_rcluster *c, uint32_t ni, int e)
{
	rnode *n = &c->nodes[ni];
	bool timeout = n->ctx->err == REDIS_ERR_IO && (e == EAGAIN || e == EWOULDBLOCK || e == ETIMEDOUT);
	kvs__rcl_set_err(c, "%s:%d: %s", n->host, n->port,
			 timeout ? "no answer within the time-out" : n->ctx->errstr);
	if (timeout) {
		CNT(c, timeouts, 1);
		node_down(c, ni);
		return KVS_E_TIMEOUT;
	}
	if (n->ctx->err == REDIS_ERR_OOM) {
		kvs__rcl_node_drop(n);
		return -ENOMEM;
	}
	if (n->used) {
		kvs__rcl_node_drop(n);
		return RC_STALE;
	}
	node_down(c, ni);
	return -EHOSTDOWN;
}

int kvs__rcl_conn_flush(kvs_rcluster *c, uint32_t ni, int64_t deadline)
{
	int done = 0;
	do {
		int rc = set_wait(c, ni, deadline);
		if (rc)
			return rc;
		if (redisBufferWrite(c->nodes[ni].ctx, &done) != REDIS_OK)
			return ctx_failed(c, ni, errno);
	} while (!done);
	return 0;
}

/* The next reply on ni's connection, reading as needed. */
int kvs__rcl_conn_read(kvs_rcluster *c, uint32_t ni, int64_t deadline, redisReply **ret)
{
	void *r = NULL;
	if (redisGetReplyFromReader(c->nodes[ni].ctx, &r) != REDIS_OK)
		return ctx_failed(c, ni, errno);
	while (!r) {
		int rc = set_wait(c, ni, deadline);
		if (rc)
			return rc;
		if (redisBufferRead(c->nodes[ni].ctx) != REDIS_OK)
			return ctx_failed(c, ni, errno);
		if (redisGetReplyFromReader(c->nodes[ni].ctx, &r) != REDIS_OK)
			return ctx_failed(c, ni, errno);
	}
	*ret = r;
	return 0;
}

bool kvs__rcl_err_is(const redisReply *r, const char *prefix)
{
	size_t n = strlen(prefix);
	return r->len >= n && memcmp(r->str, prefix, n) == 0 && (r->len == n || r->str[n] == ' ');
}

/* The code for an error reply that is not a redirection; its text goes to
 * last_error. */
int kvs__rcl_reply_error(kvs_rcluster *c, uint32_t ni, const redisReply *r)
{
	kvs__rcl_set_err(c, "%s:%d: %.*s", c->nodes[ni].host, c->nodes[ni].port, (int)(r->len > 300 ? 300 : r->len),
			 r->str);
	if (kvs__rcl_err_is(r, "CLUSTERDOWN") || kvs__rcl_err_is(r, "LOADING") || kvs__rcl_err_is(r, "MASTERDOWN"))
		return -EHOSTDOWN;
	if (kvs__rcl_err_is(r, "NOAUTH") || kvs__rcl_err_is(r, "WRONGPASS") || kvs__rcl_err_is(r, "NOPERM"))
		return KVS_E_AUTH;
	if (kvs__rcl_err_is(r, "OOM"))
		return KVS_E_NOSPACE;
	return -EREMOTEIO;
}

/* Opens ni's connection if it has none (and authenticates). -EHOSTDOWN at
 * once while the node is down. */
int kvs__rcl_node_connect(kvs_rcluster *c, uint32_t ni, int64_t deadline)
{
	rnode *n = &c->nodes[ni];
	if (n->ctx)
		return 0;
	int64_t now = kvs__rcl_now_ms();
	if (n->down_until > now) {
		kvs__rcl_set_err(c, "%s:%d is down (%s; tried again in %lld ms)", n->host, n->port, n->why,
			(long long)(n->down_until - now));
		return -EHOSTDOWN;
	}
	if (deadline - now <= 0) {
		kvs__rcl_set_err(c, "%s:%d: the call's time (op_timeout_ms %u) ran out", n->host, n->port,
				 c->cfg.op_timeout_ms);
		CNT(c, timeouts, 1);
		return KVS_E_TIMEOUT;
	}
	uint32_t ms = c->cfg.connect_timeout_ms;
	if (deadline - now < ms)
		ms = (uint32_t)(deadline - now);
	struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (suseconds_t)(ms % 1000) * 1000};
	redisContext *ctx = redisConnectWithTimeout(n->host, n->port, tv);
	int e = errno;
	if (!ctx) {
		kvs__rcl_set_err(c, "%s:%d: out of memory", n->host, n->port);
		return -ENOMEM;
	}
	if (ctx->err) {
		bool timeout = e == ETIMEDOUT || strstr(ctx->errstr, "timed out");
		kvs__rcl_set_err(c, "%s:%d: %s", n->host, n->port, ctx->errstr);
		redisFree(ctx);
		node_down(c, ni);
		if (timeout)
			CNT(c, timeouts, 1);
		return timeout ? KVS_E_TIMEOUT : -EHOSTDOWN;
	}
	n->ctx = ctx, n->used = false, n->tmo_ms = 0;
	CNT(c, connects, 1);
	if (!c->password)
		return 0;
	const char *argv[3] = {"AUTH", c->user, c->password};
	size_t lens[3] = {4, c->user ? strlen(c->user) : 0, strlen(c->password)};
	int argc = 3;
	if (!c->user)
		argv[1] = argv[2], lens[1] = lens[2], argc = 2;
	if (redisAppendCommandArgv(ctx, argc, argv, lens) != REDIS_OK) {
		kvs__rcl_node_drop(n);
		return -ENOMEM;
	}
	redisReply *r = NULL;
	int rc = kvs__rcl_conn_flush(c, ni, deadline);
	if (!rc)
		rc = kvs__rcl_conn_read(c, ni, deadline, &r);
	if (rc)
		return rc == RC_STALE ? -EHOSTDOWN : rc;
	if (r->type == REDIS_REPLY_ERROR) {
		kvs__rcl_set_err(c, "%s:%d: AUTH refused: %.*s", n->host, n->port, (int)(r->len > 200 ? 200 : r->len),
				 r->str);
		freeReplyObject(r);
		kvs__rcl_node_drop(n);
		return KVS_E_AUTH;
	}
	freeReplyObject(r);
	return 0;
}

int kvs__rcl_append(kvs_rcluster *c, uint32_t ni, int argc, const char **argv, const size_t *lens)
{
	if (redisAppendCommandArgv(c->nodes[ni].ctx, argc, argv, lens) != REDIS_OK) {
		kvs__rcl_set_err(c, "out of memory formatting a command");
		kvs__rcl_node_drop(&c->nodes[ni]);
		return -ENOMEM;
	}
	return 0;
}

/* Sends one command to ni (ASKING first if asking) and reads its reply into
 * *ret (any type, error replies included). A stale connection is reopened
 * once. */
int kvs__rcl_node_exec(kvs_rcluster *c, uint32_t ni, bool asking, int argc, const char **argv,
		       const size_t *lens, size_t payload, int64_t deadline, redisReply **ret)
{
	static const char *ask_argv[1] = {"ASKING"};
	static const size_t ask_len[1] = {6};
	for (int attempt = 0;; attempt++) {
		int rc = kvs__rcl_node_connect(c, ni, deadline);
		if (rc)
			return rc;
		if (asking && (rc = kvs__rcl_append(c, ni, 1, ask_argv, ask_len)))
			return rc;
		if ((rc = kvs__rcl_append(c, ni, argc, argv, lens)))
			return rc;
		CNT(c, commands, 1);
		CNT(c, bytes_out, payload);
		redisReply *r = NULL;
		rc = kvs__rcl_conn_flush(c, ni, deadline);
		if (!rc && asking && !(rc = kvs__rcl_conn_read(c, ni, deadline, &r))) {
			freeReplyObject(r); /* ASKING's +OK (were it refused, the command's reply says so too) */
			r = NULL;
		}
		if (!rc)
			rc = kvs__rcl_conn_read(c, ni, deadline, &r);
		if (!rc) {
			c->nodes[ni].used = true, c->nodes[ni].fails = 0;
			*ret = r;
			return 0;
		}
		if (rc != RC_STALE)
			return rc;
		if (attempt > 0)
			return -EHOSTDOWN;
	}
}
