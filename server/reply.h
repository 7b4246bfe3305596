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


/* Scheduler sessions by engine (pushes of job_done). add: 0 or -ENOMEM;
 * del: a session not added is ignored. */
int kvs__route_scheduler_add(kvs_server *srv, kvs_session *s);
void kvs__route_scheduler_del(kvs_server *srv, kvs_session *s);
/* Sends msg to every scheduler session of engine. */
void kvs__push_to_schedulers(kvs_server *srv, const char *engine, kvs_msg *msg);
int kvs__routes_create(kvs_server *srv);
/* Bytes waiting for each peer (protocol §1): create (after the config is
 * set), the next peer cut off since the last call (its routing id and
 * queued bytes; false when none), the tick, counters, destroy (after the
 * ROUTER socket is closed). */
int kvs__peers_create(kvs_server *srv);
bool kvs__peers_overflowed(kvs_server *srv, uint8_t *ident, size_t *ident_len, uint64_t *queued);
void kvs__peers_tick(kvs_server *srv);
uint64_t kvs__peers_queued(const kvs_server *srv);
uint64_t kvs__peers_closed(const kvs_server *srv);
void kvs__peers_destroy(kvs_server *srv);
void kvs__routes_destroy(kvs_server *srv); /* sessions are gone by then */

#endif
