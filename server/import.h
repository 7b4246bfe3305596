/* Imports (import.c): engine memory mapped into the server, one per
 * (device type, device uuid, allocation id) and shared between
 * registrations by alias references, the way UCX's registration cache keys
 * regions. Each memory kind has its own operations: host memfd (sealed,
 * mmap'd), CUDA cuMem POSIX fd, legacy CUDA IPC handle. The table is the
 * main loop's; kvs_import_complete (opening an import, checking an alias)
 * runs on the registry's setup thread for deferred registers, touching only
 * the import it is given (see the invariant at kvs_import). */
#ifndef KVS_IMPORT_H
#define KVS_IMPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct kvs_cuda_engine;
struct kvs_cuda_map;

enum kvs_import_state {
	KVS_IMPORT_PENDING = 0, /* reserved on the loop; its creator's complete has not run */
	KVS_IMPORT_READY,       /* mapped */
	KVS_IMPORT_FAILED,      /* its open failed: aliases reserved meanwhile fail too */
};

/* One mapped allocation.
 * Invariant: refs == number of registrations (built or pending) referencing
 * it; the mapping is released exactly when refs drops to 0. state, base,
 * fd, dev, ino and cmap are written once, by the creator's
 * kvs_import_complete (the setup thread for deferred registers), before any
 * alias's complete (FIFO) and before the loop reads them (the completion
 * queue orders it); everything else is the loop's. */
typedef struct kvs_import {
	uint8_t key[33]; /* device type, uuid, alloc_id: the table key */
	int fd;          /* host: the memfd (kept for ranges mapped later); else -1 */
	dev_t dev;       /* host: identity of the memfd, so an alias is the same memory */
	ino_t ino;
	uint8_t *base;   /* host: mmap of the memfd; cuda: the mapped device VA */
	uint64_t size;
	uint32_t refs;
	bool unsealed;   /* host: the memfd could not be sealed against shrinking
			  * (allow-unsealed-memory); copies of it are guarded */
	struct kvs_cuda_map *cmap; /* cuda imports only */
	const struct import_ops *ops;
	int state;       /* enum kvs_import_state */
} kvs_import;

/* What one allocation of a `register` asks for. */
typedef struct kvs_import_req {
	uint8_t dev_type;        /* enum kvs_dev_type */
	const uint8_t *uuid;     /* 16 bytes */
	const uint8_t *alloc_id; /* 16 bytes */
	uint64_t size;
	int fd;                  /* the broker's fd (consumed by the call in every case), or -1 */
	const uint8_t *ipc_handle; /* legacy CUDA IPC: the handle, else NULL */
	size_t ipc_len;
	bool allow_unsealed;     /* host: accept a memfd that cannot be sealed */
} kvs_import_req;

typedef struct kvs_imports kvs_imports;

int kvs_imports_create(kvs_imports **ret);
/* The CUDA engine device imports go through (NULL: none). */
void kvs_imports_set_cuda(kvs_imports *t, struct kvs_cuda_engine *e);
struct kvs_workq;
/* Where CUDA mappings are released (NULL: at once, on the calling thread). */
void kvs_imports_set_workq(kvs_imports *t, struct kvs_workq *q);
/* Where host mappings are unmapped and their memfds closed (NULL: at once,
 * on the calling thread). The queue must outlive the imports' releases. */
void kvs_imports_set_reclaimq(kvs_imports *t, struct kvs_workq *q);
/* Unmaps [base, base+size) (if base) and closes fd (if >= 0) on q's thread,
 * or at once when q is NULL or memory runs out. Unmapping memory that copies
 * touched, and closing a memfd's last reference (which frees it), take time
 * in proportion to the bytes (a 4 GiB memfd: ~150 ms to unmap after reads,
 * ~600 ms more to free it): the loop hands them to the reclaim thread. */
void kvs_host_release(struct kvs_workq *q, void *base, uint64_t size, int fd);
/* Every import must have been released. Accepts NULL. */
void kvs_imports_destroy(kvs_imports *t);

/* An alias of the import the request names (refs + 1, *fresh false) or a
 * new import (*fresh true). rq->fd is consumed in every case. 0, or
 * KVS_E_GEOMETRY (imported with another size), KVS_E_AUTH (the alloc_id
 * names other memory), KVS_E_DEVICE / KVS_E_RANGE (cannot import),
 * KVS_E_BADMSG, KVS_E_INTERNAL, with the reason in err. Nothing changes on
 * failure. */
int kvs_import_acquire(kvs_imports *t, const kvs_import_req *rq, kvs_import **ret, bool *fresh, char *err,
		       size_t errlen);
/* The same in two steps, for a register whose driver work runs on the setup
 * thread (registry.c). kvs_import_reserve (loop) takes an alias reference
 * (only the size is checked) or puts a PENDING import in the table; it does
 * not consume rq->fd. kvs_import_complete (any one thread, after every
 * earlier reserve's complete) opens a fresh import or checks an alias
 * (consuming rq->fd in every case); on failure the caller still holds its
 * reference and drops it with kvs_import_release. Codes as above. */
int kvs_import_reserve(kvs_imports *t, const kvs_import_req *rq, kvs_import **ret, bool *fresh, char *err,
		       size_t errlen);
int kvs_import_complete(kvs_imports *t, kvs_import *imp, bool fresh, const kvs_import_req *rq, char *err,
			size_t errlen);
/* Drops one reference; the last one unmaps. No copy may still use it.
 * A CUDA mapping is released on the setup queue when one is set (its
 * driver calls never run on the loop); FIFO keeps that release before a
 * later import of the same memory. */
void kvs_import_release(kvs_imports *t, kvs_import *imp);

uint64_t kvs_imports_count(const kvs_imports *t);
uint64_t kvs_imports_aliases(const kvs_imports *t);

#endif
