/* Parts waiting for their producer event, for the L1 slices they touch
 * to be pinned, or for the pin threads to leave the driver; see
 * copy_cuda_impl.h. One poller
 * thread queries every waiting event (cuEventQuery, which never blocks)
 * about every 50 us while any waits, and sleeps on a condition variable
 * otherwise; a fired event, a failed query or a passed deadline posts the
 * wait to the completion queue, and the loop resubmits or fails the part. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "cuda"
#include "copy_cuda_impl.h"
#include "kvs_error.h"
#include "kvs_log.h"
#include "kvs_time.h"

typedef struct pwait {
	kvs_cq_item cq;        /* first: posted when the wait ended */
	kvs_cuda_engine *e;
	kvs_cuda_stream *s;    /* the registration's stream: leased by the part */
	kvs_copy_part part;    /* tasks owned (copied array); event cleared, or &held */
	CUevent ev;
	CUipcEventHandle held; /* W_GATE: the part's producer event, not yet checked (the
				* request that carried it is gone by the resubmission) */
	int dev;
	uint64_t deadline_ms;  /* 0: none */
	enum { W_EVENT, W_PINS, W_GATE } what; /* ev fired; slices pinned; gate free */
	int result;            /* 0 fired; KVS_E_TIMEOUT; KVS_E_DEVICE */
	struct pwait *next;
} pwait;

static void wait_done(kvs_cq_item *it)
{
	pwait *w = (pwait *)it;
	kvs_cuda_engine *e = w->e;
	bool g = w->ev ? gate_enter(e) : false;
	if (w->ev && use(e, w->dev) == 0)
		CU(e, cuEventDestroy)(w->ev);
	gate_leave(e, g);
	if (w->what == W_GATE) /* no longer held back: its submission counts it again */
		atomic_fetch_sub(&e->parts_inflight, 1);
	if (w->result == 0) {
		kvs_cuda_submit(e, w->s, &w->part);
	} else {
		if (w->result == KVS_E_TIMEOUT)
			kvs_warn(w->what == W_PINS   ? "the L1 slices of a part were not pinned before its deadline: the part fails"
				 : w->what == W_GATE ? "L1's pinning held the driver past a part's deadline: the part fails"
						     : "a store's producer event did not fire before its deadline: the part fails");
		e->st.errors++;
		for (uint32_t i = 0; i < w->part.n_tasks; i++) {
			w->part.tasks[i]->result = w->result;
			w->part.tasks[i]->cq.done(&w->part.tasks[i]->cq);
		}
	}
	free(w->part.tasks);
	free(w);
}

static void *wait_main(void *arg)
{
	kvs_cuda_engine *e = arg;
	pthread_mutex_lock(&e->wait_mu);
	for (;;) {
		while (!e->waits && !e->wait_stop)
			pthread_cond_wait(&e->wait_cv, &e->wait_mu);
		if (!e->waits)
			break;
		uint64_t now = kvs_now_ms();
		for (pwait **pp = &e->waits; *pp;) {
			pwait *w = *pp;
			int res = 1; /* still waiting */
			if (e->wait_quiesce) {
				res = KVS_E_TIMEOUT;
			} else if (w->what == W_PINS) {
				if (cuda_part_pinned(e, &w->part, false))
					res = 0;
				else if (w->deadline_ms && now >= w->deadline_ms)
					res = KVS_E_TIMEOUT;
			} else if (w->what == W_GATE) {
				/* free now: no pin thread is in the driver, and none
				 * starts a slice while the part counts as in flight */
				bool g;
				if (gate_try(e, &g)) {
					gate_leave(e, g);
					res = 0;
				} else if (w->deadline_ms && now >= w->deadline_ms) {
					res = KVS_E_TIMEOUT;
				}
			} else if (use(e, w->dev) != 0) {
				res = KVS_E_DEVICE;
			} else {
				CUresult r = CU(e, cuEventQuery)(w->ev);
				if (r == CUDA_SUCCESS)
					res = 0;
				else if (r != CUDA_ERROR_NOT_READY)
					res = KVS_E_DEVICE;
				else if (w->deadline_ms && now >= w->deadline_ms)
					res = KVS_E_TIMEOUT;
			}
			if (res == 1) {
				pp = &w->next;
				continue;
			}
			*pp = w->next;
			w->result = res;
			kvs_cq_post(e->cq, &w->cq);
		}
		if (e->waits) {
			pthread_mutex_unlock(&e->wait_mu);
			usleep(50);
			pthread_mutex_lock(&e->wait_mu);
		}
	}
	pthread_mutex_unlock(&e->wait_mu);
	return NULL;
}

void cuda_wait_init(kvs_cuda_engine *e)
{
	pthread_mutex_init(&e->wait_mu, NULL);
	pthread_cond_init(&e->wait_cv, NULL);
}

static void wait_add(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part, CUevent ev, int result,
		     int what);

void cuda_wait_producer(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part, CUevent ev, int result)
{
	wait_add(e, s, part, ev, result, W_EVENT);
}

void cuda_wait_pinned(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part)
{
	wait_add(e, s, part, 0, 0, W_PINS);
}

void cuda_wait_gate(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part)
{
	atomic_fetch_add(&e->parts_inflight, 1); /* wait_done takes it back */
	atomic_store(&e->copy_active_ns, kvs_now_ns());
	wait_add(e, s, part, 0, 0, W_GATE);
}

static void wait_add(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part, CUevent ev, int result,
		     int what)
{
	pwait *w = calloc(1, sizeof(*w));
	kvs_copy_task **own = calloc(part->n_tasks ? part->n_tasks : 1, sizeof(*own));
	if (!w || !own) {
		free(w);
		free(own);
		if (ev)
			CU(e, cuEventDestroy)(ev);
		if (what == W_GATE)
			atomic_fetch_sub(&e->parts_inflight, 1);
		/* no memory to wait: the part fails (asynchronously would need the
		 * memory we lack; the tasks' done runs on the loop right away) */
		for (uint32_t i = 0; i < part->n_tasks; i++) {
			part->tasks[i]->result = KVS_E_INTERNAL;
			part->tasks[i]->cq.done(&part->tasks[i]->cq);
		}
		return;
	}
	memcpy(own, part->tasks, part->n_tasks * sizeof(*own));
	*w = (pwait){.cq.done = wait_done, .e = e, .s = s, .part = *part, .ev = ev, .dev = kvs_cuda_stream_device(s),
		     .deadline_ms = part->deadline_ms, .result = result, .what = what};
	w->part.tasks = own;
	if (what == W_GATE && part->event && part->event_len == sizeof(w->held)) {
		memcpy(&w->held, part->event, sizeof(w->held));
		w->part.event = &w->held;
	} else { /* checked already, or owned as ev */
		w->part.event = NULL;
		w->part.event_len = 0;
	}
	if (result) { /* already failed (the event could not be opened) */
		kvs_cq_post(e->cq, &w->cq);
		return;
	}
	pthread_mutex_lock(&e->wait_mu);
	if (!e->wait_started && pthread_create(&e->wait_thr, NULL, wait_main, e) == 0)
		e->wait_started = true;
	if (!e->wait_started) {
		pthread_mutex_unlock(&e->wait_mu);
		w->result = KVS_E_INTERNAL;
		kvs_cq_post(e->cq, &w->cq);
		return;
	}
	w->next = e->waits;
	e->waits = w;
	pthread_cond_signal(&e->wait_cv);
	pthread_mutex_unlock(&e->wait_mu);
}

void kvs_cuda_engine_quiesce(kvs_cuda_engine *e)
{
	if (!e)
		return;
	pthread_mutex_lock(&e->wait_mu);
	e->wait_quiesce = true;
	pthread_mutex_unlock(&e->wait_mu);
}

void cuda_wait_fini(kvs_cuda_engine *e)
{
	pthread_mutex_lock(&e->wait_mu);
	e->wait_stop = true;
	e->wait_quiesce = true;
	pthread_cond_signal(&e->wait_cv);
	pthread_mutex_unlock(&e->wait_mu);
	if (e->wait_started)
		pthread_join(e->wait_thr, NULL);
	pthread_cond_destroy(&e->wait_cv);
	pthread_mutex_destroy(&e->wait_mu);
}
