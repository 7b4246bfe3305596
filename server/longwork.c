/* Long work in the background and its log lines (longwork.h). */
#include "longwork.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "server"
#include "copy_cuda.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "kvs_time.h"
#include "server.h"

#define MIB(x) ((unsigned long long)((x) >> 20))

/* MiB/s from bytes over ms (0 ms: 0). */
static double rate(uint64_t bytes, uint64_t ms) { return ms ? (double)bytes / 1048576.0 / ((double)ms / 1000.0) : 0.0; }

/* Faults the L1 arena in, slice by slice, off the main loop: fresh arena
 * pages would otherwise be faulted (and zeroed) by the copy threads on the
 * first store into them. Stops early at shutdown. */
static void *prefault_main(void *arg)
{
	kvs_server *srv = arg;
	uint64_t size;
	uint8_t *base = kvs_l1_arena(srv->l1, &size);
	const uint64_t slice = 64ull << 20;
	/* the CUDA engine's start first (cuda_ready): a millisecond without a GPU */
	while (!atomic_load(&srv->cuda_settled) && !atomic_load(&srv->prefault_stop))
		usleep(1000);
	if (kvs_cuda_pinning(srv->cuda)) {
		/* the engine's pinning faults L1 in as it pins: populating beside
		 * it competed with the copies (100 ms windows below 0.9 of steady
		 * speed until 5 s after start with 94 GiB, from 1.1 s without, on
		 * the H200 machine) and halved how much was pinned after 20 s */
		kvs_info("L1 prefault skipped: the CUDA engine pins (and so faults in) L1");
		atomic_store(&srv->prefault_active, false);
		return NULL;
	}
	/* said here, not at the thread's start: the CUDA engine may take over */
	kvs_info("L1 prefault: faulting in %llu MiB in the background (the server serves meanwhile)", MIB(size));
	for (uint64_t off = 0; off < size && !atomic_load(&srv->prefault_stop); off += slice) {
		/* a register in the CUDA driver goes first (issue 18): populating
		 * holds the mmap lock its mapping calls need */
		while (kvs_cuda_pin_held(srv->cuda) && !atomic_load(&srv->prefault_stop))
			usleep(200);
		uint64_t n = size - off < slice ? size - off : slice;
		if (madvise(base + off, n, MADV_POPULATE_WRITE) != 0)
			break; /* kernel without it: pages fault in on first use */
		atomic_fetch_add(&srv->prefaulted, n);
	}
	atomic_store(&srv->prefault_active, false);
	return NULL;
}

void kvs__prefault_start(kvs_server *srv)
{
	atomic_store(&srv->prefault_active, srv->cfg.l1_prefault);
	if (srv->cfg.l1_prefault && pthread_create(&srv->prefault, NULL, prefault_main, srv) == 0)
		srv->prefault_started = true;
	else
		atomic_store(&srv->prefault_active, false);
	if (srv->prefault_started) /* the thread says when it begins (or that it is skipped) */
		srv->lw_prefault = (kvs_progress){.on = true, .t0_ms = srv->now_ms, .next_ms = srv->now_ms + KVS_PROGRESS_MS};
}

void kvs__prefault_stop(kvs_server *srv)
{
	if (!srv->prefault_started)
		return;
	atomic_store(&srv->prefault_stop, true);
	pthread_join(srv->prefault, NULL);
	srv->prefault_started = false;
}

/* The prefault's progress and end. */
static void prefault_tick(kvs_server *srv)
{
	kvs_progress *p = &srv->lw_prefault;
	if (!p->on)
		return;
	uint64_t done = atomic_load(&srv->prefaulted), ms = srv->now_ms - p->t0_ms;
	if (!atomic_load(&srv->prefault_active)) {
		p->on = false;
		if (done)
			kvs_info("L1 prefault done: %llu MiB in %.1f s (%.0f MiB/s)", MIB(done), (double)ms / 1000.0,
				 rate(done, ms));
	} else if (srv->now_ms >= p->next_ms) {
		p->next_ms = srv->now_ms + KVS_PROGRESS_MS;
		kvs_info("L1 prefault: %llu of %llu MiB after %.0f s (%.0f MiB/s)", MIB(done), MIB(srv->cfg.l1_size),
			 (double)ms / 1000.0, rate(done, ms));
	}
}

/* The CUDA engine's pinning of L1: it starts with the engine. */
static void pin_tick(kvs_server *srv)
{
	kvs_progress *p = &srv->lw_pin;
	bool pinning = kvs_cuda_pinning(srv->cuda);
	if (!p->on && !pinning)
		return;
	kvs_cuda_stats st = {0};
	kvs_cuda_get_stats(srv->cuda, &st);
	if (!p->on) { /* its start: the CUDA engine's own line ("pinning N MiB of L1 in the background") */
		*p = (kvs_progress){.on = true, .t0_ms = srv->now_ms, .next_ms = srv->now_ms + KVS_PROGRESS_MS,
				    .done0 = st.pinned_bytes};
		return;
	}
	uint64_t ms = srv->now_ms - p->t0_ms, done = st.pinned_bytes - p->done0;
	if (!pinning) {
		p->on = false;
		kvs_info("L1 pinning done: %llu MiB in %.1f s", MIB(st.pinned_bytes), (double)ms / 1000.0);
	} else if (srv->now_ms >= p->next_ms) {
		p->next_ms = srv->now_ms + KVS_PROGRESS_MS;
		kvs_info("L1 pinning: %llu of %llu MiB after %.0f s (%.0f MiB/s)", MIB(st.pinned_bytes),
			 MIB(srv->cfg.l1_size), (double)ms / 1000.0, rate(done, ms));
	}
}

/* KVS_BACKLOG_LOG_BYTES, or KVS_TEST_BACKLOG_LOG_BYTES (tests: a small
 * backlog), read once. */
static uint64_t backlog_bytes(kvs_server *srv)
{
	if (!srv->backlog_log_bytes) {
		const char *t = getenv("KVS_TEST_BACKLOG_LOG_BYTES");
		srv->backlog_log_bytes = t && strtoull(t, NULL, 10) ? strtoull(t, NULL, 10) : KVS_BACKLOG_LOG_BYTES;
	}
	return srv->backlog_log_bytes;
}

/* A write-behind backlog: from backlog_bytes queued for L2 until below an
 * eighth of it. */
static void backlog_tick(kvs_server *srv)
{
	if (!srv->l2)
		return;
	kvs_progress *p = &srv->lw_backlog;
	kvs_l2_stats st;
	kvs_l2_get_stats(srv->l2, &st);
	uint64_t ms = srv->now_ms - p->t0_ms, done = st.writes_committed - p->done0;
	if (!p->on) {
		if (st.queue_bytes < backlog_bytes(srv))
			return;
		*p = (kvs_progress){.on = true, .t0_ms = srv->now_ms, .next_ms = srv->now_ms + KVS_PROGRESS_MS,
				    .done0 = st.writes_committed};
		kvs_info("write-behind: a backlog of %llu objects (%llu MiB) waits for L2", (unsigned long long)st.queue_depth,
			 MIB(st.queue_bytes));
	} else if (st.queue_bytes < backlog_bytes(srv) / 8) {
		p->on = false;
		kvs_info("write-behind: backlog drained in %.1f s (%llu objects written)", (double)ms / 1000.0,
			 (unsigned long long)done);
	} else if (srv->now_ms >= p->next_ms) {
		p->next_ms = srv->now_ms + KVS_PROGRESS_MS;
		kvs_info("write-behind: %llu objects (%llu MiB) wait for L2 after %.0f s; %llu written meanwhile",
			 (unsigned long long)st.queue_depth, MIB(st.queue_bytes), (double)ms / 1000.0,
			 (unsigned long long)done);
	}
}

void kvs__longwork_tick(kvs_server *srv)
{
	prefault_tick(srv);
	pin_tick(srv);
	backlog_tick(srv);
}

uint64_t kvs__longwork_flushing(kvs_server *srv)
{
	if (!srv->l2)
		return 0;
	kvs_l2_stats st;
	kvs_l2_get_stats(srv->l2, &st);
	if (!st.queue_depth)
		return 0;
	kvs_info("shutting down: writing %llu queued objects (%llu MiB) to L2 first", (unsigned long long)st.queue_depth,
		 MIB(st.queue_bytes));
	uint64_t t = kvs_now_ms();
	return t ? t : 1;
}

void kvs__longwork_flushed(kvs_server *srv, uint64_t t0_ms)
{
	if (t0_ms)
		kvs_info("L2 flushed in %.1f s", (double)(kvs_now_ms() - t0_ms) / 1000.0);
}
