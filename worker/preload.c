/* libkvside-preload.so: an LD_PRELOAD interposer that makes an engine's own
 * cuMemCreate calls request POSIX-fd shareable handles, so allocations made
 * by its cuMem allocator (PyTorch's expandable segments, vLLM's cuMem pool)
 * can be exported to kvside without changing the engine.
 *
 * Engines reach cuMemCreate three ways, all covered: a direct call (symbol
 * interposition), dlsym(libcuda handle, "cuMemCreate") (dlsym itself is
 * wrapped), and cuGetProcAddress("cuMemCreate") (the CUDA runtime's way:
 * cuGetProcAddress is wrapped, and returned for dlsym lookups of it). The
 * wrapper only ORs CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR into
 * prop->requestedHandleTypes; everything else passes through untouched. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include <cuda.h>

#undef cuGetProcAddress

typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
			      unsigned long long);
typedef CUresult (*getproc_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef void *(*dlsym_fn)(void *, const char *);

static _Atomic(create_fn) real_create;
static _Atomic(getproc_fn) real_getproc;

static dlsym_fn real_dlsym(void)
{
	static _Atomic(dlsym_fn) fn;
	dlsym_fn f = atomic_load(&fn);
	if (!f) {
		void *p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
		if (!p)
			p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
		memcpy(&f, &p, sizeof(f));
		atomic_store(&fn, f);
	}
	return f;
}

static create_fn find_real_create(void)
{
	create_fn f = atomic_load(&real_create);
	if (!f) {
		void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
		if (!h)
			h = dlopen("libcuda.so.1", RTLD_NOW);
		void *p = h ? real_dlsym()(h, "cuMemCreate") : NULL;
		memcpy(&f, &p, sizeof(f));
		atomic_store(&real_create, f);
	}
	return f;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
		     unsigned long long flags)
{
	create_fn f = find_real_create();
	if (!f)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!prop)
		return f(handle, size, prop, flags);
	CUmemAllocationProp p = *prop;
	p.requestedHandleTypes = (CUmemAllocationHandleType)(p.requestedHandleTypes |
							      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	CUresult r = f(handle, size, &p, flags);
	if (r != CUDA_SUCCESS)
		r = f(handle, size, prop, flags); /* never make an allocation fail */
	return r;
}

static CUresult getproc_common(const char *symbol, void **pfn, int ver, cuuint64_t flags,
			       CUdriverProcAddressQueryResult *status)
{
	getproc_fn g = atomic_load(&real_getproc);
	if (!g) {
		void *h = dlopen("libcuda.so.1", RTLD_NOW);
		void *p = h ? real_dlsym()(h, "cuGetProcAddress_v2") : NULL;
		memcpy(&g, &p, sizeof(g));
		atomic_store(&real_getproc, g);
	}
	if (!g)
		return CUDA_ERROR_NOT_INITIALIZED;
	CUresult r = g(symbol, pfn, ver, flags, status);
	if (r == CUDA_SUCCESS && pfn && *pfn && strcmp(symbol, "cuMemCreate") == 0) {
		create_fn f;
		memcpy(&f, pfn, sizeof(f));
		atomic_store(&real_create, f);
		create_fn mine = cuMemCreate;
		memcpy(pfn, &mine, sizeof(mine));
	} else if (r == CUDA_SUCCESS && pfn && *pfn && strncmp(symbol, "cuGetProcAddress", 16) == 0) {
		getproc_fn mine = getproc_common;
		memcpy(pfn, &mine, sizeof(mine));
	}
	return r;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
			     CUdriverProcAddressQueryResult *status)
{
	return getproc_common(symbol, pfn, ver, flags, status);
}

void *dlsym(void *handle, const char *name)
{
	void *p = real_dlsym()(handle, name);
	if (!p)
		return p;
	if (strcmp(name, "cuMemCreate") == 0) {
		create_fn f;
		memcpy(&f, &p, sizeof(f));
		if (f != cuMemCreate)
			atomic_store(&real_create, f);
		create_fn mine = cuMemCreate;
		memcpy(&p, &mine, sizeof(p));
	} else if (strcmp(name, "cuGetProcAddress_v2") == 0 || strcmp(name, "cuGetProcAddress") == 0) {
		getproc_fn g;
		memcpy(&g, &p, sizeof(g));
		if (g != cuGetProcAddress_v2 && g != getproc_common)
			atomic_store(&real_getproc, g);
		getproc_fn mine = getproc_common;
		memcpy(&p, &mine, sizeof(p));
	}
	return p;
}
