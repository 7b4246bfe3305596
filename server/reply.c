/* Replies and pushes: encode a message and send it to a ZeroMQ routing id or
 * to a session's latest one. Below every handler (handlers depend on it, it
 * depends on no handler). Main-loop thread only. */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "server"
#include "kvs_log.h"
#include "keys.h"
#include "reply.h"

int kvs__fail(kvs_server *srv, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(srv->errbuf, sizeof(srv->errbuf), fmt, ap);
	va_end(ap);
	return code;
}

static void free_frame(void *data, void *hint)
{
	(void)hint;
	free(data);
}

static void send_frames(kvs_server *srv, const void *ident, size_t ident_len, void *buf, size_t len)
{
	if (zmq_send(srv->router, ident, ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
		free(buf);
		return;
	}
	zmq_msg_t m;
	/* zero copy: ZeroMQ frees buf once sent */
	if (zmq_msg_init_data(&m, buf, len, free_frame, NULL) != 0) {
		free(buf);
		zmq_send(srv->router, "", 0, ZMQ_DONTWAIT);
		return;
	}
	if (zmq_msg_send(&m, srv->router, ZMQ_DONTWAIT) < 0)
		zmq_msg_close(&m);
}

void kvs__reply(kvs_server *srv, const void *ident, size_t ident_len, kvs_msg *rep)
{
	void *buf;
	size_t len;
	rep->is_reply = true;
	memcpy(rep->epoch, srv->epoch, KVS_EPOCH_BYTES);
	int r = kvs_proto_encode(rep, &buf, &len);
	if (r < 0) {
		kvs_err("cannot encode %s reply: %s", kvs_op_name(rep->op), kvs_strerror(r));
		kvs_msg e = {.op = rep->op, .id = rep->id, .is_reply = true, .ok = false,
			     .code = KVS_E_INTERNAL, .errmsg = kvs_str_c("reply could not be encoded")};
		memcpy(e.epoch, srv->epoch, KVS_EPOCH_BYTES);
		if (kvs_proto_encode(&e, &buf, &len) < 0)
			return;
		srv->st.errors[KVS_E_INTERNAL - KVS_E_BASE]++;
	}
	send_frames(srv, ident, ident_len, buf, len);
}

static void vreply_err(kvs_server *srv, const void *ident, size_t ident_len, kvs_op op, uint64_t id,
		       int code, const char *fmt, va_list ap)
{
	char text[KVS_MAX_ERRMSG];
	vsnprintf(text, sizeof(text), fmt, ap);
	if (!kvs_error_is_project(code))
		code = KVS_E_INTERNAL;
	srv->st.errors[code - KVS_E_BASE]++;
	srv->st.errors_by_op[op > KVS_OP_NONE && op < KVS_OP_COUNT_ ? op : KVS_OP_NONE][code - KVS_E_BASE]++;
	kvs_msg e = {.op = op, .id = id, .ok = false, .code = code,
		     .errmsg = kvs_str_c(text)};
	kvs_dbg("reply %s id=%llu %s: %s", kvs_op_name(op), (unsigned long long)id,
		kvs_error_name(code), text);
	kvs__reply(srv, ident, ident_len, &e);
}

void kvs__reply_err(kvs_server *srv, const void *ident, size_t ident_len, kvs_op op, uint64_t id,
		    int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vreply_err(srv, ident, ident_len, op, id, code, fmt, ap);
	va_end(ap);
}

void kvs__send_to_session(kvs_server *srv, uint64_t session, kvs_msg *msg)
{
	kvs_session *s = kvs__session_get(srv, session);
	if (s)
		kvs__reply(srv, s->ident, s->ident_len, msg);
}

void kvs__err_to_session(kvs_server *srv, uint64_t session, kvs_op op, uint64_t id, int code,
			 const char *fmt, ...)
{
	kvs_session *s = kvs__session_get(srv, session);
	if (!s)
		return;
	va_list ap;
	va_start(ap, fmt);
	vreply_err(srv, s->ident, s->ident_len, op, id, code, fmt, ap);
	va_end(ap);
}


/* ---- scheduler routes ---------------------------------------------------------
 * job_done goes to every scheduler session of the job's engine: an index by
 * engine (BLAKE2b-128 of its name) so a push costs the engine's schedulers,
 * not a scan of every session. */
typedef struct sched_route {
	uint8_t key[16]; /* digest of the engine name */
	kvs_session **s;
	uint32_t n, cap;
} sched_route;

int kvs__route_scheduler_add(kvs_server *srv, kvs_session *s)
{
	uint8_t key[16];
	kvs_ns_digest(s->engine, key);
	sched_route *rt = kvs_htab_get(srv->schedulers, key);
	if (!rt) {
		if (!(rt = calloc(1, sizeof(*rt))))
			return -ENOMEM;
		memcpy(rt->key, key, 16);
		if (kvs_htab_put(srv->schedulers, rt) < 0) {
			free(rt);
			return -ENOMEM;
		}
	}
	if (rt->n == rt->cap) {
		uint32_t nc = rt->cap ? 2 * rt->cap : 4;
		kvs_session **ns = realloc(rt->s, nc * sizeof(*ns));
		if (!ns) {
			if (!rt->n) {
				kvs_htab_del(srv->schedulers, key);
				free(rt);
			}
			return -ENOMEM;
		}
		rt->s = ns;
		rt->cap = nc;
	}
	rt->s[rt->n++] = s;
	return 0;
}

void kvs__route_scheduler_del(kvs_server *srv, kvs_session *s)
{
	uint8_t key[16];
	kvs_ns_digest(s->engine, key);
	sched_route *rt = kvs_htab_get(srv->schedulers, key);
	for (uint32_t i = 0; rt && i < rt->n; i++) {
		if (rt->s[i] != s)
			continue;
		rt->s[i] = rt->s[--rt->n];
		if (!rt->n) {
			kvs_htab_del(srv->schedulers, key);
			free(rt->s);
			free(rt);
		}
		return;
	}
}

void kvs__push_to_schedulers(kvs_server *srv, const char *engine, kvs_msg *msg)
{
	uint8_t key[16];
	kvs_ns_digest(engine, key);
	sched_route *rt = kvs_htab_get(srv->schedulers, key);
	for (uint32_t i = 0; rt && i < rt->n; i++)
		kvs__reply(srv, rt->s[i]->ident, rt->s[i]->ident_len, msg);
}

int kvs__routes_create(kvs_server *srv) { return kvs_htab_create(16, offsetof(sched_route, key), &srv->schedulers); }

void kvs__routes_destroy(kvs_server *srv)
{
	size_t pos = 0;
	sched_route *rt;
	while ((rt = kvs_htab_next(srv->schedulers, &pos)) != NULL) {
		free(rt->s);
		free(rt);
	}
	kvs_htab_destroy(srv->schedulers);
}
