/* The registry: registrations (groups, layer views over imports, leases),
 * the session -> registration index, and each namespace's geometry. Imports
 * are import.c's; every layer view is validated against its allocation.
 * Main-loop thread, except a register's work (imports opened, ranges mapped,
 * CUDA streams made), which runs on the setup thread for CUDA registers and
 * touches only what that register reserved. */
#ifndef KVS_REGISTRY_H
#define KVS_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "server.h"

#include "import.h"

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
	struct kvs_copy_engine *engine; /* what copies its parts (copy.h) */
	struct kvs_cuda_stream *stream; /* cuda registrations: their copy stream; host: NULL */
	/* a pending unregister reply (id != 0) and its drain deadline */
	uint64_t unreg_id;
	uint64_t unreg_deadline_ms;
} kvs_reg;

typedef struct kvs_registry kvs_registry;

int kvs_registry_create(kvs_registry **ret);
/* The CUDA engine imports go through (NULL: host only). */
void kvs_registry_set_cuda(kvs_registry *r, struct kvs_cuda_engine *e);
struct kvs_workq;
/* The setup thread registers' driver work runs on, and CUDA mappings are
 * released on (NULL: inline, on the loop). */
void kvs_registry_set_setupq(kvs_registry *r, struct kvs_workq *q);
/* The reclaim thread host mappings are unmapped and host memfds closed on
 * (NULL: inline, on the loop): both take time in proportion to the bytes
 * the copies touched. Must outlive the registry. */
void kvs_registry_set_reclaimq(kvs_registry *r, struct kvs_workq *q);
/* Releases every registration and import (leases must be zero). */
void kvs_registry_destroy(kvs_registry *r);

/* The current registration of a session, or NULL. */
kvs_reg *kvs_registry_of_session(kvs_registry *r, uint64_t session);
/* Any live registration of the namespace and world (for geometry), or NULL. */
kvs_reg *kvs_registry_find_ns(kvs_registry *r, const char *ns, uint32_t world);

void kvs_reg_lease(kvs_reg *g);
/* Drops a lease; releases a dead registration whose last lease this was. */
void kvs_reg_unlease(kvs_server *srv, kvs_reg *g);
/* Tokens in one chunk of group `group` of g (0: no such group, or g NULL). */
uint32_t kvs_reg_chunk_tokens(const kvs_reg *g, uint32_t group);

/* The object geometry of a namespace and world: what lookup needs. */
typedef struct kvs_geo {
	uint32_t n;
	struct {
		uint32_t id;
		uint32_t kind;   /* enum kvs_group_kind */
		int64_t window;  /* -1 = full */
		uint64_t geom, obj_bytes;
	} g[KVS_MAX_GROUPS];
} kvs_geo;
struct kvs_l2;
/* From the session's registration, else any live one of the namespace and
 * world, else the versioned record a registration left in l2 (may be NULL).
 * False when none is known. */
bool kvs_registry_geometry(kvs_registry *r, struct kvs_l2 *l2, uint64_t session, const char *ns,
			   uint32_t world, kvs_geo *geo);

/* register: CUDA registrations are answered later, from the completion
 * queue, once the setup thread made their imports, maps and streams (0 is
 * returned meanwhile and s->reg_pending is set); host ones at once. */
int kvs__op_register(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_unregister(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

/* Counters. */
uint64_t kvs_registry_count(const kvs_registry *r);
uint64_t kvs_registry_imports(const kvs_registry *r);
uint64_t kvs_registry_aliases(const kvs_registry *r);

/* Session going away: its registrations become dead (released when drained). */
void kvs_registry_session_gone(kvs_server *srv, uint64_t session);
/* Pending unregisters: reply ok once drained, E_BUSY at the deadline. */
void kvs_registry_tick(kvs_server *srv);

#endif
