/* A structural check of an LMDB data.mdb that cannot fault on any file
 * (pread only, every bound checked before use): the four named databases
 * kvside creates, the main and free databases, every page reached once. See
 * kvs_l2_verify.c for what it checks. Used by kvs_l2_open before LMDB maps
 * the file (docs/architecture.md §6). */
#ifndef KVS_L2_VERIFY_H
#define KVS_L2_VERIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvs_l2_verify_report {
	uint64_t used_bytes;   /* pages in use (the meta's last page + 1) x page size */
	uint64_t pages_read;   /* branch and leaf pages read whole */
	uint64_t pages_marked; /* pages found in a tree, an overflow run or the free list */
	uint64_t free_pages;   /* pages the free list holds */
	uint64_t entries;      /* entries of all databases */
	uint64_t us;           /* how long the walk took */
} kvs_l2_verify_report;

#define KVS_L2_VERIFY_DAMAGED 1

/* Walks file (a data.mdb not open in any process that writes it). Returns 0
 * when the structure is intact (also for an empty file), KVS_L2_VERIFY_DAMAGED
 * with the first damage found described in why, or -errno when the file
 * cannot be read (-ENOMEM: no memory for the walk). rep is filled in either
 * case, as far as the walk went. */
int kvs_l2_verify(const char *file, kvs_l2_verify_report *rep, char *why, size_t why_cap);

/* The page header (KVS_L2_PAGE_HDR bytes at hdr) of an overflow run that
 * starts at page pgno and holds a value of dsize bytes: does it say so (its
 * own number, overflow flags, a page count that holds the value and ends
 * within map_pages)? The walk does not read these headers (one random read
 * per object); the L2 writer asks this before LMDB frees or reuses a run. */
#define KVS_L2_PAGE_HDR 16u
bool kvs_l2_overflow_ok(const uint8_t *hdr, uint64_t pgno, uint64_t dsize, uint32_t psize, uint64_t map_pages);

#endif
