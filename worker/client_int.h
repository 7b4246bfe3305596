/* libkvside internals shared by the client's files (not installed). One job
 * per file:
 *   client.c         the public API: open/close, requests, blocking helpers
 *   client_io.c      the I/O thread: poll loop, sending, replies, timeouts,
 *                    heartbeats, the restart (epoch) state machine
 *   client_broker.c  allocation fds to the server's fd broker: a non-blocking
 *                    state machine driven by the I/O thread's poll loop
 *   client_reg.c     registrations kept for re-registration: kvs_register,
 *                    kvs_unregister, the restore after a restart
 *   client_result.c  a reply turned into the kvs_result a callback sees
 * Threads: application threads build and queue requests (submit queue under
 * mu, eventfd); everything else here belongs to the I/O thread unless a field
 * says otherwise. */
#ifndef KVS_CLIENT_INT_H
#define KVS_CLIENT_INT_H

#include <pthread.h>
#include <sys/types.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvs_frame.h"
#include "kvs_htab.h"
#include "kvs_proto.h"
#include "kvside.h"

#define KVS__JOB_RING 4096
#define KVS__BROKER_TIMEOUT_MS 2000 /* a broker record must be answered within this */

typedef struct kvs__req kvs__req;
typedef struct kvs__creg kvs__creg;
typedef void (*kvs__internal_fn)(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code);

/* A registration's fds on their way to the broker, attached to the
 * `register` request that claims them (client_broker.c). */
typedef struct kvs__push {
	kvs__creg *g;  /* holds a reference */
	uint32_t next; /* allocations [0, next) are parked (or have no fd to send) */
	uint32_t upto; /* the record in flight carries the fds of [next, upto) */
	uint8_t tokens[KVS_MAX_ALLOCS][16]; /* fresh per push; the message names them */
} kvs__push;

/* A request from submission to its one completion. Owned by the submit
 * queue, then by the I/O thread: the broker queue (while its push runs), the
 * held list (queued during a restore) or the pending table (sent), then
 * freed after its completion ran. */
struct kvs__req {
	uint64_t id; /* key in pending */
	kvs_op op;
	void *buf; /* the encoded message; freed once sent */
	size_t len;
	uint64_t deadline_ms;
	kvs_done_fn done;
	void *arg;
	kvs__internal_fn internal; /* I/O-thread bookkeeping instead of done */
	void *iarg;
	kvs__push *push; /* register: fds the broker must have before the message leaves */
	bool on_lane;    /* written on the job lane: only that lane's server answers it */
	kvs__req *next;
};

/* A registration the client keeps so it can restore it after a restart.
 * Every field but server_id and next is immutable once created. */
struct kvs__creg {
	uint64_t handle;    /* stable, returned to the application */
	uint64_t server_id; /* current id on the server (0 while being restored); reg_mu */
	int device_type;
	uint8_t uuid[16];
	kvs_alloc *allocs; /* fds are our duplicates, closed when refs drops to 0; fd < 0: legacy CUDA IPC (ipc_handle) */
	uint32_t n_allocs;
	kvs_group *groups;
	uint32_t n_groups;
	kvs_layer *layers;
	uint32_t n_layers;
	/* one for the client's list (or kvs_register's attempt before it joins
	 * the list), one per push in flight: a push may outlive kvs_unregister */
	atomic_uint refs;
	kvs__creg *next; /* reg_mu; the list is oldest first */
};

/* Restart state (I/O thread). */
enum kvs__reopen {
	KVS__REOPEN_NONE,
	KVS__REOPEN_HELLO,   /* the new hello is in flight: no session to keep alive yet */
	KVS__REOPEN_RESTORE, /* re-registering: heartbeats go on, application requests wait */
};

/* The I/O thread's connection to the fd broker (client_broker.c). */
typedef struct kvs__bconn {
	int fd;               /* -1: not connected */
	int state;            /* enum in client_broker.c */
	uint64_t deadline_ms; /* the reply to the record in flight is due by then */
	uint64_t retry_ms;    /* not connected: try again then (listen backlog full) */
	kvs__req *head, *tail; /* requests whose pushes run, FIFO; the head's is in flight */
} kvs__bconn;

/* The session's job lane (client_lane.c, protocol.md §18). */
enum kvs__lane_state {
	KVS__LANE_OFF,
	KVS__LANE_ATTACHING, /* the `lane` request is out: application requests are held */
	KVS__LANE_UP,
};

typedef struct kvs__lane {
	bool enabled; /* immutable after open: an ipc endpoint and KVS_LANE is not 0 */
	/* guarded by mu (application threads write to the lane) */
	int fd;       /* -1: none; closed by the I/O thread only */
	bool direct;  /* up, no restore, nothing held: application threads may write */
	bool broken;  /* a write failed: the I/O thread closes it */
	uint8_t *out; /* [out_off, out_len) of a frame (or more) the socket would not take yet */
	size_t out_off, out_len, out_cap;
	kvs__req *sent_head, *sent_tail; /* written by application threads, not in pending yet */
	atomic_int n_sent;               /* sent_head != NULL (read without mu as a hint) */
	bool opening; /* the attach after the first hello runs: kvs_client_open waits (job_cv) */
	uint64_t frames_out, direct_writes;
	/* I/O thread only */
	int state;  /* enum kvs__lane_state */
	int new_fd; /* our end while attaching, else -1 */
	kvs_frame_in in; /* received bytes not handled yet */
	uint64_t frames_in;
} kvs__lane;

/* The client's own counters, appended to kvs_stats() results (I/O thread). */
typedef struct kvs__cstats {
	uint64_t heartbeats;      /* heartbeats sent */
	uint64_t hb_delay_max_us; /* largest delay between a heartbeat falling due and
				     the I/O thread attending to it */
	uint64_t broker_records;  /* broker records sent */
	uint64_t broker_fds;      /* fds sent in them */
} kvs__cstats;

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
	pid_t pid; /* the process that opened it: in a forked child (another pid)
	            * every call fails at once (kvs__forked) and close releases
	            * nothing the parent's client still uses */

	/* submit queue: guarded by mu */
	pthread_mutex_t mu;
	kvs__req *q_head, *q_tail;
	bool draining; /* the I/O thread is routing what it took from the queue */
	bool stop;
	int efd;
	atomic_uint_fast64_t next_id;
	atomic_uint_fast64_t session;
	atomic_uint_fast64_t reconnects;
	atomic_bool closing; /* kvs_client_close began: no heartbeats, no re-open */
	atomic_bool packed_blocks; /* the session's server reads packed block lists (its hello said so) */

	/* registrations: guarded by reg_mu */
	pthread_mutex_t reg_mu;
	kvs__creg *regs;
	uint64_t next_handle;

	/* job_done ring: guarded by mu, signalled on job_cv */
	pthread_cond_t job_cv;
	struct { uint64_t job; int state; } ring[KVS__JOB_RING];
	uint64_t ring_n;
	/* Hybrid polling (kvs_job_wait, on unless KVS_HYBRID_POLL=0): how long
	 * recent waits took (an average, 0 = none yet; guarded by mu), and
	 * until when the I/O thread polls without sleeping because a wait
	 * expects its job's end about now (kvs_now_ns clock; 0 = not). */
	bool hybrid_poll;
	uint64_t wait_avg_ns;
	uint64_t hybrid_windows, hybrid_hits; /* windows polled; job ends seen in one (mu) */
	_Atomic uint64_t io_spin_until_ns;

	/* I/O thread only */
	void *zctx, *dealer;
	void *monitor; /* tcp:// only, during kvs_client_open: the PAIR end of the dealer's monitor (client_reach.c) */
	/* The dealer's ZMQ_FD, which the I/O thread polls instead of calling
	 * zmq_poll (a getpid and a poll of the dealer's own on every pass): it
	 * only says that the socket's state may have changed, and a send or a
	 * receive may take that signal while replies wait, so ZMQ_EVENTS is
	 * asked after it fires and, when dealer_check is set (after the thread
	 * used the socket), before the next poll. */
	int dealer_fd;
	bool dealer_check;
	kvs_htab *pending;
	uint8_t epoch[KVS_EPOCH_BYTES];
	bool have_epoch;
	int reopen; /* enum kvs__reopen */
	int restore_left, restore_err;
	kvs__req *held_head, *held_tail; /* application requests queued during a restore */
	uint64_t hb_ms, next_hb_ms;
	/* KVS_BUSY_POLL_US: the I/O thread polls without sleeping this long
	 * after its last message, and kvs_job_wait checks for its job_done as
	 * long before it sleeps (0: never). last_io_ns is the I/O thread's. */
	uint64_t busy_poll_ns, last_io_ns;
	bool hb_inflight;
	bool exiting; /* the loop ended: whatever is routed now fails with -ECANCELED */
	kvs__bconn broker;
	kvs__cstats cst;
	kvs__lane lane;
};

/* A blocking call's rendezvous with the I/O thread (client.c). */
typedef struct kvs__waiter {
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
} kvs__waiter;

/* ---- requests (client_io.c) ---- */

/* Wakes the I/O thread (its eventfd). */
/* True in a process forked after c was opened: the I/O thread, the session
 * and the lane are the parent's. Logs the first time. Callers return
 * KVS_E_SESSION before they touch a lock (the parent's threads may have held
 * one at the fork). */
bool kvs__forked(kvs_client *c);
void kvs__wake(kvs_client *c);
int kvs__timeout_of(kvs_client *c, int timeout_ms);
/* Encodes msg (assigning its id) into a new request due within timeout_ms
 * (0: the client's default). Returns 0, -ENOMEM or KVS_E_LIMIT. */
int kvs__req_new(kvs_client *c, kvs_msg *msg, int timeout_ms, kvs__req **ret);
/* Frees r, its buffer and its push (dropping the registration reference). */
void kvs__req_free(kvs__req *r);
/* Queues r for the I/O thread; on failure (-ECANCELED: closing) frees r. */
int kvs__req_submit(kvs_client *c, kvs__req *r);
/* kvs__req_new + kvs__req_submit with a completion. */
int kvs__submit(kvs_client *c, kvs_msg *msg, int timeout_ms, kvs_done_fn done, void *arg,
		kvs__internal_fn internal, void *iarg);
/* I/O thread: puts r in the pending table and sends it (or finishes it with
 * the error). */
void kvs__send(kvs_client *c, kvs__req *r);
void *kvs__io_main(void *arg);
/* I/O thread: one registration of a restore ended with code. */
void kvs__restore_step_done(kvs_client *c, int code);

/* I/O thread: one message from the server (DEALER or lane). */
void kvs__handle_reply(kvs_client *c, const void *data, size_t len);
/* I/O thread: routes the requests held during a restore or a lane attach. */
void kvs__release_held(kvs_client *c);

/* ---- the job lane (client_lane.c) ---- */

void kvs__lane_init(kvs_client *c, bool enabled);
/* kvs__req_submit, mu held: writes r on the lane if application threads may.
 * 0: not taken (queue it); 1: written (r belongs to the sent list); 2: the
 * same, and bytes wait for room (wake the I/O thread); or an error. */
int kvs__lane_direct(kvs_client *c, kvs__req *r);
/* I/O thread (kvs__send, r already in pending): writes r on the lane if it
 * is up. false: send it over ZeroMQ. true: written, or failed and finished. */
bool kvs__lane_send(kvs_client *c, kvs__req *r);
/* I/O thread: moves the sent list into pending; true if it held any. */
bool kvs__lane_adopt(kvs_client *c);
/* I/O thread: starts attaching a lane to the current session (after a
 * hello, or as a restore step when restore). true if the request is out. */
bool kvs__lane_start(kvs_client *c, bool restore);
/* I/O thread: closes an up lane (why for the log). */
void kvs__lane_close(kvs_client *c, const char *why);
/* I/O thread: recomputes `direct` after the state, a restore or the held
 * list changed. */
void kvs__lane_update(kvs_client *c);
/* I/O thread: poll events for the lane fd (0: do not poll it), and the work
 * on its poll results. */
short kvs__lane_events(kvs_client *c);
void kvs__lane_run(kvs_client *c, short revents);
/* kvs_client_open: waits until the attach after the first hello ended. */
void kvs__lane_wait_open(kvs_client *c);
/* kvs_client_close, after the I/O thread ended. */
void kvs__lane_free(kvs_client *c);

/* ---- completions (client_result.c) ---- */

/* Runs r's completion (internal bookkeeping or the application's callback,
 * with the reply marshalled into a kvs_result) and frees r. rep may be NULL. */
void kvs__finish(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code);
/* kvs__req.internal of kvs_store_complete_async's request (client_result.c). */
void kvs__store_completed(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code);
/* A job's end (job_done, or a store-with-complete's terminal reply) into the
 * ring kvs_job_wait reads, and to the event callback (client_io.c). */
void kvs__job_done_push(kvs_client *c, const kvs_msg *rep);

/* ---- the broker push (client_broker.c; I/O thread) ---- */

/* A push of g's fds under fresh random tokens (takes a reference), or NULL. */
kvs__push *kvs__push_new(kvs__creg *g);
void kvs__push_free(kvs__push *p);
void kvs__broker_init(kvs__bconn *b);
/* Takes r (r->push set): its fds go to the broker, then r is sent. */
void kvs__broker_add(kvs_client *c, kvs__req *r);
/* Poll events the broker connection waits for (0: none, no fd to poll). */
short kvs__broker_events(const kvs_client *c);
/* Milliseconds until kvs__broker_run has work without an event, or -1. */
long kvs__broker_wait_ms(const kvs_client *c, uint64_t now);
/* Advances every push as far as it goes without blocking; revents are the
 * broker fd's poll results (0 if it was not polled). */
void kvs__broker_run(kvs_client *c, uint64_t now, short revents);
/* Finishes every queued request with code and closes the connection. */
void kvs__broker_cancel(kvs_client *c, int code);

/* ---- registrations (client_reg.c) ---- */

void kvs__creg_unref(kvs__creg *g);
/* I/O thread, after the hello of a re-open: queues a `register` (after its
 * broker push) for every kept registration, oldest first. Returns how many
 * were queued; failures to queue go to kvs__restore_step_done as well. */
int kvs__restore(kvs_client *c);
/* kvs_client_close: drops every kept registration. */
void kvs__regs_free(kvs_client *c);

/* ---- blocking helpers (client.c) ---- */

void kvs__waiter_done(const kvs_result *res, void *arg);
bool kvs__on_io_thread(kvs_client *c);
/* Submits r with w as its completion and waits for it (the I/O thread
 * guarantees one, a timeout included). Returns the result's code. */
int kvs__call_req(kvs_client *c, kvs__req *r, kvs__waiter *w);
int kvs__call(kvs_client *c, kvs_msg *m, int timeout_ms, kvs__waiter *w);

/* Reaching the server (client_reach.c). kvs__reach_ipc: 0, or a negative
 * errno with the cause in why (directory missing, permission denied, no
 * server listening); 0 for endpoints other than ipc://. The monitor watches
 * a tcp:// dealer during kvs_client_open; explain turns what it saw into
 * why. kvs__last_error_set sets this thread's kvs_last_error(). */
int kvs__reach_ipc(const char *endpoint, char *why, size_t cap);
int kvs__monitor_start(kvs_client *c);
void kvs__monitor_explain(kvs_client *c, int timeout_ms, char *why, size_t cap);
void kvs__monitor_stop(kvs_client *c);
void kvs__last_error_set(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
