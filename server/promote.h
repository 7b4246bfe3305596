/* Promotions (promote.c): L2 -> L1 and L3 -> L1 copies of objects a
 * retrieve or a prefetching lookup needs, one per object however many parts wait for it,
 * and where an object can be found across the tiers. Main-loop thread only.
 *
 * Ownership: a promotion reserves its L1 object until the tier's read ends;
 * then the object is committed (or aborted on failure) and every waiter is
 * called back with it pinned once for that waiter (or with NULL and the
 * failure). The promotion table never reaches into its waiters: it reports
 * through their callbacks. */
#ifndef KVS_PROMOTE_H
#define KVS_PROMOTE_H

#include <stdbool.h>
#include <stdint.h>

#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_l3.h"

typedef struct kvs_promote kvs_promote;

/* A waiter's callback: obj is committed and pinned for the waiter (result
 * 0), or NULL with result KVS_E_MISS (the read failed: dropped, corrupt). */
typedef void (*kvs_promote_cb)(void *waiter, kvs_l1_obj *obj, int result);

/* l2 and l3 may be NULL (without either, nothing is ever promoted). An
 * object is read from L2 when L2 holds it, else from L3 when L3 is known to
 * hold it (kvs_l3_known). 0 or -ENOMEM. */
int kvs_promote_create(kvs_l1 *l1, kvs_l2 *l2, kvs_l3 *l3, kvs_promote **ret);
/* Promotions must have ended (kvs_promote_pending() == 0). Accepts NULL. */
void kvs_promote_destroy(kvs_promote *p);

/* Where the object is: 0 with *ret_l1 set (in L1), 0 with *ret_l1 NULL
 * (being promoted with this geometry and length, or in L2 with want_len
 * bytes, or known to be in L3), or KVS_E_MISS (absent, or of another length
 * or geometry: another layout is never copied from). *ret_tier (may be
 * NULL) gets the tier it would come from: KVS_TIER_L1, KVS_TIER_L2 (L2 or a
 * promotion running), KVS_TIER_L3. */
int kvs_promote_locate(kvs_promote *p, const kvs_objkey *key, uint64_t geom, uint64_t want_len,
		       kvs_l1_obj **ret_l1, int *ret_tier);
/* Starts the promotion of key (or finds the running one of the same geometry
 * and length) and returns the reserved L1 object the read fills (its data is
 * where copies will read from). NULL with *err: KVS_E_NOSPACE (no room in
 * L1), KVS_E_MISS (a store of the object is in flight, or a promotion of it
 * with another geometry or length), KVS_E_INTERNAL. */
kvs_l1_obj *kvs_promote_start(kvs_promote *p, const kvs_objkey *key, uint64_t geom, uint64_t len, int *err);
/* Adds a waiter to the running promotion of key. 0, -ENOENT (none running)
 * or -ENOMEM (nothing added). */
int kvs_promote_wait(kvs_promote *p, const kvs_objkey *key, kvs_promote_cb cb, void *waiter);
bool kvs_promote_running(const kvs_promote *p, const kvs_objkey *key);
/* The tier's read of a promotion ended (cookie as given to kvs_l2_read or
 * kvs_l3_read). */
void kvs_promote_done(kvs_promote *p, void *cookie, int result);
uint64_t kvs_promote_pending(const kvs_promote *p);

typedef struct kvs_promote_stats {
	uint64_t promotions, failures;
	uint64_t promotions_l3; /* of promotions: read from L3 */
} kvs_promote_stats;
void kvs_promote_get_stats(const kvs_promote *p, kvs_promote_stats *st);

#endif
