/* The `admin` op (kvside-ctl): status, drain, resume, clear. Main-loop
 * thread only.
 *
 * drain: the server stops accepting new jobs (a store or retrieve part of a
 * job it does not know is answered E_BUSY; parts of open jobs and repeats
 * of terminal ones are still served, so jobs already started can finish),
 * then answers once no job is open or after the request's timeout_ms,
 * whichever comes first; `drained` says which. The draining state stays
 * until `resume`.
 * clear: drops every L1 object not pinned and every L2 object; refused
 * (E_BUSY) while a job is open or L2 writes are queued, since those would
 * bring objects back. */
#ifndef KVS_ADMIN_H
#define KVS_ADMIN_H

#include "server.h"

int kvs__op_admin(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
/* Called by the dispatcher before a handler: 0 to go on, or a code after
 * kvs__fail (new job parts while draining). */
int kvs__admin_gate(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
/* Answers drain requests whose jobs finished or whose time ran out. */
void kvs__admin_tick(kvs_server *srv);
/* Drops pending drain requests unanswered (shutdown). */
void kvs__admin_fini(kvs_server *srv);

#endif
