/* kvside-demo: a short workload against a running kvside-server. Four
 * simulated TP ranks (each its own session and memfd KV region: 2 groups,
 * 8 layers) and a scheduler store a prompt's KV blocks, look them up,
 * retrieve them into other blocks and verify every byte. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvside.h"

static const char *kvs_tier_name_pub(int t)
{
	return t == KVS_TIER_L3 ? "L3 (shared)" : t == KVS_TIER_L2 ? "L2 (disk)" : "L1 (DRAM)";
}

#define WORLD 4
#define LAYERS0 6   /* group 0: full attention, 16 tokens/block, 16 blocks/chunk */
#define LAYERS1 2   /* group 1: sliding-window layers, same block size */
#define BLOCK_BYTES 8192
#define NUM_BLOCKS 256
#define CHUNK_TOKENS 256
#define N_CHUNKS 4

static const char *broker_dir;
static int after_restart; /* second run: the server restarted, nothing stored by us */
static uint8_t keys[N_CHUNKS * 32];

typedef struct rank_ctx {
	uint32_t rank;
	kvs_client *c;
	uint8_t *mem;
	int fd;
	uint64_t size;
	int result;
	pthread_barrier_t *bar;
	uint64_t mismatches;
} rank_ctx;

static void lists(uint32_t base, int64_t *l0, int64_t *l1)
{
	for (uint32_t i = 0; i < N_CHUNKS * 16; i++)
		l0[i] = l1[i] = base + i;
}

static void *rank_main(void *arg)
{
	rank_ctx *r = arg;
	kvs_client_config cfg = {.broker_dir = broker_dir, .engine = "demo-engine", .ns = "llama-demo:v1",
				 .role = KVS_ROLE_WORKER, .rank = r->rank, .world = WORLD};
	if ((r->result = kvs_client_open(&cfg, &r->c)) != 0)
		goto out;
	r->size = (uint64_t)(LAYERS0 + LAYERS1) * NUM_BLOCKS * BLOCK_BYTES;
	if ((r->result = kvs_memfd_create("demo-kv", r->size, &r->fd, (void **)&r->mem)) != 0)
		goto out;
	/* deterministic per rank (a private xorshift, not the shared random()),
	 * so the run after a restart has the same source bytes */
	uint64_t x = 0x9E3779B97F4A7C15ull * (r->rank + 1);
	for (uint64_t i = 0; i < r->size; i += 8) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		memcpy(r->mem + i, &x, 8);
	}
	kvs_alloc al = {.fd = r->fd, .size = r->size};
	kvs_group gr[2] = {{.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = 16,
			    .window_chunks = -1, .null_block = -1},
			   {.id = 1, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = 16,
			    .window_chunks = -1, .null_block = -1}};
	kvs_layer ly[LAYERS0 + LAYERS1];
	for (uint32_t l = 0; l < LAYERS0 + LAYERS1; l++)
		ly[l] = (kvs_layer){.group = l < LAYERS0 ? 0 : 1, .alloc = 0,
				    .offset = (uint64_t)l * NUM_BLOCKS * BLOCK_BYTES, .num_blocks = NUM_BLOCKS,
				    .block_stride = BLOCK_BYTES, .block_bytes = BLOCK_BYTES};
	kvs_registration_desc d = {.device_type = KVS_DEV_HOST, .allocs = &al, .n_allocs = 1, .groups = gr,
				   .n_groups = 2, .layers = ly, .n_layers = LAYERS0 + LAYERS1};
	uint64_t handle;
	if ((r->result = kvs_register(r->c, &d, 0, &handle)) != 0)
		goto out;
	printf("  rank %u: registered %llu MiB of KV memory (memfd, 2 groups, %d layers)\n", r->rank,
	       (unsigned long long)(r->size >> 20), LAYERS0 + LAYERS1);
	pthread_barrier_wait(r->bar); /* registered */
	pthread_barrier_wait(r->bar); /* scheduler: go store */
	int64_t l0[N_CHUNKS * 16], l1[N_CHUNKS * 16];
	const int64_t *ids[2] = {l0, l1};
	uint32_t lens[2] = {N_CHUNKS * 16, N_CHUNKS * 16};
	kvs_blocks bl = {.n_groups = 2, .ids = ids, .len = lens};
	lists(0, l0, l1);
	int st;
	if (!after_restart &&
	    ((r->result = kvs_store(r->c, 1, keys, N_CHUNKS, &bl, NULL, 0, &st)) != 0 ||
	     (r->result = kvs_complete(r->c, 1, true, 0, &st)) != 0))
		goto out;
	pthread_barrier_wait(r->bar); /* stored */
	pthread_barrier_wait(r->bar); /* scheduler: go retrieve */
	lists(128, l0, l1);
	if ((r->result = kvs_retrieve(r->c, 2, keys, N_CHUNKS, &bl, 0, 0, &st)) != 0 ||
	    (r->result = kvs_complete(r->c, 2, true, 0, &st)) != 0)
		goto out;
	for (uint32_t l = 0; l < LAYERS0 + LAYERS1; l++) {
		uint8_t *layer = r->mem + (uint64_t)l * NUM_BLOCKS * BLOCK_BYTES;
		r->mismatches += memcmp(layer, layer + 128ull * BLOCK_BYTES, N_CHUNKS * 16ull * BLOCK_BYTES) != 0;
	}
	pthread_barrier_wait(r->bar); /* retrieved */
	kvs_unregister(r->c, handle, 0);
	return NULL;
out:
	fprintf(stderr, "  rank %u failed: %s\n", r->rank, kvs_strerror(r->result));
	exit(1);
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--after-restart") == 0)
			after_restart = 1;
		else
			broker_dir = argv[i];
	}
	uint32_t tokens[N_CHUNKS * CHUNK_TOKENS];
	for (uint32_t i = 0; i < N_CHUNKS * CHUNK_TOKENS; i++)
		tokens[i] = (i * 2654435761u) % 32000;
	kvs_keys_for_tokens("llama-demo:v1", tokens, N_CHUNKS * CHUNK_TOKENS, CHUNK_TOKENS, keys, N_CHUNKS);
	printf("kvside demo: %d ranks + 1 scheduler, a prompt of %d tokens = %d chunks\n", WORLD,
	       N_CHUNKS * CHUNK_TOKENS, N_CHUNKS);
	kvs_client_config cfg = {.broker_dir = broker_dir, .engine = "demo-engine", .ns = "llama-demo:v1",
				 .role = KVS_ROLE_SCHEDULER, .rank = 0, .world = WORLD};
	kvs_client *sched;
	int r = kvs_client_open(&cfg, &sched);
	if (r) {
		fprintf(stderr, "cannot reach kvside-server: %s\n", kvs_strerror(r));
		return 1;
	}
	pthread_barrier_t bar;
	pthread_barrier_init(&bar, NULL, WORLD + 1);
	rank_ctx rk[WORLD];
	pthread_t th[WORLD];
	for (uint32_t i = 0; i < WORLD; i++) {
		rk[i] = (rank_ctx){.rank = i, .bar = &bar};
		pthread_create(&th[i], NULL, rank_main, &rk[i]);
	}
	pthread_barrier_wait(&bar);
	uint64_t hits;
	uint8_t tiers[N_CHUNKS];
	int st = -1;
	kvs_lookup(sched, keys, N_CHUNKS, false, 0, 0, &hits, tiers);
	if (after_restart) {
		printf("scheduler: after the server restart, lookup -> %llu of %d chunks cached, tier %s\n",
		       (unsigned long long)hits, N_CHUNKS, hits ? kvs_tier_name_pub(tiers[0]) : "-");
		pthread_barrier_wait(&bar);
		pthread_barrier_wait(&bar);
	} else {
		printf("scheduler: lookup before store -> %llu of %d chunks cached\n", (unsigned long long)hits,
		       N_CHUNKS);
		pthread_barrier_wait(&bar);
		pthread_barrier_wait(&bar);
		r = kvs_job_wait(sched, 1, 5000, &st);
		printf("scheduler: store job 1 -> job_done %s\n", r ? kvs_strerror(r) : kvs_state_name(st));
		kvs_lookup(sched, keys, N_CHUNKS, false, 0, 0, &hits, tiers);
		printf("scheduler: lookup after store -> %llu of %d chunks cached (every rank, every group), tier %s\n",
		       (unsigned long long)hits, N_CHUNKS, hits ? kvs_tier_name_pub(tiers[0]) : "-");
	}
	pthread_barrier_wait(&bar);
	pthread_barrier_wait(&bar);
	r = kvs_job_wait(sched, 2, 5000, &st);
	printf("scheduler: retrieve job 2 into other blocks -> job_done %s\n",
	       r ? kvs_strerror(r) : kvs_state_name(st));
	uint64_t bad = 0;
	for (uint32_t i = 0; i < WORLD; i++) {
		pthread_join(th[i], NULL);
		bad += rk[i].mismatches;
		printf("  rank %u: retrieved blocks %s their sources\n", i,
		       rk[i].mismatches ? "DIFFER FROM" : "are byte-identical to");
	}
	kvs_stat_out s[256];
	uint32_t n = 0;
	kvs_stats(sched, 0, s, 256, &n);
	printf("server: %llu sessions, %llu L1 objects (%llu KiB), %llu L2 objects, %llu jobs committed, "
	       "%llu bytes copied, retained_blocks %llu\n",
	       (unsigned long long)kvs_stat_find(s, n, "sessions"), (unsigned long long)kvs_stat_find(s, n, "l1_objects"),
	       (unsigned long long)(kvs_stat_find(s, n, "l1_bytes") >> 10),
	       (unsigned long long)kvs_stat_find(s, n, "l2_objects"),
	       (unsigned long long)kvs_stat_find(s, n, "jobs_committed"),
	       (unsigned long long)kvs_stat_find(s, n, "copy_bytes"),
	       (unsigned long long)kvs_stat_find(s, n, "retained_blocks"));
	for (uint32_t i = 0; i < WORLD; i++)
		kvs_client_close(rk[i].c);
	kvs_client_close(sched);
	printf("demo %s\n", bad || hits != N_CHUNKS ? "FAILED" : "passed");
	return bad || hits != N_CHUNKS;
}
