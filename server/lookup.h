/* Lookup (lookup.c): the longest cached prefix of a key list under the
 * hybrid prefix rule, its tiers, lookup pins (pin_ms) and L2 prefetches.
 * Main-loop thread only. */
#ifndef KVS_LOOKUP_H
#define KVS_LOOKUP_H

#include "server.h"

typedef struct kvs_lookup kvs_lookup;

int kvs_lookup_create(kvs_lookup **ret);
/* Unpins every lookup pin (L1 must still exist), frees. Accepts NULL. */
void kvs_lookup_destroy(kvs_server *srv, kvs_lookup *lk);
/* Drops expired lookup pins. */
void kvs_lookup_tick(kvs_server *srv);
int kvs__op_lookup(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

typedef struct kvs_lookup_stats {
	uint64_t lookups, keys, hits, hits_l2, prefetches, pins;
} kvs_lookup_stats;
void kvs_lookup_get_stats(const kvs_lookup *lk, kvs_lookup_stats *st);

#endif
