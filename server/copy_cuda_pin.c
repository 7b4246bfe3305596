/* L1's pinning for device access (architecture.md §16.2): pin threads
 * claim 32 MiB slices of the arena, wanted ones first, and register them
 * with the driver while no register or copy needs it; the prefix of slices
 * that are final; which slices a part touches. See copy_cuda_impl.h. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "cuda"
#include "copy_cuda_impl.h"
#include "kvs_cuda.h"
#include "kvs_log.h"
#include "kvs_time.h"

/* Claims slice i for pinning (UNPINNED -> PINNING). */
static bool slice_claim(kvs_cuda_engine *e, uint32_t i)
{
	uint8_t exp = SLICE_UNPINNED;
	return atomic_compare_exchange_strong(&e->slice[i], &exp, SLICE_PINNING);
}

/* The next slice to pin: a wanted one first (a part waits for it), else
 * the next in address order (the L1 allocator hands out low addresses
 * first). -1 when none is left. */
static int64_t slice_next(kvs_cuda_engine *e)
{
	if (atomic_exchange(&e->n_want, 0) > 0) {
		for (uint32_t i = 0; i < e->n_slices; i++)
			if (atomic_load(&e->want[i]) && slice_claim(e, i)) {
				atomic_fetch_add(&e->n_want, 1); /* look again next time: there may be more */
				return i;
			}
	}
	uint32_t i;
	while ((i = atomic_fetch_add(&e->cursor, 1)) < e->n_slices)
		if (slice_claim(e, i))
			return i;
	return -1;
}

void *cuda_pin_main(void *arg)
{
	kvs_cuda_engine *e = arg;
	CU(e, cuCtxSetCurrent)(e->ctx[0]);
	while (!atomic_load(&e->stop)) {
		/* a register's driver calls go first; a part waiting for a slice
		 * goes before both */
		bool copying = atomic_load(&e->parts_inflight) > 0 ||
			       kvs_now_ns() - atomic_load(&e->copy_active_ns) < PIN_QUIET_NS;
		if ((atomic_load(&e->pin_hold) > 0 || copying) && atomic_load(&e->n_want) == 0) {
			usleep(200);
			continue;
		}
		int64_t i = slice_next(e);
		if (i < 0)
			break;
		uint8_t *p = e->arena + (uint64_t)i * SLICE;
		uint64_t off = (uint64_t)i * SLICE;
		uint64_t n = e->arena_size - off < SLICE ? e->arena_size - off : SLICE;
		pthread_rwlock_rdlock(&e->gate);
		CUresult r = CU(e, cuMemHostRegister)(p, n, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE);
		if (e->pin_extra_us)
			usleep(e->pin_extra_us);
		CUdeviceptr dp = 0;
		uint8_t st = SLICE_FAILED;
		if (r != CUDA_SUCCESS) {
			kvs_warn("pinning L1 slice %lld failed: %s (copies there use cuMemcpyAsync)", (long long)i,
				 kvs_cuda_strerror(r));
		} else if (CU(e, cuMemHostGetDevicePointer)(&dp, p, 0) == CUDA_SUCCESS && dp == (CUdeviceptr)(uintptr_t)p) {
			st = SLICE_READY;
			atomic_fetch_add(&e->pinned, n);
		} else {
			CU(e, cuMemHostUnregister)(p); /* not usable at its host address */
		}
		pthread_rwlock_unlock(&e->gate);
		atomic_store(&e->slice[i], st);
		atomic_fetch_sub(&e->pin_left, 1);
	}
	return NULL;
}

void kvs_cuda_pin_hold(kvs_cuda_engine *e, bool hold)
{
	if (!e)
		return;
	/* a register's first copies follow its reply: the quiet after copies
	 * (PIN_QUIET_NS) starts at its end too, so that they find no slice in
	 * progress */
	if (!hold)
		atomic_store(&e->copy_active_ns, kvs_now_ns());
	atomic_fetch_add(&e->pin_hold, hold ? 1 : -1);
}

bool kvs_cuda_pin_held(kvs_cuda_engine *e) { return e && atomic_load(&e->pin_hold) > 0; }

bool kvs_cuda_pinning(kvs_cuda_engine *e) { return e && atomic_load(&e->pin_left) > 0; }

uint64_t kvs_cuda_pinned_prefix(kvs_cuda_engine *e, bool *all)
{
	while (e->prefix < e->n_slices) {
		uint8_t st = atomic_load(&e->slice[e->prefix]);
		if (st != SLICE_READY && st != SLICE_FAILED)
			break;
		e->prefix++;
	}
	*all = atomic_load(&e->pin_left) == 0;
	uint64_t b = (uint64_t)e->prefix * SLICE;
	return b < e->arena_size ? b : e->arena_size;
}

bool cuda_part_pinned(kvs_cuda_engine *e, const kvs_copy_part *part, bool want)
{
	if (atomic_load(&e->pin_left) == 0)
		return true;
	uintptr_t a = (uintptr_t)e->arena;
	bool all = true;
	for (uint32_t t = 0; t < part->n_tasks; t++) {
		const kvs_copy_task *k = part->tasks[t];
		uintptr_t p = (uintptr_t)k->l1;
		if (!k->l1 || !k->l1_len || p < a || p + k->l1_len > a + e->arena_size)
			continue;
		for (uint64_t i = (p - a) / SLICE; i <= (p + k->l1_len - 1 - a) / SLICE; i++) {
			uint8_t st = atomic_load(&e->slice[i]);
			if (st == SLICE_READY || st == SLICE_FAILED)
				continue;
			all = false;
			if (!want)
				return false;
			if (st == SLICE_UNPINNED && !atomic_exchange(&e->want[i], true))
				atomic_fetch_add(&e->n_want, 1);
		}
	}
	return all;
}
