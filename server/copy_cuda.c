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
#include "kvs_trace.h"
#include "kvs_time.h"

#include "copy_cuda_impl.h"

static void poll_unlist(kvs_cuda_engine *e, struct inflight *f);

static bool engine_busy(kvs_copy_engine *ce) { return atomic_load(&((kvs_cuda_engine *)ce)->parts_inflight) > 0; }

static void engine_submit(kvs_copy_engine *ce, void *stream, const kvs_copy_part *part)
{
	kvs_cuda_submit((kvs_cuda_engine *)ce, stream, part);
}

kvs_copy_engine *kvs_cuda_copy_engine(kvs_cuda_engine *e) { return e ? &e->engine : NULL; }

int kvs_cuda_engine_create(kvs_cq *cq, void *arena, uint64_t arena_size, const kvs_cuda_opts *opts,
			   kvs_cuda_engine **ret, char *err, size_t errlen)
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
	e->cq = cq;
	e->engine = (kvs_copy_engine){.submit = engine_submit, .busy = engine_busy, .name = "cuda"};
	e->arena = arena;
	e->arena_size = arena_size;
	pthread_mutex_init(&e->mu, NULL);
	pthread_rwlockattr_t ga;
	pthread_rwlockattr_init(&ga);
	pthread_rwlockattr_setkind_np(&ga, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
	pthread_rwlock_init(&e->gate, &ga);
	pthread_rwlockattr_destroy(&ga);
	cuda_wait_init(e);
	e->n_dev = cu->n_devices < MAX_DEV ? cu->n_devices : MAX_DEV;
	e->have_kernel = kvs_ptx[0] != '\0';
	const char *dm = getenv("KVS_CUDA_DMA_MIN");
	e->dma_min = dm ? strtoull(dm, NULL, 10) : DMA_MIN_DEFAULT;
	if (!e->dma_min)
		e->dma_min = UINT64_MAX;
	/* the environment overrides the configuration (the GPU suite runs each path) */
	const char *sb = getenv("KVS_CUDA_STAGE_BYTES"), *sm = getenv("KVS_CUDA_STAGE_MIN");
	e->stage_bytes = sb ? strtoull(sb, NULL, 10) : opts->stage_bytes;
	e->stage_min = sm ? strtoull(sm, NULL, 10) : opts->stage_min;
	if (e->stage_bytes < STAGE_SLOTS * 4096ull)
		e->stage_bytes = 0;
	const char *th = getenv("KVS_TEST_CUDA_HOLD_MS"); /* tests: copies land late (test_gpu_late) */
	e->hold_ns = th ? strtoull(th, NULL, 10) * 1000000ull : 0;
	const char *ps = getenv("KVS_CUDA_POLL_US");
	e->poll_spin_ns = (ps ? strtoull(ps, NULL, 10) : opts->poll_us) * 1000ull;
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
			} else {
				/* one empty launch now: with lazy module loading the
				 * first launch loads the kernel, which the first copy
				 * would otherwise pay, behind the pinning */
				void *nul = NULL;
				unsigned zero = 0;
				void *args[] = {&nul, &zero};
				if (cu->cuLaunchKernel(e->fn[d], 1, 1, 1, THREADS, 1, 1, 0, 0, args, NULL) == CUDA_SUCCESS)
					cu->cuCtxSynchronize();
				if (e->hold_ns && cu->cuModuleGetFunction(&e->hold_fn[d], e->mod[d], "kvs_test_hold") == CUDA_SUCCESS)
					kvs_warn("test hook: every copy of device %d held %llu ms", d,
						 (unsigned long long)(e->hold_ns / 1000000));
			}
		}
	}
	e->n_slices = (uint32_t)((arena_size + SLICE - 1) / SLICE);
	e->slice = calloc(e->n_slices ? e->n_slices : 1, sizeof(*e->slice));
	e->want = calloc(e->n_slices ? e->n_slices : 1, sizeof(*e->want));
	if (!e->slice || !e->want) {
		kvs_cuda_engine_destroy(e);
		return -ENOMEM;
	}
	atomic_store(&e->pin_left, e->n_slices);
	/* the descriptor buffers the first parts need, before pinning holds the
	 * driver (cuMemAllocHost on the loop would wait for it) */
	if (e->n_dev && use(e, 0) == 0)
		for (int i = 0; i < DESC_PREALLOC; i++) {
			desc_buf *b = calloc(1, sizeof(*b));
			if (!b || CU(e, cuMemAllocHost)((void **)&b->segs, DESC_BUF) != CUDA_SUCCESS) {
				free(b);
				break;
			}
			b->cap = (uint32_t)(DESC_BUF / sizeof(seg));
			b->pooled = true;
			b->next = e->pool;
			e->pool = b;
		}
	const char *ph = getenv("KVS_TEST_PIN_HOLD_MS"); /* tests: each slice holds the driver this long */
	e->pin_extra_us = ph ? (uint32_t)strtoul(ph, NULL, 10) * 1000u : 0;
	const char *pt = getenv("KVS_CUDA_PIN_THREADS");
	int n_pin = pt ? atoi(pt) : 4;
	n_pin = n_pin < 1 ? 1 : n_pin > PIN_THREADS_MAX ? PIN_THREADS_MAX : n_pin;
	for (int i = 0; i < n_pin && e->n_slices; i++)
		if (pthread_create(&e->pin_thr[e->n_pin_thr], NULL, cuda_pin_main, e) == 0)
			e->n_pin_thr++;
	if (!e->n_pin_thr) { /* nobody pins: every copy goes by cuMemcpyAsync, none waits */
		for (uint32_t i = 0; i < e->n_slices; i++)
			atomic_store(&e->slice[i], SLICE_FAILED);
		atomic_store(&e->pin_left, 0);
	}
	kvs_info("CUDA engine: %d device(s), driver %d, copies by %s; pinning %llu MiB of L1 in the background "
		 "(%d threads, %llu MiB slices)", e->n_dev, cu->driver_version, kvs_cuda_engine_mode(e),
		 (unsigned long long)(arena_size >> 20), e->n_pin_thr, SLICE >> 20);
	*ret = e;
	return 0;
}

void kvs_cuda_engine_destroy(kvs_cuda_engine *e)
{
	if (!e)
		return;
	atomic_store(&e->stop, true);
	for (int i = 0; i < e->n_pin_thr; i++)
		pthread_join(e->pin_thr[i], NULL);
	cuda_wait_fini(e); /* no part waits any more: jobs were finalised before */
	if (e->n_dev)
		use(e, 0);
	for (int d = 0; d < e->n_dev; d++) {
		use(e, d);
		CU(e, cuCtxSynchronize)(); /* shutdown: nothing else to serve */
		/* normally released with the device's last registration */
		kvs_cuda_stream_destroy(e, atomic_exchange(&e->h2d_pipe[d], NULL));
		for (uint32_t i = 0; i < e->n_spare_stage[d]; i++)
			CU(e, cuMemFree)(e->spare_stage[d][i]);
	}
	while (e->poll_head) /* none normally: every part completed before */
		poll_unlist(e, e->poll_head);
	for (uint32_t i = 0; e->slice && i < e->n_slices; i++)
		if (atomic_load(&e->slice[i]) == SLICE_READY)
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
	free(e->slice);
	free(e->want);
	pthread_rwlock_destroy(&e->gate);
	pthread_mutex_destroy(&e->mu);
	free(e);
}

const char *kvs_cuda_engine_mode(const kvs_cuda_engine *e)
{
	if (!e->have_kernel)
		return "cuMemcpyAsync per segment";
	return e->stage_bytes ? "gather/scatter kernel (PTX), staged DMA for long L1 runs"
			      : "gather/scatter kernel (PTX)";
}

int kvs_cuda_engine_devices(const kvs_cuda_engine *e) { return e->n_dev; }

/* Makes s's staging memory, DMA stream and events (setup thread, at
 * register). False when staging is off or unavailable: the registration's
 * parts then go direct. */
static bool stage_make(kvs_cuda_engine *e, kvs_cuda_stream *s)
{
	if (!e->stage_bytes || !e->have_kernel)
		return false;
	CUresult r = CU(e, cuStreamCreate)(&s->dma, CU_STREAM_NON_BLOCKING);
	for (int i = 0; i < STAGE_SLOTS && r == CUDA_SUCCESS; i++)
		if ((r = CU(e, cuEventCreate)(&s->full[i], CU_EVENT_DISABLE_TIMING)) == CUDA_SUCCESS)
			r = CU(e, cuEventCreate)(&s->free_[i], CU_EVENT_DISABLE_TIMING);
	if (r == CUDA_SUCCESS)
		r = CU(e, cuEventCreate)(&s->last, CU_EVENT_DISABLE_TIMING);
	s->slot_bytes = e->stage_bytes / STAGE_SLOTS / 4096 * 4096;
	CUdeviceptr spare = 0;
	if (r == CUDA_SUCCESS) {
		pthread_mutex_lock(&e->mu);
		if (e->n_spare_stage[s->dev]) {
			spare = e->spare_stage[s->dev][--e->n_spare_stage[s->dev]];
			e->st.staging_spare_bytes -= s->slot_bytes * STAGE_SLOTS;
		}
		pthread_mutex_unlock(&e->mu);
	}
	if (spare)
		s->stage = spare;
	else if (r == CUDA_SUCCESS)
		r = CU(e, cuMemAlloc)(&s->stage, s->slot_bytes * STAGE_SLOTS);
	if (r != CUDA_SUCCESS) {
		s->stage = 0;
		s->stage_off = true; /* the events and stream go with the stream */
		kvs_warn(s->pipe ? "no %llu MiB of staging memory on device %d (%s) for the retrieve pipe: retrieves "
				   "stage per registration"
				 : "no %llu MiB of staging memory on device %d (%s): this registration's copies use the kernel",
			 (unsigned long long)(e->stage_bytes >> 20), s->dev, kvs_cuda_strerror(r));
		return false;
	}
	pthread_mutex_lock(&e->mu);
	e->st.staging_bytes += s->slot_bytes * STAGE_SLOTS;
	pthread_mutex_unlock(&e->mu);
	s->last_read_only = false; /* `last` not recorded yet: waiting on it is a no-op */
	return true;
}

/* The device's retrieve pipeline (h2d_pipe): a stream of its own kind, with
 * staging, no completion stream (parts complete on their registration's). */
static void pipe_make(kvs_cuda_engine *e, int device)
{
	kvs_cuda_stream *p = calloc(1, sizeof(*p));
	if (!p)
		return;
	p->dev = device;
	p->pipe = true;
	if (CU(e, cuStreamCreate)(&p->s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
		free(p);
		return;
	}
	kvs_cuda_stream *none = NULL;
	if (!stage_make(e, p) || !atomic_compare_exchange_strong(&e->h2d_pipe[device], &none, p))
		kvs_cuda_stream_destroy(e, p); /* not counted in n_streams: p->pipe */
}

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
	/* a host function blocks its stream until the driver thread has run it
	 * (tens of microseconds): on a stream of its own it does not hold up the
	 * registration's next part */
	if (CU(e, cuStreamCreate)(&s->cb, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
		s->cb = 0;
	/* staging now, at register: made lazily by the first staged part it
	 * cost that part up to 1.7 s behind the pinning at start-up (issue 18) */
	stage_make(e, s);
	pthread_mutex_lock(&e->mu);
	e->n_streams[device]++;
	pthread_mutex_unlock(&e->mu);
	/* the device's retrieve pipe, with its first registration that has
	 * staging (the setup thread makes and releases it) */
	if (s->stage && !atomic_load(&e->h2d_pipe[device]))
		pipe_make(e, device);
	*ret = s;
	return 0;
}

/* A stream whose work has not all ended at release would break the
 * registry's invariant (a registration is released only once every part's
 * completion callback ran, and the callback is ordered after the part's
 * device work). Checked without blocking; if it ever happens, only this
 * stream is waited for, never the device. */
static void stream_retire(kvs_cuda_engine *e, CUstream st)
{
	if (!st)
		return;
	if (CU(e, cuStreamQuery)(st) == CUDA_ERROR_NOT_READY) {
		kvs_warn("a released registration's stream still has work: waiting for that stream");
		CU(e, cuStreamSynchronize)(st);
	}
	CU(e, cuStreamDestroy)(st); /* returns at once; resources go when idle */
}

void kvs_cuda_stream_destroy(kvs_cuda_engine *e, kvs_cuda_stream *s)
{
	if (!s)
		return;
	use(e, s->dev);
	kvs_cuda_stream *pipe = NULL;
	if (!s->pipe) { /* a registration's: the last takes the pipe */
		pthread_mutex_lock(&e->mu);
		if (--e->n_streams[s->dev] == 0)
			pipe = atomic_exchange(&e->h2d_pipe[s->dev], NULL);
		pthread_mutex_unlock(&e->mu);
	}
	kvs_cuda_stream_destroy(e, pipe);
	stream_retire(e, s->dma);
	stream_retire(e, s->cb);
	stream_retire(e, s->s);
	for (int i = 0; i < STAGE_SLOTS; i++) {
		if (s->full[i])
			CU(e, cuEventDestroy)(s->full[i]);
		if (s->free_[i])
			CU(e, cuEventDestroy)(s->free_[i]);
	}
	if (s->last)
		CU(e, cuEventDestroy)(s->last);
	if (s->stage) {
		bool kept = false;
		pthread_mutex_lock(&e->mu);
		e->st.staging_bytes -= s->slot_bytes * STAGE_SLOTS;
		if (e->n_spare_stage[s->dev] < 4 && s->slot_bytes == e->stage_bytes / STAGE_SLOTS / 4096 * 4096) {
			e->spare_stage[s->dev][e->n_spare_stage[s->dev]++] = s->stage; /* kept for the next */
			e->st.staging_spare_bytes += s->slot_bytes * STAGE_SLOTS;
			kept = true;
		}
		pthread_mutex_unlock(&e->mu);
		if (!kept)
			CU(e, cuMemFree)(s->stage);
	}
	free(s);
}

/* Whether s can stage: its staging memory was made at register. No driver
 * call: the loop never allocates. */
static bool stage_ready(kvs_cuda_engine *e, kvs_cuda_stream *s)
{
	(void)e;
	return s->stage != 0;
}

static void inflight_done(kvs_cq_item *it);

static void inflight_unref(inflight *f)
{
	if (atomic_fetch_sub(&f->refs, 1) == 1) {
		free(f->tasks);
		free(f);
	}
}

static void CUDA_CB host_done(void *arg)
{
	inflight *f = arg;
	kvs_cuda_engine *e = f->e;
	if (atomic_exchange(&f->claimed, true)) { /* the loop saw it first */
		inflight_unref(f);
		return;
	}
	f->t_done = kvs_now_ns();
	KVS_TRACE(KVS_TP_SRV_GPU_DONE, f->n_tasks);
	kvs_cq_post(e->cq, &f->cq); /* inflight_done drops the host function's ref */
}

/* Takes f off the poll list; true if it was on it (the caller then owns the
 * list's reference and drops it when done with f). */
static bool poll_unlink(kvs_cuda_engine *e, inflight *f)
{
	if (!f->listed)
		return false;
	*(f->pprev ? &f->pprev->pnext : &e->poll_head) = f->pnext;
	*(f->pnext ? &f->pnext->pprev : &e->poll_tail) = f->pprev;
	f->listed = false;
	return true;
}

static void poll_unlist(kvs_cuda_engine *e, inflight *f)
{
	if (poll_unlink(e, f))
		inflight_unref(f);
}

/* Is [p, p+len) host memory of the arena inside pinned slices? */
static bool zero_copy_ok(kvs_cuda_engine *e, uintptr_t p, uint64_t len)
{
	uintptr_t a = (uintptr_t)e->arena;
	if (p < a || p + len > a + e->arena_size)
		return true; /* device memory */
	for (uint64_t s = (p - a) / SLICE; s <= (p + len - 1 - a) / SLICE; s++)
		if (atomic_load(&e->slice[s]) != SLICE_READY)
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


enum { DIR_NONE, DIR_D2H, DIR_H2D };

/* Which way a staged copy of these tasks would go: DIR_D2H when every
 * segment copies device memory into pinned L1, DIR_H2D for the reverse, and
 * DIR_NONE otherwise or when the L1 side's contiguous runs are on average
 * shorter than stage_min (then the kernel is faster than DMA). */
static int staged_dir(kvs_cuda_engine *e, const kvs_copy_part *part)
{
	if (!e->have_kernel || !e->stage_bytes)
		return DIR_NONE;
	/* the part says which side is L1; its L1 runs are the tasks' extents */
	uint64_t runs = 0, total = 0;
	uintptr_t end = 0;
	for (uint32_t t = 0; t < part->n_tasks; t++) {
		const kvs_copy_task *k = part->tasks[t];
		if (!k->l1 || !zero_copy_ok(e, (uintptr_t)k->l1, k->l1_len))
			return DIR_NONE;
		runs += (uintptr_t)k->l1 != end;
		end = (uintptr_t)k->l1 + k->l1_len;
		total += k->l1_len;
	}
	if (!runs || total / runs < e->stage_min)
		return DIR_NONE;
	return part->dir == KVS_COPY_TO_L1 ? DIR_D2H : DIR_H2D;
}

static CUresult dma_runs(kvs_cuda_engine *e, CUstream st, CUdeviceptr *dst, CUdeviceptr *src, size_t *len, size_t n)
{
	CUresult r = CUDA_SUCCESS;
	if (e->cu->cuMemcpyBatchAsync && n > 1) {
		CUmemcpyAttributes at = {.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM};
		size_t idx = 0;
		for (size_t i = 0; i < n && r == CUDA_SUCCESS; i += BATCH_MAX)
			r = CU(e, cuMemcpyBatchAsync)(dst + i, src + i, len + i, n - i < BATCH_MAX ? n - i : BATCH_MAX,
						      &at, &idx, 1, st);
	} else {
		for (size_t i = 0; i < n && r == CUDA_SUCCESS; i++)
			r = CU(e, cuMemcpyAsync)(dst[i], src[i], len[i], st);
	}
	e->st.dma_copies += n;
	return r;
}

/* One staged submission being built: rounds of one slot each. */
typedef struct stager {
	kvs_cuda_engine *e;
	kvs_cuda_stream *s;
	bool d2h;
	seg *pc;                    /* kernel pieces of every round (descriptor buffer) */
	uint32_t n_pc, cap_pc, pc0; /* pieces so far, capacity, first of this round */
	CUdeviceptr *xd, *xs;       /* this round's DMA runs */
	size_t *xl;
	uint32_t n_x, cap_x;
	uint64_t fill; /* bytes of the current slot in use */
} stager;

static CUresult launch(kvs_cuda_engine *e, kvs_cuda_stream *s, CUstream st, seg *segs, unsigned cnt)
{
	void *segp = segs;
	void *args[] = {&segp, &cnt};
	unsigned grid = cnt < (unsigned)(8 * e->sms[s->dev]) ? cnt : (unsigned)(8 * e->sms[s->dev]);
	e->st.kernel_launches++;
	return CU(e, cuLaunchKernel)(e->fn[s->dev], grid, 1, 1, THREADS, 1, 1, 0, st, args, NULL);
}

/* Queues the current round: D2H gathers into the slot on s->s, then DMA to
 * L1 on s->dma; H2D the mirror image. */
static CUresult st_flush(stager *g)
{
	if (g->n_pc == g->pc0)
		return CUDA_SUCCESS;
	kvs_cuda_engine *e = g->e;
	kvs_cuda_stream *s = g->s;
	uint32_t k = s->next_slot;
	CUresult r;
	if (g->d2h) {
		(void)((r = CU(e, cuStreamWaitEvent)(s->s, s->free_[k], 0)) ||
		       (r = launch(e, s, s->s, g->pc + g->pc0, g->n_pc - g->pc0)) ||
		       (r = CU(e, cuEventRecord)(s->full[k], s->s)) ||
		       (r = CU(e, cuStreamWaitEvent)(s->dma, s->full[k], 0)) ||
		       (r = dma_runs(e, s->dma, g->xd, g->xs, g->xl, g->n_x)) ||
		       (r = CU(e, cuEventRecord)(s->free_[k], s->dma)));
	} else {
		(void)((r = CU(e, cuStreamWaitEvent)(s->dma, s->free_[k], 0)) ||
		       (r = dma_runs(e, s->dma, g->xd, g->xs, g->xl, g->n_x)) ||
		       (r = CU(e, cuEventRecord)(s->full[k], s->dma)) ||
		       (r = CU(e, cuStreamWaitEvent)(s->s, s->full[k], 0)) ||
		       (r = launch(e, s, s->s, g->pc + g->pc0, g->n_pc - g->pc0)) ||
		       (r = CU(e, cuEventRecord)(s->free_[k], s->s)));
	}
	e->st.staged_rounds++;
	s->next_slot = (k + 1) % STAGE_SLOTS;
	g->pc0 = g->n_pc;
	g->n_x = 0;
	g->fill = 0;
	return r;
}

/* Adds len bytes between device address dv and L1 address hp. */
static CUresult st_add(stager *g, uintptr_t dv, uintptr_t hp, uint64_t len)
{
	kvs_cuda_engine *e = g->e;
	kvs_cuda_stream *s = g->s;
	while (len) {
		CUresult r;
		if (g->fill >= s->slot_bytes && (r = st_flush(g)) != CUDA_SUCCESS)
			return r;
		uint64_t take = len < s->slot_bytes - g->fill ? len : s->slot_bytes - g->fill;
		uint64_t to_slice = SLICE - (hp - (uintptr_t)e->arena) % SLICE; /* one registration per DMA */
		take = take < to_slice ? take : to_slice;
		uintptr_t st = (uintptr_t)s->stage + (uint64_t)s->next_slot * s->slot_bytes + g->fill;
		for (uint64_t off = 0; off < take; off += PIECE) {
			uint64_t n = take - off < PIECE ? take - off : PIECE;
			if (g->n_pc == g->cap_pc)
				return CUDA_ERROR_INVALID_VALUE; /* bound in submit_staged is wrong */
			g->pc[g->n_pc++] = g->d2h ? (seg){st + off, dv + off, n} : (seg){dv + off, st + off, n};
		}
		uintptr_t hd = g->d2h ? hp : st, hs = g->d2h ? st : hp; /* the run's dst and src */
		if (g->n_x && g->xd[g->n_x - 1] + g->xl[g->n_x - 1] == hd && g->xs[g->n_x - 1] + g->xl[g->n_x - 1] == hs &&
		    (hp - (uintptr_t)e->arena) % SLICE != 0) {
			g->xl[g->n_x - 1] += take;
		} else {
			if (g->n_x == g->cap_x) {
				uint32_t cap = g->cap_x ? 2 * g->cap_x : 256;
				CUdeviceptr *xd = realloc(g->xd, cap * sizeof(*xd));
				if (xd)
					g->xd = xd;
				CUdeviceptr *xs = realloc(g->xs, cap * sizeof(*xs));
				if (xs)
					g->xs = xs;
				size_t *xl = realloc(g->xl, cap * sizeof(*xl));
				if (xl)
					g->xl = xl;
				if (!xd || !xs || !xl)
					return CUDA_ERROR_OUT_OF_MEMORY;
				g->cap_x = cap;
			}
			g->xd[g->n_x] = hd;
			g->xs[g->n_x] = hs;
			g->xl[g->n_x++] = take;
		}
		g->fill = (g->fill + take + 15) & ~15ull; /* slot offsets stay 16-byte aligned */
		dv += take;
		hp += take;
		len -= take;
	}
	return CUDA_SUCCESS;
}

/* A staged part: the kernel moves blocks between the imported memory and
 * the registration's device staging slots (HBM speed), the DMA engine moves
 * the slots to or from L1 in runs as long as L1's objects are contiguous.
 * Two streams, so one slot's DMA overlaps the next slot's kernel. */
static CUresult submit_staged(kvs_cuda_engine *e, kvs_cuda_stream *s, kvs_copy_task **tasks, uint32_t nt,
			      bool d2h, inflight *f)
{
	uint64_t pieces = 0, total = 0, n_segs = 0;
	for (uint32_t t = 0; t < nt; t++)
		for (uint32_t i = 0; i < tasks[t]->n_segs; i++) {
			pieces += (tasks[t]->segs[i].len + PIECE - 1) / PIECE;
			total += tasks[t]->segs[i].len;
			n_segs++;
		}
	/* every cut (slot end, slice end) adds at most one piece */
	pieces += (total + 16 * n_segs) / s->slot_bytes + 2 + total / SLICE + n_segs;
	if (pieces > UINT32_MAX / 2)
		return CUDA_ERROR_INVALID_VALUE;
	f->buf = get_buf(e, (uint32_t)pieces);
	if (!f->buf)
		return CUDA_ERROR_OUT_OF_MEMORY;
	stager g = {.e = e, .s = s, .d2h = d2h, .pc = f->buf->segs, .cap_pc = f->buf->cap};
	CUresult r = CUDA_SUCCESS;
	for (uint32_t t = 0; t < nt && r == CUDA_SUCCESS; t++)
		for (uint32_t i = 0; i < tasks[t]->n_segs && r == CUDA_SUCCESS; i++) {
			const kvs_copy_seg *sg = &tasks[t]->segs[i];
			r = d2h ? st_add(&g, (uintptr_t)sg->src, (uintptr_t)sg->dst, sg->len)
				: st_add(&g, (uintptr_t)sg->dst, (uintptr_t)sg->src, sg->len);
		}
	if (r == CUDA_SUCCESS)
		r = st_flush(&g);
	free(g.xd);
	free(g.xs);
	free(g.xl);
	e->st.staged_parts++;
	e->st.staged_bytes += total;
	return r;
}

/* The unstaged path on s->s: pieces of every segment in one kernel launch,
 * long contiguous runs to the DMA engine; cuMemcpyAsync per segment without
 * the kernel or over L1 slices not pinned yet. */
static CUresult submit_direct(kvs_cuda_engine *e, kvs_cuda_stream *s, kvs_copy_task **tasks, uint32_t nt,
			      inflight *f)
{
	CUresult r = CUDA_SUCCESS;
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
		if (!f->buf)
			return CUDA_ERROR_OUT_OF_MEMORY;
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
		if ((r = launch(e, s, s->s, f->buf->segs, (unsigned)n)) != CUDA_SUCCESS)
			return r;
	}
	bool fallback = !(all_zc || (e->have_kernel && !n && n_dma));
	for (uint32_t t = 0; t < nt && (fallback || n_dma); t++)
		for (uint32_t i = 0; i < tasks[t]->n_segs; i++) {
			const kvs_copy_seg *g = &tasks[t]->segs[i];
			if (!fallback && g->len < e->dma_min)
				continue;
			if ((r = CU(e, cuMemcpyAsync)((CUdeviceptr)(uintptr_t)g->dst, (CUdeviceptr)(uintptr_t)g->src, g->len,
						      s->s)) != CUDA_SUCCESS)
				return r;
			if (fallback)
				e->st.fallback_copies++;
			else
				e->st.dma_copies++;
		}
	return CUDA_SUCCESS;
}

/* Does any segment write outside L1 (device memory)? */

/* A store after a producer event: fired already (the usual case, the engine
 * synchronised) -> go on at once; not yet -> the part waits on the engine's
 * poller (copy_cuda_wait.c), never on the stream. True if the part was
 * taken. */
static bool producer_pending(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part)
{
	if (!part->event || part->event_len != sizeof(CUipcEventHandle))
		return false;
	CUipcEventHandle h;
	CUevent ev;
	memcpy(&h, part->event, sizeof(h));
	CUresult r = use(e, s->dev) == 0 ? CU(e, cuIpcOpenEventHandle)(&ev, h) : CUDA_ERROR_INVALID_CONTEXT;
	if (r != CUDA_SUCCESS) {
		kvs_warn("producer event: %s", kvs_cuda_strerror(r));
		cuda_wait_producer(e, s, part, 0, KVS_E_DEVICE);
		return true;
	}
	r = CU(e, cuEventQuery)(ev);
	if (r == CUDA_SUCCESS) {
		CU(e, cuEventDestroy)(ev);
		return false;
	}
	cuda_wait_producer(e, s, part, ev, r == CUDA_ERROR_NOT_READY ? 0 : KVS_E_DEVICE);
	return true;
}

int kvs_cuda_stream_device(const kvs_cuda_stream *s) { return s->dev; }

static void submit_part(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part);

void kvs_cuda_submit(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part)
{
	/* while L1 is pinned the loop queues only when no pin thread is in the
	 * driver; otherwise the part waits on the poller (cuda_wait_gate) and
	 * comes back here, rather than the loop waiting for the slices in
	 * progress (every request stood still meanwhile: up to 46 ms at the
	 * first job after a start, benchmarks.md) */
	bool g;
	if (!gate_try(e, &g)) {
		e->st.gate_waits++;
		cuda_wait_gate(e, s, part);
		return;
	}
	submit_part(e, s, part);
	gate_leave(e, g);
}

static void submit_part(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part)
{
	/* a wave after one of its part queued just now: producer fired (copy.h) */
	bool cont = part->seq && part->seq == s->cont_seq;
	s->cont_seq = 0;
	if (!cont && producer_pending(e, s, part))
		return;
	/* L1 not pinned yet under this part: it waits for those slices (pinned
	 * first) rather than going as pageable copies */
	if (!cuda_part_pinned(e, part, true)) {
		e->st.pin_waits++;
		cuda_wait_pinned(e, s, part);
		return;
	}
	kvs_copy_task **tasks = part->tasks;
	uint32_t nt = part->n_tasks;
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
			*g = (inflight){.cq.done = inflight_done, .tasks = one, .n_tasks = 1, .e = e};
			atomic_init(&g->refs, 1);
			host_done(g);
		}
		return;
	}
	memcpy(own, tasks, nt * sizeof(*own));
	*f = (inflight){.cq.done = inflight_done, .tasks = own, .n_tasks = nt, .e = e};
	atomic_init(&f->refs, 1);
	atomic_init(&f->claimed, false);
	uint64_t t0 = kvs_now_ns();
	kvs_cuda_stream *via = s; /* where a staged part runs: below */
	if (use(e, s->dev) != 0) {
		r = CUDA_ERROR_INVALID_CONTEXT;
		goto fail;
	}
	int dir = staged_dir(e, part);
	if (dir != DIR_NONE && !stage_ready(e, s))
		dir = DIR_NONE;
	/* the streams and slots a staged part runs on: its registration's, or
	 * for a retrieve the device's pipe, shared by every registration */
	if (dir == DIR_H2D) {
		/* (the pipe's kernel stream must not carry the part's host
		 * function: without a completion stream, the rule without a pipe) */
		kvs_cuda_stream *p = s->cb ? atomic_load(&e->h2d_pipe[s->dev]) : NULL;
		if (p) {
			via = p;
		} else if (e->stage_min && e->h2d_staged[s->dev] > s->h2d_staged) {
			/* no pipe: several registrations retrieving through their own
			 * staging at once measured slower than the kernel (0.91
			 * against 0.93 with 4 ranks), one alone faster. stage_min 0
			 * stages everything that can be (the suite's forced run) */
			dir = DIR_NONE;
		} else {
			f->h2d = s;
			s->h2d_staged++;
			e->h2d_staged[s->dev]++;
		}
	}
	bool writes = part->dir == KVS_COPY_FROM_L1; /* retrieves write device memory */
	/* the stream this submission starts on, and the one it ends on */
	CUstream first = dir == DIR_H2D ? via->dma : s->s, final = dir == DIR_D2H ? s->dma : via->s;
	/* a submission that writes device memory, or follows one that did,
	 * starts after the previous one (reads of device memory may overlap) */
	/* a wave is ordered after earlier parts by the stream it shares with the last */
	bool ordered = cont && first == s->cont_first;
	if (s->stage && !ordered && (writes || !s->last_read_only) &&
	    (r = CU(e, cuStreamWaitEvent)(first, s->last, 0)) != CUDA_SUCCESS)
		goto fail;
	if (e->hold_fn[s->dev]) { /* the test hook: the stream waits first */
		void *hold_args[] = {&e->hold_ns};
		if ((r = CU(e, cuLaunchKernel)(e->hold_fn[s->dev], 1, 1, 1, 1, 1, 1, 0, first, hold_args, NULL)) != CUDA_SUCCESS)
			goto fail;
	}
	r = dir != DIR_NONE ? submit_staged(e, via, tasks, nt, dir == DIR_D2H, f) : submit_direct(e, s, tasks, nt, f);
	if (r != CUDA_SUCCESS)
		goto fail;
	f->t_submit = kvs_now_ns();
	e->st.submit_ns += f->t_submit - t0;
	CUstream done_on = final;
	f->dev = s->dev;
	if (s->cb && CU(e, cuEventCreate)(&f->end, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
		if ((r = CU(e, cuEventRecord)(f->end, final)) != CUDA_SUCCESS ||
		    (r = CU(e, cuStreamWaitEvent)(s->cb, f->end, 0)) != CUDA_SUCCESS)
			goto fail;
		done_on = s->cb;
	}
	if ((r = CU(e, cuLaunchHostFunc)(done_on, host_done, f)) != CUDA_SUCCESS)
		goto fail;
	f->counted = true;
	if (e->poll_spin_ns && f->end) { /* the loop may see the end first */
		atomic_fetch_add(&f->refs, 1);
		f->listed = true;
		f->pprev = e->poll_tail;
		*(e->poll_tail ? &e->poll_tail->pnext : &e->poll_head) = f;
		e->poll_tail = f;
	}
	atomic_fetch_add(&e->parts_inflight, 1);
	atomic_store(&e->copy_active_ns, kvs_now_ns());
	if (s->stage && (r = CU(e, cuEventRecord)(s->last, final)) != CUDA_SUCCESS) {
		/* the copy itself is queued; without a fresh `last` the next part
		 * could overlap it, so wait for it here instead */
		kvs_warn("ordering event: %s; synchronizing", kvs_cuda_strerror(r));
		CU(e, cuStreamSynchronize)(final);
		CU(e, cuStreamSynchronize)(s->s);
	}
	s->last_read_only = !writes;
	s->cont_seq = part->seq;
	s->cont_first = first;
	return;
fail:
	kvs_warn("copy failed: %s", kvs_cuda_strerror(r));
	for (uint32_t t = 0; t < nt; t++)
		tasks[t]->result = KVS_E_DEVICE;
	/* wait for what was queued before completing the batch */
	CU(e, cuStreamSynchronize)(s->s);
	if (s->dma)
		CU(e, cuStreamSynchronize)(s->dma);
	if (s->cb)
		CU(e, cuStreamSynchronize)(s->cb);
	if (via != s) {
		CU(e, cuStreamSynchronize)(via->s);
		CU(e, cuStreamSynchronize)(via->dma);
	}
	put_buf(e, f->buf);
	f->buf = NULL;
	e->st.errors++;
	host_done(f);
}

/* A part ended (main loop, once: after its host function posted it or the
 * loop's query saw its end first): release what the part held in the engine,
 * then hand each task to its submitter. */
static void part_complete(inflight *f)
{
	kvs_cuda_engine *e = f->e;
	KVS_TRACE(KVS_TP_SRV_PART_DONE, f->n_tasks);
	/* the list's reference is dropped last: once it is, a host function
	 * still to run may free f */
	bool listed = poll_unlink(e, f);
	if (f->counted) {
		atomic_fetch_sub(&e->parts_inflight, 1);
		atomic_store(&e->copy_active_ns, kvs_now_ns());
	}
	if (f->t_submit && f->t_done > f->t_submit) {
		e->st.part_ns += f->t_done - f->t_submit;
		e->st.parts++;
	}
	bool g = f->end || (f->buf && !f->buf->pooled) ? gate_enter(e) : false;
	put_buf(e, f->buf); /* an unpooled buffer is freed in the driver */
	if (f->end && use(e, f->dev) == 0)
		CU(e, cuEventDestroy)(f->end);
	gate_leave(e, g);
	if (f->h2d) {
		f->h2d->h2d_staged--;
		e->h2d_staged[f->h2d->dev]--;
	}
	for (uint32_t i = 0; i < f->n_tasks; i++)
		f->tasks[i]->cq.done(&f->tasks[i]->cq);
	if (listed)
		inflight_unref(f);
}

static void inflight_done(kvs_cq_item *it)
{
	inflight *f = (inflight *)it; /* cq is the first member */
	part_complete(f);
	inflight_unref(f); /* the host function's */
}

bool kvs_cuda_poll(kvs_cuda_engine *e, uint32_t *completed)
{
	*completed = 0;
	if (!e || !e->poll_head)
		return false;
	/* while pinning runs, a query could wait behind cuMemHostRegister in
	 * the driver: the host functions report then */
	if (atomic_load(&e->pin_left) != 0)
		return false;
	uint64_t now = kvs_now_ns();
	bool spin = false;
	for (inflight *f = e->poll_head, *nx; f; f = nx) {
		nx = f->pnext;
		if (use(e, f->dev) != 0)
			break;
		CUresult r = CU(e, cuEventQuery)(f->end);
		if (r == CUDA_SUCCESS) {
			if (!atomic_exchange(&f->claimed, true)) {
				f->t_done = kvs_now_ns();
				KVS_TRACE(KVS_TP_SRV_GPU_DONE, f->n_tasks);
				e->st.parts_polled++;
				(*completed)++;
				part_complete(f); /* unlists it */
			} else {
				poll_unlist(e, f); /* its host function posted it */
			}
		} else if (r != CUDA_ERROR_NOT_READY) {
			poll_unlist(e, f); /* the host function reports it */
		} else if (now - f->t_submit < e->poll_spin_ns) {
			spin = true;
		}
	}
	return spin;
}

void kvs_cuda_get_stats(kvs_cuda_engine *e, kvs_cuda_stats *st)
{
	pthread_mutex_lock(&e->mu);
	*st = e->st;
	pthread_mutex_unlock(&e->mu);
	st->pinned_bytes = atomic_load(&e->pinned);
}
