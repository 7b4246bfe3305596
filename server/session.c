/* Sessions: hello, heartbeat, bye, leases and reaping. A session lives until
 * bye, until its lease (ttl_ms, renewed by any request) runs out, or until the
 * server stops. */
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVS_LOG_COMPONENT "session"
#include "kvs_log.h"
#include "auth.h"
#include "jobs.h"
#include "registry.h"
#include "lane.h"
#include "reply.h"
#include "session.h"

/* What a session holds goes with it: its open job parts fail, its
 * registrations die (released once their copies drained). */
static void held_free(kvs_session *s)
{
	while (s->held_head) {
		kvs_held *h = s->held_head;
		s->held_head = h->next;
		free(h);
	}
	s->held_tail = NULL;
	s->n_held = 0;
	s->held_bytes = 0;
}

static void session_gone(kvs_server *srv, kvs_session *s)
{
	held_free(s); /* held requests of a session that ended get no reply (8.2) */
	kvs__lane_session_gone(srv, s);
	kvs__route_scheduler_del(srv, s);
	if (srv->jobs) {
		kvs_jobs_session_gone(srv, s);
		kvs_registry_session_gone(srv, s->id);
	}
}

int kvs__op_hello(kvs_server *srv, const void *ident, size_t ident_len, const kvs_msg *rq)
{
	if (rq->engine.len == 0)
		return kvs__fail(srv, KVS_E_BADMSG, "engine: must not be empty");
	if (rq->world == 0)
		return kvs__fail(srv, KVS_E_BADMSG, "world: must be at least 1");
	if (rq->role == KVS_ROLE_WORKER && rq->rank >= rq->world)
		return kvs__fail(srv, KVS_E_BADMSG, "rank %u is not below world %u", rq->rank, rq->world);
	if (ident_len > KVS_MAX_IDENT)
		return kvs__fail(srv, KVS_E_LIMIT, "routing id too long");
	if (kvs_htab_count(srv->sessions) >= srv->cfg.max_sessions)
		return kvs__fail(srv, KVS_E_LIMIT, "session limit of %u reached (max-sessions); close sessions with bye",
				 srv->cfg.max_sessions);
	kvs_session *s = calloc(1, sizeof(*s));
	if (!s)
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	do
		randombytes_buf(&s->id, sizeof(s->id));
	while (s->id == 0 || kvs__session_get(srv, s->id));
	memcpy(s->ident, ident, ident_len);
	s->ident_len = ident_len;
	kvs_str_copy(s->engine, sizeof(s->engine), rq->engine);
	kvs_str_copy(s->ns, sizeof(s->ns), rq->ns);
	s->role = rq->role;
	s->rank = rq->rank;
	s->world = rq->world;
	s->expires_ms = srv->now_ms + srv->cfg.ttl_ms;
	if ((s->keyed = srv->peer == KVS_PEER_KEY || srv->peer == KVS_PEER_ADMIN_KEY))
		memcpy(s->key, srv->peer_key, sizeof(s->key));
	if (kvs_htab_put(srv->sessions, s) < 0) {
		free(s);
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	}
	if (s->role == KVS_ROLE_SCHEDULER && kvs__route_scheduler_add(srv, s) < 0) {
		kvs_htab_del(srv->sessions, &s->id);
		free(s);
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	}
	srv->st.sessions_opened++;
	kvs_info("session %016llx opened: engine '%s' %s rank %u/%u ns '%s'",
		 (unsigned long long)s->id, s->engine,
		 s->role == KVS_ROLE_SCHEDULER ? "scheduler" : "worker", s->rank, s->world, s->ns);
	kvs_msg rep = {.op = KVS_OP_HELLO, .id = rq->id, .ok = true, .session = s->id,
		       .heartbeat_ms = srv->cfg.heartbeat_ms, .ttl_ms = srv->cfg.ttl_ms,
		       .limits = {.max_msg_bytes = KVS_MAX_MSG_BYTES, .max_keys = KVS_MAX_KEYS,
				  .max_block_ids = KVS_MAX_BLOCK_IDS},
		       .packed_blocks = true};
	kvs__reply(srv, ident, ident_len, &rep);
	return 0;
}

int kvs__op_heartbeat(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_msg rep = {.op = KVS_OP_HEARTBEAT, .id = rq->id, .ok = true,
		       .pending_jobs = kvs_jobs_pending(srv, s)};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	return 0;
}

int kvs__op_bye(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_msg rep = {.op = KVS_OP_BYE, .id = rq->id, .ok = true};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	kvs__session_close(srv, s, "bye");
	return 0;
}

void kvs__session_close(kvs_server *srv, kvs_session *s, const char *why)
{
	kvs_info("session %016llx closed (%s)", (unsigned long long)s->id, why);
	/* unreachable for new requests first, then release what it holds */
	kvs_htab_del(srv->sessions, &s->id);
	session_gone(srv, s);
	free(s);
}

void kvs__sessions_reap(kvs_server *srv)
{
	size_t pos = 0;
	kvs_session *s;
	while ((s = kvs_htab_next(srv->sessions, &pos)) != NULL) {
		if (s->expires_ms > srv->now_ms || s->reg_pending)
			continue; /* a pending register is the server's wait, not silence */
		srv->st.sessions_reaped++;
		kvs_htab_iter_del(srv->sessions, &pos);
		kvs_info("session %016llx expired: lease of %llu ms ran out", (unsigned long long)s->id,
			 (unsigned long long)srv->cfg.ttl_ms);
		session_gone(srv, s);
		free(s);
	}
}

/* Bounds on what one session may have held while its register is pending:
 * a client that pipelines more than this gets E_BUSY for the excess. */
#define HELD_MAX 4096
#define HELD_BYTES_MAX (64ull << 20)

int kvs__session_hold(kvs_server *srv, kvs_session *s, const uint8_t *ident, size_t ident_len, const void *buf,
		      size_t len)
{
	if (s->n_held >= HELD_MAX || s->held_bytes + len > HELD_BYTES_MAX || ident_len > KVS_MAX_IDENT)
		return kvs__fail(srv, KVS_E_BUSY, "a register of this session is in progress and %u requests "
				 "wait behind it already", s->n_held);
	kvs_held *h = malloc(sizeof(*h) + len);
	if (!h)
		return kvs__fail(srv, KVS_E_INTERNAL, "out of memory");
	h->next = NULL;
	h->ident_len = ident_len;
	memcpy(h->ident, ident, ident_len);
	h->len = len;
	memcpy(h->buf, buf, len);
	if (s->held_tail)
		s->held_tail->next = h;
	else
		s->held_head = h;
	s->held_tail = h;
	s->n_held++;
	s->held_bytes += len;
	return 0;
}

int kvs__op_lane(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	kvs_parked *p = kvs__broker_claim(srv, rq->lane_token);
	if (!p)
		return kvs__fail(srv, KVS_E_AUTH, "token: unknown, expired or already used");
	int fd = p->fd;
	free(p);
	const char *why;
	int r = kvs__lane_attach(srv, s, fd, &why);
	if (r)
		return kvs__fail(srv, r, "%s", why);
	kvs_msg rep = {.op = KVS_OP_LANE, .id = rq->id, .ok = true};
	kvs__reply(srv, s->ident, s->ident_len, &rep);
	return 0;
}
