/* KV events: see events.h. */
#include "events.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "kvs_htab.h"
#include "kvs_proto.h"

#define KVS_LOG_COMPONENT "events"
#include "kvs_log.h"

/* One pending event: consecutive calls of one kind, tier and block size
 * share it. Invariant: keys holds n 32-byte chunk keys, cap >= n. */
typedef struct pend {
	int kind, tier;
	uint32_t block_size;
	uint8_t *keys;
	uint32_t n, cap;
} pend;

/* A published batch kept for replay. */
typedef struct kept {
	uint64_t seq;
	void *buf;
	size_t len;
} kept;

/* Invariants: ring holds the last min(published, keep) batches, oldest at
 * head; next_seq is the sequence number of the next batch. */
struct kvs_events {
	void *pub, *replay;
	char topic[128];
	pend *pending;
	uint32_t n_pending, cap_pending;
	kept *ring;
	uint32_t keep, head, count;
	uint64_t next_seq;
	kvs_events_stats st;
	/* chunk tokens last seen per (namespace digest, world): L2 completions
	 * know the object, not its registration */
	struct {
		uint8_t nsw[20];
		uint32_t block_size;
	} sizes[32];
	uint32_t n_sizes;
	bool with_l2;
	kvs_htab *hashes; /* chunk key -> engine hash (struct alias), lazily */
};

/* The engine's name of a chunk. Invariant: in e->hashes iff the chunk was
 * stored with an engine hash and has not left every tier since. */
typedef struct alias {
	uint8_t chunk[32]; /* table key */
	uint8_t hash[32];
	uint8_t tiers;     /* bit per tier (1 << KVS_TIER_EV_*) announced as holding it */
} alias;

static void forget_all(kvs_events *e)
{
	size_t pos = 0;
	alias *a;
	while (e->hashes && (a = kvs_htab_next(e->hashes, &pos)) != NULL) {
		kvs_htab_iter_del(e->hashes, &pos);
		free(a);
	}
}

static void remember(kvs_events *e, const uint8_t chunk[32], const uint8_t hash[32])
{
	if (!e->hashes && kvs_htab_create(32, offsetof(alias, chunk), &e->hashes) < 0)
		return;
	alias *a = kvs_htab_get(e->hashes, chunk);
	if (a) {
		memcpy(a->hash, hash, 32);
		return;
	}
	if (kvs_htab_count(e->hashes) >= KVS_EVENTS_MAX_HASHES || !(a = malloc(sizeof(*a))))
		return;
	memcpy(a->chunk, chunk, 32);
	memcpy(a->hash, hash, 32);
	a->tiers = 0;
	if (kvs_htab_put(e->hashes, a) < 0)
		free(a);
}

int kvs_events_open(void *zctx, const char *pub, const char *replay, const char *topic, uint32_t keep,
		    bool with_l2, kvs_events **ret, char *err, size_t errlen)
{
	kvs_events *e = calloc(1, sizeof(*e));
	if (!e || !(e->ring = calloc(keep ? keep : 1, sizeof(*e->ring)))) {
		free(e);
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	e->keep = keep ? keep : 1;
	e->with_l2 = with_l2;
	snprintf(e->topic, sizeof(e->topic), "%s", topic ? topic : "");
	int zero = 0;
	e->pub = zmq_socket(zctx, ZMQ_PUB);
	if (!e->pub || zmq_setsockopt(e->pub, ZMQ_LINGER, &zero, sizeof(zero)) != 0 || zmq_bind(e->pub, pub) != 0) {
		int r = -errno;
		snprintf(err, errlen, "kv-events: cannot bind %s: %s", pub, zmq_strerror(errno));
		kvs_events_close(e);
		return r;
	}
	if (replay && replay[0]) {
		e->replay = zmq_socket(zctx, ZMQ_ROUTER);
		if (!e->replay || zmq_setsockopt(e->replay, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
		    zmq_bind(e->replay, replay) != 0) {
			int r = -errno;
			snprintf(err, errlen, "kv-events-replay: cannot bind %s: %s", replay, zmq_strerror(errno));
			kvs_events_close(e);
			return r;
		}
	}
	*ret = e;
	return 0;
}

void kvs_events_close(kvs_events *e)
{
	if (!e)
		return;
	if (e->pub)
		zmq_close(e->pub);
	if (e->replay)
		zmq_close(e->replay);
	for (uint32_t i = 0; i < e->n_pending; i++)
		free(e->pending[i].keys);
	free(e->pending);
	for (uint32_t i = 0; i < e->count; i++)
		free(e->ring[(e->head + i) % e->keep].buf);
	free(e->ring);
	forget_all(e);
	kvs_htab_destroy(e->hashes);
	free(e);
}

/* The pending event to add to: the last one if it matches, else a new one;
 * NULL when out of memory (the event is lost, logged once per batch). */
static pend *pending_for(kvs_events *e, int kind, int tier, uint32_t block_size)
{
	if (e->n_pending) {
		pend *p = &e->pending[e->n_pending - 1];
		if (p->kind == kind && p->tier == tier && p->block_size == block_size)
			return p;
	}
	if (e->n_pending == e->cap_pending) {
		uint32_t cap = e->cap_pending ? 2 * e->cap_pending : 8;
		pend *np = realloc(e->pending, cap * sizeof(*np));
		if (!np)
			return NULL;
		e->pending = np;
		e->cap_pending = cap;
	}
	pend *p = &e->pending[e->n_pending++];
	*p = (pend){.kind = kind, .tier = tier, .block_size = block_size};
	return p;
}

static void add(kvs_events *e, int kind, int tier, uint32_t block_size, const uint8_t *chunk)
{
	if (!e)
		return;
	pend *p = pending_for(e, kind, tier, block_size);
	if (!p)
		return;
	if (!chunk)
		return;
	if (p->n == p->cap) {
		uint32_t cap = p->cap ? 2 * p->cap : 16;
		uint8_t *nk = realloc(p->keys, (size_t)cap * 32);
		if (!nk)
			return;
		p->keys = nk;
		p->cap = cap;
	}
	memcpy(p->keys + 32 * (size_t)p->n++, chunk, 32);
}

/* Remembers or finds the chunk tokens of key's namespace and world. */
static uint32_t block_size_of(kvs_events *e, const kvs_objkey *key, uint32_t block_size)
{
	uint8_t nsw[20];
	memcpy(nsw, key->ns, 16);
	memcpy(nsw + 16, &key->world, 4);
	uint32_t i = 0;
	while (i < e->n_sizes && memcmp(e->sizes[i].nsw, nsw, 20) != 0)
		i++;
	if (!block_size)
		return i < e->n_sizes ? e->sizes[i].block_size : 0;
	if (i == e->n_sizes) {
		if (e->n_sizes == sizeof(e->sizes) / sizeof(e->sizes[0]))
			i = 0; /* many namespaces: the oldest slot goes */
		else
			e->n_sizes++;
		memcpy(e->sizes[i].nsw, nsw, 20);
	}
	e->sizes[i].block_size = block_size;
	return block_size;
}

void kvs_events_stored(kvs_events *e, const kvs_objkey *key, uint32_t block_size, int tier)
{
	if (!e)
		return;
	alias *a = e->hashes ? kvs_htab_get(e->hashes, key->chunk) : NULL;
	if (a)
		a->tiers |= (uint8_t)(1u << tier);
	add(e, KVS_KVEV_STORED, tier, block_size_of(e, key, block_size), a ? a->hash : key->chunk);
}

void kvs_events_stored_as(kvs_events *e, const kvs_objkey *key, uint32_t block_size, int tier,
			  const uint8_t engine_hash[32])
{
	if (!e)
		return;
	if (engine_hash)
		remember(e, key->chunk, engine_hash);
	kvs_events_stored(e, key, block_size, tier);
}

void kvs_events_removed(kvs_events *e, const kvs_objkey *key, int tier)
{
	if (!e)
		return;
	alias *a = e->hashes ? kvs_htab_get(e->hashes, key->chunk) : NULL;
	add(e, KVS_KVEV_REMOVED, tier, 0, a ? a->hash : key->chunk);
	if (!a)
		return;
	/* gone from every tier announced: its engine name is no longer needed */
	a->tiers &= (uint8_t)~(1u << tier);
	if (!a->tiers || !e->with_l2)
		free(kvs_htab_del(e->hashes, key->chunk));
}

void kvs_events_cleared(kvs_events *e)
{
	if (!e)
		return;
	add(e, KVS_KVEV_CLEARED, 0, 0, NULL);
	forget_all(e);
}

static int cmp32(const void *a, const void *b) { return memcmp(a, b, 32); }

/* Sorts and deduplicates a pending event's keys (every rank and group of a
 * chunk reports it). */
static void unique(pend *p)
{
	if (p->n < 2)
		return;
	qsort(p->keys, p->n, 32, cmp32);
	uint32_t w = 1;
	for (uint32_t r = 1; r < p->n; r++)
		if (memcmp(p->keys + 32 * (size_t)r, p->keys + 32 * (size_t)(w - 1), 32) != 0)
			memmove(p->keys + 32 * (size_t)w++, p->keys + 32 * (size_t)r, 32);
	p->n = w;
}

static void seq_bytes(uint64_t seq, uint8_t out[8])
{
	for (int i = 7; i >= 0; i--, seq >>= 8)
		out[i] = (uint8_t)seq;
}

void kvs_events_flush(kvs_events *e)
{
	if (!e || !e->n_pending)
		return;
	kvs_kvevent *evs = calloc(e->n_pending, sizeof(*evs));
	if (!evs)
		goto drop;
	uint32_t n = 0;
	for (uint32_t i = 0; i < e->n_pending; i++) {
		pend *p = &e->pending[i];
		if (p->kind != KVS_KVEV_CLEARED && p->n == 0)
			continue;
		unique(p);
		evs[n++] = (kvs_kvevent){.kind = p->kind, .medium = p->tier == KVS_TIER_EV_L2 ? "STORAGE" : "CPU",
					 .block_size = p->block_size, .keys = p->keys, .n_keys = p->n};
	}
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	void *buf = NULL;
	size_t len = 0;
	int r = n ? kvs_kvevents_encode(evs, n, (double)ts.tv_sec + ts.tv_nsec / 1e9, &buf, &len) : -ENOENT;
	free(evs);
	if (r == 0) {
		uint8_t sb[8];
		seq_bytes(e->next_seq, sb);
		/* PUB never blocks: a slow subscriber loses messages (replay covers it) */
		zmq_send(e->pub, e->topic, strlen(e->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->pub, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->pub, buf, len, ZMQ_DONTWAIT);
		if (e->count == e->keep) {
			free(e->ring[e->head].buf);
			e->head = (e->head + 1) % e->keep;
			e->count--;
		}
		e->ring[(e->head + e->count++) % e->keep] = (kept){.seq = e->next_seq, .buf = buf, .len = len};
		e->next_seq++;
		e->st.batches++;
		e->st.events += n;
	} else if (r != -ENOENT) {
		kvs_warn("a batch of %u KV events could not be encoded: %s", n, strerror(-r));
	}
drop:
	for (uint32_t i = 0; i < e->n_pending; i++)
		free(e->pending[i].keys);
	e->n_pending = 0;
}

void *kvs_events_replay_socket(kvs_events *e) { return e ? e->replay : NULL; }

/* Receives one multipart request: its first frame (the routing id) into id
 * and its last into last; false when nothing is waiting. */
static bool recv_request(void *s, zmq_msg_t *id, uint8_t last[8], size_t *last_len)
{
	if (zmq_msg_recv(id, s, ZMQ_DONTWAIT) < 0)
		return false;
	*last_len = 0;
	bool more = zmq_msg_more(id);
	while (more) {
		zmq_msg_t f;
		zmq_msg_init(&f);
		if (zmq_msg_recv(&f, s, 0) < 0) {
			zmq_msg_close(&f);
			break;
		}
		more = zmq_msg_more(&f);
		*last_len = zmq_msg_size(&f);
		if (*last_len == 8)
			memcpy(last, zmq_msg_data(&f), 8);
		zmq_msg_close(&f);
	}
	return true;
}

void kvs_events_replay(kvs_events *e)
{
	if (!e || !e->replay)
		return;
	for (;;) {
		zmq_msg_t id;
		zmq_msg_init(&id);
		uint8_t start[8];
		size_t sl = 0;
		if (!recv_request(e->replay, &id, start, &sl)) {
			zmq_msg_close(&id);
			return;
		}
		uint64_t from = 0;
		bool ok = sl == 8;
		for (int i = 0; ok && i < 8; i++)
			from = from << 8 | start[i];
		const void *idp = zmq_msg_data(&id);
		size_t idl = zmq_msg_size(&id);
		for (uint32_t i = 0; ok && i < e->count; i++) {
			kept *k = &e->ring[(e->head + i) % e->keep];
			if (k->seq < from)
				continue;
			uint8_t sb[8];
			seq_bytes(k->seq, sb);
			zmq_send(e->replay, idp, idl, ZMQ_SNDMORE | ZMQ_DONTWAIT);
			zmq_send(e->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
			zmq_send(e->replay, e->topic, strlen(e->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT);
			zmq_send(e->replay, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
			zmq_send(e->replay, k->buf, k->len, ZMQ_DONTWAIT);
		}
		/* the end marker: sequence -1 (a malformed request gets it alone) */
		static const uint8_t end[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
		zmq_send(e->replay, idp, idl, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->replay, end, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->replay, "", 0, ZMQ_DONTWAIT);
		e->st.replays++;
		zmq_msg_close(&id);
	}
}

void kvs_events_get_stats(const kvs_events *e, kvs_events_stats *st)
{
	if (e)
		*st = e->st;
	else
		memset(st, 0, sizeof(*st));
}
