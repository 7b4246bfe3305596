/* Replies and pushes (reply.c): the one way handlers answer. */
#ifndef KVS_REPLY_H
#define KVS_REPLY_H

#include "server.h"

/* Handlers return 0 once they have replied (or deferred their reply), or a
 * kvs error code after kvs__fail() set the text; the dispatcher then sends
 * the error reply. Either way every request is answered exactly once. */
int kvs__fail(kvs_server *srv, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Replies. The `ident` variants address a ZeroMQ routing id directly; the
 * session variants use the session's latest routing id (no-op if the session
 * is gone). Sending never blocks: a client that cannot receive loses the
 * message. */
void kvs__reply(kvs_server *srv, const void *ident, size_t ident_len, kvs_msg *rep);
void kvs__reply_err(kvs_server *srv, const void *ident, size_t ident_len, kvs_op op,
		    uint64_t id, int code, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
void kvs__send_to_session(kvs_server *srv, uint64_t session, kvs_msg *msg);
void kvs__err_to_session(kvs_server *srv, uint64_t session, kvs_op op, uint64_t id, int code,
			 const char *fmt, ...) __attribute__((format(printf, 6, 7)));

#endif
