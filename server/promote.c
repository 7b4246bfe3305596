/* L2 -> L1 and L3 -> L1 promotions; see promote.h. */
#include "promote.h"

#include <errno.h>
#include <stdlib.h>

#include "kvs_error.h"
#include "kvs_htab.h"
#include "kvs_types.h"

typedef struct waiter {
	kvs_promote_cb cb;
	void *arg;
} waiter;

/* One promotion in flight. Invariant: obj is RESERVED until the read ends. */
typedef struct promo {
	kvs_objkey key; /* table key */
	kvs_l1_obj *obj;
	uint64_t geom;  /* the layout it reads (its length is obj's) */
	waiter *waiters;
	uint32_t n_waiters;
} promo;

struct kvs_promote {
	kvs_l1 *l1;
	kvs_l2 *l2;
	kvs_l3 *l3;
	kvs_htab *running; /* promo by object key */
	kvs_promote_stats st;
};

int kvs_promote_create(kvs_l1 *l1, kvs_l2 *l2, kvs_l3 *l3, kvs_promote **ret)
{
	kvs_promote *p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->l1 = l1;
	p->l2 = l2;
	p->l3 = l3;
	int r = kvs_htab_create(sizeof(kvs_objkey), offsetof(promo, key), &p->running);
	if (r) {
		free(p);
		return r;
	}
	*ret = p;
	return 0;
}

void kvs_promote_destroy(kvs_promote *p)
{
	if (!p)
		return;
	kvs_htab_destroy(p->running);
	free(p);
}

/* The tier a promotion of key would read: KVS_TIER_L2, KVS_TIER_L3, or -1. */
static int source_tier(kvs_promote *p, const kvs_objkey *key, uint64_t geom, uint64_t want_len)
{
	uint64_t len = 0;
	if (p->l2 && kvs_l2_contains(p->l2, key, geom, &len) == 0 && len == want_len)
		return KVS_TIER_L2;
	if (p->l3 && kvs_l3_known(p->l3, key, geom, want_len))
		return KVS_TIER_L3;
	return -1;
}

int kvs_promote_locate(kvs_promote *p, const kvs_objkey *key, uint64_t geom, uint64_t want_len,
		       kvs_l1_obj **ret_l1, int *ret_tier)
{
	int tier_none;
	if (!ret_tier)
		ret_tier = &tier_none;
	*ret_tier = KVS_TIER_L1;
	*ret_l1 = kvs_l1_get(p->l1, key);
	if (*ret_l1) {
		/* an object of another layout (the namespace re-registered with a
		 * different geometry) is never copied from: a miss */
		if (kvs_l1_len(*ret_l1) != want_len) {
			*ret_l1 = NULL;
			return KVS_E_MISS;
		}
		return 0;
	}
	const promo *pr = kvs_htab_get(p->running, key);
	*ret_tier = KVS_TIER_L2;
	if (pr) /* being promoted right now: usable only with the same layout */
		return pr->geom == geom && kvs_l1_len(pr->obj) == want_len ? 0 : KVS_E_MISS;
	int t = source_tier(p, key, geom, want_len);
	if (t < 0)
		return KVS_E_MISS;
	*ret_tier = t;
	return 0;
}

kvs_l1_obj *kvs_promote_start(kvs_promote *p, const kvs_objkey *key, uint64_t geom, uint64_t len, int *err)
{
	promo *pr = kvs_htab_get(p->running, key);
	if (pr) {
		/* a promotion of another layout fills an object no copy of this
		 * layout may read: not available, like a store in flight */
		if (pr->geom != geom || kvs_l1_len(pr->obj) != len) {
			*err = KVS_E_MISS;
			return NULL;
		}
		return pr->obj;
	}
	int tier = source_tier(p, key, geom, len);
	if (tier < 0 && p->l2)
		tier = KVS_TIER_L2; /* not seen there now; the read says (a miss fails the waiters) */
	if (tier < 0) {
		*err = KVS_E_MISS;
		return NULL;
	}
	pr = calloc(1, sizeof(*pr));
	if (!pr) {
		*err = KVS_E_INTERNAL;
		return NULL;
	}
	pr->key = *key;
	pr->geom = geom;
	int r = kvs_l1_reserve(p->l1, key, len, &pr->obj);
	if (r) {
		free(pr);
		/* -EBUSY: a store of the same object is in flight: not available yet */
		*err = r == KVS_E_NOSPACE ? KVS_E_NOSPACE : r == -EBUSY ? KVS_E_MISS : KVS_E_INTERNAL;
		return NULL;
	}
	int rr = kvs_htab_put(p->running, pr) < 0 ? -ENOMEM
		 : tier == KVS_TIER_L2 ? kvs_l2_read(p->l2, key, geom, kvs_l1_data(pr->obj), len, pr)
		 : kvs_l3_read(p->l3, key, geom, kvs_l1_data(pr->obj), len, pr);
	if (rr != 0) {
		kvs_htab_del(p->running, key);
		kvs_l1_abort(p->l1, pr->obj);
		free(pr);
		*err = KVS_E_INTERNAL;
		return NULL;
	}
	p->st.promotions++;
	p->st.promotions_l3 += tier == KVS_TIER_L3;
	return pr->obj;
}

int kvs_promote_wait(kvs_promote *p, const kvs_objkey *key, kvs_promote_cb cb, void *arg)
{
	promo *pr = kvs_htab_get(p->running, key);
	if (!pr)
		return -ENOENT;
	waiter *w = realloc(pr->waiters, (pr->n_waiters + 1) * sizeof(*w));
	if (!w)
		return -ENOMEM;
	pr->waiters = w;
	pr->waiters[pr->n_waiters++] = (waiter){cb, arg};
	return 0;
}

bool kvs_promote_running(const kvs_promote *p, const kvs_objkey *key)
{
	return kvs_htab_get(p->running, key) != NULL;
}

void kvs_promote_done(kvs_promote *p, void *cookie, int result)
{
	promo *pr = cookie;
	kvs_htab_del(p->running, &pr->key);
	if (result == 0) {
		kvs_l1_commit(p->l1, pr->obj);
	} else {
		kvs_l1_abort(p->l1, pr->obj);
		p->st.failures++;
	}
	for (uint32_t i = 0; i < pr->n_waiters; i++) {
		if (result == 0) {
			kvs_l1_pin(p->l1, pr->obj);
			pr->waiters[i].cb(pr->waiters[i].arg, pr->obj, 0);
		} else {
			pr->waiters[i].cb(pr->waiters[i].arg, NULL, KVS_E_MISS);
		}
	}
	free(pr->waiters);
	free(pr);
}

uint64_t kvs_promote_pending(const kvs_promote *p) { return kvs_htab_count(p->running); }

void kvs_promote_get_stats(const kvs_promote *p, kvs_promote_stats *st) { *st = p->st; }
