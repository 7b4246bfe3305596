/* Lookup; see lookup.h. */
#include "lookup.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "keys.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "promote.h"
#include "registry.h"
#include "reply.h"

typedef struct lpin {
	kvs_l1_obj *obj;
	uint64_t expires_ms;
} lpin;

struct kvs_lookup {
	lpin *pins; /* lookup pins (pin_ms), each holding one L1 pin */
	uint32_t n_pins, cap_pins;
	kvs_lookup_stats st;
};

int kvs_lookup_create(kvs_lookup **ret)
{
	*ret = calloc(1, sizeof(**ret));
	return *ret ? 0 : -ENOMEM;
}

void kvs_lookup_destroy(kvs_server *srv, kvs_lookup *lk)
{
	if (!lk)
		return;
	for (uint32_t i = 0; i < lk->n_pins; i++)
		kvs_l1_unpin(srv->l1, lk->pins[i].obj);
	free(lk->pins);
	free(lk);
}

void kvs_lookup_get_stats(const kvs_lookup *lk, kvs_lookup_stats *st)
{
	*st = lk->st;
	st->pins = lk->n_pins;
}

void kvs_lookup_tick(kvs_server *srv)
{
	kvs_lookup *lk = srv->lookup;
	for (uint32_t i = 0; i < lk->n_pins;) {
		if (lk->pins[i].expires_ms <= srv->now_ms) {
			kvs_l1_unpin(srv->l1, lk->pins[i].obj);
			lk->pins[i] = lk->pins[--lk->n_pins];
		} else {
			i++;
		}
	}
}

static void lookup_pin(kvs_server *srv, kvs_l1_obj *o, uint64_t pin_ms)
{
	kvs_lookup *lk = srv->lookup;
	if (lk->n_pins >= 1u << 20)
		return;
	if (lk->n_pins == lk->cap_pins) {
		uint32_t nc = lk->cap_pins ? 2 * lk->cap_pins : 256;
		lpin *np = realloc(lk->pins, nc * sizeof(*np));
		if (!np)
			return;
		lk->pins = np;
		lk->cap_pins = nc;
	}
	kvs_l1_pin(srv->l1, o);
	lk->pins[lk->n_pins++] = (lpin){o, srv->now_ms + pin_ms};
}

/* Does chunk k of group gi need to be present for a hit of n chunks? */
static bool needed(const kvs_geo *geo, uint32_t gi, uint32_t n, uint32_t k)
{
	if (geo->g[gi].kind == KVS_GROUP_RECURRENT)
		return k == n - 1; /* the state at the end of chunk n, nothing else */
	if (geo->g[gi].window > 0)
		return (int64_t)k >= (int64_t)n - geo->g[gi].window;
	return true;
}

/* 0 absent, 1 in L1 on every rank, 2 some rank only in L2 (or promoting) */
static int8_t presence(kvs_server *srv, kvs_session *s, const kvs_geo *geo, const uint8_t ns[16],
		       const uint8_t *keys, uint32_t gi, uint32_t k)
{
	int8_t v = 1;
	for (uint32_t r = 0; r < s->world && v; r++) {
		kvs_objkey key;
		kvs_l1_obj *o;
		kvs_obj_key(&key, ns, s->world, r, geo->g[gi].id, keys + (size_t)k * KVS_KEY_BYTES);
		if (kvs_promote_locate(srv->promote, &key, geo->g[gi].geom, geo->g[gi].obj_bytes, &o) != 0)
			v = 0;
		else if (!o)
			v = 2;
	}
	return v;
}

static bool is_full_attention(const kvs_geo *geo, uint32_t gi)
{
	return geo->g[gi].kind == KVS_GROUP_ATTENTION && geo->g[gi].window < 0;
}

/* The longest hit: pres[gi * N + k] caches presence (-1 = not asked yet). */
static uint32_t longest_hit(kvs_server *srv, kvs_session *s, const kvs_geo *geo, const uint8_t ns[16],
			    const kvs_msg *rq, int8_t *pres)
{
	uint32_t N = rq->n_keys;
#define PRES(gi, k) (pres[(gi) * N + (k)] >= 0 ? pres[(gi) * N + (k)] \
		     : (pres[(gi) * N + (k)] = presence(srv, s, geo, ns, rq->keys, (gi), (k))))
	/* upper bound: the leading run every full-attention group has */
	uint32_t A = N;
	for (uint32_t gi = 0; gi < geo->n; gi++)
		if (is_full_attention(geo, gi))
			for (uint32_t k = 0; k < A; k++)
				if (!PRES(gi, k)) {
					A = k;
					break;
				}
	for (uint32_t n = A; n >= 1; n--) {
		bool ok = true;
		for (uint32_t gi = 0; gi < geo->n && ok; gi++) {
			if (is_full_attention(geo, gi))
				continue; /* covered by A */
			for (uint32_t k = 0; k < n && ok; k++)
				if (needed(geo, gi, n, k))
					ok = PRES(gi, k) != 0;
		}
		if (ok)
			return n;
	}
#undef PRES
	return 0;
}

/* Tiers of a hit of n chunks; refreshes, pins (pin_ms) and prefetches
 * (L2 -> L1) what the hit needs. */
static void hit_tiers(kvs_server *srv, kvs_session *s, const kvs_geo *geo, const uint8_t ns[16],
		      const kvs_msg *rq, const int8_t *pres, uint32_t hits, uint8_t *tiers)
{
	kvs_lookup *lk = srv->lookup;
	uint32_t N = rq->n_keys;
	for (uint32_t k = 0; k < hits; k++) {
		tiers[k] = KVS_TIER_L1;
		for (uint32_t gi = 0; gi < geo->n; gi++) {
			if (!needed(geo, gi, hits, k))
				continue;
			if (pres[gi * N + k] == 2)
				tiers[k] = KVS_TIER_L2;
			for (uint32_t r = 0; r < s->world; r++) {
				kvs_objkey key;
				kvs_obj_key(&key, ns, s->world, r, geo->g[gi].id, rq->keys + (size_t)k * KVS_KEY_BYTES);
				kvs_l1_obj *o = kvs_l1_get(srv->l1, &key);
				if (o) {
					kvs_l1_touch(srv->l1, o);
					if (rq->pin_ms)
						lookup_pin(srv, o, rq->pin_ms);
				} else if (srv->l2) {
					kvs_l2_touch(srv->l2, &key);
					int err;
					if (rq->prefetch && !kvs_promote_running(srv->promote, &key) &&
					    kvs_promote_start(srv->promote, &key, geo->g[gi].geom, geo->g[gi].obj_bytes, &err))
						lk->st.prefetches++;
				}
			}
		}
		lk->st.hits_l2 += tiers[k] == KVS_TIER_L2;
	}
}

/* A prefix of n chunks hits only if, on every rank, every full-attention
 * group has all n chunks, every windowed group its last window_chunks of
 * them, and every recurrent group the state at the end of chunk n: state
 * from one prefix length is never spliced with attention KV of another. */
int kvs__op_lookup(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_lookup *lk = srv->lookup;
	lk->st.lookups++;
	lk->st.keys += rq->n_keys;
	kvs_geo geo;
	bool known = kvs_registry_geometry(srv->reg, srv->l2, s->id, s->ns, s->world, &geo);
	uint32_t N = rq->n_keys;
	uint8_t *tiers = calloc(N ? N : 1, 1);
	int8_t *pres = known ? malloc((size_t)geo.n * (N ? N : 1)) : NULL;
	if (!tiers || (known && !pres)) {
		free(tiers);
		free(pres);
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	}
	uint8_t ns[16];
	kvs_ns_digest(s->ns, ns);
	uint32_t hits = 0;
	if (known) {
		memset(pres, -1, (size_t)geo.n * N);
		hits = longest_hit(srv, s, &geo, ns, rq, pres);
		hit_tiers(srv, s, &geo, ns, rq, pres, hits, tiers);
	}
	lk->st.hits += hits;
	kvs_msg rep = {.op = KVS_OP_LOOKUP, .id = rq->id, .ok = true, .hits = hits, .tiers = tiers,
		       .n_tiers = hits};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	free(tiers);
	free(pres);
	return 0;
}
