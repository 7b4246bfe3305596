/* The host copy engine: a small pool of threads doing memcpy for copy tasks
 * submitted by the main loop. A finished task goes onto a done list and the
 * loop's eventfd is written; the loop collects it with kvs_copy_pool_reap().
 * Tasks own their segment arrays; the memory they point into must stay mapped
 * until the task is reaped (the registration lease and the L1 pin/reservation
 * guarantee that). A segment whose pages vanish under the copy (an unsealed
 * memfd shrunk by its owner: SIGBUS) fails its task with result -EFAULT; the
 * pool installs a process-wide SIGBUS handler for that, which leaves every
 * other SIGBUS to the default action. */
#ifndef KVS_COPY_HOST_H
#define KVS_COPY_HOST_H

#include <stdint.h>

typedef struct kvs_copy_seg {
	void *dst;
	const void *src;
	uint64_t len;
} kvs_copy_seg;

typedef struct kvs_copy_task {
	struct kvs_copy_task *next; /* queue link, pool-private */
	kvs_copy_seg *segs;         /* owned by the task */
	uint32_t n_segs;
	int result;                 /* 0, or an error set by the engine */
	void *owner;                /* the submitter's context (job part) */
	void *obj;                  /* the submitter's object (L1 object) */
} kvs_copy_task;

typedef struct kvs_copy_pool kvs_copy_pool;

/* Starts n threads that signal completions on efd. 0 or -errno. */
int kvs_copy_pool_create(unsigned n, int efd, kvs_copy_pool **ret);
/* Runs the queued tasks to the end and joins the threads. Finished tasks not
 * yet reaped stay the caller's to reap first. Accepts NULL. */
void kvs_copy_pool_destroy(kvs_copy_pool *p);
/* Queues a task (ownership passes to the pool until reaped). */
void kvs_copy_pool_submit(kvs_copy_pool *p, kvs_copy_task *t);
/* Takes the list of finished tasks (linked by next), or NULL. */
kvs_copy_task *kvs_copy_pool_reap(kvs_copy_pool *p);
/* Bytes copied so far (statistics). */
uint64_t kvs_copy_pool_bytes(kvs_copy_pool *p);

#endif
