/* L1: the DRAM tier. One anonymous arena, an index of objects by kvs_objkey,
 * and LRU eviction over chunks (every rank and group of a chunk key goes
 * together). Metadata belongs to one thread, the server's main loop; no call
 * here is thread-safe. Copy threads may read and write an object's data bytes
 * (kvs_l1_data) while the main loop keeps the object reserved or pinned. */
#ifndef KVS_L1_H
#define KVS_L1_H

#include <stdint.h>

/* An object's identity: 64 bytes compared bytewise, so every byte counts,
 * padding included. The first 52 bytes (chunk, ns, world) name the object's
 * chunk, the unit of eviction. */
typedef struct kvs_objkey {
	uint8_t chunk[32]; /* chunk key (kvs_chunk_keys) */
	uint8_t ns[16];    /* BLAKE2b with a 16-byte output of the namespace string */
	uint32_t world;
	uint32_t rank;
	uint32_t group;
	uint32_t pad; /* 0: the object everyone sees; other values: a private
	               * staging copy (a store racing another store of the same
	               * object), made public later with kvs_l1_rekey */
} kvs_objkey;

_Static_assert(sizeof(kvs_objkey) == 64, "kvs_objkey must be 64 bytes");

/* Bytes of a kvs_objkey that name its chunk: chunk, ns and world. */
#define KVS_L1_CHUNK_KEY_BYTES 52
/* Allocation granule: every object starts on a page boundary of the arena and
 * occupies whole pages. */
#define KVS_L1_PAGE 4096u

typedef struct kvs_l1_config {
	uint64_t size; /* arena bytes; rounded down to a multiple of KVS_L1_PAGE */
	/* Called once per chunk evicted to make room (not for kvs_l1_clear),
	 * with the key of one of its objects, before its objects are forgotten;
	 * must not call back into this L1. May be NULL. */
	void (*on_evict)(const kvs_objkey *key, void *arg);
	void *evict_arg;
	/* Start with the whole arena withheld (issue 18): see kvs_l1_set_ceiling.
	 * Until a ceiling is set, withheld memory is handed out as needed, in
	 * 64 MiB steps from the start of the arena, before anything is evicted:
	 * a store never notices. */
	int withhold;
} kvs_l1_config;

typedef struct kvs_l1 kvs_l1;
typedef struct kvs_l1_obj kvs_l1_obj;

/* Object states. FREE is internal: callers never hold a FREE object. */
enum kvs_l1_state { KVS_L1_FREE, KVS_L1_RESERVED, KVS_L1_COMMITTED };

/* Creates an L1 with an arena of cfg->size bytes, mapped
 * MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE and page aligned. Pages are
 * committed by the kernel as they are first written.
 * Parameters:
 *   cfg  size must be at least KVS_L1_PAGE and at most 8 TiB.
 *   ret  receives the new L1; untouched on failure.
 * Returns 0, or:
 *   -EINVAL  size out of range.
 *   -ENOMEM  the arena, the record table or an index could not be allocated.
 *   -EIO     libsodium (the index hash) could not start. */
int kvs_l1_create(const kvs_l1_config *cfg, kvs_l1 **ret);

/* Unmaps the arena and frees all metadata. Every kvs_l1_obj pointer and every
 * data pointer becomes invalid, pinned or not: the caller must have stopped
 * all copies first. Accepts NULL. */
void kvs_l1_destroy(kvs_l1 *l1);

/* The arena: its first byte (KVS_L1_PAGE aligned) and, in *ret_size, its
 * length. Fixed for the life of the L1, e.g. to register it once with a copy
 * engine (cuMemHostRegister); every kvs_l1_data pointer lies inside. Nothing
 * here ever writes the arena: only callers do, through kvs_l1_data. */
void *kvs_l1_arena(const kvs_l1 *l1, uint64_t *ret_size);

/* Reserves a new object of len bytes under key, in state RESERVED: invisible
 * to kvs_l1_get, never evicted, its data uninitialized and writable by the
 * caller (and by copy threads the caller hands kvs_l1_data to) until
 * kvs_l1_commit or kvs_l1_abort.
 * When the free space has no run of ceil(len / KVS_L1_PAGE) pages, whole
 * chunks are evicted, least recently used first, skipping chunks that hold a
 * RESERVED or a pinned object, until the run exists. Before evicting anything
 * it checks that free plus evictable pages could cover the request; if not it
 * fails at once and evicts nothing. Evictions already made when the request
 * finally fails (free space too fragmented) stay made. The object's own chunk
 * may be evicted like any other.
 * Parameters:
 *   key  copied into the object (pad 0: the public key).
 *   len  bytes, at least 1.
 *   ret  receives the object; untouched on failure.
 * Returns 0, or:
 *   -EINVAL         len is 0.
 *   -EEXIST         key is already COMMITTED. Nothing was done.
 *   -EBUSY          key is already RESERVED. Nothing was done.
 *   KVS_E_NOSPACE   no room even after evicting everything evictable, or len
 *                   exceeds the arena (then nothing is evicted).
 *   -ENOMEM         the index could not grow. Evictions made stay made.
 * The object stays valid until kvs_l1_abort, or once committed until it is
 * evicted or cleared (see kvs_l1_commit). */
int kvs_l1_reserve(kvs_l1 *l1, const kvs_objkey *key, uint64_t len, kvs_l1_obj **ret);

/* The object's data: len bytes at a KVS_L1_PAGE-aligned address inside the
 * arena. Valid as long as the object is. */
void *kvs_l1_data(const kvs_l1_obj *o);
/* The object's length in bytes, as reserved. */
uint64_t kvs_l1_len(const kvs_l1_obj *o);
/* The object's key, stored in the object: valid as long as the object is. */
const kvs_objkey *kvs_l1_key(const kvs_l1_obj *o);
/* KVS_L1_RESERVED or KVS_L1_COMMITTED. */
enum kvs_l1_state kvs_l1_state(const kvs_l1_obj *o);
/* The object's pin count. */
uint32_t kvs_l1_pins(const kvs_l1_obj *o);

/* Makes a RESERVED object COMMITTED: visible to kvs_l1_get and, once
 * unpinned, evictable. Its chunk becomes the most recently used (as soon as
 * no member of the chunk is RESERVED or pinned any more; see kvs_l1_touch).
 * From now on an unpinned object may vanish at the next kvs_l1_reserve or
 * kvs_l1_clear: pin it to keep the pointer across them. o must be RESERVED. */
void kvs_l1_commit(kvs_l1 *l1, kvs_l1_obj *o);

/* Frees a RESERVED object; o is invalid on return. Copy threads must be done
 * with its data. o must be RESERVED. */
void kvs_l1_abort(kvs_l1 *l1, kvs_l1_obj *o);

/* Returns the object with this key in any state (RESERVED or COMMITTED), or
 * NULL. The pointer follows the same validity rules as kvs_l1_get's. */
kvs_l1_obj *kvs_l1_peek(kvs_l1 *l1, const kvs_objkey *key);

/* Changes the pad of o's key (nothing else of the key may differ): 0, or
 * -EEXIST if an object already has the new key, -EINVAL if more than the pad
 * differs. Used to swap a private staging copy and a public reservation. */
int kvs_l1_rekey(kvs_l1 *l1, kvs_l1_obj *o, const kvs_objkey *key);

/* Returns the COMMITTED object with this key, or NULL (absent or only
 * RESERVED). Does not change the LRU order. The pointer is valid until the
 * next call that can evict (kvs_l1_reserve, kvs_l1_clear) unless pinned. */
kvs_l1_obj *kvs_l1_get(kvs_l1 *l1, const kvs_objkey *key);

/* Marks o's chunk as the most recently used. A chunk that holds a RESERVED or
 * pinned member is not on the LRU list; it becomes the most recently used
 * when its last reservation or pin goes away, so touching it then is a no-op.
 * o must be COMMITTED. */
void kvs_l1_touch(kvs_l1 *l1, kvs_l1_obj *o);

/* Takes and drops a reference that keeps o, and so its whole chunk, from
 * eviction and clearing. Counted: n pins need n unpins. Dropping the chunk's
 * last pin (with nothing RESERVED in it) makes it the most recently used.
 * o must be COMMITTED; unpin of an unpinned object is a programming error. */
void kvs_l1_pin(kvs_l1 *l1, kvs_l1_obj *o);
void kvs_l1_unpin(kvs_l1 *l1, kvs_l1_obj *o);

/* Drops every COMMITTED unpinned object (admin "clear"), including those of
 * chunks that keep other members (pinned or RESERVED). Not counted as
 * evictions. Pointers to the dropped objects become invalid. */
void kvs_l1_clear(kvs_l1 *l1);

typedef struct kvs_l1_stats {
	uint64_t size;             /* arena bytes */
	uint64_t bytes_used;       /* sum of len over RESERVED and COMMITTED objects */
	uint64_t bytes_reserved;   /* sum of len over RESERVED objects */
	uint64_t objects;          /* RESERVED and COMMITTED objects */
	uint64_t objects_reserved; /* RESERVED objects */
	uint64_t chunks;           /* chunks with at least one object */
	uint64_t evictions;        /* objects evicted to make room (cumulative) */
	uint64_t evicted_bytes;    /* their len (cumulative) */
	uint64_t nospace;          /* kvs_l1_reserve calls that returned KVS_E_NOSPACE */
	uint64_t meta_bytes;       /* metadata memory: records, indexes, the L1 itself */
	/* additions */
	uint64_t bytes_allocated;  /* bytes_used rounded up to whole pages per object */
	uint64_t bytes_evictable;  /* allocated bytes of chunks with nothing RESERVED or pinned */
	uint64_t free_extents;     /* runs of free pages (fragmentation) */
	uint64_t largest_free;     /* bytes of the largest run of free pages */
	uint64_t withheld;         /* bytes withheld at the arena's end (kvs_l1_set_ceiling) */
} kvs_l1_stats;

/* Withholding (issue 18). A server with a GPU pins L1 slice by slice for
 * device access, from the start of the arena, at a few GB/s; a copy into a
 * slice not pinned yet must wait for it. While part of the arena is
 * withheld, its tail [withheld start, end) is not allocated from: reserve
 * takes free runs first, then withheld memory below the ceiling (in 64 MiB
 * steps), then evicts least recently used chunks, and only then withheld
 * memory above the ceiling (never fails for it). With the ceiling at the
 * pinned prefix the cache behaves as one of the pinned size until pinning is
 * done. set_ceiling takes bytes (rounded down to pages; any value); release
 * frees the whole withheld tail, after which the L1 withholds nothing for
 * good. Both O(1); no-ops when nothing is withheld. */
void kvs_l1_set_ceiling(kvs_l1 *l1, uint64_t bytes);
void kvs_l1_release(kvs_l1 *l1);
/* Bytes withheld now (0 once released). */
uint64_t kvs_l1_withheld(const kvs_l1 *l1);

/* Fills st. O(1) except largest_free, which looks at the top free size class:
 * O(free runs in that class). */
void kvs_l1_get_stats(const kvs_l1 *l1, kvs_l1_stats *st);

/* Debug: checks every invariant written at the structs in kvs_l1.c, walking
 * all metadata (O(objects x members per chunk)). Returns 0 if consistent,
 * else -EUCLEAN after printing the first broken invariant to stderr. */
int kvs_l1_check(const kvs_l1 *l1);

#endif
