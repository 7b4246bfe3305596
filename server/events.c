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

/* A published batch kept for replay: its payload in a ZeroMQ message whose
 * content every send shares (zmq_msg_copy counts a reference, it copies no
 * bytes), so a replay to any number of peers costs no copy of the ring. */
typedef struct kept {
	uint64_t seq;
	zmq_msg_t msg;
	size_t len;
} kept;

/* A replay in progress: the batches [next, end) still to send to one peer.
 * end is the next sequence number when the request came: a replay ends even
 * while batches keep coming. */
typedef struct replay_cur {
	uint8_t id[256]; /* the peer's routing id */
	size_t idl;
	uint64_t next, end;
	uint64_t progress_ms; /* when the peer last took a batch (or the request came) */
	bool blocked;         /* the peer's queue was full: tried again at the tick */
} replay_cur;

/* Bounds of replay: replays in progress at once (more requests get the end
 * marker alone), batches sent per loop pass over all of them (the loop's
 * other work never waits behind a replay of the whole ring), requests read
 * per pass, a peer's send queue (messages; ROUTER_MANDATORY: a full queue
 * says EAGAIN and the replay waits), and how long a replay may make no
 * progress before it is dropped (a peer that never reads). */
#define REPLAY_MAX 16
#define REPLAY_PASS 64
#define REPLAY_REQS_PASS 64
#define REPLAY_SNDHWM 1000
#define REPLAY_STALL_MS 5000

/* Invariants: ring holds the last published batches, oldest at head, at most
 * keep of them and at most keep_bytes bytes of payload (ring_bytes; at 160 k
 * stores a second a bound by count alone let the ring reach 2.6 GiB);
 * their sequence numbers are consecutive; next_seq is the sequence number of
 * the next batch. curs[0..n_curs) are the replays in progress, one per peer. */
struct kvs_events {
	void *pub, *replay;
	char topic[128];
	pend *pending;
	uint32_t n_pending, cap_pending;
	kept *ring;
	uint32_t keep, head, count;
	uint64_t ring_bytes, keep_bytes;
	uint64_t next_seq;
	replay_cur curs[REPLAY_MAX];
	uint32_t n_curs, rr; /* rr: where the next pass starts (round robin) */
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
		    uint64_t keep_bytes, bool with_l2, kvs_events **ret, char *err, size_t errlen)
{
	kvs_events *e = calloc(1, sizeof(*e));
	if (!e || !(e->ring = calloc(keep ? keep : 1, sizeof(*e->ring)))) {
		free(e);
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	e->keep = keep ? keep : 1;
	e->keep_bytes = keep_bytes;
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
		int one = 1, hwm = REPLAY_SNDHWM;
		if (!e->replay || zmq_setsockopt(e->replay, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
		    zmq_setsockopt(e->replay, ZMQ_ROUTER_MANDATORY, &one, sizeof(one)) != 0 ||
		    zmq_setsockopt(e->replay, ZMQ_SNDHWM, &hwm, sizeof(hwm)) != 0 ||
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
		zmq_msg_close(&e->ring[(e->head + i) % e->keep].msg);
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

static void free_payload(void *data, void *hint)
{
	(void)hint;
	free(data);
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
		kept k = {.seq = e->next_seq, .len = len};
		if (zmq_msg_init_data(&k.msg, buf, len, free_payload, NULL) != 0) {
			free(buf);
			goto drop;
		}
		uint8_t sb[8];
		seq_bytes(e->next_seq, sb);
		/* PUB never blocks: a slow subscriber loses messages (replay covers it) */
		zmq_msg_t out;
		zmq_msg_init(&out);
		zmq_msg_copy(&out, &k.msg);
		zmq_send(e->pub, e->topic, strlen(e->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT);
		zmq_send(e->pub, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
		if (zmq_msg_send(&out, e->pub, ZMQ_DONTWAIT) < 0)
			zmq_msg_close(&out);
		while (e->count && (e->count == e->keep || e->ring_bytes + len > e->keep_bytes)) {
			kept *old = &e->ring[e->head];
			e->ring_bytes -= old->len;
			zmq_msg_close(&old->msg);
			e->head = (e->head + 1) % e->keep;
			e->count--;
			e->st.ring_dropped++;
		}
		e->ring[(e->head + e->count++) % e->keep] = k;
		e->ring_bytes += len;
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

/* Receives one multipart request: its first frame (the routing id) into id,
 * and the start sequence the rest asks for into *start; false when nothing
 * is waiting. *ok says whether the rest was a request at all. */
static bool recv_request(void *s, zmq_msg_t *id, uint64_t *start, bool *ok)
{
	if (zmq_msg_recv(id, s, ZMQ_DONTWAIT) < 0)
		return false;
	zmq_msg_t f[2];
	uint32_t n = 0;
	bool more = zmq_msg_more(id), extra = false;
	while (more) {
		zmq_msg_t x, *m = n < 2 ? &f[n] : &x;
		zmq_msg_init(m);
		if (zmq_msg_recv(m, s, 0) < 0) {
			zmq_msg_close(m);
			break;
		}
		more = zmq_msg_more(m);
		if (n < 2)
			n++;
		else {
			extra = true;
			zmq_msg_close(m);
		}
	}
	const uint8_t *data[2];
	size_t lens[2];
	for (uint32_t i = 0; i < n; i++)
		data[i] = zmq_msg_data(&f[i]), lens[i] = zmq_msg_size(&f[i]);
	*ok = !extra && kvs_kvevents_replay_request(data, lens, n, start) == 0;
	for (uint32_t i = 0; i < n; i++)
		zmq_msg_close(&f[i]);
	return true;
}

static const uint8_t END_SEQ[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

/* Sends one (delimiter, topic, seq, payload) to a peer: 0, -EAGAIN when its
 * queue is full (nothing sent), or -errno (the peer is gone). A ROUTER
 * checks the queue at the first frame only: once that is taken, the rest
 * of the message is too. */
static int send_to(kvs_events *e, const replay_cur *c, const void *topic, size_t tl, const uint8_t seq[8],
		   zmq_msg_t *payload)
{
	if (zmq_send(e->replay, c->id, c->idl, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
		return -errno;
	zmq_send(e->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(e->replay, topic, tl, ZMQ_SNDMORE | ZMQ_DONTWAIT);
	zmq_send(e->replay, seq, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
	if (payload) {
		zmq_msg_t m;
		zmq_msg_init(&m);
		zmq_msg_copy(&m, payload);
		if (zmq_msg_send(&m, e->replay, ZMQ_DONTWAIT) < 0)
			zmq_msg_close(&m);
	} else {
		zmq_send(e->replay, "", 0, ZMQ_DONTWAIT);
	}
	return 0;
}

static void cur_drop(kvs_events *e, uint32_t i)
{
	e->curs[i] = e->curs[--e->n_curs];
	if (e->rr >= e->n_curs)
		e->rr = 0;
}

/* Takes the waiting requests (at most REPLAY_REQS_PASS): each starts a
 * replay, or replaces its peer's replay in progress; a malformed request,
 * or one beyond REPLAY_MAX replays, gets the end marker alone. */
static void take_requests(kvs_events *e, uint64_t now_ms)
{
	for (int budget = 0; budget < REPLAY_REQS_PASS; budget++) {
		zmq_msg_t id;
		zmq_msg_init(&id);
		uint64_t start = 0;
		bool ok = false;
		if (!recv_request(e->replay, &id, &start, &ok)) {
			zmq_msg_close(&id);
			return;
		}
		e->st.replay_requests++;
		replay_cur c = {.idl = zmq_msg_size(&id), .next = start, .end = e->next_seq, .progress_ms = now_ms};
		if (c.idl > sizeof(c.id)) { /* (ZeroMQ routing ids are at most 255 bytes) */
			zmq_msg_close(&id);
			continue;
		}
		memcpy(c.id, zmq_msg_data(&id), c.idl);
		zmq_msg_close(&id);
		uint32_t at = 0;
		while (at < e->n_curs && (e->curs[at].idl != c.idl || memcmp(e->curs[at].id, c.id, c.idl) != 0))
			at++;
		if (!ok || (at == e->n_curs && e->n_curs == REPLAY_MAX)) {
			if (ok)
				e->st.replays_refused++;
			(void)send_to(e, &c, "", 0, END_SEQ, NULL);
			continue;
		}
		if (at == e->n_curs)
			e->n_curs++;
		e->curs[at] = c;
	}
}

/* Sends what the replay at i can take now: false when it ended (done, or
 * its peer gone) and was dropped. */
static bool cur_step(kvs_events *e, uint32_t i, uint64_t now_ms, uint32_t *budget)
{
	replay_cur *c = &e->curs[i];
	uint64_t first = e->count ? e->ring[e->head].seq : e->next_seq;
	if (c->next < first)
		c->next = first; /* dropped from the ring meanwhile: the peer sees the gap */
	while (*budget && c->next < c->end) {
		kept *k = &e->ring[(e->head + (uint32_t)(c->next - first)) % e->keep];
		uint8_t sb[8];
		seq_bytes(k->seq, sb);
		int r = send_to(e, c, e->topic, strlen(e->topic), sb, &k->msg);
		if (r == -EAGAIN) {
			c->blocked = true;
			return true;
		}
		if (r < 0) { /* unreachable: the peer went away */
			e->st.replays_dropped++;
			cur_drop(e, i);
			return false;
		}
		c->blocked = false;
		c->progress_ms = now_ms;
		c->next++;
		(*budget)--;
		e->st.replay_batches++;
	}
	if (c->next < c->end)
		return true;
	int r = send_to(e, c, "", 0, END_SEQ, NULL);
	if (r == -EAGAIN) {
		c->blocked = true;
		return true;
	}
	e->st.replays += r == 0;
	e->st.replays_dropped += r != 0;
	cur_drop(e, i);
	return false;
}

bool kvs_events_replay(kvs_events *e, uint64_t now_ms, bool readable)
{
	if (!e || !e->replay)
		return false;
	if (readable)
		take_requests(e, now_ms);
	/* the replays in turn (from where the last pass stopped), each sending
	 * what its peer takes until the pass's REPLAY_PASS batches are spent */
	uint32_t budget = REPLAY_PASS;
	bool progress = true;
	while (budget && e->n_curs && progress) {
		progress = false;
		for (uint32_t n = e->n_curs; n && budget && e->n_curs; n--) {
			uint32_t i = e->rr % e->n_curs;
			uint32_t before = budget;
			if (cur_step(e, i, now_ms, &budget)) {
				if (e->curs[i].blocked && now_ms - e->curs[i].progress_ms >= REPLAY_STALL_MS) {
					e->st.replays_dropped++;
					cur_drop(e, i);
				} else {
					e->rr = (i + 1) % e->n_curs;
				}
			}
			progress |= budget != before;
		}
	}
	/* more to send now (a replay that is not blocked)? */
	for (uint32_t i = 0; i < e->n_curs; i++)
		if (!e->curs[i].blocked)
			return true;
	return false;
}

bool kvs_events_replaying(const kvs_events *e) { return e && e->n_curs; }

void kvs_events_get_stats(const kvs_events *e, kvs_events_stats *st)
{
	if (e) {
		*st = e->st;
		st->replays_active = e->n_curs;
		st->ring_batches = e->count;
		st->ring_bytes = e->ring_bytes;
	} else
		memset(st, 0, sizeof(*st));
}
