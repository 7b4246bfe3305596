/* libkvside completions: a decoded reply (or a local failure) turned into the
 * kvs_result an application callback sees, then the request freed. Runs on
 * the I/O thread; the arrays a result points to are thread-local and valid
 * during the callback only (kvside.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_int.h"

/* The client's own counters, after the server's in a `stats` result. */
#define CLIENT_STATS 10

static uint32_t client_stats(kvs_client *c, kvs_stat_out *out)
{
	pthread_mutex_lock(&c->mu); /* application threads count their lane writes under it */
	uint64_t frames_out = c->lane.frames_out, direct = c->lane.direct_writes;
	uint64_t windows = c->hybrid_windows, hits = c->hybrid_hits;
	pthread_mutex_unlock(&c->mu);
	const struct {
		const char *name;
		uint64_t value;
	} st[CLIENT_STATS] = {
		{"client_heartbeats", c->cst.heartbeats},
		{"client_heartbeat_delay_max_us", c->cst.hb_delay_max_us},
		{"client_broker_records", c->cst.broker_records},
		{"client_broker_fds", c->cst.broker_fds},
		{"client_lane_up", c->lane.state == KVS__LANE_UP},
		{"client_lane_frames_out", frames_out},
		{"client_lane_direct", direct},
		{"client_lane_frames_in", c->lane.frames_in},
		{"client_hybrid_windows", windows},
		{"client_hybrid_hits", hits},
	};
	for (uint32_t i = 0; i < CLIENT_STATS; i++) {
		snprintf(out[i].name, sizeof(out[i].name), "%s", st[i].name);
		out[i].value = st[i].value;
	}
	return CLIENT_STATS;
}

static void fill(kvs_client *c, const kvs_msg *rep, kvs_result *res, kvs_admin_info *admin)
{
	static _Thread_local kvs_job_info_out jobs[KVS_MAX_JOBS_QUERY];
	static _Thread_local kvs_stat_out stats[KVS_MAX_COUNTERS + CLIENT_STATS];
	res->session = rep->session;
	res->registration = rep->registration;
	res->imported = rep->imported;
	res->aliased = rep->aliased;
	res->pending_jobs = rep->pending_jobs;
	res->hits = rep->hits;
	res->tiers = rep->tiers;
	res->state = rep->state;
	uint32_t n = rep->n_job_infos < KVS_MAX_JOBS_QUERY ? rep->n_job_infos : KVS_MAX_JOBS_QUERY;
	for (uint32_t i = 0; i < n; i++) {
		jobs[i].job = rep->job_infos[i].job;
		jobs[i].state = rep->job_infos[i].state;
		jobs[i].ranks_done = rep->job_infos[i].ranks_done;
		kvs_str_copy(jobs[i].reason, sizeof(jobs[i].reason), rep->job_infos[i].reason);
	}
	res->jobs = jobs;
	res->n_jobs = n;
	n = rep->n_counters < KVS_MAX_COUNTERS ? rep->n_counters : KVS_MAX_COUNTERS;
	for (uint32_t i = 0; i < n; i++) {
		kvs_str_copy(stats[i].name, sizeof(stats[i].name), rep->counters[i].name);
		stats[i].value = rep->counters[i].value;
	}
	if (rep->op == KVS_OP_STATS)
		n += client_stats(c, stats + n);
	res->stats = stats;
	res->n_stats = n;
	if (rep->op == KVS_OP_ADMIN) {
		*admin = (kvs_admin_info){.cmd = rep->admin_cmd, .draining = rep->draining,
					  .drained = rep->drained, .jobs_open = rep->jobs_open,
					  .waited_ms = rep->waited_ms, .cleared_l1 = rep->cleared_l1,
					  .cleared_l2 = rep->cleared_l2, .kept_l1 = rep->kept_l1};
		res->admin = admin;
	}
}

static void deliver(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	if (r->done) {
		kvs_result res = {.code = code, .msg = ""};
		kvs_admin_info admin = {0};
		char msgbuf[KVS_MAX_ERRMSG + 1];
		if (rep && !rep->ok) {
			kvs_str_copy(msgbuf, sizeof(msgbuf), rep->errmsg);
			res.msg = msgbuf;
		} else if (rep) {
			fill(c, rep, &res, &admin);
		}
		r->done(&res, r->arg);
	}
}

void kvs__finish(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	if (r->internal)
		r->internal(c, r, rep, code);
	else
		deliver(c, r, rep, code);
	kvs__req_free(r);
}

/* The reply to a store that carried its complete (kvs_store_complete_async):
 * a terminal state is the job's end, which kvs_job_wait and the event
 * callback learn as from job_done; "open" comes from a server that ignored
 * the field, so the rank's complete is sent now. Then the caller's done. */
void kvs__store_completed(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	if (!code && rep && rep->ok) {
		if (rep->state == KVS_JOB_COMMITTED || rep->state == KVS_JOB_ABORTED) {
			kvs__job_done_push(c, rep);
		} else {
			kvs_msg m = {.op = KVS_OP_COMPLETE, .session = atomic_load(&c->session), .job = rep->job,
				     .status = KVS_STATUS_OK};
			(void)kvs__submit(c, &m, 0, NULL, NULL, NULL, NULL);
		}
	}
	deliver(c, r, rep, code);
}
