/* Op handlers and the hooks by which the data-path modules (registry, jobs,
 * L1, copy pool) plug into the main loop. */
#ifndef KVS_OPS_H
#define KVS_OPS_H

#include "server.h"

int kvs__ops_init(kvs_server *srv);
void kvs__ops_fini(kvs_server *srv);
/* Periodic work: deadlines, drains. */
void kvs__ops_tick(kvs_server *srv);
/* The eventfd fired: collect finished copies. */
void kvs__ops_completions(kvs_server *srv);
/* A session is going away: fail its job parts, drop its registrations. */
void kvs__ops_session_gone(kvs_server *srv, kvs_session *s);
/* Open jobs the session participates in (heartbeat's pending_jobs). */
uint64_t kvs__ops_pending_jobs(kvs_server *srv, kvs_session *s);

/* The counters `stats` reports (and /metrics exports): fills c (at least
 * KVS_STATS_MAX entries; names of the errors.* entries are written to names,
 * which must outlive c) and returns how many. */
#define KVS_STATS_MAX 160
uint32_t kvs__stats_collect(kvs_server *srv, kvs_counter *c, char (*names)[32]);

int kvs__op_heartbeat(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_bye(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_stats(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_register(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_unregister(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_lookup(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_store(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_retrieve(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_complete(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_job_status(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

#endif
