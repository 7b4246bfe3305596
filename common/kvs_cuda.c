/* Run-time CUDA driver loader; see kvs_cuda.h. */
#include "kvs_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static kvs_cuda_api api;
static pthread_once_t once = PTHREAD_ONCE_INIT;

typedef CUresult (*getproc_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static void load(void)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		snprintf(api.err, sizeof(api.err), "no CUDA driver (libcuda.so.1: %s)", dlerror());
		return;
	}
	getproc_fn getproc;
	void *sym = dlsym(h, "cuGetProcAddress_v2");
	memcpy(&getproc, &sym, sizeof(getproc));
	if (!getproc) {
		snprintf(api.err, sizeof(api.err), "CUDA driver without cuGetProcAddress_v2 (too old)");
		return;
	}
	CUdriverProcAddressQueryResult q;
	void *p;
#define KVS_CUDA_LOAD(name)                                                                        \
	if (getproc(#name, &p, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS || !p) { \
		snprintf(api.err, sizeof(api.err), "CUDA driver lacks %s", #name);                 \
		return;                                                                            \
	}                                                                                          \
	memcpy(&api.name, &p, sizeof(p));
	KVS_CUDA_FUNCS(KVS_CUDA_LOAD)
#undef KVS_CUDA_LOAD
#define KVS_CUDA_LOAD_OPT(name)                                                                   \
	p = NULL;                                                                                  \
	if (getproc(#name, &p, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) == CUDA_SUCCESS && p) \
		memcpy(&api.name, &p, sizeof(p));
	KVS_CUDA_OPT_FUNCS(KVS_CUDA_LOAD_OPT)
#undef KVS_CUDA_LOAD_OPT
	CUresult r = api.cuInit(0);
	if (r != CUDA_SUCCESS) {
		snprintf(api.err, sizeof(api.err), "cuInit failed: %s", kvs_cuda_strerror(r));
		return;
	}
	api.cuDriverGetVersion(&api.driver_version);
	if (api.cuDeviceGetCount(&api.n_devices) != CUDA_SUCCESS || api.n_devices < 1) {
		snprintf(api.err, sizeof(api.err), "no CUDA device");
		return;
	}
	api.ok = true;
}

const kvs_cuda_api *kvs_cuda(void)
{
	pthread_once(&once, load);
	return &api;
}

const char *kvs_cuda_strerror(CUresult r)
{
	const char *s = NULL;
	if (api.cuGetErrorString && api.cuGetErrorString(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA error";
}
