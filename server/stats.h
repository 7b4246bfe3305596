/* The server's counters (stats.c). */
#ifndef KVS_STATS_H
#define KVS_STATS_H

#include "server.h"

/* The counters `stats` reports (and /metrics exports): fills c (at least
 * KVS_STATS_MAX entries; names of the errors.* entries are written to names,
 * which must outlive c) and returns how many. */
#define KVS_STATS_MAX 200
uint32_t kvs__stats_collect(kvs_server *srv, kvs_counter *c, char (*names)[32]);
int kvs__op_stats(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

#endif
