/* libkvside's I/O thread: it owns the DEALER socket and the pending table,
 * drains the submit queue, matches replies to requests, times requests out,
 * sends heartbeats and runs the restart (epoch) state machine. It never
 * blocks on anything but its poll: broker pushes are a state machine of their
 * own (client_broker.c) driven from the same loop. */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "libkvside"
#include "client_int.h"
#include "kvs_log.h"
#include "kvs_time.h"
#include "kvs_trace.h"
#include "kvs_zfd.h"

/* ---- submission (any thread) ----------------------------------------------- */

void kvs__wake(kvs_client *c)
{
	uint64_t one = 1;
	ssize_t w = write(c->efd, &one, sizeof(one));
	(void)w;
}

int kvs__timeout_of(kvs_client *c, int t) { return t > 0 ? t : c->timeout_ms; }

int kvs__req_new(kvs_client *c, kvs_msg *msg, int timeout_ms, kvs__req **ret)
{
	kvs__req *r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	msg->id = atomic_fetch_add(&c->next_id, 1);
	int e = kvs_proto_encode(msg, &r->buf, &r->len);
	if (e) {
		free(r);
		return e == -ENOMEM ? -ENOMEM : KVS_E_LIMIT;
	}
	if (r->len > KVS_MAX_MSG_BYTES) {
		free(r->buf);
		free(r);
		return KVS_E_LIMIT;
	}
	r->id = msg->id;
	r->op = msg->op;
	r->deadline_ms = kvs_now_ms() + (uint64_t)kvs__timeout_of(c, timeout_ms);
	*ret = r;
	return 0;
}

void kvs__req_free(kvs__req *r)
{
	if (!r)
		return;
	kvs__push_free(r->push);
	free(r->buf);
	free(r);
}

int kvs__req_submit(kvs_client *c, kvs__req *r)
{
	if (kvs__forked(c)) {
		kvs__req_free(r);
		return KVS_E_SESSION;
	}
	pthread_mutex_lock(&c->mu);
	if (c->stop) {
		pthread_mutex_unlock(&c->mu);
		kvs__req_free(r);
		return -ECANCELED;
	}
	r->next = NULL;
	if (!c->q_head && !c->draining) {
		/* the lane: written from this thread, nothing to hand over (nor
		 * ahead of it: the queue is empty and not being routed) */
		int d = kvs__lane_direct(c, r);
		if (d != 0) {
			pthread_mutex_unlock(&c->mu);
			if (d < 0)
				kvs__req_free(r);
			else if (d == 2)
				kvs__wake(c);
			return d < 0 ? d : 0;
		}
	}
	if (c->q_tail)
		c->q_tail->next = r;
	else
		c->q_head = r;
	c->q_tail = r;
	pthread_mutex_unlock(&c->mu);
	kvs__wake(c);
	return 0;
}

int kvs__submit(kvs_client *c, kvs_msg *msg, int timeout_ms, kvs_done_fn done, void *arg,
		kvs__internal_fn internal, void *iarg)
{
	kvs__req *r;
	int e = kvs__req_new(c, msg, timeout_ms, &r);
	if (e)
		return e;
	r->done = done;
	r->arg = arg;
	r->internal = internal;
	r->iarg = iarg;
	KVS_TRACE(KVS_TP_APP_SUBMIT, msg->op);
	return kvs__req_submit(c, r);
}

/* ---- sending (I/O thread) ---------------------------------------------------- */

void kvs__send(kvs_client *c, kvs__req *r)
{
	r->next = NULL;
	if (kvs_htab_put(c->pending, r) < 0) {
		kvs__finish(c, r, NULL, -ENOMEM);
	} else if (kvs__lane_send(c, r)) {
		/* written on the lane (or failed there and finished) */
	} else if ((c->dealer_check = true, zmq_send(c->dealer, r->buf, r->len, ZMQ_DONTWAIT) < 0)) {
		int e = errno;
		kvs_htab_del(c->pending, &r->id);
		kvs__finish(c, r, NULL, e == EAGAIN ? KVS_E_BUSY : KVS_E_INTERNAL);
	} else {
		KVS_TRACE(KVS_TP_IO_SEND, r->op);
		free(r->buf);
		r->buf = NULL;
	}
}

static void hold(kvs_client *c, kvs__req *r)
{
	r->next = NULL;
	if (c->held_tail)
		c->held_tail->next = r;
	else
		c->held_head = r;
	c->held_tail = r;
}

/* Requests leave in the order queued. During a restore the application's
 * requests wait until every registration is back (a store must not overtake
 * the `register` it needs); the restore's own requests and heartbeats go. */
static void route(kvs_client *c, kvs__req *r)
{
	if (c->exiting)
		kvs__finish(c, r, NULL, -ECANCELED);
	else if ((c->reopen == KVS__REOPEN_RESTORE || c->lane.state == KVS__LANE_ATTACHING) && !r->internal)
		hold(c, r); /* the lane's attach: the switch of paths must not reorder */
	else if (r->push)
		kvs__broker_add(c, r);
	else
		kvs__send(c, r);
}

static void drain_queue(kvs_client *c)
{
	pthread_mutex_lock(&c->mu);
	kvs__req *r = c->q_head;
	c->q_head = c->q_tail = NULL;
	/* until these are routed, an application thread must not write to the
	 * lane ahead of them: it queues behind them instead */
	c->draining = r != NULL;
	pthread_mutex_unlock(&c->mu);
	if (!r)
		return;
	while (r) {
		kvs__req *next = r->next;
		route(c, r);
		r = next;
	}
	pthread_mutex_lock(&c->mu);
	c->draining = false;
	pthread_mutex_unlock(&c->mu);
}

void kvs__release_held(kvs_client *c)
{
	kvs__req *r = c->held_head;
	c->held_head = c->held_tail = NULL;
	while (r) {
		kvs__req *next = r->next;
		route(c, r);
		r = next;
	}
}

static void emit(kvs_client *c, kvs_event *ev)
{
	ev->session = atomic_load(&c->session);
	if (c->on_event)
		c->on_event(ev, c->event_arg);
}

/* ---- restart handling ---------------------------------------------------------- */

void kvs__restore_step_done(kvs_client *c, int code)
{
	if (code && !c->restore_err)
		c->restore_err = code;
	if (--c->restore_left > 0)
		return;
	c->reopen = KVS__REOPEN_NONE;
	atomic_fetch_add(&c->reconnects, 1);
	kvs_info("session %016llx re-opened after server restart/expiry (%s)",
		 (unsigned long long)atomic_load(&c->session),
		 c->restore_err ? kvs_strerror(c->restore_err) : "registrations restored");
	kvs_event ev = {.type = KVS_EVENT_RECONNECTED, .error = c->restore_err};
	emit(c, &ev);
	kvs__release_held(c);
	kvs__lane_update(c);
}

static void on_rehello(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	(void)r;
	if (code) {
		/* server still away or refusing: try again at the next heartbeat */
		c->reopen = KVS__REOPEN_NONE;
		c->have_epoch = false;
		if (code != -ECANCELED) /* closing: not worth a warning */
			kvs_warn("re-opening session failed: %s", kvs_strerror(code));
		return;
	}
	atomic_store(&c->session, rep->session);
	memcpy(c->epoch, rep->epoch, KVS_EPOCH_BYTES);
	c->have_epoch = true;
	c->hb_ms = rep->heartbeat_ms ? rep->heartbeat_ms : 1000;
	atomic_store(&c->packed_blocks, rep->packed_blocks);
	/* the registers (and their broker pushes) run from the poll loop while
	 * heartbeats of the new session go on */
	c->reopen = KVS__REOPEN_RESTORE;
	c->restore_left = 1; /* held until every register is queued */
	c->restore_err = 0;
	kvs__restore(c);
	if (kvs__lane_start(c, true)) /* after the registers: the broker queue is FIFO */
		c->restore_left++;
	kvs__restore_step_done(c, 0);
}

/* A re-open: requests that went over the lane are lost with it (a server
 * that restarted never read them, or read them for a session that is gone):
 * they fail with KVS_E_SESSION now, as requests a new server answers do,
 * rather than at their timeout. Collected first: a completion may submit. */
static void fail_lane_requests(kvs_client *c)
{
	kvs__lane_adopt(c);
	kvs__req *lost = NULL;
	size_t pos = 0;
	kvs__req *r;
	while ((r = kvs_htab_next(c->pending, &pos)) != NULL) {
		if (!r->on_lane)
			continue;
		kvs_htab_iter_del(c->pending, &pos);
		r->next = lost;
		lost = r;
	}
	while (lost) {
		kvs__req *next = lost->next;
		kvs__finish(c, lost, NULL, KVS_E_SESSION);
		lost = next;
	}
}

static void start_reopen(kvs_client *c, const char *why)
{
	/* a heartbeat answered E_SESSION after our own bye is no restart */
	if (c->reopen != KVS__REOPEN_NONE || atomic_load(&c->closing))
		return;
	kvs_info("server %s: re-opening session", why);
	kvs__lane_close(c, "the session is re-opened");
	c->reopen = KVS__REOPEN_HELLO;
	kvs__lane_update(c);
	fail_lane_requests(c);
	kvs_msg m = {.op = KVS_OP_HELLO, .engine = kvs_str_c(c->engine), .role = (uint8_t)c->role,
		     .rank = c->rank, .world = c->world, .ns = kvs_str_c(c->ns)};
	if (kvs__submit(c, &m, 0, NULL, NULL, on_rehello, NULL) != 0)
		c->reopen = KVS__REOPEN_NONE;
}

static void on_heartbeat(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	(void)rep;
	c->hb_inflight = false;
	/* stale heartbeats queued while the server was away name an old session */
	if (code == KVS_E_SESSION && (uint64_t)(uintptr_t)r->iarg == atomic_load(&c->session))
		start_reopen(c, "no longer knows our session");
}

/* ---- replies --------------------------------------------------------------------- */

void kvs__job_done_push(kvs_client *c, const kvs_msg *rep)
{
	char reason[KVS_MAX_STR + 1];
	kvs_str_copy(reason, sizeof(reason), rep->reason);
	pthread_mutex_lock(&c->mu);
	c->ring[c->ring_n % KVS__JOB_RING].job = rep->job;
	c->ring[c->ring_n % KVS__JOB_RING].state = rep->state;
	__atomic_store_n(&c->ring_n, c->ring_n + 1, __ATOMIC_RELEASE); /* kvs_job_wait's spin reads it unlocked */
	pthread_cond_broadcast(&c->job_cv);
	pthread_mutex_unlock(&c->mu);
	kvs_event ev = {.type = KVS_EVENT_JOB_DONE, .job = rep->job, .state = rep->state,
			.reason = reason};
	emit(c, &ev);
}

void kvs__handle_reply(kvs_client *c, const void *data, size_t len)
{
	kvs_msg rep;
	kvs_proto_err perr;
	int r = kvs_proto_decode(data, len, true, &rep, &perr);
	if (r) {
		kvs_warn("undecodable reply (%s): %s", kvs_error_name(r), perr.msg);
		if (perr.id) {
			kvs__req *q = kvs_htab_del(c->pending, &perr.id);
			if (q)
				kvs__finish(c, q, NULL, KVS_E_BADMSG);
		}
		return;
	}
	bool new_epoch = c->have_epoch && memcmp(rep.epoch, c->epoch, KVS_EPOCH_BYTES) != 0;
	if (rep.op == KVS_OP_JOB_DONE && rep.id == 0) {
		KVS_TRACE(KVS_TP_IO_RECV, 0);
		kvs__job_done_push(c, &rep);
		KVS_TRACE(KVS_TP_IO_JOB_DONE, 0);
	} else {
		kvs__req *q = kvs_htab_del(c->pending, &rep.id);
		if (!q && kvs__lane_adopt(c)) /* written on the lane since we last looked */
			q = kvs_htab_del(c->pending, &rep.id);
		if (q) {
			bool first_hello = false;
			KVS_TRACE(KVS_TP_IO_RECV, q->op);
			if (q->op == KVS_OP_HELLO && rep.ok && !c->have_epoch) {
				memcpy(c->epoch, rep.epoch, KVS_EPOCH_BYTES);
				c->have_epoch = true;
				new_epoch = false;
				c->hb_ms = rep.heartbeat_ms ? rep.heartbeat_ms : 1000;
				atomic_store(&c->packed_blocks, rep.packed_blocks);
				atomic_store(&c->session, rep.session);
				c->next_hb_ms = kvs_now_ms(); /* heartbeats start right away */
				first_hello = true;
			}
			int code = rep.ok ? 0 : rep.code;
			if (new_epoch && !q->internal && code == 0)
				code = KVS_E_SESSION; /* answered by a server that forgot us */
			if (first_hello && code == 0)
				kvs__lane_start(c, false); /* before kvs_client_open learns of the hello */
			kvs__finish(c, q, &rep, code);
		}
	}
	/* re-check: the reply may itself have completed a re-open */
	if (c->have_epoch && memcmp(rep.epoch, c->epoch, KVS_EPOCH_BYTES) != 0 &&
	    c->reopen == KVS__REOPEN_NONE)
		start_reopen(c, "restarted (new epoch)");
	kvs_msg_clear(&rep);
}

static void receive(kvs_client *c)
{
	for (int i = 0; i < 1024; i++) {
		zmq_msg_t m;
		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, c->dealer, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&m);
			break;
		}
		if (!zmq_msg_more(&m))
			kvs__handle_reply(c, zmq_msg_data(&m), zmq_msg_size(&m));
		else
			while (zmq_msg_more(&m) && zmq_msg_recv(&m, c->dealer, 0) >= 0)
				; /* multi-frame replies are not ours: drop */
		zmq_msg_close(&m);
	}
}

/* ---- timers ------------------------------------------------------------------------ */

static void expire_list(kvs_client *c, kvs__req **head, kvs__req **tail, uint64_t now)
{
	kvs__req *keep = NULL, **kp = &keep, *last = NULL;
	kvs__req *r = *head;
	while (r) {
		kvs__req *next = r->next;
		if (r->deadline_ms <= now) {
			kvs__finish(c, r, NULL, KVS_E_TIMEOUT);
		} else {
			r->next = NULL;
			*kp = last = r;
			kp = &r->next;
		}
		r = next;
	}
	*head = keep;
	*tail = last;
}

static void expire(kvs_client *c, uint64_t now)
{
	size_t pos = 0;
	kvs__req *r;
	while ((r = kvs_htab_next(c->pending, &pos)) != NULL) {
		if (r->deadline_ms > now)
			continue;
		kvs_htab_iter_del(c->pending, &pos);
		kvs__finish(c, r, NULL, KVS_E_TIMEOUT);
	}
	expire_list(c, &c->held_head, &c->held_tail, now);
}

static void heartbeat(kvs_client *c, uint64_t now)
{
	if (!c->next_hb_ms || now < c->next_hb_ms || !atomic_load(&c->session) ||
	    atomic_load(&c->closing))
		return;
	/* how late the loop got here: what a stall of this thread costs the
	 * session's lease (kvs_stats: client_heartbeat_delay_max_us) */
	uint64_t now_us = kvs_now_ns() / 1000, due_us = c->next_hb_ms * 1000;
	if (now_us > due_us && now_us - due_us > c->cst.hb_delay_max_us)
		c->cst.hb_delay_max_us = now_us - due_us;
	c->next_hb_ms = now + (c->hb_ms ? c->hb_ms : 1000);
	if (c->reopen == KVS__REOPEN_HELLO)
		return;
	if (!c->have_epoch) { /* an earlier re-open failed: try again */
		start_reopen(c, "unreachable earlier");
		return;
	}
	if (c->hb_inflight)
		return;
	kvs_msg m = {.op = KVS_OP_HEARTBEAT, .session = atomic_load(&c->session)};
	/* the reply must come within one ttl-ish window; ttl >= 2 heartbeats */
	if (kvs__submit(c, &m, (int)(c->hb_ms ? 2 * c->hb_ms : 2000), NULL, NULL, on_heartbeat,
			(void *)(uintptr_t)m.session) == 0) {
		c->hb_inflight = true;
		c->cst.heartbeats++;
	}
}

/* ---- the loop ------------------------------------------------------------------------ */

static long poll_timeout(kvs_client *c, uint64_t now)
{
	long to = 50;
	if (c->next_hb_ms > now && (long)(c->next_hb_ms - now) < to)
		to = (long)(c->next_hb_ms - now);
	long b = kvs__broker_wait_ms(c, now);
	if (b >= 0 && b < to)
		to = b;
	return to;
}

/* At exit: fails everything left with -ECANCELED. A completion may release
 * more (a restore that ends routes the held requests), hence the repeat. */
static void fail_all(kvs_client *c)
{
	c->exiting = true;
	kvs__lane_adopt(c);
	for (;;) {
		kvs__broker_cancel(c, -ECANCELED);
		kvs__req *r = c->held_head;
		c->held_head = c->held_tail = NULL;
		while (r) {
			kvs__req *next = r->next;
			kvs__finish(c, r, NULL, -ECANCELED);
			r = next;
		}
		size_t pos = 0;
		while ((r = kvs_htab_next(c->pending, &pos)) != NULL) {
			kvs_htab_iter_del(c->pending, &pos);
			kvs__finish(c, r, NULL, -ECANCELED);
		}
		if (!c->broker.head && !c->held_head && kvs_htab_count(c->pending) == 0)
			break;
	}
}

/* The lane and the broker connection speak zmq_poll's event bits (their
 * modules predate the plain poll); poll(2)'s are translated at the call. */
static short to_poll(short zev)
{
	return (short)(((zev & ZMQ_POLLIN) ? POLLIN : 0) | ((zev & ZMQ_POLLOUT) ? POLLOUT : 0));
}

static short from_poll(short rev)
{
	return (short)(((rev & POLLIN) ? ZMQ_POLLIN : 0) | ((rev & POLLOUT) ? ZMQ_POLLOUT : 0) |
		       ((rev & ~(POLLIN | POLLOUT | POLLPRI)) ? ZMQ_POLLERR : 0));
}

void *kvs__io_main(void *arg)
{
	kvs_client *c = arg;
	for (;;) {
		pthread_mutex_lock(&c->mu);
		bool stop = c->stop && !c->q_head;
		pthread_mutex_unlock(&c->mu);
		if (stop)
			break;
		struct pollfd it[4] = {{.fd = c->dealer_fd, .events = POLLIN}, {.fd = c->efd, .events = POLLIN}};
		int n = 2, bi = -1, li = -1;
		short bev = kvs__broker_events(c);
		if (bev)
			it[bi = n++] = (struct pollfd){.fd = c->broker.fd, .events = to_poll(bev)};
		short lev = kvs__lane_events(c);
		if (lev)
			it[li = n++] = (struct pollfd){.fd = c->lane.fd, .events = to_poll(lev)};
		long to = poll_timeout(c, kvs_now_ms());
		uint64_t now_ns = kvs_now_ns();
		if (c->busy_poll_ns && now_ns - c->last_io_ns < c->busy_poll_ns)
			to = 0; /* busy poll (KVS_BUSY_POLL_US) */
		if (now_ns < atomic_load(&c->io_spin_until_ns))
			to = 0; /* a job_wait expects its job's end about now (hybrid polling) */
		bool dready = false;
		if (c->dealer_check) { /* the thread used the dealer since it last asked */
			c->dealer_check = false;
			if ((dready = kvs_zmq_readable(c->dealer)))
				to = 0;
		}
		int pr = poll(it, (nfds_t)n, (int)to);
		if (!dready && pr > 0 && (it[0].revents & (POLLIN | POLLERR | POLLHUP)))
			dready = kvs_zmq_readable(c->dealer);
		if ((pr > 0 || dready) && c->busy_poll_ns)
			c->last_io_ns = kvs_now_ns();
		if (it[1].revents & POLLIN) {
			uint64_t v;
			ssize_t rd = read(c->efd, &v, sizeof(v));
			(void)rd;
		}
		drain_queue(c);
		kvs__lane_adopt(c);
		if (dready) {
			receive(c);
			c->dealer_check = true; /* it may have left replies (its budget) */
		}
		if (li >= 0)
			kvs__lane_run(c, from_poll(it[li].revents));
		drain_queue(c); /* internal requests queued by handlers */
		uint64_t now = kvs_now_ms();
		kvs__broker_run(c, now, bi >= 0 ? from_poll(it[bi].revents) : 0);
		now = kvs_now_ms();
		expire(c, now);
		heartbeat(c, now);
	}
	fail_all(c);
	return NULL;
}
