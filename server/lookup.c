/* Lookup; see lookup.h. */
#include "lookup.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "keys.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_l3.h"
#include "promote.h"
#include "registry.h"
#include "reply.h"
#include "session.h"
#include "writeback.h"

/* Probes in the L3 prober's queue beyond which lookups do not ask L3 (a slow
 * cluster must not build a backlog that answers come too late for). */
#define MAX_PROBES_QUEUED 64

typedef struct lpin {
	kvs_l1_obj *obj;
	uint64_t expires_ms;
} lpin;

/* A lookup waiting for L3's answer (its probe's cookie). Invariant: on the
 * waits list, in creation order (so in expiry order), until its probe
 * completes; answered once, by the probe or by its expiry, whichever
 * comes first. */
typedef struct lwait {
	struct lwait *prev, *next;
	uint64_t sid, req_id;
	uint8_t *keys; /* copy of the request's n_keys chunk keys */
	uint32_t n_keys;
	bool prefetch;
	uint64_t pin_ms;
	uint64_t expires_ms;
	bool answered;
} lwait;

struct kvs_lookup {
	lpin *pins; /* lookup pins (pin_ms), each holding one L1 pin */
	uint32_t n_pins, cap_pins;
	lwait *waits_head, *waits_tail;
	uint32_t n_waits;
	kvs_lookup_stats st;
};

static void wait_unlink(kvs_lookup *lk, lwait *w)
{
	if (w->prev)
		w->prev->next = w->next;
	else
		lk->waits_head = w->next;
	if (w->next)
		w->next->prev = w->prev;
	else
		lk->waits_tail = w->prev;
	lk->n_waits--;
	free(w->keys);
	free(w);
}

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
	while (lk->waits_head) /* their probes are dropped with L3 (closed after this) */
		wait_unlink(lk, lk->waits_head);
	free(lk);
}

void kvs_lookup_get_stats(const kvs_lookup *lk, kvs_lookup_stats *st)
{
	*st = lk->st;
	st->pins = lk->n_pins;
	st->l3_waiting = lk->n_waits;
}

static void answer_wait(kvs_server *srv, lwait *w);

void kvs_lookup_tick(kvs_server *srv)
{
	kvs_lookup *lk = srv->lookup;
	/* lookups whose L3 answer is late answer from L1 and L2 (and what L3
	 * said before); their probes still teach what L3 holds */
	for (lwait *w = lk->waits_head; w && w->expires_ms <= srv->now_ms; w = w->next)
		if (!w->answered) {
			lk->st.l3_timeouts++;
			answer_wait(srv, w);
		}
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

/* 0 absent, 1 in L1 on every rank, 2 some rank only in L2 (or promoting),
 * 3 some rank only in L3 */
static int8_t presence(kvs_server *srv, kvs_session *s, const kvs_geo *geo, const uint8_t ns[16],
		       const uint8_t *keys, uint32_t gi, uint32_t k)
{
	int8_t v = 1;
	for (uint32_t r = 0; r < s->world && v; r++) {
		kvs_objkey key;
		kvs_l1_obj *o;
		int tier;
		kvs_obj_key(&key, ns, s->world, r, geo->g[gi].id, keys + (size_t)k * KVS_KEY_BYTES);
		if (kvs_promote_locate(srv->promote, &key, geo->g[gi].geom, geo->g[gi].obj_bytes, &o, &tier) != 0)
			v = 0;
		else if (tier == KVS_TIER_L3)
			v = 3;
		else if (!o && v < 2)
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
			if (pres[gi * N + k] == 3)
				tiers[k] = KVS_TIER_L3;
			else if (pres[gi * N + k] == 2 && tiers[k] == KVS_TIER_L1)
				tiers[k] = KVS_TIER_L2;
			for (uint32_t r = 0; r < s->world; r++) {
				kvs_objkey key;
				kvs_obj_key(&key, ns, s->world, r, geo->g[gi].id, rq->keys + (size_t)k * KVS_KEY_BYTES);
				kvs_l1_obj *o = kvs_l1_get(srv->l1, &key);
				if (o) {
					kvs_l1_touch(srv->l1, o);
					if (rq->pin_ms)
						lookup_pin(srv, o, rq->pin_ms);
					kvs_writeback_used(srv, o, geo->g[gi].geom);
				} else {
					if (srv->l2)
						kvs_l2_touch(srv->l2, &key);
					int err;
					if (rq->prefetch && !kvs_promote_running(srv->promote, &key) &&
					    kvs_promote_start(srv->promote, &key, geo->g[gi].geom, geo->g[gi].obj_bytes, &err))
						lk->st.prefetches++;
				}
			}
		}
		lk->st.hits_l2 += tiers[k] == KVS_TIER_L2;
		lk->st.hits_l3 += tiers[k] == KVS_TIER_L3;
	}
}

/* The objects of the request that no tier here is known to hold: L3's
 * probe. Returns how many went to keys/geoms/lens (allocated; NULL if none). */
static uint32_t missing(kvs_server *srv, kvs_session *s, const kvs_geo *geo, const uint8_t ns[16],
			const kvs_msg *rq, kvs_objkey **ret_keys, uint64_t **ret_geoms, uint64_t **ret_lens)
{
	uint64_t max = (uint64_t)geo->n * rq->n_keys * s->world;
	kvs_objkey *keys = malloc((max ? max : 1) * sizeof(*keys));
	uint64_t *geoms = malloc((max ? max : 1) * sizeof(*geoms)), *lens = malloc((max ? max : 1) * sizeof(*lens));
	uint32_t n = 0;
	for (uint32_t k = 0; keys && geoms && lens && k < rq->n_keys; k++)
		for (uint32_t gi = 0; gi < geo->n; gi++)
			for (uint32_t r = 0; r < s->world; r++) {
				kvs_l1_obj *o;
				kvs_obj_key(&keys[n], ns, s->world, r, geo->g[gi].id, rq->keys + (size_t)k * KVS_KEY_BYTES);
				if (kvs_promote_locate(srv->promote, &keys[n], geo->g[gi].geom, geo->g[gi].obj_bytes, &o,
						       NULL) == 0)
					continue;
				geoms[n] = geo->g[gi].geom;
				lens[n] = geo->g[gi].obj_bytes;
				n++;
			}
	if (!n || !keys || !geoms || !lens) {
		free(keys);
		free(geoms);
		free(lens);
		return 0;
	}
	*ret_keys = keys, *ret_geoms = geoms, *ret_lens = lens;
	return n;
}

/* Asks L3 about what the lookup misses, deferring the answer; false when
 * there is nothing to ask or L3 cannot be asked now (answer at once). */
static bool ask_l3(kvs_server *srv, kvs_session *s, const kvs_geo *geo, const uint8_t ns[16],
		   const kvs_msg *rq)
{
	kvs_lookup *lk = srv->lookup;
	kvs_l3_stats l3s;
	kvs_l3_get_stats(srv->l3, &l3s);
	if (l3s.probe_queue >= MAX_PROBES_QUEUED) {
		lk->st.l3_skipped++;
		return false;
	}
	kvs_objkey *keys;
	uint64_t *geoms, *lens;
	uint32_t n = missing(srv, s, geo, ns, rq, &keys, &geoms, &lens);
	if (!n)
		return false;
	lwait *w = calloc(1, sizeof(*w));
	if (w)
		w->keys = malloc((size_t)rq->n_keys * KVS_KEY_BYTES);
	bool ok = w && w->keys && kvs_l3_probe(srv->l3, keys, geoms, lens, n, w) == 0;
	free(keys);
	free(geoms);
	free(lens);
	if (!ok) {
		if (w)
			free(w->keys);
		free(w);
		return false;
	}
	memcpy(w->keys, rq->keys, (size_t)rq->n_keys * KVS_KEY_BYTES);
	w->sid = s->id, w->req_id = rq->id, w->n_keys = rq->n_keys;
	w->prefetch = rq->prefetch, w->pin_ms = rq->pin_ms;
	w->expires_ms = srv->now_ms + srv->cfg.l3_lookup_ms;
	w->prev = lk->waits_tail;
	if (lk->waits_tail)
		lk->waits_tail->next = w;
	else
		lk->waits_head = w;
	lk->waits_tail = w;
	lk->n_waits++;
	lk->st.l3_deferred++;
	return true;
}

/* A prefix of n chunks hits only if, on every rank, every full-attention
 * group has all n chunks, every windowed group its last window_chunks of
 * them, and every recurrent group the state at the end of chunk n: state
 * from one prefix length is never spliced with attention KV of another.
 * With L3, a lookup that misses in L1 and L2 first asks L3 (ask_l3) and
 * is answered when L3 answers or after l3-lookup-ms. */
static int lookup(kvs_server *srv, kvs_session *s, const kvs_msg *rq, bool may_ask_l3)
{
	kvs_lookup *lk = srv->lookup;
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
		if (may_ask_l3 && hits < N && ask_l3(srv, s, &geo, ns, rq)) {
			free(tiers);
			free(pres);
			return 0; /* answered later */
		}
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

int kvs__op_lookup(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_lookup *lk = srv->lookup;
	lk->st.lookups++;
	lk->st.keys += rq->n_keys;
	return lookup(srv, s, rq, srv->l3 != NULL);
}

/* Answers a waiting lookup with what is known now (its session may have
 * gone: then nobody is waiting). */
static void answer_wait(kvs_server *srv, lwait *w)
{
	w->answered = true;
	kvs_session *s = kvs__session_get(srv, w->sid);
	if (!s)
		return;
	kvs_msg rq = {.op = KVS_OP_LOOKUP, .id = w->req_id, .keys = w->keys, .n_keys = w->n_keys,
		      .prefetch = w->prefetch, .pin_ms = w->pin_ms};
	lookup(srv, s, &rq, false);
}

void kvs_lookup_l3_done(kvs_server *srv, void *cookie, int result)
{
	lwait *w = cookie;
	if (result)
		srv->lookup->st.l3_errors++;
	if (!w->answered)
		answer_wait(srv, w);
	wait_unlink(srv->lookup, w);
}
