/* Intrusive linear-probing hash table; see kvs_htab.h. */
#include "kvs_htab.h"

#include <errno.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>

struct slot {
	uint64_t hash; /* valid iff val != NULL */
	void *val;
};

/* Invariant: count < cap * 3 / 4; cap is a power of two; every value lies in
 * the probe run that starts at its home slot (hash & (cap - 1)). */
struct kvs_htab {
	size_t keylen, key_off;
	size_t cap, count;
	struct slot *slots;
	unsigned char sipkey[crypto_shorthash_KEYBYTES];
};

static uint64_t hash_key(const kvs_htab *t, const void *key)
{
	uint64_t h;
	crypto_shorthash((unsigned char *)&h, key, t->keylen, t->sipkey);
	return h;
}

static const void *key_of(const kvs_htab *t, const void *val)
{
	return (const char *)val + t->key_off;
}

int kvs_htab_create(size_t keylen, size_t key_off, kvs_htab **ret)
{
	kvs_htab *t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	t->keylen = keylen;
	t->key_off = key_off;
	t->cap = 16;
	t->slots = calloc(t->cap, sizeof(*t->slots));
	if (!t->slots) {
		free(t);
		return -ENOMEM;
	}
	if (sodium_init() < 0) {
		free(t->slots);
		free(t);
		return -EIO;
	}
	randombytes_buf(t->sipkey, sizeof(t->sipkey));
	*ret = t;
	return 0;
}

void kvs_htab_destroy(kvs_htab *t)
{
	if (!t)
		return;
	free(t->slots);
	free(t);
}

static size_t find(const kvs_htab *t, const void *key, uint64_t h)
{
	size_t mask = t->cap - 1;
	for (size_t i = h & mask;; i = (i + 1) & mask) {
		const struct slot *s = &t->slots[i];
		if (!s->val)
			return SIZE_MAX;
		if (s->hash == h && memcmp(key_of(t, s->val), key, t->keylen) == 0)
			return i;
	}
}

void *kvs_htab_get(const kvs_htab *t, const void *key)
{
	size_t i = find(t, key, hash_key(t, key));
	return i == SIZE_MAX ? NULL : t->slots[i].val;
}

static void insert_slot(struct slot *slots, size_t cap, uint64_t h, void *val)
{
	size_t mask = cap - 1;
	size_t i = h & mask;
	while (slots[i].val)
		i = (i + 1) & mask;
	slots[i].hash = h;
	slots[i].val = val;
}

static int grow(kvs_htab *t)
{
	size_t ncap = t->cap * 2;
	struct slot *ns = calloc(ncap, sizeof(*ns));
	if (!ns)
		return -ENOMEM;
	for (size_t i = 0; i < t->cap; i++)
		if (t->slots[i].val)
			insert_slot(ns, ncap, t->slots[i].hash, t->slots[i].val);
	free(t->slots);
	t->slots = ns;
	t->cap = ncap;
	return 0;
}

int kvs_htab_put(kvs_htab *t, void *val)
{
	const void *key = key_of(t, val);
	uint64_t h = hash_key(t, key);
	if (find(t, key, h) != SIZE_MAX)
		return -EEXIST;
	if ((t->count + 1) * 4 >= t->cap * 3) {
		int r = grow(t);
		if (r < 0)
			return r;
	}
	insert_slot(t->slots, t->cap, h, val);
	t->count++;
	return 0;
}

/* Removes slot i and shifts later members of the run back so that every value
 * stays reachable from its home slot. */
static void remove_at(kvs_htab *t, size_t i)
{
	size_t mask = t->cap - 1;
	size_t j = i;
	t->slots[i].val = NULL;
	for (;;) {
		j = (j + 1) & mask;
		if (!t->slots[j].val)
			break;
		size_t home = t->slots[j].hash & mask;
		/* Move j into the hole i if home is not cyclically in (i, j]. */
		int in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
		if (!in_range) {
			t->slots[i] = t->slots[j];
			t->slots[j].val = NULL;
			i = j;
		}
	}
	t->count--;
}

void *kvs_htab_del(kvs_htab *t, const void *key)
{
	size_t i = find(t, key, hash_key(t, key));
	if (i == SIZE_MAX)
		return NULL;
	void *v = t->slots[i].val;
	remove_at(t, i);
	return v;
}

size_t kvs_htab_count(const kvs_htab *t) { return t->count; }

void *kvs_htab_next(const kvs_htab *t, size_t *pos)
{
	while (*pos < t->cap) {
		void *v = t->slots[(*pos)++].val;
		if (v)
			return v;
	}
	return NULL;
}

void kvs_htab_iter_del(kvs_htab *t, size_t *pos)
{
	/* The value returned last sits at *pos - 1; a backward shift may move an
	 * unvisited value into that slot, so revisit it. */
	size_t i = *pos - 1;
	remove_at(t, i);
	*pos = i;
}
