/* Unit tests for the client library's I/O code (worker/client_*.c) against a
 * fake server played by the test: a ZeroMQ ROUTER on the client's endpoint and
 * a SOCK_SEQPACKET listener on its broker path, both in a temporary broker
 * directory. The test decodes what the client sends and writes the replies
 * itself, so it can answer late, wrongly, with another epoch or not at all.
 * Covered: hello and heartbeats (and the delay counter), finish's result
 * marshalling per op, timeouts and late replies, undecodable replies, the
 * broker push (one record, 256 fds in two, refusals, a broker that hangs up,
 * never answers or is missing), the restart state machine (E_SESSION to a
 * heartbeat, a new epoch on an application reply, re-open, re-registration
 * under fresh tokens while heartbeats go on and application requests wait, a
 * failed re-open retried, an unregister racing the restore), close. */
#include <check.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "check_main.h"
#include "kvs_fdpass.h"
#include "kvs_log.h"
#include "kvs_proto.h"
#include "kvs_time.h"
#include "kvside.h"

/* ---- the fake server -------------------------------------------------------- */

typedef struct fs {
	char dir[64];
	void *zctx, *router;
	int lfd; /* broker listener, -1 when there is none */
	uint8_t epoch[KVS_EPOCH_BYTES];
	uint64_t session;   /* the session the fake's hellos hand out last */
	uint64_t hb_ms;     /* advised in hello replies */
	uint8_t ident[256]; /* routing id of the last request */
	size_t ident_len;
	void *body; /* the last request's bytes (the decoded request borrows them) */
	size_t body_len;
	kvs_msg rq; /* the last request */
	int heartbeats; /* answered by fs_expect on the way */
	uint64_t hb_session; /* session of the last heartbeat seen */
} fs;

static void fs_new_epoch(fs *f)
{
	for (int i = 0; i < KVS_EPOCH_BYTES; i++)
		f->epoch[i] = (uint8_t)random();
}

static void fs_start(fs *f, uint64_t hb_ms)
{
	memset(f, 0, sizeof(*f));
	kvs_log_set_level(getenv("KVS_TEST_VERBOSE") ? KVS_LOG_DEBUG : KVS_LOG_ERROR);
	snprintf(f->dir, sizeof(f->dir), "/tmp/kvs-uc-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(f->dir));
	f->zctx = zmq_ctx_new();
	f->router = zmq_socket(f->zctx, ZMQ_ROUTER);
	int zero = 0;
	zmq_setsockopt(f->router, ZMQ_LINGER, &zero, sizeof(zero));
	char ep[128];
	snprintf(ep, sizeof(ep), "ipc://%s/kvside.zmq", f->dir);
	ck_assert_int_eq(zmq_bind(f->router, ep), 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s", f->dir, KVS_BROKER_SOCK_NAME);
	f->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	ck_assert_int_ge(f->lfd, 0);
	ck_assert_int_eq(bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	ck_assert_int_eq(listen(f->lfd, 16), 0);
	f->hb_ms = hb_ms;
	f->session = 0x1000;
	fs_new_epoch(f);
}

static void fs_broker_close(fs *f)
{
	char path[128];
	snprintf(path, sizeof(path), "%s/%s", f->dir, KVS_BROKER_SOCK_NAME);
	if (f->lfd >= 0)
		close(f->lfd);
	f->lfd = -1;
	unlink(path);
}

static void fs_stop(fs *f)
{
	kvs_msg_clear(&f->rq);
	free(f->body);
	fs_broker_close(f);
	zmq_close(f->router);
	zmq_ctx_term(f->zctx);
	char p[128];
	snprintf(p, sizeof(p), "%s/kvside.zmq", f->dir);
	unlink(p);
	rmdir(f->dir);
}

/* Receives the next request within timeout_ms into f->rq: 0, or -1. */
static int fs_recv(fs *f, int timeout_ms)
{
	zmq_pollitem_t it = {.socket = f->router, .events = ZMQ_POLLIN};
	if (zmq_poll(&it, 1, timeout_ms) <= 0)
		return -1;
	int n = zmq_recv(f->router, f->ident, sizeof(f->ident), 0);
	ck_assert_int_gt(n, 0);
	f->ident_len = (size_t)n;
	zmq_msg_t m;
	zmq_msg_init(&m);
	ck_assert_int_ge(zmq_msg_recv(&m, f->router, 0), 0);
	kvs_msg_clear(&f->rq);
	free(f->body);
	f->body_len = zmq_msg_size(&m);
	f->body = malloc(f->body_len + 1);
	memcpy(f->body, zmq_msg_data(&m), f->body_len);
	zmq_msg_close(&m);
	kvs_proto_err err;
	ck_assert_msg(kvs_proto_decode(f->body, f->body_len, false, &f->rq, &err) == 0,
		      "client sent an undecodable request: %s", err.msg);
	return 0;
}

/* Sends rep (its id and op as given) with the fake's current epoch. */
static void fs_send(fs *f, kvs_msg *rep)
{
	rep->is_reply = true;
	memcpy(rep->epoch, f->epoch, KVS_EPOCH_BYTES);
	void *buf;
	size_t len;
	ck_assert_int_eq(kvs_proto_encode(rep, &buf, &len), 0);
	ck_assert_int_ge(zmq_send(f->router, f->ident, f->ident_len, ZMQ_SNDMORE), 0);
	ck_assert_int_ge(zmq_send(f->router, buf, len, 0), 0);
	free(buf);
}

/* A lookup reply whose `hits` is a string: undecodable, yet its id readable. */
static void fs_send_mistyped_hits(fs *f, uint64_t id)
{
	uint8_t b[64], *p = b;
	*p++ = 0x86;
	memcpy(p, "\xa1v\x01\xa2op\xa6lookup\xa2id\xcf", 17);
	p += 17;
	for (int i = 7; i >= 0; i--)
		*p++ = (uint8_t)(id >> (8 * i));
	memcpy(p, "\xa2ok\xc3\xa5" "epoch\xc4\x10", 12);
	p += 12;
	memcpy(p, f->epoch, KVS_EPOCH_BYTES);
	p += KVS_EPOCH_BYTES;
	memcpy(p, "\xa4hits\xa1x", 7);
	p += 7;
	ck_assert_int_ge(zmq_send(f->router, f->ident, f->ident_len, ZMQ_SNDMORE), 0);
	ck_assert_int_ge(zmq_send(f->router, b, (size_t)(p - b), 0), 0);
}

static void fs_ok(fs *f, kvs_op op, uint64_t id)
{
	kvs_msg rep = {.op = op, .id = id, .ok = true};
	fs_send(f, &rep);
}

static void fs_err(fs *f, kvs_op op, uint64_t id, int code, const char *text)
{
	kvs_msg rep = {.op = op, .id = id, .ok = false, .code = code, .errmsg = kvs_str_c(text)};
	fs_send(f, &rep);
}

static void fs_hello_ok(fs *f, uint64_t id)
{
	kvs_msg rep = {.op = KVS_OP_HELLO, .id = id, .ok = true, .session = ++f->session,
		       .heartbeat_ms = f->hb_ms, .ttl_ms = 10 * f->hb_ms,
		       .limits = {.max_msg_bytes = KVS_MAX_MSG_BYTES, .max_keys = KVS_MAX_KEYS,
				  .max_block_ids = KVS_MAX_BLOCK_IDS}};
	fs_send(f, &rep);
}

/* Waits for a request of op, answering heartbeats on the way (unless op is
 * the heartbeat). Any other request fails the test. 0, or -1 on timeout. */
static int fs_expect(fs *f, kvs_op op, int timeout_ms)
{
	uint64_t end = kvs_now_ms() + (uint64_t)timeout_ms;
	for (;;) {
		uint64_t now = kvs_now_ms();
		if (now >= end || fs_recv(f, (int)(end - now)) != 0)
			return -1;
		if (f->rq.op == op)
			return 0;
		ck_assert_msg(f->rq.op == KVS_OP_HEARTBEAT, "expected %s, got %s", kvs_op_name(op),
			      kvs_op_name(f->rq.op));
		f->heartbeats++;
		f->hb_session = f->rq.session;
		fs_ok(f, KVS_OP_HEARTBEAT, f->rq.id);
	}
}

/* Answers heartbeats for ms; fails the test on anything else. */
static void fs_serve_heartbeats(fs *f, int ms)
{
	ck_assert_int_eq(fs_expect(f, KVS_OP_NONE, ms), -1);
}

/* ---- the fake broker --------------------------------------------------------- */

static int fs_broker_accept(fs *f, int timeout_ms)
{
	struct pollfd p = {.fd = f->lfd, .events = POLLIN};
	if (poll(&p, 1, timeout_ms) != 1)
		return -1;
	int fd = accept4(f->lfd, NULL, NULL, SOCK_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	return fd;
}

/* One record from conn within timeout_ms: its entries and fds (the caller
 * closes them). Returns the entry count, or -1 (timeout or hang-up). */
static int fs_broker_read(int conn, kvs_broker_entry *e, int *fds, int timeout_ms)
{
	struct pollfd p = {.fd = conn, .events = POLLIN};
	if (poll(&p, 1, timeout_ms) != 1)
		return -1;
	uint8_t rec[KVS_BROKER_REC_MAX + 1];
	size_t len = 0;
	int nfds = 0;
	if (kvs_fd_recv(conn, rec, sizeof(rec), &len, fds, KVS_BROKER_MAX_FDS, &nfds) != 0)
		return -1;
	uint32_t n = 0;
	ck_assert_int_eq(kvs_broker_rec_unpack(rec, len, e, &n), 0);
	ck_assert_int_eq(rec[4], 2); /* the client writes version 2 */
	ck_assert_int_eq((int)n, nfds);
	return (int)n;
}

static void fs_broker_reply(int conn, int status)
{
	uint8_t rep[KVS_BROKER_REP_BYTES];
	kvs_broker_rep_pack(status, rep);
	ck_assert_int_eq(kvs_fd_send(conn, rep, sizeof(rep), NULL, 0), 0);
}

static void close_all(int *fds, int n)
{
	for (int i = 0; i < n; i++)
		close(fds[i]);
}

/* ---- client calls on a thread of their own ---------------------------------- */

typedef struct bg bg;
struct bg {
	pthread_t t;
	int (*fn)(bg *);
	int ret;
	fs *f;
	kvs_client *c;
	int timeout_ms;
	/* register */
	uint32_t n_allocs;
	int fds[256];
	uint64_t handle;
	/* results */
	uint64_t u64;
	uint8_t tiers[8];
	kvs_job_info_out jobs[4];
	kvs_stat_out stats[16];
	uint32_t n;
	kvs_admin_info admin;
};

static void *bg_main(void *a)
{
	bg *b = a;
	b->ret = b->fn(b);
	return NULL;
}

static void bg_start(bg *b, int (*fn)(bg *))
{
	b->fn = fn;
	b->ret = 1;
	ck_assert_int_eq(pthread_create(&b->t, NULL, bg_main, b), 0);
}

static int bg_join(bg *b) { return pthread_join(b->t, NULL) == 0 ? b->ret : -1; }

static atomic_int events_reconnected, last_event_error;

static void on_event(const kvs_event *ev, void *arg)
{
	(void)arg;
	if (ev->type == KVS_EVENT_RECONNECTED) {
		atomic_store(&last_event_error, ev->error);
		atomic_fetch_add(&events_reconnected, 1);
	}
}

static int do_open(bg *b)
{
	kvs_client_config cfg = {.broker_dir = b->f->dir, .engine = "eng", .ns = "ns",
				 .role = KVS_ROLE_WORKER, .rank = 0, .world = 1,
				 .timeout_ms = b->timeout_ms ? b->timeout_ms : 3000,
				 .on_event = on_event};
	return kvs_client_open(&cfg, &b->c);
}

/* Opens a client against f: answers its hello. */
static kvs_client *open_client(fs *f, int timeout_ms)
{
	atomic_store(&events_reconnected, 0);
	atomic_store(&last_event_error, 0);
	bg b = {.f = f, .timeout_ms = timeout_ms};
	bg_start(&b, do_open);
	ck_assert_int_eq(fs_expect(f, KVS_OP_HELLO, 3000), 0);
	char eng[16];
	kvs_str_copy(eng, sizeof(eng), f->rq.engine);
	ck_assert_str_eq(eng, "eng");
	fs_hello_ok(f, f->rq.id);
	ck_assert_int_eq(bg_join(&b), 0);
	ck_assert_uint_eq(kvs_client_session(b.c), f->session);
	return b.c;
}

static int do_close(bg *b)
{
	kvs_client_close(b->c);
	return 0;
}

/* Closes c: answers its bye. */
static void close_client(fs *f, kvs_client *c)
{
	bg b = {.f = f, .c = c};
	bg_start(&b, do_close);
	if (fs_expect(f, KVS_OP_BYE, 3000) == 0)
		fs_ok(f, KVS_OP_BYE, f->rq.id);
	bg_join(&b);
}

static int do_register(bg *b)
{
	kvs_alloc al[256];
	kvs_layer ly[256];
	for (uint32_t i = 0; i < b->n_allocs; i++) {
		void *p;
		if (kvs_memfd_create("kvs-uc", 4096, &b->fds[i], &p) != 0)
			return -1;
		al[i] = (kvs_alloc){.fd = b->fds[i], .size = 4096};
		ly[i] = (kvs_layer){.group = 0, .alloc = i, .offset = 0, .num_blocks = 1,
				    .block_stride = 4096, .block_bytes = 4096};
	}
	kvs_group g = {.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16,
		       .blocks_per_chunk = 1, .window_chunks = -1, .null_block = -1};
	kvs_registration_desc d = {.device_type = KVS_DEV_HOST, .allocs = al, .n_allocs = b->n_allocs,
				   .groups = &g, .n_groups = 1, .layers = ly, .n_layers = b->n_allocs};
	return kvs_register(b->c, &d, b->timeout_ms, &b->handle);
}

static bool same_file(int a, int b)
{
	struct stat sa, sb;
	return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* Serves one registration's broker push on a new connection and checks it:
 * n entries whose fds are b's memfds in order, tokens as the later register
 * names them. Leaves the tokens in tokens_out; returns the connection. */
static int serve_push(fs *f, bg *b, uint8_t (*tokens_out)[16])
{
	int conn = fs_broker_accept(f, 3000);
	ck_assert_int_ge(conn, 0);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int fds[KVS_BROKER_MAX_FDS];
	uint32_t done = 0;
	while (done < b->n_allocs) {
		int n = fs_broker_read(conn, e, fds, 3000);
		ck_assert_int_eq(n, (int)(b->n_allocs - done < KVS_BROKER_MAX_FDS ? b->n_allocs - done
										  : KVS_BROKER_MAX_FDS));
		for (int i = 0; i < n; i++) {
			ck_assert(same_file(fds[i], b->fds[done + (uint32_t)i]));
			ck_assert_uint_eq(e[i].size, 4096);
			memcpy(tokens_out[done + (uint32_t)i], e[i].token, 16);
		}
		close_all(fds, n);
		done += (uint32_t)n;
		if (done < b->n_allocs) {
			/* the next record waits for this one's reply */
			ck_assert_int_eq(fs_broker_read(conn, e, fds, 100), -1);
		}
		fs_broker_reply(conn, 0);
	}
	return conn;
}

/* Checks that the register request in f->rq names tokens, in order. */
static void check_register(fs *f, uint32_t n, uint8_t (*tokens)[16])
{
	ck_assert_int_eq(f->rq.op, KVS_OP_REGISTER);
	ck_assert_uint_eq(f->rq.n_allocs, n);
	for (uint32_t i = 0; i < n; i++)
		ck_assert_int_eq(memcmp(f->rq.allocs[i].token, tokens[i], 16), 0);
}

/* Registers n allocations through the fake (push + register): the handle. */
static uint64_t register_n(fs *f, kvs_client *c, uint32_t n, uint64_t reg_id, bg *b)
{
	memset(b, 0, sizeof(*b));
	*b = (bg){.f = f, .c = c, .n_allocs = n, .timeout_ms = 5000};
	bg_start(b, do_register);
	uint8_t (*tok)[16] = calloc(n, 16);
	int conn = serve_push(f, b, tok);
	ck_assert_int_eq(fs_expect(f, KVS_OP_REGISTER, 3000), 0);
	check_register(f, n, tok);
	kvs_msg rep = {.op = KVS_OP_REGISTER, .id = f->rq.id, .ok = true, .registration = reg_id,
		       .imported = n};
	fs_send(f, &rep);
	ck_assert_int_eq(bg_join(b), 0);
	/* the client hangs up once nothing is left to push */
	kvs_broker_entry e[1];
	int fds[KVS_BROKER_MAX_FDS];
	ck_assert_int_eq(fs_broker_read(conn, e, fds, 1000), -1);
	close(conn);
	free(tok);
	return b->handle;
}

static void close_fds(bg *b) { close_all(b->fds, (int)b->n_allocs); }

static uint64_t client_stat(fs *f, kvs_client *c, const char *name);

/* ---- tests ---------------------------------------------------------------------- */

START_TEST(hello_and_heartbeats)
{
	fs f;
	fs_start(&f, 20);
	kvs_client *c = open_client(&f, 0);
	uint64_t t0 = kvs_now_ms();
	fs_serve_heartbeats(&f, 500);
	/* every 20 ms from the open on, never lazily: 25 in 500 ms, give or take */
	ck_assert_int_ge(f.heartbeats, 15);
	ck_assert_int_le(f.heartbeats, 30);
	ck_assert_uint_eq(f.hb_session, kvs_client_session(c));
	ck_assert_uint_ge(kvs_now_ms() - t0, 500);
	ck_assert_uint_ge(client_stat(&f, c, "client_heartbeats"), (uint64_t)f.heartbeats);
	/* attended to on time, on an idle machine well within one interval */
	ck_assert_uint_lt(client_stat(&f, c, "client_heartbeat_delay_max_us"), 20000);
	ck_assert_uint_eq(kvs_client_reconnects(c), 0);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

/* kvs_job_wait with the job in u64; its state in n. */
static int do_job_wait(bg *b)
{
	int st = -1;
	int r = kvs_job_wait(b->c, b->u64, 2000, &st);
	b->n = (uint32_t)st;
	return r;
}

/* Waits of a steady length: after a few, kvs_job_wait polls for a window
 * around their average (hybrid polling); with KVS_HYBRID_POLL=0 it never
 * does. Every wait gets its job's state either way. */
START_TEST(job_wait_polls_around_the_expected_end)
{
	for (int on = 1; on >= 0; on--) {
		if (!on)
			setenv("KVS_HYBRID_POLL", "0", 1);
		fs f;
		fs_start(&f, 1000);
		kvs_client *c = open_client(&f, 0);
		unsetenv("KVS_HYBRID_POLL");
		/* with it on, until a window opened: on a loaded machine the
		 * waiting thread may start late and find its job ended, or
		 * wake late (a CI run saw none in sixteen) */
		for (uint64_t j = 1; j <= 16 || (on && j <= 256 && !client_stat(&f, c, "client_hybrid_windows")); j++) {
			bg b = {.c = c, .u64 = j};
			bg_start(&b, do_job_wait);
			usleep(3000);
			kvs_msg push = {.op = KVS_OP_JOB_DONE, .id = 0, .ok = true, .job = j,
					.state = j % 2 ? KVS_JOB_COMMITTED : KVS_JOB_ABORTED, .reason = kvs_str_c("x")};
			fs_send(&f, &push);
			ck_assert_int_eq(bg_join(&b), 0);
			ck_assert_int_eq((int)b.n, j % 2 ? KVS_JOB_COMMITTED : KVS_JOB_ABORTED);
		}
		uint64_t windows = client_stat(&f, c, "client_hybrid_windows");
		uint64_t hits = client_stat(&f, c, "client_hybrid_hits");
		ck_assert_uint_le(hits, windows);
		if (on)
			ck_assert_uint_gt(windows, 0);
		else
			ck_assert_uint_eq(windows, 0);
		/* a job that ended before the wait: found at once */
		bg b = {.c = c, .u64 = 3};
		bg_start(&b, do_job_wait);
		ck_assert_int_eq(bg_join(&b), 0);
		ck_assert_int_eq((int)b.n, KVS_JOB_COMMITTED);
		close_client(&f, c);
		fs_stop(&f);
	}
}
END_TEST

START_TEST(heartbeat_unanswered_waits_for_its_timeout)
{
	fs f;
	fs_start(&f, 20);
	kvs_client *c = open_client(&f, 0);
	/* never answer: one heartbeat in flight at a time, the next after the
	 * first timed out (2 x 20 ms) */
	int seen = 0;
	uint64_t end = kvs_now_ms() + 300;
	while (kvs_now_ms() < end)
		if (fs_recv(&f, 20) == 0) {
			ck_assert_int_eq(f.rq.op, KVS_OP_HEARTBEAT);
			seen++;
		}
	ck_assert_int_ge(seen, 4);
	ck_assert_int_le(seen, 9); /* not 15 */
	ck_assert_uint_eq(kvs_client_reconnects(c), 0);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

/* ---- finish: replies marshalled into kvs_result ---- */

static int do_lookup(bg *b)
{
	uint8_t keys[8 * 32] = {0};
	return kvs_lookup(b->c, keys, 8, false, 0, b->timeout_ms, &b->u64, b->tiers);
}

static int do_job_status(bg *b)
{
	uint64_t ids[2] = {5, 6};
	return kvs_job_status(b->c, ids, 2, 2000, b->jobs, 2, &b->n);
}

static int do_stats(bg *b) { return kvs_stats(b->c, 2000, b->stats, 16, &b->n); }

static int do_admin(bg *b) { return kvs_admin(b->c, KVS_ADMIN_DRAIN, 100, 2000, &b->admin); }

static uint64_t client_stat(fs *f, kvs_client *c, const char *name)
{
	bg b = {.f = f, .c = c};
	bg_start(&b, do_stats);
	ck_assert_int_eq(fs_expect(f, KVS_OP_STATS, 3000), 0);
	kvs_counter cs[1] = {{kvs_str_c("sessions"), 1}};
	kvs_msg rep = {.op = KVS_OP_STATS, .id = f->rq.id, .ok = true, .counters = cs, .n_counters = 1};
	fs_send(f, &rep);
	ck_assert_int_eq(bg_join(&b), 0);
	return kvs_stat_find(b.stats, b.n, name);
}

START_TEST(results_are_marshalled_per_op)
{
	fs f;
	fs_start(&f, 1000);
	kvs_client *c = open_client(&f, 0);

	/* lookup: hits and tiers, tiers copied up to n_keys */
	bg b = {.f = &f, .c = c, .timeout_ms = 2000};
	bg_start(&b, do_lookup);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_LOOKUP, 3000), 0);
	ck_assert_uint_eq(f.rq.n_keys, 8);
	uint8_t tiers[3] = {KVS_TIER_L1, KVS_TIER_L2, KVS_TIER_L1};
	kvs_msg rep = {.op = KVS_OP_LOOKUP, .id = f.rq.id, .ok = true, .hits = 3, .tiers = tiers,
		       .n_tiers = 3};
	fs_send(&f, &rep);
	ck_assert_int_eq(bg_join(&b), 0);
	ck_assert_uint_eq(b.u64, 3);
	ck_assert_int_eq(b.tiers[1], KVS_TIER_L2);

	/* job_status: three infos into room for two */
	b = (bg){.f = &f, .c = c};
	bg_start(&b, do_job_status);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_JOB_STATUS, 3000), 0);
	kvs_job_info ji[3] = {{5, KVS_JOB_COMMITTED, kvs_str_c(""), 2},
			      {6, KVS_JOB_ABORTED, kvs_str_c("deadline"), 1},
			      {7, KVS_JOB_OPEN, kvs_str_c(""), 0}};
	rep = (kvs_msg){.op = KVS_OP_JOB_STATUS, .id = f.rq.id, .ok = true, .job_infos = ji,
			.n_job_infos = 3};
	fs_send(&f, &rep);
	ck_assert_int_eq(bg_join(&b), 0);
	ck_assert_uint_eq(b.n, 2);
	ck_assert_uint_eq(b.jobs[1].job, 6);
	ck_assert_int_eq(b.jobs[1].state, KVS_JOB_ABORTED);
	ck_assert_uint_eq(b.jobs[1].ranks_done, 1);
	ck_assert_str_eq(b.jobs[1].reason, "deadline");

	/* stats: the server's counters, then the client's own */
	b = (bg){.f = &f, .c = c};
	bg_start(&b, do_stats);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_STATS, 3000), 0);
	kvs_counter cs[2] = {{kvs_str_c("sessions"), 4}, {kvs_str_c("requests"), 99}};
	rep = (kvs_msg){.op = KVS_OP_STATS, .id = f.rq.id, .ok = true, .counters = cs, .n_counters = 2};
	fs_send(&f, &rep);
	ck_assert_int_eq(bg_join(&b), 0);
	ck_assert_uint_eq(b.n, 12);
	ck_assert_uint_eq(kvs_stat_find(b.stats, b.n, "requests"), 99);
	ck_assert_uint_eq(kvs_stat_find(b.stats, b.n, "client_hybrid_windows"), 0); /* no job waited */
	ck_assert_uint_eq(kvs_stat_find(b.stats, b.n, "client_hybrid_hits"), 0);
	ck_assert_str_eq(b.stats[2].name, "client_heartbeats");
	ck_assert_uint_ne(kvs_stat_find(b.stats, b.n, "client_heartbeat_delay_max_us"), UINT64_MAX);
	ck_assert_uint_eq(kvs_stat_find(b.stats, b.n, "client_broker_records"), 0);
	ck_assert_uint_eq(kvs_stat_find(b.stats, b.n, "client_broker_fds"), 0);
	ck_assert_uint_eq(kvs_stat_find(b.stats, b.n, "client_lane_up"), 0); /* KVS_LANE=0 */
	ck_assert_uint_eq(kvs_stat_find(b.stats, b.n, "client_lane_frames_out"), 0);

	/* admin: the fields, then an error's text */
	b = (bg){.f = &f, .c = c};
	bg_start(&b, do_admin);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_ADMIN, 3000), 0);
	ck_assert_uint_eq(f.rq.wait_ms, 100);
	rep = (kvs_msg){.op = KVS_OP_ADMIN, .id = f.rq.id, .ok = true, .admin_cmd = KVS_ADMIN_DRAIN,
			.draining = true, .drained = false, .jobs_open = 3, .waited_ms = 100};
	fs_send(&f, &rep);
	ck_assert_int_eq(bg_join(&b), 0);
	ck_assert(b.admin.draining);
	ck_assert(!b.admin.drained);
	ck_assert_uint_eq(b.admin.jobs_open, 3);
	ck_assert_uint_eq(b.admin.waited_ms, 100);
	b = (bg){.f = &f, .c = c};
	bg_start(&b, do_admin);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_ADMIN, 3000), 0);
	fs_err(&f, KVS_OP_ADMIN, f.rq.id, KVS_E_BUSY, "drain refused: testing");
	ck_assert_int_eq(bg_join(&b), KVS_E_BUSY);
	ck_assert_str_eq(b.admin.msg, "drain refused: testing");

	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

START_TEST(timeouts_late_and_bad_replies)
{
	fs f;
	fs_start(&f, 1000);
	kvs_client *c = open_client(&f, 0);
	/* never answered: E_TIMEOUT after its own timeout */
	bg b = {.f = &f, .c = c, .timeout_ms = 150};
	uint64_t t0 = kvs_now_ms();
	bg_start(&b, do_lookup);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_LOOKUP, 3000), 0);
	uint64_t late_id = f.rq.id;
	ck_assert_int_eq(bg_join(&b), KVS_E_TIMEOUT);
	ck_assert_uint_ge(kvs_now_ms() - t0, 150);
	ck_assert_uint_lt(kvs_now_ms() - t0, 1500);
	/* its late reply, and one for an id never used, are dropped */
	fs_ok(&f, KVS_OP_LOOKUP, late_id);
	fs_ok(&f, KVS_OP_LOOKUP, 987654);
	/* an undecodable reply naming a request fails that request */
	b = (bg){.f = &f, .c = c, .timeout_ms = 2000};
	bg_start(&b, do_lookup);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_LOOKUP, 3000), 0);
	fs_send_mistyped_hits(&f, f.rq.id);
	ck_assert_int_eq(bg_join(&b), KVS_E_BADMSG);
	/* the client goes on */
	ck_assert_uint_eq(client_stat(&f, c, "sessions"), 1);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

/* ---- the broker push ---- */

START_TEST(register_sends_one_record)
{
	fs f;
	fs_start(&f, 1000);
	kvs_client *c = open_client(&f, 0);
	bg b;
	uint64_t h = register_n(&f, c, 5, 77, &b);
	ck_assert_uint_eq(h, 1);
	ck_assert_uint_eq(client_stat(&f, c, "client_broker_records"), 1);
	ck_assert_uint_eq(client_stat(&f, c, "client_broker_fds"), 5);
	close_fds(&b);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

START_TEST(register_256_allocations_in_two_records)
{
	fs f;
	fs_start(&f, 1000);
	kvs_client *c = open_client(&f, 0);
	bg b;
	register_n(&f, c, 256, 78, &b);
	ck_assert_uint_eq(client_stat(&f, c, "client_broker_records"), 2);
	ck_assert_uint_eq(client_stat(&f, c, "client_broker_fds"), 256);
	close_fds(&b);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

/* kvs_register against a broker that does something wrong: the code it
 * returns, and that no register was sent. */
static int register_against(fs *f, kvs_client *c, int how, int timeout_ms)
{
	bg b = {.f = f, .c = c, .n_allocs = 3, .timeout_ms = timeout_ms};
	bg_start(&b, do_register);
	int conn = how == 3 ? -1 : fs_broker_accept(f, 3000);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int fds[KVS_BROKER_MAX_FDS];
	if (conn >= 0) {
		int n = fs_broker_read(conn, e, fds, 3000);
		ck_assert_int_eq(n, 3);
		close_all(fds, n);
		if (how == 0)
			fs_broker_reply(conn, KVS_E_AUTH);
		else if (how == 1)
			close(conn); /* hang up without a reply */
		/* how == 2: never answer */
	}
	int r = bg_join(&b);
	ck_assert_int_eq(fs_expect(f, KVS_OP_REGISTER, 100), -1);
	if (conn >= 0 && how != 1)
		close(conn);
	close_fds(&b);
	return r;
}

START_TEST(broker_failures_fail_the_registration)
{
	fs f;
	fs_start(&f, 1000);
	kvs_client *c = open_client(&f, 0);
	ck_assert_int_eq(register_against(&f, c, 0, 3000), KVS_E_AUTH);
	ck_assert_int_eq(register_against(&f, c, 1, 3000), -ECONNRESET);
	uint64_t t0 = kvs_now_ms();
	ck_assert_int_eq(register_against(&f, c, 2, 300), KVS_E_TIMEOUT);
	ck_assert_uint_lt(kvs_now_ms() - t0, 1500);
	/* and heartbeats went on meanwhile: the session is fine */
	ck_assert_uint_eq(client_stat(&f, c, "sessions"), 1);
	fs_broker_close(&f);
	int r = register_against(&f, c, 3, 3000);
	ck_assert_msg(r == -ENOENT || r == -ECONNREFUSED, "no broker: %d", r);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

/* ---- restarts ---- */

static int do_unregister(bg *b) { return kvs_unregister(b->c, b->handle, 2000); }

/* Restarts the fake (new epoch, the session forgotten) and walks the client
 * through its re-open up to the first re-registration's push, read (n
 * entries, into e) but not answered: the broker connection. */
static int restart_until_push(fs *f, int n, kvs_broker_entry *e)
{
	fs_new_epoch(f);
	ck_assert_int_eq(fs_expect(f, KVS_OP_HEARTBEAT, 1000), 0);
	fs_err(f, KVS_OP_HEARTBEAT, f->rq.id, KVS_E_SESSION, "unknown session");
	ck_assert_int_eq(fs_expect(f, KVS_OP_HELLO, 1000), 0);
	fs_hello_ok(f, f->rq.id);
	int conn = fs_broker_accept(f, 2000);
	ck_assert_int_ge(conn, 0);
	int fds[KVS_BROKER_MAX_FDS];
	ck_assert_int_eq(fs_broker_read(conn, e, fds, 2000), n);
	close_all(fds, n);
	return conn;
}

/* The fake restarts (new epoch, forgets the session); the client's next
 * heartbeat is answered E_SESSION; it re-opens and re-registers. */
START_TEST(restart_reopens_and_restores_without_stalling)
{
	fs f;
	fs_start(&f, 20);
	kvs_client *c = open_client(&f, 0);
	bg reg;
	uint64_t h = register_n(&f, c, 4, 41, &reg);
	uint64_t old_session = kvs_client_session(c);
	uint8_t first_tokens[16];
	memcpy(first_tokens, f.rq.allocs[0].token, 16);

	fs_new_epoch(&f);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_HEARTBEAT, 1000), 0);
	fs_err(&f, KVS_OP_HEARTBEAT, f.rq.id, KVS_E_SESSION, "unknown session");
	ck_assert_int_eq(fs_expect(&f, KVS_OP_HELLO, 1000), 0);
	fs_hello_ok(&f, f.rq.id);

	/* the push: the client connects; the fake holds its reply back while
	 * heartbeats of the new session keep arriving and an application request
	 * queued meanwhile waits for the restore */
	int conn = fs_broker_accept(&f, 2000);
	ck_assert_int_ge(conn, 0);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int fds[KVS_BROKER_MAX_FDS];
	ck_assert_int_eq(fs_broker_read(conn, e, fds, 2000), 4);
	for (int i = 0; i < 4; i++)
		ck_assert(same_file(fds[i], reg.fds[i]));
	close_all(fds, 4);
	ck_assert_int_ne(memcmp(e[0].token, first_tokens, 16), 0); /* fresh tokens */
	bg lk = {.f = &f, .c = c, .timeout_ms = 3000};
	bg_start(&lk, do_lookup);
	f.heartbeats = 0;
	fs_serve_heartbeats(&f, 200); /* a lookup here would fail the test */
	ck_assert_int_ge(f.heartbeats, 5);
	ck_assert_uint_eq(f.hb_session, f.session);
	ck_assert_uint_ne(f.session, old_session);
	ck_assert_int_eq(atomic_load(&events_reconnected), 0);

	fs_broker_reply(conn, 0);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_REGISTER, 2000), 0);
	ck_assert_uint_eq(f.rq.session, f.session);
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(memcmp(f.rq.allocs[i].token, e[i].token, 16), 0);
	kvs_msg rep = {.op = KVS_OP_REGISTER, .id = f.rq.id, .ok = true, .registration = 42};
	fs_send(&f, &rep);
	/* restored: the event, then the held lookup goes out */
	ck_assert_int_eq(fs_expect(&f, KVS_OP_LOOKUP, 2000), 0);
	ck_assert_int_eq(atomic_load(&events_reconnected), 1);
	ck_assert_int_eq(atomic_load(&last_event_error), 0);
	ck_assert_uint_eq(kvs_client_reconnects(c), 1);
	uint8_t tiers[1] = {KVS_TIER_L1};
	rep = (kvs_msg){.op = KVS_OP_LOOKUP, .id = f.rq.id, .ok = true, .hits = 1, .tiers = tiers,
			.n_tiers = 1};
	fs_send(&f, &rep);
	ck_assert_int_eq(bg_join(&lk), 0);
	close(conn);
	/* the handle maps to the new registration id */
	bg un = {.f = &f, .c = c, .handle = h};
	bg_start(&un, do_unregister);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_UNREGISTER, 2000), 0);
	ck_assert_uint_eq(f.rq.registration, 42);
	fs_ok(&f, KVS_OP_UNREGISTER, f.rq.id);
	ck_assert_int_eq(bg_join(&un), 0);
	close_fds(&reg);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST


START_TEST(new_epoch_on_an_application_reply)
{
	fs f;
	fs_start(&f, 1000);
	kvs_client *c = open_client(&f, 0);
	bg b = {.f = &f, .c = c, .timeout_ms = 2000};
	bg_start(&b, do_lookup);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_LOOKUP, 3000), 0);
	fs_new_epoch(&f);
	uint8_t tiers[1] = {KVS_TIER_L1};
	kvs_msg rep = {.op = KVS_OP_LOOKUP, .id = f.rq.id, .ok = true, .hits = 1, .tiers = tiers,
		       .n_tiers = 1};
	fs_send(&f, &rep);
	/* answered by a server that forgot us: E_SESSION, and a re-open */
	ck_assert_int_eq(bg_join(&b), KVS_E_SESSION);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_HELLO, 1000), 0);
	fs_hello_ok(&f, f.rq.id);
	/* nothing to restore: reconnected at once */
	ck_assert_uint_eq(client_stat(&f, c, "sessions"), 1);
	ck_assert_uint_eq(kvs_client_reconnects(c), 1);
	ck_assert_int_eq(atomic_load(&events_reconnected), 1);
	ck_assert_uint_eq(kvs_client_session(c), f.session);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

START_TEST(failed_reopen_is_retried)
{
	fs f;
	fs_start(&f, 20);
	kvs_client *c = open_client(&f, 0);
	fs_new_epoch(&f);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_HEARTBEAT, 1000), 0);
	fs_err(&f, KVS_OP_HEARTBEAT, f.rq.id, KVS_E_SESSION, "unknown session");
	ck_assert_int_eq(fs_expect(&f, KVS_OP_HELLO, 1000), 0);
	fs_err(&f, KVS_OP_HELLO, f.rq.id, KVS_E_INTERNAL, "not now");
	/* no heartbeats without a session; the next heartbeat time retries */
	ck_assert_int_eq(fs_recv(&f, 1000), 0);
	ck_assert_int_eq(f.rq.op, KVS_OP_HELLO);
	fs_hello_ok(&f, f.rq.id);
	fs_serve_heartbeats(&f, 100);
	ck_assert_uint_eq(f.hb_session, f.session);
	ck_assert_uint_eq(kvs_client_reconnects(c), 1);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

START_TEST(restore_keeps_registration_order)
{
	fs f;
	fs_start(&f, 50);
	kvs_client *c = open_client(&f, 0);
	bg r1, r2;
	register_n(&f, c, 2, 11, &r1);
	register_n(&f, c, 3, 12, &r2);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int fds[KVS_BROKER_MAX_FDS];
	/* oldest first, so the newest is the session's registration at the end */
	int conn = restart_until_push(&f, 2, e);
	fs_broker_reply(conn, 0);
	ck_assert_int_eq(fs_broker_read(conn, e, fds, 2000), 3);
	close_all(fds, 3);
	fs_broker_reply(conn, 0);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_REGISTER, 2000), 0);
	ck_assert_uint_eq(f.rq.n_allocs, 2);
	kvs_msg rep = {.op = KVS_OP_REGISTER, .id = f.rq.id, .ok = true, .registration = 21};
	fs_send(&f, &rep);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_REGISTER, 2000), 0);
	ck_assert_uint_eq(f.rq.n_allocs, 3);
	rep = (kvs_msg){.op = KVS_OP_REGISTER, .id = f.rq.id, .ok = true, .registration = 22};
	fs_send(&f, &rep);
	ck_assert_uint_eq(client_stat(&f, c, "client_broker_records"), 4);
	ck_assert_uint_eq(kvs_client_reconnects(c), 1);
	ck_assert_int_eq(atomic_load(&last_event_error), 0);
	close(conn);
	close_fds(&r1);
	close_fds(&r2);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

START_TEST(restore_push_times_out)
{
	fs f;
	fs_start(&f, 20);
	kvs_client *c = open_client(&f, 300); /* the restore's requests time out after 300 ms */
	bg reg;
	register_n(&f, c, 2, 31, &reg);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int conn = restart_until_push(&f, 2, e);
	/* never answered: heartbeats go on, the registration fails in time */
	f.heartbeats = 0;
	fs_serve_heartbeats(&f, 600);
	ck_assert_int_ge(f.heartbeats, 10);
	ck_assert_int_eq(atomic_load(&events_reconnected), 1);
	ck_assert_int_eq(atomic_load(&last_event_error), KVS_E_TIMEOUT);
	ck_assert_uint_eq(kvs_client_reconnects(c), 1);
	close(conn);
	close_fds(&reg);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

START_TEST(unregister_during_restore_leaves_no_orphan)
{
	fs f;
	fs_start(&f, 50);
	kvs_client *c = open_client(&f, 0);
	bg reg;
	uint64_t h = register_n(&f, c, 2, 51, &reg);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int conn = restart_until_push(&f, 2, e);
	/* the application unregisters while the push is in flight: its request
	 * waits for the restore */
	bg un = {.f = &f, .c = c, .handle = h};
	bg_start(&un, do_unregister);
	fs_serve_heartbeats(&f, 100);
	fs_broker_reply(conn, 0);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_REGISTER, 2000), 0);
	kvs_msg rep = {.op = KVS_OP_REGISTER, .id = f.rq.id, .ok = true, .registration = 52};
	fs_send(&f, &rep);
	/* the restored registration is unregistered by the client itself, and
	 * the application's request (naming no live id) is answered E_NOREG */
	bool orphan = false, app = false;
	while (!orphan || !app) {
		ck_assert_int_eq(fs_expect(&f, KVS_OP_UNREGISTER, 2000), 0);
		if (f.rq.registration == 52) {
			ck_assert(!orphan);
			orphan = true;
			fs_ok(&f, KVS_OP_UNREGISTER, f.rq.id);
		} else {
			ck_assert(!app);
			app = true;
			fs_err(&f, KVS_OP_UNREGISTER, f.rq.id, KVS_E_NOREG, "no such registration");
		}
	}
	ck_assert_int_eq(bg_join(&un), KVS_E_NOREG);
	/* gone for the client: a second unregister knows no such handle */
	ck_assert_int_eq(kvs_unregister(c, h, 100), KVS_E_NOREG);
	close(conn);
	close_fds(&reg);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

static atomic_int async_code;
static void async_done(const kvs_result *res, void *arg)
{
	(void)arg;
	atomic_store(&async_code, res->code);
}

START_TEST(close_cancels_what_is_left)
{
	fs f;
	fs_start(&f, 50);
	kvs_client *c = open_client(&f, 0);
	bg reg;
	register_n(&f, c, 2, 61, &reg);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	int conn = restart_until_push(&f, 2, e);
	/* a request held for the restore, and the restore's push in flight */
	uint8_t keys[32] = {0};
	atomic_store(&async_code, 1);
	ck_assert_int_eq(kvs_lookup_async(c, keys, 1, false, 0, 5000, async_done, NULL), 0);
	fs_serve_heartbeats(&f, 50);
	close_client(&f, c);
	ck_assert_int_eq(atomic_load(&async_code), -ECANCELED);
	ck_assert_int_eq(atomic_load(&last_event_error), -ECANCELED);
	close(conn);
	close_fds(&reg);
	fs_stop(&f);
}
END_TEST

/* ---- the job lane (protocol.md §18) ------------------------------------------------ */

/* One frame from the lane within timeout_ms, decoded into *rq (its bytes in
 * *buf, freed by the caller): 0, or -1 (timeout, hang-up, bad frame). */
static int lane_read(int fd, kvs_msg *rq, void **buf, int timeout_ms)
{
	uint8_t hdr[4];
	size_t got = 0;
	uint8_t *b = NULL;
	uint32_t n = 0;
	for (;;) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, timeout_ms) != 1)
			break;
		ssize_t r = got < 4 ? read(fd, hdr + got, 4 - got) : read(fd, b + got - 4, n - (got - 4));
		if (r <= 0)
			break;
		got += (size_t)r;
		if (got == 4) {
			n = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 | (uint32_t)hdr[3] << 24;
			b = malloc(n ? n : 1);
		}
		if (got >= 4 && got == 4 + (size_t)n) {
			kvs_proto_err err;
			if (kvs_proto_decode(b, n, false, rq, &err) != 0)
				break;
			*buf = b;
			return 0;
		}
	}
	free(b);
	return -1;
}

static void lane_send(fs *f, int fd, kvs_msg *rep)
{
	rep->is_reply = true;
	memcpy(rep->epoch, f->epoch, KVS_EPOCH_BYTES);
	void *buf;
	size_t len;
	ck_assert_int_eq(kvs_proto_encode(rep, &buf, &len), 0);
	uint8_t hdr[4] = {(uint8_t)len, (uint8_t)(len >> 8), (uint8_t)(len >> 16), (uint8_t)(len >> 24)};
	ck_assert_int_eq(write(fd, hdr, 4), 4);
	ck_assert_int_eq(write(fd, buf, len), (ssize_t)len);
	free(buf);
}

/* Opens a client with lanes on: answers its hello, takes the socket its
 * attach pushes (checked to be one end of an AF_UNIX stream pair) and
 * returns it in *lane; the `lane` request is in f->rq, unanswered, and the
 * open still waits for it (b). */
/* Takes a lane attach after a hello: the socket its push parks (checked to
 * be one end of an AF_UNIX stream pair) and the `lane` request naming it,
 * left unanswered in f->rq. Returns the socket. */
static int take_attach(fs *f)
{
	int conn = fs_broker_accept(f, 3000);
	ck_assert_int_ge(conn, 0);
	kvs_broker_entry e[1];
	int fds[KVS_BROKER_MAX_FDS];
	ck_assert_int_eq(fs_broker_read(conn, e, fds, 3000), 1);
	int type = 0, domain = 0;
	socklen_t l = sizeof(type);
	ck_assert_int_eq(getsockopt(fds[0], SOL_SOCKET, SO_TYPE, &type, &l), 0);
	l = sizeof(domain);
	ck_assert_int_eq(getsockopt(fds[0], SOL_SOCKET, SO_DOMAIN, &domain, &l), 0);
	ck_assert_int_eq(type, SOCK_STREAM);
	ck_assert_int_eq(domain, AF_UNIX);
	fs_broker_reply(conn, 0);
	ck_assert_int_eq(fs_expect(f, KVS_OP_LANE, 3000), 0);
	ck_assert_uint_eq(f->rq.session, f->session);
	ck_assert_int_eq(memcmp(f->rq.lane_token, e[0].token, 16), 0);
	close(conn);
	return fds[0];
}

/* The next frame on the lane that is not a heartbeat (heartbeats answered
 * on the way) into *rq; returns its bytes (free them after kvs_msg_clear). */
static void *lane_expect(fs *f, int lane, kvs_msg *rq)
{
	void *buf = NULL;
	for (;;) {
		ck_assert_int_eq(lane_read(lane, rq, &buf, 3000), 0);
		if (rq->op != KVS_OP_HEARTBEAT)
			return buf;
		kvs_msg hb = {.op = KVS_OP_HEARTBEAT, .id = rq->id, .ok = true};
		lane_send(f, lane, &hb);
		kvs_msg_clear(rq);
		free(buf);
	}
}

static void open_attaching(fs *f, bg *b, int *lane)
{
	setenv("KVS_LANE", "1", 1);
	*b = (bg){.f = f};
	bg_start(b, do_open);
	ck_assert_int_eq(fs_expect(f, KVS_OP_HELLO, 3000), 0);
	fs_hello_ok(f, f->rq.id);
	*lane = take_attach(f);
	/* kvs_client_open waits for the attach to end */
	usleep(50000);
	ck_assert_int_eq(pthread_tryjoin_np(b->t, NULL), EBUSY);
	setenv("KVS_LANE", "0", 1);
}

/* A client whose lane the server attached: open_attaching, the `lane`
 * request answered, kvs_client_open returned. */
static kvs_client *open_laned(fs *f, int *lane)
{
	bg b;
	open_attaching(f, &b, lane);
	fs_ok(f, KVS_OP_LANE, f->rq.id);
	ck_assert_int_eq(bg_join(&b), 0);
	return b.c;
}

/* A server without lanes answers E_UNKNOWN_OP: the client stays on ZeroMQ.
 * While the attach waits, heartbeats go on (the session must not lapse). */
START_TEST(lane_refused_stays_on_zmq)
{
	fs f;
	fs_start(&f, 20);
	bg b;
	int lane;
	open_attaching(&f, &b, &lane);
	uint64_t lane_id = f.rq.id;
	int hb0 = f.heartbeats;
	fs_serve_heartbeats(&f, 300);
	ck_assert_int_ge(f.heartbeats - hb0, 5); /* every 20 ms, over ZeroMQ */
	fs_err(&f, KVS_OP_LANE, lane_id, KVS_E_UNKNOWN_OP, "op 'lane' is not served");
	ck_assert_int_eq(bg_join(&b), 0);
	kvs_client *c = b.c;
	/* the client closed its end: ours reads end of stream */
	char x;
	ck_assert_int_eq(read(lane, &x, 1), 0);
	close(lane);
	ck_assert_uint_eq(client_stat(&f, c, "client_lane_up"), 0); /* answered over ZeroMQ */
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

/* An attached lane carries the requests both ways; once the server closes
 * it, requests go over ZeroMQ again. */
START_TEST(lane_carries_requests_until_closed)
{
	fs f;
	fs_start(&f, 1000);
	int lane;
	kvs_client *c = open_laned(&f, &lane);
	/* a stats request comes on the lane, its reply goes back on it */
	bg s = {.f = &f, .c = c};
	bg_start(&s, do_stats);
	kvs_msg rq = {0};
	void *buf = lane_expect(&f, lane, &rq);
	ck_assert_int_eq(rq.op, KVS_OP_STATS);
	kvs_counter cs[1] = {{kvs_str_c("sessions"), 7}};
	kvs_msg rep = {.op = KVS_OP_STATS, .id = rq.id, .ok = true, .counters = cs, .n_counters = 1};
	lane_send(&f, lane, &rep);
	kvs_msg_clear(&rq);
	free(buf);
	ck_assert_int_eq(bg_join(&s), 0);
	ck_assert_uint_eq(kvs_stat_find(s.stats, s.n, "sessions"), 7);
	ck_assert_uint_eq(kvs_stat_find(s.stats, s.n, "client_lane_up"), 1);
	ck_assert_uint_ge(kvs_stat_find(s.stats, s.n, "client_lane_frames_in"), 1);
	/* nothing came over ZeroMQ meanwhile but heartbeats */
	fs_serve_heartbeats(&f, 20);
	/* the server closes the lane: the next request comes over ZeroMQ */
	close(lane);
	usleep(50000);
	ck_assert_uint_eq(client_stat(&f, c, "client_lane_up"), 0);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

/* A request that went over the lane when the server died is lost with the
 * lane: at the re-open it fails with KVS_E_SESSION (its timeout, 30 s, would
 * give KVS_E_TIMEOUT), and the restore attaches a new lane. */
START_TEST(lane_requests_fail_at_a_restart)
{
	fs f;
	fs_start(&f, 100);
	int lane;
	kvs_client *c = open_laned(&f, &lane);
	bg l = {.f = &f, .c = c, .timeout_ms = 30000};
	bg_start(&l, do_lookup);
	kvs_msg rq = {0};
	void *buf = lane_expect(&f, lane, &rq); /* the lookup, on the lane */
	ck_assert_int_eq(rq.op, KVS_OP_LOOKUP);
	kvs_msg_clear(&rq);
	free(buf);
	/* the server dies unanswered: the lane closes, the next server has a
	 * new epoch, which the next heartbeat (over ZeroMQ now) meets */
	close(lane);
	fs_new_epoch(&f);
	ck_assert_int_eq(fs_expect(&f, KVS_OP_HEARTBEAT, 3000), 0);
	fs_ok(&f, KVS_OP_HEARTBEAT, f.rq.id);
	ck_assert_int_eq(bg_join(&l), KVS_E_SESSION);
	/* the re-open: hello, then the restore's lane attach (refused here) */
	ck_assert_int_eq(fs_expect(&f, KVS_OP_HELLO, 3000), 0);
	fs_hello_ok(&f, f.rq.id);
	lane = take_attach(&f);
	fs_err(&f, KVS_OP_LANE, f.rq.id, KVS_E_UNKNOWN_OP, "op 'lane' is not served");
	close(lane);
	ck_assert_uint_eq(client_stat(&f, c, "client_lane_up"), 0);
	ck_assert_uint_eq(kvs_client_reconnects(c), 1);
	close_client(&f, c);
	fs_stop(&f);
}
END_TEST

static Suite *client_suite(void)
{
	/* the fake server below speaks ZeroMQ and the broker only: no job lane
	 * (protocol.md §18; the integration tests run the lane on the real
	 * server) */
	setenv("KVS_LANE", "0", 1);
	Suite *s = suite_create("client");
	TCase *tc = tcase_create("io");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, hello_and_heartbeats);
	tcase_add_test(tc, job_wait_polls_around_the_expected_end);
	tcase_add_test(tc, heartbeat_unanswered_waits_for_its_timeout);
	tcase_add_test(tc, results_are_marshalled_per_op);
	tcase_add_test(tc, timeouts_late_and_bad_replies);
	tcase_add_test(tc, register_sends_one_record);
	tcase_add_test(tc, register_256_allocations_in_two_records);
	tcase_add_test(tc, broker_failures_fail_the_registration);
	tcase_add_test(tc, restart_reopens_and_restores_without_stalling);
	tcase_add_test(tc, new_epoch_on_an_application_reply);
	tcase_add_test(tc, failed_reopen_is_retried);
	tcase_add_test(tc, restore_keeps_registration_order);
	tcase_add_test(tc, restore_push_times_out);
	tcase_add_test(tc, unregister_during_restore_leaves_no_orphan);
	tcase_add_test(tc, close_cancels_what_is_left);
	tcase_add_test(tc, lane_refused_stays_on_zmq);
	tcase_add_test(tc, lane_carries_requests_until_closed);
	tcase_add_test(tc, lane_requests_fail_at_a_restart);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(client_suite)
