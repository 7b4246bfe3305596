/* The registry: host-memory (memfd) imports and the registrations that view
 * them. Imports are keyed by (device uuid, allocation id) and shared between
 * registrations by alias references; every layer view is validated against
 * its allocation. Main-loop thread only. */
#ifndef KVS_REGISTRY_H
#define KVS_REGISTRY_H

#include <stdint.h>
#include <sys/types.h>

#include "server.h"

/* One mapped allocation.
 * Invariant: refs == number of live registrations referencing it; the
 * mapping is released (munmap, close) exactly when refs drops to 0. */
typedef struct kvs_import {
	uint8_t key[33]; /* device type, uuid, alloc_id: the table key */
	int fd;
	dev_t dev; /* identity of the memfd, so an alias is the same memory */
	ino_t ino;
	uint8_t *base;   /* host: mmap of the memfd; cuda: the mapped device VA */
	uint64_t size;
	uint32_t refs;
	bool unsealed;   /* host: the memfd could not be sealed against shrinking
			  * (allow-unsealed-memory); copies of it are guarded */
	struct kvs_cuda_map *cmap; /* cuda imports only */
} kvs_import;

/* A layer view, resolved: block b of this layer lives at
 * base + b * stride, and block_bytes of it are copied. */
typedef struct kvs_view {
	uint8_t *base; /* import base + offset */
	uint64_t num_blocks, stride, block_bytes;
	kvs_import *imp;
} kvs_view;

/* A range of several allocations, mapped by the server back to back as the
 * engine maps them; views of the range address base + offset. */
typedef struct kvs_span {
	uint32_t head;   /* index of its first allocation in the request */
	uint8_t *base;
	uint64_t size;
	struct kvs_cuda_span *cspan; /* cuda: the device mapping; host: NULL (mmap) */
} kvs_span;

typedef struct kvs_reg_group {
	kvs_group_desc desc;
	uint32_t n_layers;   /* layers of this group, in registration order */
	uint32_t *layers;    /* indexes into views */
	uint64_t num_blocks; /* shared by every layer of the group */
	uint64_t obj_bytes;  /* one chunk of this group on one rank: n_layers * blocks_per_chunk * block_bytes summed */
	uint64_t geom;       /* fingerprint of the object layout (L2 header): kind,
	                      * tokens/blocks per chunk, window, each layer's block_bytes */
} kvs_reg_group;

/* A registration.
 * Invariants: leases counts job parts (store/retrieve) using it whose copies
 * may still run; a `dead` registration is unreachable from its session and is
 * released exactly when leases reaches 0. */
typedef struct kvs_reg {
	uint64_t id; /* key */
	uint64_t session;
	char ns[KVS_MAX_STR + 1];
	uint32_t world, rank;
	uint8_t dev_type;
	uint32_t n_groups;
	kvs_reg_group *groups;
	uint32_t n_views;
	kvs_view *views;
	uint32_t n_imports;
	kvs_import **imports; /* distinct imports referenced */
	/* ranges of several allocations mapped back to back (allocations that
	 * `follow`): one mapping each, unmapped before the imports are dropped */
	uint32_t n_spans;
	struct kvs_span *spans;
	uint32_t leases;
	bool dead;
	struct kvs_cuda_stream *stream; /* cuda registrations: their copy stream */
	/* a pending unregister reply (id != 0) and its drain deadline */
	uint64_t unreg_id;
	uint64_t unreg_deadline_ms;
} kvs_reg;

typedef struct kvs_registry kvs_registry;

int kvs_registry_create(kvs_registry **ret);
/* The CUDA engine imports go through (NULL: host only). */
void kvs_registry_set_cuda(kvs_registry *r, struct kvs_cuda_engine *e);
/* Releases every registration and import (leases must be zero). */
void kvs_registry_destroy(kvs_registry *r);

/* The current registration of a session, or NULL. */
kvs_reg *kvs_registry_of_session(kvs_registry *r, uint64_t session);
/* Any live registration of the namespace and world (for geometry), or NULL. */
kvs_reg *kvs_registry_find_ns(kvs_registry *r, const char *ns, uint32_t world);

void kvs_reg_lease(kvs_reg *g);
/* Drops a lease; releases a dead registration whose last lease this was. */
void kvs_reg_unlease(kvs_server *srv, kvs_reg *g);

/* Counters. */
uint64_t kvs_registry_count(const kvs_registry *r);
uint64_t kvs_registry_imports(const kvs_registry *r);
uint64_t kvs_registry_aliases(const kvs_registry *r);

/* Session going away: its registrations become dead (released when drained). */
void kvs_registry_session_gone(kvs_server *srv, uint64_t session);
/* Pending unregisters: reply ok once drained, E_BUSY at the deadline. */
void kvs_registry_tick(kvs_server *srv);

#endif
