/* The host copy engine: a small pool of threads doing memcpy for copy tasks
 * submitted by the main loop. A finished task is posted to the completion
 * queue (its `cq` item, whose done the submitter set).
 * Tasks own their segment arrays; the memory they point into must stay mapped
 * until the task is reaped (the registration lease and the L1 pin/reservation
 * guarantee that). A segment whose pages vanish under the copy (an unsealed
 * memfd shrunk by its owner: SIGBUS) fails its task with result -EFAULT; the
 * pool installs a process-wide SIGBUS handler for that, which leaves every
 * other SIGBUS to the default action. */
#ifndef KVS_COPY_HOST_H
#define KVS_COPY_HOST_H

#include <stdint.h>

#include "copy.h"

typedef struct kvs_copy_pool kvs_copy_pool;

/* A part of at most this many bytes (KVS_COPY_INLINE_MAX in the environment
 * overrides it; 0: never) is copied by the submitting thread
 * itself (the main loop) instead of a pool thread: cheaper than two thread
 * hand-offs, and short (a few microseconds). */
#define KVS_COPY_INLINE_MAX (64u << 10)

/* A pool thread that ran a task polls the queue spin_us (the setting
 * copy-spin-us, default KVS_COPY_SPIN_US) before it sleeps, on machines with
 * at least KVS_COPY_SPIN_MIN_CPUS online CPUs (KVS_COPY_SPIN_US in the
 * environment overrides both, for experiments; 0: never; at most
 * KVS_COPY_SPIN_MAX_US): a job's next part then needs no futex wake-up from
 * the loop and starts without a sleeping thread's wake-up latency. */
#define KVS_COPY_SPIN_US 50u
#define KVS_COPY_SPIN_MAX_US 10000u
#define KVS_COPY_SPIN_MIN_CPUS 8

/* Starts n threads that post finished tasks to cq. 0 or -errno. */
int kvs_copy_pool_create(unsigned n, uint32_t spin_us, kvs_cq *cq, kvs_copy_pool **ret);
/* Runs the queued tasks to the end and joins the threads. Tasks posted but
 * not yet run by the queue stay the caller's. Accepts NULL. */
void kvs_copy_pool_destroy(kvs_copy_pool *p);
/* Queues a task (ownership passes to the pool until it is posted). */
void kvs_copy_pool_submit(kvs_copy_pool *p, kvs_copy_task *t);
/* The pool as a copy engine (copy.h): submit queues every task of the part
 * (or, for a part of at most KVS_COPY_INLINE_MAX bytes, copies it at once);
 * the stream is NULL. */
kvs_copy_engine *kvs_copy_pool_engine(kvs_copy_pool *p);
/* Bytes copied so far (statistics). */
uint64_t kvs_copy_pool_bytes(kvs_copy_pool *p);

#endif
