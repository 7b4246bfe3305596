/* Unit tests for the planner (server/plan.c), with no server: a small L1, a
 * registration built by hand whose layer views point into a malloc'd buffer
 * standing in for engine memory, and, for retrieves, a source over that L1
 * that pins committed objects (what the server's source does for L1 hits).
 * Every plan's copy tasks are executed here with memcpy and the bytes are
 * compared with the layout plan.h and registry.h state: an object holds its
 * chunk's blocks gathered layer by layer (attention: every block of the
 * chunk; recurrent: the one state block).
 * Covers kvs_plan_check (list count, list length, ids out of range, null ids,
 * a retrieve naming a destination twice), stores (layout and merged
 * segments, event hashes, recurrent state blocks, null handling, cached
 * objects skipped, objects reserved by another store staged under a private
 * key, L1 full), retrieves (misses fetch nothing, skip_tokens, windows,
 * recurrent groups, null destinations, a source refusing a fetch), undo, and
 * a store -> retrieve round trip of a hybrid registration. */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "kvs_error.h"
#include "kvs_l1.h"
#include "plan.h"

#define MAXG 4
#define MAXL 4
#define MAXK 8
#define MEM_BYTES (256u << 10) /* the "engine memory" */
#define PAGE KVS_L1_PAGE

/* ---- deterministic bytes ------------------------------------------------ */

/* splitmix64 stream: every block of the buffer differs from every other. */
static void fill(uint8_t *p, uint64_t len, uint64_t seed)
{
	uint64_t x = (seed + 1) * 0xd1342543de82ef95ull;
	for (uint64_t i = 0; i < len; i += 8) {
		x += 0x9e3779b97f4a7c15ull;
		uint64_t z = x;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		z ^= z >> 31;
		uint64_t n = len - i < 8 ? len - i : 8;
		memcpy(p + i, &z, n);
	}
}

/* ---- fixture: L1, planner, registration over engine memory --------------- */

typedef struct lay {
	uint64_t stride, bb; /* block stride and block bytes of one layer view */
} lay;

typedef struct fx {
	kvs_l1 *l1;
	kvs_planner *P;
	kvs_plan_who who;
	kvs_reg g;
	kvs_reg_group grp[MAXG];
	uint32_t lidx[MAXG][MAXL];
	kvs_view views[MAXG * MAXL];
	uint8_t *mem;
	uint64_t used; /* bytes of mem handed to views */
} fx;

static void fx_init(fx *f, uint64_t l1_size)
{
	memset(f, 0, sizeof(*f));
	kvs_l1_config c = {.size = l1_size};
	ck_assert_int_eq(kvs_l1_create(&c, &f->l1), 0);
	ck_assert_int_eq(kvs_planner_create(f->l1, &f->P), 0);
	f->mem = malloc(MEM_BYTES);
	ck_assert_ptr_nonnull(f->mem);
	fill(f->mem, MEM_BYTES, 1);
	f->g.id = 1;
	f->g.world = 2;
	f->g.rank = 1;
	f->g.groups = f->grp;
	f->g.views = f->views;
	memset(f->who.ns, 0xA5, sizeof(f->who.ns));
	f->who.ns[0] = 0x17;
	f->who.world = 2;
	f->who.rank = 1;
}

/* Nothing reserved or pinned is left, and the L1's invariants hold. */
static void assert_l1_idle(fx *f)
{
	kvs_l1_stats st;
	kvs_l1_get_stats(f->l1, &st);
	ck_assert_uint_eq(st.objects_reserved, 0);
	ck_assert_uint_eq(st.bytes_reserved, 0);
	ck_assert_uint_eq(st.bytes_evictable, st.bytes_allocated); /* no pin anywhere */
	ck_assert_int_eq(kvs_l1_check(f->l1), 0);
}

static void fx_done(fx *f)
{
	assert_l1_idle(f);
	kvs_planner_destroy(f->P);
	kvs_l1_destroy(f->l1);
	free(f->mem);
}

/* Adds a group with nl layer views laid out one after the other in engine
 * memory (64 bytes apart, so that no copy can run from one view into the
 * next). obj_bytes and geom as the registry computes them. */
static kvs_reg_group *add_group(fx *f, kvs_group_desc d, uint64_t num_blocks, uint32_t nl, const lay *L)
{
	ck_assert_uint_lt(f->g.n_groups, MAXG);
	ck_assert_uint_le(nl, MAXL);
	uint32_t gi = f->g.n_groups++;
	kvs_reg_group *G = &f->grp[gi];
	memset(G, 0, sizeof(*G));
	G->desc = d;
	G->n_layers = nl;
	G->layers = f->lidx[gi];
	G->num_blocks = num_blocks;
	for (uint32_t li = 0; li < nl; li++) {
		ck_assert_uint_ge(L[li].stride, L[li].bb);
		uint64_t span = num_blocks * L[li].stride;
		ck_assert_uint_le(f->used + span + 64, MEM_BYTES);
		uint32_t vi = f->g.n_views++;
		f->views[vi] = (kvs_view){.base = f->mem + f->used, .num_blocks = num_blocks, .stride = L[li].stride,
					  .block_bytes = L[li].bb};
		f->used += span + 64;
		G->layers[li] = vi;
		G->obj_bytes += L[li].bb * (d.kind == KVS_GROUP_RECURRENT ? 1 : d.blocks_per_chunk);
	}
	G->geom = 0x6e6f6d0000000000ull + d.id;
	return G;
}

static const kvs_view *view(const fx *f, const kvs_reg_group *G, uint32_t li) { return &f->views[G->layers[li]]; }

static uint8_t *block(const fx *f, const kvs_reg_group *G, uint32_t li, int64_t id)
{
	const kvs_view *v = view(f, G, li);
	ck_assert(id >= 0 && (uint64_t)id < v->num_blocks);
	return v->base + (uint64_t)id * v->stride;
}

/* group A: attention, 2 blocks per chunk, null block 0; layer 0 packed
 * (stride == block bytes: adjacent blocks form one run), layer 1 strided */
static const kvs_group_desc DA = {.id = 7, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16,
				  .blocks_per_chunk = 2, .window_chunks = -1, .null_block = 0};
static const lay LA[2] = {{256, 256}, {512, 128}};
#define OBJ_A (2 * 256 + 2 * 128)
/* group B: attention, 1 block per chunk, no null block */
static const kvs_group_desc DB = {.id = 9, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 32,
				  .blocks_per_chunk = 1, .window_chunks = -1, .null_block = -1};
static const lay LB[1] = {{64, 64}};
#define OBJ_B 64
/* group R: recurrent (Mamba-like), 4 blocks per chunk, one state block */
static const kvs_group_desc DR = {.id = 5, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 16,
				  .blocks_per_chunk = 4, .window_chunks = -1, .null_block = 0};
static const lay LR[2] = {{128, 96}, {256, 200}};
#define OBJ_R (96 + 200)

/* ---- requests -------------------------------------------------------------- */

typedef struct req {
	kvs_msg m;
	uint8_t keys[MAXK * KVS_KEY_BYTES];
	uint8_t evh[MAXK * KVS_KEY_BYTES];
} req;

static void key_of(uint8_t k[KVS_KEY_BYTES], uint32_t v)
{
	memset(k, 0, KVS_KEY_BYTES);
	memcpy(k, &v, 4);
	k[31] = 0x5a;
}

/* n keys with values base, base+1, ...; lists added with req_list */
static void req_init(req *r, kvs_op op, uint32_t n, uint32_t base)
{
	ck_assert_uint_le(n, MAXK);
	memset(r, 0, sizeof(*r));
	r->m.op = op;
	r->m.n_keys = n;
	r->m.keys = r->keys;
	for (uint32_t i = 0; i < n; i++)
		key_of(r->keys + (size_t)i * KVS_KEY_BYTES, base + i);
}

static void req_list(req *r, const int64_t *ids, uint32_t len)
{
	r->m.blocks.ids[r->m.blocks.n] = ids;
	r->m.blocks.len[r->m.blocks.n++] = len;
}

/* The public object key of (group, chunk key value), built by hand. */
static kvs_objkey okey(const fx *f, uint32_t group, uint32_t v)
{
	kvs_objkey k;
	memset(&k, 0, sizeof(k));
	key_of(k.chunk, v);
	memcpy(k.ns, f->who.ns, 16);
	k.world = f->who.world;
	k.rank = f->who.rank;
	k.group = group;
	return k;
}

/* ---- layout model and task execution --------------------------------------- */

/* Where (layer li, block position b of the chunk) lies in an object of G:
 * layer by layer, each layer's blocks in chunk order (recurrent: one). */
static uint64_t obj_off(const fx *f, const kvs_reg_group *G, uint32_t li, uint32_t b)
{
	bool rec = G->desc.kind == KVS_GROUP_RECURRENT;
	uint64_t per = rec ? 1 : G->desc.blocks_per_chunk, off = 0;
	for (uint32_t l = 0; l < li; l++)
		off += per * view(f, G, l)->block_bytes;
	return off + (rec ? 0 : b) * view(f, G, li)->block_bytes;
}

/* The bytes a store must put in the object of chunk `ids` of G. */
static void expect_obj(const fx *f, const kvs_reg_group *G, const int64_t *ids, uint8_t *out)
{
	uint64_t n = 0;
	for (uint32_t li = 0; li < G->n_layers; li++)
		for (uint32_t b = 0; b < G->desc.blocks_per_chunk; b++) {
			if (ids[b] == G->desc.null_block)
				continue;
			uint64_t bb = view(f, G, li)->block_bytes;
			memcpy(out + obj_off(f, G, li, b), block(f, G, li, ids[b]), bb);
			n += bb;
		}
	ck_assert_uint_eq(n, G->obj_bytes);
}

static int find_obj(const kvs_plan *pl, const kvs_objkey *k)
{
	for (uint32_t i = 0; i < pl->n_objs; i++)
		if (memcmp(kvs_l1_key(pl->objs[i]), k, sizeof(*k)) == 0)
			return (int)i;
	return -1;
}

static bool inside(const void *p, uint64_t len, const void *base, uint64_t blen)
{
	const uint8_t *a = p, *b = base;
	return a >= b && len <= blen && a - b <= (ptrdiff_t)(blen - len);
}

/* The object of the plan a task writes (store), checked to be one object
 * for all its segments. */
static int task_obj(const kvs_plan *pl, const kvs_copy_task *t)
{
	int o = -1;
	ck_assert_uint_gt(t->n_segs, 0);
	for (uint32_t s = 0; s < t->n_segs; s++) {
		int hit = -1, hits = 0;
		for (uint32_t i = 0; i < pl->n_objs; i++)
			if (inside(t->segs[s].dst, t->segs[s].len, kvs_l1_data(pl->objs[i]), kvs_l1_len(pl->objs[i])))
				hit = (int)i, hits++;
		ck_assert_int_eq(hits, 1);
		ck_assert(o < 0 || o == hit);
		o = hit;
	}
	return o;
}

/* Executes a store plan: every object poisoned, then every segment copied
 * (each inside one object of the plan, reading engine memory); the segments
 * add up to the objects exactly, so with the byte comparison afterwards no
 * byte is written twice or left out. */
static void run_store(fx *f, const kvs_plan *pl)
{
	ck_assert_uint_eq(pl->n_tasks, pl->n_objs);
	uint64_t objs = 0, segs = 0;
	for (uint32_t i = 0; i < pl->n_objs; i++) {
		ck_assert_int_eq(kvs_l1_state(pl->objs[i]), KVS_L1_RESERVED);
		memset(kvs_l1_data(pl->objs[i]), 0xee, kvs_l1_len(pl->objs[i]));
		objs += kvs_l1_len(pl->objs[i]);
	}
	bool seen[MAXG * MAXK] = {0};
	for (uint32_t t = 0; t < pl->n_tasks; t++) {
		int o = task_obj(pl, pl->tasks[t]);
		ck_assert(!seen[o]); /* one task per object */
		seen[o] = true;
		for (uint32_t s = 0; s < pl->tasks[t]->n_segs; s++) {
			const kvs_copy_seg *sg = &pl->tasks[t]->segs[s];
			ck_assert(inside(sg->src, sg->len, f->mem, MEM_BYTES));
			memcpy(sg->dst, sg->src, sg->len);
			segs += sg->len;
		}
	}
	ck_assert_uint_eq(segs, objs);
}

/* The task of object i (by what it writes). */
static const kvs_copy_task *task_of(const kvs_plan *pl, int i)
{
	for (uint32_t t = 0; t < pl->n_tasks; t++)
		if (task_obj(pl, pl->tasks[t]) == i)
			return pl->tasks[t];
	ck_abort_msg("no task writes object %d", i);
	return NULL;
}

/* The object of (G, key value) is in the plan with the expected content,
 * length, geometry and a task of nsegs segments; returns its index. */
static int check_stored(fx *f, const kvs_plan *pl, const kvs_reg_group *G, uint32_t v, const int64_t *ids,
			uint32_t nsegs)
{
	kvs_objkey k = okey(f, G->desc.id, v);
	int i = find_obj(pl, &k);
	ck_assert_msg(i >= 0, "no object for group %u key %u", G->desc.id, v);
	ck_assert_uint_eq(kvs_l1_len(pl->objs[i]), G->obj_bytes);
	ck_assert_uint_eq(pl->geoms[i], G->geom);
	uint8_t *want = malloc(G->obj_bytes);
	ck_assert_ptr_nonnull(want);
	expect_obj(f, G, ids, want);
	ck_assert_mem_eq(kvs_l1_data(pl->objs[i]), want, G->obj_bytes);
	free(want);
	ck_assert_uint_eq(task_of(pl, i)->n_segs, nsegs);
	return i;
}

static kvs_l1_stats l1st(fx *f)
{
	kvs_l1_stats st;
	kvs_l1_get_stats(f->l1, &st);
	return st;
}

/* A committed object of (group, key value) with deterministic content. */
static kvs_l1_obj *put_obj(fx *f, uint32_t group, uint32_t v, uint64_t len)
{
	kvs_objkey k = okey(f, group, v);
	kvs_l1_obj *o;
	ck_assert_int_eq(kvs_l1_reserve(f->l1, &k, len, &o), 0);
	fill(kvs_l1_data(o), len, 1000u + v * 31u + group);
	kvs_l1_commit(f->l1, o);
	return o;
}

static const char *ename(int code) { return code ? kvs_error_name(code) : "0"; }

#define EXPECT(call, code)                                                                                  \
	do {                                                                                                \
		int r_ = (call);                                                                            \
		ck_assert_msg(r_ == (code), "%s: got %s, want %s (%s)", #call, ename(r_), ename(code),      \
			      pl.err);                                                                      \
	} while (0)

#define ERR_HAS(needle) ck_assert_msg(strstr(pl.err, (needle)), "err '%s' lacks '%s'", pl.err, (needle))

/* ---- kvs_plan_check ----------------------------------------------------------- */

START_TEST(check_lists)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	add_group(&f, DA, 16, 2, LA);
	add_group(&f, DB, 8, 1, LB);
	kvs_plan pl = {0};
	req r;
	int64_t a[4] = {1, 2, 15, 0}, b[2] = {7, -1};
	for (int op = 0; op < 2; op++) {
		req_init(&r, op ? KVS_OP_RETRIEVE : KVS_OP_STORE, 2, 0);
		req_list(&r, a, 4);
		req_list(&r, b, 2);
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);

		/* list count */
		r.m.blocks.n = 1;
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), KVS_E_GEOMETRY);
		ERR_HAS("1 lists given, the registration has 2 groups");
		r.m.blocks.n = 3;
		r.m.blocks.ids[2] = b;
		r.m.blocks.len[2] = 2;
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), KVS_E_GEOMETRY);
		ERR_HAS("3 lists given, the registration has 2 groups");
		r.m.blocks.n = 2;

		/* list length: keys x blocks per chunk */
		r.m.blocks.len[0] = 3;
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), KVS_E_GEOMETRY);
		ERR_HAS("blocks[0] (group id 7): 3 ids given, expected 4 (2 keys x 2 blocks per chunk)");
		r.m.blocks.len[0] = 4;
		r.m.blocks.len[1] = 3;
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), KVS_E_GEOMETRY);
		ERR_HAS("blocks[1] (group id 9): 3 ids given, expected 2 (2 keys x 1 blocks per chunk)");
		r.m.blocks.len[1] = 2;

		/* ids out of range (A: 0..15, null 0; B: 0..7, null -1) */
		static const struct {
			int g;
			int64_t id;
		} bad[] = {{0, 16}, {0, -1}, {0, INT64_MIN}, {0, INT64_MAX}, {1, 8}, {1, -2}, {1, INT64_MIN}};
		for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
			int64_t *l = bad[i].g ? b : a, keep = l[1];
			l[1] = bad[i].id;
			EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), KVS_E_RANGE);
			ERR_HAS(bad[i].g ? "blocks[1][1]" : "blocks[0][1]");
			l[1] = keep;
		}
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);

		/* null ids throughout */
		int64_t an[4] = {0, 0, 0, 0}, bn[2] = {-1, -1};
		r.m.blocks.ids[0] = an;
		r.m.blocks.ids[1] = bn;
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
		r.m.blocks.ids[0] = a;
		r.m.blocks.ids[1] = b;

		/* no keys, empty lists */
		req_init(&r, op ? KVS_OP_RETRIEVE : KVS_OP_STORE, 0, 0);
		req_list(&r, a, 0);
		req_list(&r, b, 0);
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	}
	fx_done(&f);
}
END_TEST

START_TEST(check_retrieve_duplicates)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	add_group(&f, DA, 16, 2, LA);
	add_group(&f, DB, 8, 1, LB);
	kvs_plan pl = {0};
	req st, rt;
	int64_t a[6] = {3, 4, 5, 4, 0, 0}, b[3] = {3, 5, -1};
	req_init(&st, KVS_OP_STORE, 3, 0);
	req_list(&st, a, 6);
	req_list(&st, b, 3);
	req_init(&rt, KVS_OP_RETRIEVE, 3, 0);
	req_list(&rt, a, 6);
	req_list(&rt, b, 3);
	/* a store may read one block twice; a retrieve may not write one twice */
	EXPECT(kvs_plan_check(f.P, &f.g, &st.m, &pl), 0);
	EXPECT(kvs_plan_check(f.P, &f.g, &rt.m, &pl), KVS_E_GEOMETRY);
	ERR_HAS("blocks[0]: destination block 4 named twice");
	/* within one chunk too */
	a[3] = 6;
	a[1] = 3;
	EXPECT(kvs_plan_check(f.P, &f.g, &rt.m, &pl), KVS_E_GEOMETRY);
	ERR_HAS("destination block 3 named twice");
	/* the null block named several times, and one id in two groups: fine */
	a[1] = 4;
	EXPECT(kvs_plan_check(f.P, &f.g, &rt.m, &pl), 0);
	b[2] = -1;
	b[1] = -1;
	EXPECT(kvs_plan_check(f.P, &f.g, &rt.m, &pl), 0);
	/* group B's duplicate */
	b[1] = 3;
	EXPECT(kvs_plan_check(f.P, &f.g, &rt.m, &pl), KVS_E_GEOMETRY);
	ERR_HAS("blocks[1]: destination block 3 named twice");
	b[1] = 5;
	/* the scratch state is clean after each call: the same lists again */
	for (int i = 0; i < 3; i++)
		EXPECT(kvs_plan_check(f.P, &f.g, &rt.m, &pl), 0);
	fx_done(&f);
}
END_TEST

/* A group of many blocks after one of few (the scratch bitmap grows), then
 * the small one again. */
START_TEST(check_scratch_grows)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_group_desc d = DB;
	add_group(&f, d, 8, 1, LB);
	d.id = 10;
	add_group(&f, d, 3000, 1, (lay[]){{8, 8}});
	kvs_plan pl = {0};
	req r;
	int64_t b[2] = {7, 1}, c[2] = {2999, 64};
	req_init(&r, KVS_OP_RETRIEVE, 2, 0);
	req_list(&r, b, 2);
	req_list(&r, c, 2);
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	c[0] = 64;
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), KVS_E_GEOMETRY);
	ERR_HAS("destination block 64 named twice");
	c[0] = 2999;
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	b[0] = 1;
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), KVS_E_GEOMETRY);
	ERR_HAS("blocks[0]: destination block 1 named twice");
	b[0] = 7;
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	fx_done(&f);
}
END_TEST

/* ---- stores ------------------------------------------------------------------- */

START_TEST(store_attention_layout)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	kvs_reg_group *B = add_group(&f, DB, 8, 1, LB);
	ck_assert_uint_eq(A->obj_bytes, OBJ_A);
	ck_assert_uint_eq(B->obj_bytes, OBJ_B);
	/* A: chunk 0 adjacent blocks (layer 0 is one run: 1 + 2 segments),
	 * chunk 1 in reverse order (2 + 2), chunk 2 adjacent again; B names
	 * block 2 twice (read twice, retained once) */
	int64_t a[6] = {3, 4, 6, 5, 9, 10}, b[3] = {2, 2, 5};
	req r;
	req_init(&r, KVS_OP_STORE, 3, 100);
	req_list(&r, a, 6);
	req_list(&r, b, 3);
	kvs_plan pl = {0};
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 6);
	ck_assert_uint_eq(pl.n_tasks, 6);
	ck_assert_uint_eq(pl.skipped, 0);
	ck_assert_uint_eq(pl.staged, 0);
	ck_assert_uint_eq(pl.retained, 6 + 2);
	ck_assert_ptr_null(pl.evh);
	kvs_l1_stats st = l1st(&f);
	ck_assert_uint_eq(st.objects_reserved, 6);
	ck_assert_uint_eq(st.bytes_reserved, 3 * OBJ_A + 3 * OBJ_B);
	/* reserved objects are invisible */
	kvs_objkey k0 = okey(&f, 7, 100);
	ck_assert_ptr_null(kvs_l1_get(f.l1, &k0));
	run_store(&f, &pl);
	check_stored(&f, &pl, A, 100, a + 0, 3);
	check_stored(&f, &pl, A, 101, a + 2, 4);
	check_stored(&f, &pl, A, 102, a + 4, 3);
	check_stored(&f, &pl, B, 100, b + 0, 1);
	check_stored(&f, &pl, B, 101, b + 1, 1);
	check_stored(&f, &pl, B, 102, b + 2, 1);
	/* the engine's memory was only read */
	uint8_t *ref = malloc(MEM_BYTES);
	ck_assert_ptr_nonnull(ref);
	fill(ref, MEM_BYTES, 1);
	ck_assert_mem_eq(f.mem, ref, MEM_BYTES);
	free(ref);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	ck_assert_ptr_null(pl.objs);
	ck_assert_ptr_null(pl.tasks);
	ck_assert_uint_eq(pl.n_objs, 0);
	ck_assert_uint_eq(pl.n_tasks, 0);
	ck_assert_uint_eq(l1st(&f).objects, 0);
	ck_assert_uint_eq(l1st(&f).bytes_used, 0);
	/* retention is counted afresh by the next plan */
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.retained, 6 + 2);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	fx_done(&f);
}
END_TEST

/* Blocks adjacent in both views merge across the chunk: with every layer
 * packed, a chunk of consecutive blocks is one segment per layer, and a
 * view whose stride exceeds its block bytes never merges. */
START_TEST(store_segments_merge)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_group_desc d = DA;
	d.blocks_per_chunk = 4;
	kvs_reg_group *G = add_group(&f, d, 32, 3, (lay[]){{64, 64}, {128, 128}, {256, 32}});
	int64_t ids[12] = {4, 5, 6, 7, /* one run per layer */
			   8, 9, 11, 12, /* two runs */
			   20, 19, 18, 17};  /* no run */
	req r;
	req_init(&r, KVS_OP_STORE, 3, 0);
	req_list(&r, ids, 12);
	kvs_plan pl = {0};
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	run_store(&f, &pl);
	check_stored(&f, &pl, G, 0, ids + 0, 1 + 1 + 4);
	check_stored(&f, &pl, G, 1, ids + 4, 2 + 2 + 4);
	check_stored(&f, &pl, G, 2, ids + 8, 4 + 4 + 4);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	fx_done(&f);
}
END_TEST

START_TEST(store_event_hashes)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	add_group(&f, DA, 16, 2, LA);
	add_group(&f, DB, 8, 1, LB);
	int64_t a[6] = {1, 2, 0, 0, 5, 6}, b[3] = {1, 2, 3};
	req r;
	req_init(&r, KVS_OP_STORE, 3, 40);
	req_list(&r, a, 6);
	req_list(&r, b, 3);
	for (uint32_t k = 0; k < 3; k++)
		memset(r.evh + k * KVS_KEY_BYTES, 0x30 + (int)k, KVS_KEY_BYTES);
	r.m.event_hashes = r.evh;
	r.m.n_event_hashes = 3;
	kvs_plan pl = {0};
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 5); /* A's chunk 1 is all null */
	ck_assert_ptr_nonnull(pl.evh);
	for (uint32_t i = 0; i < pl.n_objs; i++) {
		/* the hash of the object's own key */
		uint32_t v;
		memcpy(&v, kvs_l1_key(pl.objs[i])->chunk, 4);
		ck_assert_uint_ge(v, 40);
		ck_assert_uint_le(v, 42);
		ck_assert_mem_eq(pl.evh + (size_t)i * KVS_KEY_BYTES, r.evh + (size_t)(v - 40) * KVS_KEY_BYTES,
				 KVS_KEY_BYTES);
	}
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	ck_assert_ptr_null(pl.evh);
	/* one hash per key, or none */
	for (uint32_t n = 1; n <= 4; n += 3) {
		r.m.n_event_hashes = n == 1 ? 2 : 4;
		EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), KVS_E_GEOMETRY);
		ERR_HAS("event_hashes");
		ck_assert_uint_eq(pl.n_objs, 0);
		ck_assert_uint_eq(l1st(&f).objects, 0);
		kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	}
	fx_done(&f);
}
END_TEST

START_TEST(store_recurrent)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *R = add_group(&f, DR, 16, 2, LR);
	ck_assert_uint_eq(R->obj_bytes, OBJ_R);
	/* the state block wherever the engine puts it; a chunk of nulls has
	 * no state to store */
	int64_t ids[12] = {0, 0, 0, 7, 0, 0, 0, 0, 0, 3, 0, 0};
	req r;
	req_init(&r, KVS_OP_STORE, 3, 0);
	req_list(&r, ids, 12);
	kvs_plan pl = {0};
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 2);
	ck_assert_uint_eq(pl.retained, 2);
	run_store(&f, &pl);
	check_stored(&f, &pl, R, 0, ids + 0, 2);
	check_stored(&f, &pl, R, 2, ids + 8, 2);
	kvs_objkey k1 = okey(&f, 5, 1);
	ck_assert_int_lt(find_obj(&pl, &k1), 0);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	/* more than one state block in a chunk (two, in each chunk in turn;
	 * then four): refused */
	for (int k = 0; k < 4; k++) {
		int64_t two[12];
		memcpy(two, ids, sizeof(two));
		if (k < 3) {
			two[4 * k] = 12; /* a second block next to the state */
			if (k == 1)
				two[4 * k + 2] = 13; /* (chunk 1 had none) */
		} else {
			two[0] = 12; /* every block of chunk 0 */
			two[1] = 13;
			two[2] = 14;
		}
		r.m.blocks.ids[0] = two;
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0); /* the shape is the store's to judge */
		EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), KVS_E_GEOMETRY);
		ERR_HAS("exactly one expected");
		ck_assert_uint_eq(pl.n_objs, (uint32_t)(k == 1 || k == 2 ? 1 : 0)); /* what was done so far */
		kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
		assert_l1_idle(&f);
		ck_assert_uint_eq(l1st(&f).objects, 0);
		r.m.blocks.ids[0] = ids;
	}
	fx_done(&f);
}
END_TEST

START_TEST(store_attention_nulls)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	int64_t ids[6] = {0, 0, 3, 4, 0, 0};
	req r;
	req_init(&r, KVS_OP_STORE, 3, 0);
	req_list(&r, ids, 6);
	kvs_plan pl = {0};
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 1); /* chunks of nulls are skipped */
	ck_assert_uint_eq(pl.skipped, 0);  /* (not counted as cached) */
	ck_assert_uint_eq(pl.retained, 2);
	run_store(&f, &pl);
	check_stored(&f, &pl, A, 1, ids + 2, 3);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	/* a chunk mixing null and real blocks: refused, also after objects of
	 * earlier chunks were reserved (the plan holds them for undo) */
	for (int pos = 0; pos < 2; pos++) {
		int64_t mixed[6] = {1, 2, 5, 6, 0, 0};
		mixed[4 + pos] = 9;
		r.m.blocks.ids[0] = mixed;
		EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), KVS_E_GEOMETRY);
		ERR_HAS("chunk 2 mixes null and real blocks");
		ck_assert_uint_eq(pl.n_objs, 2);
		ck_assert_uint_eq(l1st(&f).objects_reserved, 2);
		kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
		ck_assert_uint_eq(l1st(&f).objects, 0);
	}
	fx_done(&f);
}
END_TEST

START_TEST(store_skips_cached)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	kvs_l1_obj *cached = put_obj(&f, 7, 1, OBJ_A);
	uint8_t before[OBJ_A];
	memcpy(before, kvs_l1_data(cached), OBJ_A);
	int64_t ids[6] = {1, 2, 3, 4, 5, 6};
	req r;
	req_init(&r, KVS_OP_STORE, 3, 0);
	req_list(&r, ids, 6);
	kvs_plan pl = {0};
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 2);
	ck_assert_uint_eq(pl.n_tasks, 2);
	ck_assert_uint_eq(pl.skipped, 1);
	ck_assert_uint_eq(pl.staged, 0);
	ck_assert_uint_eq(pl.retained, 6); /* the engine still hands all blocks over */
	run_store(&f, &pl); /* no segment touches the cached object */
	check_stored(&f, &pl, A, 0, ids + 0, 3);
	check_stored(&f, &pl, A, 2, ids + 4, 3);
	ck_assert_mem_eq(kvs_l1_data(cached), before, OBJ_A);
	ck_assert_int_eq(kvs_l1_state(cached), KVS_L1_COMMITTED);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	ck_assert_uint_eq(l1st(&f).objects, 1);
	ck_assert_ptr_eq(kvs_l1_get(f.l1, kvs_l1_key(cached)), cached);
	fx_done(&f);
}
END_TEST

START_TEST(store_stages_reserved)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	/* another store holds the reservation of chunk 1 */
	kvs_objkey k1 = okey(&f, 7, 1);
	kvs_l1_obj *other;
	ck_assert_int_eq(kvs_l1_reserve(f.l1, &k1, OBJ_A, &other), 0);
	int64_t ids[6] = {1, 2, 3, 4, 5, 6};
	req r;
	req_init(&r, KVS_OP_STORE, 3, 0);
	req_list(&r, ids, 6);
	kvs_plan pl = {0}, pl2 = {0};
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 3);
	ck_assert_uint_eq(pl.staged, 1);
	ck_assert_uint_eq(pl.skipped, 0);
	ck_assert_uint_eq(l1st(&f).objects_reserved, 4);
	/* the private copy: the public key with a nonzero pad */
	int staged = -1;
	for (uint32_t i = 0; i < pl.n_objs; i++) {
		kvs_objkey k = *kvs_l1_key(pl.objs[i]);
		ck_assert_ptr_ne(pl.objs[i], other);
		if (k.pad == 0)
			continue;
		ck_assert_int_lt(staged, 0);
		staged = (int)i;
		k.pad = 0;
		ck_assert_mem_eq(&k, &k1, sizeof(k));
	}
	ck_assert_int_ge(staged, 0);
	uint32_t pad1 = kvs_l1_key(pl.objs[staged])->pad;
	run_store(&f, &pl);
	check_stored(&f, &pl, A, 0, ids + 0, 3);
	check_stored(&f, &pl, A, 2, ids + 4, 3);
	uint8_t want[OBJ_A];
	expect_obj(&f, A, ids + 2, want);
	ck_assert_mem_eq(kvs_l1_data(pl.objs[staged]), want, OBJ_A);
	ck_assert_ptr_eq(kvs_l1_peek(f.l1, &k1), other); /* the public one is untouched */

	/* a second store of the same chunks while both are reserved: every
	 * object staged, each under a pad of its own */
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl2), 0);
	ck_assert_uint_eq(pl2.n_objs, 3);
	ck_assert_uint_eq(pl2.staged, 3);
	uint32_t pads[4] = {pad1};
	for (uint32_t i = 0; i < 3; i++) {
		pads[i + 1] = kvs_l1_key(pl2.objs[i])->pad;
		ck_assert_uint_ne(pads[i + 1], 0);
		for (uint32_t j = 0; j <= i; j++)
			ck_assert_uint_ne(pads[i + 1], pads[j]);
	}
	run_store(&f, &pl2);
	for (uint32_t i = 0; i < 3; i++) {
		kvs_objkey k = *kvs_l1_key(pl2.objs[i]);
		uint32_t v;
		memcpy(&v, k.chunk, 4);
		ck_assert_uint_le(v, 2);
		expect_obj(&f, A, ids + 2 * v, want);
		ck_assert_mem_eq(kvs_l1_data(pl2.objs[i]), want, OBJ_A);
	}
	kvs_plan_undo(f.l1, &pl2, KVS_OP_STORE);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	kvs_l1_abort(f.l1, other);
	ck_assert_uint_eq(l1st(&f).objects, 0);
	fx_done(&f);
}
END_TEST

START_TEST(store_nospace)
{
	fx f;
	fx_init(&f, 4 * PAGE); /* four objects of A (one page each) */
	add_group(&f, DA, 16, 2, LA);
	int64_t ids[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
	req r;
	req_init(&r, KVS_OP_STORE, 6, 0);
	req_list(&r, ids, 12);
	kvs_plan pl = {0};
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), KVS_E_NOSPACE);
	ERR_HAS("L1 cannot hold 768 more bytes");
	ck_assert_uint_eq(pl.n_objs, 4);
	ck_assert_uint_eq(l1st(&f).objects_reserved, 4);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	ck_assert_uint_eq(l1st(&f).objects, 0);
	assert_l1_idle(&f);
	/* exactly four fit */
	r.m.n_keys = 4;
	r.m.blocks.len[0] = 8;
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 4);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	fx_done(&f);

	/* an object larger than the whole arena */
	fx_init(&f, 1 * PAGE);
	kvs_group_desc d = DB;
	add_group(&f, d, 4, 1, (lay[]){{PAGE + 8, PAGE + 8}});
	int64_t one[1] = {2};
	req_init(&r, KVS_OP_STORE, 1, 0);
	req_list(&r, one, 1);
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), KVS_E_NOSPACE);
	ERR_HAS("L1 cannot hold");
	ck_assert_uint_eq(pl.n_objs, 0);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	fx_done(&f);
}
END_TEST

/* ---- retrieves ----------------------------------------------------------------- */

/* A source over the L1: present when committed with the group's length;
 * fetch pins and hands out the data, or refuses call number refuse_at. */
typedef struct src_ctx {
	fx *f;
	uint32_t present_calls, fetch_calls;
	uint32_t refuse_at;
	int refuse_code;
	uint32_t unready_at; /* present() calls this one not ready (0: none; a refusal: all) */
} src_ctx;

static int t_present(void *arg, const kvs_objkey *key, const kvs_reg_group *G, bool *ready)
{
	src_ctx *c = arg;
	c->present_calls++;
	*ready = !c->refuse_at && c->present_calls != c->unready_at; /* a fetch that may fail is not ready */
	kvs_l1_obj *o = kvs_l1_get(c->f->l1, key);
	return o && kvs_l1_len(o) == G->obj_bytes ? 0 : KVS_E_MISS;
}

static int t_fetch(void *arg, kvs_plan *pl, const kvs_objkey *key, const kvs_reg_group *G, const uint8_t **src)
{
	src_ctx *c = arg;
	if (++c->fetch_calls == c->refuse_at)
		return c->refuse_code;
	kvs_l1_obj *o = kvs_l1_get(c->f->l1, key);
	ck_assert_ptr_nonnull(o); /* present() said so */
	ck_assert_uint_eq(kvs_l1_len(o), G->obj_bytes);
	kvs_l1_pin(c->f->l1, o);
	pl->objs[pl->n_objs++] = o;
	*src = kvs_l1_data(o);
	return 0;
}

/* Executes a retrieve plan: every segment reads inside one fetched object
 * and writes inside engine memory. */
static void run_retrieve(fx *f, const kvs_plan *pl)
{
	for (uint32_t t = 0; t < pl->n_tasks; t++) {
		ck_assert_uint_gt(pl->tasks[t]->n_segs, 0);
		for (uint32_t s = 0; s < pl->tasks[t]->n_segs; s++) {
			const kvs_copy_seg *sg = &pl->tasks[t]->segs[s];
			int hits = 0;
			for (uint32_t i = 0; i < pl->n_objs; i++)
				hits += inside(sg->src, sg->len, kvs_l1_data(pl->objs[i]), kvs_l1_len(pl->objs[i]));
			ck_assert_int_eq(hits, 1);
			ck_assert(inside(sg->dst, sg->len, f->mem, MEM_BYTES));
			memcpy(sg->dst, sg->src, sg->len);
		}
	}
}

/* Applies to img (a copy of engine memory) what a retrieve must write for
 * one chunk of G: positions b with want[b] receive, in every layer, their
 * bytes of obj. */
static void expect_scatter(fx *f, uint8_t *img, const kvs_reg_group *G, const int64_t *ids, const bool *want,
			   const kvs_l1_obj *obj)
{
	for (uint32_t li = 0; li < G->n_layers; li++)
		for (uint32_t b = 0; b < G->desc.blocks_per_chunk; b++) {
			if (!want[b])
				continue;
			uint8_t *dst = block(f, G, li, ids[b]);
			memcpy(img + (dst - f->mem), (const uint8_t *)kvs_l1_data(obj) + obj_off(f, G, li, b),
			       view(f, G, li)->block_bytes);
		}
}

static uint8_t *snapshot(fx *f)
{
	uint8_t *img = malloc(MEM_BYTES);
	ck_assert_ptr_nonnull(img);
	memcpy(img, f->mem, MEM_BYTES);
	return img;
}

static void retrieve(fx *f, req *r, src_ctx *c, kvs_plan *pl, int code)
{
	kvs_plan_source src = {.present = t_present, .fetch = t_fetch, .arg = c};
	c->f = f;
	c->present_calls = c->fetch_calls = 0;
	int rc = kvs_plan_retrieve(f->P, &f->who, &f->g, &r->m, &src, NULL, pl);
	ck_assert_msg(rc == code, "retrieve: got %s, want %s (%s)", ename(rc), ename(code), pl->err);
}

static void assert_unpinned(kvs_l1_obj **o, int n)
{
	for (int i = 0; i < n; i++)
		if (o[i])
			ck_assert_uint_eq(kvs_l1_pins(o[i]), 0);
}

START_TEST(retrieve_scatter)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	kvs_reg_group *B = add_group(&f, DB, 8, 1, LB);
	kvs_l1_obj *oa[3] = {put_obj(&f, 7, 0, OBJ_A), put_obj(&f, 7, 1, OBJ_A), NULL};
	kvs_l1_obj *ob[3] = {put_obj(&f, 9, 0, OBJ_B), NULL, put_obj(&f, 9, 2, OBJ_B)};
	/* A: chunk 0 both blocks (adjacent destinations: layer 0 one run),
	 * chunk 1 only its second block, chunk 2 nothing (its object is absent
	 * and not needed); B: chunk 1 null (absent, not needed) */
	int64_t a[6] = {5, 6, 0, 9, 0, 0}, b[3] = {4, -1, 7};
	req r;
	req_init(&r, KVS_OP_RETRIEVE, 3, 0);
	req_list(&r, a, 6);
	req_list(&r, b, 3);
	kvs_plan pl = {0};
	src_ctx c = {0};
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	uint8_t *img = snapshot(&f);
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_int_eq(pl.stopped, 0);
	ck_assert_uint_eq(c.present_calls, 4);
	ck_assert_uint_eq(c.fetch_calls, 4);
	ck_assert_uint_eq(pl.n_objs, 4);
	ck_assert_uint_eq(pl.n_tasks, 4);
	ck_assert_uint_eq(kvs_l1_pins(oa[0]), 1);
	ck_assert_uint_eq(kvs_l1_pins(oa[1]), 1);
	ck_assert_uint_eq(kvs_l1_pins(ob[0]), 1);
	ck_assert_uint_eq(kvs_l1_pins(ob[2]), 1);
	uint32_t nsegs = 0;
	for (uint32_t t = 0; t < pl.n_tasks; t++)
		nsegs += pl.tasks[t]->n_segs;
	ck_assert_uint_eq(nsegs, (1 + 2) + 2 + 1 + 1);
	run_retrieve(&f, &pl);
	expect_scatter(&f, img, A, a + 0, (bool[]){true, true}, oa[0]);
	expect_scatter(&f, img, A, a + 2, (bool[]){false, true}, oa[1]);
	expect_scatter(&f, img, B, b + 0, (bool[]){true}, ob[0]);
	expect_scatter(&f, img, B, b + 2, (bool[]){true}, ob[2]);
	ck_assert_mem_eq(f.mem, img, MEM_BYTES);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	assert_unpinned(oa, 3);
	assert_unpinned(ob, 3);
	ck_assert_uint_eq(l1st(&f).objects, 4); /* unpinned, still cached */
	free(img);
	fx_done(&f);
}
END_TEST

START_TEST(retrieve_miss_fetches_nothing)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	add_group(&f, DA, 16, 2, LA);
	add_group(&f, DB, 8, 1, LB);
	kvs_l1_obj *o[5] = {put_obj(&f, 7, 0, OBJ_A), put_obj(&f, 7, 1, OBJ_A), put_obj(&f, 9, 0, OBJ_B),
			    put_obj(&f, 9, 1, OBJ_B), NULL};
	int64_t a[6] = {1, 2, 3, 4, 5, 6}, b[3] = {1, 2, 3};
	req r;
	req_init(&r, KVS_OP_RETRIEVE, 3, 0);
	req_list(&r, a, 6);
	req_list(&r, b, 3);
	kvs_plan pl = {0};
	src_ctx c = {0};
	uint8_t *img = snapshot(&f);
	/* group A's last chunk is missing: nothing fetched, nothing pinned */
	retrieve(&f, &r, &c, &pl, KVS_E_MISS);
	ERR_HAS("chunk 2 of group 7 is not cached");
	ck_assert_uint_eq(c.present_calls, 3);
	ck_assert_uint_eq(c.fetch_calls, 0);
	ck_assert_uint_eq(pl.n_objs, 0);
	ck_assert_uint_eq(pl.n_tasks, 0);
	assert_unpinned(o, 5);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	/* group B's last chunk missing: found after all of A was looked at */
	o[4] = put_obj(&f, 7, 2, OBJ_A);
	retrieve(&f, &r, &c, &pl, KVS_E_MISS);
	ERR_HAS("chunk 2 of group 9 is not cached");
	ck_assert_uint_eq(c.present_calls, 6);
	ck_assert_uint_eq(c.fetch_calls, 0);
	assert_unpinned(o, 5);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	ck_assert_mem_eq(f.mem, img, MEM_BYTES); /* nothing written */
	free(img);
	fx_done(&f);
}
END_TEST

/* skip_tokens with A (16 tokens per block, 2 blocks per chunk), 3 chunks:
 * which of the 6 blocks are written, and which chunks must be present. */
static const struct {
	uint64_t skip;
	bool want[6];
	uint32_t present; /* chunks looked up */
} SKIPS[] = {
	{0, {1, 1, 1, 1, 1, 1}, 3},   {15, {1, 1, 1, 1, 1, 1}, 3}, {16, {0, 1, 1, 1, 1, 1}, 3},
	{31, {0, 1, 1, 1, 1, 1}, 3},  {32, {0, 0, 1, 1, 1, 1}, 2}, {40, {0, 0, 1, 1, 1, 1}, 2},
	{48, {0, 0, 0, 1, 1, 1}, 2},  {80, {0, 0, 0, 0, 0, 1}, 1}, {95, {0, 0, 0, 0, 0, 1}, 1},
	{96, {0, 0, 0, 0, 0, 0}, 0},  {1000, {0, 0, 0, 0, 0, 0}, 0},
};

START_TEST(retrieve_skip_tokens)
{
	const int i = _i;
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	kvs_l1_obj *o[3] = {NULL, NULL, NULL};
	/* only the chunks that must be present are */
	for (int k = 0; k < 3; k++)
		if (SKIPS[i].want[2 * k] || SKIPS[i].want[2 * k + 1])
			o[k] = put_obj(&f, 7, (uint32_t)k, OBJ_A);
	int64_t a[6] = {11, 12, 2, 1, 8, 9};
	req r;
	req_init(&r, KVS_OP_RETRIEVE, 3, 0);
	req_list(&r, a, 6);
	r.m.skip_tokens = SKIPS[i].skip;
	kvs_plan pl = {0};
	src_ctx c = {0};
	uint8_t *img = snapshot(&f);
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_uint_eq(c.present_calls, SKIPS[i].present);
	ck_assert_uint_eq(c.fetch_calls, SKIPS[i].present);
	ck_assert_uint_eq(pl.n_tasks, SKIPS[i].present);
	run_retrieve(&f, &pl);
	for (int k = 0; k < 3; k++)
		if (o[k])
			expect_scatter(&f, img, A, a + 2 * k, SKIPS[i].want + 2 * k, o[k]);
	ck_assert_mem_eq(f.mem, img, MEM_BYTES);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	assert_unpinned(o, 3);
	free(img);
	fx_done(&f);
}
END_TEST

START_TEST(retrieve_window)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_group_desc d = DA;
	d.id = 11;
	d.window_chunks = 2; /* sliding window: the last two chunks */
	kvs_reg_group *W = add_group(&f, d, 16, 2, LA);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	kvs_l1_obj *ow[4] = {NULL, NULL, put_obj(&f, 11, 2, OBJ_A), put_obj(&f, 11, 3, OBJ_A)};
	kvs_l1_obj *oa[4] = {put_obj(&f, 7, 0, OBJ_A), put_obj(&f, 7, 1, OBJ_A), put_obj(&f, 7, 2, OBJ_A),
			     put_obj(&f, 7, 3, OBJ_A)};
	int64_t w[8] = {1, 2, 3, 4, 5, 6, 7, 8}, a[8] = {8, 7, 6, 5, 4, 3, 2, 1};
	req r;
	req_init(&r, KVS_OP_RETRIEVE, 4, 0);
	req_list(&r, w, 8);
	req_list(&r, a, 8);
	kvs_plan pl = {0};
	src_ctx c = {0};
	uint8_t *img = snapshot(&f);
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_uint_eq(c.present_calls, 2 + 4);
	ck_assert_uint_eq(pl.n_tasks, 2 + 4);
	run_retrieve(&f, &pl);
	static const bool both[2] = {true, true};
	for (int k = 0; k < 4; k++) {
		if (k >= 2)
			expect_scatter(&f, img, W, w + 2 * k, both, ow[k]);
		expect_scatter(&f, img, A, a + 2 * k, both, oa[k]);
	}
	ck_assert_mem_eq(f.mem, img, MEM_BYTES);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	assert_unpinned(ow, 4);
	assert_unpinned(oa, 4);
	/* fewer chunks than the window: all of them */
	req_init(&r, KVS_OP_RETRIEVE, 1, 3);
	req_list(&r, w + 6, 2);
	req_list(&r, a + 6, 2);
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_uint_eq(c.present_calls, 2);
	ck_assert_uint_eq(pl.n_tasks, 2);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	free(img);
	fx_done(&f);
}
END_TEST

START_TEST(retrieve_recurrent)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *R = add_group(&f, DR, 16, 2, LR);
	kvs_l1_obj *o = put_obj(&f, 5, 2, OBJ_R); /* the last chunk's state only */
	/* earlier chunks name blocks too: not written */
	int64_t ids[12] = {0, 0, 0, 2, 0, 0, 0, 3, 0, 11, 0, 0};
	req r;
	req_init(&r, KVS_OP_RETRIEVE, 3, 0);
	req_list(&r, ids, 12);
	kvs_plan pl = {0};
	src_ctx c = {0};
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	uint8_t *img = snapshot(&f);
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_uint_eq(c.present_calls, 1);
	ck_assert_uint_eq(c.fetch_calls, 1);
	ck_assert_uint_eq(pl.n_tasks, 1);
	ck_assert_uint_eq(pl.tasks[0]->n_segs, 2);
	run_retrieve(&f, &pl);
	expect_scatter(&f, img, R, ids + 8, (bool[]){false, true, false, false}, o);
	ck_assert_mem_eq(f.mem, img, MEM_BYTES);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	ck_assert_uint_eq(kvs_l1_pins(o), 0);

	/* skip_tokens: the state is written unless every token is skipped */
	r.m.skip_tokens = 3 * 4 * 16 - 1;
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_uint_eq(pl.n_tasks, 1);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	r.m.skip_tokens = 3 * 4 * 16;
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_uint_eq(c.present_calls, 0);
	ck_assert_uint_eq(pl.n_tasks, 0);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	r.m.skip_tokens = 0;

	/* the last chunk must name exactly one destination */
	int64_t two[12] = {0, 0, 0, 2, 0, 0, 0, 3, 0, 11, 0, 12};
	int64_t none[12] = {0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0};
	for (int i = 0; i < 2; i++) {
		r.m.blocks.ids[0] = i ? none : two;
		retrieve(&f, &r, &c, &pl, KVS_E_GEOMETRY);
		ERR_HAS("exactly one destination block in the last chunk");
		ck_assert_uint_eq(c.present_calls, 0);
		ck_assert_uint_eq(c.fetch_calls, 0);
		kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	}
	ck_assert_mem_eq(f.mem, img, MEM_BYTES);
	free(img);
	fx_done(&f);
}
END_TEST

START_TEST(retrieve_fetch_refused)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	add_group(&f, DA, 16, 2, LA);
	add_group(&f, DB, 8, 1, LB);
	kvs_l1_obj *o[4] = {put_obj(&f, 7, 0, OBJ_A), put_obj(&f, 7, 1, OBJ_A), put_obj(&f, 9, 0, OBJ_B),
			    put_obj(&f, 9, 1, OBJ_B)};
	int64_t a[4] = {1, 2, 3, 4}, b[2] = {1, 2};
	req r;
	req_init(&r, KVS_OP_RETRIEVE, 2, 0);
	req_list(&r, a, 4);
	req_list(&r, b, 2);
	for (uint32_t at = 1; at <= 4; at++) {
		kvs_plan pl = {0};
		src_ctx c = {.refuse_at = at, .refuse_code = at == 3 ? KVS_E_MISS : KVS_E_NOSPACE};
		uint8_t *img = snapshot(&f);
		retrieve(&f, &r, &c, &pl, 0); /* not an error of the plan: see stopped */
		ck_assert_int_eq(pl.stopped, c.refuse_code);
		ck_assert_uint_eq(c.present_calls, 4);
		ck_assert_uint_eq(c.fetch_calls, at); /* nothing asked after the refusal */
		ck_assert_uint_eq(pl.n_objs, at - 1);
		/* every object is fetched before any copy is built: a part that
		 * stopped has none (waves could not have started one) */
		ck_assert_uint_eq(pl.n_tasks, 0);
		for (uint32_t i = 0; i < 4; i++)
			ck_assert_uint_eq(kvs_l1_pins(o[i]), i < at - 1 ? 1 : 0);
		run_retrieve(&f, &pl);
		ck_assert_mem_eq(f.mem, img, MEM_BYTES);
		kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
		assert_unpinned(o, 4);
		free(img);
	}
	fx_done(&f);
}
END_TEST

/* ---- waves (plan.h) ------------------------------------------------------------ */

/* Records each offer: the tasks offered are the plan's next ones, and
 * (retrieve) how many fetches had run by then. */
typedef struct wave_rec {
	kvs_plan *pl;
	const uint32_t *fetch_calls; /* retrieve: the source's counter, or NULL */
	uint32_t calls, n[MAXK], fetched[MAXK];
	bool refuse;
} wave_rec;

static bool t_take(void *arg, kvs_copy_task **tasks, uint32_t n)
{
	wave_rec *w = arg;
	ck_assert_uint_lt(w->calls, MAXK);
	ck_assert_ptr_eq(tasks, w->pl->tasks + w->pl->handed);
	ck_assert_uint_eq(n, w->pl->n_tasks - w->pl->handed);
	ck_assert_uint_gt(n, 0);
	w->fetched[w->calls] = w->fetch_calls ? *w->fetch_calls : 0;
	w->n[w->calls++] = n;
	return !w->refuse;
}

/* What a taker does with the tasks it took once their copies ended. */
static void free_handed(kvs_plan *pl)
{
	for (uint32_t i = 0; i < pl->handed; i++) {
		free(pl->tasks[i]->segs);
		free(pl->tasks[i]);
	}
}

/* group W: 1 block of 64 bytes per chunk, 16 blocks: 8 chunks fill MAXK */
static const kvs_group_desc DW = {.id = 3, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16,
				  .blocks_per_chunk = 1, .window_chunks = -1, .null_block = -1};
static const lay LW[1] = {{64, 64}};
static const int64_t WIDS[8] = {15, 13, 11, 9, 7, 5, 3, 1};

START_TEST(store_waves)
{
	/* {first, max} -> the waves taken, the rest left for the caller */
	static const struct {
		uint64_t first, max;
		uint32_t calls, n[3], rest;
	} cases[] = {
		{128, 1 << 20, 2, {2, 3}, 3}, /* 128 B, then 192 B; 288 B would not leave a rest */
		{128, 128, 3, {2, 2, 2}, 2},  /* capped at max */
		{64, 64, 7, {1, 1, 1}, 1},    /* one object per wave, the last one left */
		{1 << 20, 1 << 20, 0, {0}, 8},  /* the part is shorter than a wave */
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		fx f;
		fx_init(&f, 64 * PAGE);
		kvs_reg_group *W = add_group(&f, DW, 16, 1, LW);
		req r;
		req_init(&r, KVS_OP_STORE, 8, 200);
		req_list(&r, WIDS, 8);
		kvs_plan pl = {0};
		wave_rec w = {.pl = &pl};
		kvs_plan_wave wave = {.first = cases[ci].first, .max = cases[ci].max, .take = t_take, .arg = &w};
		EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
		EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, &wave, &pl), 0);
		ck_assert_uint_eq(w.calls, cases[ci].calls);
		uint32_t handed = 0;
		for (uint32_t i = 0; i < w.calls && i < 3; i++) {
			ck_assert_uint_eq(w.n[i], cases[ci].n[i]);
			handed += w.n[i];
		}
		if (w.calls > 3)
			handed = 8 - cases[ci].rest;
		ck_assert_uint_eq(pl.handed, handed);
		ck_assert_uint_eq(pl.n_tasks - pl.handed, cases[ci].rest);
		/* taken or not, the tasks together are the whole part, in order */
		ck_assert_uint_eq(pl.n_tasks, 8);
		run_store(&f, &pl);
		for (uint32_t k = 0; k < 8; k++) {
			int i = check_stored(&f, &pl, W, 200 + k, WIDS + k, 1);
			ck_assert_int_eq(task_obj(&pl, pl.tasks[k]), i);
		}
		free_handed(&pl);
		kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
		fx_done(&f);
	}
}
END_TEST

/* A taker that refuses leaves everything with the plan: offered again with
 * every later task, the plan ends as one without waves. */
START_TEST(store_waves_refused)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *W = add_group(&f, DW, 16, 1, LW);
	req r;
	req_init(&r, KVS_OP_STORE, 8, 300);
	req_list(&r, WIDS, 8);
	kvs_plan pl = {0};
	wave_rec w = {.pl = &pl, .refuse = true};
	kvs_plan_wave wave = {.first = 128, .max = 128, .take = t_take, .arg = &w};
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, &wave, &pl), 0);
	ck_assert_uint_eq(w.calls, 6); /* before keys 3..8 */
	ck_assert_uint_eq(w.n[0], 2);
	ck_assert_uint_eq(w.n[5], 7);
	ck_assert_uint_eq(pl.handed, 0);
	run_store(&f, &pl);
	for (uint32_t k = 0; k < 8; k++)
		check_stored(&f, &pl, W, 300 + k, WIDS + k, 1);
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	fx_done(&f);
}
END_TEST

/* L1 full after waves were taken: the plan fails, and still lists every
 * object it reserved, those the taken tasks copy into among them (the
 * caller keeps them reserved until those copies end). */
START_TEST(store_waves_then_nospace)
{
	fx f;
	fx_init(&f, 4 * PAGE); /* four 64-byte objects, a page each */
	add_group(&f, DW, 16, 1, LW);
	req r;
	req_init(&r, KVS_OP_STORE, 8, 400);
	req_list(&r, WIDS, 8);
	kvs_plan pl = {0};
	wave_rec w = {.pl = &pl};
	kvs_plan_wave wave = {.first = 128, .max = 1 << 20, .take = t_take, .arg = &w};
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, &wave, &pl), KVS_E_NOSPACE);
	ERR_HAS("L1 cannot hold");
	ck_assert_uint_eq(w.calls, 1);
	ck_assert_uint_eq(pl.handed, 2);
	ck_assert_uint_eq(pl.n_tasks, 4);
	ck_assert_uint_eq(pl.n_objs, 4);
	for (uint32_t t = 0; t < pl.n_tasks; t++)
		ck_assert_int_eq(task_obj(&pl, pl.tasks[t]), (int)t);
	ck_assert_uint_eq(l1st(&f).objects_reserved, 4);
	free_handed(&pl); /* their copies ended */
	kvs_plan_undo(f.l1, &pl, KVS_OP_STORE);
	fx_done(&f);
}
END_TEST

/* A retrieve whose objects are all ready (in L1) offers waves while it
 * fetches; one that is not offers them only once every object was fetched.
 * Either way its tasks, taken or not, write the whole part. */
START_TEST(retrieve_waves)
{
	for (uint32_t unready = 0; unready <= 5; unready += 5) {
		fx f;
		fx_init(&f, 64 * PAGE);
		kvs_reg_group *W = add_group(&f, DW, 16, 1, LW);
		kvs_l1_obj *o[8];
		for (uint32_t k = 0; k < 8; k++)
			o[k] = put_obj(&f, DW.id, 500 + k, 64);
		req r;
		req_init(&r, KVS_OP_RETRIEVE, 8, 500);
		req_list(&r, WIDS, 8);
		kvs_plan pl = {0};
		src_ctx c = {.f = &f, .unready_at = unready};
		wave_rec w = {.pl = &pl, .fetch_calls = &c.fetch_calls};
		kvs_plan_wave wave = {.first = 128, .max = 1 << 20, .take = t_take, .arg = &w};
		kvs_plan_source src = {.present = t_present, .fetch = t_fetch, .arg = &c};
		uint8_t *img = snapshot(&f);
		EXPECT(kvs_plan_retrieve(f.P, &f.who, &f.g, &r.m, &src, &wave, &pl), 0);
		ck_assert_int_eq(pl.stopped, 0);
		ck_assert_uint_eq(c.present_calls, 8);
		ck_assert_uint_eq(c.fetch_calls, 8);
		ck_assert_uint_eq(w.calls, 2);
		ck_assert_uint_eq(w.n[0], 2);
		ck_assert_uint_eq(w.n[1], 3);
		/* the offer before building the 3rd and the 6th task */
		ck_assert_uint_eq(w.fetched[0], unready ? 8 : 3);
		ck_assert_uint_eq(w.fetched[1], unready ? 8 : 6);
		ck_assert_uint_eq(pl.handed, 5);
		ck_assert_uint_eq(pl.n_tasks, 8);
		run_retrieve(&f, &pl);
		for (uint32_t k = 0; k < 8; k++)
			expect_scatter(&f, img, W, WIDS + k, (bool[]){true}, o[k]);
		ck_assert_mem_eq(f.mem, img, MEM_BYTES);
		free_handed(&pl);
		kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
		assert_unpinned(o, 8);
		free(img);
		fx_done(&f);
	}
}
END_TEST

START_TEST(retrieve_limit)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_group_desc d = DB;
	d.blocks_per_chunk = 4097;
	add_group(&f, d, 8, 1, LB);
	int64_t *ids = malloc(4097 * sizeof(*ids));
	ck_assert_ptr_nonnull(ids);
	for (int i = 0; i < 4097; i++)
		ids[i] = -1;
	req r;
	req_init(&r, KVS_OP_RETRIEVE, 1, 0);
	req_list(&r, ids, 4097);
	kvs_plan pl = {0};
	src_ctx c = {0};
	retrieve(&f, &r, &c, &pl, KVS_E_LIMIT);
	ERR_HAS("blocks_per_chunk above 4096");
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	free(ids);
	fx_done(&f);
}
END_TEST

/* A hybrid registration stored from some blocks and retrieved into others:
 * each destination block ends up with its source block's bytes, layer by
 * layer, whatever the object layout in between. */
START_TEST(roundtrip_hybrid)
{
	fx f;
	fx_init(&f, 64 * PAGE);
	kvs_reg_group *A = add_group(&f, DA, 16, 2, LA);
	kvs_reg_group *R = add_group(&f, DR, 16, 2, LR);
	kvs_reg_group *B = add_group(&f, DB, 8, 1, LB);
	int64_t sa[6] = {1, 2, 3, 4, 5, 6}, sr[12] = {0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 0, 3}, sb[3] = {0, 1, 2};
	req r;
	req_init(&r, KVS_OP_STORE, 3, 500);
	req_list(&r, sa, 6);
	req_list(&r, sr, 12);
	req_list(&r, sb, 3);
	kvs_plan pl = {0};
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	EXPECT(kvs_plan_store(f.P, &f.who, &f.g, &r.m, NULL, &pl), 0);
	ck_assert_uint_eq(pl.n_objs, 9);
	run_store(&f, &pl);
	for (uint32_t i = 0; i < pl.n_objs; i++)
		kvs_l1_commit(f.l1, pl.objs[i]);
	kvs_plan_free_tasks(pl.tasks, pl.n_tasks);
	free(pl.objs);
	free(pl.geoms);
	free(pl.chunk);
	free(pl.evh);
	memset(&pl, 0, sizeof(pl));

	int64_t da[6] = {14, 13, 12, 11, 10, 9}, dr[12] = {0, 0, 0, 0, 0, 0, 0, 0, 15, 0, 0, 0}, db[3] = {7, 6, 5};
	req_init(&r, KVS_OP_RETRIEVE, 3, 500);
	req_list(&r, da, 6);
	req_list(&r, dr, 12);
	req_list(&r, db, 3);
	src_ctx c = {0};
	EXPECT(kvs_plan_check(f.P, &f.g, &r.m, &pl), 0);
	uint8_t *img = snapshot(&f);
	retrieve(&f, &r, &c, &pl, 0);
	ck_assert_uint_eq(pl.n_tasks, 3 + 1 + 3);
	run_retrieve(&f, &pl);
	/* expected: engine memory with each destination block a copy of its
	 * source block */
	for (uint32_t li = 0; li < 2; li++)
		for (int i = 0; i < 6; i++)
			memcpy(img + (block(&f, A, li, da[i]) - f.mem), block(&f, A, li, sa[i]),
			       view(&f, A, li)->block_bytes);
	for (uint32_t li = 0; li < 2; li++)
		memcpy(img + (block(&f, R, li, 15) - f.mem), block(&f, R, li, 3), view(&f, R, li)->block_bytes);
	for (int i = 0; i < 3; i++)
		memcpy(img + (block(&f, B, 0, db[i]) - f.mem), block(&f, B, 0, sb[i]), OBJ_B);
	ck_assert_mem_eq(f.mem, img, MEM_BYTES);
	kvs_plan_undo(f.l1, &pl, KVS_OP_RETRIEVE);
	free(img);
	fx_done(&f);
}
END_TEST

static Suite *plan_suite(void)
{
	Suite *s = suite_create("plan");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, check_lists);
	tcase_add_test(tc, check_retrieve_duplicates);
	tcase_add_test(tc, check_scratch_grows);
	tcase_add_test(tc, store_attention_layout);
	tcase_add_test(tc, store_segments_merge);
	tcase_add_test(tc, store_event_hashes);
	tcase_add_test(tc, store_recurrent);
	tcase_add_test(tc, store_attention_nulls);
	tcase_add_test(tc, store_skips_cached);
	tcase_add_test(tc, store_stages_reserved);
	tcase_add_test(tc, store_nospace);
	tcase_add_test(tc, retrieve_scatter);
	tcase_add_test(tc, retrieve_miss_fetches_nothing);
	tcase_add_loop_test(tc, retrieve_skip_tokens, 0, (int)(sizeof(SKIPS) / sizeof(SKIPS[0])));
	tcase_add_test(tc, retrieve_window);
	tcase_add_test(tc, retrieve_recurrent);
	tcase_add_test(tc, retrieve_fetch_refused);
	tcase_add_test(tc, store_waves);
	tcase_add_test(tc, store_waves_refused);
	tcase_add_test(tc, store_waves_then_nospace);
	tcase_add_test(tc, retrieve_waves);
	tcase_add_test(tc, retrieve_limit);
	tcase_add_test(tc, roundtrip_hybrid);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(plan_suite)
