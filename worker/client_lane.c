/* libkvside's job lane (protocol.md §18): a stream socket pair whose other
 * end the server reads in its loop. Once attached, requests are written to
 * it by the thread that makes them (no hand-off to the I/O thread, none to
 * ZeroMQ's threads) and the server answers on it; the I/O thread reads the
 * answers next to the DEALER's.
 *
 * Order: a session's messages must reach the server in the order sent, and
 * the lane and the DEALER are two paths. So the lane is used by every
 * request once it is up and by none before: it comes up only when the
 * `lane` reply arrives (everything sent on the DEALER before it has been
 * handled by then), application threads write to it only while nothing is
 * queued for the I/O thread or held by a restore (`direct`), and bytes a full
 * socket would not take wait in `out`, behind which every later request
 * waits too. Once broken (a write or read failed, the server closed it) the
 * lane is gone for the session: requests go over ZeroMQ again; after a
 * server restart the restore attaches a new one.
 *
 * Requests written by application threads go to the `sent` list under mu,
 * in the same critical section as the write, and the I/O thread moves them
 * to its pending table (kvs__lane_adopt) before it looks up any reply:
 * their timeouts and replies then work as for the rest. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "libkvside"
#include "client_int.h"
#include "kvs_frame.h"
#include "kvs_log.h"
#include "kvs_trace.h"

#define OUT_MAX (64ull << 20) /* bytes waiting for the socket: beyond, KVS_E_BUSY */

void kvs__lane_init(kvs_client *c, bool enabled)
{
	kvs__lane *L = &c->lane;
	memset(L, 0, sizeof(*L));
	L->fd = L->new_fd = -1;
	L->enabled = enabled;
}

/* ---- writing (mu held) ----------------------------------------------------- */

static int out_append(kvs__lane *L, const void *p, size_t n)
{
	if (L->out_off == L->out_len)
		L->out_off = L->out_len = 0;
	if (L->out_len + n > OUT_MAX)
		return KVS_E_BUSY;
	if (L->out_len + n > L->out_cap) {
		size_t cap = L->out_cap ? L->out_cap : 4096;
		while (cap < L->out_len + n)
			cap *= 2;
		uint8_t *b = realloc(L->out, cap);
		if (!b)
			return -ENOMEM;
		L->out = b;
		L->out_cap = cap;
	}
	memcpy(L->out + L->out_len, p, n);
	L->out_len += n;
	return 0;
}

/* Writes what waits in out. 0 (all out, or the socket is full), or a
 * negative errno: the lane broke. */
static int flush_locked(kvs__lane *L)
{
	while (L->out_off < L->out_len) {
		ssize_t w = send(L->fd, L->out + L->out_off, L->out_len - L->out_off, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				return 0;
			return -errno;
		}
		L->out_off += (size_t)w;
	}
	L->out_off = L->out_len = 0;
	return 0;
}

/* One frame: 4-byte little-endian length, then the message. Returns 0 (written
 * or queued in out), KVS_E_BUSY (out is full), -ENOMEM, or -EPIPE: the lane
 * broke, nothing of this frame was written. */
static int write_frame_locked(kvs__lane *L, const void *buf, size_t len)
{
	uint8_t hdr[4];
	kvs_frame_hdr(hdr, (uint32_t)len);
	size_t w = 0;
	if (L->out_off == L->out_len) {
		struct iovec iov[2] = {{hdr, 4}, {(void *)buf, len}};
		struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
		ssize_t r;
		do
			r = sendmsg(L->fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
		while (r < 0 && errno == EINTR);
		if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
			L->broken = true;
			return -EPIPE;
		}
		w = r < 0 ? 0 : (size_t)r;
		if (w == 4 + len) {
			L->frames_out++;
			return 0;
		}
	}
	/* the rest waits for POLLOUT; a frame is never dropped half-way */
	int e = 0;
	if (w < 4)
		e = out_append(L, hdr + w, 4 - w);
	if (!e)
		e = out_append(L, (const uint8_t *)buf + (w > 4 ? w - 4 : 0), len - (w > 4 ? w - 4 : 0));
	if (e && w > 0) {
		/* part of the frame is in the socket: the stream cannot go on */
		L->broken = true;
		return -EPIPE;
	}
	if (!e)
		L->frames_out++;
	return e;
}

int kvs__lane_direct(kvs_client *c, kvs__req *r)
{
	kvs__lane *L = &c->lane;
	if (!L->direct || L->broken || r->push)
		return 0;
	bool queued_before = L->out_off < L->out_len;
	int e = write_frame_locked(L, r->buf, r->len);
	if (e == -EPIPE)
		return 0; /* the I/O thread closes it; r goes the other way */
	if (e)
		return e;
	KVS_TRACE(KVS_TP_IO_SEND, r->op);
	free(r->buf);
	r->buf = NULL;
	r->on_lane = true;
	r->next = NULL;
	if (L->sent_tail)
		L->sent_tail->next = r;
	else
		L->sent_head = r;
	L->sent_tail = r;
	atomic_store_explicit(&L->n_sent, 1, memory_order_relaxed);
	L->direct_writes++;
	/* bytes left in out: the I/O thread must poll for room */
	return !queued_before && L->out_off < L->out_len ? 2 : 1;
}

bool kvs__lane_send(kvs_client *c, kvs__req *r)
{
	kvs__lane *L = &c->lane;
	if (L->state != KVS__LANE_UP)
		return false;
	pthread_mutex_lock(&c->mu);
	int e = L->broken ? -EPIPE : write_frame_locked(L, r->buf, r->len);
	pthread_mutex_unlock(&c->mu);
	if (e == -EPIPE)
		return false;
	if (e) {
		kvs_htab_del(c->pending, &r->id);
		kvs__finish(c, r, NULL, e == KVS_E_BUSY ? KVS_E_BUSY : KVS_E_INTERNAL);
		return true;
	}
	KVS_TRACE(KVS_TP_IO_SEND, r->op);
	free(r->buf);
	r->buf = NULL;
	r->on_lane = true;
	return true;
}

/* ---- the I/O thread ---------------------------------------------------------- */

bool kvs__lane_adopt(kvs_client *c)
{
	kvs__lane *L = &c->lane;
	if (!atomic_load_explicit(&L->n_sent, memory_order_relaxed))
		return false;
	pthread_mutex_lock(&c->mu);
	kvs__req *r = L->sent_head;
	L->sent_head = L->sent_tail = NULL;
	atomic_store_explicit(&L->n_sent, 0, memory_order_relaxed);
	pthread_mutex_unlock(&c->mu);
	bool any = r != NULL;
	while (r) {
		kvs__req *next = r->next;
		r->next = NULL;
		if (kvs_htab_put(c->pending, r) < 0)
			kvs__finish(c, r, NULL, -ENOMEM); /* sent, but its reply could not be matched */
		r = next;
	}
	return any;
}

/* Closes the lane (I/O thread): later requests go over ZeroMQ. */
void kvs__lane_close(kvs_client *c, const char *why)
{
	kvs__lane *L = &c->lane;
	if (L->state != KVS__LANE_UP)
		return;
	if (why && !atomic_load(&c->closing))
		kvs_info("job lane closed (%s): requests go over ZeroMQ", why);
	kvs__lane_adopt(c);
	pthread_mutex_lock(&c->mu);
	if (L->fd >= 0)
		close(L->fd);
	L->fd = -1;
	L->direct = false;
	L->broken = false;
	L->out_off = L->out_len = 0;
	pthread_mutex_unlock(&c->mu);
	if (L->state == KVS__LANE_UP)
		L->state = KVS__LANE_OFF; /* an attach in flight ends in on_lane */
	kvs_frame_free(&L->in); /* a new lane starts clean */
}

void kvs__lane_update(kvs_client *c)
{
	kvs__lane *L = &c->lane;
	bool d = L->state == KVS__LANE_UP && c->reopen == KVS__REOPEN_NONE && !c->held_head;
	if (d == L->direct)
		return;
	pthread_mutex_lock(&c->mu);
	L->direct = d;
	pthread_mutex_unlock(&c->mu);
}

short kvs__lane_events(kvs_client *c)
{
	kvs__lane *L = &c->lane;
	if (L->state != KVS__LANE_UP)
		return 0;
	pthread_mutex_lock(&c->mu);
	bool broken = L->broken;
	short ev = ZMQ_POLLIN | (L->out_off < L->out_len ? ZMQ_POLLOUT : 0);
	pthread_mutex_unlock(&c->mu);
	if (broken) { /* an application thread's write failed: close it here */
		kvs__lane_close(c, "write failed");
		return 0;
	}
	return ev;
}

/* Handles the whole frames in the lane's buffer; false if the lane must
 * close (a bad frame). */
static bool frames(kvs_client *c)
{
	kvs__lane *L = &c->lane;
	const uint8_t *body;
	uint32_t n;
	int r;
	while ((r = kvs_frame_next(&L->in, &body, &n)) == 1) {
		L->frames_in++;
		kvs__handle_reply(c, body, n);
		if (L->state != KVS__LANE_UP) /* the reply closed it (a re-open) */
			return true;
	}
	if (r < 0) {
		kvs_warn("job lane: %s", r == -EPROTO ? "a frame length from the server is out of range" : "out of memory");
		return false;
	}
	kvs_frame_compact(&L->in);
	return true;
}

void kvs__lane_run(kvs_client *c, short revents)
{
	kvs__lane *L = &c->lane;
	if (L->state != KVS__LANE_UP)
		return;
	pthread_mutex_lock(&c->mu);
	int e = L->broken ? -EPIPE : 0;
	if (!e && (revents & ZMQ_POLLOUT))
		e = flush_locked(L);
	if (e)
		L->broken = true;
	pthread_mutex_unlock(&c->mu);
	if (e) {
		kvs__lane_close(c, "write failed");
		return;
	}
	if (!(revents & (ZMQ_POLLIN | ZMQ_POLLERR)))
		return;
	for (int i = 0; i < 64 && L->state == KVS__LANE_UP; i++) {
		int full = 0;
		long r = kvs_frame_recv(&L->in, L->fd, &full);
		if (r == -EAGAIN)
			return;
		if (r <= 0) {
			kvs__lane_close(c, r == 0 ? "closed by the server" : "read failed");
			return;
		}
		if (!frames(c)) {
			kvs__lane_close(c, "bad frame");
			return;
		}
		if (!full)
			return;
	}
}

/* ---- attaching ------------------------------------------------------------------ */

/* The `lane` request's end (I/O thread). r->iarg is non-NULL for a
 * restore's attach. Requests the application made meanwhile were held
 * (route) and leave now, over the lane if it is up. */
static void on_lane(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	kvs__lane *L = &c->lane;
	(void)rep;
	kvs__push_free(r->push); /* our copy of the server's end: closed before anyone forks */
	r->push = NULL;
	if (code == 0 && L->new_fd >= 0) {
		pthread_mutex_lock(&c->mu);
		L->fd = L->new_fd;
		pthread_mutex_unlock(&c->mu);
		L->state = KVS__LANE_UP;
		L->new_fd = -1;
	} else {
		if (L->new_fd >= 0)
			close(L->new_fd);
		L->new_fd = -1;
		L->state = KVS__LANE_OFF;
		if (code == KVS_E_UNKNOWN_OP)
			kvs_info("the server has no job lanes: requests go over ZeroMQ");
		else if (code && code != -ECANCELED)
			kvs_warn("job lane not attached (%s): requests go over ZeroMQ", kvs_strerror(code));
	}
	if (r->iarg)
		kvs__restore_step_done(c, 0); /* without a lane the session still works */
	else if (c->reopen == KVS__REOPEN_NONE)
		kvs__release_held(c);
	kvs__lane_update(c);
	pthread_mutex_lock(&c->mu);
	if (L->opening) {
		L->opening = false;
		pthread_cond_broadcast(&c->job_cv);
	}
	pthread_mutex_unlock(&c->mu);
}

/* A holder of the one fd to push: the broker push takes registrations. */
static kvs__creg *fd_holder(int fd)
{
	kvs__creg *g = calloc(1, sizeof(*g));
	kvs_alloc *a = calloc(1, sizeof(*a));
	if (!g || !a) {
		free(g);
		free(a);
		return NULL;
	}
	a->fd = fd;
	g->allocs = a;
	g->n_allocs = 1;
	atomic_init(&g->refs, 0); /* the push's reference is the only one */
	return g;
}

bool kvs__lane_start(kvs_client *c, bool restore)
{
	kvs__lane *L = &c->lane;
	if (!L->enabled || L->state != KVS__LANE_OFF || atomic_load(&c->closing))
		return false;
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
		kvs_warn("job lane: socketpair failed: %s", strerror(errno));
		return false;
	}
	kvs__creg *g = fd_holder(sv[1]);
	kvs__push *p = g ? kvs__push_new(g) : NULL;
	if (!p) {
		if (g)
			free(g->allocs), free(g);
		close(sv[0]);
		close(sv[1]);
		return false;
	}
	kvs_msg m = {.op = KVS_OP_LANE, .session = atomic_load(&c->session)};
	memcpy(m.lane_token, p->tokens[0], KVS_TOKEN_BYTES);
	kvs__req *r;
	if (kvs__req_new(c, &m, 0, &r) != 0) {
		kvs__push_free(p); /* closes sv[1] */
		close(sv[0]);
		return false;
	}
	r->push = p;
	r->internal = on_lane;
	r->iarg = restore ? (void *)1 : NULL;
	L->new_fd = sv[0];
	L->state = KVS__LANE_ATTACHING;
	if (!restore) {
		pthread_mutex_lock(&c->mu);
		L->opening = true;
		pthread_mutex_unlock(&c->mu);
	}
	kvs__broker_add(c, r); /* its fd goes to the broker, then the request */
	return true;
}

void kvs__lane_wait_open(kvs_client *c)
{
	/* until the pair's server end is closed here: a process forked after
	 * kvs_client_open returns must not hold a copy of it (the server would
	 * then never see the lane close) */
	pthread_mutex_lock(&c->mu);
	while (c->lane.opening && !c->stop)
		pthread_cond_wait(&c->job_cv, &c->mu);
	pthread_mutex_unlock(&c->mu);
}

void kvs__lane_free(kvs_client *c)
{
	kvs__lane *L = &c->lane;
	if (L->fd >= 0)
		close(L->fd);
	if (L->new_fd >= 0)
		close(L->new_fd);
	kvs_frame_free(&L->in);
	free(L->out);
	kvs__req *r = L->sent_head;
	while (r) {
		kvs__req *next = r->next;
		kvs__req_free(r);
		r = next;
	}
	memset(L, 0, sizeof(*L));
	L->fd = L->new_fd = -1;
}
