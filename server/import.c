/* Imports; see import.h. */
#include "import.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "copy_cuda.h"
#include "kvs_error.h"
#include "kvs_htab.h"
#include "kvs_proto.h"
#include "kvs_workq.h"

struct kvs_imports {
	struct kvs_cuda_engine *cuda;
	struct kvs_workq *q; /* CUDA releases run there; NULL: inline */
	struct kvs_workq *reclaimq; /* host releases run there; NULL: inline */
	kvs_htab *table;  /* kvs_import by key */
	uint64_t aliases; /* sum of (refs - 1) over imports */
};

/* Operations of one memory kind. open fills base/size/... of a new import
 * and consumes rq->fd; same says whether an existing import is the memory
 * rq names (0, or a code with err); close unmaps. */
typedef struct import_ops {
	int (*open)(kvs_imports *t, const kvs_import_req *rq, kvs_import *imp, char *err, size_t errlen);
	int (*same)(const kvs_import *imp, const kvs_import_req *rq, char *err, size_t errlen);
	void (*close)(kvs_imports *t, kvs_import *imp);
} import_ops;

/* ---- host memfd ------------------------------------------------------------- */

static int host_open(kvs_imports *t, const kvs_import_req *rq, kvs_import *imp, char *err, size_t errlen)
{
	(void)t;
	int fd = rq->fd;
	struct stat st;
	int seals = fstat(fd, &st) == 0 ? fcntl(fd, F_GET_SEALS) : -1;
	int r = 0;
	if (seals < 0 || !S_ISREG(st.st_mode)) {
		snprintf(err, errlen, "fd is not a memfd");
		r = KVS_E_DEVICE;
		goto out;
	}
	/* a memfd shrunk under our mapping would SIGBUS the copy threads; with
	 * allow-unsealed-memory the host engine guards its copies and fails the
	 * one that meets a shrunk region instead */
	if (!(seals & F_SEAL_SHRINK) && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0) {
		if (!rq->allow_unsealed) {
			snprintf(err, errlen, "memfd cannot be sealed against shrinking (create it with "
			         "MFD_ALLOW_SEALING and without F_SEAL_SEAL, or add F_SEAL_SHRINK; or start the "
			         "server with allow-unsealed-memory)");
			r = KVS_E_DEVICE;
			goto out;
		}
		imp->unsealed = true;
	}
	if ((uint64_t)st.st_size < rq->size) {
		snprintf(err, errlen, "memfd holds %lld bytes, %llu declared", (long long)st.st_size,
			 (unsigned long long)rq->size);
		r = KVS_E_RANGE;
		goto out;
	}
	void *base = mmap(NULL, rq->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (base == MAP_FAILED) {
		snprintf(err, errlen, "mmap failed: %s", strerror(errno));
		r = KVS_E_DEVICE;
		goto out;
	}
	imp->base = base;
	imp->fd = fd;
	imp->dev = st.st_dev;
	imp->ino = st.st_ino;
	return 0;
out:
	close(fd);
	return r;
}

static int host_same(const kvs_import *imp, const kvs_import_req *rq, char *err, size_t errlen)
{
	struct stat st;
	if (fstat(rq->fd, &st) < 0) {
		snprintf(err, errlen, "fstat failed: %s", strerror(errno));
		return KVS_E_DEVICE;
	}
	if (imp->dev != st.st_dev || imp->ino != st.st_ino) {
		snprintf(err, errlen, "alloc_id already names other memory");
		return KVS_E_AUTH;
	}
	return 0;
}

typedef struct host_release_item {
	kvs_workq_item wi; /* first */
	void *base;
	uint64_t size;
	int fd;
} host_release_item;

static void host_release_now(void *base, uint64_t size, int fd)
{
	if (base)
		munmap(base, size);
	if (fd >= 0)
		close(fd);
}

static void host_release_work(kvs_workq_item *it)
{
	host_release_item *h = (host_release_item *)it;
	host_release_now(h->base, h->size, h->fd);
	free(h);
}

void kvs_host_release(struct kvs_workq *q, void *base, uint64_t size, int fd)
{
	host_release_item *h = q ? calloc(1, sizeof(*h)) : NULL;
	if (!h) {
		host_release_now(base, size, fd);
		return;
	}
	*h = (host_release_item){.wi.work = host_release_work, .base = base, .size = size, .fd = fd};
	kvs_workq_submit(q, &h->wi); /* cq.done NULL: frees itself */
}

static void host_close(kvs_imports *t, kvs_import *imp) { kvs_host_release(t->reclaimq, imp->base, imp->size, imp->fd); }

static const import_ops host_memfd = {host_open, host_same, host_close};

/* ---- CUDA: cuMem POSIX fd and legacy IPC handle ---------------------------------- */

static int cuda_fd_open(kvs_imports *t, const kvs_import_req *rq, kvs_import *imp, char *err, size_t errlen)
{
	int r = kvs_cuda_import(t->cuda, rq->uuid, rq->fd, rq->size, &imp->cmap, err, errlen); /* closes fd */
	if (r == 0)
		imp->base = kvs_cuda_map_base(imp->cmap);
	return r;
}

static int cuda_ipc_open(kvs_imports *t, const kvs_import_req *rq, kvs_import *imp, char *err, size_t errlen)
{
	if (rq->fd >= 0)
		close(rq->fd);
	if (rq->ipc_len != 64) {
		snprintf(err, errlen, "ipc_handle must be 64 bytes");
		return KVS_E_BADMSG;
	}
	int r = kvs_cuda_import_ipc(t->cuda, rq->uuid, rq->ipc_handle, rq->size, &imp->cmap, err, errlen);
	if (r == 0)
		imp->base = kvs_cuda_map_base(imp->cmap);
	return r;
}

static int cuda_same(const kvs_import *imp, const kvs_import_req *rq, char *err, size_t errlen)
{
	(void)imp, (void)rq, (void)err, (void)errlen;
	return 0; /* the driver names the memory by (device, alloc_id) alone */
}

typedef struct unimport_item {
	kvs_workq_item wi; /* first */
	struct kvs_cuda_engine *cuda;
	struct kvs_cuda_map *cmap;
} unimport_item;

static void unimport_work(kvs_workq_item *it)
{
	unimport_item *u = (unimport_item *)it;
	kvs_cuda_unimport(u->cuda, u->cmap);
	free(u);
}

/* unmap -> free VA -> release, on the setup thread when there is one */
static void cuda_close(kvs_imports *t, kvs_import *imp)
{
	unimport_item *u = t->q ? calloc(1, sizeof(*u)) : NULL;
	if (!u) {
		kvs_cuda_unimport(t->cuda, imp->cmap);
		return;
	}
	u->wi.work = unimport_work; /* cq.done NULL: frees itself */
	u->cuda = t->cuda;
	u->cmap = imp->cmap;
	kvs_workq_submit(t->q, &u->wi);
}

static const import_ops cuda_vmm_fd = {cuda_fd_open, cuda_same, cuda_close};
static const import_ops cuda_legacy_ipc = {cuda_ipc_open, cuda_same, cuda_close};

/* ---- the table ---------------------------------------------------------------- */

int kvs_imports_create(kvs_imports **ret)
{
	kvs_imports *t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	int r = kvs_htab_create(33, offsetof(kvs_import, key), &t->table);
	if (r) {
		free(t);
		return r;
	}
	*ret = t;
	return 0;
}

void kvs_imports_set_cuda(kvs_imports *t, struct kvs_cuda_engine *e) { t->cuda = e; }
void kvs_imports_set_workq(kvs_imports *t, struct kvs_workq *q) { t->q = q; }
void kvs_imports_set_reclaimq(kvs_imports *t, struct kvs_workq *q) { t->reclaimq = q; }

void kvs_imports_destroy(kvs_imports *t)
{
	if (!t)
		return;
	kvs_htab_destroy(t->table);
	free(t);
}

static const import_ops *ops_of(const kvs_import_req *rq)
{
	if (rq->dev_type != KVS_DEV_CUDA)
		return &host_memfd;
	return rq->ipc_handle ? &cuda_legacy_ipc : &cuda_vmm_fd;
}

int kvs_import_reserve(kvs_imports *t, const kvs_import_req *rq, kvs_import **ret, bool *fresh, char *err,
		       size_t errlen)
{
	uint8_t key[33];
	key[0] = rq->dev_type;
	memcpy(key + 1, rq->uuid, 16);
	memcpy(key + 17, rq->alloc_id, 16);
	kvs_import *imp = kvs_htab_get(t->table, key);
	if (imp) {
		if (imp->size != rq->size) {
			snprintf(err, errlen, "already imported with another size");
			return KVS_E_GEOMETRY;
		}
		imp->refs++;
		t->aliases++;
		*ret = imp;
		*fresh = false;
		return 0;
	}
	if (rq->dev_type == KVS_DEV_CUDA && !t->cuda) {
		snprintf(err, errlen, "no CUDA engine");
		return KVS_E_DEVICE;
	}
	imp = calloc(1, sizeof(*imp));
	if (!imp) {
		snprintf(err, errlen, "out of memory");
		return KVS_E_INTERNAL;
	}
	memcpy(imp->key, key, sizeof(key));
	imp->fd = -1;
	imp->size = rq->size;
	imp->refs = 1;
	imp->ops = ops_of(rq);
	imp->state = KVS_IMPORT_PENDING;
	if (kvs_htab_put(t->table, imp) < 0) {
		free(imp);
		snprintf(err, errlen, "out of memory");
		return KVS_E_INTERNAL;
	}
	*ret = imp;
	*fresh = true;
	return 0;
}

int kvs_import_complete(kvs_imports *t, kvs_import *imp, bool fresh, const kvs_import_req *rq, char *err,
			size_t errlen)
{
	int r;
	if (fresh) {
		r = imp->ops->open(t, rq, imp, err, errlen); /* consumes the fd */
		imp->state = r ? KVS_IMPORT_FAILED : KVS_IMPORT_READY;
		return r;
	}
	if (imp->state != KVS_IMPORT_READY) {
		snprintf(err, errlen, "the import of this alloc_id by another register failed");
		r = KVS_E_DEVICE;
	} else {
		r = imp->ops->same(imp, rq, err, errlen);
	}
	if (rq->fd >= 0)
		close(rq->fd);
	return r;
}

int kvs_import_acquire(kvs_imports *t, const kvs_import_req *rq, kvs_import **ret, bool *fresh, char *err,
		       size_t errlen)
{
	kvs_import *imp;
	bool f;
	int r = kvs_import_reserve(t, rq, &imp, &f, err, errlen);
	if (r) {
		if (rq->fd >= 0)
			close(rq->fd);
		return r;
	}
	if ((r = kvs_import_complete(t, imp, f, rq, err, errlen)) != 0) {
		kvs_import_release(t, imp);
		return r;
	}
	*ret = imp;
	*fresh = f;
	return 0;
}

void kvs_import_release(kvs_imports *t, kvs_import *imp)
{
	if (--imp->refs > 0) {
		t->aliases--;
		return;
	}
	/* teardown order: no copy runs (leases drained) -> unmap -> close */
	kvs_htab_del(t->table, imp->key);
	if (imp->state == KVS_IMPORT_READY)
		imp->ops->close(t, imp);
	free(imp);
}

uint64_t kvs_imports_count(const kvs_imports *t) { return kvs_htab_count(t->table); }
uint64_t kvs_imports_aliases(const kvs_imports *t) { return t->aliases; }
