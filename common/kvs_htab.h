/* An intrusive open-addressing hash table: values are pointers to structs that
 * embed their own fixed-length key at a fixed offset. Linear probing with
 * backward-shift deletion (no tombstones). Keys are hashed with SipHash under
 * a per-table random key, so clients choosing ids cannot flood a bucket.
 * Not thread-safe: each table belongs to one thread (the main loop). */
#ifndef KVS_HTAB_H
#define KVS_HTAB_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvs_htab kvs_htab;

/* Creates a table whose values carry a key of keylen bytes at byte offset
 * key_off. Returns 0 or -ENOMEM. */
int kvs_htab_create(size_t keylen, size_t key_off, kvs_htab **ret);
/* Frees the table, not the values. Accepts NULL. */
void kvs_htab_destroy(kvs_htab *t);
/* Returns the value whose key equals key, or NULL. */
void *kvs_htab_get(const kvs_htab *t, const void *key);
/* Inserts val (its key must not be present). Returns 0 or -ENOMEM, -EEXIST. */
int kvs_htab_put(kvs_htab *t, void *val);
/* Removes and returns the value with this key, or NULL. */
void *kvs_htab_del(kvs_htab *t, const void *key);
size_t kvs_htab_count(const kvs_htab *t);
/* Iteration: *pos starts at 0; returns the next value or NULL at the end.
 * The table must not be modified during iteration, except by deleting the
 * value just returned with kvs_htab_iter_del. */
void *kvs_htab_next(const kvs_htab *t, size_t *pos);
/* Deletes the value last returned by kvs_htab_next and adjusts *pos so the
 * iteration visits every remaining value exactly once... or possibly one
 * value twice if backward shifting wrapped; callers must tolerate that by
 * using it only for idempotent sweeps. */
void kvs_htab_iter_del(kvs_htab *t, size_t *pos);

#endif
