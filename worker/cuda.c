/* libkvside's CUDA side: shareable cuMem allocations (the allocator torch's
 * CUDAPluggableAllocator can use) and export of an allocation behind a device
 * pointer as a POSIX fd for the broker. The driver is loaded at run time. */
#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvside.h"

#if KVS_HAVE_CUDA
#include "kvs_cuda.h"

_Static_assert(sizeof(CUipcMemHandle) == KVS_IPC_HANDLE_LEN, "kvs_alloc.ipc_handle holds a CUipcMemHandle");

/* Allocations made here (for free) and alloc ids handed out by export
 * (stable per allocation base). Guarded by mu. */
typedef struct rec {
	CUdeviceptr base;
	size_t size;
	CUmemGenericAllocationHandle h; /* 0 for export-only records */
	bool ours;
	uint8_t alloc_id[16];
	struct rec *next;
} rec;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static rec *recs;

static int ctx_for(const kvs_cuda_api *cu, int device)
{
	CUdevice d;
	CUcontext c;
	if (cu->cuDeviceGet(&d, device) != CUDA_SUCCESS || cu->cuDevicePrimaryCtxRetain(&c, d) != CUDA_SUCCESS ||
	    cu->cuCtxSetCurrent(c) != CUDA_SUCCESS)
		return -1;
	return 0;
}

bool kvs_cuda_available(void) { return kvs_cuda()->ok; }

void *kvs_cuda_alloc(size_t size, int device, void *stream)
{
	(void)stream;
	const kvs_cuda_api *cu = kvs_cuda();
	if (!cu->ok || ctx_for(cu, device) != 0)
		return NULL;
	CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
				    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device},
				    .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR};
	size_t gran = 0;
	if (cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS ||
	    !gran)
		return NULL;
	size_t sz = (size + gran - 1) / gran * gran;
	rec *r = calloc(1, sizeof(*r));
	if (!r)
		return NULL;
	if (cu->cuMemCreate(&r->h, sz, &prop, 0) != CUDA_SUCCESS)
		goto err_free;
	if (cu->cuMemAddressReserve(&r->base, sz, gran, 0, 0) != CUDA_SUCCESS)
		goto err_release;
	if (cu->cuMemMap(r->base, sz, 0, r->h, 0) != CUDA_SUCCESS)
		goto err_va;
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	if (cu->cuMemSetAccess(r->base, sz, &acc, 1) != CUDA_SUCCESS)
		goto err_unmap;
	r->size = sz;
	r->ours = true;
	randombytes_buf(r->alloc_id, 16);
	pthread_mutex_lock(&mu);
	r->next = recs;
	recs = r;
	pthread_mutex_unlock(&mu);
	return (void *)(uintptr_t)r->base;
err_unmap:
	cu->cuMemUnmap(r->base, sz);
err_va:
	cu->cuMemAddressFree(r->base, sz);
err_release:
	cu->cuMemRelease(r->h);
err_free:
	free(r);
	return NULL;
}

void kvs_cuda_free(void *ptr, size_t size, int device, void *stream)
{
	(void)size;
	(void)stream;
	const kvs_cuda_api *cu = kvs_cuda();
	if (!cu->ok || !ptr)
		return;
	pthread_mutex_lock(&mu);
	rec **pp = &recs, *r = NULL;
	for (; *pp; pp = &(*pp)->next)
		if ((*pp)->base == (CUdeviceptr)(uintptr_t)ptr && (*pp)->ours) {
			r = *pp;
			*pp = r->next;
			break;
		}
	pthread_mutex_unlock(&mu);
	if (!r)
		return;
	ctx_for(cu, device);
	cu->cuCtxSynchronize();
	cu->cuMemUnmap(r->base, r->size);
	cu->cuMemAddressFree(r->base, r->size);
	cu->cuMemRelease(r->h);
	free(r);
}

int kvs_cuda_export(const void *dptr, kvs_alloc *ret_alloc, uint64_t *ret_base)
{
	const kvs_cuda_api *cu = kvs_cuda();
	if (!cu->ok)
		return -ENODEV;
	CUdeviceptr base = 0;
	size_t size = 0;
	if (cu->cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)dptr) != CUDA_SUCCESS)
		return KVS_E_DEVICE;
	CUmemGenericAllocationHandle h;
	int fd = -1;
	CUipcMemHandle ipc;
	bool legacy = false;
	if (cu->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)base) != CUDA_SUCCESS) {
		/* not a VMM allocation (cudaMalloc): legacy CUDA IPC instead */
		if (cu->cuIpcGetMemHandle(&ipc, base) != CUDA_SUCCESS)
			return KVS_E_DEVICE;
		legacy = true;
	} else {
		CUresult r = cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
		cu->cuMemRelease(h); /* drop the retain; the allocation lives on */
		if (r != CUDA_SUCCESS)
			return KVS_E_DEVICE; /* allocated without the POSIX-fd handle type */
	}
	pthread_mutex_lock(&mu);
	rec *x = recs;
	while (x && x->base != base)
		x = x->next;
	if (!x && (x = calloc(1, sizeof(*x))) != NULL) {
		x->base = base;
		x->size = size;
		randombytes_buf(x->alloc_id, 16);
		x->next = recs;
		recs = x;
	}
	if (x)
		memcpy(ret_alloc->alloc_id, x->alloc_id, 16);
	pthread_mutex_unlock(&mu);
	if (!x) {
		if (fd >= 0)
			close(fd);
		return -ENOMEM;
	}
	ret_alloc->fd = fd;
	ret_alloc->size = size;
	ret_alloc->follows = false;
	if (legacy)
		memcpy(ret_alloc->ipc_handle, &ipc, sizeof(ipc));
	else
		memset(ret_alloc->ipc_handle, 0, sizeof(ret_alloc->ipc_handle));
	*ret_base = base;
	return 0;
}

int kvs_cuda_device_uuid(int device, uint8_t out[16])
{
	const kvs_cuda_api *cu = kvs_cuda();
	if (!cu->ok)
		return -ENODEV;
	CUdevice d;
	CUuuid u;
	if (cu->cuDeviceGet(&d, device) != CUDA_SUCCESS || cu->cuDeviceGetUuid(&u, d) != CUDA_SUCCESS)
		return KVS_E_DEVICE;
	memcpy(out, u.bytes, 16);
	return 0;
}

#else /* built without CUDA headers */

bool kvs_cuda_available(void) { return false; }
void *kvs_cuda_alloc(size_t size, int device, void *stream) { (void)size, (void)device, (void)stream; return NULL; }
void kvs_cuda_free(void *ptr, size_t size, int device, void *stream) { (void)ptr, (void)size, (void)device, (void)stream; }
int kvs_cuda_export(const void *dptr, kvs_alloc *ret_alloc, uint64_t *ret_base)
{
	(void)dptr, (void)ret_alloc, (void)ret_base;
	return -ENODEV;
}
int kvs_cuda_device_uuid(int device, uint8_t out[16]) { (void)device, (void)out; return -ENODEV; }

#endif
