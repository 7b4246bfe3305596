/* Replies and pushes: encode a message and send it to a ZeroMQ routing id or
 * to a session's latest one. Below every handler (handlers depend on it, it
 * depends on no handler). Main-loop thread only. */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sodium.h>
#include <stdatomic.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "server"
#include "kvs_log.h"
#include "keys.h"
#include "lane.h"
#include "reply.h"

int kvs__fail(kvs_server *srv, int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(srv->errbuf, sizeof(srv->errbuf), fmt, ap);
	va_end(ap);
	return code;
}

/* ---- bytes waiting for each peer ---------------------------------------------
 * Every reply and push is handed to ZeroMQ zero-copy; ZeroMQ releases it
 * (free_frame, on its I/O thread) once written to the socket or dropped. The
 * bytes between the two are what a peer that does not read makes the server
 * hold: counted per peer (routing id) and in total, both bounded (protocol
 * §1). A peer over its bound gets nothing more, and the loop closes its
 * sessions (kvs__peers_overflowed). */
typedef struct kvs_peer {
	uint8_t key[16];            /* BLAKE2b-128 of the routing id */
	uint8_t ident[KVS_MAX_IDENT];
	size_t ident_len;
	atomic_uint_fast64_t queued; /* bytes handed to ZeroMQ, not yet released */
	atomic_uint refs;           /* the table's 1 + one per message in flight */
	bool over;                  /* over its bound: sends dropped until it drained */
	struct kvs_peer *next_over; /* on the overflow list (loop only) */
	atomic_uint_fast64_t *total;
} kvs_peer;

typedef struct frame_hint {
	kvs_peer *peer;
	uint64_t len;
} frame_hint;

struct kvs_peers {
	kvs_htab *table;            /* kvs_peer by key */
	atomic_uint_fast64_t total; /* bytes in flight to every peer */
	uint64_t max_peer, max_total;
	kvs_peer *overflowed;       /* peers whose sessions the loop must close */
	uint64_t closed;            /* peers cut off (stats) */
};

static void free_frame(void *data, void *hint)
{
	free(data);
	frame_hint *h = hint;
	if (!h)
		return;
	atomic_fetch_sub(&h->peer->queued, h->len);
	atomic_fetch_sub(h->peer->total, h->len);
	atomic_fetch_sub(&h->peer->refs, 1);
	free(h);
}

static kvs_peer *peer_of(kvs_server *srv, const void *ident, size_t ident_len)
{
	struct kvs_peers *P = srv->peers;
	uint8_t key[16];
	crypto_generichash(key, 16, ident, ident_len, NULL, 0);
	kvs_peer *p = kvs_htab_get(P->table, key);
	if (p || ident_len > KVS_MAX_IDENT)
		return p;
	if (!(p = calloc(1, sizeof(*p))))
		return NULL;
	memcpy(p->key, key, 16);
	memcpy(p->ident, ident, ident_len);
	p->ident_len = ident_len;
	atomic_init(&p->refs, 1);
	p->total = &P->total;
	if (kvs_htab_put(P->table, p) < 0) {
		free(p);
		return NULL;
	}
	return p;
}

/* What a waiting message costs beyond its bytes: ZeroMQ's content record,
 * the hint, allocator headers. */
#define FRAME_OVERHEAD 128

static void send_frames(kvs_server *srv, const void *ident, size_t ident_len, void *buf, size_t len)
{
	struct kvs_peers *P = srv->peers;
	if (kvs__is_lane_ident(ident, ident_len)) {
		/* a lane takes it now or never: what it cannot take goes to the
		 * lane's ZeroMQ routing id (lane.h) */
		int taken = kvs__lane_send(srv, ident, ident_len, buf, len);
		if (taken) {
			if (taken < 0)
				free(buf);
			return;
		}
		kvs__zmq_ident(&ident, &ident_len);
	}
	/* the encoder's buffer grows by doubling from 8 KiB: a 100-byte reply
	 * would hold 8 KiB while it waits */
	void *fit = realloc(buf, len ? len : 1);
	if (fit)
		buf = fit;
	kvs_peer *peer = peer_of(srv, ident, ident_len);
	uint64_t cost = len + FRAME_OVERHEAD;
	if (peer && !peer->over &&
	    (atomic_load(&peer->queued) + cost > P->max_peer || atomic_load(&P->total) + cost > P->max_total)) {
		/* the peer is not reading (or everyone is behind and this one holds
		 * the most it may): cut it off, the loop closes its sessions */
		peer->over = true;
		peer->next_over = P->overflowed;
		P->overflowed = peer;
		atomic_fetch_add(&peer->refs, 1); /* the overflow list's reference */
	}
	frame_hint *h = peer && !peer->over ? malloc(sizeof(*h)) : NULL;
	srv->router_used = true; /* a send may take the socket's ZMQ_FD signal (loop.c) */
	if (!h || zmq_send(srv->router, ident, ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
		free(h);
		free(buf);
		return;
	}
	*h = (frame_hint){peer, cost};
	atomic_fetch_add(&peer->queued, cost);
	atomic_fetch_add(&P->total, cost);
	atomic_fetch_add(&peer->refs, 1);
	zmq_msg_t m;
	/* zero copy: ZeroMQ frees buf once sent */
	if (zmq_msg_init_data(&m, buf, len, free_frame, h) != 0) {
		free_frame(buf, h);
		zmq_send(srv->router, "", 0, ZMQ_DONTWAIT);
		return;
	}
	if (zmq_msg_send(&m, srv->router, ZMQ_DONTWAIT) < 0)
		zmq_msg_close(&m); /* calls free_frame */
}

int kvs__peers_create(kvs_server *srv)
{
	struct kvs_peers *P = calloc(1, sizeof(*P));
	if (!P)
		return -ENOMEM;
	int r = kvs_htab_create(16, offsetof(kvs_peer, key), &P->table);
	if (r) {
		free(P);
		return r;
	}
	P->max_peer = srv->cfg.max_peer_queue;
	P->max_total = srv->cfg.max_queued;
	srv->peers = P;
	return 0;
}

bool kvs__peers_overflowed(kvs_server *srv, uint8_t *ident, size_t *ident_len, uint64_t *queued)
{
	struct kvs_peers *P = srv->peers;
	kvs_peer *p = P->overflowed;
	if (!p)
		return false;
	P->overflowed = p->next_over;
	memcpy(ident, p->ident, p->ident_len);
	*ident_len = p->ident_len;
	*queued = atomic_load(&p->queued);
	atomic_fetch_sub(&p->refs, 1);
	P->closed++;
	return true;
}

/* Tick: a cut-off peer whose bytes drained may be served again (a client
 * that re-opens); idle peers leave the table. */
void kvs__peers_tick(kvs_server *srv)
{
	struct kvs_peers *P = srv->peers;
	size_t pos = 0;
	kvs_peer *p;
	while ((p = kvs_htab_next(P->table, &pos)) != NULL) {
		if (atomic_load(&p->queued) != 0)
			continue;
		if (p->over && atomic_load(&p->refs) == 1)
			p->over = false;
		if (!p->over && atomic_load(&p->refs) == 1) {
			kvs_htab_iter_del(P->table, &pos);
			free(p);
		}
	}
}

uint64_t kvs__peers_queued(const kvs_server *srv) { return atomic_load(&srv->peers->total); }
uint64_t kvs__peers_closed(const kvs_server *srv) { return srv->peers->closed; }

/* After the ROUTER socket is closed (ZeroMQ released every message). */
void kvs__peers_destroy(kvs_server *srv)
{
	struct kvs_peers *P = srv->peers;
	if (!P)
		return;
	size_t pos = 0;
	kvs_peer *p;
	while ((p = kvs_htab_next(P->table, &pos)) != NULL)
		free(p);
	kvs_htab_destroy(P->table);
	free(P);
	srv->peers = NULL;
}

void kvs__reply(kvs_server *srv, const void *ident, size_t ident_len, kvs_msg *rep)
{
	void *buf;
	size_t len;
	rep->is_reply = true;
	memcpy(rep->epoch, srv->epoch, KVS_EPOCH_BYTES);
	int r = kvs_proto_encode(rep, &buf, &len);
	if (r < 0) {
		kvs_err("cannot encode %s reply: %s", kvs_op_name(rep->op), kvs_strerror(r));
		kvs_msg e = {.op = rep->op, .id = rep->id, .is_reply = true, .ok = false,
			     .code = KVS_E_INTERNAL, .errmsg = kvs_str_c("reply could not be encoded")};
		memcpy(e.epoch, srv->epoch, KVS_EPOCH_BYTES);
		if (kvs_proto_encode(&e, &buf, &len) < 0)
			return;
		srv->st.errors[KVS_E_INTERNAL - KVS_E_BASE]++;
	}
	send_frames(srv, ident, ident_len, buf, len);
}

static void vreply_err(kvs_server *srv, const void *ident, size_t ident_len, kvs_op op, uint64_t id,
		       int code, const char *fmt, va_list ap)
{
	char text[KVS_MAX_ERRMSG];
	vsnprintf(text, sizeof(text), fmt, ap);
	if (!kvs_error_is_project(code))
		code = KVS_E_INTERNAL;
	srv->st.errors[code - KVS_E_BASE]++;
	srv->st.errors_by_op[op > KVS_OP_NONE && op < KVS_OP_COUNT_ ? op : KVS_OP_NONE][code - KVS_E_BASE]++;
	kvs_msg e = {.op = op, .id = id, .ok = false, .code = code,
		     .errmsg = kvs_str_c(text)};
	kvs_dbg("reply %s id=%llu %s: %s", kvs_op_name(op), (unsigned long long)id,
		kvs_error_name(code), text);
	kvs__reply(srv, ident, ident_len, &e);
}

void kvs__reply_err(kvs_server *srv, const void *ident, size_t ident_len, kvs_op op, uint64_t id,
		    int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vreply_err(srv, ident, ident_len, op, id, code, fmt, ap);
	va_end(ap);
}

void kvs__send_to_session(kvs_server *srv, uint64_t session, kvs_msg *msg)
{
	kvs_session *s = kvs__session_get(srv, session);
	if (s)
		kvs__reply(srv, s->ident, s->ident_len, msg);
}

void kvs__err_to_session(kvs_server *srv, uint64_t session, kvs_op op, uint64_t id, int code,
			 const char *fmt, ...)
{
	kvs_session *s = kvs__session_get(srv, session);
	if (!s)
		return;
	va_list ap;
	va_start(ap, fmt);
	vreply_err(srv, s->ident, s->ident_len, op, id, code, fmt, ap);
	va_end(ap);
}


/* ---- scheduler routes ---------------------------------------------------------
 * job_done goes to every scheduler session of the job's engine: an index by
 * engine (BLAKE2b-128 of its name) so a push costs the engine's schedulers,
 * not a scan of every session. */
typedef struct sched_route {
	uint8_t key[16]; /* digest of the engine name */
	kvs_session **s;
	uint32_t n, cap;
} sched_route;

int kvs__route_scheduler_add(kvs_server *srv, kvs_session *s)
{
	uint8_t key[16];
	kvs_ns_digest(s->engine, key);
	sched_route *rt = kvs_htab_get(srv->schedulers, key);
	if (!rt) {
		if (!(rt = calloc(1, sizeof(*rt))))
			return -ENOMEM;
		memcpy(rt->key, key, 16);
		if (kvs_htab_put(srv->schedulers, rt) < 0) {
			free(rt);
			return -ENOMEM;
		}
	}
	if (rt->n == rt->cap) {
		uint32_t nc = rt->cap ? 2 * rt->cap : 4;
		kvs_session **ns = realloc(rt->s, nc * sizeof(*ns));
		if (!ns) {
			if (!rt->n) {
				kvs_htab_del(srv->schedulers, key);
				free(rt);
			}
			return -ENOMEM;
		}
		rt->s = ns;
		rt->cap = nc;
	}
	rt->s[rt->n++] = s;
	return 0;
}

void kvs__route_scheduler_del(kvs_server *srv, kvs_session *s)
{
	uint8_t key[16];
	kvs_ns_digest(s->engine, key);
	sched_route *rt = kvs_htab_get(srv->schedulers, key);
	for (uint32_t i = 0; rt && i < rt->n; i++) {
		if (rt->s[i] != s)
			continue;
		rt->s[i] = rt->s[--rt->n];
		if (!rt->n) {
			kvs_htab_del(srv->schedulers, key);
			free(rt->s);
			free(rt);
		}
		return;
	}
}

void kvs__push_to_schedulers(kvs_server *srv, const char *engine, kvs_msg *msg)
{
	uint8_t key[16];
	kvs_ns_digest(engine, key);
	sched_route *rt = kvs_htab_get(srv->schedulers, key);
	for (uint32_t i = 0; rt && i < rt->n; i++)
		kvs__reply(srv, rt->s[i]->ident, rt->s[i]->ident_len, msg);
}

int kvs__routes_create(kvs_server *srv) { return kvs_htab_create(16, offsetof(sched_route, key), &srv->schedulers); }

void kvs__routes_destroy(kvs_server *srv)
{
	size_t pos = 0;
	sched_route *rt;
	while ((rt = kvs_htab_next(srv->schedulers, &pos)) != NULL) {
		free(rt->s);
		free(rt);
	}
	kvs_htab_destroy(srv->schedulers);
}
