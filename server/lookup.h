/* Lookup (lookup.c): the longest cached prefix of a key list under the
 * hybrid prefix rule, its tiers, lookup pins (pin_ms), L2 and L3 prefetches,
 * and lookups waiting for L3's answer (at most l3-lookup-ms).
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
/* L3's probe for a waiting lookup ended (cookie as given to kvs_l3_probe;
 * what L3 holds is known to it by now): the lookup is answered, unless its
 * time ran out before. */
void kvs_lookup_l3_done(kvs_server *srv, void *cookie, int result);

typedef struct kvs_lookup_stats {
	uint64_t lookups, keys, hits, hits_l2, hits_l3, prefetches, pins;
	uint64_t l3_deferred; /* lookups that waited for L3 */
	uint64_t l3_timeouts; /* of those: answered without L3 after l3-lookup-ms */
	uint64_t l3_skipped;  /* lookups that did not ask L3: too many probes queued */
	uint64_t l3_errors;   /* probes that failed (the cluster down, a time-out) */
	uint64_t l3_waiting;  /* lookups waiting now */
} kvs_lookup_stats;
void kvs_lookup_get_stats(const kvs_lookup *lk, kvs_lookup_stats *st);

#endif
