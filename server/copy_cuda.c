/* CUDA copy engine; see copy_cuda.h. */
#include "copy_cuda.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "cuda"
#include "kvs_cuda.h"
#include "kvs_error.h"
#include "kvs_log.h"

#define MAX_DEV 16
#define SLICE (1ull << 30)       /* L1 pinning granule */
#define PIECE (256u << 10)       /* segments are split into pieces of this size: one CTA each */
#define DESC_BUF (4u << 20)      /* bytes of one pooled descriptor buffer (174k pieces) */
#define THREADS 256
/* Contiguous runs at least this long go to the DMA engine (cuMemcpyAsync):
 * measured on an H200, one cuMemcpyAsync of a 2 MiB block reaches 95 % of
 * the PCIe ceiling, more than the kernel's share at that size; below it, the
 * kernel wins (one copy per block: 12 % at 16 KiB, 34 % at 64 KiB).
 * KVS_CUDA_DMA_MIN overrides it (bytes; 0 = never). */
#define DMA_MIN_DEFAULT (2u << 20)

extern const char kvs_ptx[]; /* generated from cuda/kernels.cu, or empty */

typedef struct seg {
	unsigned long long dst, src, len;
} seg;

typedef struct desc_buf {
	struct desc_buf *next;
	seg *segs;      /* pinned, device-mapped */
	uint32_t cap;   /* segments */
	bool pooled;
} desc_buf;

/* A batch of tasks in flight (owned by the engine until reaped). */
typedef struct inflight {
	kvs_copy_task **tasks;
	uint32_t n_tasks;
	desc_buf *buf;
	kvs_cuda_engine *e;
	struct inflight *next;
} inflight;

struct kvs_cuda_map {
	bool ipc; /* opened with cuIpcOpenMemHandle: closed, not unmapped */
	int dev;
	CUdeviceptr va;
	size_t size;
	CUmemGenericAllocationHandle h;
};

struct kvs_cuda_stream {
	int dev;
	CUstream s;
};

struct kvs_cuda_engine {
	const kvs_cuda_api *cu;
	int efd;
	int n_dev;
	CUdevice dev[MAX_DEV];
	CUcontext ctx[MAX_DEV];
	CUuuid uuid[MAX_DEV];
	CUmodule mod[MAX_DEV];
	CUfunction fn[MAX_DEV];
	int sms[MAX_DEV];
	bool have_kernel;
	uint8_t *arena;
	uint64_t arena_size;
	uint32_t n_slices;
	atomic_bool *ready; /* slice i pinned and device-mapped at its host address */
	atomic_bool stop;
	pthread_t pin_thr;
	bool pin_started;
	desc_buf *pool; /* free pooled descriptor buffers (main loop) */
	uint64_t dma_min;
	pthread_mutex_t mu;
	inflight *done; /* guarded by mu: host callbacks push here */
	kvs_cuda_stats st;
	atomic_uint_fast64_t pinned;
};

#define CU(e, call) ((e)->cu->call)

static int use(kvs_cuda_engine *e, int dev)
{
	return CU(e, cuCtxSetCurrent)(e->ctx[dev]) == CUDA_SUCCESS ? 0 : -1;
}

static void *pin_main(void *arg)
{
	kvs_cuda_engine *e = arg;
	CU(e, cuCtxSetCurrent)(e->ctx[0]);
	for (uint32_t i = 0; i < e->n_slices && !atomic_load(&e->stop); i++) {
		uint8_t *p = e->arena + (uint64_t)i * SLICE;
		uint64_t n = e->arena_size - (uint64_t)i * SLICE < SLICE ? e->arena_size - (uint64_t)i * SLICE : SLICE;
		CUresult r = CU(e, cuMemHostRegister)(p, n, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
		if (r != CUDA_SUCCESS) {
			kvs_warn("pinning L1 slice %u failed: %s (copies there use cuMemcpyAsync)", i, kvs_cuda_strerror(r));
			continue;
		}
		CUdeviceptr dp = 0;
		if (CU(e, cuMemHostGetDevicePointer)(&dp, p, 0) == CUDA_SUCCESS && dp == (CUdeviceptr)(uintptr_t)p) {
			atomic_store(&e->ready[i], true);
			atomic_fetch_add(&e->pinned, n);
		}
	}
	return NULL;
}

int kvs_cuda_engine_create(int efd, void *arena, uint64_t arena_size, kvs_cuda_engine **ret, char *err,
			   size_t errlen)
{
	const kvs_cuda_api *cu = kvs_cuda();
	if (!cu->ok) {
		snprintf(err, errlen, "%s", cu->err);
		return -ENODEV;
	}
	kvs_cuda_engine *e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->cu = cu;
	e->efd = efd;
	e->arena = arena;
	e->arena_size = arena_size;
	pthread_mutex_init(&e->mu, NULL);
	e->n_dev = cu->n_devices < MAX_DEV ? cu->n_devices : MAX_DEV;
	e->have_kernel = kvs_ptx[0] != '\0';
	const char *dm = getenv("KVS_CUDA_DMA_MIN");
	e->dma_min = dm ? strtoull(dm, NULL, 10) : DMA_MIN_DEFAULT;
	if (!e->dma_min)
		e->dma_min = UINT64_MAX;
	for (int d = 0; d < e->n_dev; d++) {
		CUresult r;
		if ((r = cu->cuDeviceGet(&e->dev[d], d)) != CUDA_SUCCESS ||
		    (r = cu->cuDevicePrimaryCtxRetain(&e->ctx[d], e->dev[d])) != CUDA_SUCCESS ||
		    (r = cu->cuDeviceGetUuid(&e->uuid[d], e->dev[d])) != CUDA_SUCCESS) {
			snprintf(err, errlen, "device %d: %s", d, kvs_cuda_strerror(r));
			e->n_dev = d;
			kvs_cuda_engine_destroy(e);
			return -ENODEV;
		}
		cu->cuDeviceGetAttribute(&e->sms[d], CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, e->dev[d]);
		if (e->have_kernel) {
			use(e, d);
			if ((r = cu->cuModuleLoadData(&e->mod[d], kvs_ptx)) != CUDA_SUCCESS ||
			    (r = cu->cuModuleGetFunction(&e->fn[d], e->mod[d], "kvs_copy_segs")) != CUDA_SUCCESS) {
				kvs_warn("device %d: copy kernel unavailable (%s): using cuMemcpyAsync", d,
					 kvs_cuda_strerror(r));
				e->have_kernel = false;
			}
		}
	}
	e->n_slices = (uint32_t)((arena_size + SLICE - 1) / SLICE);
	e->ready = calloc(e->n_slices ? e->n_slices : 1, sizeof(*e->ready));
	if (!e->ready) {
		kvs_cuda_engine_destroy(e);
		return -ENOMEM;
	}
	if (pthread_create(&e->pin_thr, NULL, pin_main, e) == 0)
		e->pin_started = true;
	kvs_info("CUDA engine: %d device(s), driver %d, copies by %s; pinning %llu MiB of L1 in the background",
		 e->n_dev, cu->driver_version, kvs_cuda_engine_mode(e), (unsigned long long)(arena_size >> 20));
	*ret = e;
	return 0;
}

void kvs_cuda_engine_destroy(kvs_cuda_engine *e)
{
	if (!e)
		return;
	atomic_store(&e->stop, true);
	if (e->pin_started)
		pthread_join(e->pin_thr, NULL);
	if (e->n_dev)
		use(e, 0);
	for (int d = 0; d < e->n_dev; d++) {
		use(e, d);
		CU(e, cuCtxSynchronize)();
	}
	for (uint32_t i = 0; e->ready && i < e->n_slices; i++)
		if (atomic_load(&e->ready[i]))
			CU(e, cuMemHostUnregister)(e->arena + (uint64_t)i * SLICE);
	while (e->pool) {
		desc_buf *b = e->pool;
		e->pool = b->next;
		CU(e, cuMemFreeHost)(b->segs);
		free(b);
	}
	for (int d = 0; d < e->n_dev; d++) {
		if (e->mod[d]) {
			use(e, d);
			CU(e, cuModuleUnload)(e->mod[d]);
		}
		CU(e, cuDevicePrimaryCtxRelease)(e->dev[d]);
	}
	free(e->ready);
	pthread_mutex_destroy(&e->mu);
	free(e);
}

const char *kvs_cuda_engine_mode(const kvs_cuda_engine *e)
{
	return e->have_kernel ? "gather/scatter kernel (PTX)" : "cuMemcpyAsync per segment";
}

int kvs_cuda_engine_devices(const kvs_cuda_engine *e) { return e->n_dev; }

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
	CU(e, cuCtxSynchronize)();            /* the mapping's work is done */
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

uint8_t *kvs_cuda_map_base(const kvs_cuda_map *m) { return (uint8_t *)(uintptr_t)m->va; }
int kvs_cuda_map_device(const kvs_cuda_map *m) { return m->dev; }

int kvs_cuda_stream_create(kvs_cuda_engine *e, int device, kvs_cuda_stream **ret)
{
	kvs_cuda_stream *s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->dev = device;
	if (use(e, device) != 0 || CU(e, cuStreamCreate)(&s->s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
		free(s);
		return KVS_E_DEVICE;
	}
	*ret = s;
	return 0;
}

void kvs_cuda_stream_destroy(kvs_cuda_engine *e, kvs_cuda_stream *s)
{
	if (!s)
		return;
	use(e, s->dev);
	CU(e, cuStreamSynchronize)(s->s);
	CU(e, cuStreamDestroy)(s->s);
	free(s);
}

static void CUDA_CB host_done(void *arg)
{
	inflight *f = arg;
	kvs_cuda_engine *e = f->e;
	pthread_mutex_lock(&e->mu);
	f->next = e->done;
	e->done = f;
	pthread_mutex_unlock(&e->mu);
	uint64_t one = 1;
	ssize_t w = write(e->efd, &one, sizeof(one));
	(void)w;
}

/* Is [p, p+len) host memory of the arena inside pinned slices? */
static bool zero_copy_ok(kvs_cuda_engine *e, uintptr_t p, uint64_t len)
{
	uintptr_t a = (uintptr_t)e->arena;
	if (p < a || p + len > a + e->arena_size)
		return true; /* device memory */
	for (uint64_t s = (p - a) / SLICE; s <= (p + len - 1 - a) / SLICE; s++)
		if (!atomic_load(&e->ready[s]))
			return false;
	return true;
}

static desc_buf *get_buf(kvs_cuda_engine *e, uint32_t n)
{
	desc_buf *b;
	if (n * sizeof(seg) <= DESC_BUF && e->pool) {
		b = e->pool;
		e->pool = b->next;
		return b;
	}
	b = calloc(1, sizeof(*b));
	if (!b)
		return NULL;
	size_t bytes = n * sizeof(seg) <= DESC_BUF ? DESC_BUF : n * sizeof(seg);
	if (CU(e, cuMemAllocHost)((void **)&b->segs, bytes) != CUDA_SUCCESS) {
		free(b);
		return NULL;
	}
	b->cap = (uint32_t)(bytes / sizeof(seg));
	b->pooled = bytes == DESC_BUF;
	return b;
}

static void put_buf(kvs_cuda_engine *e, desc_buf *b)
{
	if (!b)
		return;
	if (b->pooled) {
		b->next = e->pool;
		e->pool = b;
	} else {
		CU(e, cuMemFreeHost)(b->segs);
		free(b);
	}
}

void kvs_cuda_submit(kvs_cuda_engine *e, kvs_cuda_stream *s, kvs_copy_task **tasks, uint32_t nt,
		     const void *event, size_t event_len)
{
	inflight *f = calloc(1, sizeof(*f));
	kvs_copy_task **own = calloc(nt ? nt : 1, sizeof(*own));
	e->st.tasks += nt;
	CUresult r = CUDA_SUCCESS;
	if (!f || !own) {
		free(f);
		free(own);
		/* no memory to track them: fail each one now */
		for (uint32_t i = 0; i < nt; i++) {
			inflight *g = calloc(1, sizeof(*g));
			kvs_copy_task **one = calloc(1, sizeof(*one));
			tasks[i]->result = KVS_E_INTERNAL;
			if (!g || !one) {
				free(g);
				free(one);
				continue; /* the job deadline aborts it */
			}
			one[0] = tasks[i];
			*g = (inflight){.tasks = one, .n_tasks = 1, .e = e};
			host_done(g);
		}
		return;
	}
	memcpy(own, tasks, nt * sizeof(*own));
	*f = (inflight){.tasks = own, .n_tasks = nt, .e = e};
	if (use(e, s->dev) != 0) {
		r = CUDA_ERROR_INVALID_CONTEXT;
		goto fail;
	}
	if (event && event_len == sizeof(CUipcEventHandle)) {
		CUipcEventHandle h;
		CUevent ev;
		memcpy(&h, event, sizeof(h));
		if ((r = CU(e, cuIpcOpenEventHandle)(&ev, h)) != CUDA_SUCCESS ||
		    (r = CU(e, cuStreamWaitEvent)(s->s, ev, 0)) != CUDA_SUCCESS)
			goto fail;
		CU(e, cuEventDestroy)(ev);
	}
	/* every segment of every task, split into pieces: one kernel launch;
	 * segments over L1 slices not pinned yet go by cuMemcpyAsync */
	uint64_t n = 0, n_dma = 0;
	bool all_zc = e->have_kernel;
	for (uint32_t t = 0; t < nt; t++)
		for (uint32_t i = 0; i < tasks[t]->n_segs; i++) {
			const kvs_copy_seg *g = &tasks[t]->segs[i];
			if (g->len >= e->dma_min) {
				n_dma++;
				continue;
			}
			n += (g->len + PIECE - 1) / PIECE;
			if (!zero_copy_ok(e, (uintptr_t)g->dst, g->len) || !zero_copy_ok(e, (uintptr_t)g->src, g->len))
				all_zc = false;
		}
	if (all_zc && n && n <= UINT32_MAX) {
		f->buf = get_buf(e, (uint32_t)n);
		if (!f->buf) {
			r = CUDA_ERROR_OUT_OF_MEMORY;
			goto fail;
		}
		uint32_t k = 0;
		for (uint32_t t = 0; t < nt; t++)
			for (uint32_t i = 0; i < tasks[t]->n_segs; i++) {
				const kvs_copy_seg *g = &tasks[t]->segs[i];
				if (g->len >= e->dma_min)
					continue;
				for (uint64_t off = 0; off < g->len; off += PIECE) {
					uint64_t len = g->len - off < PIECE ? g->len - off : PIECE;
					f->buf->segs[k++] = (seg){(uintptr_t)g->dst + off, (uintptr_t)g->src + off, len};
				}
			}
		void *segp = f->buf->segs;
		unsigned cnt = (unsigned)n;
		void *args[] = {&segp, &cnt};
		unsigned grid = cnt < (unsigned)(8 * e->sms[s->dev]) ? cnt : (unsigned)(8 * e->sms[s->dev]);
		if ((r = CU(e, cuLaunchKernel)(e->fn[s->dev], grid, 1, 1, THREADS, 1, 1, 0, s->s, args, NULL)) != CUDA_SUCCESS)
			goto fail;
		e->st.kernel_launches++;
	}
	if (all_zc || (e->have_kernel && !n && n_dma)) {
		/* the long contiguous runs: DMA engine */
		for (uint32_t t = 0; t < nt && n_dma; t++)
			for (uint32_t i = 0; i < tasks[t]->n_segs; i++) {
				const kvs_copy_seg *g = &tasks[t]->segs[i];
				if (g->len < e->dma_min)
					continue;
				if ((r = CU(e, cuMemcpyAsync)((CUdeviceptr)(uintptr_t)g->dst, (CUdeviceptr)(uintptr_t)g->src,
							      g->len, s->s)) != CUDA_SUCCESS)
					goto fail;
				e->st.dma_copies++;
			}
	} else {
		for (uint32_t t = 0; t < nt; t++)
			for (uint32_t i = 0; i < tasks[t]->n_segs; i++) {
				const kvs_copy_seg *g = &tasks[t]->segs[i];
				if ((r = CU(e, cuMemcpyAsync)((CUdeviceptr)(uintptr_t)g->dst, (CUdeviceptr)(uintptr_t)g->src,
							      g->len, s->s)) != CUDA_SUCCESS)
					goto fail;
				e->st.fallback_copies++;
			}
	}
	if ((r = CU(e, cuLaunchHostFunc)(s->s, host_done, f)) != CUDA_SUCCESS)
		goto fail;
	return;
fail:
	kvs_warn("copy failed: %s", kvs_cuda_strerror(r));
	for (uint32_t t = 0; t < nt; t++)
		tasks[t]->result = KVS_E_DEVICE;
	/* wait for what was queued before completing the batch */
	CU(e, cuStreamSynchronize)(s->s);
	put_buf(e, f->buf);
	f->buf = NULL;
	e->st.errors++;
	host_done(f);
}

kvs_copy_task *kvs_cuda_reap(kvs_cuda_engine *e)
{
	pthread_mutex_lock(&e->mu);
	inflight *f = e->done;
	e->done = NULL;
	pthread_mutex_unlock(&e->mu);
	kvs_copy_task *list = NULL;
	while (f) {
		inflight *next = f->next;
		put_buf(e, f->buf);
		for (uint32_t i = 0; i < f->n_tasks; i++) {
			f->tasks[i]->next = list;
			list = f->tasks[i];
		}
		free(f->tasks);
		free(f);
		f = next;
	}
	return list;
}

void kvs_cuda_get_stats(kvs_cuda_engine *e, kvs_cuda_stats *st)
{
	*st = e->st;
	st->pinned_bytes = atomic_load(&e->pinned);
}
