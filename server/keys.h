/* Keys the server derives (keys.c): job keys, namespace digests, L1/L2
 * object keys and the digest of a job part's content. Pure functions. */
#ifndef KVS_KEYS_H
#define KVS_KEYS_H

#include <stdint.h>

#include "kvs_l1.h"
#include "kvs_proto.h"

#define KVS_JOBKEY_BYTES 24 /* BLAKE2b-128(engine) || job id */

void kvs_job_key(const char *engine, uint64_t id, uint8_t key[KVS_JOBKEY_BYTES]);
/* BLAKE2b-128 of the namespace string. */
void kvs_ns_digest(const char *ns, uint8_t out[16]);
/* The object key of one chunk (32 bytes at chunk) of one group on one rank. */
void kvs_obj_key(kvs_objkey *k, const uint8_t ns[16], uint32_t world, uint32_t rank, uint32_t group,
		 const uint8_t *chunk);
/* Digest of a store/retrieve part's content: what a repeat must match. */
void kvs_part_digest(const kvs_msg *rq, uint8_t out[16]);

#endif
