/* Glue between the main loop and the data-path modules (registry, jobs, L1,
 * host copy pool), and the `stats` op. */
#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define KVS_LOG_COMPONENT "ops"
#include "events.h"
#include "copy_host.h"
#if KVS_HAVE_CUDA
#include "copy_cuda.h"
#endif
#include "jobs.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "metrics.h"
#include "ops.h"
#include "registry.h"

/* Faults the L1 arena in, slice by slice, off the main loop: fresh arena
 * pages would otherwise be faulted (and zeroed) by the copy threads on the
 * first store into them. Stops early at shutdown. */
static void *prefault_main(void *arg)
{
	kvs_server *srv = arg;
	uint64_t size;
	uint8_t *base = kvs_l1_arena(srv->l1, &size);
	const uint64_t slice = 64ull << 20;
	for (uint64_t off = 0; off < size && !atomic_load(&srv->prefault_stop); off += slice) {
		uint64_t n = size - off < slice ? size - off : slice;
		if (madvise(base + off, n, MADV_POPULATE_WRITE) != 0)
			break; /* kernel without it: pages fault in on first use */
		atomic_fetch_add(&srv->prefaulted, n);
	}
	return NULL;
}

/* L1 made room by dropping a chunk: KV-event subscribers learn it. */
static void l1_evicted(const kvs_objkey *key, void *arg)
{
	kvs_server *srv = arg;
	kvs_events_removed(srv->events, key, KVS_TIER_EV_L1);
}

int kvs__ops_init(kvs_server *srv)
{
	int r;
	kvs_l1_config l1c = {.size = srv->cfg.l1_size, .on_evict = l1_evicted, .evict_arg = srv};
	if ((r = kvs_l1_create(&l1c, &srv->l1)) < 0) {
		kvs_err("cannot create the L1 arena of %llu bytes: %s", (unsigned long long)l1c.size,
			kvs_strerror(r));
		return r;
	}
	if ((r = kvs_registry_create(&srv->reg)) < 0)
		goto err_l1;
#if KVS_HAVE_CUDA
	{
		uint64_t asz;
		void *arena = kvs_l1_arena(srv->l1, &asz);
		char why[160] = "";
		kvs_cuda_opts co = {.stage_bytes = srv->cfg.cuda_staging, .stage_min = srv->cfg.cuda_stage_min};
		if (kvs_cuda_engine_create(srv->efd, arena, asz, &co, &srv->cuda, why, sizeof(why)) != 0) {
			srv->cuda = NULL;
			kvs_info("CUDA engine: not available (%s); host engine only", why);
		}
		kvs_registry_set_cuda(srv->reg, srv->cuda);
	}
#else
	kvs_info("CUDA engine: not built (no CUDA headers at build time); host engine only");
#endif
	if ((r = kvs_copy_pool_create(srv->cfg.copy_threads, srv->efd, &srv->pool)) < 0)
		goto err_reg;
	if (srv->cfg.l2_path[0]) {
		kvs_l2_config l2c;
		kvs_l2_config_defaults(&l2c);
		l2c.path = srv->cfg.l2_path;
		l2c.size = srv->cfg.l2_size;
		l2c.sync = srv->cfg.l2_sync;
		l2c.efd = srv->efd;
		l2c.report_evictions = srv->cfg.kv_events[0] != 0; /* for KV-event subscribers */
		if ((r = kvs_l2_open(&l2c, &srv->l2)) < 0)
			goto err_pool;
	}
	if ((r = kvs_jobs_create(srv, &srv->jobs)) < 0)
		goto err_l2;
	kvs_info("host copy engine: %u threads", srv->cfg.copy_threads);
	if (srv->cfg.l1_prefault && pthread_create(&srv->prefault, NULL, prefault_main, srv) == 0)
		srv->prefault_started = true;
	return 0;
err_l2:
	kvs_l2_close(srv->l2);
	srv->l2 = NULL;
err_pool:
	kvs_copy_pool_destroy(srv->pool);
	srv->pool = NULL;
err_reg:
	kvs_registry_destroy(srv->reg);
	srv->reg = NULL;
#if KVS_HAVE_CUDA
	kvs_cuda_engine_destroy(srv->cuda);
	srv->cuda = NULL;
#endif
err_l1:
	kvs_l1_destroy(srv->l1);
	srv->l1 = NULL;
	return r;
}

void kvs__ops_fini(kvs_server *srv)
{
	if (srv->prefault_started) {
		atomic_store(&srv->prefault_stop, true);
		pthread_join(srv->prefault, NULL);
		srv->prefault_started = false;
	}
	if (srv->jobs)
		kvs_jobs_destroy(srv, srv->jobs); /* waits for running copies */
	srv->jobs = NULL;
	kvs_copy_pool_destroy(srv->pool);
	srv->pool = NULL;
	/* queued L2 writes still read L1 memory: close L2 before L1 goes */
	kvs_l2_close(srv->l2);
	srv->l2 = NULL;
	kvs_registry_destroy(srv->reg);
	srv->reg = NULL;
#if KVS_HAVE_CUDA
	kvs_cuda_engine_destroy(srv->cuda); /* unpins L1: after every import is gone */
	srv->cuda = NULL;
#endif
	kvs_l1_destroy(srv->l1);
	srv->l1 = NULL;
}

void kvs__ops_tick(kvs_server *srv)
{
	kvs_jobs_tick(srv);
	kvs_registry_tick(srv);
}

void kvs__ops_completions(kvs_server *srv) { kvs_jobs_completions(srv); }

void kvs__ops_session_gone(kvs_server *srv, kvs_session *s)
{
	if (!srv->jobs)
		return;
	kvs_jobs_session_gone(srv, s);
	kvs_registry_session_gone(srv, s->id);
}

uint64_t kvs__ops_pending_jobs(kvs_server *srv, kvs_session *s) { return kvs_jobs_pending(srv, s); }

uint32_t kvs__stats_collect(kvs_server *srv, kvs_counter *c, char (*names)[32])
{
	enum { NE = KVS_E_LAST_ - KVS_E_BASE + 1 };
	uint32_t n = 0;
	kvs_l1_stats l1;
	kvs_l1_get_stats(srv->l1, &l1);
	kvs_jobs_stats js;
	kvs_jobs_get_stats(srv->jobs, &js);
#define C(nm, val) c[n++] = (kvs_counter){kvs_str_c(nm), (uint64_t)(val)}
	C("sessions", kvs_htab_count(srv->sessions));
	C("sessions_opened", srv->st.sessions_opened);
	C("sessions_reaped", srv->st.sessions_reaped);
	C("requests", srv->st.requests);
	C("registrations", kvs_registry_count(srv->reg));
	C("imports", kvs_registry_imports(srv->reg));
	C("aliases", kvs_registry_aliases(srv->reg));
	C("retained_blocks", kvs_jobs_retained(srv->jobs));
	C("jobs_open", kvs_jobs_open(srv->jobs));
	C("jobs_committed", js.committed);
	C("jobs_aborted", js.aborted);
	C("jobs_terminal_remembered", js.terminal_entries);
	C("store_objects", js.store_objects);
	C("store_skipped_cached", js.store_skipped);
	C("store_staged", js.store_staged);
	C("job_parts", js.parts);
	C("job_part_us", js.part_ns / 1000);
	C("retrieve_objects", js.retrieve_objects);
	C("copy_bytes", js.copy_bytes);
	C("copy_bytes_store_host", js.copy_bytes_dir[0][0]);
	C("copy_bytes_retrieve_host", js.copy_bytes_dir[1][0]);
	C("copy_bytes_store_cuda", js.copy_bytes_dir[0][1]);
	C("copy_bytes_retrieve_cuda", js.copy_bytes_dir[1][1]);
	C("lookups", js.lookups);
	C("lookup_keys", js.lookup_keys);
	C("hits", js.lookup_hits);
	C("misses", js.lookup_keys - js.lookup_hits);
	C("hits_l1", js.lookup_hits - js.lookup_hits_l2);
	C("hits_l2", js.lookup_hits_l2);
	C("l2_promotions", js.promotions);
	C("l2_promotion_failures", js.promotion_failures);
	C("l2_prefetches", js.prefetches);
	C("lookup_pins", js.pins);
	C("l1_capacity", l1.size);
	C("l1_bytes", l1.bytes_used);
	C("l1_bytes_reserved", l1.bytes_reserved);
	C("l1_objects", l1.objects);
	C("l1_objects_reserved", l1.objects_reserved);
	C("l1_chunks", l1.chunks);
	C("l1_evictions", l1.evictions);
	C("l1_evicted_bytes", l1.evicted_bytes);
	C("l1_nospace", l1.nospace);
	C("l1_meta_bytes", l1.meta_bytes);
	C("l1_prefaulted_bytes", atomic_load(&srv->prefaulted));
	C("loop_busy_us", srv->busy_ns / 1000);
	kvs_l2_stats l2 = {0};
	if (srv->l2)
		kvs_l2_get_stats(srv->l2, &l2);
	C("l2_enabled", srv->l2 != NULL);
	C("l2_capacity", l2.map_size);
	C("l2_bytes", l2.bytes);
	C("l2_objects", l2.objects);
	C("l2_writes", l2.writes);
	C("l2_writes_committed", l2.writes_committed);
	C("l2_write_batches", l2.write_batches);
	C("l2_write_drops", l2.write_drops);
	C("l2_write_errors", l2.write_errors);
	C("l2_queue_depth", l2.queue_depth);
	C("l2_queue_bytes", l2.queue_bytes);
	C("l2_reads", l2.reads);
	C("l2_read_misses", l2.read_misses);
	C("l2_checksum_failures", l2.checksum_failures);
	C("l2_header_mismatches", l2.header_mismatches);
	C("l2_evictions", l2.evictions);
	C("l2_map_full_retries", l2.map_full_retries);
	C("broker_accepted", srv->st.broker_accepted);
	C("broker_rejected", srv->st.broker_rejected);
	C("broker_parked", srv->st.broker_parked);
	C("broker_expired", srv->st.broker_expired);
	C("parked_fds", kvs_htab_count(srv->parked));
	C("copy_bytes_host", kvs_copy_pool_bytes(srv->pool));
	C("draining", srv->draining);
	C("metrics_port", kvs__metrics_port(srv));
#if KVS_HAVE_CUDA
	kvs_cuda_stats cs = {0};
	if (srv->cuda)
		kvs_cuda_get_stats(srv->cuda, &cs);
	C("cuda_available", srv->cuda != NULL);
	C("cuda_devices", srv->cuda ? kvs_cuda_engine_devices(srv->cuda) : 0);
	C("cuda_tasks", cs.tasks);
	C("cuda_kernel_launches", cs.kernel_launches);
	C("cuda_fallback_copies", cs.fallback_copies);
	C("cuda_dma_copies", cs.dma_copies);
	C("cuda_staged_parts", cs.staged_parts);
	C("cuda_staged_rounds", cs.staged_rounds);
	C("cuda_staged_bytes", cs.staged_bytes);
	C("cuda_staging_bytes", cs.staging_bytes);
	C("cuda_parts", cs.parts);
	C("cuda_part_us", cs.part_ns / 1000);
	C("cuda_submit_us", cs.submit_ns / 1000);
	C("cuda_errors", cs.errors);
	C("cuda_pinned_bytes", cs.pinned_bytes);
#else
	C("cuda_available", 0);
#endif
	for (int i = 0; i < NE; i++) {
		snprintf(names[i], sizeof(names[i]), "errors.%s", kvs_error_name(KVS_E_BASE + i));
		C(names[i], srv->st.errors[i]);
	}
#undef C
	assert(n <= KVS_STATS_MAX);
	return n;
}

int kvs__op_stats(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_counter c[KVS_STATS_MAX];
	char names[KVS_E_LAST_ - KVS_E_BASE + 1][32];
	uint32_t n = kvs__stats_collect(srv, c, names);
	kvs_msg rep = {.op = KVS_OP_STATS, .id = rq->id, .ok = true, .counters = c, .n_counters = n};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	return 0;
}
