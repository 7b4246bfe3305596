/* Shared by the GPU suite's C tests: CHECK (counts a failure and goes on),
 * waiting for the server's CUDA engine, and one rank in the test's own
 * process whose cuMem memory on GPU 0 is registered as one attention layer
 * (test_gpu_event, test_gpu_gate). Header-only: each test is one file. */
#ifndef KVS_TEST_GPU_UTIL_H
#define KVS_TEST_GPU_UTIL_H

#include <stdio.h>
#include <stdlib.h>
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
