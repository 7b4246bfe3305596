/* Simulated rank processes; see rank.h. */
#include "rank.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Region layout: allocation 0 holds group 0 (5 layers, 1024 bytes per block,
 * stride 1088: padded), allocation 1 holds group 1 (3 layers, 2048 bytes,
 * stride 2048). */
#define G0_LAYERS 5
#define G1_LAYERS 3
#define G0_BYTES 1024
#define G0_STRIDE 1088
#define G1_BYTES 2048
#define G1_STRIDE 2048
#define A0_SIZE ((uint64_t)G0_LAYERS * KVT_NUM_BLOCKS * G0_STRIDE)
#define A1_SIZE ((uint64_t)G1_LAYERS * KVT_NUM_BLOCKS * G1_STRIDE + 4096)

void kvt_key(uint32_t k, uint8_t out[32]) { kvt_key_p(0, k, out); }

void kvt_key_p(uint32_t p, uint32_t k, uint8_t out[32])
{
	uint32_t tokens[KVT_CHUNK_TOKENS * 64];
	for (uint32_t i = 0; i < (k + 1) * KVT_CHUNK_TOKENS; i++)
		tokens[i] = 1000 + i * 7 + p * 100003;
	uint8_t keys[64 * 32];
	kvs_keys_for_tokens("test-model", tokens, (k + 1) * KVT_CHUNK_TOKENS, KVT_CHUNK_TOKENS, keys, 64);
	memcpy(out, keys + 32 * k, 32);
}

typedef struct region {
	uint8_t *a[2];
	uint8_t *orig[2];
	int fd[2];
	uint64_t size[2];
} region;

static uint8_t *block_ptr(region *rg, int g, uint32_t layer, uint64_t id)
{
	if (g == 0)
		return rg->a[0] + (uint64_t)layer * KVT_NUM_BLOCKS * G0_STRIDE + id * G0_STRIDE;
	return rg->a[1] + (uint64_t)layer * KVT_NUM_BLOCKS * G1_STRIDE + id * G1_STRIDE;
}

static int do_register(kvs_client *c, region *rg, uint32_t rank, uint64_t *handle)
{
	kvs_alloc al[2] = {{.fd = rg->fd[0], .size = rg->size[0]}, {.fd = rg->fd[1], .size = rg->size[1]}};
	(void)rank; /* alloc ids left zero: the library draws random ones */
	kvs_group gr[2] = {{.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16,
			    .blocks_per_chunk = KVT_G0_BPC, .window_chunks = -1, .null_block = -1},
			   {.id = 1, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 32,
			    .blocks_per_chunk = KVT_G1_BPC, .window_chunks = -1, .null_block = -1}};
	kvs_layer ly[G0_LAYERS + G1_LAYERS];
	for (int l = 0; l < G0_LAYERS; l++)
		ly[l] = (kvs_layer){.group = 0, .alloc = 0, .offset = (uint64_t)l * KVT_NUM_BLOCKS * G0_STRIDE,
				    .num_blocks = KVT_NUM_BLOCKS, .block_stride = G0_STRIDE, .block_bytes = G0_BYTES};
	for (int l = 0; l < G1_LAYERS; l++)
		ly[G0_LAYERS + l] = (kvs_layer){.group = 1, .alloc = 1,
						.offset = (uint64_t)l * KVT_NUM_BLOCKS * G1_STRIDE,
						.num_blocks = KVT_NUM_BLOCKS, .block_stride = G1_STRIDE,
						.block_bytes = G1_BYTES};
	kvs_registration_desc d = {.device_type = KVS_DEV_HOST, .allocs = al, .n_allocs = 2,
				   .groups = gr, .n_groups = 2, .layers = ly,
				   .n_layers = G0_LAYERS + G1_LAYERS};
	return kvs_register(c, &d, 5000, handle);
}

static void fill_lists(const kvt_cmd *cmd, uint32_t base, int64_t *l0, int64_t *l1)
{
	for (uint32_t k = 0; k < cmd->n_keys; k++) {
		uint32_t c = k + cmd->block_chunk;
		for (uint32_t b = 0; b < KVT_G0_BPC; b++)
			l0[k * KVT_G0_BPC + b] = base + c * KVT_G0_BPC + b;
		for (uint32_t b = 0; b < KVT_G1_BPC; b++)
			l1[k * KVT_G1_BPC + b] = base + c * KVT_G1_BPC + b;
	}
}

/* Checks that destination blocks equal their sources (respecting skip_tokens)
 * and that every other byte of the region is as it was at start. */
static void verify(region *rg, const kvt_cmd *cmd, kvt_res *res)
{
	uint8_t *expect[2];
	for (int a = 0; a < 2; a++) {
		expect[a] = malloc(rg->size[a]);
		memcpy(expect[a], rg->orig[a], rg->size[a]);
	}
	region ex = {.a = {expect[0], expect[1]}};
	for (uint32_t k = 0; k < cmd->n_keys; k++) {
		for (int g = 0; g < 2; g++) {
			uint32_t bpc = g ? KVT_G1_BPC : KVT_G0_BPC;
			uint32_t tpb = g ? 32 : 16;
			uint32_t layers = g ? G1_LAYERS : G0_LAYERS;
			uint32_t bytes = g ? G1_BYTES : G0_BYTES;
			for (uint32_t b = 0; b < bpc; b++) {
				if ((uint64_t)(k * bpc + b + 1) * tpb <= cmd->skip_tokens)
					continue;
				for (uint32_t l = 0; l < layers; l++)
					memcpy(block_ptr(&ex, g, l, cmd->dst_base + k * bpc + b),
					       block_ptr(&(region){.a = {rg->orig[0], rg->orig[1]}}, g, l,
							 cmd->src_base + k * bpc + b),
					       bytes);
			}
		}
	}
	res->value = 0;
	for (int a = 0; a < 2; a++) {
		for (uint64_t i = 0; i < rg->size[a]; i++)
			res->value += rg->a[a][i] != expect[a][i];
		free(expect[a]);
	}
	res->code = 0;
}

/* Replies of a part and its complete sent back to back. */
typedef struct pair_wait {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int left, code[2], state[2];
} pair_wait;

static void pair_done(pair_wait *w, int i, const kvs_result *r)
{
	pthread_mutex_lock(&w->mu);
	w->code[i] = r->code;
	w->state[i] = r->state;
	w->left--;
	pthread_cond_signal(&w->cv);
	pthread_mutex_unlock(&w->mu);
}

static void part_cb(const kvs_result *r, void *arg) { pair_done(arg, 0, r); }
static void complete_cb(const kvs_result *r, void *arg) { pair_done(arg, 1, r); }

static void part_then_complete(kvs_client *c, const kvt_cmd *cmd, const uint8_t *keys, const kvs_blocks *bl,
			       int to, kvt_res *res)
{
	pair_wait w = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .left = 2};
	int r = cmd->op == KVT_STORE_COMPLETE
			? kvs_store_async(c, cmd->job, keys, cmd->n_keys, bl, NULL, to, part_cb, &w)
			: kvs_retrieve_async(c, cmd->job, keys, cmd->n_keys, bl, cmd->skip_tokens, to, part_cb, &w);
	if (r) {
		res->code = r;
		return;
	}
	r = kvs_complete_async(c, cmd->job, true, to, complete_cb, &w);
	pthread_mutex_lock(&w.mu);
	if (r)
		w.left--;
	while (w.left > 0)
		pthread_cond_wait(&w.cv, &w.mu);
	pthread_mutex_unlock(&w.mu);
	res->code = w.code[0];
	res->state = r ? -1 : w.code[1] ? -w.code[1] : w.state[1];
}

static void onemsg_cb(const kvs_result *r, void *arg) { pair_done(arg, 0, r); }

static void rank_main(kvt_server *s, const char *engine, uint32_t rank, uint32_t world, int cfd, int rfd)
{
	pair_wait one = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
	uint64_t one_job = 0;
	kvs_client *c = kvt_client(s, engine, KVS_ROLE_WORKER, rank, world, NULL, NULL);
	kvt_res res = {.code = c ? 0 : -1};
	region rg = {.size = {A0_SIZE, A1_SIZE}};
	srandom(1234 + rank);
	for (int a = 0; a < 2 && c; a++) {
		if (kvs_memfd_create("kvt", rg.size[a], &rg.fd[a], (void **)&rg.a[a]) != 0)
			_exit(3);
		rg.orig[a] = malloc(rg.size[a]);
		for (uint64_t i = 0; i < rg.size[a]; i++)
			rg.a[a][i] = (uint8_t)random();
		memcpy(rg.orig[a], rg.a[a], rg.size[a]);
	}
	uint64_t handle = 0;
	if (c)
		res.code = do_register(c, &rg, rank, &handle);
	if (write(rfd, &res, sizeof(res)) != sizeof(res))
		_exit(4);
	kvt_cmd cmd;
	while (read(cfd, &cmd, sizeof(cmd)) == sizeof(cmd)) {
		memset(&res, 0, sizeof(res));
		uint8_t keys[64 * 32];
		for (uint32_t k = 0; k < cmd.n_keys && k < 64; k++)
			kvt_key_p(cmd.prompt, cmd.first_key + k, keys + 32 * k);
		int64_t l0[256], l1[256];
		const int64_t *ids[2] = {l0, l1};
		uint32_t lens[2] = {cmd.n_keys * KVT_G0_BPC, cmd.n_keys * KVT_G1_BPC};
		kvs_blocks bl = {.n_groups = 2, .ids = ids, .len = lens};
		int to = cmd.timeout_ms ? cmd.timeout_ms : 10000;
		switch (cmd.op) {
		case KVT_STORE:
			fill_lists(&cmd, cmd.src_base, l0, l1);
			res.code = kvs_store(c, cmd.job, keys, cmd.n_keys, &bl, NULL, to, &res.state);
			break;
		case KVT_STORE_RAW: {
			const int64_t *rids[2] = {cmd.ids0, cmd.ids1};
			uint32_t rl[2] = {cmd.len0, cmd.len1};
			kvs_blocks rb = {.n_groups = 2, .ids = rids, .len = rl};
			res.code = kvs_store(c, cmd.job, keys, cmd.n_keys, &rb, NULL, to, &res.state);
			break;
		}
		case KVT_RETRIEVE:
			fill_lists(&cmd, cmd.dst_base, l0, l1);
			res.code = kvs_retrieve(c, cmd.job, keys, cmd.n_keys, &bl, cmd.skip_tokens, to, &res.state);
			break;
		case KVT_COMPLETE:
			res.code = kvs_complete(c, cmd.job, cmd.ok, to, &res.state);
			break;
		case KVT_STORE_COMPLETE:
			fill_lists(&cmd, cmd.src_base, l0, l1);
			part_then_complete(c, &cmd, keys, &bl, to, &res);
			break;
		case KVT_RETRIEVE_COMPLETE:
			fill_lists(&cmd, cmd.dst_base, l0, l1);
			part_then_complete(c, &cmd, keys, &bl, to, &res);
			break;
		case KVT_STORE_ONEMSG:
			fill_lists(&cmd, cmd.src_base, l0, l1);
			one.left = 1;
			one_job = cmd.job;
			res.code = kvs_store_complete_async(c, cmd.job, keys, cmd.n_keys, &bl, NULL, to, onemsg_cb, &one);
			if (res.code)
				one.left = 0;
			break;
		case KVT_ONEMSG_RESULT: {
			pthread_mutex_lock(&one.mu);
			while (one.left > 0)
				pthread_cond_wait(&one.cv, &one.mu);
			pthread_mutex_unlock(&one.mu);
			res.code = one.code[0];
			res.state = one.state[0];
			int st = 99;
			if (kvs_job_wait(c, one_job, 1000, &st) != 0)
				st = 99;
			res.value = (uint64_t)st;
			break;
		}
		case KVT_VERIFY:
			verify(&rg, &cmd, &res);
			break;
		case KVT_UNREGISTER:
			res.code = kvs_unregister(c, handle, to);
			break;
		case KVT_REGISTER:
			res.code = do_register(c, &rg, rank, &handle);
			break;
		case KVT_RESET:
			for (int a = 0; a < 2; a++)
				memcpy(rg.a[a], rg.orig[a], rg.size[a]);
			break;
		case KVT_PEEK:
			memcpy(res.data, block_ptr(&rg, 0, 0, cmd.src_base), 64);
			break;
		case KVT_STATE:
			res.value = kvs_client_reconnects(c);
			res.value2 = kvs_client_session(c);
			break;
		case KVT_EXIT:
			kvs_client_close(c);
			_exit(0);
		}
		if (write(rfd, &res, sizeof(res)) != sizeof(res))
			_exit(5);
	}
	_exit(0);
}

typedef struct rank_arg {
	kvt_server *s;
	const char *engine;
	uint32_t rank, world;
} rank_arg;

static void rank_entry(void *arg, int cfd, int rfd)
{
	rank_arg *a = arg;
	rank_main(a->s, a->engine, a->rank, a->world, cfd, rfd);
}

int kvt_rank_start(kvt_rank *r, kvt_server *s, const char *engine, uint32_t rank, uint32_t world)
{
	rank_arg a = {.s = s, .engine = engine, .rank = rank, .world = world};
	r->rank = rank;
	if (kvt_proc_start(&r->p, rank_entry, &a, NULL, 0) != 0)
		return -1;
	kvt_res res;
	if (kvt_proc_call(&r->p, NULL, 0, &res, sizeof(res), 15000) != 0)
		return -1;
	return res.code;
}

int kvt_rank_do(kvt_rank *r, const kvt_cmd *cmd, kvt_res *res)
{
	return kvt_proc_call(&r->p, cmd, sizeof(*cmd), res, sizeof(*res), 30000);
}

void kvt_rank_kill(kvt_rank *r) { kvt_proc_kill(&r->p); }

void kvt_rank_stop(kvt_rank *r)
{
	kvt_cmd c = {.op = KVT_EXIT};
	kvt_proc_stop(&r->p, &c, sizeof(c));
}
