/* Hybrid KV caches end to end (docs/design.md §6): the real server, 4 real rank
 * processes with a hybrid layout (full attention, sliding-window attention,
 * three recurrent state groups; padded strides; gaps between views) and a
 * scheduler client. The test keeps a shared mapping of every rank's memfd
 * region: before each retrieve the whole region is poisoned, afterwards
 * every byte is compared with an exact expectation (written blocks equal
 * their sources, everything else — windowed chunks outside the window,
 * recurrent states of non-last chunks, skipped blocks, stride padding, gaps
 * — still poisoned). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "harness.h"
#include "hybrid_rank.h"
#include "rank.h"

#define W 4
#define NS "hybrid-model"

/* group indices (registration order) of HR_HYBRID */
enum { G_FULL = 0, G_WIN = 1, G_R2 = 2, G_R3 = 3, G_R4 = 4 };
static const uint32_t BPC[HR_MAX_GROUPS] = {4, 4, 1, 1, 2};
#define WINDOW 2
#define CHUNK_TOKENS 64

/* Block conventions: chunk c of a prompt is stored from attention blocks
 * SRC_ATT(c).. (both attention groups) and, where a state is stored, from
 * recurrent block SRC_REC(c); retrieve writes relative chunk k to DST_ATT(k)..
 * and DST_REC(k). Group 4 has two slots per chunk; the state sits in slot 1
 * unless a test says otherwise. */
#define SRC_ATT(c) (4 * (int64_t)(c))
#define SRC_REC(c) (1 + (int64_t)(c))
#define DST_ATT(k) (32 + 4 * (int64_t)(k))
#define DST_REC(k) (12 + (int64_t)(k))

typedef struct world {
	kvt_server s;
	hr_rank r[W];
	kvs_client *sched;
} world;

static void world_up(world *w)
{
	kvt_server_init(&w->s, "--ttl-ms", "3000", "--heartbeat-ms", "100", "--job-deadline-ms", "60000",
			"--drain-ms", "2000", "--l1-size", "64M", NULL);
	ck_assert_int_eq(kvt_server_start(&w->s), 0);
	for (uint32_t i = 0; i < W; i++)
		ck_assert_int_eq(hr_rank_start(&w->r[i], &w->s, "H", NS, HR_HYBRID, i, W, 100 + i), 0);
	w->sched = kvt_client_ns(&w->s, "H", NS, KVS_ROLE_SCHEDULER, 0, W);
	ck_assert_ptr_nonnull(w->sched);
	ck_assert_uint_eq(kvt_stat(w->sched, "registrations"), W);
}

static void world_down(world *w)
{
	for (uint32_t i = 0; i < W; i++)
		hr_rank_stop(&w->r[i]);
	kvs_client_close(w->sched);
	ck_assert_int_eq(kvt_server_stop(&w->s), 0);
	kvt_server_cleanup(&w->s);
}

static uint64_t ctr(world *w, const char *name)
{
	uint64_t v = kvt_stat(w->sched, name);
	ck_assert_msg(v != UINT64_MAX, "no counter %s", name);
	return v;
}

/* ---- commands ------------------------------------------------------------------ */

/* Every id null: -1 for attention, HR_REC_NULL for recurrent groups. */
static hr_cmd cmd_new(int op, uint64_t job, uint32_t prompt, uint32_t first, uint32_t n)
{
	hr_cmd c;
	memset(&c, 0, sizeof(c));
	c.op = op;
	c.job = job;
	c.prompt = prompt;
	c.first_key = first;
	c.n_keys = n;
	for (uint32_t gi = 0; gi < HR_MAX_GROUPS; gi++) {
		c.len[gi] = n * BPC[gi];
		for (uint32_t i = 0; i < HR_MAX_IDS; i++)
			c.ids[gi][i] = gi < 2 ? -1 : HR_REC_NULL;
	}
	return c;
}

/* Chunk k of an attention group: blocks base..base+3, or all null (base < 0). */
static void att(hr_cmd *c, uint32_t gi, uint32_t k, int64_t base)
{
	for (uint32_t b = 0; b < 4; b++)
		c->ids[gi][k * 4 + b] = base < 0 ? -1 : base + b;
}

/* Chunk k of a recurrent group: id in slot (group 4 has slots 0 and 1). */
static void rec(hr_cmd *c, uint32_t gi, uint32_t k, uint32_t slot, int64_t id)
{
	c->ids[gi][k * BPC[gi] + slot] = id;
}

static void rec_all(hr_cmd *c, uint32_t k, int64_t id)
{
	rec(c, G_R2, k, 0, id);
	rec(c, G_R3, k, 0, id);
	rec(c, G_R4, k, 1, id);
}

/* Store of keys first..first+n-1: attention chunks from SRC_ATT, a recurrent
 * state (all three groups) at the chunks whose bit is set in rec_mask (bit =
 * absolute chunk index). */
static hr_cmd std_store(uint64_t job, uint32_t prompt, uint32_t first, uint32_t n, uint32_t rec_mask)
{
	hr_cmd c = cmd_new(HR_STORE, job, prompt, first, n);
	for (uint32_t k = 0; k < n; k++) {
		uint32_t ch = first + k;
		att(&c, G_FULL, k, SRC_ATT(ch));
		att(&c, G_WIN, k, SRC_ATT(ch));
		if (rec_mask >> ch & 1)
			rec_all(&c, k, SRC_REC(ch));
	}
	return c;
}

/* Retrieve of keys first..first+n-1 with a non-null destination for every
 * block of every chunk and group (recurrent ones included). */
static hr_cmd std_retrieve(uint64_t job, uint32_t prompt, uint32_t first, uint32_t n, uint64_t skip)
{
	hr_cmd c = cmd_new(HR_RETRIEVE, job, prompt, first, n);
	c.skip_tokens = skip;
	for (uint32_t k = 0; k < n; k++) {
		att(&c, G_FULL, k, DST_ATT(k));
		att(&c, G_WIN, k, DST_ATT(k));
		rec_all(&c, k, DST_REC(k));
	}
	return c;
}

/* What a std_retrieve of chunks stored by std_store must write: every
 * full-attention block, the windowed group's trailing WINDOW chunks only,
 * blocks wholly inside skip not at all, and each recurrent group only the
 * state of the last chunk (unless skip covers the whole prefix). */
typedef struct std_exp {
	uint32_t first, n;
	uint64_t skip;
} std_exp;

static void expect_std(const hr_region *rg, uint8_t *exp[2], const void *arg)
{
	const std_exp *e = arg;
	for (uint32_t k = 0; k < e->n; k++)
		for (uint32_t gi = G_FULL; gi <= G_WIN; gi++) {
			if (gi == G_WIN && k + WINDOW < e->n)
				continue;
			for (uint32_t b = 0; b < 4; b++)
				if ((uint64_t)(k * 4 + b + 1) * 16 > e->skip)
					hr_expect_copy(rg, exp, gi, DST_ATT(k) + b, SRC_ATT(e->first + k) + b);
		}
	if ((uint64_t)e->n * CHUNK_TOKENS > e->skip)
		for (uint32_t gi = G_R2; gi <= G_R4; gi++)
			hr_expect_copy(rg, exp, gi, DST_REC(e->n - 1), SRC_REC(e->first + e->n - 1));
}

/* ---- driving ----------------------------------------------------------------------- */

static void rank_do(world *w, uint32_t i, hr_cmd cmd, int want_code, int want_state)
{
	hr_res res;
	ck_assert_int_eq(hr_rank_do(&w->r[i], &cmd, &res), 0);
	ck_assert_msg(res.code == want_code, "rank %u op %d job %llu: code %d (%s), want %d (%s)", i, cmd.op,
		      (unsigned long long)cmd.job, res.code, kvs_strerror(res.code), want_code,
		      kvs_strerror(want_code));
	if (want_state >= 0 && want_code == 0)
		ck_assert_msg(res.state == want_state, "rank %u op %d job %llu: state %d, want %d", i, cmd.op,
			      (unsigned long long)cmd.job, res.state, want_state);
}

static void all_do(world *w, hr_cmd cmd, int want_code, int want_state)
{
	for (uint32_t i = 0; i < W; i++)
		rank_do(w, i, cmd, want_code, want_state);
}

static int wait_job(kvs_client *sched, uint64_t job)
{
	int st = -1;
	if (kvs_job_wait(sched, job, 5000, &st) != 0)
		return -1;
	return st;
}

static void complete_all(world *w, uint64_t job, int want_state)
{
	hr_cmd c = {.op = HR_COMPLETE, .job = job, .ok = 1};
	all_do(w, c, 0, -1);
	ck_assert_int_eq(wait_job(w->sched, job), want_state);
}

/* Restores every rank's source content, stores, commits. */
static void store_commit(world *w, hr_cmd sc)
{
	for (uint32_t i = 0; i < W; i++)
		hr_restore(&w->r[i].rg);
	all_do(w, sc, 0, KVS_JOB_OPEN);
	complete_all(w, sc.job, KVS_JOB_COMMITTED);
}

static void poison_all(world *w)
{
	for (uint32_t i = 0; i < W; i++)
		hr_poison(&w->r[i].rg);
}

/* Poisons every rank's region, retrieves, commits. */
static void retrieve_commit(world *w, hr_cmd rc)
{
	poison_all(w);
	all_do(w, rc, 0, KVS_JOB_OPEN);
	complete_all(w, rc.job, KVS_JOB_COMMITTED);
}

/* Every rank's region must equal poison + what fill adds (fill NULL: poison only). */
static void check_memory(world *w, void (*fill)(const hr_region *, uint8_t *[2], const void *), const void *arg,
			 const char *what)
{
	for (uint32_t i = 0; i < W; i++) {
		uint8_t *exp[2];
		hr_expect_init(&w->r[i].rg, exp);
		if (fill)
			fill(&w->r[i].rg, exp, arg);
		uint64_t d = hr_diff(&w->r[i].rg, exp, what);
		hr_expect_free(exp);
		ck_assert_msg(d == 0, "%s: rank %u: %llu bytes differ from the expectation", what, i,
			      (unsigned long long)d);
	}
}

static uint64_t lookup_c(kvs_client *c, uint32_t prompt, uint32_t first, uint32_t n)
{
	uint8_t keys[64 * 32];
	for (uint32_t k = 0; k < n; k++)
		kvt_key_p(prompt, first + k, keys + 32 * k);
	uint64_t hits = 99;
	uint8_t tiers[64];
	ck_assert_int_eq(kvs_lookup(c, keys, n, false, 0, 3000, &hits, tiers), 0);
	ck_assert_uint_le(hits, n);
	for (uint64_t i = 0; i < hits; i++)
		ck_assert_int_eq(tiers[i], KVS_TIER_L1);
	return hits;
}

static uint64_t lookup(world *w, uint32_t prompt, uint32_t first, uint32_t n)
{
	return lookup_c(w->sched, prompt, first, n);
}

static void assert_idle(world *w)
{
	ck_assert(KVT_WAIT(kvt_stat(w->sched, "jobs_open") == 0, 3000));
	ck_assert_uint_eq(ctr(w, "retained_blocks"), 0);
	ck_assert_uint_eq(ctr(w, "l1_bytes_reserved"), 0);
	ck_assert_uint_eq(ctr(w, "l1_objects_reserved"), 0);
}

/* ---- tests -------------------------------------------------------------------------- */

START_TEST(roundtrip_window_state_padding_skip)
{
	world w;
	world_up(&w);
	uint64_t o0 = ctr(&w, "l1_objects");
	hr_cmd sc = std_store(1, 0, 0, 4, 0xF);
	for (uint32_t i = 0; i < W; i++)
		hr_restore(&w.r[i].rg);
	all_do(&w, sc, 0, KVS_JOB_OPEN);
	/* per rank: 16 + 16 attention blocks, 4 states in each recurrent group */
	ck_assert_uint_eq(ctr(&w, "retained_blocks"), (uint64_t)W * (16 + 16 + 4 + 4 + 4));
	ck_assert_uint_eq(lookup(&w, 0, 0, 4), 0); /* nothing visible before commit */
	complete_all(&w, 1, KVS_JOB_COMMITTED);
	ck_assert_uint_eq(ctr(&w, "retained_blocks"), 0);
	/* one object per (rank, group, chunk) */
	ck_assert_uint_eq(ctr(&w, "l1_objects") - o0, (uint64_t)W * 5 * 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 4), 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 6), 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 3), 3);
	ck_assert_uint_eq(lookup(&w, 0, 0, 1), 1);
	ck_assert_uint_eq(lookup(&w, 1, 0, 4), 0); /* another prompt */

	/* 4 chunks: full attention everywhere, window trimmed to chunks 2..3,
	 * recurrent only chunk 3's state into chunk 3's destination */
	retrieve_commit(&w, std_retrieve(2, 0, 0, 4, 0));
	check_memory(&w, expect_std, &(std_exp){0, 4, 0}, "retrieve 4");

	/* 2 chunks, skip 80 tokens (5 blocks of each attention group); the
	 * recurrent destinations of the non-last chunk are null here */
	hr_cmd rc = std_retrieve(3, 0, 0, 2, 80);
	rec_all(&rc, 0, HR_REC_NULL);
	retrieve_commit(&w, rc);
	check_memory(&w, expect_std, &(std_exp){0, 2, 80}, "retrieve 2 skip 80");

	/* keys 1..2 only: the state of chunk 2 */
	retrieve_commit(&w, std_retrieve(4, 0, 1, 2, 0));
	check_memory(&w, expect_std, &(std_exp){1, 2, 0}, "retrieve keys 1..2");

	/* skip covering both chunks: nothing at all is written */
	retrieve_commit(&w, std_retrieve(5, 0, 0, 2, 128));
	check_memory(&w, expect_std, &(std_exp){0, 2, 128}, "retrieve 2 skip 128");
	check_memory(&w, NULL, NULL, "retrieve 2 skip 128 (all poison)");

	/* 1 chunk: window larger than the request, the state of chunk 0 */
	retrieve_commit(&w, std_retrieve(6, 0, 0, 1, 0));
	check_memory(&w, expect_std, &(std_exp){0, 1, 0}, "retrieve 1");

	/* 3 chunks, state of chunk 2, group 4's destination in slot 0 this time */
	rc = std_retrieve(7, 0, 0, 3, 0);
	rec(&rc, G_R4, 2, 1, HR_REC_NULL);
	rec(&rc, G_R4, 2, 0, DST_REC(2));
	retrieve_commit(&w, rc);
	check_memory(&w, expect_std, &(std_exp){0, 3, 0}, "retrieve 3 (group 4 slot 0)");

	assert_idle(&w);
	ck_assert_uint_eq(ctr(&w, "jobs_committed"), 7);
	ck_assert_uint_eq(ctr(&w, "jobs_aborted"), 0);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - o0, (uint64_t)W * 5 * 4);
	world_down(&w);
}
END_TEST

START_TEST(recurrent_state_gates_lookup)
{
	world w;
	world_up(&w);
	uint64_t o = ctr(&w, "l1_objects");
	/* prompt 0, chunks 0..3, states only at chunks 1 and 3: the all-null
	 * recurrent chunks store nothing */
	store_commit(&w, std_store(10, 0, 0, 4, 1u << 1 | 1u << 3));
	ck_assert_uint_eq(ctr(&w, "l1_objects") - o, (uint64_t)W * (4 + 4 + 3 * 2));
	o = ctr(&w, "l1_objects");
	ck_assert_uint_eq(lookup(&w, 0, 0, 4), 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 5), 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 3), 2); /* no state at chunk 2: falls back to 2 */
	ck_assert_uint_eq(lookup(&w, 0, 0, 2), 2);
	ck_assert_uint_eq(lookup(&w, 0, 0, 1), 0); /* no state at chunk 0 */

	/* retrieve of 3 needs the state of chunk 2: E_MISS, nothing written;
	 * the job is aborted, later parts of it are answered with that state */
	poison_all(&w);
	rank_do(&w, 0, std_retrieve(11, 0, 0, 3, 0), KVS_E_MISS, -1);
	ck_assert_int_eq(wait_job(w.sched, 11), KVS_JOB_ABORTED);
	for (uint32_t i = 1; i < W; i++)
		rank_do(&w, i, std_retrieve(11, 0, 0, 3, 0), 0, KVS_JOB_ABORTED);
	check_memory(&w, NULL, NULL, "E_MISS retrieve of 3");
	/* retrieve of 1: E_MISS on each rank (own jobs) */
	for (uint32_t i = 0; i < W; i++) {
		rank_do(&w, i, std_retrieve(12 + i, 0, 0, 1, 0), KVS_E_MISS, -1);
		ck_assert_int_eq(wait_job(w.sched, 12 + i), KVS_JOB_ABORTED);
	}
	check_memory(&w, NULL, NULL, "E_MISS retrieve of 1");

	/* retrieve of 4 names destinations for every chunk's state: only the
	 * state of chunk 3 is needed and written; absent states of chunks 0 and 2
	 * are no miss */
	retrieve_commit(&w, std_retrieve(20, 0, 0, 4, 0));
	check_memory(&w, expect_std, &(std_exp){0, 4, 0}, "retrieve 4 (states at 1, 3)");
	retrieve_commit(&w, std_retrieve(21, 0, 0, 2, 0));
	check_memory(&w, expect_std, &(std_exp){0, 2, 0}, "retrieve 2 (states at 1, 3)");

	/* one recurrent group short: group 3 has no state at chunk 1 */
	hr_cmd sc = std_store(22, 1, 0, 2, 0x3);
	rec(&sc, G_R3, 1, 0, HR_REC_NULL);
	store_commit(&w, sc);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - o, (uint64_t)W * (2 + 2 + 2 + 1 + 2));
	o = ctr(&w, "l1_objects");
	ck_assert_uint_eq(lookup(&w, 1, 0, 2), 1);
	ck_assert_uint_eq(lookup(&w, 1, 0, 1), 1);

	/* one rank short: rank W-1 has no state at chunk 1 */
	for (uint32_t i = 0; i < W; i++) {
		hr_restore(&w.r[i].rg);
		rank_do(&w, i, std_store(23, 2, 0, 2, i == W - 1 ? 0x1 : 0x3), 0, KVS_JOB_OPEN);
	}
	complete_all(&w, 23, KVS_JOB_COMMITTED);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - o, (uint64_t)W * (2 + 2 + 3 * 2) - 3);
	o = ctr(&w, "l1_objects");
	ck_assert_uint_eq(lookup(&w, 2, 0, 2), 1);

	/* windowed group stored for the trailing 2 chunks only (all-null
	 * attention chunks store nothing), state only at chunk 3: 4 hits, but
	 * no shorter prefix qualifies */
	sc = std_store(24, 3, 0, 4, 1u << 3);
	att(&sc, G_WIN, 0, -1);
	att(&sc, G_WIN, 1, -1);
	store_commit(&w, sc);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - o, (uint64_t)W * (4 + 2 + 3));
	o = ctr(&w, "l1_objects");
	ck_assert_uint_eq(lookup(&w, 3, 0, 4), 4);
	ck_assert_uint_eq(lookup(&w, 3, 0, 5), 4);
	ck_assert_uint_eq(lookup(&w, 3, 0, 3), 0);
	ck_assert_uint_eq(lookup(&w, 3, 0, 2), 0);
	/* the retrieve of all 4 needs no windowed chunk 0 or 1 */
	retrieve_commit(&w, std_retrieve(25, 3, 0, 4, 0));
	check_memory(&w, expect_std, &(std_exp){0, 4, 0}, "retrieve 4 (window only stored)");

	/* windowed group missing a chunk inside the window: no hit, E_MISS */
	sc = std_store(26, 4, 0, 4, 0xF);
	for (uint32_t k = 0; k < 3; k++)
		att(&sc, G_WIN, k, -1);
	store_commit(&w, sc);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - o, (uint64_t)W * (4 + 1 + 3 * 4));
	ck_assert_uint_eq(lookup(&w, 4, 0, 4), 0);
	ck_assert_uint_eq(lookup(&w, 4, 0, 2), 0);
	poison_all(&w);
	rank_do(&w, 2, std_retrieve(27, 4, 0, 4, 0), KVS_E_MISS, -1);
	ck_assert_int_eq(wait_job(w.sched, 27), KVS_JOB_ABORTED);
	check_memory(&w, NULL, NULL, "E_MISS retrieve (window chunk missing)");

	assert_idle(&w);
	world_down(&w);
}
END_TEST

START_TEST(geometry_errors)
{
	world w;
	world_up(&w);
	store_commit(&w, std_store(30, 0, 0, 2, 0x3));
	uint64_t objs = ctr(&w, "l1_objects"), bytes = ctr(&w, "l1_bytes");
	uint64_t geo0 = ctr(&w, "errors.E_GEOMETRY");
	uint64_t n_geo = 0;

	/* store: group 4 (two slots) with both slots non-null in chunk 1 */
	hr_cmd sc = std_store(31, 0, 4, 2, 0x30);
	rec(&sc, G_R4, 1, 0, 9);
	rank_do(&w, 0, sc, KVS_E_GEOMETRY, -1);
	n_geo++;
	ck_assert_int_eq(wait_job(w.sched, 31), KVS_JOB_ABORTED);
	/* store: recurrent list of the wrong length */
	sc = std_store(32, 0, 4, 2, 0x30);
	sc.len[G_R2] = 3;
	rank_do(&w, 1, sc, KVS_E_GEOMETRY, -1);
	n_geo++;
	/* store: windowed attention chunk mixing null and real blocks */
	sc = std_store(33, 0, 4, 2, 0x30);
	sc.ids[G_WIN][5] = -1;
	rank_do(&w, 2, sc, KVS_E_GEOMETRY, -1);
	n_geo++;
	/* store: recurrent id out of range */
	sc = std_store(34, 0, 4, 2, 0x30);
	rec(&sc, G_R3, 0, 0, HR_REC_BLOCKS);
	rank_do(&w, 3, sc, KVS_E_RANGE, -1);
	/* one rank's bad part aborts the whole job: nothing becomes visible */
	for (uint32_t i = 0; i < W; i++) {
		hr_restore(&w.r[i].rg);
		sc = std_store(35, 0, 4, 2, 0x30);
		if (i == W - 1)
			rec(&sc, G_R4, 0, 0, 10);
		rank_do(&w, i, sc, i == W - 1 ? KVS_E_GEOMETRY : 0, KVS_JOB_OPEN);
	}
	n_geo++;
	for (uint32_t i = 0; i < W - 1; i++)
		rank_do(&w, i, (hr_cmd){.op = HR_COMPLETE, .job = 35, .ok = 1}, 0, KVS_JOB_ABORTED);
	ck_assert_int_eq(wait_job(w.sched, 35), KVS_JOB_ABORTED);
	ck_assert_uint_eq(lookup(&w, 0, 4, 2), 0);

	poison_all(&w);
	/* retrieve: the last chunk names no destination for group 2 */
	hr_cmd rc = std_retrieve(40, 0, 0, 2, 0);
	rec(&rc, G_R2, 1, 0, HR_REC_NULL);
	rank_do(&w, 0, rc, KVS_E_GEOMETRY, -1);
	n_geo++;
	ck_assert_int_eq(wait_job(w.sched, 40), KVS_JOB_ABORTED);
	/* retrieve: the last chunk names two destinations for group 4 */
	rc = std_retrieve(41, 0, 0, 2, 0);
	rec(&rc, G_R4, 1, 0, 20);
	rank_do(&w, 1, rc, KVS_E_GEOMETRY, -1);
	n_geo++;
	/* retrieve: one destination named twice in the full-attention group */
	rc = std_retrieve(42, 0, 0, 2, 0);
	rc.ids[G_FULL][5] = rc.ids[G_FULL][0];
	rank_do(&w, 2, rc, KVS_E_GEOMETRY, -1);
	n_geo++;
	/* retrieve: a recurrent destination named in two chunks */
	rc = std_retrieve(43, 0, 0, 2, 0);
	rec(&rc, G_R3, 0, 0, DST_REC(1));
	rank_do(&w, 3, rc, KVS_E_GEOMETRY, -1);
	n_geo++;
	/* retrieve: the last chunk's recurrent destination out of range */
	rc = std_retrieve(44, 0, 0, 2, 0);
	rec(&rc, G_R4, 1, 1, HR_REC_BLOCKS + 5);
	rank_do(&w, 0, rc, KVS_E_RANGE, -1);
	check_memory(&w, NULL, NULL, "refused retrieves");

	ck_assert_uint_eq(ctr(&w, "errors.E_GEOMETRY") - geo0, n_geo);
	ck_assert_uint_eq(ctr(&w, "l1_objects"), objs);
	ck_assert_uint_eq(ctr(&w, "l1_bytes"), bytes);
	assert_idle(&w);
	ck_assert_uint_eq(lookup(&w, 0, 0, 2), 2);
	/* the same chunks stored correctly still work */
	store_commit(&w, std_store(45, 0, 4, 2, 0x30));
	ck_assert_uint_eq(lookup(&w, 0, 4, 2), 2);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - objs, (uint64_t)W * 5 * 2);
	world_down(&w);
}
END_TEST

START_TEST(lazy_refused_with_recurrent_allowed_without)
{
	world w;
	world_up(&w);
	uint64_t objs = ctr(&w, "l1_objects");
	/* hybrid registration: lazy refused on every rank (own job each) */
	for (uint32_t i = 0; i < W; i++) {
		hr_cmd sc = std_store(50 + i, 0, 0, 2, 0x3);
		sc.lazy = 1;
		rank_do(&w, i, sc, KVS_E_LAZY_RECURRENT, -1);
		ck_assert_int_eq(wait_job(w.sched, 50 + i), KVS_JOB_ABORTED);
	}
	/* also when this store carries no recurrent block: the registration has
	 * recurrent groups */
	hr_cmd sc = std_store(55, 0, 0, 2, 0);
	sc.lazy = 1;
	rank_do(&w, 0, sc, KVS_E_LAZY_RECURRENT, -1);
	ck_assert_uint_eq(ctr(&w, "errors.E_LAZY_RECURRENT"), W + 1);
	ck_assert_uint_eq(ctr(&w, "l1_objects"), objs);
	assert_idle(&w);
	ck_assert_uint_eq(lookup(&w, 0, 0, 2), 0);
	/* not lazy: fine */
	store_commit(&w, std_store(56, 0, 0, 2, 0x3));
	ck_assert_uint_eq(lookup(&w, 0, 0, 2), 2);

	/* a second engine, attention-only (its own namespace, world 2): lazy ok */
	kvs_client *sa = kvt_client_ns(&w.s, "A", "attn-model", KVS_ROLE_SCHEDULER, 0, 2);
	ck_assert_ptr_nonnull(sa);
	hr_rank a[2];
	for (uint32_t i = 0; i < 2; i++)
		ck_assert_int_eq(hr_rank_start(&a[i], &w.s, "A", "attn-model", HR_ATTN_ONLY, i, 2, 200 + i), 0);
	objs = ctr(&w, "l1_objects");
	hr_cmd as = std_store(56, 0, 0, 4, 0); /* same job id as engine H's: jobs are per engine */
	as.lazy = 1;
	for (uint32_t i = 0; i < 2; i++) {
		hr_res res;
		ck_assert_int_eq(hr_rank_do(&a[i], &as, &res), 0);
		ck_assert_int_eq(res.code, 0);
		ck_assert_int_eq(res.state, KVS_JOB_OPEN);
	}
	ck_assert_uint_eq(ctr(&w, "retained_blocks"), 2 * (16 + 16));
	for (uint32_t i = 0; i < 2; i++) {
		hr_res res;
		hr_cmd c = {.op = HR_COMPLETE, .job = 56, .ok = 1};
		ck_assert_int_eq(hr_rank_do(&a[i], &c, &res), 0);
		ck_assert_int_eq(res.code, 0);
	}
	ck_assert_int_eq(wait_job(sa, 56), KVS_JOB_COMMITTED);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - objs, 2 * 2 * 4);
	ck_assert_uint_eq(lookup_c(sa, 0, 0, 4), 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 4), 2); /* engine H's cache is separate */
	/* retrieve on the attention-only engine: window trimmed, byte-exact */
	for (uint32_t i = 0; i < 2; i++)
		hr_poison(&a[i].rg);
	hr_cmd ar = std_retrieve(57, 0, 0, 4, 16);
	for (uint32_t i = 0; i < 2; i++) {
		hr_res res;
		ck_assert_int_eq(hr_rank_do(&a[i], &ar, &res), 0);
		ck_assert_int_eq(res.code, 0);
		hr_cmd c = {.op = HR_COMPLETE, .job = 57, .ok = 1};
		ck_assert_int_eq(hr_rank_do(&a[i], &c, &res), 0);
		ck_assert_int_eq(res.code, 0);
	}
	ck_assert_int_eq(wait_job(sa, 57), KVS_JOB_COMMITTED);
	for (uint32_t i = 0; i < 2; i++) {
		uint8_t *exp[2];
		hr_expect_init(&a[i].rg, exp);
		expect_std(&a[i].rg, exp, &(std_exp){0, 4, 16});
		uint64_t d = hr_diff(&a[i].rg, exp, "attention-only retrieve");
		hr_expect_free(exp);
		ck_assert_uint_eq(d, 0);
	}
	for (uint32_t i = 0; i < 2; i++)
		hr_rank_stop(&a[i]);
	kvs_client_close(sa);
	assert_idle(&w);
	world_down(&w);
}
END_TEST

START_TEST(repeated_ids_retained_once)
{
	world w;
	world_up(&w);
	uint64_t objs = ctr(&w, "l1_objects");
	hr_cmd sc = cmd_new(HR_STORE, 60, 0, 0, 2);
	for (uint32_t i = 0; i < 8; i++)
		sc.ids[G_FULL][i] = 5; /* one block for the whole group */
	att(&sc, G_WIN, 0, -1);
	for (uint32_t i = 0; i < 8; i++)
		sc.ids[G_WIN][i] = i < 4 ? 5 : 6; /* same id as group 0: another block */
	rec(&sc, G_R2, 0, 0, 3);
	rec(&sc, G_R2, 1, 0, 3); /* the same state block for both chunks */
	rec(&sc, G_R3, 1, 0, 4); /* chunk 0: nothing */
	rec(&sc, G_R4, 0, 1, 6);
	rec(&sc, G_R4, 1, 0, 7); /* the state in slot 0 */
	for (uint32_t i = 0; i < W; i++)
		hr_restore(&w.r[i].rg);
	all_do(&w, sc, 0, KVS_JOB_OPEN);
	/* distinct (group, id) per part: 1 + 2 + 1 + 1 + 2 */
	ck_assert_uint_eq(ctr(&w, "retained_blocks"), (uint64_t)W * 7);
	complete_all(&w, 60, KVS_JOB_COMMITTED);
	ck_assert_uint_eq(ctr(&w, "retained_blocks"), 0);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - objs, (uint64_t)W * (2 + 2 + 2 + 1 + 2));
	ck_assert_uint_eq(lookup(&w, 0, 0, 2), 2);
	ck_assert_uint_eq(lookup(&w, 0, 0, 1), 0); /* group 3 has no state at chunk 0 */
	retrieve_commit(&w, std_retrieve(61, 0, 0, 2, 0));
	for (uint32_t i = 0; i < W; i++) {
		hr_region *rg = &w.r[i].rg;
		uint8_t *exp[2];
		hr_expect_init(rg, exp);
		for (uint32_t k = 0; k < 2; k++)
			for (uint32_t b = 0; b < 4; b++) {
				hr_expect_copy(rg, exp, G_FULL, DST_ATT(k) + b, 5);
				hr_expect_copy(rg, exp, G_WIN, DST_ATT(k) + b, k ? 6 : 5);
			}
		hr_expect_copy(rg, exp, G_R2, DST_REC(1), 3);
		hr_expect_copy(rg, exp, G_R3, DST_REC(1), 4);
		hr_expect_copy(rg, exp, G_R4, DST_REC(1), 7);
		uint64_t d = hr_diff(rg, exp, "repeated ids");
		hr_expect_free(exp);
		ck_assert_msg(d == 0, "rank %u: %llu bytes differ", i, (unsigned long long)d);
	}
	assert_idle(&w);
	world_down(&w);
}
END_TEST

START_TEST(concurrent_stores_at_different_boundaries)
{
	world w;
	world_up(&w);
	uint64_t objs = ctr(&w, "l1_objects"), skipped = ctr(&w, "store_skipped_cached");
	uint64_t staged = ctr(&w, "store_staged");
	for (uint32_t i = 0; i < W; i++)
		hr_restore(&w.r[i].rg);
	/* one request, two jobs in flight: A = chunks 0..1 with the state at 1,
	 * B = chunks 0..3 with the state at 3 */
	all_do(&w, std_store(70, 0, 0, 2, 1u << 1), 0, KVS_JOB_OPEN);
	all_do(&w, std_store(71, 0, 0, 4, 1u << 3), 0, KVS_JOB_OPEN);
	ck_assert_uint_eq(ctr(&w, "retained_blocks"), (uint64_t)W * ((8 + 8 + 3) + (16 + 16 + 3)));
	ck_assert_uint_eq(ctr(&w, "jobs_open"), 2);
	ck_assert_uint_eq(lookup(&w, 0, 0, 4), 0);
	/* B commits first, on its own */
	complete_all(&w, 71, KVS_JOB_COMMITTED);
	ck_assert_uint_eq(ctr(&w, "retained_blocks"), (uint64_t)W * (8 + 8 + 3));
	ck_assert_uint_eq(ctr(&w, "jobs_open"), 1);
	/* B found chunks 0..1 being stored by A and kept private staging copies
	 * of them: B's 4-chunk prefix is complete on its own, A's is not yet */
	ck_assert_uint_eq(ctr(&w, "store_skipped_cached") - skipped, 0);
	ck_assert_uint_eq(ctr(&w, "store_staged") - staged, (uint64_t)W * 2 * 2);
	ck_assert_uint_eq(lookup(&w, 0, 0, 4), 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 2), 0); /* A's state at chunk 1 not yet */
	complete_all(&w, 70, KVS_JOB_COMMITTED);
	assert_idle(&w);
	ck_assert_uint_eq(ctr(&w, "l1_objects") - objs, (uint64_t)W * ((2 + 2 + 3) + (2 + 2 + 3)));
	ck_assert_uint_eq(lookup(&w, 0, 0, 4), 4);
	ck_assert_uint_eq(lookup(&w, 0, 0, 3), 2);
	ck_assert_uint_eq(lookup(&w, 0, 0, 2), 2);
	ck_assert_uint_eq(lookup(&w, 0, 0, 1), 0);
	/* each prefix gets its own boundary's state, never the other's */
	retrieve_commit(&w, std_retrieve(72, 0, 0, 2, 0));
	check_memory(&w, expect_std, &(std_exp){0, 2, 0}, "retrieve 2 (state of A)");
	retrieve_commit(&w, std_retrieve(73, 0, 0, 4, 0));
	check_memory(&w, expect_std, &(std_exp){0, 4, 0}, "retrieve 4 (state of B)");
	assert_idle(&w);
	ck_assert_uint_eq(ctr(&w, "jobs_committed"), 4);
	/* independence when one of them aborts: prompt 1, A' reserves first and
	 * aborts; B' (staged behind A') still commits its whole prefix */
	all_do(&w, std_store(74, 1, 0, 2, 1u << 1), 0, KVS_JOB_OPEN);
	all_do(&w, std_store(75, 1, 0, 4, 1u << 3), 0, KVS_JOB_OPEN);
	for (uint32_t i = 0; i < W; i++)
		rank_do(&w, i, (hr_cmd){.op = HR_COMPLETE, .job = 74, .ok = 0}, 0, -1);
	complete_all(&w, 75, KVS_JOB_COMMITTED);
	ck_assert_uint_eq(lookup(&w, 1, 0, 4), 4);
	ck_assert_uint_eq(lookup(&w, 1, 0, 2), 0);
	assert_idle(&w);
	/* and the other order: B'' commits first, then A'' aborts: B'' stays */
	all_do(&w, std_store(76, 2, 0, 2, 1u << 1), 0, KVS_JOB_OPEN);
	all_do(&w, std_store(77, 2, 0, 4, 1u << 3), 0, KVS_JOB_OPEN);
	complete_all(&w, 77, KVS_JOB_COMMITTED);
	for (uint32_t i = 0; i < W; i++)
		rank_do(&w, i, (hr_cmd){.op = HR_COMPLETE, .job = 76, .ok = 0}, 0, -1);
	ck_assert_uint_eq(lookup(&w, 2, 0, 4), 4);
	assert_idle(&w);
	world_down(&w);
}
END_TEST

START_TEST(registration_validation)
{
	world w;
	world_up(&w);
	uint64_t imports = ctr(&w, "imports"), geo0 = ctr(&w, "errors.E_GEOMETRY");
	static const int bad[] = {HR_BAD_REC_WINDOW, HR_BAD_WINDOW_ZERO, HR_BAD_BYTES};
	for (uint32_t i = 0; i < 3; i++) {
		hr_rank b;
		ck_assert_int_eq(hr_rank_start(&b, &w.s, "B", NS, bad[i], 0, 1, 300 + i), KVS_E_GEOMETRY);
		hr_rank_stop(&b);
	}
	ck_assert_uint_eq(ctr(&w, "errors.E_GEOMETRY") - geo0, 3);
	/* all-or-nothing: nothing imported, nothing registered */
	ck_assert_uint_eq(ctr(&w, "registrations"), W);
	ck_assert(KVT_WAIT(kvt_stat(w.sched, "imports") == imports, 3000));
	/* the good engine still works */
	store_commit(&w, std_store(80, 0, 0, 1, 0x1));
	ck_assert_uint_eq(lookup(&w, 0, 0, 1), 1);
	world_down(&w);
}
END_TEST

static Suite *hybrid_suite(void)
{
	Suite *s = suite_create("hybrid");
	TCase *tc = tcase_create("hybrid");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, roundtrip_window_state_padding_skip);
	tcase_add_test(tc, recurrent_state_gates_lookup);
	tcase_add_test(tc, geometry_errors);
	tcase_add_test(tc, lazy_refused_with_recurrent_allowed_without);
	tcase_add_test(tc, repeated_ids_retained_once);
	tcase_add_test(tc, concurrent_stores_at_different_boundaries);
	tcase_add_test(tc, registration_validation);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(hybrid_suite)
