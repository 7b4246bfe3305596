/* KV events for cache-aware routers (vLLM's router, llm-d, Dynamo): what
 * kvside holds, published on a ZeroMQ PUB socket in vLLM's KV-event wire
 * format, with a ROUTER socket replaying recent batches to a subscriber that
 * missed some (protocol.md §17). Owned by the main loop; nothing here is
 * thread-safe. Every function accepts a NULL kvs_events (events off).
 *
 * Events accumulate between ticks and leave as one batch per tick:
 * multipart (topic, 8-byte big-endian sequence number, msgpack
 * KVEventBatch). The last `keep` batches (at most keep_bytes of payload) are kept
 * for replay: a request (empty delimiter, 8-byte big-endian start sequence)
 * is answered with every kept batch from that sequence up to the last one
 * published before the request, each (delimiter, topic, seq, payload), then
 * (delimiter, "", seq -1, ""). A replay is sent a few batches per loop pass
 * (events.c: the bounds), never more than a peer's queue takes; a peer that
 * takes nothing for 5 s loses its replay. */
#ifndef KVS_EVENTS_H
#define KVS_EVENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvs_l1.h"

typedef struct kvs_events kvs_events;

enum kvs_event_tier { KVS_TIER_EV_L1, KVS_TIER_EV_L2 };

/* Binds pub (and replay, unless NULL or "") on zctx. 0 and *ret, or -errno
 * with the reason in err. with_l2: a chunk evicted from L1 may still be in
 * L2 (its engine hash is kept until L2 drops it). */
int kvs_events_open(void *zctx, const char *pub, const char *replay, const char *topic, uint32_t keep,
		    uint64_t keep_bytes, bool with_l2, kvs_events **ret, char *err, size_t errlen);
void kvs_events_close(kvs_events *e);

/* An object's chunk became present in a tier / left it; block_size: the
 * chunk's tokens (0: as last seen for the object's namespace and world).
 * Repeats within one batch (every rank and group of a chunk) are published
 * once. */
void kvs_events_stored(kvs_events *e, const kvs_objkey *key, uint32_t block_size, int tier);
/* As kvs_events_stored, naming the chunk by the engine's own 32-byte block
 * hash (a store's event_hashes, protocol.md §6.7): this and every later event
 * of the chunk publish that hash instead of the chunk key, until the chunk
 * has left every tier (at most KVS_EVENTS_MAX_HASHES chunks remembered). */
void kvs_events_stored_as(kvs_events *e, const kvs_objkey *key, uint32_t block_size, int tier,
			  const uint8_t engine_hash[32]);
#define KVS_EVENTS_MAX_HASHES (1u << 22)
void kvs_events_removed(kvs_events *e, const kvs_objkey *key, int tier);
/* Every tier was cleared (admin clear). */
void kvs_events_cleared(kvs_events *e);

/* Publishes what accumulated as one batch (call once per tick). */
void kvs_events_flush(kvs_events *e);
/* The replay socket for the loop's poll set, or NULL. */
void *kvs_events_replay_socket(kvs_events *e);
/* Takes the replay requests waiting on the replay socket (readable: the
 * loop saw it ready) and sends the replays in progress their next batches,
 * within the per-pass bound. True when a replay can take more now (the loop
 * calls again without sleeping); replays whose peer's queue is full wait for
 * the next call (the loop's tick calls it). */
bool kvs_events_replay(kvs_events *e, uint64_t now_ms, bool readable);
bool kvs_events_replaying(const kvs_events *e);

typedef struct kvs_events_stats {
	uint64_t batches, events;   /* cum. published */
	uint64_t ring_dropped;      /* cum. batches dropped from the ring (count or byte bound) */
	uint64_t replay_requests;   /* cum. requests read */
	uint64_t replays;           /* cum. replays sent to the end */
	uint64_t replays_refused;   /* cum. requests beyond REPLAY_MAX replays (end marker alone) */
	uint64_t replays_dropped;   /* cum. replays ended early: peer gone, or no progress for 5 s */
	uint64_t replay_batches;    /* cum. batches sent by replays */
	uint64_t replays_active, ring_batches, ring_bytes; /* now */
} kvs_events_stats;
void kvs_events_get_stats(const kvs_events *e, kvs_events_stats *st);

#endif
