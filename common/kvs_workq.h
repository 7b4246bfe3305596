/* A work queue: one thread that runs submitted work in submission order,
 * off the main loop, and hands each finished item back through the
 * completion queue (kvs_cq.h). The server uses it for what may sit in the
 * CUDA driver for long (imports, maps, streams, staging memory, their
 * teardown) so the loop never does (issue 18). FIFO is part of the
 * contract: work submitted after other work runs after it, so a teardown
 * queued before an import of the same memory runs first.
 *
 * Ownership: an item belongs to the queue from submit until its `work`
 * returned; then, if its cq.done is set, it is posted to the completion
 * queue and belongs to its producer again when done runs on the loop; if
 * cq.done is NULL the item is the work's own (a fire-and-forget teardown
 * frees itself). */
#ifndef KVS_WORKQ_H
#define KVS_WORKQ_H

#include <stdint.h>

#include "kvs_cq.h"

typedef struct kvs_workq_item kvs_workq_item;
typedef void (*kvs_workq_fn)(kvs_workq_item *it);

struct kvs_workq_item {
	kvs_cq_item cq;       /* first: posted after work when cq.done != NULL */
	kvs_workq_fn work;    /* runs on the queue's thread */
	kvs_workq_item *next; /* queue link, the queue's while queued */
};

typedef struct kvs_workq kvs_workq;

/* Starts the thread. 0, or -errno. */
int kvs_workq_create(kvs_cq *cq, kvs_workq **ret);
/* Runs every item still queued, then joins the thread. Accepts NULL. */
void kvs_workq_destroy(kvs_workq *q);
/* Any thread. Never fails, never blocks beyond the queue's mutex. With q
 * NULL the work runs at once on the calling thread (and a set cq.done is
 * left to the caller: nothing is posted). */
void kvs_workq_submit(kvs_workq *q, kvs_workq_item *it);
/* Waits until every item submitted before the call has run its work (its
 * completion may still be queued on the cq). Not from the queue's thread. */
void kvs_workq_drain(kvs_workq *q);
/* Items submitted and not yet finished (a gauge). */
uint64_t kvs_workq_pending(kvs_workq *q);

#endif
