/* Object records; see kvs_record.h. */
#include "kvs_record.h"

#include <string.h>
#include <xxhash.h>

/* libxxhash's x86 dispatch entry points pick AVX2 / AVX-512 at run time
 * (same values). Weak: a libxxhash without them leaves them NULL, and the
 * plain ones are used. */
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxh_x86dispatch.h>)
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#pragma weak XXH3_64bits_withSeed_dispatch
#pragma weak XXH3_64bits_update_dispatch
#define KVS_XXH_DISPATCH 1
#endif
#endif

void kvs_record_init(kvs_record_hdr *h, const kvs_objkey *key, uint64_t geom, uint64_t len)
{
	*h = (kvs_record_hdr){.magic = {'K', 'V', 'L', '2'}, .version = KVS_RECORD_VERSION, .geom = geom,
			      .len = len, .key = *key};
}

uint64_t kvs_record_seed(const kvs_record_hdr *h, const kvs_objkey *key)
{
	kvs_record_hdr z = *h;
	z.checksum = 0;
	z.key = *key;
	return XXH3_64bits(&z, sizeof(z));
}

uint64_t kvs_record_sum(uint64_t seed, const void *data, uint64_t len)
{
#ifdef KVS_XXH_DISPATCH
	if (XXH3_64bits_withSeed_dispatch)
		return XXH3_64bits_withSeed_dispatch(data, len, seed);
#endif
	return XXH3_64bits_withSeed(data, len, seed);
}

kvs_record_hasher *kvs_record_hasher_new(void) { return (kvs_record_hasher *)XXH3_createState(); }

void kvs_record_hasher_free(kvs_record_hasher *hs)
{
	if (hs)
		XXH3_freeState((XXH3_state_t *)hs);
}

void kvs_record_hasher_reset(kvs_record_hasher *hs, uint64_t seed)
{
	XXH3_64bits_reset_withSeed((XXH3_state_t *)hs, seed);
}

void kvs_record_hasher_update(kvs_record_hasher *hs, const void *data, uint64_t len)
{
#ifdef KVS_XXH_DISPATCH
	if (XXH3_64bits_update_dispatch) {
		XXH3_64bits_update_dispatch((XXH3_state_t *)hs, data, len);
		return;
	}
#endif
	XXH3_64bits_update((XXH3_state_t *)hs, data, len);
}

uint64_t kvs_record_hasher_digest(const kvs_record_hasher *hs) { return XXH3_64bits_digest((const XXH3_state_t *)hs); }

int kvs_record_check(const void *rec, uint64_t rec_size, const kvs_objkey *key, uint64_t geom,
		     kvs_record_hdr *h)
{
	if (rec_size < KVS_RECORD_HDR_BYTES)
		return KVS_RECORD_BAD;
	memcpy(h, rec, KVS_RECORD_HDR_BYTES);
	if (memcmp(h->magic, "KVL2", 4) != 0 || h->version != KVS_RECORD_VERSION ||
	    h->len != rec_size - KVS_RECORD_HDR_BYTES)
		return KVS_RECORD_BAD;
	if (memcmp(&h->key, key, sizeof(*key)) != 0)
		return KVS_RECORD_KEY;
	if (h->geom != geom)
		return KVS_RECORD_GEOM;
	return KVS_RECORD_OK;
}
