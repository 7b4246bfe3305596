/* Unit tests for the job table (server/jobs.c), in process: a real
 * kvs_server, two rank sessions of one engine with memfd registrations, and
 * kvs__op_store / kvs__op_retrieve / kvs__op_complete / kvs__ops_tick called
 * directly; copies run on the host pool and are collected the way the main
 * loop does (eventfd, kvs__ops_completions). Covers multi-rank commit,
 * source-block retention, repeats and conflicts after the terminal state,
 * aborts releasing reservations, the bounded terminal table, deadlines, and
 * byte-exact retrieves. */
#include "server_fixture.h"

#include "check_main.h"

#define MSZ 65536u

/* group 7: attention, 2 blocks per chunk, two layers of 256 bytes;
 * group 9: attention, 1 block per chunk, one layer of 128 of a 256 stride.
 * Block 0 is the null block of both. */
static const kvs_group_desc GROUPS[2] = {
	{.id = 7, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = 2,
	 .window_chunks = -1, .null_block = 0},
	{.id = 9, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 32, .blocks_per_chunk = 1,
	 .window_chunks = -1, .null_block = 0},
};
#define OFF_A0 0
#define OFF_A1 4096
#define OFF_B 8192
static const kvs_layer_desc LAYERS[3] = {
	{.group = 7, .alloc = 0, .offset = OFF_A0, .num_blocks = 16, .block_stride = 256, .block_bytes = 256},
	{.group = 7, .alloc = 0, .offset = OFF_A1, .num_blocks = 16, .block_stride = 256, .block_bytes = 256},
	{.group = 9, .alloc = 0, .offset = OFF_B, .num_blocks = 16, .block_stride = 256, .block_bytes = 128},
};
#define OBJ_A (2 * 2 * 256)
#define OBJ_B 128

typedef struct rank {
	kvs_session *s;
	int fd;
	uint8_t *mem;
} rank;

static uint32_t next_token = 1;

static void rank_open(fx *f, rank *r, const char *ident, const char *engine, uint32_t rk, uint32_t world)
{
	r->s = fx_session(f, ident, engine, "ns", KVS_ROLE_WORKER, rk, world);
	r->fd = fx_memfd(MSZ);
	r->mem = fx_map(r->fd, MSZ);
	for (uint32_t i = 0; i < MSZ; i++)
		r->mem[i] = (uint8_t)(i * 131u + rk * 71u + 1u + (i >> 8));
	uint32_t tok = next_token++;
	fx_park(f, tok, 1000 + tok, MSZ, dup(r->fd));
	kvs_alloc_desc a = fx_alloc(tok, 1000 + tok, MSZ);
	ck_assert_int_eq(fx_register(f, r->s, &a, 1, GROUPS, 2, LAYERS, 3), 0);
}

static void rank_close(rank *r)
{
	munmap(r->mem, MSZ);
	close(r->fd);
}

static void key_of(uint8_t k[32], uint32_t v)
{
	memset(k, 0, 32);
	memcpy(k, &v, 4);
	k[31] = 0x5A;
}

/* a store or retrieve part: n keys (base, base+1, ...), ids per group */
static int part(fx *f, rank *r, kvs_op op, uint64_t job, uint32_t key_base, uint32_t n, const int64_t *ida,
		const int64_t *idb)
{
	uint8_t keys[8 * 32];
	ck_assert_uint_le(n, 8);
	for (uint32_t i = 0; i < n; i++)
		key_of(keys + 32 * i, key_base + i);
	kvs_msg rq = {.op = op, .id = 10, .session = r->s->id, .job = job, .keys = keys, .n_keys = n};
	rq.blocks.n = 2;
	rq.blocks.ids[0] = ida;
	rq.blocks.len[0] = 2 * n;
	rq.blocks.ids[1] = idb;
	rq.blocks.len[1] = n;
	f->srv->errbuf[0] = '\0';
	return op == KVS_OP_STORE ? kvs__op_store(f->srv, r->s, &rq) : kvs__op_retrieve(f->srv, r->s, &rq);
}

static int complete(fx *f, rank *r, uint64_t job, uint8_t status)
{
	kvs_msg rq = {.op = KVS_OP_COMPLETE, .id = 11, .session = r->s->id, .job = job, .status = status};
	f->srv->errbuf[0] = '\0';
	return kvs__op_complete(f->srv, r->s, &rq);
}

static kvs_jobs_stats jstats(fx *f)
{
	kvs_jobs_stats st;
	kvs_jobs_get_stats(f->srv->jobs, &st);
	return st;
}

static kvs_l1_stats l1stats(fx *f)
{
	kvs_l1_stats st;
	kvs_l1_get_stats(f->srv->l1, &st);
	return st;
}

static uint32_t leases(fx *f, rank *r)
{
	kvs_reg *g = kvs_registry_of_session(f->srv->reg, r->s->id);
	ck_assert_ptr_nonnull(g);
	return g->leases;
}

/* 3 keys: group 7 chunk 1 is all null (skipped), group 9 names block 1
 * twice (retained once) and the null block once (skipped) */
static const int64_t SA[6] = {1, 2, 0, 0, 3, 4};
static const int64_t SB[3] = {1, 0, 1};
#define S_RETAINED 5                          /* {7:1,2,3,4} + {9:1} */
#define S_OBJECTS 4                           /* 7: chunks 0, 2; 9: chunks 0, 2 */
#define S_BYTES (2 * OBJ_A + 2 * OBJ_B)       /* copied by one part */

START_TEST(test_commit_retention_repeats)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_jobs *J = f.srv->jobs;
	rank r0, r1;
	rank_open(&f, &r0, "r0", "eng", 0, 2);
	rank_open(&f, &r1, "r1", "eng", 1, 2);

	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 1, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(kvs_jobs_open(J), 1);
	ck_assert_uint_eq(kvs_jobs_retained(J), S_RETAINED);
	ck_assert_uint_eq(leases(&f, &r0), 1);
	ck_assert_uint_eq(jstats(&f).store_objects, S_OBJECTS);
	ck_assert_uint_eq(l1stats(&f).objects_reserved, S_OBJECTS);
	ck_assert_uint_eq(l1stats(&f).bytes_reserved, S_BYTES);
	ck_assert(kvs_jobs_known(J, "eng", 1));
	ck_assert(!kvs_jobs_known(J, "other", 1));
	/* a repeat of the same part while open changes nothing */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 1, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(kvs_jobs_retained(J), S_RETAINED);
	ck_assert_uint_eq(jstats(&f).store_objects, S_OBJECTS);
	/* other content for the same job from the same rank: a conflict */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 1, 1, 3, SA, SB), KVS_E_JOB_CONFLICT);
	/* a retrieve under a store job's id: a conflict */
	ck_assert_int_eq(part(&f, &r1, KVS_OP_RETRIEVE, 1, 0, 3, SA, SB), KVS_E_JOB_CONFLICT);
	ck_assert_uint_eq(kvs_jobs_open(J), 1);

	ck_assert_int_eq(part(&f, &r1, KVS_OP_STORE, 1, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(kvs_jobs_retained(J), 2 * S_RETAINED);
	ck_assert_uint_eq(jstats(&f).store_objects, 2 * S_OBJECTS);
	/* copies finish; the job stays open until every rank completed */
	FX_PUMP_UNTIL(&f, jstats(&f).copy_bytes == 2 * S_BYTES);
	ck_assert_uint_eq(kvs_jobs_open(J), 1);
	ck_assert_int_eq(complete(&f, &r0, 1, KVS_STATUS_OK), 0);
	for (int i = 0; i < 5; i++)
		fx_pump_once(&f, 2);
	ck_assert_uint_eq(kvs_jobs_open(J), 1);
	ck_assert_uint_eq(kvs_jobs_retained(J), 2 * S_RETAINED);
	ck_assert_uint_eq(l1stats(&f).objects_reserved, 2 * S_OBJECTS);
	/* complete repeated: same status fine, the other a conflict */
	ck_assert_int_eq(complete(&f, &r0, 1, KVS_STATUS_OK), 0);
	ck_assert_int_eq(complete(&f, &r0, 1, KVS_STATUS_FAILED), KVS_E_JOB_CONFLICT);
	ck_assert_uint_eq(kvs_jobs_open(J), 1);
	ck_assert_int_eq(complete(&f, &r1, 1, KVS_STATUS_OK), 0);
	FX_PUMP_UNTIL(&f, kvs_jobs_open(J) == 0);
	kvs_jobs_stats js = jstats(&f);
	ck_assert_uint_eq(js.committed, 1);
	ck_assert_uint_eq(js.aborted, 0);
	ck_assert_uint_eq(js.terminal_entries, 1);
	ck_assert_uint_eq(kvs_jobs_retained(J), 0);
	ck_assert_uint_eq(leases(&f, &r0), 0);
	ck_assert_uint_eq(leases(&f, &r1), 0);
	kvs_l1_stats l1 = l1stats(&f);
	ck_assert_uint_eq(l1.bytes_reserved, 0);
	ck_assert_uint_eq(l1.objects, 2 * S_OBJECTS);
	ck_assert_uint_eq(l1.bytes_used, 2 * S_BYTES);
	ck_assert(kvs_jobs_known(J, "eng", 1));
	ck_assert_int_eq(kvs_l1_check(f.srv->l1), 0);

	/* after the terminal state: repeats answer, change nothing */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 1, 0, 3, SA, SB), 0);
	ck_assert_int_eq(complete(&f, &r1, 1, KVS_STATUS_OK), 0);
	ck_assert_uint_eq(kvs_jobs_open(J), 0);
	ck_assert_uint_eq(kvs_jobs_retained(J), 0);
	ck_assert_uint_eq(jstats(&f).store_objects, 2 * S_OBJECTS);
	ck_assert_uint_eq(jstats(&f).committed, 1);
	ck_assert_uint_eq(l1stats(&f).objects, 2 * S_OBJECTS);
	/* ...but other content or the other status is a conflict */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 1, 4, 3, SA, SB), KVS_E_JOB_CONFLICT);
	ck_assert_ptr_nonnull(strstr(f.srv->errbuf, "terminal"));
	ck_assert_int_eq(complete(&f, &r1, 1, KVS_STATUS_FAILED), KVS_E_JOB_CONFLICT);
	ck_assert_uint_eq(kvs_jobs_open(J), 0);

	/* a store of chunks already cached copies nothing: skipped */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 2, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(jstats(&f).store_skipped, S_OBJECTS);
	ck_assert_uint_eq(jstats(&f).store_objects, 2 * S_OBJECTS);
	ck_assert_uint_eq(kvs_jobs_retained(J), S_RETAINED); /* still counted while open */
	ck_assert_int_eq(part(&f, &r1, KVS_OP_STORE, 2, 0, 3, SA, SB), 0);
	ck_assert_int_eq(complete(&f, &r0, 2, KVS_STATUS_OK), 0);
	ck_assert_int_eq(complete(&f, &r1, 2, KVS_STATUS_OK), 0);
	ck_assert_uint_eq(kvs_jobs_open(J), 0); /* no copies: committed at once */
	ck_assert_uint_eq(kvs_jobs_retained(J), 0);
	ck_assert_uint_eq(jstats(&f).committed, 2);

	/* retrieve into other blocks, byte-exact */
	static const int64_t RA[6] = {5, 6, 0, 0, 7, 8};
	static const int64_t RB[3] = {9, 0, 10};
	rank *rs[2] = {&r0, &r1};
	uint8_t want[2][MSZ];
	for (int k = 0; k < 2; k++) {
		uint8_t *m = rs[k]->mem;
		memcpy(want[k], m, MSZ);
		/* expected: blocks 5..8 of both group-7 layers = stored blocks 1..4;
		 * blocks 9 and 10 of the group-9 layer = the first 128 bytes of
		 * stored block 1, their other 128 bytes untouched */
		for (int b = 0; b < 4; b++) {
			memcpy(want[k] + OFF_A0 + (5 + b) * 256, m + OFF_A0 + (1 + b) * 256, 256);
			memcpy(want[k] + OFF_A1 + (5 + b) * 256, m + OFF_A1 + (1 + b) * 256, 256);
		}
		memset(want[k] + OFF_B + 9 * 256, 0xEE, 2 * 256);
		memcpy(want[k] + OFF_B + 9 * 256, m + OFF_B + 1 * 256, 128);
		memcpy(want[k] + OFF_B + 10 * 256, m + OFF_B + 1 * 256, 128);
		/* clobber the destinations first */
		for (int b = 5; b <= 8; b++) {
			memset(m + OFF_A0 + b * 256, 0xEE, 256);
			memset(m + OFF_A1 + b * 256, 0xEE, 256);
		}
		memset(m + OFF_B + 9 * 256, 0xEE, 2 * 256);
	}
	ck_assert_int_eq(part(&f, &r0, KVS_OP_RETRIEVE, 3, 0, 3, RA, RB), 0);
	ck_assert_int_eq(part(&f, &r1, KVS_OP_RETRIEVE, 3, 0, 3, RA, RB), 0);
	ck_assert_uint_eq(kvs_jobs_retained(J), 0); /* retrieves retain nothing */
	ck_assert_uint_eq(jstats(&f).retrieve_objects, 2 * S_OBJECTS);
	ck_assert_int_eq(complete(&f, &r0, 3, KVS_STATUS_OK), 0);
	ck_assert_int_eq(complete(&f, &r1, 3, KVS_STATUS_OK), 0);
	FX_PUMP_UNTIL(&f, kvs_jobs_open(J) == 0);
	ck_assert_uint_eq(jstats(&f).committed, 3);
	ck_assert_uint_eq(jstats(&f).copy_bytes, 4 * S_BYTES);
	for (int k = 0; k < 2; k++)
		ck_assert_msg(memcmp(rs[k]->mem, want[k], MSZ) == 0, "rank %d memory differs after retrieve", k);
	/* a retrieve of chunks nobody stored: a miss, nothing written */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_RETRIEVE, 4, 50, 3, RA, RB), KVS_E_MISS);
	ck_assert_uint_eq(kvs_jobs_open(J), 0);
	ck_assert_uint_eq(jstats(&f).aborted, 1);
	ck_assert_uint_eq(leases(&f, &r0), 0);
	ck_assert_int_eq(kvs_l1_check(f.srv->l1), 0);
	rank_close(&r0);
	rank_close(&r1);
	fx_stop(&f);
}
END_TEST

/* event_hashes (the engine's names for KV events): one per key or none; a
 * store with another count is refused and aborts its job, nothing reserved */
START_TEST(test_event_hashes_count)
{
	fx f;
	fx_start(&f, 0, 0);
	rank r0;
	rank_open(&f, &r0, "r0", "eng", 0, 1);
	uint8_t keys[3 * 32], names[3 * 32];
	for (uint32_t i = 0; i < 3; i++) {
		key_of(keys + 32 * i, 40 + i);
		memset(names + 32 * i, 0xE0 + (int)i, 32);
	}
	kvs_msg rq = {.op = KVS_OP_STORE, .id = 10, .session = r0.s->id, .job = 5, .keys = keys, .n_keys = 3,
		      .event_hashes = names, .n_event_hashes = 2};
	rq.blocks.n = 2;
	rq.blocks.ids[0] = SA;
	rq.blocks.len[0] = 6;
	rq.blocks.ids[1] = SB;
	rq.blocks.len[1] = 3;
	ck_assert_int_eq(kvs__op_store(f.srv, r0.s, &rq), KVS_E_GEOMETRY);
	ck_assert_ptr_nonnull(strstr(f.srv->errbuf, "event_hashes"));
	ck_assert_uint_eq(l1stats(&f).objects_reserved, 0);
	ck_assert_uint_eq(kvs_jobs_retained(f.srv->jobs), 0);
	/* one per key: accepted */
	rq.job = 6;
	rq.n_event_hashes = 3;
	ck_assert_int_eq(kvs__op_store(f.srv, r0.s, &rq), 0);
	ck_assert_int_eq(complete(&f, &r0, 6, KVS_STATUS_OK), 0);
	FX_PUMP_UNTIL(&f, kvs_jobs_open(f.srv->jobs) == 0);
	ck_assert_uint_eq(l1stats(&f).objects, S_OBJECTS);
	rank_close(&r0);
	fx_stop(&f);
}
END_TEST

START_TEST(test_complete_unknown_and_state)
{
	fx f;
	fx_start(&f, 0, 0);
	rank r0, r1;
	rank_open(&f, &r0, "r0", "eng", 0, 2);
	rank_open(&f, &r1, "r1", "eng", 1, 2);
	ck_assert_int_eq(complete(&f, &r0, 999, KVS_STATUS_OK), KVS_E_JOB_STATE);
	ck_assert_ptr_nonnull(strstr(f.srv->errbuf, "unknown"));
	ck_assert_uint_eq(kvs_jobs_open(f.srv->jobs), 0);
	/* a rank that sent no part cannot complete */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 5, 0, 3, SA, SB), 0);
	ck_assert_int_eq(complete(&f, &r1, 5, KVS_STATUS_OK), KVS_E_JOB_STATE);
	ck_assert_ptr_nonnull(strstr(f.srv->errbuf, "no part"));
	/* a session of another world: a conflict */
	rank w3;
	rank_open(&f, &w3, "w3", "eng", 2, 3);
	ck_assert_int_eq(part(&f, &w3, KVS_OP_STORE, 5, 0, 3, SA, SB), KVS_E_JOB_CONFLICT);
	ck_assert_int_eq(complete(&f, &w3, 5, KVS_STATUS_OK), KVS_E_JOB_CONFLICT);
	/* the same id under another engine is another job */
	rank o0;
	rank_open(&f, &o0, "o0", "other", 0, 1);
	ck_assert_int_eq(complete(&f, &o0, 5, KVS_STATUS_OK), KVS_E_JOB_STATE);
	ck_assert_uint_eq(kvs_jobs_open(f.srv->jobs), 1);
	/* a refused part (bad block list) aborts its job at once */
	static const int64_t bad[6] = {1, 2, 3, 4, 5, 16};
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 6, 0, 3, bad, SB), KVS_E_RANGE);
	ck_assert(kvs_jobs_known(f.srv->jobs, "eng", 6));
	ck_assert_uint_eq(kvs_jobs_retained(f.srv->jobs), S_RETAINED); /* job 5's only */
	/* rank 1's part of that job now gets the terminal state, stores nothing */
	uint64_t so = jstats(&f).store_objects;
	ck_assert_int_eq(part(&f, &r1, KVS_OP_STORE, 6, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(jstats(&f).store_objects, so);
	ck_assert_uint_eq(kvs_jobs_open(f.srv->jobs), 1);
	ck_assert_uint_eq(jstats(&f).aborted, 1);
	rank_close(&r0);
	rank_close(&r1);
	rank_close(&w3);
	rank_close(&o0);
	fx_stop(&f);
}
END_TEST

START_TEST(test_failed_complete_aborts)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_jobs *J = f.srv->jobs;
	rank r0, r1;
	rank_open(&f, &r0, "r0", "eng", 0, 2);
	rank_open(&f, &r1, "r1", "eng", 1, 2);
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 7, 0, 3, SA, SB), 0);
	ck_assert_int_eq(part(&f, &r1, KVS_OP_STORE, 7, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(l1stats(&f).bytes_reserved, 2 * S_BYTES);
	ck_assert_uint_eq(kvs_jobs_retained(J), 2 * S_RETAINED);
	ck_assert_int_eq(complete(&f, &r0, 7, KVS_STATUS_FAILED), 0);
	FX_PUMP_UNTIL(&f, kvs_jobs_open(J) == 0);
	kvs_jobs_stats js = jstats(&f);
	ck_assert_uint_eq(js.aborted, 1);
	ck_assert_uint_eq(js.committed, 0);
	ck_assert_uint_eq(kvs_jobs_retained(J), 0);
	kvs_l1_stats l1 = l1stats(&f);
	ck_assert_uint_eq(l1.bytes_reserved, 0);
	ck_assert_uint_eq(l1.objects, 0);
	ck_assert_uint_eq(l1.bytes_used, 0);
	ck_assert_uint_eq(leases(&f, &r0), 0);
	ck_assert_uint_eq(leases(&f, &r1), 0);
	/* rank 1's late complete and repeats answer the terminal state */
	ck_assert_int_eq(complete(&f, &r1, 7, KVS_STATUS_OK), 0);
	ck_assert_int_eq(part(&f, &r1, KVS_OP_STORE, 7, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(kvs_jobs_open(J), 0);
	ck_assert_uint_eq(jstats(&f).store_objects, 2 * S_OBJECTS);
	ck_assert_uint_eq(l1stats(&f).objects, 0);
	/* nothing was committed: a retrieve misses */
	static const int64_t RA[6] = {5, 6, 0, 0, 7, 8};
	static const int64_t RB[3] = {9, 0, 10};
	ck_assert_int_eq(part(&f, &r0, KVS_OP_RETRIEVE, 8, 0, 3, RA, RB), KVS_E_MISS);
	ck_assert_int_eq(kvs_l1_check(f.srv->l1), 0);

	/* a session going away before completing aborts its jobs too */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 9, 0, 3, SA, SB), 0);
	ck_assert_int_eq(complete(&f, &r0, 9, KVS_STATUS_OK), 0);
	ck_assert_int_eq(part(&f, &r1, KVS_OP_STORE, 9, 0, 3, SA, SB), 0);
	kvs__session_close(f.srv, r1.s, "test");
	FX_PUMP_UNTIL(&f, kvs_jobs_open(J) == 0);
	ck_assert_uint_eq(jstats(&f).aborted, 3);
	ck_assert_uint_eq(l1stats(&f).bytes_reserved, 0);
	ck_assert_uint_eq(kvs_jobs_retained(J), 0);
	/* r1's registration went with its session once its lease was dropped */
	ck_assert_uint_eq(kvs_registry_count(f.srv->reg), 1);
	rank_close(&r0);
	rank_close(&r1);
	fx_stop(&f);
}
END_TEST

START_TEST(test_terminal_table_bounded)
{
	fx f;
	fx_start(&f, 4, 0);
	kvs_jobs *J = f.srv->jobs;
	rank s;
	rank_open(&f, &s, "solo", "solo", 0, 1);
	for (uint64_t job = 1; job <= 6; job++) {
		ck_assert_int_eq(part(&f, &s, KVS_OP_STORE, job, 10 * (uint32_t)job, 3, SA, SB), 0);
		ck_assert_int_eq(complete(&f, &s, job, KVS_STATUS_OK), 0);
		FX_PUMP_UNTIL(&f, kvs_jobs_open(J) == 0);
		ck_assert_uint_eq(jstats(&f).terminal_entries, job < 4 ? job : 4);
	}
	ck_assert_uint_eq(jstats(&f).committed, 6);
	ck_assert(!kvs_jobs_known(J, "solo", 1));
	ck_assert(!kvs_jobs_known(J, "solo", 2));
	for (uint64_t job = 3; job <= 6; job++)
		ck_assert_msg(kvs_jobs_known(J, "solo", job), "job %llu forgotten", (unsigned long long)job);
	/* the oldest are forgotten: a repeat of job 1's complete is unknown */
	ck_assert_int_eq(complete(&f, &s, 1, KVS_STATUS_OK), KVS_E_JOB_STATE);
	ck_assert_ptr_nonnull(strstr(f.srv->errbuf, "unknown"));
	ck_assert_int_eq(complete(&f, &s, 2, KVS_STATUS_OK), KVS_E_JOB_STATE);
	/* the newest four still answer */
	for (uint64_t job = 3; job <= 6; job++) {
		ck_assert_int_eq(complete(&f, &s, job, KVS_STATUS_OK), 0);
		ck_assert_int_eq(complete(&f, &s, job, KVS_STATUS_FAILED), KVS_E_JOB_CONFLICT);
	}
	ck_assert_uint_eq(jstats(&f).terminal_entries, 4);
	ck_assert_uint_eq(kvs_jobs_open(J), 0);
	rank_close(&s);
	fx_stop(&f);
}
END_TEST

START_TEST(test_deadline)
{
	fx f;
	fx_start(&f, 0, 1000);
	kvs_jobs *J = f.srv->jobs;
	rank r0, r1;
	rank_open(&f, &r0, "r0", "eng", 0, 2);
	rank_open(&f, &r1, "r1", "eng", 1, 2);
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 11, 0, 3, SA, SB), 0);
	ck_assert_int_eq(complete(&f, &r0, 11, KVS_STATUS_OK), 0);
	FX_PUMP_UNTIL(&f, jstats(&f).copy_bytes == S_BYTES);
	f.srv->now_ms += 999;
	kvs__server_tick(f.srv);
	ck_assert_uint_eq(kvs_jobs_open(J), 1);
	ck_assert_uint_eq(kvs_jobs_retained(J), S_RETAINED);
	f.srv->now_ms += 1;
	kvs__server_tick(f.srv);
	FX_PUMP_UNTIL(&f, kvs_jobs_open(J) == 0);
	ck_assert_uint_eq(jstats(&f).aborted, 1);
	ck_assert_uint_eq(kvs_jobs_retained(J), 0);
	ck_assert_uint_eq(l1stats(&f).bytes_reserved, 0);
	ck_assert_uint_eq(l1stats(&f).objects, 0);
	ck_assert_uint_eq(leases(&f, &r0), 0);
	/* the late rank gets the terminal state; nothing is stored */
	ck_assert_int_eq(part(&f, &r1, KVS_OP_STORE, 11, 0, 3, SA, SB), 0);
	ck_assert_uint_eq(jstats(&f).store_objects, S_OBJECTS);
	ck_assert_uint_eq(kvs_jobs_open(J), 0);
	/* a deadline passing while copies run: aborted once they finish */
	ck_assert_int_eq(part(&f, &r0, KVS_OP_STORE, 12, 0, 3, SA, SB), 0);
	f.srv->now_ms += 5000;
	kvs__server_tick(f.srv);
	FX_PUMP_UNTIL(&f, kvs_jobs_open(J) == 0);
	ck_assert_uint_eq(jstats(&f).aborted, 2);
	ck_assert_uint_eq(l1stats(&f).bytes_reserved, 0);
	ck_assert_uint_eq(kvs_jobs_retained(J), 0);
	rank_close(&r0);
	rank_close(&r1);
	fx_stop(&f);
}
END_TEST

static Suite *jobtable_suite(void)
{
	Suite *s = suite_create("jobtable");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_commit_retention_repeats);
	tcase_add_test(tc, test_event_hashes_count);
	tcase_add_test(tc, test_complete_unknown_and_state);
	tcase_add_test(tc, test_failed_complete_aborts);
	tcase_add_test(tc, test_terminal_table_bounded);
	tcase_add_test(tc, test_deadline);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(jobtable_suite)
