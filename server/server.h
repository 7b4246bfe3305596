/* kvside-server internals shared by the server's modules. Everything here is
 * owned by the main-loop thread; other threads (copy pool, L2) never touch
 * these structures and talk to the loop only through queues + the eventfd. */
#ifndef KVS_SERVER_H
#define KVS_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "kvs_error.h"
#include "kvs_htab.h"
#include "kvs_proto.h"

#define KVS_MAX_IDENT 256
#define KVS_MAX_BROKER_CONNS 64
#define KVS_MAX_PARKED 4096
#define KVS_BROKER_CONN_IDLE_MS 5000
#define KVS_TICK_MS 50
/* memory the server needs beside L1 (its metadata, threads, sockets,
 * buffers): kept free when l1-size is checked against its memory room */
#define KVS_SERVER_OWN_BYTES (256ull << 20)

typedef struct kvs_server_config {
	char listen[512];       /* ZeroMQ endpoint; "" = ipc://<broker_dir>/kvside.zmq */
	char broker_dir[256];   /* run directory holding kvside.sock */
	uint64_t l1_size;       /* bytes of the L1 arena */
	bool l1_size_clamp;     /* l1-size above the memory the server may use: take what there is (else refuse) */
	uint64_t ttl_ms;        /* session lease */
	uint64_t heartbeat_ms;  /* advised client heartbeat period */
	uint64_t job_deadline_ms;
	uint64_t fd_park_ms;    /* unclaimed broker fds are closed after this */
	uint64_t drain_ms;      /* unregister waits this long for leases */
	uint32_t terminal_jobs; /* bounded table of terminal job ids */
	uint32_t copy_threads;  /* host copy pool */
	uint32_t max_sessions;  /* hello beyond this many open sessions: E_LIMIT */
	uint64_t max_peer_queue; /* bytes of replies waiting for one peer (then it is cut off) */
	uint64_t max_queued;     /* bytes of replies waiting for all peers */
	bool insecure_tcp;       /* tcp:// without CURVE */
	char state_dir[256];     /* the server's CURVE key pair (tcp://) */
	char authorized_keys[256]; /* client public keys; "" = <state_dir>/authorized_keys */
	int log_level;
	int log_format;         /* enum kvs_log_format */
	char kv_events[256];        /* ZeroMQ PUB endpoint of KV events; "" = off */
	char kv_events_replay[256]; /* ROUTER endpoint replaying recent batches; "" = none */
	char kv_events_topic[128];
	uint32_t kv_events_buffer;  /* batches kept for replay */
	uint64_t kv_events_buffer_bytes; /* and the bytes they may hold */
	long allow_uid;         /* extra UID allowed on the broker, -1 = none */
	char l2_path[256];      /* LMDB environment directory; "" = no L2 tier */
	uint64_t l2_size;       /* LMDB map size */
	int l2_sync;            /* enum kvs_l2_sync */
	bool l2_verify;         /* walk data.mdb's structure at start (kvs_l2_verify.h) */
	char l3_redis[512];     /* Redis Cluster seeds of the L3 tier; "" = no L3 */
	char l3_user[128];
	char l3_password[256];
	char l3_prefix[64];     /* key prefix in the cluster */
	int l3_write;           /* enum kvs_l3_write_policy */
	uint64_t l3_part_bytes; /* largest L3 value; larger objects are split */
	uint64_t l3_timeout_ms; /* one wait for a node (a call: twice) */
	uint64_t l3_lookup_ms;  /* a lookup's longest wait for L3 */
	bool l1_prefault;       /* fault the arena in at start (background) */
	bool allow_unsealed;    /* accept memfds that cannot get F_SEAL_SHRINK (copies guarded) */
	char metrics_listen[128]; /* HOST:PORT of the metrics/health HTTP endpoint; "" = off */
	uint64_t metrics_stall_ms; /* /healthz fails when the loop has not ticked for this long */
	uint64_t cuda_staging;  /* device staging bytes per CUDA registration; 0 = kernel only */
	uint64_t cuda_stage_min; /* stage a part when its L1 runs average at least this */
	uint32_t cuda_poll_us;  /* the loop spins on a GPU part's end event this long after queueing it */
	uint64_t copy_wave;     /* first wave of a long part's copies, bytes (plan.h; 0: whole parts) */
	uint32_t copy_spin_us;  /* a host copy thread polls for the next task this long (copy_host.h) */
} kvs_server_config;

void kvs_server_config_defaults(kvs_server_config *cfg);

/* Connections shed because the process was out of fds (fdguard.c, in the
 * executable; the stat accepts_shed reads it). */
extern atomic_uint_fast64_t kvs_accept_shed;
/* fdguard.c: opens the reserve descriptor; main() calls it first. */
void kvs_fdguard_init(void);

typedef struct kvs_server kvs_server;

/* Creates the server: run directory, broker socket, ROUTER socket, eventfd.
 * Returns 0 or a negative code, logging why. */
int kvs_server_create(const kvs_server_config *cfg, kvs_server **ret);
/* Runs the main loop until SIGINT/SIGTERM arrive on sigfd. Returns 0 on a
 * clean shutdown. */
int kvs_server_run(kvs_server *srv, int sigfd);
void kvs_server_destroy(kvs_server *srv);

/* ---- internal (kvs__) -------------------------------------------------- */

/* A client session, in srv->sessions keyed by id.
 * Invariant: ident is the ZeroMQ routing id of the session's latest request,
 * so pushes and deferred replies reach its current connection. */
typedef struct kvs_session {
	uint64_t id; /* key */
	uint8_t ident[KVS_MAX_IDENT];
	size_t ident_len;
	char engine[KVS_MAX_STR + 1];
	char ns[KVS_MAX_STR + 1];
	uint8_t role;
	uint32_t rank, world;
	uint64_t expires_ms;
	/* A `register` of this session whose driver work runs on the setup
	 * thread (registry.c). While it is pending the session is never reaped
	 * (the wait is the server's, not the client's silence), and the
	 * session's later requests other than heartbeats are held, in order, and
	 * handled once it has been answered: a session's messages are handled in
	 * the order sent (protocol.md 6.4). */
	bool reg_pending;
	bool engine_wait; /* reg_pending because its CUDA register waits for the engine */
	struct kvs_held *held_head, *held_tail; /* FIFO of held requests */
	uint32_t n_held;
	uint64_t held_bytes;
	uint64_t lane_id; /* its job lane (lane.c), 0: none */
	/* opened over tcp:// with this CURVE key: closed when the key leaves
	 * authorized-keys (loop.c, auth.h) */
	bool keyed;
	uint8_t key[32];
} kvs_session;

/* A request held while its session's `register` is pending: the raw
 * message, decoded again when it is handled. */
typedef struct kvs_held {
	struct kvs_held *next;
	size_t ident_len, len;
	uint8_t ident[KVS_MAX_IDENT];
	uint8_t buf[]; /* len bytes */
} kvs_held;

/* An fd parked by the broker until a `register` claims its token. */
typedef struct kvs_parked {
	uint8_t token[16]; /* key */
	uint8_t alloc_id[16];
	uint64_t size;
	int fd;
	uid_t uid;
	pid_t pid;     /* the process that pushed it (per-process quota) */
	uint64_t expires_ms;
} kvs_parked;

typedef struct kvs_broker_conn {
	int fd;
	uid_t uid;
	pid_t pid;
	uint64_t expires_ms;
} kvs_broker_conn;

/* Server-wide counters reported by `stats`. */
typedef struct kvs_stats {
	uint64_t requests;
	uint64_t errors[KVS_E_LAST_ - KVS_E_BASE + 1];
	uint64_t sessions_opened, sessions_reaped;
	uint64_t broker_accepted, broker_rejected, broker_parked, broker_expired;
	uint64_t lane_spoofs; /* ZeroMQ messages dropped: their routing id was in the lanes' reserved space */
	uint64_t metrics_conns_cut; /* metrics.c's count, copied at each metrics tick */
	/* by op (index KVS_OP_NONE: requests whose op was unreadable) */
	uint64_t requests_by_op[KVS_OP_COUNT_];
	uint64_t errors_by_op[KVS_OP_COUNT_][KVS_E_LAST_ - KVS_E_BASE + 1];
} kvs_stats;

struct kvs_registry;
struct kvs_jobs;
struct kvs_l1;
struct kvs_l2;
struct kvs_copy_pool;
struct kvs_cuda_engine;

/* One piece of long work being reported (longwork.c). Main-loop thread
 * only. */
typedef struct kvs_progress {
	bool on;
	uint64_t t0_ms, next_ms; /* started; next progress line */
	uint64_t done0;          /* the amount done when it started */
} kvs_progress;

struct kvs_server {
	kvs_server_config cfg;
	uint8_t epoch[KVS_EPOCH_BYTES];
	void *zctx, *router;
	bool router_used; /* the loop sent on the router this iteration (reply.c): ask ZMQ_EVENTS again */
	struct kvs_events *events; /* KV-event publisher (events.h), NULL = off */
	char endpoint[600];
	int broker_fd;
	int dir_lock;        /* kvs_dirlock on the broker directory: held until kvs_server_destroy's end */
	int spare_fd;        /* reserve fd for EMFILE on accept */
	uint32_t max_parked; /* bounded by the fd limit */
	uint32_t parked_quota; /* parked fds one process may hold: an eighth of max_parked,
	                        * at least two registrations' worth, at most max_parked */
	char broker_path[300];
	struct kvs_cq *cq; /* completion queue: work finished on other threads */
	struct kvs_workq *setupq; /* the setup thread: registers' driver work (registry.c) */
	struct kvs_workq *reclaimq; /* the reclaim thread: host unmaps and memfd closes (registry.c) */
	/* run when a session's register was answered: handles the requests held
	 * behind it (loop.c sets it; the registry calls it) */
	void (*replay)(kvs_server *srv, uint64_t session);
	/* decodes and handles one request from ident (a ZeroMQ routing id or a
	 * lane ident, lane.h); srv->peer says who sent it (loop.c sets it; the
	 * lanes call it) */
	void (*dispatch)(kvs_server *srv, const uint8_t *ident, size_t ident_len, const void *buf, size_t len);
	bool stopping;

	kvs_htab *sessions; /* kvs_session by id */
	kvs_htab *schedulers; /* scheduler sessions by engine digest (reply.c) */
	struct kvs_peers *peers; /* bytes waiting for each peer (reply.c) */
	struct kvs_lanes *lanes; /* job lanes (lane.c) */
	struct kvs_auth *auth;   /* CURVE, ZAP, who may run admin (auth.c) */
	int peer;                /* enum kvs_peer_kind of the request being handled */
	uint8_t peer_key[32];    /* its CURVE key, for the key kinds (auth.h) */
	kvs_htab *parked;   /* kvs_parked by token */
	kvs_htab *consumed; /* recently claimed tokens (ring entries), refused if replayed */
	struct kvs_token_ent { uint8_t token[16]; } *consumed_ring;
	uint32_t consumed_head, consumed_n;
	kvs_broker_conn conns[KVS_MAX_BROKER_CONNS];
	int n_conns;

	struct kvs_registry *reg;
	struct kvs_jobs *jobs;
	struct kvs_l1 *l1;
	struct kvs_l2 *l2; /* NULL without --l2-path */
	struct kvs_l3 *l3; /* NULL without --l3-redis */
	struct kvs_copy_pool *pool;
	/* NULL without a GPU, and until the engine exists: it is created on the
	 * setup thread after start-up (the driver's initialisation takes a
	 * quarter of a second, which the socket must not wait for, issue 18);
	 * set on the loop when done, then cuda_settled; the L1 prefault thread
	 * reads it only after cuda_settled; cleared after that thread is joined. */
	struct kvs_cuda_engine *cuda;
	/* The engine is being created: a CUDA `register` arriving now waits
	 * (held like the requests behind a pending register, engine_wait set)
	 * and is handled once the engine exists or is known to be absent. */
	bool cuda_pending;
	bool closing; /* modules_fini has begun */
	struct kvs_promote *promote;  /* L2 -> L1 promotions */
	struct kvs_lookup *lookup;    /* lookup pins and counters */

	kvs_stats st;
	uint64_t now_ms; /* refreshed once per loop iteration */
	uint64_t start_ms, start_unix_ms; /* when kvs_server_create ran: monotonic, and wall-clock (stats) */
	pthread_t prefault; /* faults the L1 arena in at start-up */
	bool prefault_started;
	atomic_bool prefault_stop;
	/* set (release) once srv->cuda is final: the prefault thread, started
	 * when the socket is bound, waits for it (the driver's start needs the
	 * mmap lock that populating holds) */
	atomic_bool cuda_settled;
	atomic_uint_fast64_t prefaulted; /* bytes of the arena faulted in so far */
	atomic_bool prefault_active; /* the prefault thread has work left (it clears it when it ends) */
	kvs_progress lw_prefault, lw_pin, lw_backlog; /* their log lines (longwork.c) */
	uint64_t backlog_log_bytes; /* longwork.c: a backlog this large is logged (0: not read yet) */
	uint64_t busy_ns; /* main-loop time spent handling events (not waiting) */
	char errbuf[256]; /* text of the error a handler is returning */

	/* operations (admin.c, metrics.c) */
	bool draining;            /* new job parts are refused with E_BUSY */
	uint64_t drain_since_ms;
	struct kvs_admin_wait *admin_waits; /* drain requests waiting for open jobs */
	struct kvs_metrics *metrics;        /* NULL when off or not bound */
	unsigned metrics_port;              /* its bound port, 0 = none (stats) */
};

/* Handler for an op that needs a session (session already checked). */
typedef int (*kvs_op_fn)(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

/* The loop's periodic work (deadlines, leases, drains, metrics) and its
 * completion handling; the loop calls them, unit tests drive them. */
void kvs__server_tick(kvs_server *srv);
void kvs__server_completions(kvs_server *srv);

/* Sessions (session.c). */
/* The open session with this id, or NULL. */
static inline kvs_session *kvs__session_get(kvs_server *srv, uint64_t id)
{
	return (kvs_session *)kvs_htab_get(srv->sessions, &id);
}
void kvs__session_close(kvs_server *srv, kvs_session *s, const char *why);
void kvs__sessions_reap(kvs_server *srv);
/* Holds a request of a session whose register is pending (a copy of the
 * raw message). 0, or KVS_E_BUSY when the session holds too much already. */
int kvs__session_hold(kvs_server *srv, kvs_session *s, const uint8_t *ident, size_t ident_len, const void *buf,
		      size_t len);

int kvs__op_hello(kvs_server *srv, const void *ident, size_t ident_len, const kvs_msg *rq);

/* Broker (broker.c). */
int kvs__broker_open(kvs_server *srv);
void kvs__broker_close(kvs_server *srv);
void kvs__broker_accept(kvs_server *srv);
void kvs__broker_conn_ready(kvs_server *srv, int idx);
void kvs__broker_expire(kvs_server *srv);
/* Removes and returns the parked fd for token (caller owns the fd), or NULL. */
kvs_parked *kvs__broker_claim(kvs_server *srv, const uint8_t token[16]);

#endif
