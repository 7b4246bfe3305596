/* The completion queue: how work finished on other threads (host copies,
 * CUDA host callbacks, the L2 threads) comes back to the main loop, the way
 * libuv's uv__work_done does it. A producer posts an item carrying its own
 * `done` callback from any thread; the loop, woken by the queue's eventfd,
 * runs every posted item's `done` in posting order. The queue knows no
 * producer.
 *
 * Ownership: an item belongs to its producer. Once posted it must stay valid
 * until its `done` has run, or until the queue is destroyed (which never
 * touches items still queued). An item is on the queue at most once at a
 * time; `done` may post it again. */
#ifndef KVS_CQ_H
#define KVS_CQ_H

#include <stdint.h>

typedef struct kvs_cq_item kvs_cq_item;
typedef void (*kvs_cq_done_fn)(kvs_cq_item *it);

struct kvs_cq_item {
	kvs_cq_item *next; /* queue link, the queue's while posted */
	kvs_cq_done_fn done;
};

typedef struct kvs_cq kvs_cq;

/* 0, or -errno (eventfd, memory). */
int kvs_cq_create(kvs_cq **ret);
/* Items still queued are dropped untouched. Accepts NULL. */
void kvs_cq_destroy(kvs_cq *q);
/* The eventfd the loop polls for POLLIN. */
int kvs_cq_fd(const kvs_cq *q);
/* Any thread. Never fails, never blocks beyond the queue's mutex. */
void kvs_cq_post(kvs_cq *q, kvs_cq_item *it);
/* Loop thread: clears the eventfd, then runs the done of every item posted
 * before the call, oldest first. Returns how many ran. */
uint32_t kvs_cq_run(kvs_cq *q);

#endif
