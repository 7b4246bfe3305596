/* A job's ranks named in words (ranks.h). */
#include "ranks.h"

#include <stdbool.h>
#include <stdio.h>

/* The ranks of one kind as ranges ("1-3,5") into b (cap bytes, "..." when
 * cut short); returns how many there are. */
static uint32_t rank_list(const uint8_t *kind, uint32_t world, uint8_t k, char *b, size_t cap)
{
	uint32_t n = 0;
	size_t len = 0;
	bool full = false;
	b[0] = 0;
	for (uint32_t r = 0; r < world; r++) {
		if (kind[r] != k)
			continue;
		uint32_t last = r;
		while (last + 1 < world && kind[last + 1] == k)
			last++;
		n += last - r + 1;
		if (len + 24 < cap) /* 24: a range and "..." always fit */
			len += (size_t)snprintf(b + len, cap - len, last == r ? "%s%u" : "%s%u-%u", len ? "," : "", r, last);
		else if (!full)
			len += (size_t)snprintf(b + len, cap - len, "..."), full = true;
		r = last;
	}
	return n;
}

void kvs_ranks_missing(const uint8_t *kind, uint32_t world, char *out, size_t cap)
{
	if (!kind) {
		snprintf(out, cap, "some ranks did not report");
		return;
	}
	char none[40], open[40];
	uint32_t n_none = rank_list(kind, world, KVS_RANK_NONE, none, sizeof(none));
	uint32_t n_open = rank_list(kind, world, KVS_RANK_OPEN, open, sizeof(open));
	if (n_none && n_open)
		snprintf(out, cap, "rank%s %s of %u sent no part, rank%s %s did not complete", n_none > 1 ? "s" : "", none,
			 world, n_open > 1 ? "s" : "", open);
	else if (n_none)
		snprintf(out, cap, "rank%s %s of %u sent no part", n_none > 1 ? "s" : "", none, world);
	else if (n_open)
		snprintf(out, cap, "rank%s %s of %u did not complete", n_open > 1 ? "s" : "", open, world);
	else
		snprintf(out, cap, "every rank reported");
}
