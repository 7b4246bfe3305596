/* The LD_PRELOAD interposer: an allocation made through cuGetProcAddress'
 * cuMemCreate (the CUDA runtime's path) or dlsym'd cuMemCreate (PyTorch's)
 * without any shareable handle type cannot be exported as a POSIX fd; under
 * libkvside-preload.so the same code can. The test runs itself twice, each
 * time in a fresh exec (CUDA is not fork-safe). Exits 77 without a GPU. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda.h>

#undef cuGetProcAddress

typedef CUresult (*getproc_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

#define GET(name, var)                                                                  \
	do {                                                                            \
		void *p_ = NULL;                                                        \
		CUdriverProcAddressQueryResult q_;                                      \
		if (gp(#name, &p_, CUDA_VERSION, 0, &q_) != CUDA_SUCCESS || !p_)          \
			return 77;                                                      \
		memcpy(&var, &p_, sizeof(var));                                          \
	} while (0)

/* Allocates without handle types; returns 0 if it could export a POSIX fd,
 * 1 if not, 77 if there is no GPU. via: 0 cuGetProcAddress, 1 dlsym. */
static int child(int via)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW);
	if (!h)
		return 77;
	void *sym = dlsym(h, "cuGetProcAddress_v2");
	getproc_fn gp;
	memcpy(&gp, &sym, sizeof(gp));
	if (!gp)
		return 77;
	CUresult (*init)(unsigned);
	CUresult (*devget)(CUdevice *, int);
	CUresult (*ctxret)(CUcontext *, CUdevice);
	CUresult (*ctxset)(CUcontext);
	CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
	CUresult (*exp)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
	CUresult (*rel)(CUmemGenericAllocationHandle);
	GET(cuInit, init);
	GET(cuDeviceGet, devget);
	GET(cuDevicePrimaryCtxRetain, ctxret);
	GET(cuCtxSetCurrent, ctxset);
	GET(cuMemExportToShareableHandle, exp);
	GET(cuMemRelease, rel);
	if (via == 0) {
		GET(cuMemCreate, create);
	} else {
		void *p = dlsym(h, "cuMemCreate");
		memcpy(&create, &p, sizeof(create));
	}
	CUdevice d;
	CUcontext c;
	if (init(0) || devget(&d, 0) || ctxret(&c, d) || ctxset(c))
		return 77;
	CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
				    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
	CUmemGenericAllocationHandle a;
	if (create(&a, 2u << 20, &prop, 0) != CUDA_SUCCESS)
		return 2;
	int fd = -1;
	CUresult r = exp(&fd, a, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	rel(a);
	return r == CUDA_SUCCESS && fd >= 0 ? 0 : 1;
}

static int run(const char *self, int via, const char *preload)
{
	pid_t p = fork();
	if (p == 0) {
		char v[16];
		snprintf(v, sizeof(v), "%d", via & 1);
		if (preload)
			setenv("LD_PRELOAD", preload, 1);
		else
			unsetenv("LD_PRELOAD");
		execl(self, self, "--child", v, (char *)NULL);
		_exit(3);
	}
	int st;
	waitpid(p, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 4;
}

int main(int argc, char **argv)
{
	if (argc == 3 && strcmp(argv[1], "--child") == 0)
		return child(atoi(argv[2]));
	const char *pre = getenv("KVS_PRELOAD");
	if (!pre) {
		fprintf(stderr, "KVS_PRELOAD not set\n");
		return 1;
	}
	int fails = 0;
	for (int via = 0; via < 2; via++) {
		const char *how = via ? "dlsym(\"cuMemCreate\")" : "cuGetProcAddress(\"cuMemCreate\")";
		int plain = run(argv[0], via, NULL);
		if (plain == 77) {
			printf("SKIP: no GPU\n");
			return 77;
		}
		int with = run(argv[0], via, pre);
		printf("%s: export without preload %s, with libkvside-preload.so %s\n", how,
		       plain == 1 ? "refused (as expected)" : plain == 0 ? "ALLOWED?" : "error",
		       with == 0 ? "works" : "FAILED");
		fails += plain != 1 || with != 0;
	}
	printf("%s\n", fails ? "FAILED" : "PASSED");
	return fails ? 1 : 0;
}
