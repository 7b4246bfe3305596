/* Internals of the CUDA copy engine shared by its two files: copy_cuda.c
 * (engine, streams, copies, completions) and copy_cuda_map.c (imports of
 * engine memory and ranges of them). Nothing else includes this. */
#ifndef KVS_COPY_CUDA_IMPL_H
#define KVS_COPY_CUDA_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "copy_cuda.h"
#include "kvs_cuda.h"

#define MAX_DEV 16
/* L1 pinning granule. cuMemHostRegister holds the driver while it pins, so
 * every other driver call of the process waits for the slices in progress:
 * 32 MiB keeps that wait to tens of milliseconds (1 GiB slices held a register's
 * driver calls for seconds at start-up, issue 18). DMA runs never cross a
 * slice (each slice is its own registration). */
#define SLICE (32ull << 20)
#define PIN_THREADS_MAX 16
#define PIN_QUIET_NS (5ull * 1000 * 1000)
#define DESC_PREALLOC 8 /* descriptor buffers allocated at create, before pinning starts */

enum { SLICE_UNPINNED = 0, SLICE_PINNING, SLICE_READY, SLICE_FAILED };
#define PIECE (256u << 10)       /* segments are split into pieces of this size: one CTA each */
#define DESC_BUF (4u << 20)      /* bytes of one pooled descriptor buffer (174k pieces) */
#define THREADS 256
/* Contiguous runs at least this long go to the DMA engine (cuMemcpyAsync):
 * measured on an H200, one cuMemcpyAsync of a 2 MiB block reaches 95 % of
 * the PCIe ceiling, more than the kernel's share at that size; below it, the
 * kernel wins (one copy per block: 12 % at 16 KiB, 34 % at 64 KiB).
 * KVS_CUDA_DMA_MIN overrides it (bytes; 0 = never). */
#define DMA_MIN_DEFAULT (2u << 20)
/* Staged copies (see submit_staged): each registration gets `cuda-staging`
 * bytes of device memory in STAGE_SLOTS slots; a part whose L1 side comes in
 * contiguous host extents of `cuda-stage-min` bytes or more on average goes
 * through it: blocks gathered (or scattered) on the device by the kernel, the
 * PCIe crossing done by the DMA engine in long runs. Measured on an H200:
 * batched DMA of 2 MiB runs reaches 98-99 % of the one-copy ceiling, a kernel
 * writing or reading mapped host memory 90-93 % pipelined; 8 MiB slots fill
 * the pipeline sooner than 16 MiB ones (defaults in kvs_server_config_defaults).
 * KVS_CUDA_STAGE_BYTES (0 = never stage) and KVS_CUDA_STAGE_MIN (bytes)
 * override the configuration. */
#define STAGE_SLOTS 4
#define BATCH_MAX 4096 /* entries per cuMemcpyBatchAsync call */

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

/* A batch of tasks in flight (owned by the engine until reaped).
 * Completion is seen two ways (issue 18): the host function on the `cb`
 * stream, and the loop querying `end` while it spins (kvs_cuda_poll). The
 * first to set `claimed` completes the part, once, on the loop (the host
 * function by posting cq). refs counts the holders of the struct: the host
 * function until it ran, and the loop's poll list while listed; the last
 * one frees it (tasks and buffers are released by the completion, not by
 * the free). */
typedef struct inflight {
	kvs_cq_item cq;            /* posted by the host callback; run on the loop */
	atomic_int refs;
	atomic_bool claimed;
	bool listed;               /* on e->poll_head (loop-owned list) */
	struct inflight *pnext, *pprev;
	kvs_copy_task **tasks;
	uint32_t n_tasks;
	uint64_t t_submit, t_done; /* ns: queued, callback ran */
	CUevent end;               /* recorded after the part's last copy, or 0 */
	struct kvs_cuda_stream *h2d; /* a staged retrieve's registration (counted in flight), or NULL;
				      * it outlives the part: the part leases it until reaped */
	int dev;                   /* whose context owns end */
	bool counted;              /* in e->parts_inflight */
	desc_buf *buf;
	kvs_cuda_engine *e;
} inflight;

struct kvs_cuda_map {
	bool ipc; /* opened with cuIpcOpenMemHandle: closed, not unmapped */
	int dev;
	CUdeviceptr va;
	size_t size;
	CUmemGenericAllocationHandle h;
};

/* A registration's streams and staging memory. Invariants: everything of
 * one submission that writes device memory, or follows a submission that
 * did, starts after the previous submission's `last`; slot i of the staging
 * memory is refilled only after free[i] (the previous use drained), and
 * read only after full[i]. Staging is allocated at the first staged part. */
struct kvs_cuda_stream {
	int dev;
	CUstream s;          /* kernels, unstaged copies */
	CUstream dma;        /* staged parts: DMA between staging and L1 */
	CUstream cb;         /* completion callbacks, off the copy streams, or 0 */
	CUdeviceptr stage;   /* STAGE_SLOTS slots of slot_bytes, or 0 */
	uint64_t slot_bytes;
	CUevent full[STAGE_SLOTS], free_[STAGE_SLOTS], last;
	uint32_t next_slot;
	bool last_read_only; /* the previous submission wrote no device memory */
	uint64_t cont_seq;   /* the previous submission was a wave of this part (copy.h seq), queued
			      * at once after its producer event fired; 0: none */
	CUstream cont_first; /* the stream that wave started on */
	uint32_t h2d_staged; /* staged retrieve parts in flight */
	bool stage_off;      /* staging unavailable on this stream */
	bool pipe;           /* the engine's h2d_pipe of dev, not a registration's */
};

struct kvs_cuda_engine {
	kvs_copy_engine engine; /* first: the engine as copy.h sees it */
	const kvs_cuda_api *cu;
	kvs_cq *cq;
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
	/* Pinning (copy_cuda.c pin_main): slice i goes UNPINNED -> PINNING (one
	 * pin thread claimed it) -> READY (pinned and device-mapped at its host
	 * address) or FAILED. Threads take wanted slices first (a part waiting
	 * for them, copy_cuda_wait.c), then the next by address; they pause while
	 * pin_hold > 0 (the setup thread is in the driver for a register). */
	_Atomic uint8_t *slice;
	atomic_bool *want;
	atomic_uint n_want;     /* a hint: some want[] may be set */
	atomic_uint cursor;     /* next slice in address order */
	uint32_t prefix;        /* slices [0, prefix) are final (kvs_cuda_pinned_prefix; loop) */
	atomic_int pin_hold;
	/* The loop's driver calls against the pinning: measured on an H200, a
	 * driver call of the loop waited until all of L1 was pinned (3.9 s at
	 * 32 GiB, 15.8 s at 96 GiB) while pin threads kept the driver busy. Pin
	 * threads hold gate shared around each cuMemHostRegister; the loop takes
	 * it exclusive (writers preferred) around its driver calls while
	 * pinning runs, so it waits for the slices in progress at most. */
	pthread_rwlock_t gate;
	/* Copies go before bulk pinning: no new slice in address order while a
	 * part is in flight or for PIN_QUIET_NS after the last one ended or was
	 * queued (wanted slices are pinned regardless). */
	atomic_uint parts_inflight;
	atomic_uint_fast64_t copy_active_ns;
	atomic_uint pin_left;   /* slices not yet final */
	uint32_t pin_extra_us;  /* test hook KVS_TEST_PIN_HOLD_MS: a slow driver's register */
	/* test hook KVS_TEST_CUDA_HOLD_MS: every part's stream is held this
	 * long by kvs_test_hold before its copies (0, or no such kernel: off) */
	uint64_t hold_ns;
	CUfunction hold_fn[MAX_DEV];
	atomic_bool stop;
	/* parts waiting for their producer event (copy_cuda_wait.c) */
	pthread_mutex_t wait_mu;
	pthread_cond_t wait_cv;
	struct pwait *waits;  /* guarded by wait_mu */
	bool wait_stop, wait_quiesce, wait_started;
	pthread_t wait_thr;
	pthread_t pin_thr[PIN_THREADS_MAX];
	int n_pin_thr;
	desc_buf *pool; /* free pooled descriptor buffers (main loop) */
	/* Parts whose end event the loop may query (kvs_cuda_poll), oldest
	 * first; loop-owned. poll_spin_ns: how long after its queueing a part
	 * keeps the loop spinning (0: never poll, host functions only). */
	inflight *poll_head, *poll_tail;
	uint64_t poll_spin_ns;
	/* staging memory of released registrations, per device, for the next
	 * ones: cuMemFree synchronizes the whole device, which the loop must
	 * never wait for (freed at engine destroy) */
	CUdeviceptr spare_stage[MAX_DEV][4];
	uint32_t n_spare_stage[MAX_DEV];
	uint32_t h2d_staged[MAX_DEV]; /* staged retrieve parts in flight per device (without a pipe) */
	/* Every registration's staged retrieves of a device go through one
	 * pipeline (DMA stream, kernel stream, staging slots) in submission
	 * order: several DMA queues reading host memory at once measured 0.90
	 * of the PCIe ceiling where one queue with as many parts in flight made
	 * 0.96 (architecture.md §11). Made with the device's first registration
	 * and released with its last (setup thread, under mu: n_streams); the
	 * loop reads it only while submitting a part of a live registration of
	 * that device, so it is never released under the loop. NULL: none (no
	 * staging memory), retrieves stage per registration as before. */
	_Atomic(kvs_cuda_stream *) h2d_pipe[MAX_DEV];
	uint32_t n_streams[MAX_DEV]; /* registrations' streams per device (mu) */
	uint64_t dma_min;
	uint64_t stage_bytes, stage_min; /* per registration; mean host extent */
	pthread_mutex_t mu; /* spare_stage, n_spare_stage and st's staging gauges: streams are
			     * made and destroyed on the setup thread, read on the loop */
	kvs_cuda_stats st;
	atomic_uint_fast64_t pinned;
};

#define CU(e, call) ((e)->cu->call)

/* The loop's side of gate: true when taken (pinning still runs); pass the
 * result to gate_leave. */
static inline bool gate_enter(kvs_cuda_engine *e)
{
	if (atomic_load(&e->pin_left) == 0)
		return false;
	pthread_rwlock_wrlock(&e->gate);
	return true;
}

/* gate_enter without waiting: false when a pin thread is in the driver
 * (nothing taken); else true, with *taken as gate_enter would return it. */
static inline bool gate_try(kvs_cuda_engine *e, bool *taken)
{
	*taken = false;
	if (atomic_load(&e->pin_left) == 0)
		return true;
	if (pthread_rwlock_trywrlock(&e->gate) != 0)
		return false;
	*taken = true;
	return true;
}

static inline void gate_leave(kvs_cuda_engine *e, bool taken)
{
	if (taken)
		pthread_rwlock_unlock(&e->gate);
}

static inline int use(kvs_cuda_engine *e, int dev)
{
	return CU(e, cuCtxSetCurrent)(e->ctx[dev]) == CUDA_SUCCESS ? 0 : -1;
}

/* copy_cuda_wait.c: a part whose producer event has not fired yet waits on
 * the engine's poller thread, never on a stream (issue 16 #10): a store
 * whose event never fires fails at its deadline with KVS_E_TIMEOUT instead
 * of holding its job, lease and import forever. Takes the part (tasks and
 * ev); the loop resubmits it without the event once ev fired. */
void cuda_wait_producer(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part, CUevent ev, int result);
/* A part touching L1 slices not pinned yet waits on the poller too (the
 * slices are asked for first); resubmitted once every slice it touches is
 * final. */
void cuda_wait_pinned(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part);
/* A part the loop could not queue at once because pin threads were in the
 * driver (gate held shared): it waits on the poller until the slices in
 * progress are done, counted in parts_inflight meanwhile so that no new
 * slice starts, and the loop resubmits it; the loop never blocks on gate
 * for a submission (a 32 MiB cuMemHostRegister took up to ~30 ms on the
 * H200). */
void cuda_wait_gate(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part);
/* Every L1 slice the part's tasks touch is READY or FAILED; with want set,
 * the ones that are not are asked for first. */
bool cuda_part_pinned(kvs_cuda_engine *e, const kvs_copy_part *part, bool want);
/* copy_cuda_pin.c: a pin thread (pthread start routine; arg: the engine). */
void *cuda_pin_main(void *arg);
void cuda_wait_init(kvs_cuda_engine *e);
void cuda_wait_fini(kvs_cuda_engine *e);

#endif
