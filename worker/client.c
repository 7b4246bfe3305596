/* libkvside's public API (kvside.h): opening and closing a client, building
 * requests for the I/O thread (client_io.c) and the blocking helpers that
 * wait for their completion. Registrations are in client_reg.c. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "libkvside"
#include "client_int.h"
#include "kvs_chunkkey.h"
#include "kvs_log.h"
#include "kvs_trace.h"
#include "kvs_time.h"
#include "kvs_zfd.h"

/* ---- blocking helpers ------------------------------------------------------ */

void kvs__waiter_done(const kvs_result *res, void *arg)
{
	kvs__waiter *w = arg;
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
	/* a failed request has no arrays (NULL, count 0): memcpy must not see NULL */
	if (w->jobs_out) {
		w->n_out = res->n_jobs < w->cap ? res->n_jobs : w->cap;
		if (w->n_out)
			memcpy(w->jobs_out, res->jobs, w->n_out * sizeof(*w->jobs_out));
	}
	if (w->stats_out) {
		w->n_out = res->n_stats < w->cap ? res->n_stats : w->cap;
		if (w->n_out)
			memcpy(w->stats_out, res->stats, w->n_out * sizeof(*w->stats_out));
	}
	w->done = true;
	pthread_cond_signal(&w->cv);
	pthread_mutex_unlock(&w->mu);
}

bool kvs__forked(kvs_client *c)
{
	if (getpid() == c->pid)
		return false;
	static atomic_bool said;
	if (!atomic_exchange(&said, true))
		kvs_err("this kvside client was opened by process %d and cannot be used in its forked child %d: "
			"open a new client in the child (calls fail with E_SESSION)", (int)c->pid, (int)getpid());
	return true;
}

bool kvs__on_io_thread(kvs_client *c)
{
	return c->thr_started && pthread_equal(pthread_self(), c->thr);
}

int kvs__call_req(kvs_client *c, kvs__req *r, kvs__waiter *w)
{
	if (kvs__on_io_thread(c)) {
		kvs__req_free(r);
		return -EDEADLK;
	}
	pthread_mutex_init(&w->mu, NULL);
	pthread_cond_init(&w->cv, NULL);
	r->done = kvs__waiter_done;
	r->arg = w;
	int e = kvs__req_submit(c, r);
	if (e == 0) {
		pthread_mutex_lock(&w->mu);
		while (!w->done)
			pthread_cond_wait(&w->cv, &w->mu);
		pthread_mutex_unlock(&w->mu);
		e = w->res.code;
	}
	kvs__last_error_set("%s", e && e == w->res.code ? w->msg : ""); /* the server's text (kvs_last_error) */
	pthread_cond_destroy(&w->cv);
	pthread_mutex_destroy(&w->mu);
	return e;
}

int kvs__call(kvs_client *c, kvs_msg *m, int timeout_ms, kvs__waiter *w)
{
	if (kvs__on_io_thread(c))
		return -EDEADLK;
	kvs__req *r;
	int e = kvs__req_new(c, m, timeout_ms, &r);
	if (e)
		kvs__last_error_set("%s", "");
	return e ? e : kvs__call_req(c, r, w);
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

/* CURVE keys for a tcp:// server (all three or none). 0 or -EINVAL. */
static int set_curve(void *dealer, const kvs_client_config *cfg)
{
	const char *k[3] = {cfg->curve_server_key, cfg->curve_public_key, cfg->curve_secret_key};
	if (!k[0] && !k[1] && !k[2])
		return 0;
	for (int i = 0; i < 3; i++)
		if (!k[i] || strlen(k[i]) != 40) {
			kvs_err("CURVE keys: the server key and this client's public and secret keys, 40 Z85 characters each");
			kvs__last_error_set("CURVE keys: the server key and this client's public and secret keys, 40 Z85 "
					    "characters each (key %d is not)", i);
			return -EINVAL;
		}
	if (zmq_setsockopt(dealer, ZMQ_CURVE_SERVERKEY, k[0], 40) != 0 ||
	    zmq_setsockopt(dealer, ZMQ_CURVE_PUBLICKEY, k[1], 40) != 0 ||
	    zmq_setsockopt(dealer, ZMQ_CURVE_SECRETKEY, k[2], 40) != 0) {
		kvs_err("CURVE keys refused by libzmq: %s", zmq_strerror(errno));
		kvs__last_error_set("CURVE keys refused by libzmq: %s", zmq_strerror(errno));
		return -EINVAL;
	}
	return 0;
}

/* An ipc:// endpoint's checks (kvs__reach_ipc), again every 20 ms for up
 * to 3 s (or timeout_ms) while a server may be starting; the cause is
 * logged and kept for kvs_last_error(). */
static int reach_wait(const char *endpoint, int timeout_ms)
{
	uint64_t grace = timeout_ms > 0 && timeout_ms < 3000 ? (uint64_t)timeout_ms : 3000, t0 = kvs_now_ms();
	char why[1400];
	int r;
	while ((r = kvs__reach_ipc(endpoint, why, sizeof(why))) < 0 && kvs_now_ms() - t0 < grace)
		usleep(20000);
	if (r < 0) {
		kvs_err("open: %s", why);
		kvs__last_error_set("%s", why);
	}
	return r;
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
	c->pid = getpid();
	int r;
	if (cfg->broker_dir)
		snprintf(c->broker_dir, sizeof(c->broker_dir), "%s", cfg->broker_dir);
	else
		default_broker_dir(c->broker_dir, sizeof(c->broker_dir));
	if (cfg->endpoint)
		snprintf(c->endpoint, sizeof(c->endpoint), "%s", cfg->endpoint);
	else
		snprintf(c->endpoint, sizeof(c->endpoint), "ipc://%s/kvside.zmq", c->broker_dir);
	kvs__last_error_set("%s", "");
	if ((r = reach_wait(c->endpoint, cfg->timeout_ms)) < 0) {
		free(c);
		return r;
	}
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
	kvs__broker_init(&c->broker);
	const char *lane = getenv("KVS_LANE");
	kvs__lane_init(c, strncmp(c->endpoint, "ipc://", 6) == 0 && !(lane && strcmp(lane, "0") == 0));
	pthread_mutex_init(&c->mu, NULL);
	pthread_mutex_init(&c->reg_mu, NULL);
	pthread_cond_init(&c->job_cv, NULL);
	const char *bp = getenv("KVS_BUSY_POLL_US");
	c->busy_poll_ns = bp ? strtoull(bp, NULL, 10) * 1000ull : 0;
	const char *hp = getenv("KVS_HYBRID_POLL");
	c->hybrid_poll = !(hp && strcmp(hp, "0") == 0);
	c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (c->efd < 0) {
		r = -errno;
		goto err_free;
	}
	if ((r = kvs_htab_create(sizeof(uint64_t), offsetof(kvs__req, id), &c->pending)) < 0)
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
	/* A server that restarts is back within ~100 ms (L2 opens without a
	 * scan): retry the connection every 10 ms, backing off to 100 ms. The
	 * former 100 ms / 1 s backoff put up to a second between the server
	 * listening and a client's hello (issue 18: restart to first L2 hit
	 * measured 135-195 ms here with the server listening at 25-90 ms;
	 * 412-856 ms on a GPU machine). A failed connect to a local socket
	 * costs a system call. */
	int zero = 0, ivl = 10, ivlmax = 100;
	zmq_setsockopt(c->dealer, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(c->dealer, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
	zmq_setsockopt(c->dealer, ZMQ_RECONNECT_IVL_MAX, &ivlmax, sizeof(ivlmax));
	if ((r = set_curve(c->dealer, cfg)) < 0)
		goto err_sock;
	if ((c->dealer_fd = kvs_zmq_fd(c->dealer)) < 0) {
		r = -EINVAL;
		kvs_err("libzmq gave no ZMQ_FD: %s", zmq_strerror(errno));
		goto err_sock;
	}
	c->dealer_check = true;
	kvs__monitor_start(c); /* tcp://: what the connection sees explains a time-out */
	if (zmq_connect(c->dealer, c->endpoint) != 0) {
		r = -EINVAL;
		kvs_err("cannot connect to %s: %s", c->endpoint, zmq_strerror(errno));
		kvs__last_error_set("cannot connect to %s: %s", c->endpoint, zmq_strerror(errno));
		goto err_sock;
	}
	if ((r = pthread_create(&c->thr, NULL, kvs__io_main, c)) != 0) {
		r = -r;
		goto err_sock;
	}
	c->thr_started = true;
	kvs_msg m = {.op = KVS_OP_HELLO, .engine = kvs_str_c(c->engine), .role = (uint8_t)c->role,
		     .rank = c->rank, .world = c->world, .ns = kvs_str_c(c->ns)};
	kvs__waiter w = {0};
	r = kvs__call(c, &m, cfg->timeout_ms, &w);
	if (r) {
		char why[1400];
		if (r == KVS_E_TIMEOUT && c->monitor)
			kvs__monitor_explain(c, c->timeout_ms, why, sizeof(why));
		else if (r == KVS_E_TIMEOUT)
			snprintf(why, sizeof(why), "no answer from %s within %d ms", c->endpoint, c->timeout_ms);
		else
			snprintf(why, sizeof(why), "the server refused the hello: %s%s%s", kvs_error_name(r),
				 w.res.msg && w.res.msg[0] ? ": " : "", w.res.msg ? w.res.msg : "");
		kvs_err("open: %s", why);
		kvs__last_error_set("%s", why);
		kvs__monitor_stop(c);
		kvs_client_close(c);
		return r;
	}
	kvs__monitor_stop(c);
	kvs__lane_wait_open(c);
	*ret = c;
	return 0;

err_sock:
	kvs__monitor_stop(c);
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

void kvs_client_close(kvs_client *c)
{
	if (!c)
		return;
	if (kvs__forked(c)) {
		/* the parent's: no bye (it would end the parent's session), no
		 * join (the I/O thread is not in this process), no ZeroMQ (its
		 * context would wait for that thread), no lock (one may have been
		 * held at the fork). What the child inherited stays as it is;
		 * the struct is left to the process's exit. */
		return;
	}
	atomic_store(&c->closing, true);
	if (c->thr_started && atomic_load(&c->session)) {
		kvs_msg m = {.op = KVS_OP_BYE, .session = atomic_load(&c->session)};
		kvs__waiter w = {0};
		kvs__call(c, &m, 1000, &w);
	}
	pthread_mutex_lock(&c->mu);
	c->stop = true;
	pthread_mutex_unlock(&c->mu);
	kvs__wake(c);
	if (c->thr_started)
		pthread_join(c->thr, NULL);
	zmq_close(c->dealer);
	zmq_ctx_term(c->zctx);
	kvs_htab_destroy(c->pending);
	close(c->efd);
	kvs__lane_free(c);
	kvs__regs_free(c);
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

static int fill_blocks(kvs_client *c, kvs_msg *m, const kvs_blocks *b)
{
	if (!b || b->n_groups > KVS_MAX_GROUPS)
		return KVS_E_LIMIT;
	m->blocks.n = b->n_groups;
	m->blocks.packed = atomic_load(&c->packed_blocks); /* 4 bytes an id, decoded at memory speed */
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
	return fill_blocks(c, m, blocks);
}

static int store_msg(kvs_client *c, kvs_msg *m, uint64_t job, const uint8_t *keys, uint32_t n_keys,
		     const kvs_blocks *blocks, const kvs_store_opts *opts)
{
	int r = job_msg(c, m, KVS_OP_STORE, job, keys, n_keys, blocks);
	if (r || !opts)
		return r;
	m->lazy = opts->lazy;
	m->producer_event = (kvs_bytes){opts->producer_event, opts->producer_event_len};
	if (opts->event_hashes) {
		m->event_hashes = opts->event_hashes;
		m->n_event_hashes = n_keys;
	}
	return 0;
}

int kvs_store_async(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
		    const kvs_blocks *blocks, const kvs_store_opts *opts, int timeout_ms,
		    kvs_done_fn done, void *arg)
{
	kvs_msg m;
	int r = store_msg(c, &m, job, keys, n_keys, blocks, opts);
	return r ? r : kvs__submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

int kvs_store_complete_async(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
			     const kvs_blocks *blocks, const kvs_store_opts *opts, int timeout_ms,
			     kvs_done_fn done, void *arg)
{
	kvs_msg m;
	int r = store_msg(c, &m, job, keys, n_keys, blocks, opts);
	if (r)
		return r;
	m.complete = true;
	return kvs__submit(c, &m, timeout_ms, done, arg, kvs__store_completed, NULL);
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
	return kvs__submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

int kvs_complete_async(kvs_client *c, uint64_t job, bool ok, int timeout_ms, kvs_done_fn done,
		       void *arg)
{
	kvs_msg m = {.op = KVS_OP_COMPLETE, .session = atomic_load(&c->session), .job = job,
		     .status = ok ? KVS_STATUS_OK : KVS_STATUS_FAILED};
	return kvs__submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

int kvs_lookup_async(kvs_client *c, const uint8_t *keys, uint32_t n_keys, bool prefetch,
		     uint32_t pin_ms, int timeout_ms, kvs_done_fn done, void *arg)
{
	if (n_keys > KVS_MAX_KEYS)
		return KVS_E_LIMIT;
	kvs_msg m = {.op = KVS_OP_LOOKUP, .session = atomic_load(&c->session), .keys = keys,
		     .n_keys = n_keys, .prefetch = prefetch, .pin_ms = pin_ms};
	return kvs__submit(c, &m, timeout_ms, done, arg, NULL, NULL);
}

static int wait_async(kvs_client *c, int r, kvs__waiter *w)
{
	if (r) {
		kvs__last_error_set("%s", "");
		return r;
	}
	pthread_mutex_lock(&w->mu);
	while (!w->done)
		pthread_cond_wait(&w->cv, &w->mu);
	pthread_mutex_unlock(&w->mu);
	kvs__last_error_set("%s", w->res.code ? w->msg : ""); /* the server's text (kvs_last_error) */
	return w->res.code;
}

#define BLOCKING(w)                                  \
	kvs__waiter w = {0};                              \
	if (kvs__on_io_thread(c))                         \
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
					      kvs__waiter_done, &w), &w);
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
						 timeout_ms, kvs__waiter_done, &w), &w);
	if (!r && ret_state)
		*ret_state = w.res.state;
	BLOCKING_END(w);
	return r;
}

int kvs_complete(kvs_client *c, uint64_t job, bool ok, int timeout_ms, int *ret_state)
{
	BLOCKING(w);
	int r = wait_async(c, kvs_complete_async(c, job, ok, timeout_ms, kvs__waiter_done, &w), &w);
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
					       kvs__waiter_done, &w), &w);
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
	kvs__waiter w = {.jobs_out = out, .cap = cap};
	int r = kvs__call(c, &m, timeout_ms, &w);
	if (!r && ret_n)
		*ret_n = w.n_out;
	return r;
}

int kvs_stats(kvs_client *c, int timeout_ms, kvs_stat_out *out, uint32_t cap, uint32_t *ret_n)
{
	kvs_msg m = {.op = KVS_OP_STATS, .session = atomic_load(&c->session)};
	kvs__waiter w = {.stats_out = out, .cap = cap};
	int r = kvs__call(c, &m, timeout_ms, &w);
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
	kvs__waiter w = {.admin_out = &info};
	int r = kvs__call(c, &m, timeout_ms, &w);
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

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ volatile("yield");
#endif
}

/* The ring's entry for job, or -1; under mu. */
static int ring_find(const kvs_client *c, uint64_t job, int *state)
{
	uint64_t lo = c->ring_n > KVS__JOB_RING ? c->ring_n - KVS__JOB_RING : 0;
	for (uint64_t i = c->ring_n; i > lo; i--)
		if (c->ring[(i - 1) % KVS__JOB_RING].job == job) {
			*state = c->ring[(i - 1) % KVS__JOB_RING].state;
			return 0;
		}
	return -1;
}

/* Spins (without the lock, which the I/O thread takes to push) until the
 * ring's count moves or until `until`, after waking the I/O thread if
 * `kick`; under mu, returns under mu. */
static void spin_ring(kvs_client *c, uint64_t until, bool kick)
{
	uint64_t seen = c->ring_n;
	pthread_mutex_unlock(&c->mu);
	if (kick) {
		uint64_t one = 1;
		ssize_t w = write(c->efd, &one, sizeof(one));
		(void)w;
	}
	while (__atomic_load_n(&c->ring_n, __ATOMIC_ACQUIRE) == seen && kvs_now_ns() < until)
		cpu_relax();
	pthread_mutex_lock(&c->mu);
}

static void add_ns(struct timespec *ts, uint64_t ns)
{
	ns += (uint64_t)ts->tv_nsec;
	ts->tv_sec += (time_t)(ns / 1000000000ull);
	ts->tv_nsec = (long)(ns % 1000000000ull);
}

/* Hybrid polling (the scheme of Linux's hybrid block polling): a wait
 * sleeps through most of the time recent waits took, then polls for a
 * window around their average, and so does the I/O thread (woken for it),
 * so that neither needs waking when the job ends: a thread that went idle
 * costs tens of microseconds to wake on a virtual machine (architecture.md
 * §17.1). Outside the window both sleep as before. */
static void hybrid_window(const kvs_client *c, uint64_t t0, uint64_t *from, uint64_t *to)
{
	*from = *to = 0;
	/* not for waits shorter than ~100 us: the I/O thread is still awake
	 * then, and the window's eventfd write only costs (tiny jobs ran 6-10 %
	 * slower with it on the H200) */
	if (!c->hybrid_poll || c->busy_poll_ns || c->wait_avg_ns < 100000)
		return;
	uint64_t m = c->wait_avg_ns / 8; /* the window: average +- an eighth, 20-200 us */
	m = m < 20000 ? 20000 : m > 200000 ? 200000 : m;
	*from = t0 + (c->wait_avg_ns > m ? c->wait_avg_ns - m : 0);
	*to = t0 + c->wait_avg_ns + m;
}

int kvs_job_wait(kvs_client *c, uint64_t job, int timeout_ms, int *ret_state)
{
	if (kvs__forked(c))
		return KVS_E_SESSION;
	if (kvs__on_io_thread(c))
		return -EDEADLK;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t timeout_ns = (uint64_t)kvs__timeout_of(c, timeout_ms) * 1000000ull;
	add_ns(&ts, timeout_ns);
	int r = KVS_E_TIMEOUT, state = 0;
	uint64_t t0 = kvs_now_ns();
	uint64_t spin_end = c->busy_poll_ns ? t0 + c->busy_poll_ns : 0;
	bool waited = false, polled = false, waited_in_window = false;
	pthread_mutex_lock(&c->mu);
	uint64_t from, to;
	hybrid_window(c, t0, &from, &to);
	if (to > t0 + timeout_ns)
		to = t0 + timeout_ns;
	for (;; waited = true) {
		if (ring_find(c, job, &state) == 0) {
			r = 0;
			c->hybrid_hits += polled;
			break;
		}
		polled = false;
		uint64_t now = kvs_now_ns();
		if (spin_end && now < spin_end) { /* KVS_BUSY_POLL_US */
			spin_ring(c, spin_end, false);
			continue;
		}
		if (to && now >= from && now < to) {
			uint64_t io = atomic_load(&c->io_spin_until_ns);
			while (io < to && !atomic_compare_exchange_weak(&c->io_spin_until_ns, &io, to))
				;
			c->hybrid_windows += !waited_in_window;
			waited_in_window = polled = true;
			spin_ring(c, to, io < to); /* the I/O thread polls too, from now on */
			continue;
		}
		struct timespec until = ts;
		if (to && now < from) { /* sleep until the window opens */
			clock_gettime(CLOCK_REALTIME, &until);
			add_ns(&until, from - now);
			if (until.tv_sec > ts.tv_sec || (until.tv_sec == ts.tv_sec && until.tv_nsec > ts.tv_nsec))
				until = ts;
		}
		if (pthread_cond_timedwait(&c->job_cv, &c->mu, &until) == ETIMEDOUT && until.tv_sec == ts.tv_sec &&
		    until.tv_nsec == ts.tv_nsec)
			break;
	}
	if (r == 0 && waited) { /* learn how long a wait takes */
		uint64_t d = kvs_now_ns() - t0, a = c->wait_avg_ns;
		/* up slowly (over ~8 waits), down fast (halfway each wait): one
		 * slow wait, often the first, no longer keeps the window past
		 * the job's end for many waits; a window opened early costs at
		 * most its own polling */
		c->wait_avg_ns = !a ? d : d < a ? (a + d) / 2 : (7 * a + d) / 8;
	}
	pthread_mutex_unlock(&c->mu);
	if (ret_state && r == 0)
		*ret_state = state;
	KVS_TRACE(KVS_TP_APP_JOB_DONE, 0);
	return r;
}

long kvs_keys_for_tokens(const char *ns, const uint32_t *tokens, size_t n_tokens,
			 uint32_t chunk_tokens, uint8_t *out, size_t max_keys)
{
	return kvs_chunk_keys(ns, strlen(ns), tokens, n_tokens, chunk_tokens, out, max_keys);
}

const char *kvs_state_name(int state) { return kvs_job_state_name(state); }

unsigned kvs_abi_version(void) { return KVS_ABI_VERSION; }
