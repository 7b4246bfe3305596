/* The planner; see plan.h. */
#include "plan.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keys.h"
#include "kvs_error.h"

struct kvs_planner {
	kvs_l1 *l1;
	uint32_t stage_nonce; /* pads of private staging copies (never 0) */
	uint64_t *bits;       /* scratch bitmap over block ids, all zero between uses */
	uint64_t bits_words;
	kvs_plan_room_fn room;
	void *room_arg;
};

static int fail(kvs_plan *pl, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(kvs_plan *pl, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(pl->err, sizeof(pl->err), fmt, ap);
	va_end(ap);
	return code;
}

int kvs_planner_create(kvs_l1 *l1, kvs_planner **ret)
{
	kvs_planner *p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->l1 = l1;
	*ret = p;
	return 0;
}

void kvs_planner_destroy(kvs_planner *p)
{
	if (!p)
		return;
	free(p->bits);
	free(p);
}

void kvs_planner_set_room(kvs_planner *p, kvs_plan_room_fn fn, void *arg)
{
	p->room = fn;
	p->room_arg = arg;
}

uint32_t kvs_planner_nonce(kvs_planner *p)
{
	if (++p->stage_nonce == 0)
		p->stage_nonce = 1;
	return p->stage_nonce;
}

/* Counts the distinct non-null ids of ids[0..n) (each below nbits) in the
 * scratch bitmap, which is all zero before and after; *dup gets the index of
 * the first id seen twice, or n. 0, or -ENOMEM (nothing counted). */
static int distinct_ids(kvs_planner *P, const int64_t *ids, uint32_t n, int64_t null_id, uint64_t nbits,
			uint64_t *ret_distinct, uint32_t *dup)
{
	uint64_t words = (nbits + 63) / 64;
	if (words > P->bits_words) {
		uint64_t *b = calloc(words, sizeof(*b));
		if (!b)
			return -ENOMEM;
		free(P->bits);
		P->bits = b;
		P->bits_words = words;
	}
	uint64_t d = 0;
	*dup = n;
	for (uint32_t i = 0; i < n; i++) {
		if (ids[i] == null_id)
			continue;
		uint64_t w = (uint64_t)ids[i] >> 6, m = 1ull << (ids[i] & 63);
		if (P->bits[w] & m) {
			if (*dup == n)
				*dup = i;
		} else {
			P->bits[w] |= m;
			d++;
		}
	}
	for (uint32_t i = 0; i < n; i++) /* back to all zero */
		if (ids[i] != null_id)
			P->bits[(uint64_t)ids[i] >> 6] = 0;
	*ret_distinct = d;
	return 0;
}

int kvs_plan_check(kvs_planner *P, const kvs_reg *g, const kvs_msg *rq, kvs_plan *pl)
{
	if (rq->blocks.n != g->n_groups)
		return fail(pl, KVS_E_GEOMETRY, "blocks: %u lists given, the registration has %u groups (one list per group, "
			    "in registration order)", rq->blocks.n, g->n_groups);
	for (uint32_t gi = 0; gi < g->n_groups; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint64_t want = (uint64_t)rq->n_keys * G->desc.blocks_per_chunk;
		if (rq->blocks.len[gi] != want)
			return fail(pl, KVS_E_GEOMETRY, "blocks[%u] (group id %u): %u ids given, expected %llu (%u keys x %u "
				    "blocks per chunk)", gi, G->desc.id, rq->blocks.len[gi], (unsigned long long)want,
				    rq->n_keys, G->desc.blocks_per_chunk);
		for (uint32_t i = 0; i < rq->blocks.len[gi]; i++) {
			int64_t id = rq->blocks.ids[gi][i];
			if (id != G->desc.null_block && (id < 0 || (uint64_t)id >= G->num_blocks))
				return fail(pl, KVS_E_RANGE, "blocks[%u][%u]: block id %lld outside 0..%llu", gi, i,
					    (long long)id, (unsigned long long)G->num_blocks - 1);
		}
		if (rq->op != KVS_OP_RETRIEVE)
			continue;
		/* a retrieve writing one block twice would race its own copies */
		uint64_t d;
		uint32_t dup;
		if (distinct_ids(P, rq->blocks.ids[gi], rq->blocks.len[gi], G->desc.null_block, G->num_blocks, &d,
				 &dup) != 0)
			return fail(pl, KVS_E_INTERNAL, "out of memory");
		if (dup < rq->blocks.len[gi])
			return fail(pl, KVS_E_GEOMETRY, "blocks[%u]: destination block %llu named twice", gi,
				    (unsigned long long)rq->blocks.ids[gi][dup]);
	}
	return 0;
}

static bool is_null(const kvs_reg_group *G, int64_t id) { return id == G->desc.null_block; }

/* Appends one segment, merged with the previous one when both sides run on. */
static void seg_add(kvs_copy_seg *segs, uint32_t *n, uint8_t *dst, const uint8_t *src, uint64_t len)
{
	kvs_copy_seg *last = *n ? &segs[*n - 1] : NULL;
	if (last && (const uint8_t *)last->src + last->len == src && (uint8_t *)last->dst + last->len == dst)
		last->len += len;
	else
		segs[(*n)++] = (kvs_copy_seg){dst, src, len};
}

/* Waves in progress (plan.h): the current wave's size and the L1 bytes of
 * the tasks planned since the last hand-over. */
typedef struct wave_state {
	const kvs_plan_wave *w; /* NULL: no waves */
	uint64_t size, bytes;
} wave_state;

static void wave_init(wave_state *ws, const kvs_plan_wave *w)
{
	*ws = (wave_state){.w = w && w->first && w->take ? w : NULL};
	if (ws->w)
		ws->size = w->first;
}

/* Before another task is planned: offers the tasks planned since the last
 * wave once they fill the current one. */
static void wave_offer(wave_state *ws, kvs_plan *pl)
{
	if (!ws->w || ws->bytes < ws->size || pl->handed == pl->n_tasks)
		return;
	if (!ws->w->take(ws->w->arg, pl->tasks + pl->handed, pl->n_tasks - pl->handed))
		return;
	pl->handed = pl->n_tasks;
	ws->bytes = 0;
	uint64_t next = ws->size + ws->size / 2;
	ws->size = next < ws->w->max ? next : ws->w->max;
	if (ws->size < ws->w->first)
		ws->size = ws->w->first;
}

static kvs_copy_task *task_new(uint64_t max_segs)
{
	kvs_copy_task *t = calloc(1, sizeof(*t));
	kvs_copy_seg *segs = calloc(max_segs ? max_segs : 1, sizeof(*segs));
	if (!t || !segs) {
		free(t);
		free(segs);
		return NULL;
	}
	t->segs = segs;
	return t;
}

/* Reserves the L1 object of one store chunk: -EEXIST-like skip returns 1. */
static int reserve(kvs_planner *P, kvs_objkey *key, const kvs_reg_group *G, kvs_plan *pl, kvs_l1_obj **o)
{
	int r = kvs_l1_reserve(P->l1, key, G->obj_bytes, o);
	if (r == -EEXIST) {
		pl->skipped++;
		return 1; /* already cached */
	}
	if (r == -EBUSY) {
		/* another job is storing it: keep a private staging copy so this
		 * job commits on its own whatever that one does */
		key->pad = kvs_planner_nonce(P);
		r = kvs_l1_reserve(P->l1, key, G->obj_bytes, o);
		if (r == 0)
			pl->staged++;
	}
	/* pins of pending write-behind must never refuse a store (protocol
	 * §10.2): let some go and try once more */
	if (r == KVS_E_NOSPACE && P->room && P->room(P->room_arg, G->obj_bytes) > 0)
		r = kvs_l1_reserve(P->l1, key, G->obj_bytes, o);
	if (r)
		return fail(pl, r == KVS_E_NOSPACE ? KVS_E_NOSPACE : KVS_E_INTERNAL, "L1 cannot hold %llu more bytes: %s",
			    (unsigned long long)G->obj_bytes, kvs_strerror(r));
	return 0;
}

/* One store chunk of group G: which blocks [b0, b1) it copies. Attention:
 * the whole chunk; recurrent: exactly the one state block at the chunk's
 * end boundary, chosen by the engine. 1 = nothing to store, 0, or a code. */
static int store_range(const kvs_reg_group *G, uint32_t gi, uint32_t k, const int64_t *ids, uint32_t *b0,
		       uint32_t *b1, kvs_plan *pl)
{
	uint32_t bpc = G->desc.blocks_per_chunk, nulls = 0, sel = 0;
	for (uint32_t b = 0; b < bpc; b++) {
		if (is_null(G, ids[b]))
			nulls++;
		else
			sel = b;
	}
	if (nulls == bpc)
		return 1; /* nothing for this group in this chunk */
	bool recurrent = G->desc.kind == KVS_GROUP_RECURRENT;
	if (recurrent && bpc - nulls != 1)
		return fail(pl, KVS_E_GEOMETRY,
			    "blocks[%u]: recurrent group %u carries %u state blocks for chunk %u, exactly one expected", gi,
			    G->desc.id, bpc - nulls, k);
	if (!recurrent && nulls)
		return fail(pl, KVS_E_GEOMETRY, "blocks[%u]: chunk %u mixes null and real blocks", gi, k);
	*b0 = recurrent ? sel : 0;
	*b1 = recurrent ? sel + 1 : bpc;
	return 0;
}

int kvs_plan_store(kvs_planner *P, const kvs_plan_who *who, const kvs_reg *g, const kvs_msg *rq,
		   const kvs_plan_wave *wave, kvs_plan *pl)
{
	wave_state ws;
	wave_init(&ws, wave);
	uint64_t max = (uint64_t)rq->n_keys * g->n_groups;
	pl->objs = calloc(max ? max : 1, sizeof(*pl->objs));
	pl->geoms = calloc(max ? max : 1, sizeof(*pl->geoms));
	pl->chunk = calloc(max ? max : 1, sizeof(*pl->chunk));
	pl->tasks = calloc(max ? max : 1, sizeof(*pl->tasks));
	if (!pl->objs || !pl->geoms || !pl->chunk || !pl->tasks)
		return fail(pl, KVS_E_INTERNAL, "out of memory");
	if (rq->n_event_hashes && rq->n_event_hashes != rq->n_keys)
		return fail(pl, KVS_E_GEOMETRY, "event_hashes: %u hashes for %u keys (one per key, or none)",
			    rq->n_event_hashes, rq->n_keys);
	if (rq->n_event_hashes && !(pl->evh = calloc(max ? max : 1, KVS_KEY_BYTES)))
		return fail(pl, KVS_E_INTERNAL, "out of memory");
	for (uint32_t gi = 0; gi < g->n_groups; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint32_t bpc = G->desc.blocks_per_chunk;
		/* retention: each distinct source block once. A part that plans
		 * copies every non-null id of the group (whole attention chunks, the
		 * one state block of a recurrent chunk), so count those. */
		uint64_t d;
		uint32_t dup;
		if (distinct_ids(P, rq->blocks.ids[gi], rq->blocks.len[gi], G->desc.null_block, G->num_blocks, &d,
				 &dup) != 0)
			return fail(pl, KVS_E_INTERNAL, "out of memory");
		pl->retained += d;
		for (uint32_t k = 0; k < rq->n_keys; k++) {
			const int64_t *ids = rq->blocks.ids[gi] + (size_t)k * bpc;
			wave_offer(&ws, pl);
			uint32_t b0 = 0, b1 = 0;
			int r = store_range(G, gi, k, ids, &b0, &b1, pl);
			if (r == 1)
				continue;
			if (r)
				return r;
			kvs_objkey key;
			kvs_obj_key(&key, who->ns, who->world, who->rank, G->desc.id, rq->keys + (size_t)k * KVS_KEY_BYTES);
			kvs_l1_obj *o;
			if ((r = reserve(P, &key, G, pl, &o)) == 1)
				continue;
			if (r)
				return r;
			pl->geoms[pl->n_objs] = G->geom;
			pl->chunk[pl->n_objs] = k;
			if (pl->evh)
				memcpy(pl->evh + (size_t)pl->n_objs * KVS_KEY_BYTES, rq->event_hashes + (size_t)k * KVS_KEY_BYTES,
				       KVS_KEY_BYTES);
			pl->objs[pl->n_objs++] = o;
			kvs_copy_task *t = task_new((uint64_t)G->n_layers * bpc);
			if (!t)
				return fail(pl, KVS_E_INTERNAL, "out of memory");
			uint8_t *dst = kvs_l1_data(o);
			t->l1 = dst;
			t->l1_len = G->obj_bytes;
			for (uint32_t li = 0; li < G->n_layers; li++) {
				const kvs_view *v = &g->views[G->layers[li]];
				for (uint32_t b = b0; b < b1; b++) {
					seg_add(t->segs, &t->n_segs, dst, v->base + (uint64_t)ids[b] * v->stride, v->block_bytes);
					dst += v->block_bytes;
				}
			}
			pl->tasks[pl->n_tasks++] = t;
			ws.bytes += t->l1_len;
		}
	}
	return 0;
}

/* Which blocks of chunk k (of n) a retrieve writes for group G: attention
 * writes every chunk (a windowed group only its trailing window_chunks),
 * recurrent groups only the state of the last chunk, into its one non-null
 * destination block; blocks wholly inside skip_tokens and null ids are not
 * written. Returns how many; -1 if the last chunk of a recurrent group does
 * not name exactly one destination block. */
static int wanted(const kvs_reg_group *G, uint32_t n, uint32_t k, const int64_t *ids, uint64_t skip, bool *want)
{
	uint32_t bpc = G->desc.blocks_per_chunk;
	uint64_t tpb = G->desc.tokens_per_block;
	int cnt = 0;
	memset(want, 0, bpc * sizeof(*want));
	if (G->desc.kind == KVS_GROUP_RECURRENT) {
		if (k != n - 1)
			return 0;
		int sel = -1, nn = 0;
		for (uint32_t b = 0; b < bpc; b++)
			if (!is_null(G, ids[b]))
				sel = (int)b, nn++;
		if (nn != 1)
			return -1;
		if (((uint64_t)k + 1) * bpc * tpb <= skip)
			return 0;
		want[sel] = true;
		return 1;
	}
	if (G->desc.window_chunks > 0 && (int64_t)k < (int64_t)n - G->desc.window_chunks)
		return 0;
	for (uint32_t b = 0; b < bpc; b++) {
		want[b] = !is_null(G, ids[b]) && ((uint64_t)k * bpc + b + 1) * tpb > skip;
		cnt += want[b];
	}
	return cnt;
}

/* Pass 1 of a retrieve: presence only, no side effects; *all_ready: every
 * object's fetch can neither fail nor wait. */
static int retrieve_present(const kvs_plan_who *who, const kvs_reg *g, const kvs_msg *rq,
			    const kvs_plan_source *src, kvs_plan *pl, bool *all_ready)
{
	*all_ready = true;
	for (uint32_t gi = 0; gi < g->n_groups; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint32_t bpc = G->desc.blocks_per_chunk;
		if (bpc > 4096)
			return fail(pl, KVS_E_LIMIT, "blocks_per_chunk above 4096");
		for (uint32_t k = 0; k < rq->n_keys; k++) {
			const int64_t *ids = rq->blocks.ids[gi] + (size_t)k * bpc;
			bool want[4096];
			int nw = wanted(G, rq->n_keys, k, ids, rq->skip_tokens, want);
			if (nw < 0)
				return fail(pl, KVS_E_GEOMETRY,
					    "blocks[%u]: recurrent group %u needs exactly one destination block in the last chunk",
					    gi, G->desc.id);
			if (!nw)
				continue;
			kvs_objkey key;
			kvs_obj_key(&key, who->ns, who->world, who->rank, G->desc.id, rq->keys + (size_t)k * KVS_KEY_BYTES);
			bool ready = false;
			if (src->present(src->arg, &key, G, &ready) != 0)
				return fail(pl, KVS_E_MISS, "chunk %u of group %u is not cached", k, G->desc.id);
			*all_ready = *all_ready && ready;
		}
	}
	return 0;
}

/* The scatter of one retrieve chunk from src (the object's bytes). */
static void retrieve_segs(const kvs_reg *g, const kvs_reg_group *G, const int64_t *ids, const bool *want,
			  const uint8_t *src, kvs_copy_task *t)
{
	bool recurrent = G->desc.kind == KVS_GROUP_RECURRENT;
	for (uint32_t li = 0; li < G->n_layers; li++) {
		const kvs_view *v = &g->views[G->layers[li]];
		for (uint32_t b = 0; b < G->desc.blocks_per_chunk; b++) {
			if (!want[b]) {
				if (!recurrent)
					src += v->block_bytes;
				continue;
			}
			seg_add(t->segs, &t->n_segs, v->base + (uint64_t)ids[b] * v->stride, src, v->block_bytes);
			src += v->block_bytes;
		}
	}
}

int kvs_plan_retrieve(kvs_planner *P, const kvs_plan_who *who, const kvs_reg *g, const kvs_msg *rq,
		      const kvs_plan_source *src, const kvs_plan_wave *wave, kvs_plan *pl)
{
	(void)P;
	bool ready;
	int r = retrieve_present(who, g, rq, src, pl, &ready);
	if (r)
		return r;
	uint64_t max = (uint64_t)rq->n_keys * g->n_groups;
	pl->objs = calloc(max ? max : 1, sizeof(*pl->objs));
	pl->tasks = calloc(max ? max : 1, sizeof(*pl->tasks));
	/* one slot per object the part writes, in (group, chunk) order */
	struct slot {
		kvs_copy_task *t; /* allocated up front; NULL once built into pl->tasks */
		const uint8_t *from;
		uint32_t gi, k;
	} *sl = calloc(max ? max : 1, sizeof(*sl));
	if (!pl->objs || !pl->tasks || !sl) {
		free(sl);
		return fail(pl, KVS_E_INTERNAL, "out of memory");
	}
	/* every task allocated first: nothing fails for want of memory once a
	 * wave was taken */
	uint32_t n = 0;
	bool want[4096];
	for (uint32_t gi = 0; gi < g->n_groups; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint32_t bpc = G->desc.blocks_per_chunk;
		for (uint32_t k = 0; k < rq->n_keys; k++) {
			if (wanted(G, rq->n_keys, k, rq->blocks.ids[gi] + (size_t)k * bpc, rq->skip_tokens, want) <= 0)
				continue;
			sl[n] = (struct slot){.t = task_new((uint64_t)G->n_layers * bpc), .gi = gi, .k = k};
			if (!sl[n].t) {
				while (n--) {
					free(sl[n].t->segs);
					free(sl[n].t);
				}
				free(sl);
				return fail(pl, KVS_E_INTERNAL, "out of memory");
			}
			n++;
		}
	}
	/* pass 2 fetches (pins or promotes) every object, pass 3 builds the
	 * copies and offers them in waves. When every object is ready (its
	 * fetch cannot fail) the two run as one, so that the first wave leaves
	 * at once; otherwise every fetch comes first: a part that stops has not
	 * started a copy */
	wave_state ws;
	wave_init(&ws, wave);
	for (uint32_t pass = ready ? 3 : 2; pass <= 3 && !pl->stopped; pass++)
		for (uint32_t t = 0; t < n && !pl->stopped; t++) {
			const kvs_reg_group *G = &g->groups[sl[t].gi];
			const int64_t *ids = rq->blocks.ids[sl[t].gi] + (size_t)sl[t].k * G->desc.blocks_per_chunk;
			if (pass == 2 || ready) {
				kvs_objkey key;
				kvs_obj_key(&key, who->ns, who->world, who->rank, G->desc.id,
					    rq->keys + (size_t)sl[t].k * KVS_KEY_BYTES);
				pl->stopped = src->fetch(src->arg, pl, &key, G, &sl[t].from);
			}
			if (pass == 3 && !pl->stopped) {
				(void)wanted(G, rq->n_keys, sl[t].k, ids, rq->skip_tokens, want);
				wave_offer(&ws, pl);
				kvs_copy_task *task = sl[t].t;
				sl[t].t = NULL;
				task->l1 = (uint8_t *)sl[t].from;
				task->l1_len = G->obj_bytes;
				retrieve_segs(g, G, ids, want, sl[t].from, task);
				pl->tasks[pl->n_tasks++] = task;
				ws.bytes += task->l1_len;
			}
		}
	for (uint32_t t = 0; t < n; t++) /* not built: the part stopped */
		if (sl[t].t) {
			free(sl[t].t->segs);
			free(sl[t].t);
		}
	free(sl);
	return 0;
}

void kvs_plan_free_tasks(kvs_copy_task **tasks, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		free(tasks[i]->segs);
		free(tasks[i]);
	}
	free(tasks);
}

void kvs_plan_undo(kvs_l1 *l1, kvs_plan *pl, kvs_op kind)
{
	for (uint32_t i = 0; i < pl->n_objs; i++) {
		if (kind == KVS_OP_STORE)
			kvs_l1_abort(l1, pl->objs[i]);
		else
			kvs_l1_unpin(l1, pl->objs[i]);
	}
	for (uint32_t i = pl->handed; i < pl->n_tasks; i++) {
		free(pl->tasks[i]->segs);
		free(pl->tasks[i]);
	}
	free(pl->tasks);
	free(pl->objs);
	free(pl->geoms);
	free(pl->chunk);
	free(pl->evh);
	memset(pl, 0, sizeof(*pl));
}
