/* Simulated TP rank processes for integration tests. Each rank is a real
 * forked process (kvt_proc, harness.h) with its own libkvside client and its
 * own memfd KV region (2 groups, 8 layers, padded strides, random bytes); the
 * test drives it over a pipe with small commands and gets a result back.
 * hybrid_rank.h is the same for hybrid layouts, with the region on the test's
 * side. */
#ifndef KVT_RANK_H
#define KVT_RANK_H

#include <stdint.h>
#include <sys/types.h>

#include "harness.h"

/* Geometry shared by every rank (see rank.c). */
#define KVT_G0_BPC 4   /* group 0: 16 tokens/block, 4 blocks/chunk */
#define KVT_G1_BPC 2   /* group 1: 32 tokens/block, 2 blocks/chunk */
#define KVT_CHUNK_TOKENS 64
#define KVT_NUM_BLOCKS 64

enum kvt_cmd_op { KVT_STORE = 1, KVT_RETRIEVE, KVT_COMPLETE, KVT_VERIFY, KVT_UNREGISTER,
		  KVT_REGISTER, KVT_STATE, KVT_EXIT, KVT_STORE_RAW, KVT_RESET, KVT_PEEK,
		  /* the part and its complete ("ok") queued back to back, without
		   * waiting for the part's reply: code = the part's, state = the
		   * complete's reply */
		  KVT_STORE_COMPLETE, KVT_RETRIEVE_COMPLETE,
		  /* the part with its complete in one message
		   * (kvs_store_complete_async): queued, code = the queueing's;
		   * KVT_ONEMSG_RESULT then waits for its reply: code and state of
		   * the reply, value = the state kvs_job_wait then reports (or
		   * 99 if it timed out) */
		  KVT_STORE_ONEMSG, KVT_ONEMSG_RESULT };

typedef struct kvt_cmd {
	int op;
	uint64_t job;
	uint32_t prompt;            /* which test prompt the keys come from */
	uint32_t first_key, n_keys; /* keys first_key .. first_key + n_keys - 1 */
	uint32_t block_chunk;       /* block ids are numbered as if the request started at this chunk */
	uint32_t src_base;          /* chunk k uses blocks base + k*bpc .. */
	uint32_t dst_base;
	uint64_t skip_tokens;
	int ok;                     /* complete status */
	int timeout_ms;
	/* KVT_STORE_RAW: explicit block lists */
	uint32_t len0, len1;
	int64_t ids0[64], ids1[64];
} kvt_cmd;

typedef struct kvt_res {
	int code;
	int state;
	uint64_t value; /* VERIFY: mismatching bytes; STATE: reconnects */
	uint64_t value2; /* VERIFY: bytes changed outside destinations */
	uint8_t data[64]; /* PEEK: first 64 bytes of block src_base of layer 0, group 0 */
} kvt_res;

typedef struct kvt_rank {
	kvt_proc p;
	uint32_t rank;
} kvt_rank;

/* Forks a rank process: opens a client (engine, rank/world), builds and
 * registers its region. Returns 0 once the rank reports it registered. */
int kvt_rank_start(kvt_rank *r, kvt_server *s, const char *engine, uint32_t rank, uint32_t world);
/* Sends one command and waits for its result (timeout 30 s). */
int kvt_rank_do(kvt_rank *r, const kvt_cmd *cmd, kvt_res *res);
void kvt_rank_kill(kvt_rank *r);
void kvt_rank_stop(kvt_rank *r);

/* The 32-byte key of chunk k of test prompt 0 / of prompt p (namespace "test-model"). */
void kvt_key(uint32_t k, uint8_t out[32]);
void kvt_key_p(uint32_t p, uint32_t k, uint8_t out[32]);

#endif
