/* Job lanes: see lane.h and protocol.md §18. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <sodium.h>

#define KVS_LOG_COMPONENT "lane"
#include "kvs_frame.h"
#include "kvs_log.h"
#include "lane.h"

/* A lane ident: LANE_MAGIC, the lane's number (u64, little-endian), the
 * lane's secret (8 random bytes), then the ZeroMQ routing id of the `lane`
 * request: at least LANE_HDR + 1 bytes, starting 0x00. The ids a ROUTER makes
 * are exactly 5 bytes (0x00, then a counter); ids a peer chooses should not
 * start with 0x00 (ZeroMQ reserves those) but libzmq does not enforce it. A
 * forged lane ident would route the replies to its request into another
 * session's lane, so the loop drops every ZeroMQ message whose routing id
 * starts with LANE_MAGIC, whatever its length (kvs__in_lane_space, used by
 * loop.c's router_ready), and kvs__lane_send takes a reply only for the
 * exact ident of a live lane, secret included. */
static const uint8_t LANE_MAGIC[3] = {0x00, 'L', 'N'};
#define LANE_SECRET 11
#define LANE_HDR 19
#define READ_BUDGET (1u << 20) /* bytes read from one lane per loop iteration */
#define CORK_MAX (256u << 10)   /* bytes a lane collects before it writes mid-iteration */
#define KEEP_MAX (16u << 10)    /* an emptied buffer larger than this is freed */
/* Input held for frames larger than a lane's first buffer (KVS_FRAME_START),
 * over every lane: a lane whose large frame would take the total beyond it
 * is closed, and so is a lane whose large frame received nothing for
 * LANE_STALL_MS (a peer announcing 8 MiB frames and stalling would otherwise
 * hold 8 MiB per lane, up to max-sessions lanes). Engines' frames are small
 * (a 4,096-key lookup is ~140 KiB, sent at once). */
#define LANE_BIG_MAX (64u << 20)
#define LANE_STALL_MS 5000

/* One lane. Invariants: fd >= 0 while open; a dead lane (closed fd) is only
 * waiting for the sweep at the end of the loop step that killed it, because
 * the read loop may still be walking its buffer. out[out_off..out_len) are
 * framed bytes (length prefix and message, in order) not yet written: the
 * replies of this loop iteration, written together by kvs__lanes_flush, or,
 * when blocked, what a full socket would not take (then nothing is added
 * until POLLOUT wrote it all); out_off is 0 unless blocked. The session's
 * lane_id names this lane while both are alive. */
typedef struct kvs_lane {
	uint64_t id; /* key */
	uint64_t session;
	int fd;
	bool dead;
	bool blocked; /* the socket refused bytes: out waits for POLLOUT */
	int peer;        /* kvs_peer_kind of the `lane` request: the lane's requests' */
	uint8_t ident[KVS_MAX_IDENT]; /* its lane ident */
	size_t ident_len;
	kvs_frame_in in; /* received bytes not yet handled */
	size_t big;      /* in.cap when above KVS_FRAME_START, else 0: its share of kvs_lanes.big */
	uint64_t last_in_ms; /* when bytes last arrived */
	uint8_t *out;    /* owned; NULL until the first reply */
	size_t out_len, out_off, out_cap;
} kvs_lane;

struct kvs_lanes {
	kvs_htab *by_id;
	kvs_lane **list; /* open and dead lanes, in no order */
	int n, cap;
	int corked; /* lanes given bytes this iteration (an upper bound) */
	size_t big; /* sum of the lanes' big: at most LANE_BIG_MAX plus one frame */
	uint64_t next_id;
	kvs_lane_stats st;
};

bool kvs__in_lane_space(const void *ident, size_t ident_len)
{
	return ident_len >= sizeof(LANE_MAGIC) && memcmp(ident, LANE_MAGIC, sizeof(LANE_MAGIC)) == 0;
}

bool kvs__is_lane_ident(const void *ident, size_t ident_len)
{
	return ident_len > LANE_HDR && memcmp(ident, LANE_MAGIC, sizeof(LANE_MAGIC)) == 0;
}

void kvs__zmq_ident(const void **ident, size_t *ident_len)
{
	if (kvs__is_lane_ident(*ident, *ident_len)) {
		*ident = (const uint8_t *)*ident + LANE_HDR;
		*ident_len -= LANE_HDR;
	}
}

static uint64_t ident_lane_id(const uint8_t *ident)
{
	uint64_t id = 0;
	for (int i = 0; i < 8; i++)
		id |= (uint64_t)ident[3 + i] << (8 * i);
	return id;
}

int kvs__lanes_create(kvs_server *srv)
{
	struct kvs_lanes *L = calloc(1, sizeof(*L));
	if (!L)
		return -ENOMEM;
	int r = kvs_htab_create(sizeof(uint64_t), offsetof(kvs_lane, id), &L->by_id);
	if (r) {
		free(L);
		return r;
	}
	L->next_id = 1;
	srv->lanes = L;
	return 0;
}

/* Hands the socket what l still holds, if it takes it now (the last
 * replies before a close: a bye's answer, say). */
static void last_words(kvs_lane *l)
{
	if (l->fd >= 0 && l->out_len > l->out_off)
		(void)send(l->fd, l->out + l->out_off, l->out_len - l->out_off, MSG_DONTWAIT | MSG_NOSIGNAL);
	l->out_off = l->out_len = 0;
}

static void lane_free(kvs_lane *l)
{
	if (l->fd >= 0)
		close(l->fd);
	kvs_frame_free(&l->in);
	free(l->out);
	free(l);
}

void kvs__lanes_destroy(kvs_server *srv)
{
	struct kvs_lanes *L = srv->lanes;
	if (!L)
		return;
	for (int i = 0; i < L->n; i++)
		lane_free(L->list[i]);
	free(L->list);
	kvs_htab_destroy(L->by_id);
	free(L);
	srv->lanes = NULL;
}

/* Closes l now, after a last write of what it holds; its memory goes at the
 * next sweep. */
static void lane_kill(kvs_server *srv, kvs_lane *l, const char *why)
{
	if (l->dead)
		return;
	last_words(l);
	kvs_dbg("lane %llu of session %016llx closed (%s)", (unsigned long long)l->id,
		(unsigned long long)l->session, why);
	l->dead = true;
	close(l->fd);
	l->fd = -1;
	srv->lanes->big -= l->big;
	l->big = 0;
	kvs_htab_del(srv->lanes->by_id, &l->id);
	srv->lanes->st.open--;
	kvs_session *s = kvs__session_get(srv, l->session);
	if (s && s->lane_id == l->id)
		s->lane_id = 0;
}

static void sweep(struct kvs_lanes *L)
{
	for (int i = 0; i < L->n;) {
		if (!L->list[i]->dead) {
			i++;
			continue;
		}
		lane_free(L->list[i]);
		L->list[i] = L->list[--L->n];
	}
}

void kvs__lane_session_gone(kvs_server *srv, kvs_session *s)
{
	if (!s->lane_id || !srv->lanes)
		return;
	kvs_lane *l = kvs_htab_get(srv->lanes->by_id, &s->lane_id);
	if (l)
		lane_kill(srv, l, "session closed");
	s->lane_id = 0;
}

/* The fd must be one end of an AF_UNIX stream socket: anything else would
 * let a client make the loop read from a file or a pipe it writes slowly. */
static const char *check_socket(int fd)
{
	struct stat st;
	int type = 0, domain = 0;
	socklen_t tl = sizeof(type), dl = sizeof(domain);
	if (fstat(fd, &st) < 0 || !S_ISSOCK(st.st_mode))
		return "token: the parked fd is not a socket";
	if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || type != SOCK_STREAM ||
	    getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &dl) < 0 || domain != AF_UNIX)
		return "token: the parked fd is not an AF_UNIX stream socket";
	return NULL;
}

int kvs__lane_attach(kvs_server *srv, kvs_session *s, int fd, const char **why)
{
	struct kvs_lanes *L = srv->lanes;
	int code = KVS_E_INTERNAL;
	kvs_lane *l = NULL;
	*why = "out of memory";
	/* the request's own ident is the session's latest (dispatch set it) */
	if (kvs__is_lane_ident(s->ident, s->ident_len)) {
		*why = "a lane is attached over ZeroMQ, not over a lane";
		code = KVS_E_BADMSG;
		goto fail;
	}
	if (s->ident_len + LANE_HDR > KVS_MAX_IDENT) {
		*why = "routing id too long for a lane";
		code = KVS_E_LIMIT;
		goto fail;
	}
	if ((*why = check_socket(fd)) != NULL) {
		code = KVS_E_BADMSG;
		goto fail;
	}
	*why = "out of memory";
	if (L->n == L->cap) {
		int cap = L->cap ? 2 * L->cap : 16;
		kvs_lane **nl = realloc(L->list, (size_t)cap * sizeof(*nl));
		if (!nl)
			goto fail;
		L->list = nl, L->cap = cap;
	}
	if (!(l = calloc(1, sizeof(*l))))
		goto fail;
	l->id = L->next_id++;
	l->session = s->id;
	l->fd = fd;
	l->peer = srv->peer;
	memcpy(l->ident, LANE_MAGIC, sizeof(LANE_MAGIC));
	for (int i = 0; i < 8; i++)
		l->ident[3 + i] = (uint8_t)(l->id >> (8 * i));
	randombytes_buf(l->ident + LANE_SECRET, LANE_HDR - LANE_SECRET);
	memcpy(l->ident + LANE_HDR, s->ident, s->ident_len);
	l->ident_len = LANE_HDR + s->ident_len;
	if (kvs_htab_put(L->by_id, l) < 0) {
		free(l);
		goto fail;
	}
	L->list[L->n++] = l;
	L->st.open++;
	L->st.attached++;
	/* a session has one lane: a new one replaces the old */
	if (s->lane_id) {
		kvs_lane *old = kvs_htab_get(L->by_id, &s->lane_id);
		if (old)
			lane_kill(srv, old, "replaced by a new lane");
	}
	s->lane_id = l->id;
	return 0;
fail:
	close(fd);
	return code;
}

/* ---- reading ------------------------------------------------------------------ */

/* Handles the whole frames in l->in; false if the lane died (a bad frame,
 * or a request that closed its session). */
static bool handle_frames(kvs_server *srv, kvs_lane *l)
{
	const uint8_t *body;
	uint32_t n;
	int r;
	while ((r = kvs_frame_next(&l->in, &body, &n)) == 1) {
		srv->lanes->st.requests++;
		srv->peer = l->peer;
		srv->dispatch(srv, l->ident, l->ident_len, body, n);
		if (l->dead) /* the request closed its session (bye) */
			return false;
	}
	if (r < 0) {
		if (r == -EPROTO) {
			kvs_warn("lane of session %016llx: a frame length is outside 1..%u: lane closed",
				 (unsigned long long)l->session, (unsigned)KVS_FRAME_MAX);
			srv->lanes->st.closed_bad++;
		}
		lane_kill(srv, l, r == -EPROTO ? "bad frame" : "out of memory");
		return false;
	}
	kvs_frame_compact(&l->in);
	return true;
}

/* Counts l's large-frame buffer in the lanes' total; false (l closed) when
 * that takes the total beyond LANE_BIG_MAX. */
static bool account(kvs_server *srv, kvs_lane *l)
{
	struct kvs_lanes *L = srv->lanes;
	size_t big = l->in.cap > KVS_FRAME_START ? l->in.cap : 0;
	L->big = L->big - l->big + big;
	l->big = big;
	if (big && L->big > LANE_BIG_MAX) {
		kvs_warn("lane of session %016llx: a %zu-byte frame would take the lanes' input beyond %u MiB: "
			 "lane closed", (unsigned long long)l->session, big, LANE_BIG_MAX >> 20);
		L->st.closed_budget++;
		lane_kill(srv, l, "input budget");
		return false;
	}
	return true;
}

static void lane_read(kvs_server *srv, kvs_lane *l)
{
	for (size_t got = 0; got < READ_BUDGET;) {
		int full = 0;
		long r = kvs_frame_recv(&l->in, l->fd, &full);
		if (r == -EAGAIN)
			return;
		if (r <= 0) {
			srv->lanes->st.closed_bad += r < 0 && r != -ENOMEM;
			lane_kill(srv, l, r == 0 ? "closed by the client" : strerror((int)-r));
			return;
		}
		got += (size_t)r;
		l->last_in_ms = srv->now_ms;
		if (!handle_frames(srv, l) || !account(srv, l) || !full)
			return; /* dead, or drained (a short read) */
	}
}

void kvs__lanes_tick(kvs_server *srv)
{
	struct kvs_lanes *L = srv->lanes;
	for (int i = 0; L && i < L->n; i++) {
		kvs_lane *l = L->list[i];
		if (l->dead || !l->big || srv->now_ms - l->last_in_ms < LANE_STALL_MS)
			continue;
		kvs_warn("lane of session %016llx: a %zu-byte frame received nothing for %u ms: lane closed",
			 (unsigned long long)l->session, l->big, LANE_STALL_MS);
		L->st.closed_stalled++;
		lane_kill(srv, l, "stalled frame");
	}
	if (L)
		sweep(L);
}

/* ---- writing ------------------------------------------------------------------ */

/* Writes out[out_off..out_len) with as few system calls as the socket allows.
 * Returns true when it is all out (the buffer is kept for the next replies);
 * false when the socket is full (blocked: POLLOUT) or the lane died. */
static bool flush(kvs_server *srv, kvs_lane *l)
{
	while (l->out_off < l->out_len) {
		ssize_t w = send(l->fd, l->out + l->out_off, l->out_len - l->out_off, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK) {
				l->blocked = true;
				return false;
			}
			lane_kill(srv, l, strerror(errno));
			return false;
		}
		l->out_off += (size_t)w;
		srv->lanes->st.writes++;
	}
	l->out_off = l->out_len = 0;
	l->blocked = false;
	if (l->out_cap > KEEP_MAX) { /* a burst's buffer does not stay */
		free(l->out);
		l->out = NULL;
		l->out_cap = 0;
	}
	return true;
}

/* Appends a frame (prefix and len bytes) to l->out; false if out of memory. */
static bool append(kvs_lane *l, const void *buf, size_t len)
{
	size_t need = l->out_len + 4 + len;
	if (need > l->out_cap) {
		size_t cap = l->out_cap ? l->out_cap : 1024;
		while (cap < need)
			cap *= 2;
		uint8_t *o = realloc(l->out, cap);
		if (!o)
			return false;
		l->out = o, l->out_cap = cap;
	}
	kvs_frame_hdr(l->out + l->out_len, (uint32_t)len);
	memcpy(l->out + l->out_len + 4, buf, len);
	l->out_len = need;
	return true;
}

int kvs__lane_send(kvs_server *srv, const void *ident, size_t ident_len, void *buf, size_t len)
{
	struct kvs_lanes *L = srv->lanes;
	uint64_t id = ident_lane_id(ident);
	if (!L)
		return 0;
	kvs_lane *l = kvs_htab_get(L->by_id, &id);
	if (l && (l->ident_len != ident_len || memcmp(l->ident, ident, ident_len) != 0)) {
		/* the number of a live lane with another secret or routing id:
		 * not this lane's reply, and not one for that routing id either */
		L->st.forged++;
		return -1;
	}
	if (!l || l->dead || l->blocked) {
		L->st.diverted++;
		return 0;
	}
	/* not blocked, so out_off is 0. A lane that collected CORK_MAX writes
	 * now, so one iteration's replies never hold much memory */
	if (l->out_len && l->out_len + len > CORK_MAX && !flush(srv, l)) {
		L->st.diverted++;
		return 0;
	}
	if (!l->out_len)
		L->corked++;
	if (!append(l, buf, len)) {
		L->st.diverted++;
		return 0;
	}
	free(buf);
	L->st.replies++;
	return 1;
}

void kvs__lanes_flush(kvs_server *srv)
{
	struct kvs_lanes *L = srv->lanes;
	if (!L || !L->corked)
		return;
	L->corked = 0;
	for (int i = 0; i < L->n; i++) {
		kvs_lane *l = L->list[i];
		if (!l->dead && !l->blocked && l->out_len > l->out_off)
			flush(srv, l);
	}
	sweep(L);
}

/* ---- the loop ------------------------------------------------------------------ */

int kvs__lanes_items(kvs_server *srv, struct pollfd *fds, int cap)
{
	struct kvs_lanes *L = srv->lanes;
	int n = 0;
	sweep(L); /* fds[i] is L->list[i] until kvs__lanes_ready */
	for (int i = 0; i < L->n && n < cap; i++) {
		kvs_lane *l = L->list[i];
		fds[n++] = (struct pollfd){.fd = l->fd, .events = (short)(POLLIN | (l->blocked ? POLLOUT : 0))};
	}
	return n;
}

void kvs__lanes_ready(kvs_server *srv, const struct pollfd *fds, int n)
{
	struct kvs_lanes *L = srv->lanes;
	/* fds[i] is L->list[i]: nothing adds a lane or sweeps before the end */
	for (int i = 0; i < n && i < L->n; i++) {
		kvs_lane *l = L->list[i];
		if (l->dead || l->fd != fds[i].fd)
			continue;
		if (l->blocked && (fds[i].revents & POLLOUT))
			flush(srv, l);
		/* a hang-up or an error: the read finds the end (or the error) */
		if (!l->dead && (fds[i].revents & (POLLIN | POLLERR | POLLHUP | POLLNVAL)))
			lane_read(srv, l);
	}
	sweep(L);
}

void kvs__lanes_before_poll(kvs_server *srv)
{
	struct kvs_lanes *L = srv->lanes;
	if (!L || !L->corked)
		return;
	if (L->st.late++ == 0)
		kvs_err("lanes: replies were left unwritten before the loop's poll (a path that makes replies "
			"outside a loop iteration does not flush them; written now, counted in lane_late_flushes)");
	kvs__lanes_flush(srv);
}

int kvs__lanes_count(const kvs_server *srv) { return srv->lanes ? srv->lanes->n : 0; }

void kvs__lanes_stats(const kvs_server *srv, kvs_lane_stats *out)
{
	if (srv->lanes) {
		*out = srv->lanes->st;
		out->big_bytes = srv->lanes->big;
	} else
		memset(out, 0, sizeof(*out));
}
