/* The planner (plan.c): block lists -> L1 objects + copy tasks, for one
 * rank's store or retrieve part. It validates, reserves L1 objects (store),
 * asks its source for each needed object (retrieve), and builds the copy
 * segments; it never replies, never touches a job and needs no server, so
 * it is unit-tested on its own (tests/unit/test_plan.c).
 *
 * Ownership: on success the plan's arrays, objects (reserved for a store)
 * and tasks belong to the caller, who either hands them on or calls
 * kvs_plan_undo(). On failure the plan holds what was done so far; the
 * caller calls kvs_plan_undo() to release it. */
#ifndef KVS_PLAN_H
#define KVS_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "copy.h"
#include "kvs_l1.h"
#include "kvs_proto.h"
#include "registry.h"

typedef struct kvs_planner kvs_planner;

typedef struct kvs_plan {
	kvs_l1_obj **objs; /* store: reserved; retrieve: pinned by the source */
	uint64_t *geoms;   /* store: L2 geometry fingerprint per object */
	uint32_t *chunk;   /* store: the chunk (key index) of each object */
	uint8_t *evh;      /* store with event_hashes: the engine hash of each object's chunk */
	uint32_t n_objs;
	kvs_copy_task **tasks;
	uint32_t n_tasks;
	uint32_t handed;    /* tasks[0..handed) went to the wave's take() and are not the plan's */
	uint64_t retained;  /* store: distinct non-null source blocks */
	uint32_t skipped;   /* store: objects already cached (no copy) */
	uint32_t staged;    /* store: objects another job is storing (private copy) */
	int stopped;        /* retrieve: the source's refusal that ended planning early, or 0 */
	char err[200];      /* why a plan was refused */
} kvs_plan;

/* Whose part: the namespace digest and the rank's place. */
typedef struct kvs_plan_who {
	uint8_t ns[16];
	uint32_t world, rank;
} kvs_plan_who;

/* Where a retrieve reads objects from. present: 0 if key can be served
 * (KVS_E_MISS otherwise), no side effects; *ready set when its fetch (right
 * after, with no other planning in between) can neither fail nor wait: the
 * object is in L1. fetch: pins or starts bringing
 * the object into L1, appends a pinned L1 object to pl->objs if it has one,
 * and sets *src to where its bytes are (or will be); a nonzero return stops
 * planning (kvs_plan.stopped). */
typedef struct kvs_plan_source {
	int (*present)(void *arg, const kvs_objkey *key, const kvs_reg_group *G, bool *ready);
	int (*fetch)(void *arg, kvs_plan *pl, const kvs_objkey *key, const kvs_reg_group *G, const uint8_t **src);
	void *arg;
} kvs_plan_source;

/* Waves (optional): a long part's copies start while the rest of it is
 * still being planned. Whenever the tasks planned since the last wave cover
 * at least the wave's size in L1 bytes and more of the part is to come, the
 * planner offers them to take(), which either takes them (true: they are
 * handed to a copy engine and owned there) or leaves them with the plan
 * (false; offered again with the next wave). The first wave is `first`
 * bytes, each later one at most 1.5 times the one before and at most `max`:
 * the planner then stays ahead of copies that each wave overlaps. The last
 * tasks always stay with the plan for the caller. A store part may fail
 * after waves were taken (no room in L1): the caller must then keep the
 * objects of the taken tasks reserved until their copies end. A retrieve
 * offers waves as it fetches when every object is ready (present() said
 * so: no fetch can fail), else only after every object was fetched; either
 * way a retrieve that fails has taken none. */
typedef struct kvs_plan_wave {
	uint64_t first, max;
	bool (*take)(void *arg, kvs_copy_task **tasks, uint32_t n);
	void *arg;
} kvs_plan_wave;

int kvs_planner_create(kvs_l1 *l1, kvs_planner **ret);
void kvs_planner_destroy(kvs_planner *p);
/* Asked when L1 has no room for a store's object: release up to `bytes` of
 * what is held for other reasons (pending write-behind pins) and return how
 * many bytes it let go (0: nothing). The reservation is retried once. */
typedef uint64_t (*kvs_plan_room_fn)(void *arg, uint64_t bytes);
void kvs_planner_set_room(kvs_planner *p, kvs_plan_room_fn fn, void *arg);
/* A fresh non-zero pad for a private staging key. */
uint32_t kvs_planner_nonce(kvs_planner *p);

/* The block lists against the registration: one list per group, each with
 * blocks_per_chunk ids per key, ids in range or the group's null id, and no
 * destination named twice by a retrieve. 0, or KVS_E_GEOMETRY / KVS_E_RANGE
 * / KVS_E_INTERNAL with pl->err. */
int kvs_plan_check(kvs_planner *p, const kvs_reg *g, const kvs_msg *rq, kvs_plan *pl);
/* A store part: one reserved L1 object per (key, group) with blocks, its
 * blocks gathered layer by layer. 0, or KVS_E_GEOMETRY / KVS_E_NOSPACE /
 * KVS_E_INTERNAL with pl->err. */
int kvs_plan_store(kvs_planner *p, const kvs_plan_who *who, const kvs_reg *g, const kvs_msg *rq,
		   const kvs_plan_wave *wave, kvs_plan *pl);
/* A retrieve part: every needed object present (else KVS_E_MISS, nothing
 * fetched), then fetched and scattered; blocks wholly inside skip_tokens
 * and null destinations are not written. 0 (see pl->stopped), or
 * KVS_E_MISS / KVS_E_GEOMETRY / KVS_E_LIMIT / KVS_E_INTERNAL with pl->err. */
int kvs_plan_retrieve(kvs_planner *p, const kvs_plan_who *who, const kvs_reg *g, const kvs_msg *rq,
		      const kvs_plan_source *src, const kvs_plan_wave *wave, kvs_plan *pl);
/* Releases what a plan holds: aborts reserved objects (store) or unpins
 * (retrieve), frees the tasks not handed over and the arrays. The plan is
 * zeroed. Only for a plan none of whose tasks were taken by a wave. */
void kvs_plan_undo(kvs_l1 *l1, kvs_plan *pl, kvs_op kind);
/* Frees n tasks and the array. */
void kvs_plan_free_tasks(kvs_copy_task **tasks, uint32_t n);

#endif
