/* Sessions (session.c): hello, heartbeat, bye, leases and reaping. */
#ifndef KVS_SESSION_H
#define KVS_SESSION_H

#include "server.h"

/* Removes s from the table, fails its open job parts, drops its
 * registrations, frees it. */
void kvs__session_close(kvs_server *srv, kvs_session *s, const char *why);
/* Closes every session whose lease ran out. */
void kvs__sessions_reap(kvs_server *srv);
int kvs__op_hello(kvs_server *srv, const void *ident, size_t ident_len, const kvs_msg *rq);
int kvs__op_heartbeat(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_bye(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
/* `lane`: the broker fd of rq's token becomes s's job lane (lane.h). */
int kvs__op_lane(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

#endif
