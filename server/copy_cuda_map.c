/* The CUDA engine's imports: cuMem POSIX-fd handles and legacy IPC handles
 * mapped into the server, and ranges of several of them mapped back to
 * back; see copy_cuda.h. Main-loop thread. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "cuda"
#include "copy_cuda_impl.h"
#include "kvs_error.h"
#include "kvs_log.h"

int kvs_cuda_import(kvs_cuda_engine *e, const uint8_t uuid[16], int fd, uint64_t size, kvs_cuda_map **ret,
		    char *err, size_t errlen)
{
	int d = 0;
	while (d < e->n_dev && memcmp(e->uuid[d].bytes, uuid, 16) != 0)
		d++;
	if (d == e->n_dev) {
		close(fd);
		snprintf(err, errlen, "no device with the registration's UUID on this server");
		return KVS_E_DEVICE;
	}
	kvs_cuda_map *m = calloc(1, sizeof(*m));
	if (!m) {
		close(fd);
		snprintf(err, errlen, "out of memory");
		return KVS_E_INTERNAL;
	}
	m->dev = d;
	CUresult r = CUDA_SUCCESS;
	const char *step = "set context";
	if (use(e, d) != 0)
		goto err_close;
	step = "cuMemImportFromShareableHandle";
	r = CU(e, cuMemImportFromShareableHandle)(&m->h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (r != CUDA_SUCCESS)
		goto err_close;
	close(fd);
	fd = -1;
	CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
				    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d}};
	size_t gran = 0;
	CU(e, cuMemGetAllocationGranularity)(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	m->size = gran ? (size + gran - 1) / gran * gran : size;
	step = "cuMemAddressReserve";
	if ((r = CU(e, cuMemAddressReserve)(&m->va, m->size, 0, 0, 0)) != CUDA_SUCCESS)
		goto err_release;
	step = "cuMemMap";
	if ((r = CU(e, cuMemMap)(m->va, m->size, 0, m->h, 0)) != CUDA_SUCCESS)
		goto err_free_va;
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	step = "cuMemSetAccess";
	if ((r = CU(e, cuMemSetAccess)(m->va, m->size, &acc, 1)) != CUDA_SUCCESS)
		goto err_unmap;
	*ret = m;
	return 0;
err_unmap:
	CU(e, cuMemUnmap)(m->va, m->size);
err_free_va:
	CU(e, cuMemAddressFree)(m->va, m->size);
err_release:
	CU(e, cuMemRelease)(m->h);
err_close:
	if (fd >= 0)
		close(fd);
	snprintf(err, errlen, "%s: %s", step, kvs_cuda_strerror(r));
	free(m);
	return KVS_E_DEVICE;
}

int kvs_cuda_import_ipc(kvs_cuda_engine *e, const uint8_t uuid[16], const uint8_t handle[64], uint64_t size,
			kvs_cuda_map **ret, char *err, size_t errlen)
{
	int d = 0;
	while (d < e->n_dev && memcmp(e->uuid[d].bytes, uuid, 16) != 0)
		d++;
	if (d == e->n_dev) {
		snprintf(err, errlen, "no device with the registration's UUID on this server");
		return KVS_E_DEVICE;
	}
	kvs_cuda_map *m = calloc(1, sizeof(*m));
	if (!m) {
		snprintf(err, errlen, "out of memory");
		return KVS_E_INTERNAL;
	}
	CUipcMemHandle h;
	memcpy(&h, handle, sizeof(h));
	CUresult r = CUDA_ERROR_INVALID_CONTEXT;
	if (use(e, d) != 0 ||
	    (r = CU(e, cuIpcOpenMemHandle)(&m->va, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) != CUDA_SUCCESS) {
		snprintf(err, errlen, "cuIpcOpenMemHandle: %s", kvs_cuda_strerror(r));
		free(m);
		return KVS_E_DEVICE;
	}
	m->ipc = true;
	m->dev = d;
	m->size = size;
	*ret = m;
	return 0;
}

void kvs_cuda_unimport(kvs_cuda_engine *e, kvs_cuda_map *m)
{
	if (!m)
		return;
	use(e, m->dev);
	/* no synchronisation: the registry drops the last reference only after
	 * every registration using the mapping was released, i.e. after every
	 * part's completion callback ran (ordered after its device work). A
	 * cuCtxSynchronize here waited for every other rank's copies too. */
	if (m->ipc) {
		CU(e, cuIpcCloseMemHandle)(m->va);
		free(m);
		return;
	}
	CU(e, cuMemUnmap)(m->va, m->size);    /* -> unmap */
	CU(e, cuMemAddressFree)(m->va, m->size); /* -> free the range */
	CU(e, cuMemRelease)(m->h);            /* -> release the handle */
	free(m);
}

/* A range of several imported allocations mapped back to back, as the
 * engine maps them (PyTorch's expandable segments): its own address range,
 * each piece's handle mapped again at its offset. The pieces' imports own
 * their handles; a span only maps them, so it is torn down first. */
struct kvs_cuda_span {
	int dev;
	CUdeviceptr va;
	size_t size;
	uint32_t n;
	size_t *sizes;
};

int kvs_cuda_span_map(kvs_cuda_engine *e, kvs_cuda_map *const *pieces, const uint64_t *sizes, uint32_t n,
		      kvs_cuda_span **ret, char *err, size_t errlen)
{
	int d = pieces[0]->dev;
	size_t total = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (pieces[i]->ipc || pieces[i]->dev != d) {
			snprintf(err, errlen, "allocation %u of a range is %s", i,
				 pieces[i]->ipc ? "a legacy CUDA IPC allocation" : "on another device");
			return KVS_E_DEVICE;
		}
		/* the engine maps pieces of their declared sizes back to back: a
		 * piece other than the last must fill its whole mapping */
		if (i + 1 < n && pieces[i]->size != sizes[i]) {
			snprintf(err, errlen, "allocation %u of a range: %llu bytes is not a multiple of the "
				 "mapping granularity", i, (unsigned long long)sizes[i]);
			return KVS_E_DEVICE;
		}
		total += pieces[i]->size;
	}
	kvs_cuda_span *s = calloc(1, sizeof(*s));
	size_t *sz = calloc(n, sizeof(*sz));
	if (!s || !sz) {
		free(s);
		free(sz);
		snprintf(err, errlen, "out of memory");
		return KVS_E_INTERNAL;
	}
	s->dev = d;
	s->size = total;
	s->sizes = sz;
	CUresult r = CUDA_ERROR_INVALID_CONTEXT;
	const char *step = "set context";
	if (use(e, d) != 0)
		goto fail;
	step = "cuMemAddressReserve";
	if ((r = CU(e, cuMemAddressReserve)(&s->va, total, 0, 0, 0)) != CUDA_SUCCESS)
		goto fail;
	step = "cuMemMap";
	size_t off = 0;
	for (uint32_t i = 0; i < n; i++) {
		if ((r = CU(e, cuMemMap)(s->va + off, pieces[i]->size, 0, pieces[i]->h, 0)) != CUDA_SUCCESS)
			goto fail_unmap;
		sz[s->n++] = pieces[i]->size;
		off += pieces[i]->size;
	}
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	step = "cuMemSetAccess";
	if ((r = CU(e, cuMemSetAccess)(s->va, total, &acc, 1)) != CUDA_SUCCESS)
		goto fail_unmap;
	*ret = s;
	return 0;
fail_unmap:
	for (uint32_t i = 0, o = 0; i < s->n; o += sz[i], i++)
		CU(e, cuMemUnmap)(s->va + o, sz[i]);
	CU(e, cuMemAddressFree)(s->va, total);
fail:
	snprintf(err, errlen, "%s: %s", step, kvs_cuda_strerror(r));
	free(sz);
	free(s);
	return KVS_E_DEVICE;
}

void kvs_cuda_span_unmap(kvs_cuda_engine *e, kvs_cuda_span *s)
{
	if (!s)
		return;
	use(e, s->dev); /* no synchronisation: as kvs_cuda_unimport */
	size_t off = 0;
	for (uint32_t i = 0; i < s->n; off += s->sizes[i], i++)
		CU(e, cuMemUnmap)(s->va + off, s->sizes[i]);
	CU(e, cuMemAddressFree)(s->va, s->size);
	free(s->sizes);
	free(s);
}

uint8_t *kvs_cuda_span_base(const kvs_cuda_span *s) { return (uint8_t *)(uintptr_t)s->va; }

uint8_t *kvs_cuda_map_base(const kvs_cuda_map *m) { return (uint8_t *)(uintptr_t)m->va; }
int kvs_cuda_map_device(const kvs_cuda_map *m) { return m->dev; }

