/* Replies and pushes: encode a message and send it to a ZeroMQ routing id or
 * to a session's latest one. Below every handler (handlers depend on it, it
 * depends on no handler). Main-loop thread only. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "server"
#include "kvs_log.h"
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

