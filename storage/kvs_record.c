/* Object records; see kvs_record.h. */
#include "kvs_record.h"

#include <string.h>
#include <xxhash.h>

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
	return XXH3_64bits_withSeed(data, len, seed);
}

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
