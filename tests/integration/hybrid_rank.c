/* Hybrid-layout rank processes; see hybrid_rank.h. */
#include "hybrid_rank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rank.h" /* kvt_key_p */

/* ---- layout ------------------------------------------------------------------ */

typedef struct layer_spec {
	uint32_t gi;
	uint64_t bytes, stride;
} layer_spec;

static void layout(hr_region *rg, int geom)
{
	static const kvs_group groups[HR_MAX_GROUPS] = {
		{.id = 10, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = 4,
		 .window_chunks = -1, .null_block = -1},
		{.id = 11, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = 4,
		 .window_chunks = 2, .null_block = -1},
		{.id = 2, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 64, .blocks_per_chunk = 1,
		 .window_chunks = -1, .null_block = HR_REC_NULL},
		{.id = 3, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 64, .blocks_per_chunk = 1,
		 .window_chunks = -1, .null_block = HR_REC_NULL},
		{.id = 4, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 32, .blocks_per_chunk = 2,
		 .window_chunks = -1, .null_block = HR_REC_NULL},
	};
	/* layers 3,2,1,1,2, listed interleaved; padded strides except group 1 */
	static const layer_spec hybrid[] = {
		{0, 1024, 1088}, {1, 2048, 2048}, {2, 6144, 6400}, {0, 1024, 1088}, {3, 6144, 6400},
		{1, 2048, 2048}, {4, 6144, 6400}, {0, 1024, 1088}, {4, 4096, 6400},
	};
	static const layer_spec attn[] = {
		{0, 1024, 1088}, {1, 2048, 2048}, {0, 1024, 1088}, {1, 2048, 2048}, {0, 1024, 1088},
	};
	bool hy = geom != HR_ATTN_ONLY;
	const layer_spec *ls = hy ? hybrid : attn;
	rg->geom = geom;
	rg->n_groups = hy ? 5 : 2;
	rg->n_layers = hy ? 9 : 5;
	rg->n_allocs = hy ? 2 : 1;
	memcpy(rg->groups, groups, sizeof(groups));
	if (geom == HR_BAD_REC_WINDOW)
		rg->groups[3].window_chunks = 2;
	if (geom == HR_BAD_WINDOW_ZERO)
		rg->groups[1].window_chunks = 0;
	uint64_t off[2] = {0, 0};
	for (uint32_t li = 0; li < rg->n_layers; li++) {
		const kvs_group *G = &rg->groups[ls[li].gi];
		uint32_t a = G->kind == KVS_GROUP_RECURRENT ? 1 : 0;
		uint64_t nb = a ? HR_REC_BLOCKS : HR_ATT_BLOCKS;
		off[a] += a ? 256 : 512; /* a gap before every view */
		rg->layers[li] = (kvs_layer){.group = G->id, .alloc = a, .offset = off[a], .num_blocks = nb,
					     .block_stride = ls[li].stride, .block_bytes = ls[li].bytes};
		rg->layer_gi[li] = ls[li].gi;
		off[a] += nb * ls[li].stride;
	}
	if (geom == HR_BAD_BYTES)
		rg->layers[8].block_bytes = rg->layers[8].block_stride + 64;
	rg->size[0] = off[0] + 512;
	rg->size[1] = rg->n_allocs > 1 ? off[1] + 256 : 0;
}

static uint8_t poison_byte(uint32_t a, uint64_t i)
{
	return (uint8_t)(0xA5 ^ (i * 0x9E) ^ (i >> 9) ^ (a * 0x3C));
}

uint8_t *hr_block(const hr_region *rg, uint8_t *const buf[2], uint32_t li, uint64_t id)
{
	const kvs_layer *l = &rg->layers[li];
	return buf[l->alloc] + l->offset + id * l->block_stride;
}

void hr_restore(hr_region *rg)
{
	for (uint32_t a = 0; a < rg->n_allocs; a++)
		memcpy(rg->mem[a], rg->src[a], rg->size[a]);
}

void hr_poison(hr_region *rg)
{
	for (uint32_t a = 0; a < rg->n_allocs; a++)
		for (uint64_t i = 0; i < rg->size[a]; i++)
			rg->mem[a][i] = poison_byte(a, i);
}

void hr_expect_init(const hr_region *rg, uint8_t *exp[2])
{
	exp[0] = exp[1] = NULL;
	for (uint32_t a = 0; a < rg->n_allocs; a++) {
		exp[a] = malloc(rg->size[a]);
		if (!exp[a])
			abort();
		for (uint64_t i = 0; i < rg->size[a]; i++)
			exp[a][i] = poison_byte(a, i);
	}
}

void hr_expect_free(uint8_t *exp[2])
{
	free(exp[0]);
	free(exp[1]);
	exp[0] = exp[1] = NULL;
}

void hr_expect_copy(const hr_region *rg, uint8_t *exp[2], uint32_t gi, int64_t dst, int64_t src)
{
	for (uint32_t li = 0; li < rg->n_layers; li++)
		if (rg->layer_gi[li] == gi)
			memcpy(hr_block(rg, exp, li, (uint64_t)dst), hr_block(rg, rg->src, li, (uint64_t)src),
			       rg->layers[li].block_bytes);
}

uint64_t hr_diff(const hr_region *rg, uint8_t *const exp[2], const char *what)
{
	uint64_t n = 0;
	int shown = 0;
	for (uint32_t a = 0; a < rg->n_allocs; a++)
		for (uint64_t i = 0; i < rg->size[a]; i++) {
			if (rg->mem[a][i] == exp[a][i])
				continue;
			if (shown++ < 4) {
				/* name the layer and block the byte belongs to */
				const char *where = "gap";
				uint32_t lw = 0;
				uint64_t blk = 0, in = 0;
				for (uint32_t li = 0; li < rg->n_layers; li++) {
					const kvs_layer *l = &rg->layers[li];
					if (l->alloc == a && i >= l->offset && i < l->offset + l->num_blocks * l->block_stride) {
						lw = li;
						blk = (i - l->offset) / l->block_stride;
						in = (i - l->offset) % l->block_stride;
						where = in < l->block_bytes ? "block" : "padding";
					}
				}
				fprintf(stderr, "%s: alloc %u byte %llu (%s, layer %u group index %u block %llu +%llu): "
						"got %02x want %02x (poison %02x)\n",
					what, a, (unsigned long long)i, where, lw, rg->layer_gi[lw], (unsigned long long)blk,
					(unsigned long long)in, rg->mem[a][i], exp[a][i], poison_byte(a, i));
			}
			n++;
		}
	return n;
}

/* ---- the rank process -------------------------------------------------------------- */

static int do_register(kvs_client *c, hr_region *rg)
{
	kvs_alloc al[2];
	memset(al, 0, sizeof(al));
	for (uint32_t a = 0; a < rg->n_allocs; a++)
		al[a] = (kvs_alloc){.fd = rg->fd[a], .size = rg->size[a]};
	kvs_registration_desc d = {.device_type = KVS_DEV_HOST, .allocs = al, .n_allocs = rg->n_allocs,
				   .groups = rg->groups, .n_groups = rg->n_groups, .layers = rg->layers,
				   .n_layers = rg->n_layers};
	uint64_t handle;
	return kvs_register(c, &d, 5000, &handle);
}

static void rank_main(kvt_server *s, const char *engine, const char *ns, hr_region *rg, uint32_t rank,
		      uint32_t world, int cfd, int rfd)
{
	kvs_client *c = kvt_client_ns(s, engine, ns, KVS_ROLE_WORKER, rank, world);
	hr_res res = {.code = c ? do_register(c, rg) : -1};
	if (write(rfd, &res, sizeof(res)) != sizeof(res))
		_exit(4);
	hr_cmd cmd;
	while (read(cfd, &cmd, sizeof(cmd)) == sizeof(cmd)) {
		memset(&res, 0, sizeof(res));
		uint8_t keys[HR_MAX_IDS * 32];
		for (uint32_t k = 0; k < cmd.n_keys && k < HR_MAX_IDS; k++)
			kvt_key_p(cmd.prompt, cmd.first_key + k, keys + 32 * k);
		const int64_t *ids[HR_MAX_GROUPS];
		for (uint32_t g = 0; g < HR_MAX_GROUPS; g++)
			ids[g] = cmd.ids[g];
		kvs_blocks bl = {.n_groups = rg->n_groups, .ids = ids, .len = cmd.len};
		int to = cmd.timeout_ms ? cmd.timeout_ms : 10000;
		switch (cmd.op) {
		case HR_STORE: {
			kvs_store_opts o = {.lazy = cmd.lazy != 0};
			res.code = kvs_store(c, cmd.job, keys, cmd.n_keys, &bl, &o, to, &res.state);
			break;
		}
		case HR_RETRIEVE:
			res.code = kvs_retrieve(c, cmd.job, keys, cmd.n_keys, &bl, cmd.skip_tokens, to, &res.state);
			break;
		case HR_COMPLETE:
			res.code = kvs_complete(c, cmd.job, cmd.ok, to, &res.state);
			break;
		case HR_EXIT:
			kvs_client_close(c);
			_exit(0);
		default:
			res.code = -1;
		}
		if (write(rfd, &res, sizeof(res)) != sizeof(res))
			_exit(5);
	}
	kvs_client_close(c);
	_exit(0);
}

typedef struct rank_arg {
	kvt_server *s;
	const char *engine, *ns;
	hr_region *rg;
	uint32_t rank, world;
} rank_arg;

static void rank_entry(void *arg, int cfd, int rfd)
{
	rank_arg *a = arg;
	rank_main(a->s, a->engine, a->ns, a->rg, a->rank, a->world, cfd, rfd);
}

int hr_rank_start(hr_rank *r, kvt_server *s, const char *engine, const char *ns, int geom, uint32_t rank,
		  uint32_t world, unsigned seed)
{
	memset(r, 0, sizeof(*r));
	hr_region *rg = &r->rg;
	layout(rg, geom);
	uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
	for (uint32_t a = 0; a < rg->n_allocs; a++) {
		if (kvs_memfd_create("kvt-hybrid", rg->size[a], &rg->fd[a], (void **)&rg->mem[a]) != 0)
			return -1;
		kvt_proc_track(rg->fd[a]);
		rg->src[a] = malloc(rg->size[a]);
		if (!rg->src[a])
			return -1;
		for (uint64_t i = 0; i < rg->size[a]; i++) {
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
			rg->src[a][i] = (uint8_t)(x >> 24);
		}
		memcpy(rg->mem[a], rg->src[a], rg->size[a]);
	}
	/* the child keeps its own memfds and closes every other rank's */
	rank_arg ra = {.s = s, .engine = engine, .ns = ns, .rg = rg, .rank = rank, .world = world};
	r->rank = rank;
	if (kvt_proc_start(&r->p, rank_entry, &ra, rg->fd, (int)rg->n_allocs) != 0)
		return -1;
	hr_res res;
	if (kvt_proc_call(&r->p, NULL, 0, &res, sizeof(res), 15000) != 0)
		return -1;
	return res.code;
}

int hr_rank_do(hr_rank *r, const hr_cmd *cmd, hr_res *res)
{
	return kvt_proc_call(&r->p, cmd, sizeof(*cmd), res, sizeof(*res), 30000);
}

void hr_rank_stop(hr_rank *r)
{
	hr_cmd c = {.op = HR_EXIT};
	kvt_proc_stop(&r->p, &c, sizeof(c));
	hr_region *rg = &r->rg;
	for (uint32_t a = 0; a < rg->n_allocs; a++) {
		if (rg->mem[a])
			munmap(rg->mem[a], rg->size[a]);
		if (rg->fd[a] > 0) {
			kvt_proc_untrack(rg->fd[a]);
			close(rg->fd[a]);
		}
		free(rg->src[a]);
		rg->mem[a] = rg->src[a] = NULL;
		rg->fd[a] = -1;
	}
}
