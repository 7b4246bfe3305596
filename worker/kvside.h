/** @file kvside.h
 * @brief libkvside: the client library engines link to talk to kvside-server.
 *
 * One #kvs_client per process role (a TP rank, or the scheduler). The client
 * owns a background I/O thread which owns the ZeroMQ DEALER socket: it sends
 * heartbeats from the moment the session opens (never lazily), matches
 * replies to requests by id, fails requests that outlive their timeout with
 * #KVS_E_TIMEOUT, and notices a server restart (a new epoch in any reply). On
 * a restart, or when the server reports the session expired, it re-opens the
 * session by itself, re-registers every registration still held, and then
 * reports #KVS_EVENT_RECONNECTED to the application. Requests in flight at the
 * restart fail with #KVS_E_SESSION; the application retries them.
 *
 * Job lane: a client of an ipc:// endpoint also attaches a socket pair to its
 * session (docs/protocol.md §18) before kvs_client_open returns; requests are
 * then written to it by the calling thread and the I/O thread reads the
 * replies. KVS_LANE=0 in the environment keeps every request on ZeroMQ.
 *
 * Threading: every function is thread-safe. Completion callbacks and event
 * callbacks run on the I/O thread: they must return quickly and must not call
 * the blocking helpers (those return -EDEADLK there); they may call the
 * asynchronous functions.
 *
 * Errors: functions return 0 or a negative code — a project code
 * (#KVS_E_BADMSG ... #KVS_E_INTERNAL, see kvs_error.h) or a negative errno.
 * kvs_strerror() turns any of them into text. The library never aborts or
 * exits the host process.
 */
#ifndef KVSIDE_H
#define KVSIDE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvs_error.h"
#include "kvs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVS_KEY_LEN 32 /**< bytes in a chunk key */
#define KVS_REASON_LEN 129 /**< a job's reason: 128 bytes (the wire's bound) and its NUL */

/** Version of the binary interface this header describes: the layout of its
 * structs and the signatures of its functions. It changes whenever either
 * does (a field added to a struct included), so that a binding mirroring the
 * structs (the Python one) can refuse a library it does not match. */
#define KVS_ABI_VERSION 2

/** KVS_ABI_VERSION as libkvside was built with it. */
KVS_EXPORT unsigned kvs_abi_version(void);

typedef struct kvs_client kvs_client;

/** Event kinds delivered to kvs_client_config::on_event. */
enum kvs_event_type {
	/** The server restarted (or expired our session); the session was
	 *  re-opened and every registration restored. `session` is the new id,
	 *  `error` is 0, or the first re-registration failure. */
	KVS_EVENT_RECONNECTED = 1,
	/** A job this session takes part in (or, for a scheduler, any job of
	 *  its engine) reached a terminal state. */
	KVS_EVENT_JOB_DONE = 2,
};

typedef struct kvs_event {
	int type;          /**< enum kvs_event_type */
	uint64_t session;  /**< current session id */
	uint64_t job;      /**< JOB_DONE: the job */
	int state;         /**< JOB_DONE: enum kvs_job_state */
	const char *reason;/**< JOB_DONE: text; valid during the callback only */
	int error;         /**< RECONNECTED: 0 or the first failure */
} kvs_event;

typedef void (*kvs_event_fn)(const kvs_event *ev, void *arg);

typedef struct kvs_client_config {
	const char *endpoint;   /**< ZeroMQ endpoint; NULL: ipc://<broker_dir>/kvside.zmq */
	const char *broker_dir; /**< fd-broker directory; NULL: the server's default */
	const char *engine;     /**< engine instance name (jobs are scoped by it); required */
	const char *ns;         /**< namespace: model id + salt; isolates caches; required */
	int role;               /**< KVS_ROLE_SCHEDULER or KVS_ROLE_WORKER */
	uint32_t rank;          /**< this rank (workers) */
	uint32_t world;         /**< ranks that must report per job */
	int timeout_ms;         /**< default request timeout; 0: 10000 */
	kvs_event_fn on_event;  /**< may be NULL */
	void *event_arg;
	/** tcp:// endpoints of a server with CURVE (protocol.md §1): the
	 *  server's public key and this client's key pair, Z85 (40 characters
	 *  each); NULL: plain (ipc, or a server started with insecure-tcp). All
	 *  three or none; a key of another length fails kvs_client_open with
	 *  -EINVAL. */
	const char *curve_server_key;
	const char *curve_public_key;
	const char *curve_secret_key;
} kvs_client_config;

/** Opens a session: starts the I/O thread and waits up to cfg->timeout_ms
 * for the hello reply. An ipc:// endpoint is checked first, retried for up
 * to 3 s (or timeout_ms if shorter) while a server may still be starting:
 * its broker directory missing (-ENOENT), another user's (-EACCES), no
 * server listening there, also behind a socket a dead server left
 * (-ECONNREFUSED), each fails without waiting for the hello.
 * @return 0 and *ret set, or one of those, #KVS_E_TIMEOUT (no answer: for
 * tcp:// kvs_last_error() says what the connection saw, e.g. the CURVE key
 * refused), a code from the server's reply, -ENOMEM, -EINVAL (missing
 * engine/ns, bad CURVE keys). *ret untouched on failure; kvs_last_error()
 * names the cause. */
KVS_EXPORT int kvs_client_open(const kvs_client_config *cfg, kvs_client **ret);

/** Why this thread's last blocking call failed, in words: for
 * kvs_client_open the cause, naming the path, the user ids or the endpoint
 * ("broker directory /run/kvside does not exist: ..."); for the blocking
 * requests (kvs_store, kvs_retrieve, kvs_complete, kvs_lookup,
 * kvs_job_status, kvs_job_wait's none, kvs_stats, kvs_admin) the server's
 * text ("blocks[0] (group id 0): 3 ids given, expected 4 ..."), or "" where
 * there is none. "" after a success. Thread-local; valid until the thread's
 * next blocking call. The asynchronous calls leave it alone: their
 * kvs_result carries msg. */
KVS_EXPORT const char *kvs_last_error(void);

/** Says bye (waiting at most 1 s), stops the I/O thread, fails requests still
 * pending with -ECANCELED, closes duplicated fds, frees. Accepts NULL. Must
 * not be called from a callback.
 *
 * fork(): a client belongs to the process that opened it. In a child forked
 * after kvs_client_open, every call on it returns #KVS_E_SESSION at once
 * (logged once) and kvs_client_close returns without a bye, a join or any
 * lock, leaving the parent's session, lane and registrations as they are;
 * a child opens a client of its own. */
KVS_EXPORT void kvs_client_close(kvs_client *c);

/** Current session id (changes after a reconnect). */
KVS_EXPORT uint64_t kvs_client_session(kvs_client *c);
/** Number of reconnects (server restarts or expiries survived). */
KVS_EXPORT uint64_t kvs_client_reconnects(kvs_client *c);

/* ---- results ------------------------------------------------------------ */

typedef struct kvs_job_info_out {
	uint64_t job;
	int state;        /**< enum kvs_job_state */
	uint32_t ranks_done;
	char reason[KVS_REASON_LEN]; /**< the job's reason, up to the wire's 128 bytes */
} kvs_job_info_out;

typedef struct kvs_stat_out {
	char name[48];
	uint64_t value;
} kvs_stat_out;

/** What an admin command reports (kvs_admin()). */
typedef struct kvs_admin_info {
	int cmd;             /**< enum kvs_admin_cmd, as answered */
	bool draining;       /**< the server refuses new jobs */
	bool drained;        /**< drain: no job was open when it answered */
	uint64_t jobs_open;  /**< jobs open on the server, all engines */
	uint64_t waited_ms;  /**< drain: how long the server waited */
	uint64_t cleared_l1; /**< clear: objects dropped from L1 */
	uint64_t cleared_l2; /**< clear: objects dropped from L2 */
	uint64_t kept_l1;    /**< clear: L1 objects kept because pinned */
	char msg[256];       /**< on failure: the server's text, or "" */
} kvs_admin_info;

/** What a completion callback receives. Pointers are borrowed: valid during
 * the callback only. Fields not belonging to the op are zero. */
typedef struct kvs_result {
	int code;            /**< 0 or an error */
	const char *msg;     /**< server's text for the error, or "" */
	uint64_t session, registration, imported, aliased, pending_jobs, hits;
	const uint8_t *tiers; /**< hits entries of enum kvs_tier */
	int state;           /**< job state for store/retrieve/complete */
	const kvs_job_info_out *jobs;
	uint32_t n_jobs;
	const kvs_stat_out *stats;
	uint32_t n_stats;
	const kvs_admin_info *admin; /**< admin replies, else NULL */
} kvs_result;

typedef void (*kvs_done_fn)(const kvs_result *res, void *arg);


/* ---- registrations ------------------------------------------------------ */

#define KVS_IPC_HANDLE_LEN 64 /**< bytes in a legacy CUDA IPC handle (CUipcMemHandle) */

typedef struct kvs_alloc {
	int fd;              /**< memfd (host) or POSIX-fd cuMem handle; duplicated.
	                          -1 for CUDA memory sent by ipc_handle instead */
	uint64_t size;       /**< bytes */
	uint8_t alloc_id[16];/**< stable id of the allocation (0 = random) */
	bool follows;        /**< mapped right after the previous allocation: the
	                          entries form one range (a tensor over several
	                          cuMem allocations, e.g. PyTorch's expandable
	                          segments); layers name the range's first entry
	                          and their offsets may run across the pieces */
	/** CUDA memory without a VMM handle (cudaMalloc), fd -1: the legacy CUDA
	 *  IPC handle (CUipcMemHandle, as kvs_cuda_export fills it), which
	 *  kvs_register sends in the message instead of an fd. Ignored for host
	 *  memory and when fd >= 0. */
	uint8_t ipc_handle[KVS_IPC_HANDLE_LEN];
} kvs_alloc;

typedef struct kvs_group {
	uint32_t id;
	int kind;                  /**< enum kvs_group_kind */
	uint32_t tokens_per_block;
	uint32_t blocks_per_chunk;
	int64_t window_chunks;     /**< -1 = full attention */
	int64_t null_block;        /**< -1 = none */
} kvs_group;

typedef struct kvs_layer {
	uint32_t group;       /**< group id */
	uint32_t alloc;       /**< index into the allocations */
	uint64_t offset;      /**< byte offset of block 0 in the allocation */
	uint64_t num_blocks;
	uint64_t block_stride;/**< bytes between blocks (>= block_bytes) */
	uint64_t block_bytes; /**< bytes copied per block */
} kvs_layer;

typedef struct kvs_registration_desc {
	int device_type;       /**< enum kvs_devtype */
	uint8_t device_uuid[16];
	const kvs_alloc *allocs;
	uint32_t n_allocs;
	const kvs_group *groups;
	uint32_t n_groups;
	const kvs_layer *layers;
	uint32_t n_layers;
} kvs_registration_desc;

/** Creates a memfd of size bytes mapped shared into this process, for use as
 * a host KV region. *ret_fd and *ret_ptr belong to the caller (close, munmap).
 * @return 0, or -errno. */
KVS_EXPORT int kvs_memfd_create(const char *name, uint64_t size, int *ret_fd, void **ret_ptr);

/** Registers KV memory with the server: sends every allocation's fd through
 * the broker, then `register`. The library keeps a duplicate of each fd and
 * the layout so that it can re-register after a server restart; *ret_handle
 * stays valid across such restarts. Blocking (timeout_ms, 0 = default).
 * @return 0, or #KVS_E_GEOMETRY, #KVS_E_RANGE, #KVS_E_AUTH, #KVS_E_NOREG ... */
KVS_EXPORT int kvs_register(kvs_client *c, const kvs_registration_desc *d, int timeout_ms,
			    uint64_t *ret_handle);

/** Unregisters (the server waits for in-flight copies; #KVS_E_BUSY if they
 * do not drain in time, in which case the registration stays). */
KVS_EXPORT int kvs_unregister(kvs_client *c, uint64_t handle, int timeout_ms);

/* ---- CUDA memory (libkvside built with CUDA headers; driver at run time) -- */

/** True if the CUDA driver and a device are usable in this process. */
KVS_EXPORT bool kvs_cuda_available(void);

/** Allocates size bytes of shareable cuMem memory (POSIX-fd handle type) on
 * device, mapped read-write for it; rounds up to the allocation granularity.
 * The signature matches torch.cuda.memory.CUDAPluggableAllocator's. Returns
 * NULL on failure (no driver, no memory). Makes device's primary context
 * current on the calling thread. */
KVS_EXPORT void *kvs_cuda_alloc(size_t size, int device, void *stream);
/** Frees memory from kvs_cuda_alloc (unmap, free the range, release). */
KVS_EXPORT void kvs_cuda_free(void *ptr, size_t size, int device, void *stream);

/** Finds the cuMem allocation behind a device pointer and exports it as a
 * POSIX fd for kvs_register(): fills *ret_alloc (fd: a new descriptor the
 * caller closes after kvs_register, size, alloc_id: stable for this
 * allocation within this process) and *ret_base (the allocation's start, to
 * compute layer offsets). Memory without a VMM handle (cudaMalloc) is
 * exported as a legacy CUDA IPC handle instead: then ret_alloc->fd is -1,
 * ret_alloc->ipc_handle holds the handle and kvs_register sends it in the
 * message (no broker fd). For cuMem memory ipc_handle is zeroed.
 * @return 0, -ENODEV (no CUDA), or KVS_E_DEVICE. */
KVS_EXPORT int kvs_cuda_export(const void *dptr, kvs_alloc *ret_alloc, uint64_t *ret_base);

/** The 16-byte UUID of a CUDA device (for kvs_registration_desc.device_uuid). */
KVS_EXPORT int kvs_cuda_device_uuid(int device, uint8_t out[16]);

/* ---- jobs --------------------------------------------------------------- */

/** Block lists: one list per group in registration order, each with
 * blocks_per_chunk ids per key, key by key. */
typedef struct kvs_blocks {
	uint32_t n_groups;
	const int64_t *const *ids;
	const uint32_t *len;
} kvs_blocks;

typedef struct kvs_store_opts {
	bool lazy;
	const uint8_t *producer_event; /**< CUDA IPC event handle or NULL */
	uint32_t producer_event_len;
	/** NULL, or n_keys engine block hashes of 32 bytes (the engine's name of
	 *  each chunk, e.g. vLLM's block hash of its last block): KV events
	 *  (protocol.md §17) publish these instead of the chunk keys */
	const uint8_t *event_hashes;
} kvs_store_opts;

/** Asynchronous calls: 0 once queued (done is then called exactly once, on
 * the I/O thread), or an error now (done never called). Key and block arrays
 * are copied before return. Requests leave in the order queued, so a rank may
 * queue its store/retrieve and then its complete without waiting for the
 * first reply, and wait for the job with kvs_job_wait (one round trip less
 * per job; protocol.md §6.9).
 *
 * Job ids: a job is (this client's engine, job). The server remembers the
 * ids of its last terminal-jobs (65,536) ended jobs for the life of its
 * process, to answer repeats: an id reused for other work in one server run
 * gets that job's old state, or #KVS_E_JOB_CONFLICT ("job J ended earlier
 * with other content ..."). Take a random 64-bit base per process plus a
 * counter (protocol.md §9.5). */
KVS_EXPORT int kvs_store_async(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
			       const kvs_blocks *blocks, const kvs_store_opts *opts, int timeout_ms,
			       kvs_done_fn done, void *arg);
/** A store part that also completes this rank's part ("ok"), for a rank that
 * has nothing to decide after its copies: one message and one reply per rank
 * and job instead of a part, a complete, two replies and job_done
 * (protocol.md §6.7). The reply, and so done, comes when the job is
 * terminal: res->state is KVS_JOB_COMMITTED or KVS_JOB_ABORTED, and
 * kvs_job_wait and the event callback see the job's end as from job_done. A
 * refused part is answered at once with its error (the job aborts). A server
 * that predates the field answers at once with KVS_JOB_OPEN; the library then
 * sends the complete itself and the job's end comes by job_done. Give
 * timeout_ms room for the whole job. */
KVS_EXPORT int kvs_store_complete_async(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
					const kvs_blocks *blocks, const kvs_store_opts *opts, int timeout_ms,
					kvs_done_fn done, void *arg);
KVS_EXPORT int kvs_retrieve_async(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
				  const kvs_blocks *blocks, uint64_t skip_tokens, int timeout_ms,
				  kvs_done_fn done, void *arg);
KVS_EXPORT int kvs_complete_async(kvs_client *c, uint64_t job, bool ok, int timeout_ms, kvs_done_fn done,
				  void *arg);
KVS_EXPORT int kvs_lookup_async(kvs_client *c, const uint8_t *keys, uint32_t n_keys, bool prefetch,
				uint32_t pin_ms, int timeout_ms, kvs_done_fn done, void *arg);

/** Blocking helpers: wait for the reply (timeout_ms, 0 = default).
 * ret_state (may be NULL) gets the job state of the reply. */
KVS_EXPORT int kvs_store(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
			 const kvs_blocks *blocks, const kvs_store_opts *opts, int timeout_ms, int *ret_state);
KVS_EXPORT int kvs_retrieve(kvs_client *c, uint64_t job, const uint8_t *keys, uint32_t n_keys,
			    const kvs_blocks *blocks, uint64_t skip_tokens, int timeout_ms, int *ret_state);
KVS_EXPORT int kvs_complete(kvs_client *c, uint64_t job, bool ok, int timeout_ms, int *ret_state);
/** ret_tiers (may be NULL) receives up to n_keys tier codes. */
KVS_EXPORT int kvs_lookup(kvs_client *c, const uint8_t *keys, uint32_t n_keys, bool prefetch,
			  uint32_t pin_ms, int timeout_ms, uint64_t *ret_hits, uint8_t *ret_tiers);
/** Job states for the given ids (n_jobs 0: every open job of the engine).
 * Writes up to cap entries; *ret_n gets the count written. */
KVS_EXPORT int kvs_job_status(kvs_client *c, const uint64_t *jobs, uint32_t n_jobs, int timeout_ms,
			      kvs_job_info_out *out, uint32_t cap, uint32_t *ret_n);
/** Server counters; writes up to cap entries. */
KVS_EXPORT int kvs_stats(kvs_client *c, int timeout_ms, kvs_stat_out *out, uint32_t cap, uint32_t *ret_n);
/** Looks a counter up by name in a kvs_stats() result; UINT64_MAX if absent. */
KVS_EXPORT uint64_t kvs_stat_find(const kvs_stat_out *st, uint32_t n, const char *name);

/** Runs an operator command (enum kvs_admin_cmd) on the server:
 * - #KVS_ADMIN_STATUS: reports draining and jobs_open;
 * - #KVS_ADMIN_DRAIN: the server refuses new jobs from now on (store and
 *   retrieve parts of jobs it does not know get #KVS_E_BUSY; parts of jobs
 *   already open still run) and answers once no job is open or after wait_ms
 *   (0: at once); `drained` says which;
 * - #KVS_ADMIN_RESUME: accept new jobs again;
 * - #KVS_ADMIN_CLEAR: drop every L1 object not pinned and every L2 object.
 * timeout_ms (0 = default) bounds the whole request: give it more than
 * wait_ms. ret (may be NULL) gets the answer, or the server's text in
 * ret->msg on failure.
 * @return 0, #KVS_E_BUSY (clear while jobs are open or L2 writes queued),
 * #KVS_E_TIMEOUT, #KVS_E_SESSION ... */
KVS_EXPORT int kvs_admin(kvs_client *c, int cmd, uint32_t wait_ms, int timeout_ms, kvs_admin_info *ret);

/** Waits until a job_done for job has been received (the client remembers the
 * last 4096) and returns its state in *ret_state. The calling thread sleeps
 * through most of the time recent waits took and polls, with the client's
 * I/O thread, for a short window around their average (hybrid polling; off
 * with KVS_HYBRID_POLL=0, docs/library.md).
 * @return 0, or #KVS_E_TIMEOUT. */
KVS_EXPORT int kvs_job_wait(kvs_client *c, uint64_t job, int timeout_ms, int *ret_state);

/** Chunk keys: BLAKE2b-256 chained over chunk_tokens-token chunks, seeded by
 * the namespace; writes up to max_keys keys of 32 bytes to out.
 * @return the number of keys, or -EINVAL. */
KVS_EXPORT long kvs_keys_for_tokens(const char *ns, const uint32_t *tokens, size_t n_tokens,
				    uint32_t chunk_tokens, uint8_t *out, size_t max_keys);

/** Name of a job state ("open", "committed", "aborted", "unknown"). */
KVS_EXPORT const char *kvs_state_name(int state);

#ifdef __cplusplus
}
#endif
#endif
