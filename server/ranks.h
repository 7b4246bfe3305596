/* A job's ranks named in words for its reason and the log (ranks.c):
 * "rank 1 of 2 sent no part", "ranks 0-3,5 of 8 did not complete". */
#ifndef KVS_RANKS_H
#define KVS_RANKS_H

#include <stddef.h>
#include <stdint.h>

/* What a rank has done for a job. */
enum { KVS_RANK_NONE, KVS_RANK_OPEN, KVS_RANK_DONE };

/* The ranks whose kind[r] is not KVS_RANK_DONE, into out: those that sent
 * no part, then those that sent one but never completed, as ranges cut
 * short with "..." when long; "every rank reported" when none ("some ranks
 * did not report" for a NULL kind: the caller had no memory for it). */
void kvs_ranks_missing(const uint8_t *kind, uint32_t world, char *out, size_t cap);

#endif
