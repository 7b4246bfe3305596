/* Internals of the L1 tier shared by its two files: kvs_l1.c (allocator,
 * chunks, the API) and kvs_l1_check.c (the consistency check the tests run).
 * Nothing else includes this. */
#ifndef KVS_L1_IMPL_H
#define KVS_L1_IMPL_H

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvs_htab.h"
#include "kvs_l1.h"

#define PAGE_SHIFT 12
_Static_assert((1u << PAGE_SHIFT) == KVS_L1_PAGE, "KVS_L1_PAGE is 1 << PAGE_SHIFT");

#define SL_BITS 4
#define SL_N (1u << SL_BITS) /* linear classes per power of two */
#define FL_N 29              /* powers of two for run sizes below 2^32 pages */
#define SCAN_MAX 32          /* runs of the request's own class looked at */
/* Record indexes are 32 bits and the table holds 2 * pages + 2 records. */
#define MAX_PAGES ((UINT32_MAX - 2u) / 2u)

typedef uint32_t ref; /* index into kvs_l1.recs; 0 means none */

enum { REC_UNUSED = 3,   /* state of a record on the record free list */
       REC_WITHHELD = 4 }; /* state of the withheld tail extent (kvs_l1_set_ceiling) */
/* withheld memory is handed out in steps of this many pages (64 MiB) */
#define GROW_PAGES (1u << 14)

/* One extent of the arena: FREE, or an object (RESERVED or COMMITTED), or
 * the withheld tail (REC_WITHHELD: the last extent, in no bin and no index).
 * Invariants:
 * - the records reachable from kvs_l1.afirst through anext cover the arena
 *   in address order without gap or overlap; aprev mirrors anext;
 * - no two neighbouring extents are both FREE;
 * - a FREE extent is in exactly the size-class bin of its npages;
 * - an object has 1 <= len = npages * PAGE - slack, slack < PAGE; the
 *   object index maps its key to it; a RESERVED object has no pins;
 * - an object is on the ring of its chunk (the members sharing the first
 *   KVS_L1_CHUNK_KEY_BYTES of the key); exactly one member is the head, the
 *   one the chunk index maps that prefix to; the head fields are zero in the
 *   other members. */
struct kvs_l1_obj {
	kvs_objkey key;   /* objects only; offset 0, both indexes key on it */
	uint8_t *data;    /* first byte of the extent */
	uint32_t npages;  /* extent length in pages, >= 1 */
	ref aprev, anext; /* address-order neighbours; anext also links unused records */
	union {
		struct {
			ref prev, next; /* size-class bin */
		} f; /* FREE */
		struct {
			ref sib;       /* next member of the chunk ring (itself if alone) */
			uint32_t pins; /* kvs_l1_pin references; main loop only */
			/* chunk head only: */
			ref cprev, cnext; /* neighbours on the lru list (nbusy == 0) or busy list */
			uint32_t nbusy;   /* members RESERVED or pinned */
			uint32_t cpages;  /* sum of npages over members */
		} o; /* RESERVED, COMMITTED */
	} u;
	uint16_t slack; /* npages * PAGE - len */
	uint8_t state;  /* enum kvs_l1_state, or REC_UNUSED */
	uint8_t head;   /* 1 iff this object is its chunk's head */
};
_Static_assert(sizeof(struct kvs_l1_obj) == 112, "records are 112 bytes");
_Static_assert(offsetof(struct kvs_l1_obj, key) == 0, "indexes key at offset 0");

struct list {
	ref first, last; /* first is the least recently used on the lru list */
};

/* Invariants:
 * - bytes_used is the sum of len over objects in any state but FREE, and
 *   bytes_reserved over RESERVED ones; objects and objects_reserved count
 *   them; pages_used is the sum of npages over objects;
 * - free_pages + pages_used + wh_pages == npages; free_pages and nfree sum and count the
 *   FREE extents; bit fl of fl_map is set iff sl_map[fl] != 0, and bit sl of
 *   sl_map[fl] iff bins[fl][sl] is not empty;
 * - every chunk head is on exactly one list: lru iff its nbusy is 0, ordered
 *   by last use (commit, touch, or the moment the chunk stopped being busy),
 *   busy otherwise, unordered; nchunks counts them, and the chunk index holds
 *   exactly the heads;
 * - evictable_pages is the sum of cpages over the chunks on lru;
 * - records 1 .. rec_hwm - 1 are extents or on the rec_free list (state
 *   REC_UNUSED); record 0 is never used. */
struct kvs_l1 {
	uint8_t *arena;
	uint64_t size;
	uint32_t npages;

	kvs_l1_obj *recs;
	size_t recs_bytes; /* mapped */
	uint32_t nrecs;    /* capacity: 2 * npages + 2 */
	uint32_t rec_hwm;  /* records ever handed out, plus record 0 */
	ref rec_free;      /* unused records, linked by anext */
	ref afirst;        /* extent at the start of the arena */

	/* The withheld tail: wh is its record (the last extent) or 0; ceiling is
	 * in pages (npages until kvs_l1_set_ceiling). Invariant:
	 * free_pages + pages_used + wh_pages == npages. */
	ref wh;
	uint32_t wh_pages, ceiling;

	uint32_t fl_map;
	uint32_t sl_map[FL_N];
	ref bins[FL_N][SL_N];
	uint32_t free_pages, nfree;

	kvs_htab *objs;   /* kvs_objkey -> object */
	kvs_htab *chunks; /* first KVS_L1_CHUNK_KEY_BYTES of the key -> chunk head */
	struct list lru, busy;
	uint32_t nchunks;
	uint32_t evictable_pages;

	uint64_t bytes_used, bytes_reserved, objects, objects_reserved, pages_used;
	uint64_t evictions, evicted_bytes, nospace;
	uint64_t peak_objects, peak_chunks; /* for the index size estimate */
	void (*on_evict)(const kvs_objkey *key, void *arg);
	void *evict_arg;
};

static inline kvs_l1_obj *rec(const kvs_l1 *l1, ref r)
{
	assert(r > 0 && r < l1->rec_hwm);
	return &l1->recs[r];
}

static inline ref ref_of(const kvs_l1 *l1, const kvs_l1_obj *o)
{
	return (ref)(o - l1->recs);
}

static inline uint64_t obj_len(const kvs_l1_obj *o)
{
	return ((uint64_t)o->npages << PAGE_SHIFT) - o->slack;
}

static inline void size_class(uint32_t n, unsigned *fl, unsigned *sl)
{
	if (n < SL_N) {
		*fl = 0;
		*sl = n;
		return;
	}
	unsigned l = 31u - (unsigned)__builtin_clz(n);
	*fl = l - SL_BITS + 1;
	*sl = (n >> (l - SL_BITS)) - SL_N;
}

#endif
