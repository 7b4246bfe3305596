/* Jobs across ranks, source-block retention, the terminal-id table, and the
 * L1 lookup. A job is created by its first part, runs its copies on the host
 * copy pool, and becomes terminal only when every copy has finished and
 * either every rank completed ok (commit) or something failed (abort).
 * Only then are retention, leases and L1 reservations/pins released and
 * job_done pushed, so an engine never reuses a block a copy still reads. */
#include "jobs.h"

#include <errno.h>
#include <sodium.h>
#include <stdarg.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#define KVS_LOG_COMPONENT "jobs"
#include "copy_host.h"
#include "events.h"
#if KVS_HAVE_CUDA
#include "copy_cuda.h"
#endif
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "kvs_time.h"
#include "ops.h"
#include "registry.h"

#define JOBKEY_BYTES 24 /* BLAKE2b-128(engine) || job id */

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
	uint8_t *evh;    /* store: engine block hash per object (event_hashes), or NULL */
	uint32_t n_objs;
	uint64_t retained;
	uint64_t reply_id; /* retrieve: deferred reply, 0 = none or sent */
	/* retrieve of L2-only chunks: copies are held until every promotion
	 * into L1 finished, so a failed one leaves the rank's memory untouched */
	uint32_t promotes_pending;
	int fail_code;
	kvs_copy_task **held;
	uint32_t n_held;
} kvs_part;

/* An L2 -> L1 promotion in flight (one per object), with the retrieve parts
 * waiting for it. Invariant: obj is RESERVED until the read completes. */
typedef struct kvs_promo {
	kvs_objkey key; /* table key */
	kvs_l1_obj *obj;
	kvs_part **waiters;
	uint32_t n_waiters;
} kvs_promo;

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
	char reason[64];
	uint64_t deadline_ms;
	kvs_part *parts; /* world entries, by rank */
};

/* A terminal job remembered to answer repeats. The table is bounded: the
 * oldest entry is dropped when full. */
typedef struct kvs_terminal {
	uint8_t key[JOBKEY_BYTES];
	uint64_t id;
	uint8_t state;
	char reason[64];
	uint32_t world, ranks_done;
	uint8_t *digests; /* world * 16, zero = no part from that rank */
	uint8_t *done;    /* world entries: 0 none, 1 + status */
} kvs_terminal;

typedef struct kvs_lpin {
	kvs_l1_obj *obj;
	uint64_t expires_ms;
} kvs_lpin;

struct kvs_jobs {
	kvs_htab *open;     /* kvs_job by key */
	kvs_htab *terminal; /* kvs_terminal by key */
	kvs_terminal **ring; /* FIFO of terminal entries, cap entries */
	uint32_t cap, head, count;
	uint64_t retained; /* sum of part->retained over open jobs */
	kvs_htab *promos;  /* kvs_promo by object key */
	uint32_t stage_nonce; /* pads of private staging copies (never 0) */
	kvs_lpin *lpins;   /* lookup pins (pin_ms) */
	uint32_t n_lpins, cap_lpins;
	kvs_jobs_stats st;
	uint64_t *bits;      /* scratch bitmap over block ids, all zero between uses */
	uint64_t bits_words;
};

/* ---- helpers --------------------------------------------------------------- */

static void digest16(const void *a, size_t alen, uint8_t out[16])
{
	crypto_generichash(out, 16, a, alen, NULL, 0);
}

static void job_key(const char *engine, uint64_t id, uint8_t key[JOBKEY_BYTES])
{
	digest16(engine, strlen(engine), key);
	memcpy(key + 16, &id, 8);
}

static void ns_digest(const char *ns, uint8_t out[16]) { digest16(ns, strlen(ns), out); }

static void obj_key(kvs_objkey *k, const uint8_t ns[16], uint32_t world, uint32_t rank,
		    uint32_t group, const uint8_t *chunk)
{
	memset(k, 0, sizeof(*k));
	memcpy(k->chunk, chunk, 32);
	memcpy(k->ns, ns, 16);
	k->world = world;
	k->rank = rank;
	k->group = group;
}

/* Digest of a part's content: what a repeat must match. XXH3-128, not
 * BLAKE2b: only the engine's own ranks can name its jobs, and a part carries
 * up to hundreds of KiB of block ids (BLAKE2b cost ~130 us per 16k ids). The
 * state lives on the stack: no allocation, so no failure path. */
static void part_digest(const kvs_msg *rq, uint8_t out[16])
{
	XXH3_state_t st;
	XXH3_INITSTATE(&st);
	XXH3_128bits_reset(&st);
	uint32_t op = rq->op;
	XXH3_128bits_update(&st, &op, sizeof(op));
	XXH3_128bits_update(&st, rq->keys, (size_t)rq->n_keys * KVS_KEY_BYTES);
	XXH3_128bits_update(&st, &rq->blocks.n, sizeof(rq->blocks.n));
	for (uint32_t g = 0; g < rq->blocks.n; g++) {
		XXH3_128bits_update(&st, &rq->blocks.len[g], 4);
		XXH3_128bits_update(&st, rq->blocks.ids[g], (size_t)rq->blocks.len[g] * sizeof(int64_t));
	}
	uint64_t extra[2] = {rq->skip_tokens, rq->lazy};
	XXH3_128bits_update(&st, extra, sizeof(extra));
	XXH128_hash_t h = XXH3_128bits_digest(&st);
	memcpy(out, &h, 16);
}

/* Counts the distinct non-null ids of ids[0..n) (each below nbits) in the
 * scratch bitmap, which is all zero before and after; *dup gets the index of
 * the first id seen twice, or n. 0, or -ENOMEM (nothing counted). */
static int distinct_ids(kvs_jobs *J, const int64_t *ids, uint32_t n, int64_t null_id, uint64_t nbits,
			uint64_t *ret_distinct, uint32_t *dup)
{
	uint64_t words = (nbits + 63) / 64;
	if (words > J->bits_words) {
		uint64_t *b = calloc(words, sizeof(*b));
		if (!b)
			return -ENOMEM;
		free(J->bits);
		J->bits = b;
		J->bits_words = words;
	}
	uint64_t d = 0;
	*dup = n;
	for (uint32_t i = 0; i < n; i++) {
		if (ids[i] == null_id)
			continue;
		uint64_t w = (uint64_t)ids[i] >> 6, m = 1ull << (ids[i] & 63);
		if (J->bits[w] & m) {
			if (*dup == n)
				*dup = i;
		} else {
			J->bits[w] |= m;
			d++;
		}
	}
	for (uint32_t i = 0; i < n; i++) /* back to all zero */
		if (ids[i] != null_id)
			J->bits[(uint64_t)ids[i] >> 6] = 0;
	*ret_distinct = d;
	return 0;
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
		r = kvs_htab_create(sizeof(kvs_objkey), offsetof(kvs_promo, key), &j->promos);
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
	st->pins = j->n_lpins;
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
	size_t pos = 0;
	kvs_session *s;
	while ((s = kvs_htab_next(srv->sessions, &pos)) != NULL)
		if (s->role == KVS_ROLE_SCHEDULER && strcmp(s->engine, job->engine) == 0)
			kvs__reply(srv, s->ident, s->ident_len, &m);
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
		if (++srv->jobs->stage_nonce == 0)
			srv->jobs->stage_nonce = 1;
		stage.pad = srv->jobs->stage_nonce;
		kvs_l1_rekey(srv->l1, cur, &stage);
	}
	kvs_l1_rekey(srv->l1, o, &pub);
	return true;
}

/* Tokens of the chunk an object belongs to (its group's geometry). */
static uint32_t chunk_tokens(const kvs_reg *reg, kvs_l1_obj *o)
{
	uint32_t gid = kvs_l1_key(o)->group;
	for (uint32_t g = 0; reg && g < reg->n_groups; g++)
		if (reg->groups[g].desc.id == gid)
			return reg->groups[g].desc.tokens_per_block * reg->groups[g].desc.blocks_per_chunk;
	return 0;
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
						     chunk_tokens(p->reg, p->objs[i]), KVS_TIER_EV_L1,
						     p->evh ? p->evh + (size_t)i * KVS_KEY_BYTES : NULL);
				if (srv->l2) {
					/* written behind; pinned until the writer has copied it */
					kvs_l1_obj *o = p->objs[i];
					kvs_l1_pin(srv->l1, o);
					if (kvs_l2_write(srv->l2, kvs_l1_key(o), p->geoms[i], kvs_l1_data(o),
							 kvs_l1_len(o), o) != 0)
						kvs_l1_unpin(srv->l1, o);
				}
			} else {
				kvs_l1_abort(srv->l1, p->objs[i]);
			}
		} else {
			kvs_l1_unpin(srv->l1, p->objs[i]);
		}
	}
	free(p->objs);
	free(p->geoms);
	free(p->evh);
	p->objs = NULL;
	p->geoms = NULL;
	p->evh = NULL;
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
	/* store: every object of every rank becomes visible in this one step */
	for (uint32_t r = 0; r < job->world; r++)
		part_release(srv, &job->parts[r], commit);
	kvs_htab_del(J->open, job->key);
	if (commit)
		J->st.committed++;
	else
		J->st.aborted++;
	/* one line per job is too much on the hot path: commits at debug */
	kvs_log(commit ? KVS_LOG_DEBUG : KVS_LOG_INFO, "job %llu (%s, engine '%s') %s: %s", (unsigned long long)job->id,
		kvs_op_name(job->kind), job->engine, kvs_job_state_name(state), job->reason);
	remember_terminal(J, job, state);
	push_job_done(srv, job, state);
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
	for (uint32_t r = 0; r < s->world; r++)
		job->parts[r].job = job;
	if (kvs_htab_put(srv->jobs->open, job) < 0) {
		job_free(job);
		return NULL;
	}
	return job;
}

static void reply_state(kvs_server *srv, kvs_session *s, const kvs_msg *rq, uint8_t state)
{
	kvs_msg rep = {.op = rq->op, .id = rq->id, .ok = true, .job = rq->job, .state = state};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
}

/* ---- store / retrieve ---------------------------------------------------------- */

typedef struct plan {
	kvs_l1_obj **objs;
	uint64_t *geoms;
	uint8_t *evh; /* store with event_hashes: the engine hash of each object's chunk */
	uint32_t n_objs;
	kvs_copy_task **tasks;
	uint32_t n_tasks;
	uint64_t retained;
} plan;

static void plan_undo(kvs_server *srv, plan *pl, kvs_op kind)
{
	for (uint32_t i = 0; i < pl->n_objs; i++) {
		if (kind == KVS_OP_STORE)
			kvs_l1_abort(srv->l1, pl->objs[i]);
		else
			kvs_l1_unpin(srv->l1, pl->objs[i]);
	}
	for (uint32_t i = 0; i < pl->n_tasks; i++) {
		free(pl->tasks[i]->segs);
		free(pl->tasks[i]);
	}
	free(pl->objs);
	free(pl->geoms);
	free(pl->evh);
	free(pl->tasks);
}

/* Checks the block lists against the registration: one list per group, each
 * with blocks_per_chunk ids per key; ids in range or the group's null id. */
static int check_blocks(kvs_server *srv, const kvs_reg *g, const kvs_msg *rq)
{
	if (rq->blocks.n != g->n_groups)
		return kvs__fail(srv, KVS_E_GEOMETRY, "blocks: %u lists for %u groups", rq->blocks.n, g->n_groups);
	for (uint32_t gi = 0; gi < g->n_groups; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint64_t want = (uint64_t)rq->n_keys * G->desc.blocks_per_chunk;
		if (rq->blocks.len[gi] != want)
			return kvs__fail(srv, KVS_E_GEOMETRY,
					 "blocks[%u]: %u ids, expected %llu (%u keys x %u blocks per chunk)", gi,
					 rq->blocks.len[gi], (unsigned long long)want, rq->n_keys, G->desc.blocks_per_chunk);
		for (uint32_t i = 0; i < rq->blocks.len[gi]; i++) {
			int64_t id = rq->blocks.ids[gi][i];
			if (id != G->desc.null_block && (id < 0 || (uint64_t)id >= G->num_blocks))
				return kvs__fail(srv, KVS_E_RANGE, "blocks[%u][%u]: block id %lld outside 0..%llu", gi, i,
						 (long long)id, (unsigned long long)G->num_blocks - 1);
		}
		if (rq->op != KVS_OP_RETRIEVE)
			continue;
		/* a retrieve writing one block twice would race its own copies */
		uint64_t d;
		uint32_t dup;
		if (distinct_ids(srv->jobs, rq->blocks.ids[gi], rq->blocks.len[gi], G->desc.null_block, G->num_blocks,
				 &d, &dup) != 0)
			return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
		if (dup < rq->blocks.len[gi])
			return kvs__fail(srv, KVS_E_GEOMETRY, "blocks[%u]: destination block %llu named twice", gi,
					 (unsigned long long)rq->blocks.ids[gi][dup]);
	}
	return 0;
}

static bool is_null(const kvs_reg_group *G, int64_t id) { return id == G->desc.null_block; }

/* Builds the copy tasks of a store part: reserve one L1 object per (key,
 * group) with blocks, gather its blocks layer by layer. */
static int plan_store(kvs_server *srv, kvs_session *s, const kvs_reg *g, const kvs_msg *rq, plan *pl)
{
	uint8_t ns[16];
	ns_digest(s->ns, ns);
	uint64_t max = (uint64_t)rq->n_keys * g->n_groups;
	pl->objs = calloc(max ? max : 1, sizeof(*pl->objs));
	pl->geoms = calloc(max ? max : 1, sizeof(*pl->geoms));
	pl->tasks = calloc(max ? max : 1, sizeof(*pl->tasks));
	if (!pl->objs || !pl->geoms || !pl->tasks)
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	if (rq->n_event_hashes && rq->n_event_hashes != rq->n_keys)
		return kvs__fail(srv, KVS_E_GEOMETRY, "event_hashes: %u hashes for %u keys (one per key, or none)",
				 rq->n_event_hashes, rq->n_keys);
	if (rq->n_event_hashes && !(pl->evh = calloc(max ? max : 1, KVS_KEY_BYTES)))
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	for (uint32_t gi = 0; gi < g->n_groups; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint32_t bpc = G->desc.blocks_per_chunk;
		/* retention: each distinct source block once. A part that plans
		 * copies every non-null id of the group (whole attention chunks, the
		 * one state block of a recurrent chunk), so count those. */
		uint64_t d;
		uint32_t dup;
		if (distinct_ids(srv->jobs, rq->blocks.ids[gi], rq->blocks.len[gi], G->desc.null_block, G->num_blocks,
				 &d, &dup) != 0)
			return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
		pl->retained += d;
		for (uint32_t k = 0; k < rq->n_keys; k++) {
			const int64_t *ids = rq->blocks.ids[gi] + (size_t)k * bpc;
			uint32_t nulls = 0, sel = 0;
			for (uint32_t b = 0; b < bpc; b++) {
				if (is_null(G, ids[b]))
					nulls++;
				else
					sel = b;
			}
			if (nulls == bpc)
				continue; /* nothing for this group in this chunk */
			/* attention: the whole chunk; recurrent: exactly one state block,
			 * the one at the chunk's end boundary, chosen by the engine */
			bool recurrent = G->desc.kind == KVS_GROUP_RECURRENT;
			if (recurrent && bpc - nulls != 1)
				return kvs__fail(srv, KVS_E_GEOMETRY,
						 "blocks[%u]: recurrent group %u carries %u state blocks for chunk %u, exactly one expected",
						 gi, G->desc.id, bpc - nulls, k);
			if (!recurrent && nulls)
				return kvs__fail(srv, KVS_E_GEOMETRY, "blocks[%u]: chunk %u mixes null and real blocks", gi, k);
			uint32_t b0 = recurrent ? sel : 0, b1 = recurrent ? sel + 1 : bpc;
			kvs_objkey key;
			obj_key(&key, ns, s->world, s->rank, G->desc.id, rq->keys + (size_t)k * KVS_KEY_BYTES);
			kvs_l1_obj *o;
			int r = kvs_l1_reserve(srv->l1, &key, G->obj_bytes, &o);
			if (r == -EEXIST) {
				srv->jobs->st.store_skipped++;
				continue; /* already cached */
			}
			if (r == -EBUSY) {
				/* another job is storing it: keep a private staging copy so
				 * this job commits on its own whatever that one does */
				if (++srv->jobs->stage_nonce == 0)
					srv->jobs->stage_nonce = 1;
				key.pad = srv->jobs->stage_nonce;
				r = kvs_l1_reserve(srv->l1, &key, G->obj_bytes, &o);
				if (r == 0)
					srv->jobs->st.store_staged++;
			}
			if (r)
				return kvs__fail(srv, r == KVS_E_NOSPACE ? KVS_E_NOSPACE : KVS_E_INTERNAL,
						 "L1 cannot hold %llu more bytes: %s",
						 (unsigned long long)G->obj_bytes, kvs_strerror(r));
			pl->geoms[pl->n_objs] = G->geom;
			if (pl->evh)
				memcpy(pl->evh + (size_t)pl->n_objs * KVS_KEY_BYTES,
				       rq->event_hashes + (size_t)k * KVS_KEY_BYTES, KVS_KEY_BYTES);
			pl->objs[pl->n_objs++] = o;
			kvs_copy_task *t = calloc(1, sizeof(*t));
			kvs_copy_seg *segs = calloc((size_t)G->n_layers * bpc, sizeof(*segs));
			if (!t || !segs) {
				free(t);
				free(segs);
				return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
			}
			uint8_t *dst = kvs_l1_data(o);
			uint32_t n = 0;
			for (uint32_t li = 0; li < G->n_layers; li++) {
				const kvs_view *v = &g->views[G->layers[li]];
				for (uint32_t b = b0; b < b1; b++) {
					const uint8_t *src = v->base + (uint64_t)ids[b] * v->stride;
					/* merge runs of adjacent blocks into one copy */
					if (n && (const uint8_t *)segs[n - 1].src + segs[n - 1].len == src &&
					    (uint8_t *)segs[n - 1].dst + segs[n - 1].len == dst) {
						segs[n - 1].len += v->block_bytes;
					} else {
						segs[n++] = (kvs_copy_seg){dst, src, v->block_bytes};
					}
					dst += v->block_bytes;
				}
			}
			t->segs = segs;
			t->n_segs = n;
			t->obj = o;
			pl->tasks[pl->n_tasks++] = t;
		}
	}
	return 0;
}

/* Promotions (L2 -> L1). */

static void promo_wait(kvs_promo *pr, kvs_part *p)
{
	kvs_part **w = realloc(pr->waiters, (pr->n_waiters + 1) * sizeof(*w));
	if (!w) {
		/* cannot wait: the part fails cleanly when the promotion ends */
		p->fail_code = KVS_E_INTERNAL;
		return;
	}
	pr->waiters = w;
	pr->waiters[pr->n_waiters++] = p;
	p->promotes_pending++;
}

/* Starts (or finds) the promotion of key. Returns NULL (with *err) if L1 has
 * no room or memory runs out. */
static kvs_promo *promo_start(kvs_server *srv, const kvs_objkey *key, uint64_t geom, uint64_t len, int *err)
{
	kvs_promo *pr = kvs_htab_get(srv->jobs->promos, key);
	if (pr)
		return pr;
	pr = calloc(1, sizeof(*pr));
	if (!pr) {
		*err = KVS_E_INTERNAL;
		return NULL;
	}
	pr->key = *key;
	int r = kvs_l1_reserve(srv->l1, key, len, &pr->obj);
	if (r) {
		free(pr);
		/* -EBUSY: a store of the same object is in flight: not available yet */
		*err = r == KVS_E_NOSPACE ? KVS_E_NOSPACE : r == -EBUSY ? KVS_E_MISS : KVS_E_INTERNAL;
		return NULL;
	}
	if (kvs_htab_put(srv->jobs->promos, pr) < 0 ||
	    kvs_l2_read(srv->l2, key, geom, kvs_l1_data(pr->obj), len, pr) != 0) {
		kvs_htab_del(srv->jobs->promos, key);
		kvs_l1_abort(srv->l1, pr->obj);
		free(pr);
		*err = KVS_E_INTERNAL;
		return NULL;
	}
	srv->jobs->st.promotions++;
	return pr;
}

/* Hands a part's tasks to the registration's copy engine: one batch on its
 * CUDA stream for device memory (one launch, one completion), the host pool
 * for memfds. */
static void engine_submit(kvs_server *srv, const kvs_reg *g, kvs_copy_task **tasks, uint32_t n,
			  const kvs_bytes *event)
{
#if KVS_HAVE_CUDA
	if (g->stream) {
		if (n)
			kvs_cuda_submit(srv->cuda, g->stream, tasks, n, event ? event->ptr : NULL, event ? event->len : 0);
		return;
	}
#endif
	(void)g;
	(void)event;
	for (uint32_t i = 0; i < n; i++)
		kvs_copy_pool_submit(srv->pool, tasks[i]);
}

static void part_submit(kvs_server *srv, kvs_part *p, kvs_copy_task **tasks, uint32_t n)
{
	p->copies_pending += n;
	srv->jobs->st.retrieve_objects += n;
	for (uint32_t i = 0; i < n; i++)
		tasks[i]->owner = p;
	engine_submit(srv, p->reg, tasks, n, NULL);
}

static void free_tasks(kvs_copy_task **tasks, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		free(tasks[i]->segs);
		free(tasks[i]);
	}
	free(tasks);
}

/* A retrieve part whose promotions all ended: fail it or release its copies. */
static void part_promoted(kvs_server *srv, kvs_part *p)
{
	kvs_job *job = p->job;
	if (p->fail_code) {
		free_tasks(p->held, p->n_held);
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

static void promo_done(kvs_server *srv, kvs_promo *pr, int result)
{
	kvs_htab_del(srv->jobs->promos, &pr->key);
	if (result == 0) {
		kvs_l1_commit(srv->l1, pr->obj);
	} else {
		kvs_l1_abort(srv->l1, pr->obj);
		srv->jobs->st.promotion_failures++;
	}
	for (uint32_t i = 0; i < pr->n_waiters; i++) {
		kvs_part *p = pr->waiters[i];
		if (result == 0) {
			kvs_l1_pin(srv->l1, pr->obj);
			p->objs[p->n_objs++] = pr->obj;
		} else if (!p->fail_code) {
			p->fail_code = KVS_E_MISS;
		}
		if (--p->promotes_pending == 0)
			part_promoted(srv, p);
	}
	free(pr->waiters);
	free(pr);
}

/* Where a retrieve finds one object: in L1, or only in L2 (len given). */
static int locate(kvs_server *srv, const kvs_objkey *key, uint64_t geom, uint64_t want_len, kvs_l1_obj **ret_l1)
{
	*ret_l1 = kvs_l1_get(srv->l1, key);
	if (*ret_l1) {
		/* an object of another layout (the namespace re-registered with a
		 * different geometry) is never copied from: a miss */
		if (kvs_l1_len(*ret_l1) != want_len) {
			*ret_l1 = NULL;
			return KVS_E_MISS;
		}
		return 0;
	}
	if (kvs_htab_get(srv->jobs->promos, key))
		return 0; /* being promoted right now */
	uint64_t len = 0;
	if (srv->l2 && kvs_l2_contains(srv->l2, key, geom, &len) == 0 && len == want_len)
		return 0;
	return KVS_E_MISS;
}

/* Which blocks of chunk k (of n) a retrieve writes for group G: attention
 * writes every chunk (a windowed group only its trailing window_chunks),
 * recurrent groups only the state of the last chunk, into its one non-null
 * destination block; blocks wholly inside skip_tokens and null ids are not
 * written. Returns how many; -1 if the last chunk of a recurrent group does
 * not name exactly one destination block. */
static int wanted(const kvs_reg_group *G, uint32_t n, uint32_t k, const int64_t *ids, uint64_t skip,
		  bool *want)
{
	uint32_t bpc = G->desc.blocks_per_chunk;
	uint64_t tpb = G->desc.tokens_per_block;
	int cnt = 0;
	memset(want, 0, bpc * sizeof(*want));
	if (G->desc.kind == KVS_GROUP_RECURRENT) {
		if (k != n - 1)
			return 0;
		int sel = -1, nn = 0;
		for (uint32_t b = 0; b < bpc; b++)
			if (!is_null(G, ids[b]))
				sel = (int)b, nn++;
		if (nn != 1)
			return -1;
		if (((uint64_t)k + 1) * bpc * tpb <= skip)
			return 0;
		want[sel] = true;
		return 1;
	}
	if (G->desc.window_chunks > 0 && (int64_t)k < (int64_t)n - G->desc.window_chunks)
		return 0;
	for (uint32_t b = 0; b < bpc; b++) {
		want[b] = !is_null(G, ids[b]) && ((uint64_t)k * bpc + b + 1) * tpb > skip;
		cnt += want[b];
	}
	return cnt;
}

/* Builds the copy tasks of a retrieve part. Every needed object must be in
 * L1 or L2 (else E_MISS, nothing touched). Objects only in L2 are promoted
 * into L1 first; the part's copies are then held until every promotion has
 * ended. Blocks wholly inside skip_tokens and null destination ids are not
 * written. */
static int plan_retrieve(kvs_server *srv, kvs_session *s, const kvs_reg *g, const kvs_msg *rq, plan *pl,
			 kvs_part *p)
{
	uint8_t ns[16];
	ns_digest(s->ns, ns);
	uint64_t max = (uint64_t)rq->n_keys * g->n_groups;
	/* pass 1: presence only, no side effects */
	for (uint32_t gi = 0; gi < g->n_groups; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint32_t bpc = G->desc.blocks_per_chunk;
		if (bpc > 4096)
			return kvs__fail(srv, KVS_E_LIMIT, "blocks_per_chunk above 4096");
		for (uint32_t k = 0; k < rq->n_keys; k++) {
			const int64_t *ids = rq->blocks.ids[gi] + (size_t)k * bpc;
			bool want[4096];
			int nw = wanted(G, rq->n_keys, k, ids, rq->skip_tokens, want);
			if (nw < 0)
				return kvs__fail(srv, KVS_E_GEOMETRY,
						 "blocks[%u]: recurrent group %u needs exactly one destination block in the last chunk",
						 gi, G->desc.id);
			if (!nw)
				continue;
			kvs_objkey key;
			kvs_l1_obj *o;
			obj_key(&key, ns, s->world, s->rank, G->desc.id, rq->keys + (size_t)k * KVS_KEY_BYTES);
			if (locate(srv, &key, G->geom, G->obj_bytes, &o) != 0)
				return kvs__fail(srv, KVS_E_MISS, "chunk %u of group %u is not cached", k, G->desc.id);
		}
	}
	p->objs = calloc(max ? max : 1, sizeof(*p->objs));
	pl->tasks = calloc(max ? max : 1, sizeof(*pl->tasks));
	if (!p->objs || !pl->tasks)
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	/* pass 2: pin what is in L1, promote the rest, build the copies */
	for (uint32_t gi = 0; gi < g->n_groups && !p->fail_code; gi++) {
		const kvs_reg_group *G = &g->groups[gi];
		uint32_t bpc = G->desc.blocks_per_chunk;
		bool recurrent = G->desc.kind == KVS_GROUP_RECURRENT;
		for (uint32_t k = 0; k < rq->n_keys && !p->fail_code; k++) {
			const int64_t *ids = rq->blocks.ids[gi] + (size_t)k * bpc;
			bool want[4096];
			int nw = wanted(G, rq->n_keys, k, ids, rq->skip_tokens, want);
			if (nw <= 0)
				continue;
			uint32_t n_want = (uint32_t)nw;
			kvs_objkey key;
			obj_key(&key, ns, s->world, s->rank, G->desc.id, rq->keys + (size_t)k * KVS_KEY_BYTES);
			kvs_l1_obj *o = kvs_l1_get(srv->l1, &key);
			const uint8_t *src;
			if (o && kvs_l1_len(o) != G->obj_bytes) {
				p->fail_code = KVS_E_MISS; /* checked in pass 1; defensive */
				break;
			}
			if (o) {
				kvs_l1_pin(srv->l1, o);
				kvs_l1_touch(srv->l1, o);
				p->objs[p->n_objs++] = o;
				src = kvs_l1_data(o);
			} else {
				int err = 0;
				kvs_promo *pr = promo_start(srv, &key, G->geom, G->obj_bytes, &err);
				if (!pr) {
					p->fail_code = err;
					break;
				}
				promo_wait(pr, p);
				src = kvs_l1_data(pr->obj);
				kvs_l2_touch(srv->l2, &key);
			}
			kvs_copy_task *t = calloc(1, sizeof(*t));
			kvs_copy_seg *segs = calloc((size_t)G->n_layers * n_want, sizeof(*segs));
			if (!t || !segs) {
				free(t);
				free(segs);
				p->fail_code = KVS_E_INTERNAL;
				break;
			}
			uint32_t n = 0;
			for (uint32_t li = 0; li < G->n_layers; li++) {
				const kvs_view *v = &g->views[G->layers[li]];
				for (uint32_t b = 0; b < bpc; b++) {
					if (!want[b]) {
						if (!recurrent)
							src += v->block_bytes;
						continue;
					}
					uint8_t *dst = v->base + (uint64_t)ids[b] * v->stride;
					const uint8_t *from = src;
					src += v->block_bytes;
					if (n && (const uint8_t *)segs[n - 1].src + segs[n - 1].len == from &&
					    (uint8_t *)segs[n - 1].dst + segs[n - 1].len == dst)
						segs[n - 1].len += v->block_bytes;
					else
						segs[n++] = (kvs_copy_seg){dst, from, v->block_bytes};
				}
			}
			t->segs = segs;
			t->n_segs = n;
			pl->tasks[pl->n_tasks++] = t;
		}
	}
	return 0;
}

/* Store and retrieve share everything but the plan. */
static int op_part(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_jobs *J = srv->jobs;
	uint8_t key[JOBKEY_BYTES], dg[16];
	job_key(s->engine, rq->job, key);
	part_digest(rq, dg);
	if (s->role != KVS_ROLE_WORKER)
		return kvs__fail(srv, KVS_E_SESSION, "only worker sessions send job parts");

	kvs_terminal *t = kvs_htab_get(J->terminal, key);
	if (t && t->world != s->world)
		return kvs__fail(srv, KVS_E_JOB_CONFLICT, "job %llu had world %u", (unsigned long long)rq->job, t->world);
	if (t) {
		static const uint8_t zero[16];
		const uint8_t *had = s->rank < t->world ? t->digests + 16 * s->rank : zero;
		if (memcmp(had, zero, 16) != 0 && memcmp(had, dg, 16) != 0)
			return kvs__fail(srv, KVS_E_JOB_CONFLICT, "job %llu is terminal with other content from rank %u",
					 (unsigned long long)rq->job, s->rank);
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
	int r = g ? check_blocks(srv, g, rq) : kvs__fail(srv, KVS_E_NOREG, "session has no registration");
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
		if (!job)
			return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	}
	kvs_part *p = &job->parts[s->rank];
	p->present = true;
	p->session = s->id;
	memcpy(p->digest, dg, 16);
	plan pl = {0};
	if (!r)
		r = rq->op == KVS_OP_STORE ? plan_store(srv, s, g, rq, &pl) : plan_retrieve(srv, s, g, rq, &pl, p);
	if (r) {
		plan_undo(srv, &pl, rq->op);
		job_abort(srv, job, "rank %u part refused: %s", s->rank, kvs_error_name(r));
		try_finalize(srv, job);
		return r;
	}
	p->reg = g;
	kvs_reg_lease(g);
	if (rq->op == KVS_OP_STORE) {
		p->objs = pl.objs;
		p->geoms = pl.geoms;
		p->evh = pl.evh;
		p->n_objs = pl.n_objs;
		p->retained = pl.retained;
		J->retained += pl.retained;
		p->copies_pending = pl.n_tasks;
		J->st.store_objects += pl.n_tasks;
		for (uint32_t i = 0; i < pl.n_tasks; i++)
			pl.tasks[i]->owner = p;
		engine_submit(srv, g, pl.tasks, pl.n_tasks, rq->producer_event.len ? &rq->producer_event : NULL);
		free(pl.tasks);
		reply_state(srv, s, rq, KVS_JOB_OPEN);
		return 0;
	}
	/* retrieve: answered once the bytes are in place (or it failed) */
	p->reply_id = rq->id;
	if (p->promotes_pending) {
		p->held = pl.tasks;
		p->n_held = pl.n_tasks;
		return 0;
	}
	if (p->fail_code) {
		int code = p->fail_code;
		p->reply_id = 0;
		free_tasks(pl.tasks, pl.n_tasks);
		job_abort(srv, job, "rank %u part refused: %s", s->rank, kvs_error_name(code));
		try_finalize(srv, job);
		return kvs__fail(srv, code, "%s; nothing was written",
				 code == KVS_E_NOSPACE ? "no room in L1 to promote L2 chunks"
				 : code == KVS_E_MISS ? "a chunk is being stored by another job"
						      : "internal failure while promoting L2 chunks");
	}
	part_submit(srv, p, pl.tasks, pl.n_tasks);
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
	job_key(s->engine, rq->job, key);
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

static void l2_completions(kvs_server *srv)
{
	kvs_l2_done d[256];
	uint32_t n;
	while (srv->l2 && (n = kvs_l2_reap(srv->l2, d, 256)) > 0) {
		for (uint32_t i = 0; i < n; i++) {
			if (d[i].op == KVS_L2_EVICTED) {
				kvs_events_removed(srv->events, &d[i].key, KVS_TIER_EV_L2);
			} else if (d[i].op == KVS_L2_WRITE) {
				if (d[i].result == 0)
					kvs_events_stored(srv->events, &d[i].key, 0, KVS_TIER_EV_L2);
				kvs_l1_unpin(srv->l1, d[i].cookie); /* written (or dropped) */
			} else {
				promo_done(srv, d[i].cookie, d[i].result);
			}
		}
	}
}

void kvs_jobs_completions(kvs_server *srv)
{
	l2_completions(srv);
	kvs_copy_task *t = kvs_copy_pool_reap(srv->pool);
#if KVS_HAVE_CUDA
	if (srv->cuda) {
		kvs_copy_task *c = kvs_cuda_reap(srv->cuda);
		while (c) {
			kvs_copy_task *n = c->next;
			c->next = t;
			t = c;
			c = n;
		}
	}
#endif
	while (t) {
		kvs_copy_task *next = t->next;
		kvs_part *p = t->owner;
		kvs_job *job = p->job;
		uint64_t tb = 0;
		for (uint32_t i = 0; i < t->n_segs; i++)
			tb += t->segs[i].len;
		srv->jobs->st.copy_bytes += tb;
		srv->jobs->st.copy_bytes_dir[job->kind == KVS_OP_RETRIEVE][p->reg && p->reg->stream != NULL] += tb;
		if (t->result && !p->copy_err)
			p->copy_err = t->result;
		free(t->segs);
		free(t);
		if (--p->copies_pending == 0) {
			if (p->reply_id) {
				kvs_msg rep = {.op = KVS_OP_RETRIEVE, .id = p->reply_id, .ok = true, .job = job->id,
					       .state = job->aborting ? KVS_JOB_ABORTED : KVS_JOB_OPEN};
				if (p->copy_err)
					kvs__err_to_session(srv, p->session, KVS_OP_RETRIEVE, p->reply_id, KVS_E_DEVICE,
							    "copy failed: %s", p->copy_err == -EFAULT
							    ? "host memory shrank under the copy (unsealed memfd)"
							    : kvs_strerror(p->copy_err));
				else
					kvs__send_to_session(srv, p->session, &rep);
				p->reply_id = 0;
			}
			try_finalize(srv, job);
		}
		t = next;
	}
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

static bool expire_pred(kvs_server *srv, kvs_job *job, void *arg)
{
	if (job->aborting || job->deadline_ms > srv->now_ms)
		return false;
	job_abort(srv, job, "deadline of %llu ms passed", (unsigned long long)srv->cfg.job_deadline_ms);
	return true;
}

void kvs_jobs_tick(kvs_server *srv)
{
	for_each_open(srv, expire_pred, NULL);
	kvs_jobs *J = srv->jobs;
	for (uint32_t i = 0; i < J->n_lpins;) {
		if (J->lpins[i].expires_ms <= srv->now_ms) {
			kvs_l1_unpin(srv->l1, J->lpins[i].obj);
			J->lpins[i] = J->lpins[--J->n_lpins];
		} else {
			i++;
		}
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
	while (kvs_htab_count(J->open) || kvs_htab_count(J->promos)) {
		kvs_jobs_completions(srv);
		if (kvs_htab_count(J->open) || kvs_htab_count(J->promos))
			usleep(1000);
	}
	for (uint32_t i = 0; i < J->n_lpins; i++)
		kvs_l1_unpin(srv->l1, J->lpins[i].obj);
	free(J->lpins);
	free(J->bits);
	for (uint32_t i = 0; i < J->count; i++)
		terminal_free(J->ring[(J->head + i) % J->cap]);
	free(J->ring);
	kvs_htab_destroy(J->open);
	kvs_htab_destroy(J->terminal);
	kvs_htab_destroy(J->promos);
	free(J);
}

/* ---- lookup and job_status ------------------------------------------------------------ */

/* The object geometry of a namespace and world: what lookup needs. */
typedef struct kvs_geo {
	uint32_t n;
	struct {
		uint32_t id;
		uint32_t kind;   /* enum kvs_group_kind */
		int64_t window;  /* -1 = full */
		uint64_t geom, obj_bytes;
	} g[KVS_MAX_GROUPS];
} kvs_geo;

static void geo_key(uint8_t out[20], const char *ns, uint32_t world)
{
	ns_digest(ns, out);
	memcpy(out + 16, &world, 4);
}

void kvs_jobs_registered(kvs_server *srv, const kvs_reg *g)
{
	if (!srv->l2)
		return;
	kvs_geo geo;
	memset(&geo, 0, sizeof(geo));
	geo.n = g->n_groups;
	for (uint32_t i = 0; i < g->n_groups; i++) {
		geo.g[i].id = g->groups[i].desc.id;
		geo.g[i].kind = g->groups[i].desc.kind;
		geo.g[i].window = g->groups[i].desc.window_chunks;
		geo.g[i].geom = g->groups[i].geom;
		geo.g[i].obj_bytes = g->groups[i].obj_bytes;
	}
	uint8_t key[20];
	geo_key(key, g->ns, g->world);
	kvs_l2_put_meta(srv->l2, key, sizeof(key), &geo, sizeof(geo));
}

/* From a live registration of the namespace, else from what L2 remembers. */
static bool geo_of(kvs_server *srv, kvs_session *s, kvs_geo *geo)
{
	kvs_reg *g = kvs_registry_of_session(srv->reg, s->id);
	if (!g)
		g = kvs_registry_find_ns(srv->reg, s->ns, s->world);
	if (g) {
		geo->n = g->n_groups;
		for (uint32_t i = 0; i < g->n_groups; i++) {
			geo->g[i].id = g->groups[i].desc.id;
			geo->g[i].kind = g->groups[i].desc.kind;
			geo->g[i].window = g->groups[i].desc.window_chunks;
			geo->g[i].geom = g->groups[i].geom;
			geo->g[i].obj_bytes = g->groups[i].obj_bytes;
		}
		return true;
	}
	uint8_t key[20];
	uint32_t len = 0;
	geo_key(key, s->ns, s->world);
	return srv->l2 && kvs_l2_get_meta(srv->l2, key, sizeof(key), geo, sizeof(*geo), &len) == 0 &&
	       len == sizeof(*geo) && geo->n <= KVS_MAX_GROUPS;
}

static void lookup_pin(kvs_server *srv, kvs_l1_obj *o, uint64_t pin_ms)
{
	kvs_jobs *J = srv->jobs;
	if (J->n_lpins >= 1u << 20)
		return;
	if (J->n_lpins == J->cap_lpins) {
		uint32_t nc = J->cap_lpins ? 2 * J->cap_lpins : 256;
		kvs_lpin *np = realloc(J->lpins, nc * sizeof(*np));
		if (!np)
			return;
		J->lpins = np;
		J->cap_lpins = nc;
	}
	kvs_l1_pin(srv->l1, o);
	J->lpins[J->n_lpins++] = (kvs_lpin){o, srv->now_ms + pin_ms};
}

/* Does chunk k of group gi need to be present for a hit of n chunks? */
static bool needed(const kvs_geo *geo, uint32_t gi, uint32_t n, uint32_t k)
{
	if (geo->g[gi].kind == KVS_GROUP_RECURRENT)
		return k == n - 1; /* the state at the end of chunk n, nothing else */
	if (geo->g[gi].window > 0)
		return (int64_t)k >= (int64_t)n - geo->g[gi].window;
	return true;
}

/* present[gi * n_keys + k]: -1 unknown, 0 absent, 1 in L1 on every rank, 2 some rank only in L2 */
static int8_t presence(kvs_server *srv, kvs_session *s, const kvs_geo *geo, const uint8_t ns[16],
		       const uint8_t *keys, uint32_t gi, uint32_t k)
{
	int8_t v = 1;
	for (uint32_t r = 0; r < s->world && v; r++) {
		kvs_objkey key;
		kvs_l1_obj *o;
		obj_key(&key, ns, s->world, r, geo->g[gi].id, keys + (size_t)k * KVS_KEY_BYTES);
		if (locate(srv, &key, geo->g[gi].geom, geo->g[gi].obj_bytes, &o) != 0)
			v = 0;
		else if (!o)
			v = 2;
	}
	return v;
}

/* A prefix of n chunks hits only if, on every rank, every full-attention
 * group has all n chunks, every windowed group its last window_chunks of
 * them, and every recurrent group the state at the end of chunk n: state
 * from one prefix length is never spliced with attention KV of another. */
int kvs__op_lookup(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_jobs *J = srv->jobs;
	J->st.lookups++;
	J->st.lookup_keys += rq->n_keys;
	kvs_geo geo;
	bool known = geo_of(srv, s, &geo);
	uint32_t N = rq->n_keys;
	uint8_t *tiers = calloc(N ? N : 1, 1);
	int8_t *pres = known ? malloc((size_t)geo.n * (N ? N : 1)) : NULL;
	if (!tiers || (known && !pres)) {
		free(tiers);
		free(pres);
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	}
	uint8_t ns[16];
	ns_digest(s->ns, ns);
	uint64_t hits = 0;
	if (known) {
		memset(pres, -1, (size_t)geo.n * N);
#define PRES(gi, k) (pres[(gi) * N + (k)] >= 0 ? pres[(gi) * N + (k)] \
		     : (pres[(gi) * N + (k)] = presence(srv, s, &geo, ns, rq->keys, (gi), (k))))
		/* upper bound: the leading run every full-attention group has */
		uint32_t A = N;
		for (uint32_t gi = 0; gi < geo.n; gi++)
			if (geo.g[gi].kind == KVS_GROUP_ATTENTION && geo.g[gi].window < 0)
				for (uint32_t k = 0; k < A; k++)
					if (!PRES(gi, k)) {
						A = k;
						break;
					}
		for (uint32_t n = A; n >= 1 && !hits; n--) {
			bool ok = true;
			for (uint32_t gi = 0; gi < geo.n && ok; gi++) {
				if (geo.g[gi].kind == KVS_GROUP_ATTENTION && geo.g[gi].window < 0)
					continue; /* covered by A */
				for (uint32_t k = 0; k < n && ok; k++)
					if (needed(&geo, gi, n, k))
						ok = PRES(gi, k) != 0;
			}
			if (ok)
				hits = n;
		}
#undef PRES
	}
	/* tiers; refresh, pin (pin_ms) and prefetch (L2 -> L1) what the hit needs */
	for (uint32_t k = 0; k < hits; k++) {
		tiers[k] = KVS_TIER_L1;
		for (uint32_t gi = 0; gi < geo.n; gi++) {
			if (!needed(&geo, gi, (uint32_t)hits, k))
				continue;
			if (pres[gi * N + k] == 2)
				tiers[k] = KVS_TIER_L2;
			for (uint32_t r = 0; r < s->world; r++) {
				kvs_objkey key;
				obj_key(&key, ns, s->world, r, geo.g[gi].id, rq->keys + (size_t)k * KVS_KEY_BYTES);
				kvs_l1_obj *o = kvs_l1_get(srv->l1, &key);
				if (o) {
					kvs_l1_touch(srv->l1, o);
					if (rq->pin_ms)
						lookup_pin(srv, o, rq->pin_ms);
				} else if (srv->l2) {
					kvs_l2_touch(srv->l2, &key);
					int err;
					if (rq->prefetch && !kvs_htab_get(J->promos, &key) &&
					    promo_start(srv, &key, geo.g[gi].geom, geo.g[gi].obj_bytes, &err))
						J->st.prefetches++;
				}
			}
		}
		J->st.lookup_hits_l2 += tiers[k] == KVS_TIER_L2;
	}
	J->st.lookup_hits += hits;
	kvs_msg rep = {.op = KVS_OP_LOOKUP, .id = rq->id, .ok = true, .hits = hits, .tiers = tiers,
		       .n_tiers = (uint32_t)hits};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	free(tiers);
	free(pres);
	return 0;
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
			job_key(s->engine, rq->jobs[i], key);
			kvs_job *job = kvs_htab_get(J->open, key);
			kvs_terminal *t = job ? NULL : kvs_htab_get(J->terminal, key);
			kvs_job_info *o = &out[n++];
			o->job = rq->jobs[i];
			if (job) {
				o->state = job->aborting ? KVS_JOB_ABORTED : KVS_JOB_OPEN;
				o->reason = kvs_str_c(job->aborting ? job->reason : "in progress");
				o->ranks_done = job->ranks_done;
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
			out[n++] = (kvs_job_info){.job = job->id,
						  .state = job->aborting ? KVS_JOB_ABORTED : KVS_JOB_OPEN,
						  .reason = kvs_str_c(job->aborting ? job->reason : "in progress"),
						  .ranks_done = job->ranks_done};
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
	job_key(engine, id, key);
	return kvs_htab_get(J->open, key) || kvs_htab_get(J->terminal, key);
}
