/* Rank processes with a hybrid KV layout (attention + sliding-window
 * attention + recurrent state groups) for the hybrid integration tests.
 *
 * Unlike rank.c (the fork/pipe core, kvt_proc, is the same), the memfd region
 * of a rank is created by the test process before the fork, so the test keeps a shared mapping of every rank's memory:
 * it fills, poisons and verifies the bytes itself, while the forked rank
 * process owns the libkvside client (its own session, fd passing, register,
 * store/retrieve/complete) and is driven over a pipe. */
#ifndef KVT_HYBRID_RANK_H
#define KVT_HYBRID_RANK_H

#include <stdint.h>
#include <sys/types.h>

#include "harness.h"

#define HR_MAX_GROUPS 5
#define HR_MAX_LAYERS 9
#define HR_MAX_IDS 64     /* ids per group list in one command */
#define HR_ATT_BLOCKS 64  /* blocks per attention layer */
#define HR_REC_BLOCKS 24  /* blocks per recurrent layer */
#define HR_REC_NULL 0     /* null_block of the recurrent groups */

/* Registration layouts. */
enum hr_geom {
	/* group index: id, kind,             tpb, bpc, window, null
	 *  0:  10, attention (full),          16,  4,  -1,   -1
	 *  1:  11, attention (window 2),      16,  4,   2,   -1
	 *  2:   2, recurrent,                 64,  1,  -1,    0
	 *  3:   3, recurrent,                 64,  1,  -1,    0
	 *  4:   4, recurrent,                 32,  2,  -1,    0
	 * layers 3,2,1,1,2 (listed interleaved), attention in allocation 0,
	 * recurrent in allocation 1, gaps between the views. */
	HR_HYBRID = 1,
	/* groups 0 and 1 of HR_HYBRID only, allocation 0 only */
	HR_ATTN_ONLY = 2,
	/* HR_HYBRID with one defect each, refused by register */
	HR_BAD_REC_WINDOW = 3,  /* recurrent group 3 with window_chunks 2 */
	HR_BAD_WINDOW_ZERO = 4, /* windowed group with window_chunks 0 */
	HR_BAD_BYTES = 5,       /* a recurrent layer with block_bytes > block_stride */
};

typedef struct hr_region {
	int geom;
	uint32_t n_groups, n_layers, n_allocs;
	kvs_group groups[HR_MAX_GROUPS];
	kvs_layer layers[HR_MAX_LAYERS];
	uint32_t layer_gi[HR_MAX_LAYERS]; /* group index of each layer */
	int fd[2];
	uint8_t *mem[2];  /* shared mapping of the rank's memory */
	uint8_t *src[2];  /* snapshot of the random content (store sources) */
	uint64_t size[2];
} hr_region;

enum hr_op { HR_STORE = 1, HR_RETRIEVE, HR_COMPLETE, HR_EXIT };

typedef struct hr_cmd {
	int op;
	uint64_t job;
	uint32_t prompt, first_key, n_keys; /* keys kvt_key_p(prompt, first_key + k) */
	uint64_t skip_tokens;
	int ok;   /* complete status */
	int lazy; /* store */
	int timeout_ms;
	uint32_t len[HR_MAX_GROUPS];
	int64_t ids[HR_MAX_GROUPS][HR_MAX_IDS];
} hr_cmd;

typedef struct hr_res {
	int code;
	int state;
} hr_res;

typedef struct hr_rank {
	kvt_proc p;
	uint32_t rank;
	hr_region rg;
} hr_rank;

/* Builds rank's region (random content, seeded by seed), forks the rank
 * process, which opens its client and registers. 0 once registered, else the
 * registration's code or -1. */
int hr_rank_start(hr_rank *r, kvt_server *s, const char *engine, const char *ns, int geom, uint32_t rank,
		  uint32_t world, unsigned seed);
/* One command, its result (30 s timeout). 0 or -1. */
int hr_rank_do(hr_rank *r, const hr_cmd *cmd, hr_res *res);
/* Ends the rank process and frees the region. */
void hr_rank_stop(hr_rank *r);

/* Memory helpers, all on the test side. */
/* Pointer to block id of layer li inside buffers buf (mem, src or an expectation). */
uint8_t *hr_block(const hr_region *rg, uint8_t *const buf[2], uint32_t li, uint64_t id);
/* Puts the random source content back (before stores). */
void hr_restore(hr_region *rg);
/* Fills every byte of the region with the poison pattern. */
void hr_poison(hr_region *rg);
/* Expectation buffers, initialised to the poison pattern. */
void hr_expect_init(const hr_region *rg, uint8_t *exp[2]);
void hr_expect_free(uint8_t *exp[2]);
/* Expect block dst of every layer of group index gi to hold the source
 * content of block src (block_bytes bytes; the padding stays poisoned). */
void hr_expect_copy(const hr_region *rg, uint8_t *exp[2], uint32_t gi, int64_t dst, int64_t src);
/* Bytes of the region that differ from exp (prints the first few). */
uint64_t hr_diff(const hr_region *rg, uint8_t *const exp[2], const char *what);

#endif
