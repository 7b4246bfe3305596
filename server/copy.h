/* The copy-engine interface: what the planner produces and every copy
 * engine (host pool, CUDA) consumes. A part descriptor states its direction
 * (which side of every segment is L1) and each task's L1 extent, so an
 * engine never has to guess from addresses; the engine behind a
 * registration is chosen once, at `register`.
 *
 * Ownership: a submitted part's tasks belong to the engine until each task's
 * cq item is posted (host pool) or done is called on the loop (CUDA); the
 * memory they point into must stay mapped until then (the registration's
 * lease and the L1 reservation or pin guarantee it). */
#ifndef KVS_COPY_H
#define KVS_COPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvs_cq.h"

typedef struct kvs_copy_seg {
	void *dst;
	const void *src;
	uint64_t len;
} kvs_copy_seg;

/* One L1 object's copies. */
typedef struct kvs_copy_task {
	kvs_cq_item cq;             /* posted when the copy ended; done set by the submitter */
	struct kvs_copy_task *next; /* queue link, engine-private */
	kvs_copy_seg *segs;         /* owned by the task */
	uint32_t n_segs;
	uint8_t *l1;                /* the L1 object's bytes every segment's L1 side lies in */
	uint64_t l1_len;
	int result;                 /* 0, or an error set by the engine */
	void *owner;                /* the submitter's context (job part) */
} kvs_copy_task;

typedef enum kvs_copy_dir {
	KVS_COPY_TO_L1 = 0,   /* store: engine memory -> L1 (every dst is L1) */
	KVS_COPY_FROM_L1 = 1, /* retrieve: L1 -> engine memory (every src is L1) */
} kvs_copy_dir;

/* One rank's part of a job: its tasks complete together or one by one. */
typedef struct kvs_copy_part {
	kvs_copy_dir dir;
	kvs_copy_task **tasks;
	uint32_t n_tasks;
	const void *event; /* a producer event to wait for first (CUDA store), or NULL */
	size_t event_len;
	uint64_t deadline_ms; /* the job's deadline (kvs_now_ms clock): no wait beyond it */
	uint64_t seq;         /* the rank's part this is a wave of (plan.h), or 0. Waves of one
			       * part never copy to one place twice, so an engine need not order
			       * one after another; `event` is the same on each */
} kvs_copy_part;

/* An engine, embedded first in the engine's own struct. submit queues the
 * part's tasks on the registration's stream (stream is the engine's own
 * object, NULL for the host pool); it never fails: a task that cannot run
 * completes with its result set. */
typedef struct kvs_copy_engine {
	void (*submit)(struct kvs_copy_engine *e, void *stream, const kvs_copy_part *part);
	/* Are copies of any part in flight on the engine? (NULL: never.) A
	 * part goes in waves only when they find the engine idle: otherwise
	 * the engine has work while the part is planned, and waves would only
	 * add their cost. */
	bool (*busy)(struct kvs_copy_engine *e);
	const char *name;
} kvs_copy_engine;

#endif
