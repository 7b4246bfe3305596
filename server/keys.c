/* Keys the server derives; see keys.h. */
#include "keys.h"

#include <sodium.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

static void digest16(const void *a, size_t alen, uint8_t out[16])
{
	crypto_generichash(out, 16, a, alen, NULL, 0);
}

void kvs_job_key(const char *engine, uint64_t id, uint8_t key[KVS_JOBKEY_BYTES])
{
	digest16(engine, strlen(engine), key);
	memcpy(key + 16, &id, 8);
}

void kvs_ns_digest(const char *ns, uint8_t out[16]) { digest16(ns, strlen(ns), out); }

void kvs_obj_key(kvs_objkey *k, const uint8_t ns[16], uint32_t world, uint32_t rank, uint32_t group,
		 const uint8_t *chunk)
{
	memset(k, 0, sizeof(*k));
	memcpy(k->chunk, chunk, 32);
	memcpy(k->ns, ns, 16);
	k->world = world;
	k->rank = rank;
	k->group = group;
}

/* XXH3-128, not BLAKE2b: only the engine's own ranks can name its jobs, and
 * a part carries up to hundreds of KiB of block ids (BLAKE2b cost ~130 us
 * per 16k ids). The state lives on the stack: no allocation, so no failure
 * path. */
void kvs_part_digest(const kvs_msg *rq, uint8_t out[16])
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
