/* L1 DRAM tier: one arena carved into page runs, an index of objects, LRU
 * eviction by chunk. The contract is in kvs_l1.h; this file says how.
 *
 * Allocator: segregated fits over page runs (TLSF, Masmano et al., ECRTS
 * 2004). The arena is a list of extents in address order, each either FREE or
 * one object, each described by one record. Free extents sit in size classes:
 * one class per size below 16 pages, then 16 linear classes per power of two,
 * so sizes in one class differ by at most 1/16. A request for n pages scans
 * its own class (at most SCAN_MAX runs) for a run of at least n pages, then
 * takes the head of the first non-empty class above its own, found with two
 * find-first-set operations on the class bitmaps: every run there fits. A
 * larger run is split; a freed object merges with free neighbours at once,
 * so no two free extents are ever adjacent.
 * An object gets exactly ceil(len / 4 KiB) pages: internal waste is under
 * one page per object. A buddy allocator would round a 40 MiB object to
 * 64 MiB (up to 2x); slabs per size class would pin memory to classes as
 * registrations come and go (memcached's calcification). KV objects are
 * usually uniform within a registration, and then evicted holes are reused
 * exactly. Mixed sizes can fragment: eviction then keeps going in LRU order
 * until a run fits, or everything evictable is gone (KVS_E_NOSPACE).
 *
 * Records: 112 bytes each, in one table mapped MAP_NORESERVE at create time
 * with room for the worst case (objects <= pages, free extents <= objects +
 * 1), touched only as the high-water mark of records in use rises. Records
 * link each other by 32-bit index; none ever moves, and nothing allocates on
 * a path that frees (abort, eviction, clear), so those cannot fail. All
 * metadata lives outside the arena: copy threads working on the data of
 * reserved or pinned objects never race with the allocator.
 *
 * Chunks have no record of their own: the first member of a chunk is its
 * head and carries the chunk's list links and counters; the chunk index maps
 * the 52-byte chunk prefix of the key to it; members form a ring. When the
 * head leaves and others stay, the next member inherits the head fields.
 * Metadata per object: its record (112 B), its object-index slot (16 B at a
 * load of 3/8..3/4, so 21..43 B) and its share of its chunk's index slot:
 * 176..197 B with one object per chunk, 148..160 B with eight (measured by
 * the unit test at 4 KiB objects). */
#include "kvs_l1.h"

#include <assert.h>
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvs_error.h"
#include "kvs_htab.h"

#include "kvs_l1_impl.h"

/* ---- records ---------------------------------------------------------- */

static ref rec_alloc(kvs_l1 *l1)
{
	ref r = l1->rec_free;
	if (r) {
		l1->rec_free = l1->recs[r].anext;
	} else {
		/* cannot run out: see nrecs */
		assert(l1->rec_hwm < l1->nrecs);
		r = l1->rec_hwm++;
	}
	memset(&l1->recs[r], 0, sizeof(kvs_l1_obj));
	return r;
}

static void rec_release(kvs_l1 *l1, ref r)
{
	kvs_l1_obj *o = rec(l1, r);
	memset(o, 0, sizeof(*o));
	o->state = REC_UNUSED;
	o->anext = l1->rec_free;
	l1->rec_free = r;
}

/* ---- free extents ----------------------------------------------------- */


static void bin_insert(kvs_l1 *l1, ref r)
{
	kvs_l1_obj *f = rec(l1, r);
	unsigned fl, sl;
	size_class(f->npages, &fl, &sl);
	f->u.f.prev = 0;
	f->u.f.next = l1->bins[fl][sl];
	if (f->u.f.next)
		rec(l1, f->u.f.next)->u.f.prev = r;
	l1->bins[fl][sl] = r;
	l1->sl_map[fl] |= 1u << sl;
	l1->fl_map |= 1u << fl;
	l1->free_pages += f->npages;
	l1->nfree++;
}

static void bin_remove(kvs_l1 *l1, ref r)
{
	kvs_l1_obj *f = rec(l1, r);
	unsigned fl, sl;
	size_class(f->npages, &fl, &sl);
	if (f->u.f.prev)
		rec(l1, f->u.f.prev)->u.f.next = f->u.f.next;
	else
		l1->bins[fl][sl] = f->u.f.next;
	if (f->u.f.next)
		rec(l1, f->u.f.next)->u.f.prev = f->u.f.prev;
	if (!l1->bins[fl][sl]) {
		l1->sl_map[fl] &= ~(1u << sl);
		if (!l1->sl_map[fl])
			l1->fl_map &= ~(1u << fl);
	}
	f->u.f.prev = f->u.f.next = 0;
	l1->free_pages -= f->npages;
	l1->nfree--;
}

/* A free run of at least n pages, or 0. O(SCAN_MAX). */
static ref find_free(const kvs_l1 *l1, uint32_t n)
{
	unsigned fl, sl;
	size_class(n, &fl, &sl);
	/* Runs of n's own class may be shorter than n, except below SL_N. With
	 * uniform object sizes the first one fits. */
	ref r = l1->bins[fl][sl];
	for (unsigned i = 0; r && i < SCAN_MAX; i++) {
		const kvs_l1_obj *f = rec(l1, r);
		if (f->npages >= n)
			return r;
		r = f->u.f.next;
	}
	/* Every run of a higher class fits. */
	if (++sl == SL_N) {
		sl = 0;
		fl++;
	}
	if (fl >= FL_N)
		return 0;
	uint32_t m = l1->sl_map[fl] & (~0u << sl);
	if (!m) {
		uint32_t f = fl + 1 < FL_N ? l1->fl_map & (~0u << (fl + 1)) : 0;
		if (!f)
			return 0;
		fl = (unsigned)__builtin_ctz(f);
		m = l1->sl_map[fl];
	}
	return l1->bins[fl][__builtin_ctz(m)];
}

/* Splits the first n pages (fewer than it has) of extent r off into a new
 * record placed before r in address order; r keeps the rest. Neither is
 * binned or given a state here. */
static ref split_front(kvs_l1 *l1, ref r, uint32_t n)
{
	ref nr = rec_alloc(l1); /* the table never moves: r's record stays valid */
	kvs_l1_obj *f = rec(l1, r), *o = rec(l1, nr);
	o->data = f->data;
	o->npages = n;
	o->aprev = f->aprev;
	o->anext = r;
	if (f->aprev)
		rec(l1, f->aprev)->anext = nr;
	else
		l1->afirst = nr;
	f->aprev = nr;
	f->data += (size_t)n << PAGE_SHIFT;
	f->npages -= n;
	return nr;
}

/* Takes the first n pages of free run r. Returns the record of the taken
 * extent, still marked FREE and out of the bins: r itself on an exact fit,
 * else a new record placed before r, which keeps the rest. */
static ref extent_take(kvs_l1 *l1, ref r, uint32_t n)
{
	kvs_l1_obj *f = rec(l1, r);
	assert(f->state == KVS_L1_FREE && f->npages >= n);
	bin_remove(l1, r);
	if (f->npages == n)
		return r;
	ref nr = split_front(l1, r, n);
	rec(l1, nr)->state = KVS_L1_FREE;
	bin_insert(l1, r);
	return nr;
}

/* Makes extent r FREE, merged with free neighbours, in its bin. Record r may
 * go back to the record free list. Never fails. */
static void extent_release(kvs_l1 *l1, ref r)
{
	kvs_l1_obj *o = rec(l1, r);
	memset(&o->key, 0, sizeof(o->key));
	memset(&o->u, 0, sizeof(o->u));
	o->slack = 0;
	o->head = 0;
	o->state = KVS_L1_FREE;
	if (o->anext && rec(l1, o->anext)->state == KVS_L1_FREE) {
		ref nr = o->anext;
		kvs_l1_obj *n = rec(l1, nr);
		bin_remove(l1, nr);
		o->npages += n->npages;
		o->anext = n->anext;
		if (o->anext)
			rec(l1, o->anext)->aprev = r;
		rec_release(l1, nr);
	}
	if (o->aprev && rec(l1, o->aprev)->state == KVS_L1_FREE) {
		ref pr = o->aprev;
		kvs_l1_obj *p = rec(l1, pr);
		bin_remove(l1, pr);
		p->npages += o->npages;
		p->anext = o->anext;
		if (p->anext)
			rec(l1, p->anext)->aprev = pr;
		rec_release(l1, r);
		r = pr;
	}
	bin_insert(l1, r);
}

/* ---- chunks ----------------------------------------------------------- */

static void list_append(kvs_l1 *l1, struct list *L, ref r)
{
	kvs_l1_obj *h = rec(l1, r);
	h->u.o.cprev = L->last;
	h->u.o.cnext = 0;
	if (L->last)
		rec(l1, L->last)->u.o.cnext = r;
	else
		L->first = r;
	L->last = r;
}

static void list_remove(kvs_l1 *l1, struct list *L, ref r)
{
	kvs_l1_obj *h = rec(l1, r);
	if (h->u.o.cprev)
		rec(l1, h->u.o.cprev)->u.o.cnext = h->u.o.cnext;
	else
		L->first = h->u.o.cnext;
	if (h->u.o.cnext)
		rec(l1, h->u.o.cnext)->u.o.cprev = h->u.o.cprev;
	else
		L->last = h->u.o.cprev;
	h->u.o.cprev = h->u.o.cnext = 0;
}

static kvs_l1_obj *chunk_head(const kvs_l1 *l1, const kvs_l1_obj *o)
{
	kvs_l1_obj *h = kvs_htab_get(l1->chunks, &o->key);
	assert(h && h->head);
	return h;
}

/* A member of h's chunk became RESERVED or pinned. */
static void chunk_busy(kvs_l1 *l1, kvs_l1_obj *h)
{
	if (h->u.o.nbusy++ == 0) {
		list_remove(l1, &l1->lru, ref_of(l1, h));
		l1->evictable_pages -= h->u.o.cpages;
		list_append(l1, &l1->busy, ref_of(l1, h));
	}
}

/* A member of h's chunk stopped being RESERVED or pinned. Leaving the busy
 * state counts as a use: the chunk becomes the most recently used. */
static void chunk_idle(kvs_l1 *l1, kvs_l1_obj *h)
{
	assert(h->u.o.nbusy > 0);
	if (--h->u.o.nbusy == 0) {
		list_remove(l1, &l1->busy, ref_of(l1, h));
		list_append(l1, &l1->lru, ref_of(l1, h));
		l1->evictable_pages += h->u.o.cpages;
	}
}

/* Adds the new RESERVED object o to its chunk, creating the chunk if needed.
 * Returns 0 or -ENOMEM (nothing changed). */
static int member_add(kvs_l1 *l1, kvs_l1_obj *o)
{
	ref r = ref_of(l1, o);
	kvs_l1_obj *h = kvs_htab_get(l1->chunks, &o->key);
	if (h) {
		chunk_busy(l1, h);
		h->u.o.cpages += o->npages;
		o->u.o.sib = h->u.o.sib;
		h->u.o.sib = r;
		return 0;
	}
	int rc = kvs_htab_put(l1->chunks, o);
	if (rc < 0)
		return rc;
	o->head = 1;
	o->u.o.sib = r;
	o->u.o.nbusy = 1;
	o->u.o.cpages = o->npages;
	list_append(l1, &l1->busy, r);
	if (++l1->nchunks > l1->peak_chunks)
		l1->peak_chunks = l1->nchunks;
	return 0;
}

/* Unlinks object o from its chunk, which must be busy; was_busy says
 * whether o counted in nbusy. Drops the chunk with its last member. */
static void member_remove(kvs_l1 *l1, kvs_l1_obj *o, bool was_busy)
{
	kvs_l1_obj *h = chunk_head(l1, o);
	ref r = ref_of(l1, o);
	assert(h->u.o.nbusy > 0);
	if (o->u.o.sib == r) {
		assert(h == o);
		list_remove(l1, &l1->busy, r);
		kvs_htab_del(l1->chunks, &o->key);
		l1->nchunks--;
		return;
	}
	ref p = r;
	while (rec(l1, p)->u.o.sib != r)
		p = rec(l1, p)->u.o.sib;
	rec(l1, p)->u.o.sib = o->u.o.sib;
	if (h == o) {
		/* The next member inherits the head fields and the index entry. */
		ref nr = o->u.o.sib;
		kvs_l1_obj *n = rec(l1, nr);
		n->head = 1;
		n->u.o.nbusy = o->u.o.nbusy;
		n->u.o.cpages = o->u.o.cpages;
		n->u.o.cprev = o->u.o.cprev;
		n->u.o.cnext = o->u.o.cnext;
		if (n->u.o.cprev)
			rec(l1, n->u.o.cprev)->u.o.cnext = nr;
		else
			l1->busy.first = nr;
		if (n->u.o.cnext)
			rec(l1, n->u.o.cnext)->u.o.cprev = nr;
		else
			l1->busy.last = nr;
		o->head = 0;
		o->u.o.nbusy = o->u.o.cpages = o->u.o.cprev = o->u.o.cnext = 0;
		kvs_htab_del(l1->chunks, &o->key);
		/* Cannot fail: the table held as many entries a moment ago and
		 * only grows on insert (kvs_htab keeps count < 3/4 cap). */
		int rc = kvs_htab_put(l1->chunks, n);
		assert(rc == 0);
		(void)rc;
		h = n;
	}
	o->u.o.sib = 0;
	h->u.o.cpages -= o->npages;
	if (was_busy)
		chunk_idle(l1, h);
}

/* Takes object o out of the object index and the counters. */
static void obj_forget(kvs_l1 *l1, kvs_l1_obj *o)
{
	uint64_t len = obj_len(o);
	kvs_l1_obj *x = kvs_htab_del(l1->objs, &o->key);
	assert(x == o);
	(void)x;
	if (o->state == KVS_L1_RESERVED) {
		l1->bytes_reserved -= len;
		l1->objects_reserved--;
	}
	l1->bytes_used -= len;
	l1->objects--;
	l1->pages_used -= o->npages;
}

/* Frees every member of the idle chunk h. */
static void chunk_drop(kvs_l1 *l1, kvs_l1_obj *h, bool evicted)
{
	ref hr = ref_of(l1, h);
	assert(h->head && h->u.o.nbusy == 0);
	if (evicted && l1->on_evict)
		l1->on_evict(&h->key, l1->evict_arg);
	list_remove(l1, &l1->lru, hr);
	l1->evictable_pages -= h->u.o.cpages;
	kvs_htab_del(l1->chunks, &h->key);
	l1->nchunks--;
	ref r = hr;
	do {
		kvs_l1_obj *m = rec(l1, r);
		ref next = m->u.o.sib; /* read before the record is released */
		assert(m->state == KVS_L1_COMMITTED && m->u.o.pins == 0);
		if (evicted) {
			l1->evictions++;
			l1->evicted_bytes += obj_len(m);
		}
		obj_forget(l1, m);
		extent_release(l1, r); /* merges only with FREE extents, never members */
		r = next;
	} while (r != hr);
}

/* ---- API -------------------------------------------------------------- */

int kvs_l1_create(const kvs_l1_config *cfg, kvs_l1 **ret)
{
	uint64_t np = cfg->size >> PAGE_SHIFT;
	if (np == 0 || np > MAX_PAGES)
		return -EINVAL;
	int rc;
	kvs_l1 *l1 = calloc(1, sizeof(*l1));
	if (!l1)
		return -ENOMEM;
	l1->npages = (uint32_t)np;
	l1->size = np << PAGE_SHIFT;
	l1->on_evict = cfg->on_evict;
	l1->evict_arg = cfg->evict_arg;
	l1->arena = mmap(NULL, l1->size, PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (l1->arena == MAP_FAILED) {
		rc = -errno;
		goto err_free;
	}
	/* huge pages where the kernel allows: fewer faults and TLB misses on
	 * the copy path (advice only; failure is harmless) */
	madvise(l1->arena, l1->size, MADV_HUGEPAGE);
	l1->nrecs = 2 * l1->npages + 2;
	l1->recs_bytes = (size_t)l1->nrecs * sizeof(kvs_l1_obj);
	l1->recs = mmap(NULL, l1->recs_bytes, PROT_READ | PROT_WRITE,
			MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (l1->recs == MAP_FAILED) {
		rc = -errno;
		goto err_unmap_arena;
	}
	rc = kvs_htab_create(sizeof(kvs_objkey), offsetof(kvs_l1_obj, key), &l1->objs);
	if (rc < 0)
		goto err_unmap_recs;
	rc = kvs_htab_create(KVS_L1_CHUNK_KEY_BYTES, offsetof(kvs_l1_obj, key), &l1->chunks);
	if (rc < 0)
		goto err_destroy_objs;
	l1->rec_hwm = 1;
	ref r = rec_alloc(l1);
	kvs_l1_obj *f = rec(l1, r);
	f->data = l1->arena;
	f->npages = l1->npages;
	f->state = KVS_L1_FREE;
	l1->afirst = r;
	l1->ceiling = l1->npages;
	if (cfg->withhold) {
		f->state = REC_WITHHELD;
		l1->wh = r;
		l1->wh_pages = l1->npages;
	} else {
		bin_insert(l1, r);
	}
	*ret = l1;
	return 0;

err_destroy_objs:
	kvs_htab_destroy(l1->objs);
err_unmap_recs:
	munmap(l1->recs, l1->recs_bytes);
err_unmap_arena:
	munmap(l1->arena, l1->size);
err_free:
	free(l1);
	return rc;
}

void kvs_l1_destroy(kvs_l1 *l1)
{
	if (!l1)
		return;
	kvs_htab_destroy(l1->chunks);
	kvs_htab_destroy(l1->objs);
	munmap(l1->recs, l1->recs_bytes);
	munmap(l1->arena, l1->size);
	free(l1);
}

/* Hands out the first pages of the withheld tail: at least n (or all that
 * is left) in a step of GROW_PAGES, and, unless beyond, only below the
 * ceiling. They become a free run, merged with a free run before them.
 * False if nothing was handed out. */
static bool wh_grow(kvs_l1 *l1, uint32_t n, bool beyond)
{
	if (!l1->wh)
		return false;
	kvs_l1_obj *w = rec(l1, l1->wh);
	uint32_t start = (uint32_t)((uint64_t)(w->data - l1->arena) >> PAGE_SHIFT);
	uint32_t take = n > GROW_PAGES ? n : GROW_PAGES;
	if (!beyond) {
		if (l1->ceiling <= start || l1->ceiling - start < n)
			return false;
		if (take > l1->ceiling - start)
			take = l1->ceiling - start;
	}
	if (take >= w->npages) {
		ref r = l1->wh;
		l1->wh = 0;
		l1->wh_pages = 0;
		extent_release(l1, r);
		return true;
	}
	ref nr = split_front(l1, l1->wh, take);
	l1->wh_pages -= take;
	extent_release(l1, nr); /* FREE, merged with a free run before it */
	return true;
}

void kvs_l1_set_ceiling(kvs_l1 *l1, uint64_t bytes)
{
	uint64_t p = bytes >> PAGE_SHIFT;
	l1->ceiling = p > l1->npages ? l1->npages : (uint32_t)p;
}

void kvs_l1_release(kvs_l1 *l1)
{
	if (l1->wh)
		wh_grow(l1, l1->wh_pages, true);
	l1->ceiling = l1->npages;
}

uint64_t kvs_l1_withheld(const kvs_l1 *l1) { return (uint64_t)l1->wh_pages << PAGE_SHIFT; }

int kvs_l1_reserve(kvs_l1 *l1, const kvs_objkey *key, uint64_t len, kvs_l1_obj **ret)
{
	if (len == 0)
		return -EINVAL;
	kvs_l1_obj *old = kvs_htab_get(l1->objs, key);
	if (old)
		return old->state == KVS_L1_COMMITTED ? -EEXIST : -EBUSY;
	if (len > l1->size)
		goto nospace;
	uint32_t n = (uint32_t)((len + KVS_L1_PAGE - 1) >> PAGE_SHIFT);
	ref f = find_free(l1, n);
	if (!f && wh_grow(l1, n, false))
		f = find_free(l1, n);
	if (!f) {
		/* Cheap feasibility test first, so a full cache of pinned or
		 * reserved objects answers at once and loses nothing. */
		if ((uint64_t)l1->free_pages + l1->evictable_pages + l1->wh_pages < n)
			goto nospace;
		while (!f && l1->lru.first) {
			chunk_drop(l1, rec(l1, l1->lru.first), true);
			f = find_free(l1, n);
		}
		while (!f && wh_grow(l1, n, true)) /* above the ceiling: last */
			f = find_free(l1, n);
		if (!f)
			goto nospace; /* fragmented: the evictions stay made */
	}

	ref r = extent_take(l1, f, n);
	kvs_l1_obj *o = rec(l1, r);
	o->key = *key;
	o->slack = (uint16_t)(((uint64_t)n << PAGE_SHIFT) - len);
	o->state = KVS_L1_RESERVED;
	int rc = kvs_htab_put(l1->objs, o);
	if (rc < 0)
		goto err_release;
	rc = member_add(l1, o);
	if (rc < 0)
		goto err_unindex;
	l1->bytes_used += len;
	l1->bytes_reserved += len;
	l1->pages_used += n;
	l1->objects_reserved++;
	if (++l1->objects > l1->peak_objects)
		l1->peak_objects = l1->objects;
	*ret = o;
	return 0;

err_unindex:
	kvs_htab_del(l1->objs, key);
err_release:
	extent_release(l1, r);
	return rc;
nospace:
	l1->nospace++;
	return KVS_E_NOSPACE;
}

void *kvs_l1_arena(const kvs_l1 *l1, uint64_t *ret_size)
{
	if (ret_size)
		*ret_size = l1->size;
	return l1->arena;
}

void *kvs_l1_data(const kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_RESERVED || o->state == KVS_L1_COMMITTED);
	return o->data;
}

uint64_t kvs_l1_len(const kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_RESERVED || o->state == KVS_L1_COMMITTED);
	return obj_len(o);
}

const kvs_objkey *kvs_l1_key(const kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_RESERVED || o->state == KVS_L1_COMMITTED);
	return &o->key;
}

enum kvs_l1_state kvs_l1_state(const kvs_l1_obj *o)
{
	return (enum kvs_l1_state)o->state;
}

uint32_t kvs_l1_pins(const kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_RESERVED || o->state == KVS_L1_COMMITTED);
	return o->u.o.pins;
}

void kvs_l1_commit(kvs_l1 *l1, kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_RESERVED);
	o->state = KVS_L1_COMMITTED;
	l1->bytes_reserved -= obj_len(o);
	l1->objects_reserved--;
	chunk_idle(l1, chunk_head(l1, o));
}

void kvs_l1_abort(kvs_l1 *l1, kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_RESERVED);
	member_remove(l1, o, true);
	obj_forget(l1, o);
	extent_release(l1, ref_of(l1, o));
}

kvs_l1_obj *kvs_l1_peek(kvs_l1 *l1, const kvs_objkey *key)
{
	return kvs_htab_get(l1->objs, key);
}

int kvs_l1_rekey(kvs_l1 *l1, kvs_l1_obj *o, const kvs_objkey *key)
{
	/* only the pad may change: chunk membership (the first
	 * KVS_L1_CHUNK_KEY_BYTES) and the chunk index stay as they are */
	if (memcmp(key, &o->key, offsetof(kvs_objkey, pad)) != 0)
		return -EINVAL;
	if (key->pad == o->key.pad)
		return 0;
	if (kvs_htab_get(l1->objs, key))
		return -EEXIST;
	kvs_htab_del(l1->objs, &o->key);
	o->key.pad = key->pad;
	int rc = kvs_htab_put(l1->objs, o); /* cannot fail: a slot was just freed */
	assert(rc == 0);
	(void)rc;
	return 0;
}

kvs_l1_obj *kvs_l1_get(kvs_l1 *l1, const kvs_objkey *key)
{
	kvs_l1_obj *o = kvs_htab_get(l1->objs, key);
	return o && o->state == KVS_L1_COMMITTED ? o : NULL;
}

void kvs_l1_touch(kvs_l1 *l1, kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_COMMITTED);
	kvs_l1_obj *h = chunk_head(l1, o);
	if (h->u.o.nbusy == 0 && l1->lru.last != ref_of(l1, h)) {
		list_remove(l1, &l1->lru, ref_of(l1, h));
		list_append(l1, &l1->lru, ref_of(l1, h));
	}
}

void kvs_l1_pin(kvs_l1 *l1, kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_COMMITTED);
	assert(o->u.o.pins < UINT32_MAX);
	if (o->u.o.pins++ == 0)
		chunk_busy(l1, chunk_head(l1, o));
}

void kvs_l1_unpin(kvs_l1 *l1, kvs_l1_obj *o)
{
	assert(o->state == KVS_L1_COMMITTED);
	assert(o->u.o.pins > 0); /* unpin without pin */
	if (--o->u.o.pins == 0)
		chunk_idle(l1, chunk_head(l1, o));
}

void kvs_l1_clear(kvs_l1 *l1)
{
	while (l1->lru.first)
		chunk_drop(l1, rec(l1, l1->lru.first), false);
	/* Busy chunks keep their busy members; a chunk stays busy and keeps its
	 * place on the list even when its head leaves (the next member takes
	 * over in place), so reading cnext first is enough. */
	for (ref c = l1->busy.first; c;) {
		ref next_chunk = rec(l1, c)->u.o.cnext;
		uint32_t k = 0;
		ref m = c;
		do {
			k++;
			m = rec(l1, m)->u.o.sib;
		} while (m != c);
		for (uint32_t i = 0; i < k; i++) {
			kvs_l1_obj *x = rec(l1, m);
			ref nx = x->u.o.sib;
			if (x->state == KVS_L1_COMMITTED && x->u.o.pins == 0) {
				member_remove(l1, x, false);
				obj_forget(l1, x);
				extent_release(l1, m);
			}
			m = nx;
		}
		c = next_chunk;
	}
}

/* Slot bytes of a kvs_htab that once held peak entries: it starts with 16
 * slots of 16 bytes and doubles when an insert would reach 3/4 full. An
 * estimate from outside the table, which does not report its size. */
static uint64_t htab_bytes(uint64_t peak)
{
	uint64_t cap = 16;
	while (peak * 4 >= cap * 3)
		cap *= 2;
	return cap * 16 + 64;
}

void kvs_l1_get_stats(const kvs_l1 *l1, kvs_l1_stats *st)
{
	memset(st, 0, sizeof(*st));
	st->size = l1->size;
	st->bytes_used = l1->bytes_used;
	st->bytes_reserved = l1->bytes_reserved;
	st->objects = l1->objects;
	st->objects_reserved = l1->objects_reserved;
	st->chunks = l1->nchunks;
	st->evictions = l1->evictions;
	st->evicted_bytes = l1->evicted_bytes;
	st->nospace = l1->nospace;
	st->meta_bytes = sizeof(*l1) + (uint64_t)l1->rec_hwm * sizeof(kvs_l1_obj) +
			 htab_bytes(l1->peak_objects) + htab_bytes(l1->peak_chunks);
	st->bytes_allocated = l1->pages_used << PAGE_SHIFT;
	st->bytes_evictable = (uint64_t)l1->evictable_pages << PAGE_SHIFT;
	st->free_extents = l1->nfree;
	st->withheld = (uint64_t)l1->wh_pages << PAGE_SHIFT;
	if (l1->fl_map) {
		unsigned fl = 31u - (unsigned)__builtin_clz(l1->fl_map);
		unsigned sl = 31u - (unsigned)__builtin_clz(l1->sl_map[fl]);
		uint32_t best = 0;
		for (ref r = l1->bins[fl][sl]; r; r = rec(l1, r)->u.f.next)
			if (rec(l1, r)->npages > best)
				best = rec(l1, r)->npages;
		st->largest_free = (uint64_t)best << PAGE_SHIFT;
	}
}
