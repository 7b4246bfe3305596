/* A work item that holds a work queue's thread until the test opens it: the
 * way a unit test shows that work was queued rather than done at once. */
#ifndef KVS_TEST_WORKQ_GATE_H
#define KVS_TEST_WORKQ_GATE_H

#include <pthread.h>
#include <stdbool.h>

#include "kvs_workq.h"

/* A work item that holds its queue's thread until opened. */
typedef struct gate {
	kvs_workq_item wi; /* first */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool entered, open;
} gate;

static inline void gate_work(kvs_workq_item *it)
{
	gate *g = (gate *)it;
	pthread_mutex_lock(&g->mu);
	g->entered = true;
	pthread_cond_broadcast(&g->cv);
	while (!g->open)
		pthread_cond_wait(&g->cv, &g->mu);
	pthread_mutex_unlock(&g->mu);
}

static inline void gate_hold(gate *g, kvs_workq *q)
{
	*g = (gate){.wi.work = gate_work, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
	kvs_workq_submit(q, &g->wi);
	pthread_mutex_lock(&g->mu);
	while (!g->entered)
		pthread_cond_wait(&g->cv, &g->mu);
	pthread_mutex_unlock(&g->mu);
}

static inline void gate_open(gate *g)
{
	pthread_mutex_lock(&g->mu);
	g->open = true;
	pthread_cond_broadcast(&g->cv);
	pthread_mutex_unlock(&g->mu);
}

#endif
