/* The CUDA copy engine: imports of cuMem allocations exported by ranks as
 * POSIX fds, one stream per registration, the gather/scatter kernel between
 * imported device memory and the pinned, device-mapped L1 arena, completions
 * through cuLaunchHostFunc posting to the loop's completion queue. Copies are
 * queued from the main loop; imports, maps and streams are made and torn down
 * on the registry's setup thread; L1 is pinned by the engine's pin threads;
 * the host callbacks run on the driver's thread and do nothing but post. Built without CUDA headers,
 * copy_cuda_none.c stands in: no engine is ever created. A CUDA failure fails the task (the
 * job part gets E_DEVICE), never the server. */
#ifndef KVS_COPY_CUDA_H
#define KVS_COPY_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "copy.h"

typedef struct kvs_cuda_engine kvs_cuda_engine;
typedef struct kvs_cuda_map kvs_cuda_map;   /* one imported allocation */
typedef struct kvs_cuda_stream kvs_cuda_stream;
typedef struct kvs_cuda_span kvs_cuda_span; /* imported allocations mapped back to back */

/* Creates the engine when a GPU and driver are present (-ENODEV otherwise,
 * with why in err); opts is required. Pins the L1 arena for device access in the background,
 * slice by slice on several threads, so start-up stays fast; a part touching
 * a slice not yet pinned waits (off the loop) until its slices are, and they
 * are pinned first. */
typedef struct kvs_cuda_opts {
	uint64_t stage_bytes; /* device staging per registration; 0 (or < 16 KiB) = never stage */
	uint64_t stage_min;   /* mean L1 run from which a part is staged */
	uint64_t poll_us;     /* the loop polls a part's end this long after queueing it (0: never) */
} kvs_cuda_opts;

int kvs_cuda_engine_create(kvs_cq *cq, void *arena, uint64_t arena_size, const kvs_cuda_opts *opts,
			   kvs_cuda_engine **ret, char *err, size_t errlen);
void kvs_cuda_engine_destroy(kvs_cuda_engine *e);
/* "kernel (PTX)" or "cuMemcpyBatchAsync" or "cuMemcpyAsync": what copies. */
const char *kvs_cuda_engine_mode(const kvs_cuda_engine *e);
int kvs_cuda_engine_devices(const kvs_cuda_engine *e);

/* Imports and maps run on the registry's setup thread (never the loop).
 * Imports fd (closed by this call in every case) as size bytes on the device
 * whose UUID is uuid. 0 and *ret, or KVS_E_DEVICE with the reason in err. */
int kvs_cuda_import(kvs_cuda_engine *e, const uint8_t uuid[16], int fd, uint64_t size,
		    kvs_cuda_map **ret, char *err, size_t errlen);
/* Opens a legacy CUDA IPC handle (memory without a VMM handle, e.g.
 * cudaMalloc) of size bytes on the device whose UUID is uuid. */
int kvs_cuda_import_ipc(kvs_cuda_engine *e, const uint8_t uuid[16], const uint8_t handle[64], uint64_t size,
			kvs_cuda_map **ret, char *err, size_t errlen);
/* Teardown in order: synchronize the device's work on it -> unmap -> free
 * the address range -> release the handle. Accepts NULL. */
void kvs_cuda_unimport(kvs_cuda_engine *e, kvs_cuda_map *m);
uint8_t *kvs_cuda_map_base(const kvs_cuda_map *m);
/* Maps n imported allocations (cuMem, one device) back to back in a new
 * address range, the engine's layout of one tensor over several allocations;
 * sizes are the declared ones (every piece but the last must fill its
 * mapping). 0 and *ret, or KVS_E_DEVICE with the reason in err. The pieces
 * must outlive the span. */
int kvs_cuda_span_map(kvs_cuda_engine *e, kvs_cuda_map *const *pieces, const uint64_t *sizes, uint32_t n,
		      kvs_cuda_span **ret, char *err, size_t errlen);
/* Synchronizes the device, unmaps, frees the range. Accepts NULL. */
void kvs_cuda_span_unmap(kvs_cuda_engine *e, kvs_cuda_span *s);
uint8_t *kvs_cuda_span_base(const kvs_cuda_span *s);
int kvs_cuda_map_device(const kvs_cuda_map *m);

int kvs_cuda_stream_create(kvs_cuda_engine *e, int device, kvs_cuda_stream **ret);
/* Both may take long in the driver: the registry calls them on its setup
 * thread, never on the loop. create also makes the registration's staging
 * memory and its events (at register, not at the first staged part), so a
 * copy makes no allocation in the driver. Destroy accepts NULL. */
void kvs_cuda_stream_destroy(kvs_cuda_engine *e, kvs_cuda_stream *s);
/* While held (a count), the background pinning of L1 pauses between slices
 * so that the setup thread's driver calls wait for at most the slices in
 * progress. Accepts NULL. */
void kvs_cuda_pin_hold(kvs_cuda_engine *e, bool hold);
/* Whether a hold is in force (the L1 prefault thread pauses too: its page
 * population holds the process's mmap lock, which the driver's mapping calls
 * wait for). False for NULL. */
bool kvs_cuda_pin_held(kvs_cuda_engine *e);
/* True while the engine still has L1 slices to pin (any thread; NULL: false). */
bool kvs_cuda_pinning(kvs_cuda_engine *e);
/* Bytes from the start of L1 that are pinned (or failed to pin: copied by
 * cuMemcpyAsync) without a gap, and whether all of L1 is. The loop lets L1
 * allocate below this first (kvs_l1_set_ceiling, issue 18), so copies do
 * not wait for pinning. Monotonic; main loop. */
uint64_t kvs_cuda_pinned_prefix(kvs_cuda_engine *e, bool *all);

/* Queues n copy tasks (one job part) and one completion, after the producer
 * event if given (a CUipcEventHandle). Parts whose L1 side is long
 * contiguous runs are staged: kernel between the imported memory and device
 * staging slots, DMA between the slots and L1; others go as one kernel
 * launch over pinned L1 (long device runs by DMA). A part writing device
 * memory starts after the registration's previous part. The tasks complete
 * together: when the part's callback has run, each task's cq.done is called
 * on the loop. A producer event that has not fired is waited for on the
 * engine's poller thread, never on a stream, at most until part->deadline_ms
 * (then the tasks fail with KVS_E_TIMEOUT and nothing was queued). */
void kvs_cuda_submit(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part);
/* Fails every part still waiting for its producer event now (shutdown:
 * before the job table waits for copies). Accepts NULL. */
void kvs_cuda_engine_quiesce(kvs_cuda_engine *e);
int kvs_cuda_stream_device(const kvs_cuda_stream *s);
/* Main loop: completes the parts whose end event fired, without waiting for
 * their host functions (a host function runs tens of microseconds after the
 * GPU reaches it, and the loop's wake-up on its post costs as much again on
 * a virtual machine, issue 18). Returns true while a part queued less than
 * the spin window ago is in flight and L1 is pinned: the loop then polls
 * instead of sleeping. The host functions stay as the safety net: a part
 * past the window, or any part while pinning still holds the driver,
 * completes through them. *completed: the parts it completed. Accepts NULL
 * (false). */
bool kvs_cuda_poll(kvs_cuda_engine *e, uint32_t *completed);
/* The engine as a copy engine (copy.h); the stream is a kvs_cuda_stream. */
kvs_copy_engine *kvs_cuda_copy_engine(kvs_cuda_engine *e);

typedef struct kvs_cuda_stats {
	uint64_t tasks, kernel_launches, dma_copies, fallback_copies, errors, pinned_bytes;
	uint64_t staged_parts, staged_rounds, staged_bytes;
	uint64_t parts, part_ns; /* parts completed; their time from queued to callback */
	uint64_t submit_ns;      /* main-loop time spent queueing parts */
	uint64_t staging_bytes;  /* device memory held for staging by registrations now */
	uint64_t staging_spare_bytes; /* staging memory of released registrations kept for the next */
	uint64_t parts_polled;   /* parts whose completion the loop saw first by querying (kvs_cuda_poll) */
	uint64_t pin_waits;      /* parts that waited for their L1 slices to be pinned */
	uint64_t gate_waits;     /* parts queued off the loop after pin threads' driver calls */
} kvs_cuda_stats;
void kvs_cuda_get_stats(kvs_cuda_engine *e, kvs_cuda_stats *st);

#endif
