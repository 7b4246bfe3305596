/* The CUDA driver API, loaded at run time: dlopen("libcuda.so.1") and
 * cuGetProcAddress into one function table (NCCL's cudawrap pattern). Every
 * binary runs without a GPU: kvs_cuda() then reports why in ->err.
 * Types come from the CUDA headers; nothing links against libcuda. */
#ifndef KVS_CUDA_H
#define KVS_CUDA_H

#include <stdbool.h>
#include <cuda.h>

#define KVS_CUDA_FUNCS(X)                                                      \
	X(cuInit) X(cuDriverGetVersion) X(cuDeviceGet) X(cuDeviceGetCount)    \
	X(cuDeviceGetUuid) X(cuDeviceGetAttribute) X(cuDevicePrimaryCtxRetain) \
	X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxGetCurrent)    \
	X(cuCtxSynchronize) X(cuGetErrorString) X(cuMemCreate) X(cuMemRelease) \
	X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)      \
	X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap)   \
	X(cuMemSetAccess) X(cuMemGetAllocationGranularity)                     \
	X(cuMemRetainAllocationHandle) X(cuMemGetAddressRange)                 \
	X(cuMemHostRegister) X(cuMemHostUnregister) X(cuMemHostGetDevicePointer) \
	X(cuMemAllocHost) X(cuMemFreeHost) X(cuMemAlloc) X(cuMemFree)          \
	X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemcpyAsync) X(cuMemcpyHtoDAsync)  \
	X(cuMemcpyDtoHAsync) X(cuMemsetD8) X(cuStreamCreate) X(cuStreamDestroy) \
	X(cuStreamSynchronize) X(cuStreamQuery) X(cuStreamWaitEvent) X(cuLaunchHostFunc) \
	X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction)           \
	X(cuLaunchKernel) X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord)  \
	X(cuEventSynchronize) X(cuEventElapsedTime) X(cuEventQuery) X(cuIpcOpenEventHandle) \
	X(cuIpcGetEventHandle) \
	X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle)      \
	X(cuPointerGetAttribute)

/* Optional (newer drivers): NULL when absent. */
#define KVS_CUDA_OPT_FUNCS(X) X(cuMemcpyBatchAsync) X(cuStreamWaitValue32)

typedef struct kvs_cuda_api {
	bool ok;        /* driver loaded, cuInit succeeded, >= 1 device */
	int n_devices;
	int driver_version;
	char err[160];  /* why not ok */
#define KVS_CUDA_FIELD(name) __typeof__(name) *name;
	KVS_CUDA_FUNCS(KVS_CUDA_FIELD)
	KVS_CUDA_OPT_FUNCS(KVS_CUDA_FIELD)
#undef KVS_CUDA_FIELD
} kvs_cuda_api;

/* Loads the driver once (thread-safe); never NULL. Check ->ok. */
const kvs_cuda_api *kvs_cuda(void);

/* Text of a CUresult, via cuGetErrorString when loaded. */
const char *kvs_cuda_strerror(CUresult r);

#endif
