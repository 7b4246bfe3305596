/* libkvside client: an I/O thread owning the DEALER socket, a submit queue
 * fed by application threads (mutex + eventfd), a pending table keyed by
 * request id, heartbeats, timeouts and the restart (epoch) state machine. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "libkvside"
#include "kvs_chunkkey.h"
#include "kvs_fdpass.h"
#include "kvs_htab.h"
#include "kvs_log.h"
#include "kvs_proto.h"
#include "kvs_time.h"
#include "kvside.h"

int kvs__cuda_ipc_handle(const uint8_t alloc_id[16], uint8_t out[64]); /* cuda.c */

#define JOB_RING 4096
#define BROKER_TIMEOUT_MS 2000

typedef struct kvs_client_ kvs_client_;
struct req;
typedef void (*internal_fn)(kvs_client *c, struct req *r, const kvs_msg *rep, int code);

/* A request from submission to its one completion. Owned by the submit
 * queue, then by the pending table (I/O thread), then freed after done. */
typedef struct req {
	uint64_t id; /* key in pending */
	kvs_op op;
	void *buf;
	size_t len;
	uint64_t deadline_ms;
	kvs_done_fn done;
	void *arg;
	internal_fn internal; /* I/O-thread bookkeeping instead of done */
	void *iarg;
	struct req *next;
} req;

/* A registration the client keeps so it can restore it after a restart. */
typedef struct creg {
	uint8_t (*ipc)[64]; /* per allocation: legacy CUDA IPC handle (fd < 0) */
	uint64_t handle;    /* stable, returned to the application */
	uint64_t server_id; /* current id on the server (0 while being restored) */
	int device_type;
	uint8_t uuid[16];
	kvs_alloc *allocs; /* fds are our duplicates */
	uint32_t n_allocs;
	kvs_group *groups;
	uint32_t n_groups;
	kvs_layer *layers;
	uint32_t n_layers;
	struct creg *next;
} creg;

struct kvs_client {
	/* immutable after open */
	char endpoint[600], broker_dir[256], engine[KVS_MAX_STR + 1], ns[KVS_MAX_STR + 1];
	int role;
	uint32_t rank, world;
	int timeout_ms;
	kvs_event_fn on_event;
	void *event_arg;
	pthread_t thr;
	bool thr_started;

	/* submit queue: guarded by mu */
	pthread_mutex_t mu;
	req *q_head, *q_tail;
	bool stop;
	int efd;
	atomic_uint_fast64_t next_id;
	atomic_uint_fast64_t session;
	atomic_uint_fast64_t reconnects;
	atomic_bool closing; /* kvs_client_close began: no heartbeats, no re-open */

	/* registrations: guarded by reg_mu */
	pthread_mutex_t reg_mu;
	creg *regs;
	uint64_t next_handle;

	/* job_done ring: guarded by mu, signalled on job_cv */
	pthread_cond_t job_cv;
	struct { uint64_t job; int state; } ring[JOB_RING];
	uint64_t ring_n;

	/* I/O thread only */
	void *zctx, *dealer;
	kvs_htab *pending;
	uint8_t epoch[KVS_EPOCH_BYTES];
	bool have_epoch;
	bool reopening;
	int restore_left, restore_err;
	uint64_t hb_ms, next_hb_ms;
	bool hb_inflight;
};

/* ---- submission ---------------------------------------------------------- */

static void wake(kvs_client *c)
{
	uint64_t one = 1;
	ssize_t w = write(c->efd, &one, sizeof(one));
	(void)w;
}

static int timeout_of(kvs_client *c, int t) { return t > 0 ? t : c->timeout_ms; }

/* Encodes msg (assigning its id) and queues it. On error nothing is queued. */
static int submit(kvs_client *c, kvs_msg *msg, int timeout_ms, kvs_done_fn done, void *arg,
		  internal_fn internal, void *iarg)
{
	req *r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	msg->id = atomic_fetch_add(&c->next_id, 1);
	int e = kvs_proto_encode(msg, &r->buf, &r->len);
	if (e) {
		free(r);
		return e == -ENOMEM ? -ENOMEM : KVS_E_LIMIT;
	}
	if (r->len > KVS_MAX_MSG_BYTES) {
		free(r->buf);
		free(r);
		return KVS_E_LIMIT;
	}
	r->id = msg->id;
	r->op = msg->op;
	r->deadline_ms = kvs_now_ms() + (uint64_t)timeout_of(c, timeout_ms);
	r->done = done;
	r->arg = arg;
	r->internal = internal;
	r->iarg = iarg;
	pthread_mutex_lock(&c->mu);
	if (c->stop) {
		pthread_mutex_unlock(&c->mu);
		free(r->buf);
		free(r);
		return -ECANCELED;
	}
	if (c->q_tail)
		c->q_tail->next = r;
	else
		c->q_head = r;
	c->q_tail = r;
	pthread_mutex_unlock(&c->mu);
	wake(c);
	return 0;
}

/* ---- completion ---------------------------------------------------------- */

static void finish(kvs_client *c, req *r, const kvs_msg *rep, int code)
{
	if (r->internal) {
		r->internal(c, r, rep, code);
	} else if (r->done) {
		static _Thread_local kvs_job_info_out jobs[KVS_MAX_JOBS_QUERY];
		static _Thread_local kvs_stat_out stats[KVS_MAX_COUNTERS];
		kvs_result res = {.code = code, .msg = ""};
		kvs_admin_info admin = {0};
		char msgbuf[KVS_MAX_ERRMSG + 1];
		if (rep && !rep->ok) {
			kvs_str_copy(msgbuf, sizeof(msgbuf), rep->errmsg);
			res.msg = msgbuf;
		} else if (rep) {
			res.session = rep->session;
			res.registration = rep->registration;
			res.imported = rep->imported;
			res.aliased = rep->aliased;
			res.pending_jobs = rep->pending_jobs;
			res.hits = rep->hits;
			res.tiers = rep->tiers;
			res.state = rep->state;
			uint32_t n = rep->n_job_infos < KVS_MAX_JOBS_QUERY ? rep->n_job_infos : KVS_MAX_JOBS_QUERY;
			for (uint32_t i = 0; i < n; i++) {
				jobs[i].job = rep->job_infos[i].job;
				jobs[i].state = rep->job_infos[i].state;
				jobs[i].ranks_done = rep->job_infos[i].ranks_done;
				kvs_str_copy(jobs[i].reason, sizeof(jobs[i].reason), rep->job_infos[i].reason);
			}
			res.jobs = jobs;
			res.n_jobs = n;
			for (uint32_t i = 0; i < rep->n_counters && i < KVS_MAX_COUNTERS; i++) {
				kvs_str_copy(stats[i].name, sizeof(stats[i].name), rep->counters[i].name);
				stats[i].value = rep->counters[i].value;
			}
			res.stats = stats;
			res.n_stats = rep->n_counters;
			if (rep->op == KVS_OP_ADMIN) {
				admin = (kvs_admin_info){.cmd = rep->admin_cmd, .draining = rep->draining,
							 .drained = rep->drained, .jobs_open = rep->jobs_open,
							 .waited_ms = rep->waited_ms, .cleared_l1 = rep->cleared_l1,
							 .cleared_l2 = rep->cleared_l2, .kept_l1 = rep->kept_l1};
				res.admin = &admin;
			}
		}
		r->done(&res, r->arg);
	}
	free(r->buf);
	free(r);
}

static void emit(kvs_client *c, kvs_event *ev)
{
	ev->session = atomic_load(&c->session);
	if (c->on_event)
		c->on_event(ev, c->event_arg);
}

/* ---- restart handling ----------------------------------------------------- */

static int encode_register(kvs_client *c, creg *g, uint8_t (*tokens)[16], kvs_msg *m,
			   kvs_alloc_desc *ad, kvs_group_desc *gd, kvs_layer_desc *ld)
{
	memset(m, 0, sizeof(*m));
	m->op = KVS_OP_REGISTER;
	m->session = atomic_load(&c->session);
	m->device.type = (uint8_t)g->device_type;
	memcpy(m->device.uuid, g->uuid, 16);
	for (uint32_t i = 0; i < g->n_allocs; i++) {
		memcpy(ad[i].token, tokens[i], 16);
		memcpy(ad[i].alloc_id, g->allocs[i].alloc_id, 16);
		ad[i].size = g->allocs[i].size;
		ad[i].follows = g->allocs[i].follows;
		ad[i].ipc_handle = (kvs_bytes){NULL, 0};
		if (g->allocs[i].fd < 0 && g->ipc)
			ad[i].ipc_handle = (kvs_bytes){g->ipc[i], 64};
	}
	for (uint32_t i = 0; i < g->n_groups; i++)
		gd[i] = (kvs_group_desc){g->groups[i].id, (uint8_t)g->groups[i].kind,
					 g->groups[i].tokens_per_block, g->groups[i].blocks_per_chunk,
					 g->groups[i].window_chunks, g->groups[i].null_block};
	for (uint32_t i = 0; i < g->n_layers; i++)
		ld[i] = (kvs_layer_desc){g->layers[i].group, g->layers[i].alloc, g->layers[i].offset,
					 g->layers[i].num_blocks, g->layers[i].block_stride,
					 g->layers[i].block_bytes};
	m->allocs = ad;
	m->n_allocs = g->n_allocs;
	m->groups = gd;
	m->n_groups = g->n_groups;
	m->layers = ld;
	m->n_layers = g->n_layers;
	return 0;
}

/* Sends every allocation fd of g through the broker under fresh tokens. */
static int broker_push(kvs_client *c, creg *g, uint8_t (*tokens)[16])
{
	for (uint32_t i = 0; i < g->n_allocs; i++) {
		kvs_broker_entry br;
		randombytes_buf(tokens[i], 16);
		if (g->allocs[i].fd < 0)
			continue; /* legacy CUDA IPC: no fd to pass */
		memcpy(br.token, tokens[i], 16);
		memcpy(br.alloc_id, g->allocs[i].alloc_id, 16);
		br.size = g->allocs[i].size;
		int r = kvs_broker_send(c->broker_dir, &br, g->allocs[i].fd, BROKER_TIMEOUT_MS);
		if (r)
			return r;
	}
	return 0;
}

static void restore_step_done(kvs_client *c)
{
	if (--c->restore_left > 0)
		return;
	c->reopening = false;
	atomic_fetch_add(&c->reconnects, 1);
	kvs_info("session %016llx re-opened after server restart/expiry (%s)",
		 (unsigned long long)atomic_load(&c->session),
		 c->restore_err ? kvs_strerror(c->restore_err) : "registrations restored");
	kvs_event ev = {.type = KVS_EVENT_RECONNECTED, .error = c->restore_err};
	emit(c, &ev);
}

static void on_reregister(kvs_client *c, req *r, const kvs_msg *rep, int code)
{
	uint64_t handle = (uint64_t)(uintptr_t)r->iarg;
	pthread_mutex_lock(&c->reg_mu);
	for (creg *g = c->regs; g; g = g->next)
		if (g->handle == handle && code == 0)
			g->server_id = rep->registration;
	pthread_mutex_unlock(&c->reg_mu);
	if (code && !c->restore_err)
		c->restore_err = code;
	restore_step_done(c);
}

static void on_rehello(kvs_client *c, req *r, const kvs_msg *rep, int code)
{
	if (code) {
		/* server still away or refusing: try again at the next heartbeat */
		c->reopening = false;
		c->have_epoch = false;
		if (code != -ECANCELED) /* closing: not worth a warning */
			kvs_warn("re-opening session failed: %s", kvs_strerror(code));
		return;
	}
	atomic_store(&c->session, rep->session);
	memcpy(c->epoch, rep->epoch, KVS_EPOCH_BYTES);
	c->have_epoch = true;
	c->hb_ms = rep->heartbeat_ms ? rep->heartbeat_ms : 1000;
	c->restore_left = 1; /* held until every register is sent */
	c->restore_err = 0;
	pthread_mutex_lock(&c->reg_mu);
	for (creg *g = c->regs; g; g = g->next) {
		uint8_t tokens[KVS_MAX_ALLOCS][16];
		kvs_alloc_desc ad[KVS_MAX_ALLOCS];
		kvs_group_desc gd[KVS_MAX_GROUPS];
		kvs_layer_desc *ld = calloc(g->n_layers ? g->n_layers : 1, sizeof(*ld));
		g->server_id = 0;
		int e = ld ? broker_push(c, g, tokens) : -ENOMEM;
		if (!e) {
			kvs_msg m;
			encode_register(c, g, tokens, &m, ad, gd, ld);
			/* submit() only queues: the I/O loop sends it next iteration */
			e = submit(c, &m, 0, NULL, NULL, on_reregister, (void *)(uintptr_t)g->handle);
		}
		free(ld);
		if (e) {
			if (!c->restore_err)
				c->restore_err = e;
		} else {
			c->restore_left++;
		}
	}
	pthread_mutex_unlock(&c->reg_mu);
	restore_step_done(c);
}

static void start_reopen(kvs_client *c, const char *why)
{
	/* a heartbeat answered E_SESSION after our own bye is no restart */
	if (c->reopening || atomic_load(&c->closing))
		return;
	kvs_info("server %s: re-opening session", why);
	c->reopening = true;
	kvs_msg m = {.op = KVS_OP_HELLO, .engine = kvs_str_c(c->engine), .role = (uint8_t)c->role,
		     .rank = c->rank, .world = c->world, .ns = kvs_str_c(c->ns)};
	if (submit(c, &m, 0, NULL, NULL, on_rehello, NULL) != 0)
		c->reopening = false;
}

static void on_heartbeat(kvs_client *c, req *r, const kvs_msg *rep, int code)
{
	c->hb_inflight = false;
	/* stale heartbeats queued while the server was away name an old session */
	if (code == KVS_E_SESSION && (uint64_t)(uintptr_t)r->iarg == atomic_load(&c->session))
		start_reopen(c, "no longer knows our session");
}

/* ---- the I/O thread -------------------------------------------------------- */

static void handle_reply(kvs_client *c, const void *data, size_t len)
{
	kvs_msg rep;
	kvs_proto_err perr;
	int r = kvs_proto_decode(data, len, true, &rep, &perr);
	if (r) {
		kvs_warn("undecodable reply (%s): %s", kvs_error_name(r), perr.msg);
		if (perr.id) {
			req *q = kvs_htab_del(c->pending, &perr.id);
			if (q)
				finish(c, q, NULL, KVS_E_BADMSG);
		}
		return;
	}
	bool new_epoch = c->have_epoch && memcmp(rep.epoch, c->epoch, KVS_EPOCH_BYTES) != 0;
	if (rep.op == KVS_OP_JOB_DONE && rep.id == 0) {
		char reason[KVS_MAX_STR + 1];
		kvs_str_copy(reason, sizeof(reason), rep.reason);
		pthread_mutex_lock(&c->mu);
		c->ring[c->ring_n % JOB_RING].job = rep.job;
		c->ring[c->ring_n % JOB_RING].state = rep.state;
		c->ring_n++;
		pthread_cond_broadcast(&c->job_cv);
		pthread_mutex_unlock(&c->mu);
		kvs_event ev = {.type = KVS_EVENT_JOB_DONE, .job = rep.job, .state = rep.state,
				.reason = reason};
		emit(c, &ev);
	} else {
		req *q = kvs_htab_del(c->pending, &rep.id);
		if (q) {
			if (q->op == KVS_OP_HELLO && rep.ok && !c->have_epoch) {
				memcpy(c->epoch, rep.epoch, KVS_EPOCH_BYTES);
				c->have_epoch = true;
				new_epoch = false;
				c->hb_ms = rep.heartbeat_ms ? rep.heartbeat_ms : 1000;
				atomic_store(&c->session, rep.session);
			}
			int code = rep.ok ? 0 : rep.code;
			if (new_epoch && !q->internal && code == 0)
				code = KVS_E_SESSION; /* answered by a server that forgot us */
			finish(c, q, &rep, code);
		}
	}
	/* re-check: the reply may itself have completed a re-open */
	if (c->have_epoch && memcmp(rep.epoch, c->epoch, KVS_EPOCH_BYTES) != 0 && !c->reopening)
		start_reopen(c, "restarted (new epoch)");
	kvs_msg_clear(&rep);
}

static void drain_queue(kvs_client *c)
{
	pthread_mutex_lock(&c->mu);
	req *r = c->q_head;
	c->q_head = c->q_tail = NULL;
	pthread_mutex_unlock(&c->mu);
	while (r) {
		req *next = r->next;
		r->next = NULL;
		if (kvs_htab_put(c->pending, r) < 0) {
			finish(c, r, NULL, -ENOMEM);
		} else if (zmq_send(c->dealer, r->buf, r->len, ZMQ_DONTWAIT) < 0) {
			kvs_htab_del(c->pending, &r->id);
			finish(c, r, NULL, errno == EAGAIN ? KVS_E_BUSY : KVS_E_INTERNAL);
		} else {
			free(r->buf);
			r->buf = NULL;
		}
		r = next;
	}
}

static void expire(kvs_client *c, uint64_t now)
{
	size_t pos = 0;
	req *r;
	while ((r = kvs_htab_next(c->pending, &pos)) != NULL) {
		if (r->deadline_ms > now)
			continue;
		kvs_htab_iter_del(c->pending, &pos);
		finish(c, r, NULL, KVS_E_TIMEOUT);
	}
}

static void heartbeat(kvs_client *c, uint64_t now)
{
	if (now < c->next_hb_ms || !atomic_load(&c->session) || atomic_load(&c->closing))
		return;
	c->next_hb_ms = now + (c->hb_ms ? c->hb_ms : 1000);
	if (c->reopening)
		return;
	if (!c->have_epoch) { /* an earlier re-open failed: try again */
		start_reopen(c, "unreachable earlier");
		return;
	}
	if (c->hb_inflight)
		return;
	kvs_msg m = {.op = KVS_OP_HEARTBEAT, .session = atomic_load(&c->session)};
	/* the reply must come within one ttl-ish window; ttl >= 2 heartbeats */
	if (submit(c, &m, (int)(c->hb_ms ? 2 * c->hb_ms : 2000), NULL, NULL, on_heartbeat,
		   (void *)(uintptr_t)m.session) == 0)
		c->hb_inflight = true;
}

static void *io_main(void *arg)
{
	kvs_client *c = arg;
	for (;;) {
		pthread_mutex_lock(&c->mu);
		bool stop = c->stop && !c->q_head;
		pthread_mutex_unlock(&c->mu);
		if (stop)
			break;
		zmq_pollitem_t it[2] = {{.socket = c->dealer, .events = ZMQ_POLLIN},
					{.fd = c->efd, .events = ZMQ_POLLIN}};
		uint64_t now = kvs_now_ms();
		long to = 50;
		if (c->next_hb_ms > now && (long)(c->next_hb_ms - now) < to)
			to = (long)(c->next_hb_ms - now);
		zmq_poll(it, 2, to);
		if (it[1].revents & ZMQ_POLLIN) {
			uint64_t v;
			ssize_t rd = read(c->efd, &v, sizeof(v));
			(void)rd;
		}
		drain_queue(c);
		for (int i = 0; i < 1024; i++) {
			zmq_msg_t m;
			zmq_msg_init(&m);
			if (zmq_msg_recv(&m, c->dealer, ZMQ_DONTWAIT) < 0) {
				zmq_msg_close(&m);
				break;
			}
			if (!zmq_msg_more(&m))
				handle_reply(c, zmq_msg_data(&m), zmq_msg_size(&m));
			else
				while (zmq_msg_more(&m) && zmq_msg_recv(&m, c->dealer, 0) >= 0)
					; /* multi-frame replies are not ours: drop */
			zmq_msg_close(&m);
		}
		drain_queue(c); /* internal requests queued by handlers */
		now = kvs_now_ms();
		expire(c, now);
		heartbeat(c, now);
	}
	/* fail what is left */
	size_t pos = 0;
	req *r;
	while ((r = kvs_htab_next(c->pending, &pos)) != NULL) {
		kvs_htab_iter_del(c->pending, &pos);
		finish(c, r, NULL, -ECANCELED);
	}
	return NULL;
}

/* ---- blocking helpers ------------------------------------------------------ */

typedef struct waiter {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool done;
	kvs_result res;
	char msg[KVS_MAX_ERRMSG + 1];
	uint8_t *tiers_out;
	uint32_t tiers_cap;
	kvs_job_info_out *jobs_out;
	kvs_stat_out *stats_out;
	uint32_t cap, n_out;
	kvs_admin_info *admin_out;
} waiter;

static void waiter_done(const kvs_result *res, void *arg)
{
	waiter *w = arg;
	pthread_mutex_lock(&w->mu);
	w->res = *res;
	snprintf(w->msg, sizeof(w->msg), "%s", res->msg ? res->msg : "");
	w->res.msg = w->msg;
	w->res.tiers = NULL;
	w->res.jobs = NULL;
	w->res.stats = NULL;
	w->res.admin = NULL;
	if (w->admin_out && res->admin)
		*w->admin_out = *res->admin;
	if (w->tiers_out && res->tiers)
		memcpy(w->tiers_out, res->tiers, res->hits < w->tiers_cap ? res->hits : w->tiers_cap);
	if (w->jobs_out) {
		w->n_out = res->n_jobs < w->cap ? res->n_jobs : w->cap;
		memcpy(w->jobs_out, res->jobs, w->n_out * sizeof(*w->jobs_out));
	}
	if (w->stats_out) {
		w->n_out = res->n_stats < w->cap ? res->n_stats : w->cap;
		memcpy(w->stats_out, res->stats, w->n_out * sizeof(*w->stats_out));
	}
	w->done = true;
	pthread_cond_signal(&w->cv);
	pthread_mutex_unlock(&w->mu);
}

static bool on_io_thread(kvs_client *c)
{
	return c->thr_started && pthread_equal(pthread_self(), c->thr);
}

/* Submits msg and waits for its completion (the I/O thread guarantees one,
 * a timeout included). */
static int call(kvs_client *c, kvs_msg *m, int timeout_ms, waiter *w)
{
	if (on_io_thread(c))
		return -EDEADLK;
	pthread_mutex_init(&w->mu, NULL);
	pthread_cond_init(&w->cv, NULL);
	int r = submit(c, m, timeout_ms, waiter_done, w, NULL, NULL);
	if (r == 0) {
		pthread_mutex_lock(&w->mu);
		while (!w->done)
			pthread_cond_wait(&w->cv, &w->mu);
		pthread_mutex_unlock(&w->mu);
		r = w->res.code;
	}
	pthread_cond_destroy(&w->cv);
	pthread_mutex_destroy(&w->mu);
	return r;
}

/* ---- public API ------------------------------------------------------------ */

static void default_broker_dir(char *out, size_t cap)
{
	const char *xdg = getenv("XDG_RUNTIME_DIR");
	if (xdg && *xdg)
		snprintf(out, cap, "%s/kvside", xdg);
	else
		snprintf(out, cap, "/tmp/kvside-%u", (unsigned)getuid());
}

int kvs_client_open(const kvs_client_config *cfg, kvs_client **ret)
{
	if (!cfg || !cfg->engine || !cfg->ns || strlen(cfg->engine) > KVS_MAX_STR ||
	    strlen(cfg->ns) > KVS_MAX_STR)
		return -EINVAL;
	if (sodium_init() < 0)
		return -EIO;
	kvs_client *c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	int r;
	if (cfg->broker_dir)
		snprintf(c->broker_dir, sizeof(c->broker_dir), "%s", cfg->broker_dir);
	else
		default_broker_dir(c->broker_dir, sizeof(c->broker_dir));
	if (cfg->endpoint)
		snprintf(c->endpoint, sizeof(c->endpoint), "%s", cfg->endpoint);
	else
		snprintf(c->endpoint, sizeof(c->endpoint), "ipc://%s/kvside.zmq", c->broker_dir);
	snprintf(c->engine, sizeof(c->engine), "%s", cfg->engine);
	snprintf(c->ns, sizeof(c->ns), "%s", cfg->ns);
	c->role = cfg->role;
	c->rank = cfg->rank;
	c->world = cfg->world;
	c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 10000;
	c->on_event = cfg->on_event;
	c->event_arg = cfg->event_arg;
	atomic_init(&c->next_id, 1);
	atomic_init(&c->session, 0);
	atomic_init(&c->reconnects, 0);
	atomic_init(&c->closing, false);
	c->next_handle = 1;
	pthread_mutex_init(&c->mu, NULL);
	pthread_mutex_init(&c->reg_mu, NULL);
	pthread_cond_init(&c->job_cv, NULL);
	c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (c->efd < 0) {
		r = -errno;
		goto err_free;
	}
	if ((r = kvs_htab_create(sizeof(uint64_t), offsetof(req, id), &c->pending)) < 0)
		goto err_efd;
	c->zctx = zmq_ctx_new();
	if (!c->zctx) {
		r = -ENOMEM;
		goto err_pending;
	}
	c->dealer = zmq_socket(c->zctx, ZMQ_DEALER);
	if (!c->dealer) {
		r = -ENOMEM;
		goto err_ctx;
	}
	int zero = 0, ivl = 100, ivlmax = 1000;
	zmq_setsockopt(c->dealer, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(c->dealer, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
	zmq_setsockopt(c->dealer, ZMQ_RECONNECT_IVL_MAX, &ivlmax, sizeof(ivlmax));
	if (zmq_connect(c->dealer, c->endpoint) != 0) {
		r = -EINVAL;
		kvs_err("cannot connect to %s: %s", c->endpoint, zmq_strerror(errno));
		goto err_sock;
	}
	if ((r = pthread_create(&c->thr, NULL, io_main, c)) != 0) {
		r = -r;
		goto err_sock;
	}
	c->thr_started = true;
	kvs_msg m = {.op = KVS_OP_HELLO, .engine = kvs_str_c(c->engine), .role = (uint8_t)c->role,
		     .rank = c->rank, .world = c->world, .ns = kvs_str_c(c->ns)};
	waiter w = {0};
	r = call(c, &m, cfg->timeout_ms, &w);
	if (r) {
		kvs_client_close(c);
		return r;
	}
	c->next_hb_ms = kvs_now_ms(); /* heartbeats start right away */
	*ret = c;
	return 0;

err_sock:
	zmq_close(c->dealer);
err_ctx:
	zmq_ctx_term(c->zctx);
err_pending:
	kvs_htab_destroy(c->pending);
err_efd:
	close(c->efd);
err_free:
	pthread_cond_destroy(&c->job_cv);
	pthread_mutex_destroy(&c->reg_mu);
	pthread_mutex_destroy(&c->mu);
	free(c);
	return r;
}

static void creg_free(creg *g)
{
	for (uint32_t i = 0; i < g->n_allocs; i++)
		if (g->allocs[i].fd >= 0)
			close(g->allocs[i].fd);
	free(g->ipc);
	free(g->allocs);
	free(g->groups);
	free(g->layers);
	free(g);
}

void kvs_client_close(kvs_client *c)
{
	if (!c)
		return;
	atomic_store(&c->closing, true);
	if (c->thr_started && atomic_load(&c->session)) {
		kvs_msg m = {.op = KVS_OP_BYE, .session = atomic_load(&c->session)};
		waiter w = {0};
		call(c, &m, 1000, &w);
	}
	pthread_mutex_lock(&c->mu);
	c->stop = true;
	pthread_mutex_unlock(&c->mu);
	wake(c);
	if (c->thr_started)
		pthread_join(c->thr, NULL);
	zmq_close(c->dealer);
	zmq_ctx_term(c->zctx);
	kvs_htab_destroy(c->pending);
	close(c->efd);
	while (c->regs) {
		creg *g = c->regs;
		c->regs = g->next;
		creg_free(g);
	}
	pthread_cond_destroy(&c->job_cv);
	pthread_mutex_destroy(&c->reg_mu);
	pthread_mutex_destroy(&c->mu);
	free(c);
}

uint64_t kvs_client_session(kvs_client *c) { return atomic_load(&c->session); }
uint64_t kvs_client_reconnects(kvs_client *c) { return atomic_load(&c->reconnects); }

int kvs_memfd_create(const char *name, uint64_t size, int *ret_fd, void **ret_ptr)
{
	int fd = memfd_create(name ? name : "kvside-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)size) < 0) {
		int e = -errno;
		close(fd);
		return e;
	}
	/* the server maps it: forbid shrinking underneath it */
	fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK);
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		int e = -errno;
		close(fd);
		return e;
	}
	*ret_fd = fd;
	*ret_ptr = p;
	return 0;
}

int kvs_register(kvs_client *c, const kvs_registration_desc *d, int timeout_ms, uint64_t *ret_handle)
{
	if (!d || d->n_allocs == 0 || d->n_allocs > KVS_MAX_ALLOCS || d->n_groups > KVS_MAX_GROUPS ||
	    d->n_layers > KVS_MAX_LAYERS)
		return KVS_E_LIMIT;
	creg *g = calloc(1, sizeof(*g));
	if (!g)
		return -ENOMEM;
	int r = -ENOMEM;
	g->allocs = calloc(d->n_allocs, sizeof(*g->allocs));
	g->groups = calloc(d->n_groups ? d->n_groups : 1, sizeof(*g->groups));
	g->layers = calloc(d->n_layers ? d->n_layers : 1, sizeof(*g->layers));
	if (!g->allocs || !g->groups || !g->layers)
		goto err;
	g->device_type = d->device_type;
	memcpy(g->uuid, d->device_uuid, 16);
	for (uint32_t i = 0; i < d->n_allocs; i++) {
		g->allocs[i] = d->allocs[i];
		if (d->allocs[i].fd < 0 && d->device_type == KVS_DEV_CUDA) {
			/* legacy CUDA IPC: the handle kvs_cuda_export recorded */
			if (!g->ipc && !(g->ipc = calloc(d->n_allocs, 64))) {
				g->n_allocs = i;
				goto err;
			}
			if (kvs__cuda_ipc_handle(d->allocs[i].alloc_id, g->ipc[i]) != 0) {
				r = -EBADF;
				g->n_allocs = i;
				goto err;
			}
			continue;
		}
		g->allocs[i].fd = fcntl(d->allocs[i].fd, F_DUPFD_CLOEXEC, 3);
		if (g->allocs[i].fd < 0) {
			r = -errno;
			g->n_allocs = i;
			goto err;
		}
		static const uint8_t zero[16];
		if (memcmp(g->allocs[i].alloc_id, zero, 16) == 0)
			randombytes_buf(g->allocs[i].alloc_id, 16);
	}
	g->n_allocs = d->n_allocs;
	memcpy(g->groups, d->groups, d->n_groups * sizeof(*g->groups));
	g->n_groups = d->n_groups;
	memcpy(g->layers, d->layers, d->n_layers * sizeof(*g->layers));
	g->n_layers = d->n_layers;

	uint8_t tokens[KVS_MAX_ALLOCS][16];
	if ((r = broker_push(c, g, tokens)) != 0)
		goto err;
	kvs_alloc_desc ad[KVS_MAX_ALLOCS];
	kvs_group_desc gd[KVS_MAX_GROUPS];
	kvs_layer_desc *ld = calloc(g->n_layers ? g->n_layers : 1, sizeof(*ld));
	if (!ld) {
		r = -ENOMEM;
		goto err;
	}
	kvs_msg m;
	encode_register(c, g, tokens, &m, ad, gd, ld);
	waiter w = {0};
	r = call(c, &m, timeout_ms, &w);
	free(ld);
	if (r)
		goto err;
	pthread_mutex_lock(&c->reg_mu);
	g->server_id = w.res.registration;
	g->handle = c->next_handle++;
	g->next = c->regs;
	c->regs = g;
	*ret_handle = g->handle;
	pthread_mutex_unlock(&c->reg_mu);
	return 0;
err:
	creg_free(g);
	return r;
}

int kvs_unregister(kvs_client *c, uint64_t handle, int timeout_ms)
{
	pthread_mutex_lock(&c->reg_mu);
	creg *g = c->regs;
	while (g && g->handle != handle)
		g = g->next;
	uint64_t sid = g ? g->server_id : 0;
	pthread_mutex_unlock(&c->reg_mu);
	if (!g)
		return KVS_E_NOREG;
	kvs_msg m = {.op = KVS_OP_UNREGISTER, .session = atomic_load(&c->session), .registration = sid};
	waiter w = {0};
	int r = call(c, &m, timeout_ms, &w);
	if (r && r != KVS_E_NOREG)
		return r;
	pthread_mutex_lock(&c->reg_mu);
	for (creg **pp = &c->regs; *pp; pp = &(*pp)->next)
		if (*pp == g) {
			*pp = g->next;
			creg_free(g);
			break;
		}
	pthread_mutex_unlock(&c->reg_mu);
	return r;
}

static int fill_blocks(kvs_msg *m, const kvs_blocks *b)
{
	if (!b || b->n_groups > KVS_MAX_GROUPS)
		return KVS_E_LIMIT;
	m->blocks.n = b->n_groups;
	for (uint32_t g = 0; g < b->n_groups; g++) {
		m->blocks.ids[g] = b->ids[g];
		m->blocks.len[g] = b->len[g];
	}
	return 0;
}

static int job_msg(kvs_client *c, kvs_msg *m, kvs_op op, uint64_t job, const uint8_t *keys,
		   uint32_t n_keys, const kvs_blocks *blocks)
{
	memset(m, 0, sizeof(*m));
	m->op = op;
	m->session = atomic_load(&c->session);
	m->job = job;
	m->keys = keys;
	m->n_keys = n_keys;
	if (n_keys > KVS_MAX_KEYS)
		return KVS_E_LIMIT;
	return fill_blocks(m, blocks);
}

int kvs_store_async(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
		    const kvs_blocks *blocks, const kvs_store_opts *opts, int timeout_ms,
		    kvs_done_fn done, void *arg)
{
	kvs_msg m;
	int r = job_msg(c, &m, KVS_OP_STORE, job, keys, n_keys, blocks);
	if (r)
		return r;
	if (opts) {
		m.lazy = opts->lazy;
		m.producer_event = (kvs_bytes){opts->producer_event, opts->producer_event_len};
		if (opts->event_hashes) {
			m.event_hashes = opts->event_hashes;
			m.n_event_hashes = n_keys;
		}
	}
	return submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

int kvs_retrieve_async(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
		       const kvs_blocks *blocks, uint64_t skip_tokens, int timeout_ms,
		       kvs_done_fn done, void *arg)
{
	kvs_msg m;
	int r = job_msg(c, &m, KVS_OP_RETRIEVE, job, keys, n_keys, blocks);
	if (r)
		return r;
	m.skip_tokens = skip_tokens;
	return submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

int kvs_complete_async(kvs_client *c, uint64_t job, bool ok, int timeout_ms, kvs_done_fn done,
		       void *arg)
{
	kvs_msg m = {.op = KVS_OP_COMPLETE, .session = atomic_load(&c->session), .job = job,
		     .status = ok ? KVS_STATUS_OK : KVS_STATUS_FAILED};
	return submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

int kvs_lookup_async(kvs_client *c, const uint8_t *keys, uint32_t n_keys, bool prefetch,
		     uint32_t pin_ms, int timeout_ms, kvs_done_fn done, void *arg)
{
	if (n_keys > KVS_MAX_KEYS)
		return KVS_E_LIMIT;
	kvs_msg m = {.op = KVS_OP_LOOKUP, .session = atomic_load(&c->session), .keys = keys,
		     .n_keys = n_keys, .prefetch = prefetch, .pin_ms = pin_ms};
	return submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

static int wait_async(kvs_client *c, int r, waiter *w)
{
	if (r)
		return r;
	pthread_mutex_lock(&w->mu);
	while (!w->done)
		pthread_cond_wait(&w->cv, &w->mu);
	pthread_mutex_unlock(&w->mu);
	return w->res.code;
}

#define BLOCKING(w)                                  \
	waiter w = {0};                              \
	if (on_io_thread(c))                         \
		return -EDEADLK;                     \
	pthread_mutex_init(&w.mu, NULL);             \
	pthread_cond_init(&w.cv, NULL)
#define BLOCKING_END(w)                  \
	pthread_cond_destroy(&w.cv);     \
	pthread_mutex_destroy(&w.mu)

int kvs_store(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
	      const kvs_blocks *blocks, const kvs_store_opts *opts, int timeout_ms, int *ret_state)
{
	BLOCKING(w);
	int r = wait_async(c, kvs_store_async(c, job, keys, n_keys, blocks, opts, timeout_ms,
					      waiter_done, &w), &w);
	if (!r && ret_state)
		*ret_state = w.res.state;
	BLOCKING_END(w);
	return r;
}

int kvs_retrieve(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
		 const kvs_blocks *blocks, uint64_t skip_tokens, int timeout_ms, int *ret_state)
{
	BLOCKING(w);
	int r = wait_async(c, kvs_retrieve_async(c, job, keys, n_keys, blocks, skip_tokens,
						 timeout_ms, waiter_done, &w), &w);
	if (!r && ret_state)
		*ret_state = w.res.state;
	BLOCKING_END(w);
	return r;
}

int kvs_complete(kvs_client *c, uint64_t job, bool ok, int timeout_ms, int *ret_state)
{
	BLOCKING(w);
	int r = wait_async(c, kvs_complete_async(c, job, ok, timeout_ms, waiter_done, &w), &w);
	if (!r && ret_state)
		*ret_state = w.res.state;
	BLOCKING_END(w);
	return r;
}

int kvs_lookup(kvs_client *c, const uint8_t *keys, uint32_t n_keys, bool prefetch,
	       uint32_t pin_ms, int timeout_ms, uint64_t *ret_hits, uint8_t *ret_tiers)
{
	BLOCKING(w);
	w.tiers_out = ret_tiers;
	w.tiers_cap = n_keys;
	int r = wait_async(c, kvs_lookup_async(c, keys, n_keys, prefetch, pin_ms, timeout_ms,
					       waiter_done, &w), &w);
	if (!r && ret_hits)
		*ret_hits = w.res.hits;
	BLOCKING_END(w);
	return r;
}

int kvs_job_status(kvs_client *c, const uint64_t *jobs, uint32_t n_jobs, int timeout_ms,
		   kvs_job_info_out *out, uint32_t cap, uint32_t *ret_n)
{
	if (n_jobs > KVS_MAX_JOBS_QUERY)
		return KVS_E_LIMIT;
	kvs_msg m = {.op = KVS_OP_JOB_STATUS, .session = atomic_load(&c->session), .jobs = jobs,
		     .n_jobs = n_jobs};
	waiter w = {.jobs_out = out, .cap = cap};
	int r = call(c, &m, timeout_ms, &w);
	if (!r && ret_n)
		*ret_n = w.n_out;
	return r;
}

int kvs_stats(kvs_client *c, int timeout_ms, kvs_stat_out *out, uint32_t cap, uint32_t *ret_n)
{
	kvs_msg m = {.op = KVS_OP_STATS, .session = atomic_load(&c->session)};
	waiter w = {.stats_out = out, .cap = cap};
	int r = call(c, &m, timeout_ms, &w);
	if (!r && ret_n)
		*ret_n = w.n_out;
	return r;
}

uint64_t kvs_stat_find(const kvs_stat_out *st, uint32_t n, const char *name)
{
	for (uint32_t i = 0; i < n; i++)
		if (strcmp(st[i].name, name) == 0)
			return st[i].value;
	return UINT64_MAX;
}

int kvs_admin(kvs_client *c, int cmd, uint32_t wait_ms, int timeout_ms, kvs_admin_info *ret)
{
	if (cmd < KVS_ADMIN_STATUS || cmd > KVS_ADMIN_CLEAR || wait_ms > 3600000)
		return -EINVAL;
	kvs_msg m = {.op = KVS_OP_ADMIN, .session = atomic_load(&c->session), .admin_cmd = (uint8_t)cmd,
		     .wait_ms = cmd == KVS_ADMIN_DRAIN ? wait_ms : 0};
	kvs_admin_info info = {0};
	waiter w = {.admin_out = &info};
	int r = call(c, &m, timeout_ms, &w);
	if (ret) {
		if (r) {
			const char *t = w.msg[0] ? w.msg : kvs_strerror(r);
			size_t n = strnlen(t, sizeof(info.msg) - 1);
			memcpy(info.msg, t, n);
			info.msg[n] = '\0';
		}
		*ret = info;
	}
	return r;
}

int kvs_job_wait(kvs_client *c, uint64_t job, int timeout_ms, int *ret_state)
{
	if (on_io_thread(c))
		return -EDEADLK;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)timeout_of(c, timeout_ms) * 1000000ull;
	ts.tv_sec += (time_t)(ns / 1000000000ull);
	ts.tv_nsec = (long)(ns % 1000000000ull);
	int r = KVS_E_TIMEOUT;
	pthread_mutex_lock(&c->mu);
	for (;;) {
		uint64_t lo = c->ring_n > JOB_RING ? c->ring_n - JOB_RING : 0;
		for (uint64_t i = c->ring_n; i > lo; i--)
			if (c->ring[(i - 1) % JOB_RING].job == job) {
				if (ret_state)
					*ret_state = c->ring[(i - 1) % JOB_RING].state;
				r = 0;
				break;
			}
		if (r == 0 || pthread_cond_timedwait(&c->job_cv, &c->mu, &ts) == ETIMEDOUT)
			break;
	}
	pthread_mutex_unlock(&c->mu);
	return r;
}

long kvs_keys_for_tokens(const char *ns, const uint32_t *tokens, size_t n_tokens,
			 uint32_t chunk_tokens, uint8_t *out, size_t max_keys)
{
	return kvs_chunk_keys(ns, strlen(ns), tokens, n_tokens, chunk_tokens, out, max_keys);
}

const char *kvs_state_name(int state) { return kvs_job_state_name(state); }
