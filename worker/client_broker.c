/* libkvside's broker push: the fds of a registration go to the server's fd
 * broker (protocol.md §13) before its `register` leaves.
 *
 * A non-blocking state machine driven by the I/O thread's poll loop: the
 * connect (AF_UNIX connects at once or fails, EAGAIN only when the server's
 * listen backlog is full: retried 10 ms later), the sendmsg (MSG_DONTWAIT;
 * a full socket buffer waits for POLLOUT) and the reply (the loop polls the
 * broker socket next to the DEALER; KVS__BROKER_TIMEOUT_MS at most) never
 * block, so heartbeats and replies keep flowing while fds are pushed.
 *
 * Why on the I/O thread and not on the calling thread: after a server
 * restart the re-registration starts on the I/O thread, which has no caller
 * to lend it a thread, and a helper thread per restore would be a second
 * owner of the registrations. kvs_register goes the same way (its caller
 * waits on the request as for any blocking call), so there is one push path,
 * and the unit tests drive it.
 *
 * Shape: one connection at a time, one record in flight. All fds of a
 * registration go in one version 2 record; more than KVS_BROKER_MAX_FDS
 * (Linux passes at most 253 per message) are split into records of at most
 * that many, one after the other on the connection. Registrations queue FIFO
 * behind each other. Any failure fails the head request with the broker's
 * status (or the local error) and drops the connection (the server closes it
 * after a refusal anyway, and a late reply must not be taken for the next
 * record's); the connection is also closed when the queue runs empty. */
#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "libkvside"
#include "client_int.h"
#include "kvs_fdpass.h"
#include "kvs_log.h"

#define CONNECT_RETRY_MS 10

enum {
	BC_IDLE, /* no record in flight (connected or not) */
	BC_SEND, /* the record would not fit the socket buffer: waiting for POLLOUT */
	BC_WAIT, /* the record is out: waiting for its reply until deadline_ms */
};

kvs__push *kvs__push_new(kvs__creg *g)
{
	kvs__push *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	atomic_fetch_add(&g->refs, 1);
	p->g = g;
	randombytes_buf(p->tokens, sizeof(p->tokens[0]) * g->n_allocs);
	return p;
}

void kvs__push_free(kvs__push *p)
{
	if (!p)
		return;
	kvs__creg_unref(p->g);
	free(p);
}

void kvs__broker_init(kvs__bconn *b)
{
	memset(b, 0, sizeof(*b));
	b->fd = -1;
	b->state = BC_IDLE;
}

static void conn_close(kvs__bconn *b)
{
	if (b->fd >= 0)
		close(b->fd);
	b->fd = -1;
	b->state = BC_IDLE;
}

void kvs__broker_add(kvs_client *c, kvs__req *r)
{
	kvs__bconn *b = &c->broker;
	r->next = NULL;
	if (b->tail)
		b->tail->next = r;
	else
		b->head = r;
	b->tail = r;
}

static kvs__req *pop_head(kvs__bconn *b)
{
	kvs__req *r = b->head;
	b->head = r->next;
	if (!b->head)
		b->tail = NULL;
	r->next = NULL;
	return r;
}

/* The head's push failed: its request fails with code (unlinked first: the
 * completion may queue more). */
static void fail_head(kvs_client *c, int code)
{
	conn_close(&c->broker);
	kvs__req *r = pop_head(&c->broker);
	if (code != KVS_E_TIMEOUT)
		kvs_warn("fd broker push of %u allocation(s) failed: %s", r->push->g->n_allocs,
			 kvs_strerror(code));
	kvs__finish(c, r, NULL, code);
}

static int conn_open(kvs_client *c)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if ((size_t)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s", c->broker_dir,
			     KVS_BROKER_SOCK_NAME) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int e = errno == EWOULDBLOCK ? -EAGAIN : -errno;
		close(s);
		return e;
	}
	c->broker.fd = s;
	c->broker.state = BC_IDLE;
	return 0;
}

/* Sends the record of p's next fds (at most KVS_BROKER_MAX_FDS, skipping
 * allocations without one). Returns 0 (sent, or waiting for room) or an
 * error. */
static int send_record(kvs_client *c, kvs__push *p, uint64_t now)
{
	const kvs__creg *g = p->g;
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int fds[KVS_BROKER_MAX_FDS];
	uint32_t n = 0, i = p->next;
	for (; i < g->n_allocs && n < KVS_BROKER_MAX_FDS; i++) {
		if (g->allocs[i].fd < 0)
			continue; /* legacy CUDA IPC: the message carries the handle */
		memcpy(e[n].token, p->tokens[i], 16);
		memcpy(e[n].alloc_id, g->allocs[i].alloc_id, 16);
		e[n].size = g->allocs[i].size;
		fds[n++] = g->allocs[i].fd;
	}
	p->upto = i;
	uint8_t rec[KVS_BROKER_REC_MAX];
	size_t len = kvs_broker_rec_pack(e, n, rec);
	int r = kvs_fd_send(c->broker.fd, rec, len, fds, (int)n);
	if (r == -EAGAIN) {
		c->broker.state = BC_SEND;
		return 0;
	}
	if (r)
		return r;
	c->broker.state = BC_WAIT;
	c->broker.deadline_ms = now + KVS__BROKER_TIMEOUT_MS;
	c->cst.broker_records++;
	c->cst.broker_fds += n;
	return 0;
}

/* Reads the reply to the record in flight: 0 and *ret_status, -EAGAIN (not
 * there yet), or an error (-ECONNRESET: closed without a reply). */
static int read_reply(kvs_client *c, int *ret_status)
{
	uint8_t rep[KVS_BROKER_REP_BYTES + 1];
	size_t len = 0;
	int fd, nfds = 0;
	int r = kvs_fd_recv(c->broker.fd, rep, sizeof(rep), &len, &fd, 0, &nfds);
	if (r == -ECONNRESET) {
		struct ucred cr;
		socklen_t cl = sizeof(cr);
		if (getsockopt(c->broker.fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) == 0 && cr.uid != geteuid())
			kvs_warn("the fd broker (kvside-server pid %d, uid %u) closed the connection without a reply: it "
				 "admits only its own uid and its allow-uid, and this process runs as uid %u (start the "
				 "server with allow-uid: %u, or run the engine as uid %u)", (int)cr.pid, (unsigned)cr.uid,
				 (unsigned)geteuid(), (unsigned)geteuid(), (unsigned)cr.uid);
		else
			kvs_warn("the fd broker closed the connection without a reply (a server older "
				 "than broker record version 2 does that; see its log)");
	}
	if (r)
		return r;
	return kvs_broker_rep_unpack(rep, len, ret_status);
}

/* Requests behind the head whose deadline passed fail now (all unlinked
 * before any completion runs: a completion may queue more). */
static void expire_queued(kvs_client *c, uint64_t now)
{
	kvs__bconn *b = &c->broker;
	if (!b->head)
		return;
	kvs__req *expired = NULL, **ep = &expired, *prev = b->head;
	while (prev->next) {
		kvs__req *r = prev->next;
		if (r->deadline_ms > now) {
			prev = r;
			continue;
		}
		prev->next = r->next;
		r->next = NULL;
		*ep = r;
		ep = &r->next;
	}
	b->tail = prev;
	while (expired) {
		kvs__req *next = expired->next;
		kvs__finish(c, expired, NULL, KVS_E_TIMEOUT);
		expired = next;
	}
}

/* One step for the head request: returns true to step again, false to wait
 * for an event or a timer. */
static bool step(kvs_client *c, uint64_t now, short *revents)
{
	kvs__bconn *b = &c->broker;
	kvs__req *r = b->head;
	kvs__push *p = r->push;
	int e, status;
	if (r->deadline_ms <= now) {
		fail_head(c, KVS_E_TIMEOUT);
		return true;
	}
	if (b->state == BC_IDLE) {
		while (p->next < p->g->n_allocs && p->g->allocs[p->next].fd < 0)
			p->next++;
		if (p->next == p->g->n_allocs) { /* every fd parked: the message may go */
			kvs__send(c, pop_head(b));
			return true;
		}
	}
	if (b->fd < 0) {
		if (now < b->retry_ms)
			return false;
		*revents = 0;
		if ((e = conn_open(c)) == -EAGAIN) {
			b->retry_ms = now + CONNECT_RETRY_MS;
			return false;
		}
		if (e) {
			fail_head(c, e);
			return true;
		}
	}
	switch (b->state) {
	case BC_IDLE:
		if ((e = send_record(c, p, now)) != 0)
			fail_head(c, e);
		*revents = 0;
		return e != 0; /* sent: wait for the reply's POLLIN */
	case BC_SEND:
		if (!(*revents & (ZMQ_POLLOUT | ZMQ_POLLERR)))
			return false;
		b->state = BC_IDLE; /* room now: send again */
		*revents = 0;
		return true;
	default: /* BC_WAIT */
		if (!(*revents & (ZMQ_POLLIN | ZMQ_POLLERR))) {
			if (now < b->deadline_ms)
				return false;
			fail_head(c, KVS_E_TIMEOUT);
			return true;
		}
		*revents = 0;
		if ((e = read_reply(c, &status)) == -EAGAIN)
			return false;
		if (e || status) {
			fail_head(c, e ? e : status);
			return true;
		}
		p->next = p->upto;
		b->state = BC_IDLE;
		return true;
	}
}

void kvs__broker_run(kvs_client *c, uint64_t now, short revents)
{
	kvs__bconn *b = &c->broker;
	expire_queued(c, now);
	while (b->head && step(c, now, &revents))
		;
	if (!b->head && b->fd >= 0)
		conn_close(b); /* nothing left to push: do not hold a server slot */
}

short kvs__broker_events(const kvs_client *c)
{
	if (c->broker.fd < 0)
		return 0;
	if (c->broker.state == BC_WAIT)
		return ZMQ_POLLIN;
	if (c->broker.state == BC_SEND)
		return ZMQ_POLLOUT;
	return 0;
}

long kvs__broker_wait_ms(const kvs_client *c, uint64_t now)
{
	const kvs__bconn *b = &c->broker;
	if (!b->head)
		return -1;
	if (b->fd < 0)
		return b->retry_ms > now ? (long)(b->retry_ms - now) : 0;
	if (b->state == BC_WAIT)
		return b->deadline_ms > now ? (long)(b->deadline_ms - now) : 0;
	return b->state == BC_IDLE ? 0 : -1;
}

void kvs__broker_cancel(kvs_client *c, int code)
{
	kvs__bconn *b = &c->broker;
	conn_close(b);
	while (b->head)
		kvs__finish(c, pop_head(b), NULL, code);
}
