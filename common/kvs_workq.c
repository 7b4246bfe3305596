/* The work queue; see kvs_workq.h. */
#include "kvs_workq.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

struct kvs_workq {
	kvs_cq *cq;
	pthread_mutex_t mu;
	pthread_cond_t cv;      /* work queued, or stop */
	pthread_cond_t idle_cv; /* `done` advanced */
	kvs_workq_item *head, *tail; /* FIFO; guarded by mu */
	uint64_t submitted, done;    /* guarded by mu; done <= submitted */
	bool stop;
	pthread_t thr;
};

static void *workq_main(void *arg)
{
	kvs_workq *q = arg;
	pthread_mutex_lock(&q->mu);
	for (;;) {
		while (!q->head && !q->stop)
			pthread_cond_wait(&q->cv, &q->mu);
		kvs_workq_item *it = q->head;
		if (!it)
			break; /* stop, and nothing left */
		q->head = it->next;
		if (!q->head)
			q->tail = NULL;
		it->next = NULL;
		pthread_mutex_unlock(&q->mu);
		/* read before work: a fire-and-forget item frees itself */
		bool post = it->cq.done != NULL;
		it->work(it);
		if (post)
			kvs_cq_post(q->cq, &it->cq);
		pthread_mutex_lock(&q->mu);
		q->done++;
		pthread_cond_broadcast(&q->idle_cv);
	}
	pthread_mutex_unlock(&q->mu);
	return NULL;
}

int kvs_workq_create(kvs_cq *cq, kvs_workq **ret)
{
	kvs_workq *q = calloc(1, sizeof(*q));
	if (!q)
		return -ENOMEM;
	q->cq = cq;
	pthread_mutex_init(&q->mu, NULL);
	pthread_cond_init(&q->cv, NULL);
	pthread_cond_init(&q->idle_cv, NULL);
	int r = pthread_create(&q->thr, NULL, workq_main, q);
	if (r) {
		pthread_cond_destroy(&q->idle_cv);
		pthread_cond_destroy(&q->cv);
		pthread_mutex_destroy(&q->mu);
		free(q);
		return -r;
	}
	*ret = q;
	return 0;
}

void kvs_workq_destroy(kvs_workq *q)
{
	if (!q)
		return;
	pthread_mutex_lock(&q->mu);
	q->stop = true;
	pthread_cond_signal(&q->cv);
	pthread_mutex_unlock(&q->mu);
	pthread_join(q->thr, NULL); /* the thread empties the queue first */
	pthread_cond_destroy(&q->idle_cv);
	pthread_cond_destroy(&q->cv);
	pthread_mutex_destroy(&q->mu);
	free(q);
}

void kvs_workq_submit(kvs_workq *q, kvs_workq_item *it)
{
	if (!q) {
		it->work(it);
		return;
	}
	it->next = NULL;
	pthread_mutex_lock(&q->mu);
	if (q->tail)
		q->tail->next = it;
	else
		q->head = it;
	q->tail = it;
	q->submitted++;
	pthread_cond_signal(&q->cv);
	pthread_mutex_unlock(&q->mu);
}

void kvs_workq_drain(kvs_workq *q)
{
	if (!q)
		return;
	pthread_mutex_lock(&q->mu);
	uint64_t target = q->submitted;
	while (q->done < target)
		pthread_cond_wait(&q->idle_cv, &q->mu);
	pthread_mutex_unlock(&q->mu);
}

uint64_t kvs_workq_pending(kvs_workq *q)
{
	if (!q)
		return 0;
	pthread_mutex_lock(&q->mu);
	uint64_t n = q->submitted - q->done;
	pthread_mutex_unlock(&q->mu);
	return n;
}
