/* Registrations and host imports: validation, all-or-nothing registration,
 * alias-counted memfd mappings, unregister with lease draining. */
#include "registry.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "registry"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "kvs_time.h"
#include "keys.h"
#include "reply.h"
#include "copy_cuda.h"
#include "copy_host.h"
#include "import.h"
#include "kvs_workq.h"

struct kvs_registry {
	struct kvs_cuda_engine *cuda;
	kvs_workq *q;           /* the setup thread (NULL: registers complete inline) */
	kvs_workq *reclaimq;    /* host unmaps (NULL: inline) */
	uint32_t test_delay_ms; /* KVS_TEST_REGISTER_DELAY_MS: every register deferred, this much slower */
	kvs_htab *regs;    /* kvs_reg by id */
	kvs_htab *live;    /* the live (not dead) kvs_reg of each session, by session id */
	kvs_imports *imports;
};

int kvs_registry_create(kvs_registry **ret)
{
	kvs_registry *r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	int e = kvs_htab_create(sizeof(uint64_t), offsetof(kvs_reg, id), &r->regs);
	if (e == 0)
		e = kvs_imports_create(&r->imports);
	if (e == 0)
		e = kvs_htab_create(sizeof(uint64_t), offsetof(kvs_reg, session), &r->live);
	if (e) {
		kvs_imports_destroy(r->imports);
		kvs_htab_destroy(r->regs);
		free(r);
		return e;
	}
	const char *d = getenv("KVS_TEST_REGISTER_DELAY_MS");
	r->test_delay_ms = d ? (uint32_t)strtoul(d, NULL, 10) : 0;
	*ret = r;
	return 0;
}

void kvs_registry_set_setupq(kvs_registry *r, kvs_workq *q)
{
	r->q = q;
	kvs_imports_set_workq(r->imports, q);
}

void kvs_registry_set_reclaimq(kvs_registry *r, kvs_workq *q)
{
	r->reclaimq = q;
	kvs_imports_set_reclaimq(r->imports, q);
}

void kvs_registry_set_cuda(kvs_registry *r, struct kvs_cuda_engine *e)
{
	r->cuda = e;
	kvs_imports_set_cuda(r->imports, e);
}

static void spans_free(struct kvs_cuda_engine *cuda, kvs_span *spans, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		if (spans[i].cspan) {
			kvs_cuda_span_unmap(cuda, spans[i].cspan);
			continue;
		}
		munmap(spans[i].base, spans[i].size);
	}
	free(spans);
}

/* A registration's stream and spans, torn down off the loop: a CUDA one's
 * on the setup thread (their driver calls never run on the loop), a host
 * one's on the reclaim thread; queued before the imports' own releases to
 * the same thread, so FIFO unmaps the spans first. */
typedef struct teardown_item {
	kvs_workq_item wi; /* first */
	struct kvs_cuda_engine *cuda; /* outlives the queue (the registry may not: shutdown) */
	struct kvs_cuda_stream *stream;
	kvs_span *spans;
	uint32_t n_spans;
	bool device; /* driver work: L1's pinning pauses for it */
} teardown_item;

static void teardown_work(kvs_workq_item *it)
{
	teardown_item *t = (teardown_item *)it;
	if (t->device)
		kvs_cuda_pin_hold(t->cuda, true);
	kvs_cuda_stream_destroy(t->cuda, t->stream);
	spans_free(t->cuda, t->spans, t->n_spans);
	if (t->device)
		kvs_cuda_pin_hold(t->cuda, false);
	free(t);
}

/* Releases a stream and spans: CUDA ones on the setup thread, host ones on
 * the reclaim thread (an unmap takes time in proportion to the pages the
 * copies touched: ~36 ms per GiB read); inline when there is no such thread. */
static void release_mappings(kvs_registry *r, struct kvs_cuda_stream *stream, kvs_span *spans, uint32_t n_spans)
{
	bool device = stream != NULL;
	for (uint32_t i = 0; i < n_spans; i++)
		device |= spans[i].cspan != NULL;
	kvs_workq *q = device ? r->q : r->reclaimq;
	teardown_item *t = q && (device || n_spans) ? calloc(1, sizeof(*t)) : NULL;
	if (!t) {
		kvs_cuda_stream_destroy(r->cuda, stream);
		spans_free(r->cuda, spans, n_spans);
		return;
	}
	*t = (teardown_item){.wi.work = teardown_work, .cuda = r->cuda, .stream = stream, .spans = spans, .n_spans = n_spans,
			     .device = device};
	kvs_workq_submit(q, &t->wi);
}

static void reg_free(kvs_registry *r, kvs_reg *g)
{
	release_mappings(r, g->stream, g->spans, g->n_spans); /* before the imports they map */
	for (uint32_t i = 0; i < g->n_imports; i++)
		kvs_import_release(r->imports, g->imports[i]);
	for (uint32_t i = 0; i < g->n_groups; i++)
		free(g->groups[i].layers);
	free(g->groups);
	free(g->views);
	free(g->imports);
	free(g);
}

/* A registration dies: unreachable for new job parts from now on. */
static void reg_kill(kvs_registry *r, kvs_reg *g)
{
	if (!g->dead && kvs_htab_get(r->live, &g->session) == g)
		kvs_htab_del(r->live, &g->session);
	g->dead = true;
}

static void reg_release(kvs_server *srv, kvs_reg *g)
{
	reg_kill(srv->reg, g);
	kvs_htab_del(srv->reg->regs, &g->id);
	kvs_dbg("registration %llu released", (unsigned long long)g->id);
	reg_free(srv->reg, g);
}

void kvs_registry_destroy(kvs_registry *r)
{
	if (!r)
		return;
	size_t pos = 0;
	kvs_reg *g;
	while ((g = kvs_htab_next(r->regs, &pos)) != NULL) {
		kvs_htab_iter_del(r->regs, &pos);
		reg_free(r, g);
	}
	kvs_htab_destroy(r->regs);
	kvs_htab_destroy(r->live);
	kvs_imports_destroy(r->imports);
	free(r);
}

kvs_reg *kvs_registry_of_session(kvs_registry *r, uint64_t session) { return kvs_htab_get(r->live, &session); }

kvs_reg *kvs_registry_find_ns(kvs_registry *r, const char *ns, uint32_t world)
{
	size_t pos = 0;
	kvs_reg *g;
	while ((g = kvs_htab_next(r->regs, &pos)) != NULL)
		if (!g->dead && g->world == world && strcmp(g->ns, ns) == 0)
			return g;
	return NULL;
}

void kvs_reg_lease(kvs_reg *g) { g->leases++; }

void kvs_reg_unlease(kvs_server *srv, kvs_reg *g)
{
	if (g->leases == 0) {
		kvs_err("lease underflow on registration %llu", (unsigned long long)g->id);
		return;
	}
	if (--g->leases == 0 && g->dead && g->unreg_id == 0)
		reg_release(srv, g);
	/* a pending unregister is answered by the next tick */
}

uint32_t kvs_reg_chunk_tokens(const kvs_reg *g, uint32_t group)
{
	for (uint32_t i = 0; g && i < g->n_groups; i++)
		if (g->groups[i].desc.id == group)
			return g->groups[i].desc.tokens_per_block * g->groups[i].desc.blocks_per_chunk;
	return 0;
}

uint64_t kvs_registry_count(const kvs_registry *r) { return kvs_htab_count(r->regs); }
uint64_t kvs_registry_imports(const kvs_registry *r) { return kvs_imports_count(r->imports); }
uint64_t kvs_registry_aliases(const kvs_registry *r) { return kvs_imports_aliases(r->imports); }

/* ---- namespace geometry ------------------------------------------------------
 * What lookups need to know of a namespace and world (its groups' kinds,
 * windows, object sizes and layout fingerprints), persisted in L2 so that
 * lookups after a restart work before ranks re-register. The record is
 * versioned: a record of another version or length is ignored (lookups then
 * wait for a registration). Layout (little-endian, as the host writes it):
 * magic u32 "KVSG", version u32, n u32, pad u32, then n entries of
 * {id u32, kind u32, window i64, geom u64, obj_bytes u64}. */
#define GEO_MAGIC 0x4753564bu /* "KVSG" */
#define GEO_VERSION 1u

typedef struct geo_record {
	uint32_t magic, version, n, pad;
	struct {
		uint32_t id, kind;
		int64_t window;
		uint64_t geom, obj_bytes;
	} g[KVS_MAX_GROUPS];
} geo_record;

static void geo_from_reg(const kvs_reg *g, kvs_geo *geo)
{
	memset(geo, 0, sizeof(*geo));
	geo->n = g->n_groups;
	for (uint32_t i = 0; i < g->n_groups; i++) {
		geo->g[i].id = g->groups[i].desc.id;
		geo->g[i].kind = g->groups[i].desc.kind;
		geo->g[i].window = g->groups[i].desc.window_chunks;
		geo->g[i].geom = g->groups[i].geom;
		geo->g[i].obj_bytes = g->groups[i].obj_bytes;
	}
}

static void geo_key(uint8_t out[20], const char *ns, uint32_t world)
{
	kvs_ns_digest(ns, out);
	memcpy(out + 16, &world, 4);
}

static void persist_geometry(kvs_l2 *l2, const kvs_reg *g)
{
	if (!l2)
		return;
	kvs_geo geo;
	geo_from_reg(g, &geo);
	geo_record rec;
	memset(&rec, 0, sizeof(rec));
	rec.magic = GEO_MAGIC;
	rec.version = GEO_VERSION;
	rec.n = geo.n;
	for (uint32_t i = 0; i < geo.n; i++) {
		rec.g[i].id = geo.g[i].id;
		rec.g[i].kind = geo.g[i].kind;
		rec.g[i].window = geo.g[i].window;
		rec.g[i].geom = geo.g[i].geom;
		rec.g[i].obj_bytes = geo.g[i].obj_bytes;
	}
	uint8_t key[20];
	geo_key(key, g->ns, g->world);
	kvs_l2_put_meta(l2, key, sizeof(key), &rec, sizeof(rec));
}

bool kvs_registry_geometry(kvs_registry *r, kvs_l2 *l2, uint64_t session, const char *ns, uint32_t world,
			   kvs_geo *geo)
{
	kvs_reg *g = kvs_registry_of_session(r, session);
	if (!g)
		g = kvs_registry_find_ns(r, ns, world);
	if (g) {
		geo_from_reg(g, geo);
		return true;
	}
	uint8_t key[20];
	uint32_t len = 0;
	geo_record rec;
	geo_key(key, ns, world);
	if (!l2 || kvs_l2_get_meta(l2, key, sizeof(key), &rec, sizeof(rec), &len) != 0 || len != sizeof(rec) ||
	    rec.magic != GEO_MAGIC || rec.version != GEO_VERSION || rec.n > KVS_MAX_GROUPS)
		return false;
	memset(geo, 0, sizeof(*geo));
	geo->n = rec.n;
	for (uint32_t i = 0; i < rec.n; i++) {
		geo->g[i].id = rec.g[i].id;
		geo->g[i].kind = rec.g[i].kind;
		geo->g[i].window = rec.g[i].window;
		geo->g[i].geom = rec.g[i].geom;
		geo->g[i].obj_bytes = rec.g[i].obj_bytes;
	}
	return true;
}

/* ---- validation ----------------------------------------------------------- */

/* True if the byte sets of two strided views in one allocation intersect. */
static bool views_overlap(const kvs_layer_desc *a, const kvs_layer_desc *b)
{
	uint64_t a_end = a->offset + a->num_blocks * a->block_stride;
	uint64_t b_end = b->offset + b->num_blocks * b->block_stride;
	if (a_end <= b->offset || b_end <= a->offset)
		return false;
	if (a->block_stride != b->block_stride)
		return true; /* conservatively: interleaving only with equal strides */
	uint64_t s = a->block_stride;
	/* on the circle of length s, a occupies [0, a.bytes), b [d, d + b.bytes) */
	uint64_t d = (b->offset >= a->offset ? b->offset - a->offset : s - (a->offset - b->offset) % s) % s;
	if (d < a->block_bytes)
		return true;
	return d + b->block_bytes > s; /* b wraps around into a's bytes */
}

static int validate(kvs_server *srv, const kvs_msg *rq)
{
	if (rq->device.type == KVS_DEV_CUDA && !srv->cuda)
		return kvs__fail(srv, KVS_E_DEVICE, "device type 'cuda' is not available on this server (no GPU or "
				 "driver: host engine only)");
	if (rq->n_allocs == 0 || rq->n_groups == 0 || rq->n_layers == 0)
		return kvs__fail(srv, KVS_E_GEOMETRY, "a registration needs at least one allocation, group and layer");
	/* ranges: an allocation that `follows` continues the previous entry's
	 * range; range[h] is the size of the range whose first entry is h */
	uint64_t range[KVS_MAX_ALLOCS];
	long page = sysconf(_SC_PAGESIZE);
	for (uint32_t i = 0, h = 0; i < rq->n_allocs; i++) {
		const kvs_alloc_desc *a = &rq->allocs[i];
		if (!a->follows) {
			h = i;
			range[h] = a->size;
			continue;
		}
		if (i == 0)
			return kvs__fail(srv, KVS_E_GEOMETRY, "allocations[0]: follows no allocation");
		if (a->ipc_handle.len || rq->allocs[i - 1].ipc_handle.len)
			return kvs__fail(srv, KVS_E_GEOMETRY, "allocations[%u]: a legacy CUDA IPC allocation cannot be "
					 "part of a range", i);
		if (rq->device.type == KVS_DEV_HOST && rq->allocs[i - 1].size % (uint64_t)page)
			return kvs__fail(srv, KVS_E_RANGE, "allocations[%u]: size %llu is not a multiple of the page "
					 "size, so allocation %u cannot follow it", i - 1,
					 (unsigned long long)rq->allocs[i - 1].size, i);
		if (__builtin_add_overflow(range[h], a->size, &range[h]))
			return kvs__fail(srv, KVS_E_RANGE, "allocations[%u]: the range's size overflows", i);
		range[i] = 0;
	}
	for (uint32_t i = 0; i < rq->n_groups; i++) {
		const kvs_group_desc *g = &rq->groups[i];
		if (g->tokens_per_block == 0 || g->blocks_per_chunk == 0 || g->blocks_per_chunk > 4096)
			return kvs__fail(srv, KVS_E_GEOMETRY, "groups[%u]: tokens_per_block must be >= 1 and blocks_per_chunk 1..4096", i);
		if (g->window_chunks == 0 || g->window_chunks < -1)
			return kvs__fail(srv, KVS_E_GEOMETRY, "groups[%u]: window_chunks must be -1 or >= 1", i);
		if (g->kind == KVS_GROUP_RECURRENT && g->window_chunks != -1)
			return kvs__fail(srv, KVS_E_GEOMETRY, "groups[%u]: a recurrent group has no window", i);
		if (g->null_block < -1)
			return kvs__fail(srv, KVS_E_GEOMETRY, "groups[%u]: null_block must be -1 or a block id", i);
		for (uint32_t j = 0; j < i; j++)
			if (rq->groups[j].id == g->id)
				return kvs__fail(srv, KVS_E_GEOMETRY, "groups[%u]: duplicate group id %u", i, g->id);
	}
	for (uint32_t i = 0; i < rq->n_layers; i++) {
		const kvs_layer_desc *l = &rq->layers[i];
		uint32_t gi = 0;
		while (gi < rq->n_groups && rq->groups[gi].id != l->group)
			gi++;
		if (gi == rq->n_groups)
			return kvs__fail(srv, KVS_E_GEOMETRY, "layers[%u]: unknown group %u", i, l->group);
		if (l->alloc >= rq->n_allocs)
			return kvs__fail(srv, KVS_E_RANGE, "layers[%u]: allocation index %u out of range", i, l->alloc);
		if (rq->allocs[l->alloc].follows)
			return kvs__fail(srv, KVS_E_GEOMETRY, "layers[%u]: allocation %u continues a range; a layer "
					 "names the range's first allocation", i, l->alloc);
		if (l->num_blocks == 0 || l->block_bytes == 0)
			return kvs__fail(srv, KVS_E_GEOMETRY, "layers[%u]: num_blocks and block_bytes must be >= 1", i);
		if (l->block_bytes > l->block_stride)
			return kvs__fail(srv, KVS_E_GEOMETRY, "layers[%u]: block_bytes %llu exceeds block_stride %llu", i,
					 (unsigned long long)l->block_bytes, (unsigned long long)l->block_stride);
		/* the last block ends at offset + (num_blocks - 1) * stride +
		 * block_bytes: a padded stride need not fit after it */
		uint64_t span, end;
		if (__builtin_mul_overflow(l->num_blocks - 1, l->block_stride, &span) ||
		    __builtin_add_overflow(span, l->block_bytes, &span) || __builtin_add_overflow(l->offset, span, &end))
			return kvs__fail(srv, KVS_E_RANGE, "layers[%u]: offset + num_blocks * block_stride overflows", i);
		if (end > range[l->alloc])
			return kvs__fail(srv, KVS_E_RANGE, "layers[%u]: view ends at %llu, beyond allocation %u of %llu bytes",
					 i, (unsigned long long)end, l->alloc, (unsigned long long)range[l->alloc]);
		for (uint32_t j = 0; j < i; j++) {
			const kvs_layer_desc *o = &rq->layers[j];
			if (o->group == l->group && o->num_blocks != l->num_blocks)
				return kvs__fail(srv, KVS_E_GEOMETRY, "layers[%u]: num_blocks differs from layers[%u] of the same group", i, j);
			/* entries with one alloc_id are one allocation: compare by id.
			 * Views of different groups may share bytes: a hybrid engine
			 * (vLLM's hybrid allocator) lays every group's pages over one
			 * block pool, and a block id belongs to one group at a time */
			if (o->group == l->group &&
			    memcmp(rq->allocs[o->alloc].alloc_id, rq->allocs[l->alloc].alloc_id, 16) == 0 &&
			    views_overlap(o, l))
				return kvs__fail(srv, KVS_E_GEOMETRY, "layers[%u] overlaps layers[%u]", i, j);
		}
	}
	for (uint32_t i = 0; i < rq->n_groups; i++) {
		bool has = false;
		for (uint32_t j = 0; j < rq->n_layers && !has; j++)
			has = rq->layers[j].group == rq->groups[i].id;
		if (!has)
			return kvs__fail(srv, KVS_E_GEOMETRY, "groups[%u]: no layer", i);
	}
	/* the same alloc_id may appear more than once (one entry per layer
	 * tensor of one allocation): later entries alias the first import */
	return 0;
}

/* ---- register ----------------------------------------------------------------
 * A register runs in three steps. begin (loop): role, validation, token
 * claims, import reservations (kvs_import_reserve). work (the setup thread
 * for CUDA registrations, inline for host ones): opens the fresh imports,
 * checks the aliases, maps the ranges, creates the CUDA streams and staging
 * memory: every driver call of a register, off the loop. finish (loop, from
 * the completion queue): builds the registration, replaces the session's
 * previous one, replies. Meanwhile the session is not reaped and its later
 * requests wait behind the register (session.c); a session that ended
 * meanwhile gets nothing and what was made is released. */

/* Maps every range of several allocations (entries that `follow`) back to
 * back in one address range of its own, as the engine maps them, so views may
 * cross from one allocation into the next. *ret (may be NULL) and *ret_n; a
 * code and err on failure. Any thread (the setup thread for deferred work). */
static int map_spans(kvs_registry *R, const kvs_msg *rq, kvs_import *const *imps, kvs_span **ret,
		     uint32_t *ret_n, char *err, size_t errlen)
{
	uint32_t n = 0;
	for (uint32_t i = 1; i < rq->n_allocs; i++)
		n += rq->allocs[i].follows && !rq->allocs[i - 1].follows;
	*ret = NULL;
	*ret_n = 0;
	if (!n)
		return 0;
	kvs_span *sp = calloc(n, sizeof(*sp));
	if (!sp) {
		snprintf(err, errlen, "out of memory");
		return KVS_E_INTERNAL;
	}
	uint32_t k = 0;
	int r = 0;
	for (uint32_t h = 0; h < rq->n_allocs; h++) {
		uint32_t e = h + 1;
		while (e < rq->n_allocs && rq->allocs[e].follows)
			e++;
		if (rq->allocs[h].follows || e == h + 1)
			continue;
		kvs_span *s = &sp[k];
		s->head = h;
		for (uint32_t j = h; j < e; j++)
			s->size += rq->allocs[j].size;
		if (rq->device.type == KVS_DEV_CUDA) {
			kvs_cuda_map *pieces[KVS_MAX_ALLOCS];
			uint64_t sizes[KVS_MAX_ALLOCS];
			for (uint32_t j = h; j < e; j++) {
				pieces[j - h] = imps[j]->cmap;
				sizes[j - h] = rq->allocs[j].size;
			}
			char why[160];
			if ((r = kvs_cuda_span_map(R->cuda, pieces, sizes, e - h, &s->cspan, why, sizeof(why))) != 0) {
				snprintf(err, errlen, "allocations[%u..%u]: %s", h, e - 1, why);
				goto fail;
			}
			s->base = kvs_cuda_span_base(s->cspan);
		} else {
			uint8_t *va = mmap(NULL, s->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
			if (va == MAP_FAILED) {
				r = KVS_E_DEVICE;
				snprintf(err, errlen, "allocations[%u..%u]: reserving %llu bytes failed: %s", h, e - 1,
					 (unsigned long long)s->size, strerror(errno));
				goto fail;
			}
			uint64_t off = 0;
			for (uint32_t j = h; j < e; j++) {
				if (mmap(va + off, rq->allocs[j].size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
					 imps[j]->fd, 0) == MAP_FAILED) {
					r = KVS_E_DEVICE;
					snprintf(err, errlen, "allocations[%u]: mmap into its range failed: %s", j,
						 strerror(errno));
					munmap(va, s->size);
					goto fail;
				}
				off += rq->allocs[j].size;
			}
			s->base = va;
		}
		k++;
	}
	*ret = sp;
	*ret_n = k;
	return 0;
fail:
	spans_free(R->cuda, sp, k);
	return r;
}

static void reg_free_shell(kvs_reg *g)
{
	for (uint32_t gi = 0; g->groups && gi < g->n_groups; gi++)
		free(g->groups[gi].layers);
	free(g->groups);
	free(g->views);
	free(g->imports);
	free(g);
}

/* The layout fingerprint of a group (the L2 header's geometry): kind,
 * tokens/blocks per chunk, window, each layer's block_bytes. */
static uint64_t group_fingerprint(const kvs_reg_group *G, const kvs_msg *rq)
{
	uint64_t out;
	crypto_generichash_state hs;
	uint64_t fp[5] = {G->desc.kind, G->desc.tokens_per_block, G->desc.blocks_per_chunk,
			  (uint64_t)G->desc.window_chunks, G->n_layers};
	crypto_generichash_init(&hs, NULL, 0, 8);
	crypto_generichash_update(&hs, (const uint8_t *)fp, sizeof(fp));
	for (uint32_t k = 0; k < G->n_layers; k++)
		crypto_generichash_update(&hs, (const uint8_t *)&rq->layers[G->layers[k]].block_bytes, 8);
	crypto_generichash_final(&hs, (uint8_t *)&out, 8);
	return out;
}

/* A registration's groups and views over its imports and ranges (validated
 * request). NULL when memory runs out (nothing kept; spans stay the caller's). */
static kvs_reg *reg_build(const kvs_msg *rq, kvs_import *const *imps, kvs_span *spans, uint32_t n_spans)
{
	uint32_t n = rq->n_allocs;
	uint8_t *range_base[KVS_MAX_ALLOCS] = {0};
	for (uint32_t k = 0; k < n_spans; k++)
		range_base[spans[k].head] = spans[k].base;
	kvs_reg *g = calloc(1, sizeof(*g));
	if (!g)
		return NULL;
	g->groups = calloc(rq->n_groups, sizeof(*g->groups));
	g->views = calloc(rq->n_layers, sizeof(*g->views));
	g->imports = calloc(n, sizeof(*g->imports));
	g->n_groups = rq->n_groups;
	if (!g->groups || !g->views || !g->imports)
		goto fail;
	g->n_imports = n;
	memcpy(g->imports, imps, n * sizeof(*imps));
	for (uint32_t gi = 0; gi < rq->n_groups; gi++) {
		kvs_reg_group *G = &g->groups[gi];
		G->desc = rq->groups[gi];
		G->layers = calloc(rq->n_layers, sizeof(uint32_t));
		if (!G->layers)
			goto fail;
		for (uint32_t li = 0; li < rq->n_layers; li++) {
			const kvs_layer_desc *l = &rq->layers[li];
			if (l->group != G->desc.id)
				continue;
			G->layers[G->n_layers++] = li;
			G->num_blocks = l->num_blocks;
			/* attention: every block of the chunk; recurrent: the one state
			 * block at the chunk's end boundary */
			G->obj_bytes += l->block_bytes * (G->desc.kind == KVS_GROUP_RECURRENT ? 1 : G->desc.blocks_per_chunk);
		}
		G->geom = group_fingerprint(G, rq);
	}
	g->n_views = rq->n_layers;
	for (uint32_t li = 0; li < rq->n_layers; li++) {
		const kvs_layer_desc *l = &rq->layers[li];
		uint8_t *base = range_base[l->alloc] ? range_base[l->alloc] : imps[l->alloc]->base;
		g->views[li] = (kvs_view){.base = base + l->offset, .num_blocks = l->num_blocks,
					  .stride = l->block_stride, .block_bytes = l->block_bytes,
					  .imp = imps[l->alloc]};
	}
	g->spans = spans;
	g->n_spans = n_spans;
	return g;
fail:
	reg_free_shell(g);
	return NULL;
}

/* A register between begin and finish. The copied request (rq points
 * into allocs, ipc, groups and layers) outlives the decoded message.
 * Owned by the loop until submitted, by the setup thread while work runs,
 * by the loop again from finish on. */
typedef struct reg_pend {
	kvs_workq_item wi; /* first: the setup thread runs work, the loop finish */
	kvs_server *srv;
	uint64_t session, req_id;
	kvs_msg rq;
	kvs_alloc_desc allocs[KVS_MAX_ALLOCS];
	uint8_t ipc[KVS_MAX_ALLOCS][64];
	kvs_group_desc *groups;
	kvs_layer_desc *layers;
	bool allow_unsealed;
	uint32_t delay_ms;
	int fds[KVS_MAX_ALLOCS];          /* claimed broker fds, consumed by work; -1 */
	kvs_import *imps[KVS_MAX_ALLOCS]; /* reserved: one reference each */
	bool fresh[KVS_MAX_ALLOCS];
	kvs_span *spans;                  /* made by work */
	uint32_t n_spans;
	struct kvs_cuda_stream *stream;   /* made by work (cuda) */
	int result;
	char err[300];
} reg_pend;

static void pend_free(reg_pend *p)
{
	for (uint32_t i = 0; i < p->rq.n_allocs; i++)
		if (p->fds[i] >= 0)
			close(p->fds[i]);
	free(p->groups);
	free(p->layers);
	free(p);
}

/* The setup thread (or inline): every import, map and stream of the
 * register, in allocation order; on failure what work made is undone here
 * and the reservations are left to finish. */
static void reg_work(kvs_workq_item *it)
{
	reg_pend *p = (reg_pend *)it;
	uint64_t t0 = kvs_now_ms();
	kvs_registry *R = p->srv->reg;
	const kvs_msg *rq = &p->rq;
	if (p->delay_ms)
		usleep(p->delay_ms * 1000u); /* test hook: a slow driver */
	bool cuda = rq->device.type == KVS_DEV_CUDA; /* op_register took a pin hold: released below */
	uint32_t n = rq->n_allocs, i;
	for (i = 0; i < n && !p->result; i++) {
		const kvs_alloc_desc *a = &rq->allocs[i];
		kvs_import_req ir = {.dev_type = rq->device.type, .uuid = rq->device.uuid, .alloc_id = a->alloc_id,
				     .size = a->size, .fd = p->fds[i], .ipc_handle = a->ipc_handle.len ? a->ipc_handle.ptr : NULL,
				     .ipc_len = a->ipc_handle.len, .allow_unsealed = p->allow_unsealed};
		p->fds[i] = -1; /* consumed */
		char why[256];
		if ((p->result = kvs_import_complete(R->imports, p->imps[i], p->fresh[i], &ir, why, sizeof(why))) != 0)
			snprintf(p->err, sizeof(p->err), "allocations[%u]: %s", i, why);
	}
	for (; i < n; i++)
		if (p->fds[i] >= 0) {
			close(p->fds[i]);
			p->fds[i] = -1;
		}
	if (!p->result)
		p->result = map_spans(R, rq, p->imps, &p->spans, &p->n_spans, p->err, sizeof(p->err));
	if (!p->result && rq->device.type == KVS_DEV_CUDA &&
	    kvs_cuda_stream_create(R->cuda, kvs_cuda_map_device(p->imps[0]->cmap), &p->stream) != 0) {
		p->result = KVS_E_DEVICE;
		snprintf(p->err, sizeof(p->err), "cannot create the registration's CUDA streams");
	}
	if (p->result) {
		kvs_cuda_stream_destroy(R->cuda, p->stream); /* NULL so far: nothing */
		p->stream = NULL;
		spans_free(R->cuda, p->spans, p->n_spans);
		p->spans = NULL;
		p->n_spans = 0;
	}
	if (cuda)
		kvs_cuda_pin_hold(R->cuda, false);
	uint64_t ms = kvs_now_ms() - t0;
	if (ms > 100 + p->delay_ms) /* an operator should see the driver being slow */
		kvs_warn("register of session %016llx: %llu ms on the setup thread", (unsigned long long)p->session,
			 (unsigned long long)ms);
}

/* The loop: builds and installs the registration (or releases what the
 * attempt holds) and answers. Returns the register's code; with reply_self
 * the error reply is sent here (deferred), else the dispatcher sends it. */
static int reg_finish(reg_pend *p, bool reply_self)
{
	kvs_server *srv = p->srv;
	kvs_registry *R = srv->reg;
	const kvs_msg *rq = &p->rq;
	kvs_session *s = kvs__session_get(srv, p->session);
	uint32_t n = rq->n_allocs;
	int r = p->result;
	kvs_reg *g = NULL;
	if (s) {
		s->reg_pending = false;
		s->expires_ms = srv->now_ms + srv->cfg.ttl_ms; /* the wait was the server's */
	}
	if (r) {
		kvs__fail(srv, r, "%s", p->err);
		goto err_release;
	}
	if (!s) {
		r = KVS_E_SESSION;
		kvs_info("register of session %016llx finished after the session ended: released",
			 (unsigned long long)p->session);
		goto err_release;
	}
	g = reg_build(rq, p->imps, p->spans, p->n_spans);
	if (!g)
		goto err_nomem;
	do
		randombytes_buf(&g->id, sizeof(g->id));
	while (g->id == 0 || kvs_htab_get(R->regs, &g->id));
	g->session = s->id;
	snprintf(g->ns, sizeof(g->ns), "%s", s->ns);
	g->world = s->world;
	g->rank = s->rank;
	g->dev_type = rq->device.type;
	g->engine = g->dev_type == KVS_DEV_CUDA ? kvs_cuda_copy_engine(srv->cuda) : kvs_copy_pool_engine(srv->pool);
	/* replace the session's earlier registration only now that this one works */
	kvs_reg *old = kvs_registry_of_session(R, s->id);
	if (kvs_htab_put(R->regs, g) < 0)
		goto err_nomem;
	if (old)
		reg_kill(R, old);
	if (kvs_htab_put(R->live, g) < 0) { /* cannot fail: old's slot was just freed */
		kvs_htab_del(R->regs, &g->id);
		goto err_nomem;
	}
	g->stream = p->stream;
	if (old && old->leases == 0)
		reg_release(srv, old);
	uint64_t imported = 0;
	for (uint32_t i = 0; i < n; i++)
		imported += p->fresh[i];
	persist_geometry(srv->l2, g);
	kvs_info("registration %llu: session %016llx rank %u/%u, %u groups, %u layers, %llu imported, %llu aliased",
		 (unsigned long long)g->id, (unsigned long long)s->id, s->rank, s->world, g->n_groups,
		 g->n_views, (unsigned long long)imported, (unsigned long long)(n - imported));
	kvs_msg rep = {.op = KVS_OP_REGISTER, .id = p->req_id, .ok = true, .registration = g->id,
		       .imported = imported, .aliased = n - imported};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	pend_free(p);
	return 0;

err_nomem:
	r = kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	if (g)
		reg_free_shell(g);
err_release:
	release_mappings(R, p->stream, p->spans, p->n_spans);
	/* release exactly what this attempt reserved, newest first */
	for (uint32_t i = n; i-- > 0;)
		if (p->imps[i])
			kvs_import_release(R->imports, p->imps[i]);
	if (s && reply_self) {
		kvs_warn("session %016llx: register refused: %s: %s", (unsigned long long)s->id, kvs_error_name(r),
			 srv->errbuf);
		kvs__err_to_session(srv, s->id, KVS_OP_REGISTER, p->req_id, r, "%s", srv->errbuf);
	}
	pend_free(p);
	return r;
}

/* finish from the completion queue, then the session's held requests */
static void reg_done(kvs_cq_item *it)
{
	reg_pend *p = (reg_pend *)it;
	kvs_server *srv = p->srv;
	uint64_t session = p->session;
	srv->errbuf[0] = '\0';
	reg_finish(p, true);
	if (srv->replay)
		srv->replay(srv, session);
}

static int op_register(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

/* A refused registration is an engine misconfiguration the operator should
 * see (the engine gets the same text in the error reply). */
int kvs__op_register(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	int r = op_register(srv, s, rq);
	if (r)
		kvs_warn("session %016llx: register refused: %s: %s", (unsigned long long)s->id,
			 kvs_error_name(r), srv->errbuf);
	return r;
}

/* Copies what work and finish need of the request (the decoded message
 * and the bytes it points into go when the handler returns). */
static reg_pend *pend_new(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	reg_pend *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->groups = malloc(rq->n_groups * sizeof(*p->groups));
	p->layers = malloc(rq->n_layers * sizeof(*p->layers));
	if (!p->groups || !p->layers) {
		pend_free(p);
		return NULL;
	}
	memcpy(p->groups, rq->groups, rq->n_groups * sizeof(*p->groups));
	memcpy(p->layers, rq->layers, rq->n_layers * sizeof(*p->layers));
	memcpy(p->allocs, rq->allocs, rq->n_allocs * sizeof(*p->allocs));
	for (uint32_t i = 0; i < rq->n_allocs; i++) {
		p->fds[i] = -1;
		uint32_t len = rq->allocs[i].ipc_handle.len;
		if (len) { /* at most 64: validated by the codec */
			len = len < 64 ? len : 64;
			memcpy(p->ipc[i], rq->allocs[i].ipc_handle.ptr, len);
			p->allocs[i].ipc_handle = (kvs_bytes){.ptr = p->ipc[i], .len = rq->allocs[i].ipc_handle.len};
		}
	}
	p->rq = (kvs_msg){.op = KVS_OP_REGISTER, .id = rq->id, .device = rq->device, .allocs = p->allocs,
			  .n_allocs = rq->n_allocs, .groups = p->groups, .n_groups = rq->n_groups,
			  .layers = p->layers, .n_layers = rq->n_layers};
	p->srv = srv;
	p->session = s->id;
	p->req_id = rq->id;
	p->allow_unsealed = srv->cfg.allow_unsealed;
	p->delay_ms = srv->reg->test_delay_ms;
	return p;
}

static int op_register(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_registry *R = srv->reg;
	if (s->role != KVS_ROLE_WORKER)
		return kvs__fail(srv, KVS_E_SESSION, "only worker sessions register memory");
	int r = validate(srv, rq);
	if (r)
		return r;
	reg_pend *p = pend_new(srv, s, rq);
	if (!p)
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");

	/* Claim every token first: a token is single-use, so from here on the
	 * claimed fds are ours and are closed on failure. */
	uint32_t n = rq->n_allocs;
	uint32_t i;
	for (i = 0; i < n; i++) {
		if (rq->device.type == KVS_DEV_CUDA && rq->allocs[i].ipc_handle.len)
			continue; /* legacy CUDA IPC: the handle comes in the message */
		kvs_parked *c = kvs__broker_claim(srv, rq->allocs[i].token);
		if (!c) {
			r = kvs__fail(srv, KVS_E_AUTH, "allocations[%u]: token unknown, expired or already used", i);
			goto err;
		}
		bool match = memcmp(c->alloc_id, rq->allocs[i].alloc_id, 16) == 0 && c->size == rq->allocs[i].size;
		p->fds[i] = c->fd;
		free(c);
		if (!match) {
			r = kvs__fail(srv, KVS_E_AUTH, "allocations[%u]: alloc_id or size differ from what the broker received", i);
			goto err;
		}
	}
	/* reserve an import or an alias for each allocation: what the driver
	 * must do comes later, in reg_work */
	for (i = 0; i < n; i++) {
		const kvs_alloc_desc *a = &rq->allocs[i];
		kvs_import_req ir = {.dev_type = rq->device.type, .uuid = rq->device.uuid, .alloc_id = a->alloc_id,
				     .size = a->size, .fd = -1, .ipc_handle = a->ipc_handle.len ? a->ipc_handle.ptr : NULL,
				     .ipc_len = a->ipc_handle.len}; /* the kind (fd or legacy IPC) picks the operations */
		char why[300];
		if ((r = kvs_import_reserve(R->imports, &ir, &p->imps[i], &p->fresh[i], why, sizeof(why))) != 0) {
			r = kvs__fail(srv, r, "allocations[%u]: %s", i, why);
			goto err;
		}
	}
	/* from now until its work is done the background pinning starts no new
	 * slice: registers arriving together share one wait for the slices in
	 * progress, rather than each its own (reg_work releases the hold) */
	if (rq->device.type == KVS_DEV_CUDA)
		kvs_cuda_pin_hold(R->cuda, true);
	/* CUDA registers go to the setup thread; host ones make no driver call
	 * and complete here (unless the test hook defers them too) */
	if (R->q && (rq->device.type == KVS_DEV_CUDA || R->test_delay_ms)) {
		s->reg_pending = true;
		p->wi.work = reg_work;
		p->wi.cq.done = reg_done;
		kvs_workq_submit(R->q, &p->wi);
		return 0;
	}
	reg_work(&p->wi);
	return reg_finish(p, false);

err:
	while (i-- > 0)
		if (p->imps[i])
			kvs_import_release(R->imports, p->imps[i]);
	pend_free(p);
	return r;
}

/* ---- unregister -------------------------------------------------------------- */

int kvs__op_unregister(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_reg *g = kvs_htab_get(srv->reg->regs, &rq->registration);
	if (g && g->session == s->id && g->unreg_id)
		return kvs__fail(srv, KVS_E_BUSY, "an unregister of %llu is already waiting",
				 (unsigned long long)g->id);
	if (!g || g->session != s->id || g->dead)
		return kvs__fail(srv, KVS_E_NOREG, "registration %llu is not held by this session",
				 (unsigned long long)rq->registration);
	reg_kill(srv->reg, g);
	if (g->leases == 0) {
		reg_release(srv, g);
		kvs_msg rep = {.op = KVS_OP_UNREGISTER, .id = rq->id, .ok = true};
		kvs__reply(srv, s->ident, s->ident_len, &rep);
		return 0;
	}
	g->unreg_id = rq->id;
	g->unreg_deadline_ms = srv->now_ms + srv->cfg.drain_ms;
	kvs_info("registration %llu: unregister waits for %u leases", (unsigned long long)g->id, g->leases);
	return 0;
}

void kvs_registry_tick(kvs_server *srv)
{
	size_t pos = 0;
	kvs_reg *g;
	while ((g = kvs_htab_next(srv->reg->regs, &pos)) != NULL) {
		if (!g->unreg_id)
			continue;
		uint64_t id = g->unreg_id;
		uint64_t sess = g->session;
		if (g->leases == 0) {
			g->unreg_id = 0;
			reg_release(srv, g);
			kvs_msg rep = {.op = KVS_OP_UNREGISTER, .id = id, .ok = true};
			kvs__send_to_session(srv, sess, &rep);
			pos = 0; /* table changed: restart the sweep */
		} else if (g->unreg_deadline_ms <= srv->now_ms) {
			g->unreg_id = 0;
			/* still usable, unless the session registered anew meanwhile:
			 * a session never holds two live registrations */
			if (!kvs_registry_of_session(srv->reg, sess) && kvs_htab_put(srv->reg->live, g) == 0)
				g->dead = false;
			kvs__err_to_session(srv, sess, KVS_OP_UNREGISTER, id, KVS_E_BUSY,
					    "registration %llu still has %u active leases after %llu ms",
					    (unsigned long long)g->id, g->leases,
					    (unsigned long long)srv->cfg.drain_ms);
		}
	}
}

void kvs_registry_session_gone(kvs_server *srv, uint64_t session)
{
	size_t pos = 0;
	kvs_reg *g;
	while ((g = kvs_htab_next(srv->reg->regs, &pos)) != NULL) {
		if (g->session != session)
			continue;
		reg_kill(srv->reg, g);
		g->unreg_id = 0;
		if (g->leases == 0) {
			reg_release(srv, g);
			pos = 0;
		}
	}
}
