/* Shared by the GPU suite's C tests: CHECK (counts a failure and goes on),
 * waiting for the server's CUDA engine, and one rank in the test's own
 * process whose cuMem memory on GPU 0 is registered as one attention layer
 * (test_gpu_event, test_gpu_gate), its jobs' parts, and producer events
 * held back on a stream. Header-only: each test is one file. */
#ifndef KVS_TEST_GPU_UTIL_H
#define KVS_TEST_GPU_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "kvs_cuda.h"

static int failures;
#define CHECK(c, ...)                                                            \
	do {                                                                     \
		if (!(c)) {                                                      \
			fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);     \
			fprintf(stderr, __VA_ARGS__);                            \
			fprintf(stderr, "\n");                                   \
			failures++;                                              \
		}                                                                \
	} while (0)

/* True once the server made its CUDA engine (made after the socket is
 * bound, architecture.md §16.4); false where it found no usable GPU. */
static inline bool gpu_engine_ready(kvs_client *sc)
{
	for (int i = 0; sc && i < 1500 && kvt_stat(sc, "cuda_starting") == 1; i++)
		usleep(10000);
	return sc && kvt_stat(sc, "cuda_available") == 1 && kvs_cuda()->ok;
}

typedef struct gpu_one {
	kvs_client *w;   /* the rank's session (worker, rank 0 of 1) */
	uint8_t *dev;    /* size bytes on GPU 0 */
	uint8_t *orig;   /* their initial content */
	uint64_t size, handle;
} gpu_one;

/* Allocates size bytes on GPU 0, fills them with a pattern (seed varies
 * it), registers them as one layer of block_bytes blocks, bpc per chunk.
 * 0 on success; g holds what was made either way (gpu_one_free). */
static inline int gpu_one_register(kvt_server *s, const char *engine, uint64_t size, uint32_t block_bytes,
				   uint32_t bpc, unsigned seed, gpu_one *g)
{
	*g = (gpu_one){.size = size};
	g->w = kvt_client(s, engine, KVS_ROLE_WORKER, 0, 1, NULL, NULL);
	g->dev = kvs_cuda_alloc(size, 0, NULL);
	g->orig = malloc(size);
	if (!g->w || !g->dev || !g->orig)
		return -1;
	for (uint64_t i = 0; i < size; i++)
		g->orig[i] = (uint8_t)(i * 2654435761u >> seed);
	kvs_cuda()->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)g->dev, g->orig, size);
	kvs_alloc al;
	uint64_t base = 0;
	if (kvs_cuda_export(g->dev, &al, &base) != 0)
		return -1;
	kvs_layer ly = {.group = 0, .alloc = 0, .offset = (uint64_t)(uintptr_t)g->dev - base,
			.num_blocks = size / block_bytes, .block_stride = block_bytes, .block_bytes = block_bytes};
	kvs_group gr = {.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = bpc,
			.window_chunks = -1, .null_block = -1};
	kvs_registration_desc d = {.device_type = KVS_DEV_CUDA, .allocs = &al, .n_allocs = 1, .groups = &gr,
				   .n_groups = 1, .layers = &ly, .n_layers = 1};
	kvs_cuda_device_uuid(0, d.device_uuid);
	int rc = kvs_register(g->w, &d, 20000, &g->handle);
	close(al.fd);
	return rc;
}

/* Closes the session, frees the memory. */
static inline void gpu_one_free(gpu_one *g)
{
	kvs_client_close(g->w);
	if (g->dev)
		kvs_cuda_free(g->dev, g->size, 0, NULL);
	free(g->orig);
	*g = (gpu_one){0};
}

/* The keys and block ids of the rank's part of job: nk chunks of bpc blocks
 * over blocks first.. (store; keys from job) or into them (retrieve of the
 * chunks job - 100 stored). keys: 32 * nk bytes, ids: nk * bpc. */
static inline void gpu_one_fill(uint64_t job, bool store, int64_t first, uint32_t nk, uint32_t bpc, uint8_t *keys,
				int64_t *ids)
{
	for (uint32_t k = 0; k < nk; k++) {
		uint64_t j = store ? job : job - 100;
		memset(keys + 32 * k, 0, 32);
		memcpy(keys + 32 * k, &j, 8);
		memcpy(keys + 32 * k + 8, &k, 4);
		keys[32 * k + 31] = 0x5a;
	}
	for (uint32_t i = 0; i < nk * bpc; i++)
		ids[i] = first + i;
}

/* That part sent (a store after the producer event h if given; up to 64
 * chunks of up to 64 blocks), its reply waited for. */
static inline int gpu_one_part(const gpu_one *g, uint64_t job, bool store, int64_t first, uint32_t nk, uint32_t bpc,
			       const CUipcEventHandle *h, int *state)
{
	uint8_t keys[64 * 32];
	int64_t ids[64 * 64];
	if (nk > 64 || bpc > 64)
		return -1;
	gpu_one_fill(job, store, first, nk, bpc, keys, ids);
	const int64_t *l[1] = {ids};
	uint32_t len[1] = {nk * bpc};
	kvs_blocks bl = {.n_groups = 1, .ids = l, .len = len};
	kvs_store_opts o = {.producer_event = h ? (const uint8_t *)h : NULL, .producer_event_len = h ? sizeof(*h) : 0};
	return store ? kvs_store(g->w, job, keys, nk, &bl, &o, 20000, state)
		     : kvs_retrieve(g->w, job, keys, nk, &bl, 0, 20000, state);
}

/* A producer's work not done yet: a stream held back until *word >= 1, and
 * an IPC event recorded after it (needs cuStreamWaitValue32). */
typedef struct gpu_held {
	CUstream st;
	volatile uint32_t *word; /* pinned host word the stream waits for */
	CUevent ev;
	CUipcEventHandle h;
} gpu_held;

static inline int gpu_hold(gpu_held *x)
{
	const kvs_cuda_api *cu = kvs_cuda();
	CUdeviceptr dw;
	if (!cu->cuStreamWaitValue32 || cu->cuStreamCreate(&x->st, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
	    cu->cuMemAllocHost((void **)&x->word, 4096) != CUDA_SUCCESS)
		return -1;
	*x->word = 0;
	if (cu->cuMemHostGetDevicePointer(&dw, (void *)x->word, 0) != CUDA_SUCCESS ||
	    cu->cuStreamWaitValue32(x->st, dw, 1, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS ||
	    cu->cuEventCreate(&x->ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS) != CUDA_SUCCESS ||
	    cu->cuEventRecord(x->ev, x->st) != CUDA_SUCCESS || cu->cuIpcGetEventHandle(&x->h, x->ev) != CUDA_SUCCESS)
		return -1;
	return 0;
}

/* The producer's work ends: the event fires; waits for the stream. */
static inline void gpu_release(gpu_held *x)
{
	*x->word = 1;
	kvs_cuda()->cuStreamSynchronize(x->st);
}

/* A test's end: the scheduler session closed, the server stopped (its
 * exit status checked), PASSED or FAILED printed; the exit code. */
static inline int gpu_finish(kvt_server *s, kvs_client *sc)
{
	kvs_client_close(sc);
	CHECK(kvt_server_stop(s) == 0, "server exit");
	kvt_server_cleanup(s);
	printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
	return failures ? 1 : 0;
}

#endif
