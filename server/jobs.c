/* Jobs across ranks, source-block retention, the terminal-id table, and the
 * L1 lookup. A job is created by its first part, runs its copies on the host
 * copy pool, and becomes terminal only when every copy has finished and
 * either every rank completed ok (commit) or something failed (abort).
 * Only then are retention, leases and L1 reservations/pins released and
 * job_done pushed, so an engine never reuses a block a copy still reads. */
#include "jobs.h"

#include <errno.h>
#include <stdarg.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVS_LOG_COMPONENT "jobs"
#include "events.h"
#include "keys.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "writeback.h"
#include "kvs_log.h"
#include "kvs_trace.h"
#include "kvs_time.h"
#include "plan.h"
#include "promote.h"
#include "ranks.h"
#include "registry.h"
#include "reply.h"

#define JOBKEY_BYTES KVS_JOBKEY_BYTES
/* the end of a conflict with a remembered terminal job (protocol.md §6.4) */
#define REUSED "this server remembers the ids of its last terminal-jobs ended jobs to answer repeats; use a new id"

typedef struct kvs_job kvs_job;

/* One rank's share of a job.
 * Invariants: reg != NULL iff this part holds a lease on it; objs holds the
 * L1 objects the part reserved (store) or pinned (retrieve), each exactly
 * once; retained is the number of distinct non-null source blocks counted
 * into kvs_jobs.retained by this part. */
typedef struct kvs_part {
	kvs_job *job;
	bool present;   /* store/retrieve accepted */
	bool completed;
	uint8_t status; /* enum kvs_status, valid if completed */
	uint64_t session;
	uint8_t digest[16];
	kvs_reg *reg;
	uint32_t copies_pending;
	int copy_err;
	kvs_l1_obj **objs;
	uint64_t *geoms; /* store: L2 geometry fingerprint per object */
	uint32_t *chunk; /* store: the chunk (key index) of each object */
	uint8_t *evh;    /* store: engine block hash per object (event_hashes), or NULL */
	uint32_t n_objs;
	uint64_t retained;
	uint64_t reply_id; /* retrieve: deferred reply, 0 = none or sent */
	/* store with `complete`: the part's request, answered when the job is
	 * terminal (in place of job_done to this session), 0 = none */
	uint64_t final_id;
	/* retrieve of L2-only chunks: copies are held until every promotion
	 * into L1 finished, so a failed one leaves the rank's memory untouched */
	uint32_t promotes_pending;
	int fail_code;
	kvs_copy_task **held;
	uint32_t n_held;
	uint64_t seq; /* this part's number for its copy engine (copy.h: its waves share it) */
	int8_t waves; /* while planning: 0 undecided, 1 in waves, -1 whole (the engine was busy) */
	const kvs_bytes *event; /* store: the producer event, while the request is being handled */
} kvs_part;

/* An open job. Invariant: it is in jobs->open iff it is not yet terminal;
 * aborting jobs stay open until their copies finish. */
struct kvs_job {
	uint8_t key[JOBKEY_BYTES];
	uint64_t id;
	char engine[KVS_MAX_STR + 1];
	kvs_op kind; /* KVS_OP_STORE or KVS_OP_RETRIEVE */
	uint32_t world;
	uint32_t ranks_done;
	bool aborting;
	char reason[KVS_MAX_STR + 1]; /* the wire's bound (protocol.md §4) */
	uint64_t deadline_ms;
	kvs_part *parts; /* world entries, by rank */
	kvs_server *srv; /* for completion callbacks */
	kvs_job *older, *newer; /* the open list, by creation (so by deadline) */
};

/* A terminal job remembered to answer repeats. The table is bounded: the
 * oldest entry is dropped when full. */
typedef struct kvs_terminal {
	uint8_t key[JOBKEY_BYTES];
	uint64_t id;
	uint8_t state;
	char reason[KVS_MAX_STR + 1];
	uint32_t world, ranks_done;
	uint8_t *digests; /* world * 16, zero = no part from that rank */
	uint8_t *done;    /* world entries: 0 none, 1 + status */
} kvs_terminal;

struct kvs_jobs {
	kvs_htab *open;     /* kvs_job by key */
	/* the same open jobs, oldest first: deadlines are creation + one
	 * constant, so expiry walks from the oldest end and stops early */
	kvs_job *oldest, *newest;
	kvs_htab *terminal; /* kvs_terminal by key */
	kvs_terminal **ring; /* FIFO of terminal entries, cap entries */
	uint32_t cap, head, count;
	uint64_t retained; /* sum of part->retained over open jobs */
	kvs_planner *planner;
	uint64_t write_group; /* the write-behind group of the job finalising now */
	uint64_t part_seq;    /* the last kvs_part.seq given */
	kvs_plan_wave wave;   /* sizes of a long part's waves (take and arg set per part) */
	kvs_jobs_stats st;
};

/* The planner found no room in L1 for a store: pending write-behind pins
 * give way first (the oldest job's latest chunks first), never the store. */
static uint64_t shed_writes(void *arg, uint64_t bytes)
{
	kvs_server *srv = arg;
	uint32_t n = 0;
	uint64_t freed = kvs_writeback_shed(srv, bytes, &n);
	srv->jobs->st.writes_shed += n;
	return freed;
}

int kvs_jobs_create(kvs_server *srv, kvs_jobs **ret)
{
	kvs_jobs *j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	j->cap = srv->cfg.terminal_jobs ? srv->cfg.terminal_jobs : 65536;
	j->ring = calloc(j->cap, sizeof(*j->ring));
	int r = j->ring ? 0 : -ENOMEM;
	if (!r)
		r = kvs_htab_create(JOBKEY_BYTES, offsetof(kvs_job, key), &j->open);
	if (!r)
		r = kvs_htab_create(JOBKEY_BYTES, offsetof(kvs_terminal, key), &j->terminal);
	if (!r)
		r = kvs_planner_create(srv->l1, &j->planner);
	if (!r)
		kvs_planner_set_room(j->planner, shed_writes, srv);
	const char *wv = getenv("KVS_COPY_WAVE"); /* experiments: overrides copy-wave */
	j->wave.first = wv ? strtoull(wv, NULL, 0) : srv->cfg.copy_wave;
	j->wave.max = 8 * j->wave.first;
	if (r) {
		kvs_htab_destroy(j->terminal);
		kvs_htab_destroy(j->open);
		free(j->ring);
		free(j);
		return r;
	}
	*ret = j;
	return 0;
}

static void terminal_free(kvs_terminal *t)
{
	free(t->digests);
	free(t->done);
	free(t);
}

uint64_t kvs_jobs_open(const kvs_jobs *j) { return kvs_htab_count(j->open); }
uint64_t kvs_jobs_retained(const kvs_jobs *j) { return j->retained; }
void kvs_jobs_get_stats(const kvs_jobs *j, kvs_jobs_stats *st)
{
	*st = j->st;
	st->terminal_entries = j->count;
}

/* ---- terminal state ---------------------------------------------------------- */

static void remember_terminal(kvs_jobs *J, kvs_job *job, uint8_t state)
{
	kvs_terminal *t = calloc(1, sizeof(*t));
	if (!t)
		return; /* repeats then answer "unknown": acceptable under OOM */
	t->digests = calloc(job->world, 16);
	t->done = calloc(job->world, 1);
	if (!t->digests || !t->done) {
		terminal_free(t);
		return;
	}
	memcpy(t->key, job->key, JOBKEY_BYTES);
	t->id = job->id;
	t->state = state;
	snprintf(t->reason, sizeof(t->reason), "%s", job->reason);
	t->world = job->world;
	t->ranks_done = job->ranks_done;
	for (uint32_t r = 0; r < job->world; r++) {
		if (job->parts[r].present)
			memcpy(t->digests + 16 * r, job->parts[r].digest, 16);
		if (job->parts[r].completed)
			t->done[r] = (uint8_t)(1 + job->parts[r].status);
	}
	if (J->count == J->cap) { /* drop the oldest */
		kvs_terminal *old = J->ring[J->head];
		kvs_htab_del(J->terminal, old->key);
		terminal_free(old);
		J->count--;
		J->head = (J->head + 1) % J->cap;
	}
	/* no duplicate: a key is only ever open or terminal, and a terminal
	 * key answers repeats instead of opening a new job */
	if (kvs_htab_put(J->terminal, t) < 0) {
		terminal_free(t);
		return;
	}
	J->ring[(J->head + J->count) % J->cap] = t;
	J->count++;
}

/* ---- finalisation ------------------------------------------------------------ */

static void push_job_done(kvs_server *srv, kvs_job *job, uint8_t state)
{
	kvs_msg m = {.op = KVS_OP_JOB_DONE, .id = 0, .ok = true, .job = job->id, .state = state,
		     .reason = kvs_str_c(job->reason)};
	uint64_t sent[64];
	uint32_t n_sent = 0;
	/* parts that carried their complete: their request's reply is the
	 * job's end, and their session gets no push besides */
	for (uint32_t r = 0; r < job->world; r++) {
		kvs_part *p = &job->parts[r];
		if (!p->final_id || !p->session)
			continue;
		kvs_msg rep = m;
		rep.op = KVS_OP_STORE;
		rep.id = p->final_id;
		kvs__send_to_session(srv, p->session, &rep);
		p->final_id = 0;
		if (n_sent < 64)
			sent[n_sent++] = p->session;
	}
	for (uint32_t r = 0; r < job->world; r++) {
		uint64_t sid = job->parts[r].session;
		if (!sid)
			continue;
		bool dup = false;
		for (uint32_t i = 0; i < n_sent && !dup; i++)
			dup = sent[i] == sid;
		if (dup)
			continue;
		if (n_sent < 64)
			sent[n_sent++] = sid;
		kvs__send_to_session(srv, sid, &m);
	}
	kvs__push_to_schedulers(srv, job->engine, &m);
}

/* Before a store commits its object: a private staging copy takes the
 * public key, unless a committed object already has it (returns false: drop
 * ours). A reservation still holding the public key (a store in flight)
 * becomes the staging copy instead, and meets the same rule at its commit. */
static bool publish(kvs_server *srv, kvs_l1_obj *o)
{
	const kvs_objkey *k = kvs_l1_key(o);
	if (k->pad == 0)
		return true;
	kvs_objkey pub = *k;
	pub.pad = 0;
	kvs_l1_obj *cur = kvs_l1_peek(srv->l1, &pub);
	if (cur && kvs_l1_state(cur) == KVS_L1_COMMITTED)
		return false;
	if (cur) {
		kvs_objkey stage = pub;
		stage.pad = kvs_planner_nonce(srv->jobs->planner);
		kvs_l1_rekey(srv->l1, cur, &stage);
	}
	kvs_l1_rekey(srv->l1, o, &pub);
	return true;
}

static void part_release(kvs_server *srv, kvs_part *p, bool commit)
{
	kvs_jobs *J = srv->jobs;
	for (uint32_t i = 0; i < p->n_objs; i++) {
		if (p->job->kind == KVS_OP_STORE) {
			if (commit && !publish(srv, p->objs[i])) {
				kvs_l1_abort(srv->l1, p->objs[i]); /* someone committed it first */
			} else if (commit) {
				kvs_l1_commit(srv->l1, p->objs[i]);
				kvs_events_stored_as(srv->events, kvs_l1_key(p->objs[i]),
						     kvs_reg_chunk_tokens(p->reg, kvs_l1_key(p->objs[i])->group), KVS_TIER_EV_L1,
						     p->evh ? p->evh + (size_t)i * KVS_KEY_BYTES : NULL);
				kvs_writeback_stored(srv, p->objs[i], p->geoms[i], J->write_group, p->chunk[i]);
			} else {
				kvs_l1_abort(srv->l1, p->objs[i]);
			}
		} else {
			kvs_l1_unpin(srv->l1, p->objs[i]);
		}
	}
	free(p->objs);
	free(p->geoms);
	free(p->chunk);
	free(p->evh);
	p->objs = NULL, p->geoms = NULL;
	p->chunk = NULL, p->evh = NULL;
	p->n_objs = 0;
	J->retained -= p->retained;
	p->retained = 0;
	if (p->reg) {
		kvs_reg_unlease(srv, p->reg);
		p->reg = NULL;
	}
}

static void job_free(kvs_job *job)
{
	free(job->parts);
	free(job);
}

/* Makes the job terminal if it can be: no copy pending, and either aborting
 * or every rank completed. Returns the job's state afterwards (the job may
 * have been freed). */
static uint8_t try_finalize(kvs_server *srv, kvs_job *job)
{
	kvs_jobs *J = srv->jobs;
	for (uint32_t r = 0; r < job->world; r++)
		if (job->parts[r].copies_pending || job->parts[r].promotes_pending)
			return job->aborting ? KVS_JOB_ABORTED : KVS_JOB_OPEN;
	if (!job->aborting) {
		if (job->ranks_done < job->world)
			return KVS_JOB_OPEN;
		for (uint32_t r = 0; r < job->world; r++)
			if (job->parts[r].copy_err) {
				job->aborting = true;
				snprintf(job->reason, sizeof(job->reason), "copy failed on rank %u: %s", r,
					 job->parts[r].copy_err == -EFAULT ? "host memory shrank"
									   : kvs_error_name(job->parts[r].copy_err));
			}
	}
	bool commit = !job->aborting;
	uint8_t state = commit ? KVS_JOB_COMMITTED : KVS_JOB_ABORTED;
	if (commit)
		snprintf(job->reason, sizeof(job->reason), "%s", "all ranks completed");
	/* store: every object of every rank becomes visible in this one step;
	 * its write-behind is one group (all ranks: a hit needs every rank) */
	J->write_group++;
	for (uint32_t r = 0; r < job->world; r++)
		part_release(srv, &job->parts[r], commit);
	kvs_htab_del(J->open, job->key);
	*(job->older ? &job->older->newer : &J->oldest) = job->newer;
	*(job->newer ? &job->newer->older : &J->newest) = job->older;
	if (commit)
		J->st.committed++;
	else
		J->st.aborted++;
	/* one line per job is too much on the hot path: commits at debug */
	kvs_log(commit ? KVS_LOG_DEBUG : KVS_LOG_INFO, "job %llu (%s, engine '%s') %s: %s", (unsigned long long)job->id,
		kvs_op_name(job->kind), job->engine, kvs_job_state_name(state), job->reason);
	remember_terminal(J, job, state);
	KVS_TRACE(KVS_TP_SRV_COMMIT, state);
	push_job_done(srv, job, state);
	KVS_TRACE(KVS_TP_SRV_SENT, state);
	job_free(job);
	return state;
}

static void job_abort(kvs_server *srv, kvs_job *job, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void job_abort(kvs_server *srv, kvs_job *job, const char *fmt, ...)
{
	if (job->aborting)
		return;
	job->aborting = true;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(job->reason, sizeof(job->reason), fmt, ap);
	va_end(ap);
}

/* ---- lookup of jobs ---------------------------------------------------------- */

static kvs_job *job_new(kvs_server *srv, kvs_session *s, const uint8_t key[JOBKEY_BYTES],
			uint64_t id, kvs_op kind)
{
	kvs_job *job = calloc(1, sizeof(*job));
	if (!job)
		return NULL;
	job->parts = calloc(s->world, sizeof(*job->parts));
	if (!job->parts) {
		free(job);
		return NULL;
	}
	memcpy(job->key, key, JOBKEY_BYTES);
	job->id = id;
	snprintf(job->engine, sizeof(job->engine), "%s", s->engine);
	job->kind = kind;
	job->world = s->world;
	job->deadline_ms = srv->now_ms + srv->cfg.job_deadline_ms;
	job->srv = srv;
	for (uint32_t r = 0; r < s->world; r++)
		job->parts[r].job = job;
	kvs_jobs *J = srv->jobs;
	if (kvs_htab_put(J->open, job) < 0) {
		job_free(job);
		return NULL;
	}
	job->older = J->newest;
	*(J->newest ? &J->newest->newer : &J->oldest) = job;
	J->newest = job;
	return job;
}

static void reply_state(kvs_server *srv, kvs_session *s, const kvs_msg *rq, uint8_t state)
{
	kvs_msg rep = {.op = rq->op, .id = rq->id, .ok = true, .job = rq->job, .state = state};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
}

/* ---- store / retrieve ---------------------------------------------------------- */

static void task_done(kvs_cq_item *it);

/* Hands tasks to the copy engine of the part's registration (chosen at
 * register: one batch on its CUDA stream for device memory, the host pool
 * for memfds); they count as pending copies of the part from now on. */
static void part_submit(kvs_server *srv, kvs_part *p, kvs_copy_task **tasks, uint32_t n)
{
	if (!n)
		return;
	const kvs_job *job = p->job;
	p->copies_pending += n;
	if (job->kind == KVS_OP_STORE)
		srv->jobs->st.store_objects += n;
	else
		srv->jobs->st.retrieve_objects += n;
	for (uint32_t i = 0; i < n; i++) {
		tasks[i]->owner = p;
		tasks[i]->cq.done = task_done;
	}
	kvs_copy_part part = {.dir = job->kind == KVS_OP_STORE ? KVS_COPY_TO_L1 : KVS_COPY_FROM_L1, .tasks = tasks,
			      .n_tasks = n, .event = p->event ? p->event->ptr : NULL,
			      .event_len = p->event ? p->event->len : 0, .deadline_ms = job->deadline_ms, .seq = p->seq};
	KVS_TRACE(KVS_TP_SRV_SUBMIT, n);
	p->reg->engine->submit(p->reg->engine, p->reg->stream, &part);
	KVS_TRACE(KVS_TP_SRV_QUEUED, n);
}

/* A wave of a long part (plan.h): to the engine at once, unless the part
 * waits for promotions (its copies are held until they all ended) or has
 * failed already. */
static bool wave_take(void *arg, kvs_copy_task **tasks, uint32_t n)
{
	kvs_part *p = arg;
	if (p->promotes_pending || p->fail_code)
		return false;
	/* decided at the first offer: waves only into an idle engine (copy.h) */
	if (!p->waves)
		p->waves = p->reg->engine->busy && p->reg->engine->busy(p->reg->engine) ? -1 : 1;
	if (p->waves < 0)
		return false;
	kvs_server *srv = p->job->srv;
	part_submit(srv, p, tasks, n);
	srv->jobs->st.copy_waves++;
	return true;
}

/* A retrieve part whose promotions all ended: fail it or release its copies. */
static void part_promoted(kvs_server *srv, kvs_part *p)
{
	kvs_job *job = p->job;
	if (p->fail_code) {
		kvs_plan_free_tasks(p->held, p->n_held);
		p->held = NULL;
		p->n_held = 0;
		if (p->reply_id)
			kvs__err_to_session(srv, p->session, KVS_OP_RETRIEVE, p->reply_id, p->fail_code,
					    "%s", p->fail_code == KVS_E_MISS ? "a chunk could not be read back from L2 (dropped or corrupt); nothing was written"
									     : "no room in L1 to promote L2 chunks; nothing was written");
		p->reply_id = 0;
		job_abort(srv, job, "rank %u retrieve failed: %s", (uint32_t)(p - job->parts), kvs_error_name(p->fail_code));
		try_finalize(srv, job);
		return;
	}
	part_submit(srv, p, p->held, p->n_held);
	free(p->held);
	p->held = NULL;
	p->n_held = 0;
	if (!p->copies_pending && p->reply_id) {
		kvs_msg rep = {.op = KVS_OP_RETRIEVE, .id = p->reply_id, .ok = true, .job = job->id, .state = KVS_JOB_OPEN};
		kvs__send_to_session(srv, p->session, &rep);
		p->reply_id = 0;
		try_finalize(srv, job);
	}
}

/* The retrieve planner's source: objects in L1 are pinned for the part,
 * objects only in L2 are promoted with the part waiting for them. */
typedef struct source_ctx {
	kvs_server *srv;
	kvs_part *p;
} source_ctx;

static int source_present(void *arg, const kvs_objkey *key, const kvs_reg_group *G, bool *ready)
{
	source_ctx *c = arg;
	kvs_l1_obj *o;
	int r = kvs_promote_locate(c->srv->promote, key, G->geom, G->obj_bytes, &o, NULL);
	*ready = r == 0 && o; /* in L1: its fetch pins it */
	return r;
}

static void part_promoted(kvs_server *srv, kvs_part *p);

/* A promotion the part waited for ended (promote.h's callback). */
static void promoted_one(void *arg, kvs_l1_obj *obj, int result)
{
	kvs_part *p = arg;
	kvs_server *srv = p->job->srv;
	if (obj)
		p->objs[p->n_objs++] = obj;
	else if (!p->fail_code)
		p->fail_code = result;
	if (--p->promotes_pending == 0)
		part_promoted(srv, p);
}

static int source_fetch(void *arg, kvs_plan *pl, const kvs_objkey *key, const kvs_reg_group *G,
			const uint8_t **src)
{
	source_ctx *c = arg;
	kvs_server *srv = c->srv;
	kvs_l1_obj *o = kvs_l1_get(srv->l1, key);
	if (o && kvs_l1_len(o) != G->obj_bytes)
		return KVS_E_MISS; /* checked by present(); defensive */
	if (o) {
		kvs_l1_pin(srv->l1, o);
		kvs_l1_touch(srv->l1, o);
		pl->objs[pl->n_objs++] = o;
		*src = kvs_l1_data(o);
		return 0;
	}
	int err = 0;
	kvs_l1_obj *target = kvs_promote_start(srv->promote, key, G->geom, G->obj_bytes, &err);
	if (!target)
		return err;
	/* cannot wait: the part fails cleanly when its promotions end */
	if (kvs_promote_wait(srv->promote, key, promoted_one, c->p) != 0)
		return KVS_E_INTERNAL;
	c->p->promotes_pending++;
	*src = kvs_l1_data(target);
	if (srv->l2)
		kvs_l2_touch(srv->l2, key);
	return 0;
}

/* Plans a part against its registration g, which it leases from now on:
 * waves of a long part reach the engine while the rest is planned. 0 or a
 * code with pl->err (pl says what was taken and what is left). */
static int part_plan(kvs_server *srv, kvs_session *s, const kvs_msg *rq, kvs_reg *g, kvs_part *p, kvs_plan *pl)
{
	kvs_jobs *J = srv->jobs;
	int r;
	p->reg = g;
	kvs_reg_lease(g);
	p->seq = ++J->part_seq;
	p->waves = 0;
	p->event = rq->op == KVS_OP_STORE && rq->producer_event.len ? &rq->producer_event : NULL;
	kvs_plan_wave wave = J->wave;
	wave.take = wave_take;
	wave.arg = p;
	kvs_plan_who who = {.world = s->world, .rank = s->rank};
	kvs_ns_digest(s->ns, who.ns);
	if (rq->op == KVS_OP_STORE) {
		r = kvs_plan_store(J->planner, &who, g, rq, &wave, pl);
		J->st.store_skipped += pl->skipped;
		J->st.store_staged += pl->staged;
		return r;
	}
	kvs_plan_source src = {.present = source_present, .fetch = source_fetch, .arg = &(source_ctx){srv, p}};
	r = kvs_plan_retrieve(J->planner, &who, g, rq, &src, &wave, pl);
	/* the part owns what the source pinned (and promotions add to it) */
	p->objs = pl->objs;
	p->n_objs = pl->n_objs;
	pl->objs = NULL;
	pl->n_objs = 0;
	if (pl->stopped && !p->fail_code)
		p->fail_code = pl->stopped;
	return r;
}

/* Store and retrieve share everything but the plan. */
static int op_part(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_jobs *J = srv->jobs;
	uint8_t key[JOBKEY_BYTES], dg[16];
	kvs_job_key(s->engine, rq->job, key);
	kvs_part_digest(rq, dg);
	if (s->role != KVS_ROLE_WORKER)
		return kvs__fail(srv, KVS_E_SESSION, "only worker sessions send job parts");

	kvs_terminal *t = kvs_htab_get(J->terminal, key);
	if (t && t->world != s->world)
		return kvs__fail(srv, KVS_E_JOB_CONFLICT, "job %llu ended earlier with world %u: %s",
				 (unsigned long long)rq->job, t->world, REUSED);
	if (t) {
		static const uint8_t zero[16];
		const uint8_t *had = s->rank < t->world ? t->digests + 16 * s->rank : zero;
		if (memcmp(had, zero, 16) != 0 && memcmp(had, dg, 16) != 0)
			return kvs__fail(srv, KVS_E_JOB_CONFLICT, "job %llu ended earlier with other content from rank %u: %s",
					 (unsigned long long)rq->job, s->rank, REUSED);
		reply_state(srv, s, rq, t->state); /* a repeat changes nothing */
		return 0;
	}
	kvs_job *job = kvs_htab_get(J->open, key);
	if (job) {
		if (job->kind != rq->op || job->world != s->world)
			return kvs__fail(srv, KVS_E_JOB_CONFLICT, "job %llu is a %s job of world %u",
					 (unsigned long long)rq->job, kvs_op_name(job->kind), job->world);
		kvs_part *p = &job->parts[s->rank];
		if (p->present || p->completed) {
			if (p->present && memcmp(p->digest, dg, 16) == 0) {
				reply_state(srv, s, rq, job->aborting ? KVS_JOB_ABORTED : KVS_JOB_OPEN);
				return 0;
			}
			return kvs__fail(srv, KVS_E_JOB_CONFLICT, "rank %u already sent other content for job %llu",
					 s->rank, (unsigned long long)rq->job);
		}
		if (job->aborting) {
			reply_state(srv, s, rq, KVS_JOB_ABORTED);
			return 0;
		}
	}

	/* validate, then plan; a failure is final for this rank's part, so the
	 * job (created if this is its first part) aborts */
	kvs_reg *g = kvs_registry_of_session(srv->reg, s->id);
	kvs_plan pl = {0};
	int r = g ? kvs_plan_check(J->planner, g, rq, &pl) : kvs__fail(srv, KVS_E_NOREG, "session has no registration");
	if (!r && rq->op == KVS_OP_STORE && rq->lazy) {
		/* a deferred copy cannot keep an exact boundary snapshot safe */
		for (uint32_t gi = 0; gi < g->n_groups && !r; gi++)
			if (g->groups[gi].desc.kind == KVS_GROUP_RECURRENT)
				r = kvs__fail(srv, KVS_E_LAZY_RECURRENT,
					      "lazy store refused: registration has recurrent group %u",
					      g->groups[gi].desc.id);
	}
	if (!job) {
		job = job_new(srv, s, key, rq->job, rq->op);
		if (!job) {
			kvs_plan_undo(srv->l1, &pl, rq->op);
			return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
		}
	}
	kvs_part *p = &job->parts[s->rank];
	p->present = true;
	p->session = s->id;
	memcpy(p->digest, dg, 16);
	if (!r)
		r = part_plan(srv, s, rq, g, p, &pl);
	kvs_copy_task **rest = pl.tasks ? pl.tasks + pl.handed : NULL; /* what no wave took */
	uint32_t n_rest = pl.n_tasks - pl.handed;
	if (rq->op == KVS_OP_STORE && (!r || pl.handed)) {
		/* the part's objects: reserved now, committed or aborted with the
		 * job (also when planning failed after waves began copying into
		 * some of them: they stay reserved until those copies end) */
		p->objs = pl.objs;
		p->geoms = pl.geoms;
		p->chunk = pl.chunk;
		p->evh = pl.evh;
		p->n_objs = pl.n_objs;
		p->retained = pl.retained;
		J->retained += pl.retained;
		pl.objs = NULL;
		pl.geoms = NULL;
		pl.chunk = NULL;
		pl.evh = NULL;
		pl.n_objs = 0;
		pl.retained = 0;
	}
	if (r) {
		if (srv->errbuf[0] == 0)
			kvs__fail(srv, r, "%s", pl.err);
		p->event = NULL;
		kvs_plan_undo(srv->l1, &pl, rq->op); /* what no wave took */
		job_abort(srv, job, "rank %u part refused: %s: %s", s->rank, kvs_error_name(r),
			  srv->errbuf[0] ? srv->errbuf : pl.err);
		try_finalize(srv, job);
		return r;
	}
	if (rq->op == KVS_OP_STORE) {
		part_submit(srv, p, rest, n_rest);
		p->event = NULL;
		free(pl.tasks);
		if (!rq->complete) {
			reply_state(srv, s, rq, KVS_JOB_OPEN);
			return 0;
		}
		/* the rank's complete ("ok") rides on the part: one message and
		 * one reply per rank and job (protocol.md §6.7) */
		p->completed = true;
		p->status = KVS_STATUS_OK;
		p->final_id = rq->id;
		job->ranks_done++;
		try_finalize(srv, job); /* commits now if the copies are done (may free job) */
		return 0;
	}
	/* retrieve: answered once the bytes are in place (or it failed) */
	p->reply_id = rq->id;
	/* no wave is taken while promotions are pending or after a failure
	 * (wave_take, plan.h), so the rest is every task here */
	if (p->promotes_pending) {
		memmove(pl.tasks, rest, n_rest * sizeof(*rest));
		p->held = pl.tasks;
		p->n_held = n_rest;
		return 0;
	}
	if (p->fail_code) {
		int code = p->fail_code;
		p->reply_id = 0;
		memmove(pl.tasks, rest, n_rest * sizeof(*rest));
		kvs_plan_free_tasks(pl.tasks, n_rest);
		job_abort(srv, job, "rank %u part refused: %s", s->rank, kvs_error_name(code));
		try_finalize(srv, job);
		return kvs__fail(srv, code, "%s; nothing was written",
				 code == KVS_E_NOSPACE ? "no room in L1 to promote L2 chunks"
				 : code == KVS_E_MISS ? "a chunk is being stored by another job"
						      : "internal failure while promoting L2 chunks");
	}
	part_submit(srv, p, rest, n_rest);
	free(pl.tasks);
	if (!p->copies_pending) {
		p->reply_id = 0;
		reply_state(srv, s, rq, KVS_JOB_OPEN);
	}
	return 0;
}

static int op_part_timed(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	uint64_t t0 = kvs_now_ns();
	int r = op_part(srv, s, rq);
	srv->jobs->st.parts++;
	srv->jobs->st.part_ns += kvs_now_ns() - t0;
	return r;
}

int kvs__op_store(kvs_server *srv, kvs_session *s, const kvs_msg *rq) { return op_part_timed(srv, s, rq); }
int kvs__op_retrieve(kvs_server *srv, kvs_session *s, const kvs_msg *rq) { return op_part_timed(srv, s, rq); }

/* ---- complete ------------------------------------------------------------------ */

int kvs__op_complete(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_jobs *J = srv->jobs;
	if (s->role != KVS_ROLE_WORKER)
		return kvs__fail(srv, KVS_E_SESSION, "only worker sessions complete job parts");
	uint8_t key[JOBKEY_BYTES];
	kvs_job_key(s->engine, rq->job, key);
	kvs_terminal *t = kvs_htab_get(J->terminal, key);
	if (t && t->world != s->world)
		return kvs__fail(srv, KVS_E_JOB_CONFLICT, "job %llu had world %u", (unsigned long long)rq->job, t->world);
	if (t) {
		uint8_t had = s->rank < t->world ? t->done[s->rank] : 0;
		if (had && had != 1 + rq->status)
			return kvs__fail(srv, KVS_E_JOB_CONFLICT, "rank %u completed job %llu with the other status",
					 s->rank, (unsigned long long)rq->job);
		reply_state(srv, s, rq, t->state);
		return 0;
	}
	kvs_job *job = kvs_htab_get(J->open, key);
	if (!job)
		return kvs__fail(srv, KVS_E_JOB_STATE, "job %llu is unknown (a job starts with a store or retrieve part)",
				 (unsigned long long)rq->job);
	if (s->rank >= job->world || job->world != s->world)
		return kvs__fail(srv, KVS_E_JOB_CONFLICT, "job %llu has world %u", (unsigned long long)rq->job, job->world);
	kvs_part *p = &job->parts[s->rank];
	if (!p->present)
		return kvs__fail(srv, KVS_E_JOB_STATE, "rank %u sent no part for job %llu", s->rank,
				 (unsigned long long)rq->job);
	if (p->completed) {
		if (p->status != rq->status)
			return kvs__fail(srv, KVS_E_JOB_CONFLICT, "rank %u already completed job %llu with the other status",
					 s->rank, (unsigned long long)rq->job);
		reply_state(srv, s, rq, job->aborting ? KVS_JOB_ABORTED : KVS_JOB_OPEN);
		return 0;
	}
	p->completed = true;
	p->status = rq->status;
	p->session = s->id;
	job->ranks_done++;
	if (rq->status == KVS_STATUS_FAILED)
		job_abort(srv, job, "rank %u reported failure", s->rank);
	uint64_t id = rq->job;
	uint8_t state = try_finalize(srv, job); /* may free job */
	kvs_msg rep = {.op = KVS_OP_COMPLETE, .id = rq->id, .ok = true, .job = id, .state = state};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	return 0;
}

/* ---- copy completions ------------------------------------------------------------ */

/* A copy task ended (completion queue, loop thread). */
static void task_done(kvs_cq_item *it)
{
	kvs_copy_task *t = (kvs_copy_task *)it; /* cq is the first member */
	kvs_part *p = t->owner;
	kvs_job *job = p->job;
	KVS_TRACE(KVS_TP_SRV_PART_DONE, 1);
	kvs_server *srv = job->srv;
	uint64_t tb = 0;
	for (uint32_t i = 0; i < t->n_segs; i++)
		tb += t->segs[i].len;
	srv->jobs->st.copy_bytes += tb;
	srv->jobs->st.copy_bytes_dir[job->kind == KVS_OP_RETRIEVE][p->reg && p->reg->dev_type == KVS_DEV_CUDA] += tb;
	if (t->result && !p->copy_err)
		p->copy_err = t->result;
	free(t->segs);
	free(t);
	if (--p->copies_pending)
		return;
	if (p->reply_id) {
		kvs_msg rep = {.op = KVS_OP_RETRIEVE, .id = p->reply_id, .ok = true, .job = job->id,
			       .state = job->aborting ? KVS_JOB_ABORTED : KVS_JOB_OPEN};
		if (p->copy_err)
			kvs__err_to_session(srv, p->session, KVS_OP_RETRIEVE, p->reply_id, KVS_E_DEVICE, "copy failed: %s",
					    p->copy_err == -EFAULT ? "host memory shrank under the copy (unsealed memfd)"
								   : kvs_strerror(p->copy_err));
		else
			kvs__send_to_session(srv, p->session, &rep);
		p->reply_id = 0;
	}
	try_finalize(srv, job);
}

/* ---- lifecycle hooks -------------------------------------------------------------- */

static void for_each_open(kvs_server *srv, bool (*pred)(kvs_server *, kvs_job *, void *), void *arg)
{
	/* collect first: finalisation edits the table */
	size_t n = kvs_htab_count(srv->jobs->open), k = 0, pos = 0;
	if (!n)
		return;
	kvs_job **list = calloc(n, sizeof(*list));
	if (!list)
		return;
	kvs_job *job;
	while ((job = kvs_htab_next(srv->jobs->open, &pos)) != NULL && k < n)
		if (pred(srv, job, arg))
			list[k++] = job;
	for (size_t i = 0; i < k; i++)
		try_finalize(srv, list[i]);
	free(list);
}

/* The ranks a job still waits for, in words (ranks.h): its deadline's reason. */
static void missing_ranks(const kvs_job *job, char *out, size_t cap)
{
	uint8_t *kind = malloc(job->world);
	for (uint32_t r = 0; kind && r < job->world; r++)
		kind[r] = job->parts[r].completed ? KVS_RANK_DONE : job->parts[r].present ? KVS_RANK_OPEN : KVS_RANK_NONE;
	kvs_ranks_missing(kind, job->world, out, cap); /* NULL: "some ranks did not report" */
	free(kind);
}

/* Aborts the jobs whose deadline passed: O(expired), from the oldest end.
 * Aborting jobs still waiting for copies stay at that end until they end. */
void kvs_jobs_tick(kvs_server *srv)
{
	kvs_job *job = srv->jobs->oldest;
	while (job && job->deadline_ms <= srv->now_ms) {
		kvs_job *next = job->newer; /* finalising frees this job, no other */
		if (!job->aborting) {
			char who[160];
			missing_ranks(job, who, sizeof(who));
			job_abort(srv, job, "deadline of %llu ms passed: %s", (unsigned long long)srv->cfg.job_deadline_ms, who);
			try_finalize(srv, job);
		}
		job = next;
	}
}

static bool gone_pred(kvs_server *srv, kvs_job *job, void *arg)
{
	const kvs_session *s = arg;
	for (uint32_t r = 0; r < job->world; r++) {
		kvs_part *p = &job->parts[r];
		if (p->session == s->id && !p->completed) {
			job_abort(srv, job, "rank %u session ended before completing", r);
			return true;
		}
	}
	return false;
}

void kvs_jobs_session_gone(kvs_server *srv, kvs_session *s)
{
	for_each_open(srv, gone_pred, s);
}

uint64_t kvs_jobs_pending(kvs_server *srv, kvs_session *s)
{
	uint64_t n = 0;
	size_t pos = 0;
	kvs_job *job;
	while ((job = kvs_htab_next(srv->jobs->open, &pos)) != NULL) {
		if (s->role == KVS_ROLE_SCHEDULER) {
			n += strcmp(job->engine, s->engine) == 0;
			continue;
		}
		for (uint32_t r = 0; r < job->world; r++)
			if (job->parts[r].session == s->id) {
				n++;
				break;
			}
	}
	return n;
}

static bool all_pred(kvs_server *srv, kvs_job *job, void *arg)
{
	job_abort(srv, job, "server shutdown");
	return true;
}

void kvs_jobs_destroy(kvs_server *srv, kvs_jobs *J)
{
	if (!J)
		return;
	for_each_open(srv, all_pred, NULL);
	/* copies and promotions still running: wait for them, then finalise */
	while (kvs_htab_count(J->open) || kvs_promote_pending(srv->promote)) {
		kvs_cq_run(srv->cq);
		if (kvs_htab_count(J->open) || kvs_promote_pending(srv->promote))
			usleep(1000);
	}
	kvs_planner_destroy(J->planner);
	for (uint32_t i = 0; i < J->count; i++)
		terminal_free(J->ring[(J->head + i) % J->cap]);
	free(J->ring);
	kvs_htab_destroy(J->open);
	kvs_htab_destroy(J->terminal);
	free(J);
}

/* An open job as job_status says it: open until terminal, aborting or not
 * ("aborted" from job_status means no copy of the job is in flight, §9.6). */
static kvs_job_info open_info(const kvs_job *job)
{
	return (kvs_job_info){.job = job->id, .state = KVS_JOB_OPEN, .ranks_done = job->ranks_done,
			      .reason = kvs_str_c(job->aborting ? job->reason : "in progress")};
}

int kvs__op_job_status(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_jobs *J = srv->jobs;
	uint32_t cap = KVS_MAX_JOBS_QUERY;
	kvs_job_info *out = calloc(cap, sizeof(*out));
	if (!out)
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	uint32_t n = 0;
	uint8_t key[JOBKEY_BYTES];
	if (rq->n_jobs) {
		for (uint32_t i = 0; i < rq->n_jobs && n < cap; i++) {
			kvs_job_key(s->engine, rq->jobs[i], key);
			kvs_job *job = kvs_htab_get(J->open, key);
			kvs_terminal *t = job ? NULL : kvs_htab_get(J->terminal, key);
			kvs_job_info *o = &out[n++];
			o->job = rq->jobs[i];
			if (job) {
				*o = open_info(job);
			} else if (t) {
				o->state = t->state;
				o->reason = kvs_str_c(t->reason);
				o->ranks_done = t->ranks_done;
			} else {
				o->state = KVS_JOB_UNKNOWN;
				o->reason = kvs_str_c("unknown job");
			}
		}
	} else {
		size_t pos = 0;
		kvs_job *job;
		while ((job = kvs_htab_next(J->open, &pos)) != NULL && n < cap) {
			if (strcmp(job->engine, s->engine) != 0)
				continue;
			out[n++] = open_info(job);
		}
	}
	kvs_msg rep = {.op = KVS_OP_JOB_STATUS, .id = rq->id, .ok = true, .job_infos = out, .n_job_infos = n};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	free(out);
	return 0;
}

/* ---- drain support (admin.c) ------------------------------------------------------ */

bool kvs_jobs_known(const kvs_jobs *J, const char *engine, uint64_t id)
{
	uint8_t key[JOBKEY_BYTES];
	kvs_job_key(engine, id, key);
	return kvs_htab_get(J->open, key) || kvs_htab_get(J->terminal, key);
}
