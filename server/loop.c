/* The main loop: one thread owns the ROUTER socket, the broker sockets, the
 * eventfd, the timers and every protocol table. It never blocks on a copy, a
 * disk write or a peer: sockets are non-blocking and slow work runs on other
 * threads that report back through the eventfd. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "server"
#include "kvs_log.h"
#include "kvs_trace.h"
#include "kvs_time.h"
#include "kvs_dirlock.h"
#include "server.h"
#include "events.h"
#include "kvs_cq.h"
#include "kvs_workq.h"
#include "kvs_zfd.h"
#include "access.h"
#include "admin.h"
#include "auth.h"
#include "longwork.h"
#include "memroom.h"
#include "metrics.h"
#include "copy_host.h"
#include "copy_cuda.h"
#include "jobs.h"
#include "lane.h"
#include "kvs_l1.h"
#include "kvs_l2.h"
#include "kvs_l3.h"
#include "lookup.h"
#include "promote.h"
#include "registry.h"
#include "reply.h"
#include "session.h"
#include "stats.h"

void kvs_server_config_defaults(kvs_server_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	const char *xdg = getenv("XDG_RUNTIME_DIR");
	if (xdg && *xdg)
		snprintf(cfg->broker_dir, sizeof(cfg->broker_dir), "%s/kvside", xdg);
	else
		snprintf(cfg->broker_dir, sizeof(cfg->broker_dir), "/tmp/kvside-%u", (unsigned)getuid());
	cfg->l1_size = 1ull << 30;
	cfg->ttl_ms = 10000;
	cfg->heartbeat_ms = 1000;
	cfg->job_deadline_ms = 60000;
	cfg->fd_park_ms = 30000;
	cfg->drain_ms = 5000;
	cfg->terminal_jobs = 65536;
	cfg->copy_threads = 2;
	cfg->max_sessions = 4096;
	/* the CURVE key pair of tcp:// endpoints */
	const char *state = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
	if (geteuid() == 0)
		snprintf(cfg->state_dir, sizeof(cfg->state_dir), "/var/lib/kvside");
	else if (state && *state)
		snprintf(cfg->state_dir, sizeof(cfg->state_dir), "%s/kvside", state);
	else
		snprintf(cfg->state_dir, sizeof(cfg->state_dir), "%s/.local/state/kvside", home ? home : "/tmp");
	cfg->max_peer_queue = 8ull << 20;
	cfg->max_queued = 256ull << 20;
	cfg->log_level = KVS_LOG_INFO;
	cfg->allow_uid = -1;
	cfg->l2_size = 16ull << 30;
	cfg->l1_prefault = true;
	cfg->l2_sync = 0; /* KVS_L2_SYNC_FULL */
	cfg->l2_verify = true;
	snprintf(cfg->l3_prefix, sizeof(cfg->l3_prefix), "kvside:");
	cfg->l3_part_bytes = 8ull << 20;
	cfg->l3_timeout_ms = 200;
	cfg->l3_lookup_ms = 100;
	snprintf(cfg->metrics_listen, sizeof(cfg->metrics_listen), "127.0.0.1:9464");
	cfg->metrics_stall_ms = 2000;
	cfg->kv_events_buffer = 10000;
	cfg->kv_events_buffer_bytes = 64ull << 20;
	cfg->cuda_staging = 32ull << 20;
	cfg->cuda_stage_min = 512ull << 10;
	cfg->cuda_poll_us = 20000;
	cfg->copy_wave = 1ull << 20;
	cfg->copy_spin_us = KVS_COPY_SPIN_US;
}

/* ---- the CUDA engine, made off the start path ----------------------------- */

static void replay_held(kvs_server *srv, uint64_t id);
static void dispatch(kvs_server *srv, const uint8_t *ident, size_t ident_len, const void *buf, size_t len);
static void l1_ceiling(kvs_server *srv);

/* The engine's creation on the setup thread (issue 18): the driver's
 * initialisation and a context per device took 200-250 ms before the socket
 * was bound on the H200 machine, so restart -> first L2 hit waited for a GPU
 * it did not need. The setup queue is FIFO, so every register's driver work
 * queued later runs after it; registers that arrive before it is done wait
 * (dispatch_msg). */
typedef struct cuda_item {
	kvs_workq_item wi; /* first */
	kvs_server *srv;
	void *arena;
	uint64_t arena_size;
	kvs_cuda_opts opts;
	kvs_cuda_engine *e;
	uint64_t ns; /* how long making it took */
	char why[160];
} cuda_item;

static void cuda_make(kvs_workq_item *wi)
{
	cuda_item *c = (cuda_item *)wi;
	uint64_t t0 = kvs_now_ns();
	/* KVS_TEST_ENGINE_DELAY_MS: a stand-in for a slow driver start (the
	 * integration test regslow; no GPU needed) */
	const char *d = getenv("KVS_TEST_ENGINE_DELAY_MS");
	if (d)
		usleep((useconds_t)strtoul(d, NULL, 10) * 1000u);
	if (kvs_cuda_engine_create(c->srv->cq, c->arena, c->arena_size, &c->opts, &c->e, c->why, sizeof(c->why)) != 0)
		c->e = NULL;
	c->ns = kvs_now_ns() - t0;
}

/* The engine exists (or will not): publish it (the L1 prefault waits for
 * that), and let the registers that waited for it go, in their sessions'
 * order. */
static void cuda_ready(kvs_server *srv, kvs_cuda_engine *e)
{
	srv->cuda = e;
	atomic_store(&srv->cuda_settled, true); /* the prefault thread goes on */
	kvs_registry_set_cuda(srv->reg, e);
	srv->cuda_pending = false;
	if (srv->closing)
		return; /* modules_fini destroys it; nothing replays now */
	l1_ceiling(srv);
	uint64_t ids[64];
	for (;;) { /* replaying may open or close sessions: collect, then replay */
		uint32_t n = 0;
		size_t pos = 0;
		kvs_session *s;
		while (n < 64 && (s = kvs_htab_next(srv->sessions, &pos)) != NULL)
			if (s->engine_wait) {
				s->engine_wait = false;
				s->reg_pending = false;
				ids[n++] = s->id;
			}
		if (!n)
			break;
		for (uint32_t i = 0; i < n; i++)
			replay_held(srv, ids[i]);
	}
}

static void cuda_made(kvs_cq_item *it)
{
	cuda_item *c = (cuda_item *)it;
	kvs_server *srv = c->srv;
	if (c->e)
		kvs_info("CUDA engine ready after %.1f ms (off the start path)", (double)c->ns / 1e6);
	else
		kvs_info("CUDA engine: not available (%s); host engine only", c->why);
	cuda_ready(srv, c->e);
	free(c);
}

static int cuda_start(kvs_server *srv)
{
	cuda_item *c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	*c = (cuda_item){.wi = {.work = cuda_make, .cq.done = cuda_made}, .srv = srv,
			 .opts = {.stage_bytes = srv->cfg.cuda_staging, .stage_min = srv->cfg.cuda_stage_min,
				  .poll_us = srv->cfg.cuda_poll_us}};
	c->arena = kvs_l1_arena(srv->l1, &c->arena_size);
	srv->cuda_pending = true;
	kvs_workq_submit(srv->setupq, &c->wi);
	return 0;
}

/* ---- the data-path modules ---------------------------------------------- */

/* L1 made room by dropping a chunk: KV-event subscribers learn it. */
static void l1_evicted(const kvs_objkey *key, void *arg)
{
	kvs_server *srv = arg;
	kvs_events_removed(srv->events, key, KVS_TIER_EV_L1);
}

/* An L2 request ended, or L2 evicted an object (completion queue). */
static void l2_done(void *arg, const kvs_l2_done *d)
{
	kvs_server *srv = arg;
	if (d->op == KVS_L2_EVICTED) {
		kvs_events_removed(srv->events, &d->key, KVS_TIER_EV_L2);
	} else if (d->op == KVS_L2_WRITE) {
		if (d->result == 0)
			kvs_events_stored(srv->events, &d->key, 0, KVS_TIER_EV_L2);
		kvs_l1_unpin(srv->l1, d->cookie); /* written (or dropped): the write-behind pin */
	} else if (d->op == KVS_L2_READ) {
		kvs_promote_done(srv->promote, d->cookie, d->result);
	}
}

/* An L3 request ended (completion queue). */
static void l3_done(void *arg, const kvs_l3_done *d)
{
	kvs_server *srv = arg;
	if (d->op == KVS_L3_WRITE)
		kvs_l1_unpin(srv->l1, d->cookie); /* written (or dropped): the write-behind pin */
	else if (d->op == KVS_L3_READ)
		kvs_promote_done(srv->promote, d->cookie, d->result);
	else if (d->op == KVS_L3_PROBE)
		kvs_lookup_l3_done(srv, d->cookie, d->result);
}

static int l3_open(kvs_server *srv)
{
	kvs_l3_config c;
	kvs_l3_config_defaults(&c);
	c.backend = kvs_l3_redis_backend();
	c.seeds = srv->cfg.l3_redis;
	c.user = srv->cfg.l3_user;
	c.password = srv->cfg.l3_password;
	c.prefix = srv->cfg.l3_prefix;
	c.timeout_ms = (uint32_t)srv->cfg.l3_timeout_ms;
	c.part_bytes = srv->cfg.l3_part_bytes;
	c.write_policy = srv->cfg.l3_write;
	/* pending writes pin L1 objects, as L2's do: well below L1 */
	if (c.queue_max_bytes > srv->cfg.l1_size / 4)
		c.queue_max_bytes = srv->cfg.l1_size / 4;
	c.cq = srv->cq;
	c.on_done = l3_done;
	c.done_arg = srv;
	char err[256] = "";
	int r = kvs_l3_open(&c, &srv->l3, err, sizeof(err));
	if (r < 0)
		kvs_err("l3: %s", err);
	else
		kvs_info("L3 tier: Redis Cluster at %s, prefix \"%s\", write %s, parts of %llu KiB", c.seeds, c.prefix,
			 c.write_policy == KVS_L3_WRITE_ALL ? "all" : c.write_policy == KVS_L3_WRITE_NONE ? "none"
												  : "second-hit",
			 (unsigned long long)(c.part_bytes >> 10));
	return r;
}

static void modules_fini(kvs_server *srv);

/* An arena beyond the memory the server may use would only fail later,
 * page by page: an OOM kill within a second of "ready" under a cgroup
 * limit. Refused, or clamped with l1-size-clamp (memroom.h). */
static int l1_fits(kvs_server *srv)
{
	char where[1400];
	uint64_t room = kvs_memroom(where, sizeof(where));
	uint64_t need = srv->cfg.l1_size + KVS_SERVER_OWN_BYTES;
	if (room == UINT64_MAX || need <= room)
		return 0;
	uint64_t fit = room > KVS_SERVER_OWN_BYTES + (64ull << 20) ? (room - KVS_SERVER_OWN_BYTES) & ~((2ull << 20) - 1) : 0;
	if (!srv->cfg.l1_size_clamp || !fit) {
		kvs_err("l1-size %llu MiB and %llu MiB for the server itself are more than this server may use: "
			"%llu MiB (%s); choose an l1-size of at most %llu MiB, or set l1-size-clamp: true to take "
			"what there is", (unsigned long long)(srv->cfg.l1_size >> 20),
			(unsigned long long)(KVS_SERVER_OWN_BYTES >> 20), (unsigned long long)(room >> 20), where,
			(unsigned long long)(fit >> 20));
		return -ENOMEM;
	}
	kvs_warn("l1-size %llu MiB clamped to %llu MiB (l1-size-clamp): this server may use %llu MiB (%s), "
		 "%llu MiB of it kept for the server itself", (unsigned long long)(srv->cfg.l1_size >> 20),
		 (unsigned long long)(fit >> 20), (unsigned long long)(room >> 20), where,
		 (unsigned long long)(KVS_SERVER_OWN_BYTES >> 20));
	srv->cfg.l1_size = fit;
	return 0;
}

/* Creates the data-path modules in dependency order (L1, registry, CUDA
 * engine, host pool, L2, jobs); unwinds on failure. */
static int modules_init(kvs_server *srv)
{
	int r;
	if ((r = l1_fits(srv)) < 0)
		return r;
	/* withheld until the CUDA engine is known: with a GPU, L1's usable part
	 * follows the pinned prefix (l1_ceiling); without, it is released */
	kvs_l1_config l1c = {.size = srv->cfg.l1_size, .on_evict = l1_evicted, .evict_arg = srv, .withhold = 1};
	if ((r = kvs_l1_create(&l1c, &srv->l1)) < 0) {
		kvs_err("cannot create the L1 arena of %llu bytes: %s", (unsigned long long)l1c.size,
			kvs_strerror(r));
		return r;
	}
	if ((r = kvs_registry_create(&srv->reg)) < 0)
		goto fail;
	/* registers' driver work and CUDA teardown, off the loop (issue 18) */
	if ((r = kvs_workq_create(srv->cq, &srv->setupq)) < 0)
		goto fail;
	kvs_registry_set_setupq(srv->reg, srv->setupq);
	/* host unmaps and memfd closes, off the loop and off the setup thread
	 * (a session's teardown must not delay the next register) */
	if ((r = kvs_workq_create(srv->cq, &srv->reclaimq)) < 0)
		goto fail;
	kvs_registry_set_reclaimq(srv->reg, srv->reclaimq);
	srv->replay = replay_held;
	srv->dispatch = dispatch;
	if ((r = cuda_start(srv)) < 0)
		goto fail;
	if ((r = kvs_copy_pool_create(srv->cfg.copy_threads, srv->cfg.copy_spin_us, srv->cq, &srv->pool)) < 0)
		goto fail;
	if (srv->cfg.l2_path[0]) {
		kvs_l2_config l2c;
		kvs_l2_config_defaults(&l2c);
		l2c.path = srv->cfg.l2_path;
		l2c.size = srv->cfg.l2_size;
		l2c.sync = srv->cfg.l2_sync;
		l2c.verify = srv->cfg.l2_verify;
		/* pending writes pin their L1 objects: keep those pins well below
		 * L1 so write-behind can never crowd out stores (issue 16 #6) */
		if (l2c.queue_max_bytes > srv->cfg.l1_size / 4)
			l2c.queue_max_bytes = srv->cfg.l1_size / 4;
		if (l2c.batch_bytes > srv->cfg.l1_size / 8) /* a batch in writing cannot be shed */
			l2c.batch_bytes = srv->cfg.l1_size / 8 ? srv->cfg.l1_size / 8 : 1;
		l2c.cq = srv->cq;
		l2c.on_done = l2_done;
		l2c.done_arg = srv;
		l2c.report_evictions = srv->cfg.kv_events[0] != 0; /* for KV-event subscribers */
		if ((r = kvs_l2_open(&l2c, &srv->l2)) < 0)
			goto fail;
	}
	if (srv->cfg.l3_redis[0] && (r = l3_open(srv)) < 0)
		goto fail;
	if ((r = kvs_promote_create(srv->l1, srv->l2, srv->l3, &srv->promote)) < 0)
		goto fail;
	if ((r = kvs_lookup_create(&srv->lookup)) < 0)
		goto fail;
	if ((r = kvs_jobs_create(srv, &srv->jobs)) < 0)
		goto fail;
	kvs_info("host copy engine: %u threads", srv->cfg.copy_threads);
	return 0;
fail:
	modules_fini(srv); /* every destroy accepts what was never created */
	return r;
}

static void modules_fini(kvs_server *srv)
{
	srv->closing = true; /* an engine made from here on is only destroyed (cuda_ready) */
	kvs__prefault_stop(srv);
	kvs_cuda_engine_quiesce(srv->cuda); /* parts waiting for a producer event fail now */
	if (srv->jobs)
		kvs_jobs_destroy(srv, srv->jobs); /* waits for running copies and promotions */
	srv->jobs = NULL;
	/* registers still on the setup thread: let them finish, then their
	 * completions find their sessions gone and release what they made */
	kvs_workq_drain(srv->setupq);
	kvs_cq_run(srv->cq);
	kvs_lookup_destroy(srv, srv->lookup); /* unpins: before L1 goes */
	srv->lookup = NULL;
	kvs_promote_destroy(srv->promote);
	srv->promote = NULL;
	kvs_copy_pool_destroy(srv->pool);
	srv->pool = NULL;
	/* queued L2 and L3 writes still read L1 memory: close both before L1 goes */
	kvs_l3_close(srv->l3);
	srv->l3 = NULL;
	uint64_t flush0 = kvs__longwork_flushing(srv);
	kvs_l2_close(srv->l2);
	kvs__longwork_flushed(srv, flush0);
	srv->l2 = NULL;
	kvs_registry_destroy(srv->reg);
	srv->reg = NULL;
	kvs_workq_destroy(srv->setupq); /* runs the CUDA releases queued above */
	srv->setupq = NULL;
	kvs_workq_destroy(srv->reclaimq); /* and the host ones */
	srv->reclaimq = NULL;
	kvs_cuda_engine_destroy(srv->cuda); /* unpins L1: after every import is gone */
	srv->cuda = NULL;
	kvs_l1_destroy(srv->l1);
	srv->l1 = NULL;
}

/* allow-uid: the second user reaches the run directory (x) and both
 * sockets (rw) through ACL entries; the mode bits stay owner-only. */
static int grant_allowed_uid(kvs_server *srv)
{
	uid_t uid = (uid_t)srv->cfg.allow_uid;
	const char *zmq_path = strncmp(srv->endpoint, "ipc://", 6) == 0 ? srv->endpoint + 6 : NULL;
	int r = kvs_access_grant(srv->cfg.broker_dir, uid, 1);
	if (r == 0)
		r = kvs_access_grant(srv->broker_path, uid, 6);
	if (r == 0 && zmq_path)
		r = kvs_access_grant(zmq_path, uid, 6);
	if (r < 0) {
		kvs_err("allow-uid %ld: cannot grant access to %s and its sockets: %s%s", srv->cfg.allow_uid,
			srv->cfg.broker_dir, strerror(-r),
			r == -EOPNOTSUPP ? " (the filesystem has no POSIX ACLs: put broker-dir on one that has)" : "");
		return r;
	}
	kvs_info("allow-uid %ld: may use the broker and the ipc endpoint (not admin commands)", srv->cfg.allow_uid);
	return 0;
}

/* ---- request dispatch --------------------------------------------------- */

static const kvs_op_fn handlers[KVS_OP_COUNT_] = {
	[KVS_OP_HEARTBEAT] = kvs__op_heartbeat,
	[KVS_OP_BYE] = kvs__op_bye,
	[KVS_OP_STATS] = kvs__op_stats,
	[KVS_OP_REGISTER] = kvs__op_register,
	[KVS_OP_UNREGISTER] = kvs__op_unregister,
	[KVS_OP_LOOKUP] = kvs__op_lookup,
	[KVS_OP_STORE] = kvs__op_store,
	[KVS_OP_RETRIEVE] = kvs__op_retrieve,
	[KVS_OP_COMPLETE] = kvs__op_complete,
	[KVS_OP_JOB_STATUS] = kvs__op_job_status,
	[KVS_OP_ADMIN] = kvs__op_admin,
	[KVS_OP_LANE] = kvs__op_lane,
};

/* replay: a request held behind its session's pending register, counted
 * when it arrived */
static void dispatch_msg(kvs_server *srv, const uint8_t *ident, size_t ident_len, const void *buf, size_t len,
			 bool replay)
{
	kvs_msg rq;
	kvs_proto_err perr;
	srv->st.requests += !replay;
	int r = kvs_proto_decode(buf, len, false, &rq, &perr);
	srv->st.requests_by_op[r ? perr.op : rq.op] += !replay;
	if (r) {
		kvs__reply_err(srv, ident, ident_len, perr.op, perr.id, r, "%s", perr.msg);
		return;
	}
	srv->errbuf[0] = '\0';
	if (srv->peer == KVS_PEER_REVOKED && !replay) {
		r = kvs__fail(srv, KVS_E_AUTH, "this connection's CURVE key was removed from authorized-keys");
	} else if (rq.op == KVS_OP_HELLO) {
		r = kvs__op_hello(srv, ident, ident_len, &rq);
	} else {
		kvs_session *s = NULL;
		/* a request without a session (stats) still needs its reply target:
		 * a transient session (id 0, in no table) carries the routing id */
		kvs_session anon = {.id = 0};
		bool need_session = rq.op != KVS_OP_STATS || kvs_msg_has(&rq, "session");
		if (!need_session && ident_len <= KVS_MAX_IDENT) {
			memcpy(anon.ident, ident, ident_len);
			anon.ident_len = ident_len;
			s = &anon;
		}
		if (need_session) {
			s = kvs__session_get(srv, rq.session);
			if (!s) {
				r = kvs__fail(srv, KVS_E_SESSION, "unknown or expired session %llu",
					      (unsigned long long)rq.session);
				goto out;
			}
			/* any request renews the lease and re-targets pushes */
			s->expires_ms = srv->now_ms + srv->cfg.ttl_ms;
			if (ident_len <= KVS_MAX_IDENT) {
				memcpy(s->ident, ident, ident_len);
				s->ident_len = ident_len;
			}
		}
		if (s->id && srv->cuda_pending && rq.op == KVS_OP_REGISTER && rq.device.type == KVS_DEV_CUDA &&
		    !s->reg_pending) {
			/* the engine is being made (cuda_start): this register and
			 * what follows it wait for it, like the requests behind a
			 * pending register */
			s->reg_pending = true;
			s->engine_wait = true;
		}
		if (s->id && s->reg_pending && rq.op != KVS_OP_HEARTBEAT) {
			/* behind the session's register: handled once it is answered */
			r = kvs__session_hold(srv, s, ident, ident_len, buf, len);
			goto out;
		}
		KVS_TRACE(KVS_TP_SRV_DISPATCH, rq.op);
		if (!handlers[rq.op])
			r = kvs__fail(srv, KVS_E_UNKNOWN_OP, "op '%s' is not served", kvs_op_name(rq.op));
		else if ((r = kvs__admin_gate(srv, s, &rq)) == 0) /* draining: no new jobs */
			r = handlers[rq.op](srv, s, &rq);
	}
out:
	if (r)
		kvs__reply_err(srv, ident, ident_len, rq.op, rq.id, r, "%s",
			       srv->errbuf[0] ? srv->errbuf : kvs_strerror(r));
	kvs_msg_clear(&rq);
}

static void dispatch(kvs_server *srv, const uint8_t *ident, size_t ident_len, const void *buf, size_t len)
{
	dispatch_msg(srv, ident, ident_len, buf, len, false);
}

/* Handles the requests held behind a session's register, in order, until
 * one of them is a register that is pending again or the session ends. */
static void replay_held(kvs_server *srv, uint64_t id)
{
	kvs_session *s;
	/* looked up again each time: a held bye closes the session */
	while ((s = kvs__session_get(srv, id)) != NULL && !s->reg_pending && s->held_head) {
		kvs_held *h = s->held_head;
		s->held_head = h->next;
		if (!s->held_head)
			s->held_tail = NULL;
		s->n_held--;
		s->held_bytes -= h->len;
		dispatch_msg(srv, h->ident, h->ident_len, h->buf, h->len, true);
		free(h);
	}
}

/* Reads every pending message from the ROUTER socket without blocking. */
static void router_ready(kvs_server *srv)
{
	for (int budget = 0; budget < 256; budget++) {
		zmq_msg_t ident, body, extra;
		zmq_msg_init(&ident);
		if (zmq_msg_recv(&ident, srv->router, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&ident);
			return;
		}
		zmq_msg_init(&body);
		int nframes = 1;
		if (zmq_msg_more(&ident)) {
			zmq_msg_recv(&body, srv->router, 0);
			nframes++;
			int more = zmq_msg_more(&body);
			while (more) {
				zmq_msg_init(&extra);
				zmq_msg_recv(&extra, srv->router, 0);
				more = zmq_msg_more(&extra);
				zmq_msg_close(&extra);
				nframes++;
			}
		}
		const uint8_t *id = zmq_msg_data(&ident);
		size_t idlen = zmq_msg_size(&ident);
		if (kvs__in_lane_space(id, idlen)) {
			/* a peer that chose a routing id in the lanes' reserved
			 * space (lane.c): its replies would go into a lane, so it
			 * gets none; dropped, counted, logged */
			if (srv->st.lane_spoofs++ == 0 || (srv->st.lane_spoofs & 1023) == 0)
				kvs_warn("a ZeroMQ peer uses a routing id reserved for job lanes (0x00 'L' 'N' ...): "
					 "its messages are dropped (%llu so far)", (unsigned long long)srv->st.lane_spoofs);
		} else if (nframes != 2) {
			/* still name the request in the reply, if its first frame says */
			kvs_msg tmp;
			kvs_proto_err perr;
			uint64_t rid = 0;
			kvs_op rop = KVS_OP_NONE;
			if (nframes > 2) {
				if (kvs_proto_decode(zmq_msg_data(&body), zmq_msg_size(&body), false, &tmp, &perr) == 0) {
					rid = tmp.id, rop = tmp.op;
					kvs_msg_clear(&tmp);
				} else {
					rid = perr.id, rop = perr.op;
				}
			}
			kvs__reply_err(srv, id, idlen, rop, rid, KVS_E_BADMSG,
				       "expected exactly one frame per message, got %d", nframes - 1);
		}
		else {
			srv->peer = kvs_auth_peer(srv->auth, &body, srv->peer_key); /* who asks (admin gate) */
			dispatch(srv, id, idlen, zmq_msg_data(&body), zmq_msg_size(&body));
		}
		zmq_msg_close(&body);
		zmq_msg_close(&ident);
	}
}

/* ---- setup -------------------------------------------------------------- */

int kvs_server_create(const kvs_server_config *cfg, kvs_server **ret)
{
	int r;
	kvs_server *srv = calloc(1, sizeof(*srv));
	if (!srv)
		return -ENOMEM;
	srv->cfg = *cfg;
	srv->broker_fd = -1;
	srv->dir_lock = -1;
	srv->spare_fd = -1;
	if (sodium_init() < 0) {
		r = -EIO;
		goto err_free;
	}
	randombytes_buf(srv->epoch, sizeof(srv->epoch));
	srv->now_ms = kvs_now_ms();
	srv->start_ms = srv->now_ms;
	struct timespec wall;
	clock_gettime(CLOCK_REALTIME, &wall);
	srv->start_unix_ms = (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000;
	if ((r = kvs_htab_create(sizeof(uint64_t), offsetof(kvs_session, id), &srv->sessions)) < 0)
		goto err_free;
	if ((r = kvs_htab_create(16, offsetof(kvs_parked, token), &srv->parked)) < 0)
		goto err_sessions;
	if ((r = kvs__routes_create(srv)) < 0)
		goto err_parked;
	if ((r = kvs__peers_create(srv)) < 0 || (r = kvs__lanes_create(srv)) < 0) {
		kvs__peers_destroy(srv);
		kvs__routes_destroy(srv);
		goto err_parked;
	}
	if ((r = kvs_cq_create(&srv->cq)) < 0)
		goto err_routes;
	if ((r = kvs__broker_open(srv)) < 0)
		goto err_efd;
	if ((r = modules_init(srv)) < 0)
		goto err_broker;

	srv->zctx = zmq_ctx_new();
	if (!srv->zctx) {
		r = -errno;
		goto err_ops;
	}
	srv->router = zmq_socket(srv->zctx, ZMQ_ROUTER);
	if (!srv->router) {
		r = -errno;
		goto err_ctx;
	}
	int zero = 0, hwm = 100000;
	zmq_setsockopt(srv->router, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(srv->router, ZMQ_SNDHWM, &hwm, sizeof(hwm));
	zmq_setsockopt(srv->router, ZMQ_RCVHWM, &hwm, sizeof(hwm));
	int64_t maxmsg = KVS_MAX_MSG_BYTES + 4096; /* bigger ones are dropped by ZeroMQ itself */
	zmq_setsockopt(srv->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	if ((r = kvs_auth_create(srv->zctx, cfg, &srv->auth)) < 0)
		goto err_router;
	/* the ipc endpoint always (local engines, operators); a tcp:// listen
	 * in addition, with CURVE unless insecure-tcp */
	bool tcp = strncmp(cfg->listen, "tcp://", 6) == 0;
	if (cfg->listen[0] && !tcp)
		snprintf(srv->endpoint, sizeof(srv->endpoint), "%s", cfg->listen);
	else
		snprintf(srv->endpoint, sizeof(srv->endpoint), "ipc://%s/kvside.zmq", cfg->broker_dir);
	if ((r = kvs_auth_bind(srv->auth, srv->router, srv->endpoint)) < 0 ||
	    (tcp && (r = kvs_auth_bind(srv->auth, srv->router, cfg->listen)) < 0))
		goto err_router;
	if (strncmp(srv->endpoint, "ipc://", 6) == 0)
		chmod(srv->endpoint + 6, 0600);
	if (cfg->allow_uid >= 0 && (r = grant_allowed_uid(srv)) < 0)
		goto err_router;
	kvs_info("listening on %s%s%s, broker %s, ttl %llu ms, L1 %llu MiB", srv->endpoint, tcp ? " and " : "",
		 tcp ? cfg->listen : "", srv->broker_path, (unsigned long long)cfg->ttl_ms,
		 (unsigned long long)(srv->cfg.l1_size >> 20));
	if (cfg->kv_events[0]) {
		char why[300];
		if ((r = kvs_events_open(srv->zctx, cfg->kv_events, cfg->kv_events_replay, cfg->kv_events_topic,
					 cfg->kv_events_buffer, cfg->kv_events_buffer_bytes, cfg->l2_path[0] != 0, &srv->events, why,
					 sizeof(why))) < 0) {
			kvs_err("%s", why);
			goto err_router;
		}
		kvs_info("KV events on %s%s%s", cfg->kv_events, cfg->kv_events_replay[0] ? ", replay on " : "",
			 cfg->kv_events_replay);
	}
	kvs__metrics_init(srv); /* never fails start-up: see metrics.h */
	/* the L1 prefault starts once the sockets are bound: populating the
	 * arena holds the mmap lock that every thread and socket created during
	 * start-up needs (issue 18: 150-230 ms before listening on the H200);
	 * it waits for the CUDA engine's start too (prefault_main) */
	kvs__prefault_start(srv);
	*ret = srv;
	return 0;

err_router:
	kvs_auth_destroy(srv->auth);
	srv->auth = NULL;
	zmq_close(srv->router);
err_ctx:
	zmq_ctx_term(srv->zctx);
err_ops:
	modules_fini(srv);
err_broker:
	kvs__broker_close(srv);
err_efd:
	kvs_cq_destroy(srv->cq);
err_routes:
	kvs__lanes_destroy(srv);
	kvs__peers_destroy(srv);
	kvs__routes_destroy(srv);
err_parked:
	kvs_htab_destroy(srv->parked);
err_sessions:
	kvs_htab_destroy(srv->sessions);
err_free:
	kvs_dirlock_drop(srv->dir_lock);
	free(srv);
	return r;
}

void kvs_server_destroy(kvs_server *srv)
{
	if (!srv)
		return;
	kvs__metrics_fini(srv);
	kvs__admin_fini(srv);
	/* close every session: fails open parts, releases registrations */
	size_t pos = 0;
	kvs_session *s;
	while ((s = kvs_htab_next(srv->sessions, &pos)) != NULL) {
		kvs__session_close(srv, s, "server shutdown");
		pos = 0;
	}
	modules_fini(srv);
	kvs__broker_close(srv);
	if (srv->router) {
		if (strncmp(srv->endpoint, "ipc://", 6) == 0)
			unlink(srv->endpoint + 6);
		zmq_close(srv->router);
	}
	kvs_events_close(srv->events);
	kvs_auth_destroy(srv->auth);
	if (srv->zctx)
		zmq_ctx_term(srv->zctx);
	kvs_cq_destroy(srv->cq);
	kvs__lanes_destroy(srv);
	kvs__peers_destroy(srv); /* the context is gone: ZeroMQ released every message */
	kvs__routes_destroy(srv);
	kvs_htab_destroy(srv->parked);
	kvs_htab_destroy(srv->sessions);
	kvs_dirlock_drop(srv->dir_lock); /* last: every socket in the directory is gone */
	free(srv);
}

/* L1's usable part follows the pinned prefix while the GPU engine pins it
 * (kvs_l1_set_ceiling, issue 18): stores land in pinned memory and evict
 * rather than wait for pinning; without a GPU nothing is withheld. */
static void l1_ceiling(kvs_server *srv)
{
	if (!kvs_l1_withheld(srv->l1) || srv->cuda_pending)
		return;
	bool all = true;
	uint64_t p = srv->cuda ? kvs_cuda_pinned_prefix(srv->cuda, &all) : 0;
	if (all)
		kvs_l1_release(srv->l1);
	else
		kvs_l1_set_ceiling(srv->l1, p);
}

/* authorized-keys changed: the sessions opened with a key no longer in it
 * end (their requests are refused from now on anyway: dispatch_msg) */
static void close_revoked(kvs_server *srv)
{
	if (!kvs_auth_tick(srv->auth, srv->now_ms))
		return;
	size_t pos = 0;
	kvs_session *s;
	while ((s = kvs_htab_next(srv->sessions, &pos)) != NULL) {
		if (!s->keyed || kvs_auth_key_ok(srv->auth, s->key))
			continue;
		kvs_warn("session %016llx: its CURVE key was removed from authorized-keys: closed",
			 (unsigned long long)s->id);
		kvs__session_close(srv, s, "key removed from authorized-keys");
		pos = 0; /* the table changed */
	}
}

void kvs__server_tick(kvs_server *srv)
{
	l1_ceiling(srv);
	close_revoked(srv);
	kvs__sessions_reap(srv);
	kvs__broker_expire(srv);
	kvs_jobs_tick(srv);
	kvs_lookup_tick(srv);
	kvs_registry_tick(srv);
	kvs__peers_tick(srv);
	kvs__lanes_tick(srv);
	kvs__admin_tick(srv);
	kvs__longwork_tick(srv); /* start, progress and end lines of long work */
	kvs__metrics_tick(srv); /* publish counters + sign of life for /healthz */
	kvs_events_flush(srv->events); /* one KV-event batch per tick */
}

/* The loop's busy clock: its own CPU time, so time spent descheduled does
 * not count (two system calls per busy iteration; architecture.md, table of
 * decisions, on why not the monotonic clock). */
static uint64_t thread_cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kvs__server_completions(kvs_server *srv) { kvs_cq_run(srv->cq); }

/* Peers that stopped reading (reply.c cut them off): their sessions end,
 * which fails their open parts and frees what they held (protocol §1). */
static void close_overflowed(kvs_server *srv)
{
	uint8_t ident[KVS_MAX_IDENT];
	size_t len;
	uint64_t queued;
	while (kvs__peers_overflowed(srv, ident, &len, &queued)) {
		size_t pos = 0;
		kvs_session *s;
		char why[96];
		snprintf(why, sizeof(why), "peer not reading: %llu bytes of replies waiting", (unsigned long long)queued);
		kvs_warn("a peer stopped reading its replies (%llu bytes waiting, max-peer-queue %llu): its "
			 "sessions are closed", (unsigned long long)queued, (unsigned long long)srv->cfg.max_peer_queue);
		while ((s = kvs_htab_next(srv->sessions, &pos)) != NULL) {
			const void *sid = s->ident;
			size_t slen = s->ident_len;
			kvs__zmq_ident(&sid, &slen); /* a session that talks over its lane */
			if (slen != len || memcmp(sid, ident, len) != 0)
				continue;
			kvs__session_close(srv, s, why);
			pos = 0; /* the table changed */
		}
	}
}

/* A ZeroMQ socket in the loop's poll set, watched through its ZMQ_FD
 * (kvs_zfd.h): zmq_poll costs a getpid and a poll of its own per ZeroMQ
 * socket on every pass, where the loop's one poll of plain fds needs
 * nothing more. */
typedef struct zwatch {
	void *sock; /* NULL: not watched */
	int fd;
	int at;     /* its entry in this pass's poll set, or -1 */
	bool check; /* ask ZMQ_EVENTS before the next poll (the loop used the socket) */
	bool ready; /* a message waits */
} zwatch;

/* A ready socket is handled now: true once, and its state is asked again
 * before the next poll (the handler may leave messages, at its budget). */
static bool ztake(zwatch *w)
{
	if (!w->ready)
		return false;
	w->ready = false;
	w->check = true;
	return true;
}

int kvs_server_run(kvs_server *srv, int sigfd)
{
	uint64_t next_tick = 0;
	bool replay_more = false; /* a replay can take more batches now (events.h) */
	struct pollfd *fds = NULL;
	int fds_cap = 0;
	enum { Z_ROUTER, Z_ZAP, Z_REPLAY, NZ };
	zwatch z[NZ];
	void *zs[NZ] = {srv->router, kvs_auth_zap_socket(srv->auth), kvs_events_replay_socket(srv->events)};
	for (int i = 0; i < NZ; i++)
		z[i] = (zwatch){.sock = zs[i], .fd = kvs_zmq_fd(zs[i]), .at = -1, .check = true};
	if (z[Z_ROUTER].fd < 0) { /* the loop could not hear new requests */
		kvs_err("libzmq gave no ZMQ_FD for the ROUTER socket: %s", zmq_strerror(errno));
		return -EIO;
	}
	/* poll entries 0..3: the broker socket, the completion queue, the
	 * signals and the router; then the ZAP and replay sockets (if any),
	 * the broker connections and the lanes */
	while (!srv->stopping) {
		/* a GPU copy queued moments ago is in flight: the loop polls its
		 * end (and the sockets) rather than sleeping until its host
		 * function posts (kvs_cuda_poll); polls that find nothing are not
		 * counted as busy. Before the poll set is made: the replies of
		 * the parts it completes leave now (a lane whose write is cut
		 * short then polls for POLLOUT), not after the poll's sleep */
		bool cuda_spin = false;
		if (srv->cuda) {
			uint32_t polled = 0;
			uint64_t pt0 = kvs_now_ns();
			srv->now_ms = pt0 / 1000000u; /* the completions' clock */
			cuda_spin = kvs_cuda_poll(srv->cuda, &polled);
			if (polled) {
				kvs__lanes_flush(srv);
				srv->busy_ns += kvs_now_ns() - pt0;
			}
		}
		/* every reply made so far has left (or waits for POLLOUT) */
		kvs__lanes_before_poll(srv);
		int want = 6 + KVS_MAX_BROKER_CONNS + kvs__lanes_count(srv);
		if (want > fds_cap) {
			struct pollfd *nf = realloc(fds, (size_t)want * sizeof(*nf));
			if (!nf) {
				free(fds);
				return -ENOMEM;
			}
			fds = nf;
			fds_cap = want;
		}
		int n = 0;
		fds[n++] = (struct pollfd){.fd = srv->broker_fd, .events = POLLIN};
		fds[n++] = (struct pollfd){.fd = kvs_cq_fd(srv->cq), .events = POLLIN};
		fds[n++] = (struct pollfd){.fd = sigfd, .events = POLLIN};
		for (int i = 0; i < NZ; i++)
			if ((z[i].at = z[i].fd >= 0 ? n : -1) >= 0)
				fds[n++] = (struct pollfd){.fd = z[i].fd, .events = POLLIN};
		int nfix = n;
		for (int i = 0; i < srv->n_conns; i++)
			fds[n++] = (struct pollfd){.fd = srv->conns[i].fd, .events = POLLIN};
		int nconn = n;
		n += kvs__lanes_items(srv, fds + n, fds_cap - n);
		srv->now_ms = kvs_now_ms();
		long timeout = next_tick > srv->now_ms ? (long)(next_tick - srv->now_ms) : 0;
		/* a ZeroMQ socket the loop used may hold messages its fd no longer
		 * signals: replies sent on the router (reply.c; by the last
		 * iteration or by the parts kvs_cuda_poll completed), a handler's
		 * receive */
		if (srv->router_used) {
			srv->router_used = false;
			z[Z_ROUTER].check = true;
		}
		for (int i = 0; i < NZ; i++)
			if (z[i].sock && z[i].check) {
				z[i].check = false;
				if ((z[i].ready = kvs_zmq_readable(z[i].sock)))
					timeout = 0;
			}
		if (cuda_spin || replay_more)
			timeout = 0;
		int pr = poll(fds, (nfds_t)n, (int)timeout);
		if (pr < 0 && errno != EINTR) {
			int e = errno;
			kvs_err("poll failed: %s", strerror(e));
			free(fds);
			return -e;
		}
		if (pr < 0)
			pr = 0;
		for (int i = 0; i < NZ; i++) /* a ZMQ_FD's only signal is POLLIN */
			if (z[i].at >= 0 && !z[i].ready && (fds[z[i].at].revents & (POLLIN | POLLERR | POLLHUP | POLLNVAL)))
				z[i].ready = kvs_zmq_readable(z[i].sock);
		bool zready = z[Z_ROUTER].ready || z[Z_ZAP].ready || z[Z_REPLAY].ready;
		if (pr > 0 || zready)
			KVS_TRACE(KVS_TP_SRV_WAKE, pr);
		srv->now_ms = kvs_now_ms();
		/* an empty poll of a spinning loop is not work */
		bool idle = pr == 0 && !zready && srv->now_ms < next_tick;
		uint64_t busy0 = idle ? 0 : thread_cpu_ns();
		if (pr > 0 || zready) {
			if (fds[2].revents & POLLIN) {
				struct signalfd_siginfo si;
				if (read(sigfd, &si, sizeof(si)) == sizeof(si)) {
					kvs_info("signal %u: shutting down", si.ssi_signo);
					srv->stopping = true;
				}
			}
			if (fds[1].revents & POLLIN) {
				kvs__server_completions(srv);
			}
			if (ztake(&z[Z_ROUTER]))
				router_ready(srv);
			kvs__lanes_ready(srv, fds + nconn, n - nconn);
			close_overflowed(srv);
			/* broker connections, newest first so removal keeps indices */
			for (int i = nconn - 1; i >= nfix; i--)
				if (fds[i].revents & (POLLIN | POLLERR | POLLHUP | POLLNVAL))
					kvs__broker_conn_ready(srv, i - nfix);
			if (fds[0].revents & POLLIN)
				kvs__broker_accept(srv);
			if (ztake(&z[Z_ZAP]))
				kvs_auth_zap_ready(srv->auth);
		}
		/* replays: requests taken when the socket is ready, batches sent a
		 * pass's worth at a time while a peer takes them, and at the tick
		 * for peers whose queue was full (events.h) */
		bool rready = ztake(&z[Z_REPLAY]);
		bool tick = srv->now_ms >= next_tick;
		if (rready || replay_more || (tick && kvs_events_replaying(srv->events))) {
			replay_more = kvs_events_replay(srv->events, srv->now_ms, rready);
			z[Z_REPLAY].check = true;
		}
		if (tick) {
			kvs__server_tick(srv);
			next_tick = srv->now_ms + KVS_TICK_MS;
		}
		/* this iteration's replies to each lane, in one write per lane */
		kvs__lanes_flush(srv);
		if (!idle)
			srv->busy_ns += thread_cpu_ns() - busy0;
	}
	free(fds);
	return 0;
}
