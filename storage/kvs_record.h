/* kvs_record: the self-checking object record shared by the persistent
 * tiers (L2's LMDB values, L3's Redis values).
 *
 * A record is a 96-byte header followed by the object's data. The header
 * holds a magic ("KVL2"), the format version (2), the geometry fingerprint
 * of the layout the data was made for, the data length, a checksum, and the
 * full 64-byte object key the record was written under. The checksum is
 * XXH3-64 of the data seeded with XXH3-64 of the header (checksum field 0,
 * key field = the key the record is written or read under), so it binds the
 * bytes to that key: a record found under another key, of another layout,
 * another version, or with any flipped bit is told apart and never served.
 *
 * The layout is an on-disk and on-wire format (tests/chaos/lmdb_raw.py
 * parses it): little-endian host order, never reordered; a change bumps the
 * version. Pure functions, any thread. */
#ifndef KVS_RECORD_H
#define KVS_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "kvs_l1.h"

#define KVS_RECORD_HDR_BYTES 96
/* 2: the header holds the full object key and the checksum is seeded with
 * the header's hash (1: namespace digest only, data-only checksum). */
#define KVS_RECORD_VERSION 2

typedef struct kvs_record_hdr {
	char magic[4];     /* "KVL2" */
	uint16_t version;  /* KVS_RECORD_VERSION */
	uint16_t flags;
	uint64_t geom;     /* geometry fingerprint of the group's layout */
	uint64_t len;      /* data bytes following the header */
	uint64_t checksum; /* XXH3-64 of the data, seeded with kvs_record_seed() */
	kvs_objkey key;    /* the key the record was written under */
} kvs_record_hdr;
_Static_assert(sizeof(kvs_record_hdr) == KVS_RECORD_HDR_BYTES, "header must stay 96 bytes");
_Static_assert(offsetof(kvs_record_hdr, key) == 32, "header layout");

/* A header for len bytes of data of layout geom under key, checksum 0 (the
 * writer sets it once the data is hashed). */
void kvs_record_init(kvs_record_hdr *h, const kvs_objkey *key, uint64_t geom, uint64_t len);

/* The checksum's seed: XXH3-64 of the header with the checksum field 0 and
 * the key the object is written or read under. */
uint64_t kvs_record_seed(const kvs_record_hdr *h, const kvs_objkey *key);

/* XXH3-64 of len bytes seeded with seed (one call; for data hashed in
 * slices use XXH3's streaming state with the same seed). */
uint64_t kvs_record_sum(uint64_t seed, const void *data, uint64_t len);

/* Streaming form of kvs_record_sum, for data hashed in slices as it is
 * copied (the L2 reader and writer): reset with the seed, update with each
 * slice in order, digest. Same value as kvs_record_sum over the whole data.
 * Both forms use the widest vector unit the CPU has (XXH3's x86 dispatch,
 * where libxxhash has it: AVX2 / AVX-512 hash 4x faster than the SSE2 that
 * the plain entry points are built for). A hasher is used by one thread at
 * a time; new returns NULL when out of memory; free accepts NULL. */
typedef struct kvs_record_hasher kvs_record_hasher;
kvs_record_hasher *kvs_record_hasher_new(void);
void kvs_record_hasher_free(kvs_record_hasher *hs);
void kvs_record_hasher_reset(kvs_record_hasher *hs, uint64_t seed);
void kvs_record_hasher_update(kvs_record_hasher *hs, const void *data, uint64_t len);
uint64_t kvs_record_hasher_digest(const kvs_record_hasher *hs);

enum kvs_record_check {
	KVS_RECORD_OK,   /* usable: *h filled */
	KVS_RECORD_BAD,  /* too short, another magic or version, length not the record's: unusable by anyone */
	KVS_RECORD_KEY,  /* written under another key */
	KVS_RECORD_GEOM, /* made for another geometry */
};
/* Classifies a record of rec_size bytes (header + data; only the header is
 * read from rec) found under key, expected with layout geom. The data's
 * checksum is the caller's to verify (kvs_record_seed, kvs_record_sum). */
int kvs_record_check(const void *rec, uint64_t rec_size, const kvs_objkey *key, uint64_t geom,
		     kvs_record_hdr *h);

#endif
