/* Operator commands behind `kvside-ctl` (see admin.h for the semantics).
 * Drain requests that must wait are kept on a short list and answered from
 * the tick: the loop never blocks on them. */
#include "admin.h"
#include "auth.h"

#include <stdlib.h>

#define KVS_LOG_COMPONENT "admin"
#include "events.h"
#include "jobs.h"
#include "reply.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_log.h"

#define MAX_WAITS 64

/* A drain request waiting for open jobs to finish. */
typedef struct kvs_admin_wait {
	struct kvs_admin_wait *next;
	uint64_t session, id;
	uint64_t start_ms, deadline_ms;
} kvs_admin_wait;

static uint64_t jobs_open(kvs_server *srv) { return kvs_jobs_open(srv->jobs); }

static void reply(kvs_server *srv, uint64_t session, uint64_t id, uint8_t cmd, kvs_msg *rep)
{
	rep->op = KVS_OP_ADMIN;
	rep->id = id;
	rep->ok = true;
	rep->admin_cmd = cmd;
	rep->draining = srv->draining;
	rep->jobs_open = jobs_open(srv);
	kvs__send_to_session(srv, session, rep);
}

static void answer_drain(kvs_server *srv, kvs_admin_wait *w)
{
	kvs_msg rep = {.drained = jobs_open(srv) == 0, .waited_ms = srv->now_ms - w->start_ms};
	kvs_info("drain: %s after %llu ms (%llu jobs open)", rep.drained ? "drained" : "timed out",
		 (unsigned long long)rep.waited_ms, (unsigned long long)jobs_open(srv));
	reply(srv, w->session, w->id, KVS_ADMIN_DRAIN, &rep);
}

static int do_clear(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	uint64_t open = jobs_open(srv);
	if (open)
		return kvs__fail(srv, KVS_E_BUSY, "clear refused: %llu jobs open (drain first)",
				 (unsigned long long)open);
	kvs_l2_stats l2 = {0};
	if (srv->l2) {
		kvs_l2_get_stats(srv->l2, &l2);
		if (l2.queue_depth)
			return kvs__fail(srv, KVS_E_BUSY,
					 "clear refused: %llu L2 writes still queued (retry shortly)",
					 (unsigned long long)l2.queue_depth);
	}
	kvs_l1_stats before, after;
	kvs_l1_get_stats(srv->l1, &before);
	kvs_l1_clear(srv->l1);
	kvs_l1_get_stats(srv->l1, &after);
	if (srv->l2) {
		int r = kvs_l2_clear(srv->l2);
		if (r < 0)
			return kvs__fail(srv, KVS_E_INTERNAL, "L1 cleared; clearing L2 failed: %s",
					 kvs_strerror(r));
	}
	kvs_events_cleared(srv->events);
	kvs_msg rep = {.cleared_l1 = before.objects - after.objects, .cleared_l2 = l2.objects,
		       .kept_l1 = after.objects};
	kvs_info("clear: %llu L1 objects dropped (%llu kept: pinned), %llu L2 objects dropped",
		 (unsigned long long)rep.cleared_l1, (unsigned long long)rep.kept_l1,
		 (unsigned long long)rep.cleared_l2);
	reply(srv, s->id, rq->id, KVS_ADMIN_CLEAR, &rep);
	return 0;
}

int kvs__op_admin(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	/* operators: the server's own UID over ipc, or an admin key on tcp */
	if (srv->peer != KVS_PEER_OWNER && srv->peer != KVS_PEER_ADMIN_KEY)
		return kvs__fail(srv, KVS_E_AUTH, "admin commands need the server's UID over ipc or a CURVE key "
				 "listed with `admin` in authorized-keys");
	kvs_msg rep = {0};
	switch (rq->admin_cmd) {
	case KVS_ADMIN_STATUS:
		break;
	case KVS_ADMIN_DRAIN: {
		if (!srv->draining) {
			srv->draining = true;
			srv->drain_since_ms = srv->now_ms;
			kvs_info("draining: new jobs are refused (%llu open)",
				 (unsigned long long)jobs_open(srv));
		}
		kvs_admin_wait w = {.session = s->id, .id = rq->id, .start_ms = srv->now_ms,
				    .deadline_ms = srv->now_ms + rq->wait_ms};
		if (jobs_open(srv) == 0 || rq->wait_ms == 0) {
			answer_drain(srv, &w);
			return 0;
		}
		uint32_t n = 0;
		for (kvs_admin_wait *p = srv->admin_waits; p; p = p->next)
			n++;
		if (n >= MAX_WAITS)
			return kvs__fail(srv, KVS_E_BUSY, "too many drain requests waiting");
		kvs_admin_wait *p = malloc(sizeof(*p));
		if (!p)
			return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
		*p = w;
		p->next = srv->admin_waits;
		srv->admin_waits = p;
		return 0; /* answered by kvs__admin_tick */
	}
	case KVS_ADMIN_RESUME:
		if (srv->draining)
			kvs_info("resumed after draining for %llu ms",
				 (unsigned long long)(srv->now_ms - srv->drain_since_ms));
		srv->draining = false;
		break;
	case KVS_ADMIN_CLEAR:
		return do_clear(srv, s, rq);
	default:
		return kvs__fail(srv, KVS_E_BADMSG, "unknown admin command");
	}
	reply(srv, s->id, rq->id, rq->admin_cmd, &rep);
	return 0;
}

int kvs__admin_gate(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	if (!srv->draining || (rq->op != KVS_OP_STORE && rq->op != KVS_OP_RETRIEVE))
		return 0;
	if (kvs_jobs_known(srv->jobs, s->engine, rq->job))
		return 0;
	return kvs__fail(srv, KVS_E_BUSY,
			 "server is draining: new jobs are refused (job %llu not started; "
			 "kvside-ctl resume re-opens)", (unsigned long long)rq->job);
}

void kvs__admin_tick(kvs_server *srv)
{
	kvs_admin_wait **pp = &srv->admin_waits;
	bool idle = jobs_open(srv) == 0;
	while (*pp) {
		kvs_admin_wait *w = *pp;
		if (idle || srv->now_ms >= w->deadline_ms || !srv->draining) {
			*pp = w->next;
			answer_drain(srv, w);
			free(w);
		} else {
			pp = &w->next;
		}
	}
}

void kvs__admin_fini(kvs_server *srv)
{
	while (srv->admin_waits) {
		kvs_admin_wait *w = srv->admin_waits;
		srv->admin_waits = w->next;
		free(w);
	}
}
