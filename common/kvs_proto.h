/* kvside wire protocol v1: the one module that knows msgpack.
 *
 * Every message is one ZeroMQ frame holding one msgpack map with string keys.
 * A decoded message is a flat kvs_msg: the fields of every op live side by
 * side and each op's table (kvs_proto_fields.c) says which of them it
 * carries, which are required and what limits apply. docs/protocol.md is the
 * normative text; keep the two in step.
 *
 * Ownership: kvs_proto_decode() fills a kvs_msg whose strings, binaries and
 * arrays borrow from the input buffer and from msg->zone; they stay valid
 * until kvs_msg_clear() and while the input buffer lives. Encoding never
 * retains caller pointers. */
#ifndef KVS_PROTO_H
#define KVS_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvs_types.h"

#define KVS_PROTO_VERSION 1
#define KVS_KEY_BYTES 32
#define KVS_TOKEN_BYTES 16
#define KVS_EPOCH_BYTES 16

/* Hard limits enforced by the decoder (the server advertises them in hello). */
#define KVS_MAX_MSG_BYTES (8u << 20)  /* one message */
#define KVS_MAX_DEPTH 6               /* map/array nesting */
#define KVS_MAX_KEYS 4096             /* keys per store/retrieve/lookup */
#define KVS_MAX_BLOCK_IDS (1u << 20)  /* block ids per message, all groups */
#define KVS_MAX_GROUPS 16             /* groups per registration */
#define KVS_MAX_LAYERS 1024           /* layer views per registration */
#define KVS_MAX_ALLOCS 256            /* allocations per registration */
#define KVS_MAX_JOBS_QUERY 1024       /* ids in one job_status */
#define KVS_MAX_STR 128               /* engine, namespace, reason, ... */
#define KVS_MAX_ERRMSG 512
#define KVS_MAX_COUNTERS 256

typedef enum kvs_op {
	KVS_OP_NONE = 0,
	KVS_OP_HELLO,
	KVS_OP_HEARTBEAT,
	KVS_OP_BYE,
	KVS_OP_REGISTER,
	KVS_OP_UNREGISTER,
	KVS_OP_LOOKUP,
	KVS_OP_STORE,
	KVS_OP_RETRIEVE,
	KVS_OP_COMPLETE,
	KVS_OP_JOB_STATUS,
	KVS_OP_STATS,
	KVS_OP_JOB_DONE, /* server push, id 0 */
	KVS_OP_ADMIN,    /* operator commands: status, drain, resume, clear */
	KVS_OP_LANE,     /* attach a job lane (protocol.md §18) */
	KVS_OP_COUNT_
} kvs_op;


typedef struct kvs_str {
	const char *ptr; /* not NUL-terminated */
	uint32_t len;
} kvs_str;

typedef struct kvs_bytes {
	const uint8_t *ptr;
	uint32_t len;
} kvs_bytes;

typedef struct kvs_device_desc {
	uint8_t type; /* enum kvs_devtype */
	uint8_t uuid[16];
} kvs_device_desc;

typedef struct kvs_alloc_desc {
	uint8_t token[KVS_TOKEN_BYTES];
	uint8_t alloc_id[16];
	uint64_t size;
	kvs_bytes ipc_handle; /* cuda memory without a VMM handle (cudaMalloc): a
	                       * 64-byte CUipcMemHandle instead of a broker fd */
	bool follows;         /* mapped right after the previous entry: one range
	                       * of several allocations (protocol.md 6.4) */
} kvs_alloc_desc;

typedef struct kvs_group_desc {
	uint32_t id;
	uint8_t kind; /* enum kvs_group_kind */
	uint32_t tokens_per_block;
	uint32_t blocks_per_chunk;
	int64_t window_chunks; /* -1 = full */
	int64_t null_block;    /* -1 = none */
} kvs_group_desc;

typedef struct kvs_layer_desc {
	uint32_t group; /* group id */
	uint32_t alloc; /* index into allocations */
	uint64_t offset;
	uint64_t num_blocks;
	uint64_t block_stride;
	uint64_t block_bytes;
} kvs_layer_desc;

typedef struct kvs_limits_desc {
	uint64_t max_msg_bytes;
	uint64_t max_keys;
	uint64_t max_block_ids;
} kvs_limits_desc;

typedef struct kvs_job_info {
	uint64_t job;
	uint8_t state; /* enum kvs_job_state */
	kvs_str reason;
	uint32_t ranks_done;
} kvs_job_info;

typedef struct kvs_counter {
	kvs_str name;
	uint64_t value;
} kvs_counter;

/* Block lists of a store/retrieve: one list per group, in registration order. */
typedef struct kvs_block_lists {
	uint32_t n;                    /* number of groups */
	const int64_t *ids[KVS_MAX_GROUPS];
	uint32_t len[KVS_MAX_GROUPS];
	bool packed; /* encode: each list whose ids fit 32 bits as a packed list
		      * (protocol.md §10.1), for a server that said packed_blocks */
} kvs_block_lists;

/* A decoded or to-be-encoded message. Zero-initialise, then fill. */
typedef struct kvs_msg {
	/* envelope */
	uint32_t v;
	kvs_op op;
	uint64_t id;
	bool is_reply; /* replies and pushes */
	bool ok;
	int code;           /* kvs error code when !ok */
	kvs_str errmsg;     /* "msg" */
	uint8_t epoch[KVS_EPOCH_BYTES];

	/* requests */
	kvs_str engine;
	uint8_t role;
	uint32_t rank;
	uint32_t world;
	kvs_str ns; /* "namespace" */
	uint64_t session;
	uint64_t registration;
	uint64_t job;
	kvs_device_desc device;
	const kvs_alloc_desc *allocs;
	uint32_t n_allocs;
	const kvs_group_desc *groups;
	uint32_t n_groups;
	const kvs_layer_desc *layers;
	uint32_t n_layers;
	const uint8_t *keys; /* n_keys * 32 bytes */
	uint32_t n_keys;
	kvs_block_lists blocks;
	bool prefetch;
	uint64_t pin_ms;
	bool lazy;
	bool complete; /* store: this rank's complete ("ok") rides on the part (protocol.md §6.7) */
	uint64_t skip_tokens;
	uint8_t status; /* enum kvs_status */
	kvs_bytes producer_event;
	const uint8_t *event_hashes; /* store: 0 or n_keys engine block hashes of 32 bytes */
	uint32_t n_event_hashes;
	const uint64_t *jobs;
	uint32_t n_jobs;
	uint8_t admin_cmd; /* admin "cmd": enum kvs_admin_cmd (echoed in the reply) */
	uint64_t wait_ms;  /* admin drain "timeout_ms": wait this long for open jobs */
	uint8_t lane_token[KVS_TOKEN_BYTES]; /* lane: the broker token of the lane's socket */

	/* replies */
	uint64_t heartbeat_ms;
	bool packed_blocks; /* hello reply: the server reads packed block lists (protocol.md §10.1) */
	uint64_t ttl_ms;
	kvs_limits_desc limits;
	uint64_t pending_jobs;
	uint64_t imported;
	uint64_t aliased;
	uint64_t hits;
	const uint8_t *tiers; /* n_tiers of enum kvs_tier */
	uint32_t n_tiers;
	uint8_t state; /* enum kvs_job_state */
	kvs_str reason;
	const kvs_job_info *job_infos;
	uint32_t n_job_infos;
	const kvs_counter *counters;
	uint32_t n_counters;
	/* admin */
	bool draining;       /* new job parts are refused */
	bool drained;        /* drain: no job open when answered */
	uint64_t jobs_open;
	uint64_t waited_ms;  /* drain: time waited for open jobs */
	uint64_t cleared_l1; /* clear: objects dropped from L1 / L2 */
	uint64_t cleared_l2;
	uint64_t kept_l1;    /* clear: L1 objects kept (pinned by lookups or L2 writes) */

	/* decoder bookkeeping */
	void *zone_; /* msgpack_zone owning decoded arrays */
	uint64_t present_; /* bit i: field i of the op's table was present */
} kvs_msg;

/* Decode error detail: code is a kvs error; msg says which field and why.
 * op and id are filled as far as the envelope could be read, so that the
 * server can address its error reply. */
typedef struct kvs_proto_err {
	int code;
	kvs_op op;
	uint64_t id;
	char msg[160];
} kvs_proto_err;

/* Decodes a request (is_reply false) or a reply/push (is_reply true).
 * Returns 0, or a kvs error code with *err filled; on error *msg holds
 * nothing that needs freeing. Always call kvs_msg_clear() after success. */
int kvs_proto_decode(const void *buf, size_t len, bool is_reply, kvs_msg *msg,
		     kvs_proto_err *err);

/* Releases what decode allocated and zeroes the message. Accepts a zeroed msg. */
void kvs_msg_clear(kvs_msg *msg);

/* True if the optional field `name` of msg's op was present when decoded. */
bool kvs_msg_has(const kvs_msg *msg, const char *name);

/* Encodes msg (its op, is_reply and ok decide the fields written). On
 * success *ret_buf is a malloc'd buffer the caller frees; returns 0 or
 * -ENOMEM / -EINVAL (unencodable content, e.g. a string over its limit). */
int kvs_proto_encode(const kvs_msg *msg, void **ret_buf, size_t *ret_len);

const char *kvs_op_name(kvs_op op);
kvs_op kvs_op_from_name(const char *name, size_t len);
const char *kvs_job_state_name(int state);
const char *kvs_tier_name(int tier);
/* "status", "drain", "resume", "clear"; "?" for other values. */
const char *kvs_admin_cmd_name(int cmd);
/* enum kvs_admin_cmd for a name, or -1. */
int kvs_admin_cmd_from_name(const char *name);

/* Copies a kvs_str into a NUL-terminated buffer of cap bytes (truncating). */
void kvs_str_copy(char *dst, size_t cap, kvs_str s);
static inline kvs_str kvs_str_c(const char *s);

#include <string.h>
static inline kvs_str kvs_str_c(const char *s)
{
	kvs_str r = {s, s ? (uint32_t)strlen(s) : 0};
	return r;
}

/* ---- KV events for cache-aware routers (vLLM's format) -------------------
 * vLLM's KVEventBatch (vllm/distributed/kv_events.py): a msgpack array
 * [ts, events], each event a map tagged by "type": BlockStored {block_hashes,
 * parent_block_hash, token_ids, block_size, lora_id, lora_name, medium},
 * BlockRemoved {block_hashes, medium}, AllBlocksCleared {}. Block hashes are
 * kvside chunk keys (32-byte binaries). */
enum kvs_kvevent_kind { KVS_KVEV_STORED = 1, KVS_KVEV_REMOVED, KVS_KVEV_CLEARED };

typedef struct kvs_kvevent {
	int kind;             /* enum kvs_kvevent_kind */
	const char *medium;   /* stored/removed: "CPU" (L1), "STORAGE" (L2) */
	uint32_t block_size;  /* stored: tokens per chunk */
	const uint8_t *keys;  /* n_keys chunk keys of 32 bytes */
	uint32_t n_keys;
} kvs_kvevent;

/* Encodes one batch; *ret_buf is malloc'd (the caller frees). 0, -EINVAL (an
 * unknown kind) or -ENOMEM. */
int kvs_kvevents_encode(const kvs_kvevent *evs, uint32_t n, double ts, void **ret_buf, size_t *ret_len);
/* A KV-event replay request (protocol.md §17), its frames after the routing
 * id: (b"", start) with start 8 bytes big-endian. 0 and *start, or
 * KVS_E_BADMSG (another shape: the server answers the end marker alone). */
int kvs_kvevents_replay_request(const uint8_t *const *frames, const size_t *lens, uint32_t n, uint64_t *start);

#endif
