/* The server's counters: what `stats` answers and /metrics exports. */
#include <assert.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

#include "kvs_config.h"

#include "kvs_log.h"
#include "kvs_workq.h"
#include "lane.h"

#include "auth.h"
#include "copy_host.h"
#include "copy_cuda.h"
#include "events.h"
#include "jobs.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_l3.h"
#include "lookup.h"
#include "promote.h"
#include "registry.h"
#include "reply.h"
#include "stats.h"

/* The L3 tier's counters (after n entries of c); returns the new count. */
static uint32_t l3_collect(kvs_server *srv, const kvs_lookup_stats *lsp, const kvs_promote_stats *psp,
			   kvs_counter *c, uint32_t n)
{
	kvs_lookup_stats ls = *lsp;
	kvs_promote_stats ps = *psp;
#define C(nm, val) c[n++] = (kvs_counter){kvs_str_c(nm), (uint64_t)(val)}
	kvs_l3_stats l3 = {0};
	if (srv->l3)
		kvs_l3_get_stats(srv->l3, &l3);
	C("l3_enabled", srv->l3 != NULL);
	C("l3_connected", l3.connected);
	C("l3_lookups_deferred", ls.l3_deferred);
	C("l3_lookup_timeouts", ls.l3_timeouts);
	C("l3_lookups_skipped", ls.l3_skipped);
	C("l3_lookups_waiting", ls.l3_waiting);
	C("l3_probes", l3.probes);
	C("l3_probe_keys", l3.probe_keys);
	C("l3_probe_hits", l3.probe_hits);
	C("l3_probe_errors", l3.probe_errors);
	C("l3_probe_us", l3.probe_ns / 1000);
	C("l3_reads", l3.reads);
	C("l3_read_bytes", l3.read_bytes);
	C("l3_read_misses", l3.read_misses);
	C("l3_read_errors", l3.read_errors);
	C("l3_read_us", l3.read_ns / 1000);
	C("l3_corrupt", l3.corrupt);
	C("l3_promotions", ps.promotions_l3);
	C("l3_writes", l3.writes);
	C("l3_write_bytes", l3.write_bytes);
	C("l3_write_errors", l3.write_errors);
	C("l3_write_drops", l3.write_drops);
	C("l3_write_us", l3.write_ns / 1000);
	C("l3_queue_depth", l3.queue_depth);
	C("l3_queue_bytes", l3.queue_bytes);
	C("l3_moved", l3.moved);
	C("l3_ask", l3.ask);
	C("l3_refreshes", l3.refreshes);
	C("l3_nodes_down", l3.nodes_down);
	C("l3_timeouts", l3.timeouts);
#undef C
	return n;
}

/* The counters of the surfaces peers reach (lanes, KV events, CURVE keys;
 * docs/security.md), after n entries of c; returns the new count. */
static uint32_t surface_collect(kvs_server *srv, kvs_counter *c, uint32_t n)
{
#define C(nm, val) c[n++] = (kvs_counter){kvs_str_c(nm), (uint64_t)(val)}
	kvs_lane_stats lst;
	kvs__lanes_stats(srv, &lst);
	C("lanes_open", lst.open);
	C("lanes_attached", lst.attached);
	C("lanes_closed_bad", lst.closed_bad);
	C("lane_requests", lst.requests);
	C("lane_replies", lst.replies);
	C("lane_replies_diverted", lst.diverted);
	C("lane_writes", lst.writes);
	C("lane_late_flushes", lst.late);
	C("lane_ident_spoofs", srv->st.lane_spoofs);
	C("lane_replies_forged", lst.forged);
	C("lanes_closed_budget", lst.closed_budget);
	C("lanes_closed_stalled", lst.closed_stalled);
	C("lane_input_big_bytes", lst.big_bytes);
	kvs_events_stats es;
	kvs_events_get_stats(srv->events, &es);
	C("kv_events_batches", es.batches);
	C("kv_events_events", es.events);
	C("kv_events_ring_batches", es.ring_batches);
	C("kv_events_ring_bytes", es.ring_bytes);
	C("kv_events_ring_dropped", es.ring_dropped);
	C("kv_events_replay_requests", es.replay_requests);
	C("kv_events_replays", es.replays);
	C("kv_events_replays_active", es.replays_active);
	C("kv_events_replays_refused", es.replays_refused);
	C("kv_events_replays_dropped", es.replays_dropped);
	C("kv_events_replay_batches", es.replay_batches);
	C("auth_refused", kvs_auth_refused(srv->auth));
	C("auth_revoked", kvs_auth_revoked(srv->auth));
#undef C
	return n;
}

uint32_t kvs__stats_collect(kvs_server *srv, kvs_counter *c, char (*names)[32])
{
	enum { NE = KVS_E_LAST_ - KVS_E_BASE + 1 };
	uint32_t n = 0;
	kvs_l1_stats l1;
	kvs_l1_get_stats(srv->l1, &l1);
	kvs_jobs_stats js;
	kvs_jobs_get_stats(srv->jobs, &js);
	kvs_lookup_stats ls;
	kvs_lookup_get_stats(srv->lookup, &ls);
	kvs_promote_stats ps;
	kvs_promote_get_stats(srv->promote, &ps);
#define C(nm, val) c[n++] = (kvs_counter){kvs_str_c(nm), (uint64_t)(val)}
	/* which server answered: pid, version, start, uptime, epoch (the
	 * replies' epoch field, its first 8 bytes as a big-endian number) */
	uint64_t ep = 0;
	for (int i = 0; i < 8; i++)
		ep = ep << 8 | srv->epoch[i];
	C("server_pid", getpid());
	C("server_version", KVS_VERSION_NUM);
	C("server_start_unix_ms", srv->start_unix_ms);
	C("server_uptime_ms", srv->now_ms - srv->start_ms);
	C("server_epoch", ep);
	C("sessions", kvs_htab_count(srv->sessions));
	C("sessions_opened", srv->st.sessions_opened);
	C("sessions_reaped", srv->st.sessions_reaped);
	C("requests", srv->st.requests);
	C("registrations", kvs_registry_count(srv->reg));
	C("imports", kvs_registry_imports(srv->reg));
	C("reclaim_pending", kvs_workq_pending(srv->reclaimq));
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
	C("copy_waves", js.copy_waves);
	C("copy_bytes", js.copy_bytes);
	C("copy_bytes_store_host", js.copy_bytes_dir[0][0]);
	C("copy_bytes_retrieve_host", js.copy_bytes_dir[1][0]);
	C("copy_bytes_store_cuda", js.copy_bytes_dir[0][1]);
	C("copy_bytes_retrieve_cuda", js.copy_bytes_dir[1][1]);
	C("lookups", ls.lookups);
	C("lookup_keys", ls.keys);
	C("hits", ls.hits);
	C("misses", ls.keys - ls.hits);
	C("hits_l1", ls.hits - ls.hits_l2 - ls.hits_l3);
	C("hits_l2", ls.hits_l2);
	C("hits_l3", ls.hits_l3);
	C("l2_promotions", ps.promotions);
	C("l2_promotion_failures", ps.failures);
	C("l2_prefetches", ls.prefetches);
	C("lookup_pins", ls.pins);
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
	C("l1_prefault_active", atomic_load(&srv->prefault_active));
	C("l1_withheld_bytes", l1.withheld);
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
	C("l2_writes_shed", js.writes_shed);
	C("l2_write_errors", l2.write_errors);
	C("l2_queue_depth", l2.queue_depth);
	C("l2_queue_bytes", l2.queue_bytes);
	C("l2_reads", l2.reads);
	C("l2_read_misses", l2.read_misses);
	C("l2_checksum_failures", l2.checksum_failures);
	C("l2_header_mismatches", l2.header_mismatches);
	C("l2_key_mismatches", l2.key_mismatches);
	C("l2_evictions", l2.evictions);
	C("l2_map_full_retries", l2.map_full_retries);
	C("l2_disk_full", l2.disk_full);
	C("l2_corrupt_recoveries", l2.corrupt_recoveries);
	C("l2_verify_us", l2.verify_us);
	C("l2_verify_bytes", l2.verify_bytes);
	n = l3_collect(srv, &ls, &ps, c, n);
	C("broker_accepted", srv->st.broker_accepted);
	C("broker_rejected", srv->st.broker_rejected);
	C("broker_parked", srv->st.broker_parked);
	C("broker_expired", srv->st.broker_expired);
	C("parked_fds", kvs_htab_count(srv->parked));
	C("accepts_shed", atomic_load(&kvs_accept_shed));
	C("copy_bytes_host", kvs_copy_pool_bytes(srv->pool));
	C("draining", srv->draining);
	C("reply_bytes_queued", kvs__peers_queued(srv));
	C("peers_cut_off", kvs__peers_closed(srv));
	n = surface_collect(srv, c, n);
	C("log_lines_dropped", kvs_log_dropped());
	C("metrics_port", srv->metrics_port);
	C("metrics_conns_cut", srv->st.metrics_conns_cut);
	kvs_cuda_stats cs = {0};
	if (srv->cuda)
		kvs_cuda_get_stats(srv->cuda, &cs);
	C("cuda_available", srv->cuda != NULL);
	C("cuda_starting", srv->cuda_pending);
	C("cuda_devices", srv->cuda ? kvs_cuda_engine_devices(srv->cuda) : 0);
	C("cuda_tasks", cs.tasks);
	C("cuda_kernel_launches", cs.kernel_launches);
	C("cuda_fallback_copies", cs.fallback_copies);
	C("cuda_dma_copies", cs.dma_copies);
	C("cuda_staged_parts", cs.staged_parts);
	C("cuda_staged_rounds", cs.staged_rounds);
	C("cuda_staged_bytes", cs.staged_bytes);
	C("cuda_staging_bytes", cs.staging_bytes);
	C("cuda_staging_spare_bytes", cs.staging_spare_bytes);
	C("cuda_parts", cs.parts);
	C("cuda_part_us", cs.part_ns / 1000);
	C("cuda_submit_us", cs.submit_ns / 1000);
	C("cuda_parts_polled", cs.parts_polled);
	C("cuda_pin_waits", cs.pin_waits);
	C("cuda_gate_waits", cs.gate_waits);
	C("cuda_errors", cs.errors);
	C("cuda_pinned_bytes", cs.pinned_bytes);
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
