/* Protocol v1 field tables: one per op and direction, the single source of
 * truth for which fields each message carries, their types and limits; the
 * decoder and the encoder both walk them. Also the op, job-state, tier and
 * admin-command names. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kvs_proto_impl.h"

static const char *const role_names[] = {"scheduler", "worker", NULL};
static const char *const devtype_names[] = {"host", "cuda", NULL};
static const char *const kind_names[] = {"attention", "recurrent", NULL};
static const char *const status_names[] = {"ok", "failed", NULL};
static const char *const state_names[] = {"open", "committed", "aborted", "unknown", NULL};
static const char *const tier_names[] = {"l1", "l2", "l3", NULL};
static const char *const admin_cmd_names[] = {"status", "drain", "resume", "clear", NULL};

#define M(f) ((uint16_t)offsetof(kvs_msg, f))
#define REQ(nm, t, fld) {.name = nm, .type = t, .req = true, .off = M(fld)}
#define OPT(nm, t, fld) {.name = nm, .type = t, .req = false, .off = M(fld)}
#define REQX(nm, t, fld, ...) {.name = nm, .type = t, .req = true, .off = M(fld), __VA_ARGS__}
#define OPTX(nm, t, fld, ...) {.name = nm, .type = t, .req = false, .off = M(fld), __VA_ARGS__}
#define SPEC(a) {a, (uint8_t)(sizeof(a) / sizeof(a[0]))}

/* nested: device */
#define D(f) ((uint16_t)offsetof(kvs_device_desc, f))
static const fdesc device_f[] = {
	{.name = "type", .type = F_ENUM, .req = true, .off = D(type), .aux = devtype_names},
	{.name = "uuid", .type = F_BIN16, .req = true, .off = D(uuid)},
};
static const spec device_spec = SPEC(device_f);

#define A(f) ((uint16_t)offsetof(kvs_alloc_desc, f))
static const fdesc alloc_f[] = {
	{.name = "token", .type = F_BIN16, .req = true, .off = A(token)},
	{.name = "alloc_id", .type = F_BIN16, .req = true, .off = A(alloc_id)},
	{.name = "size", .type = F_U64, .req = true, .off = A(size)},
	{.name = "ipc_handle", .type = F_BINV, .req = false, .off = A(ipc_handle), .max = 64},
	{.name = "follows", .type = F_BOOL, .req = false, .off = A(follows)},
};
static const spec alloc_spec = SPEC(alloc_f);

#define G(f) ((uint16_t)offsetof(kvs_group_desc, f))
static const fdesc group_f[] = {
	{.name = "id", .type = F_U32, .req = true, .off = G(id)},
	{.name = "kind", .type = F_ENUM, .req = true, .off = G(kind), .aux = kind_names},
	{.name = "tokens_per_block", .type = F_U32, .req = true, .off = G(tokens_per_block)},
	{.name = "blocks_per_chunk", .type = F_U32, .req = true, .off = G(blocks_per_chunk)},
	{.name = "window_chunks", .type = F_I64, .req = false, .off = G(window_chunks), .def = -1},
	{.name = "null_block", .type = F_I64, .req = false, .off = G(null_block), .def = -1},
};
static const spec group_spec = SPEC(group_f);

#define L(f) ((uint16_t)offsetof(kvs_layer_desc, f))
static const fdesc layer_f[] = {
	{.name = "group", .type = F_U32, .req = true, .off = L(group)},
	{.name = "alloc", .type = F_U32, .req = true, .off = L(alloc)},
	{.name = "offset", .type = F_U64, .req = true, .off = L(offset)},
	{.name = "num_blocks", .type = F_U64, .req = true, .off = L(num_blocks)},
	{.name = "block_stride", .type = F_U64, .req = true, .off = L(block_stride)},
	{.name = "block_bytes", .type = F_U64, .req = true, .off = L(block_bytes)},
};
static const spec layer_spec = SPEC(layer_f);

#define LI(f) ((uint16_t)offsetof(kvs_limits_desc, f))
static const fdesc limits_f[] = {
	{.name = "max_msg_bytes", .type = F_U64, .req = true, .off = LI(max_msg_bytes)},
	{.name = "max_keys", .type = F_U64, .req = true, .off = LI(max_keys)},
	{.name = "max_block_ids", .type = F_U64, .req = true, .off = LI(max_block_ids)},
};
static const spec limits_spec = SPEC(limits_f);

#define JI(f) ((uint16_t)offsetof(kvs_job_info, f))
static const fdesc jobinfo_f[] = {
	{.name = "job", .type = F_U64, .req = true, .off = JI(job)},
	{.name = "state", .type = F_ENUM, .req = true, .off = JI(state), .aux = state_names},
	{.name = "reason", .type = F_STR, .req = true, .off = JI(reason), .max = KVS_MAX_STR},
	{.name = "ranks_done", .type = F_U32, .req = true, .off = JI(ranks_done)},
};
static const spec jobinfo_spec = SPEC(jobinfo_f);

#define SESSION REQ("session", F_U64, session)
#define KEYS REQX("keys", F_KEYS, keys, .off_n = M(n_keys), .max = KVS_MAX_KEYS)
#define BLOCKS REQX("blocks", F_BLOCKS, blocks, .max = KVS_MAX_BLOCK_IDS)

static const fdesc hello_rq[] = {
	REQX("engine", F_STR, engine, .max = KVS_MAX_STR),
	REQX("role", F_ENUM, role, .aux = role_names),
	REQX("rank", F_U32, rank, .max = 65535),
	REQX("world", F_U32, world, .max = 65536),
	REQX("namespace", F_STR, ns, .max = KVS_MAX_STR),
};
static const fdesc session_rq[] = {SESSION};
static const fdesc register_rq[] = {
	SESSION,
	REQX("device", F_OBJ, device, .aux = &device_spec),
	REQX("allocations", F_OBJS, allocs, .off_n = M(n_allocs), .max = KVS_MAX_ALLOCS,
	    .aux = &alloc_spec, .esz = sizeof(kvs_alloc_desc)),
	REQX("groups", F_OBJS, groups, .off_n = M(n_groups), .max = KVS_MAX_GROUPS,
	    .aux = &group_spec, .esz = sizeof(kvs_group_desc)),
	REQX("layers", F_OBJS, layers, .off_n = M(n_layers), .max = KVS_MAX_LAYERS,
	    .aux = &layer_spec, .esz = sizeof(kvs_layer_desc)),
};
static const fdesc unregister_rq[] = {SESSION, REQ("registration", F_U64, registration)};
static const fdesc lookup_rq[] = {
	SESSION, KEYS,
	OPT("prefetch", F_BOOL, prefetch),
	OPTX("pin_ms", F_U64, pin_ms, .max = 600000),
};
static const fdesc store_rq[] = {
	SESSION, REQ("job", F_U64, job), KEYS, BLOCKS,
	OPTX("producer_event", F_BINV, producer_event, .max = 64),
	OPT("lazy", F_BOOL, lazy),
	OPT("complete", F_BOOL, complete),
	OPTX("event_hashes", F_KEYS, event_hashes, .off_n = M(n_event_hashes), .max = KVS_MAX_KEYS),
};
static const fdesc retrieve_rq[] = {
	SESSION, REQ("job", F_U64, job), KEYS, BLOCKS,
	OPT("skip_tokens", F_U64, skip_tokens),
};
static const fdesc complete_rq[] = {
	SESSION, REQ("job", F_U64, job), REQX("status", F_ENUM, status, .aux = status_names),
};
static const fdesc job_status_rq[] = {
	SESSION, OPTX("jobs", F_U64S, jobs, .off_n = M(n_jobs), .max = KVS_MAX_JOBS_QUERY),
};
static const fdesc lane_rq[] = {SESSION, REQ("token", F_BIN16, lane_token)};
static const fdesc stats_rq[] = {OPT("session", F_U64, session)};
static const fdesc admin_rq[] = {
	SESSION,
	REQX("cmd", F_ENUM, admin_cmd, .aux = admin_cmd_names),
	OPTX("timeout_ms", F_U64, wait_ms, .max = 3600000),
};

static const fdesc hello_rp[] = {
	REQ("session", F_U64, session),
	REQ("heartbeat_ms", F_U64, heartbeat_ms),
	REQ("ttl_ms", F_U64, ttl_ms),
	REQX("limits", F_OBJ, limits, .aux = &limits_spec),
	OPT("packed_blocks", F_BOOL, packed_blocks),
};
static const fdesc heartbeat_rp[] = {REQ("pending_jobs", F_U64, pending_jobs)};
static const fdesc register_rp[] = {
	REQ("registration", F_U64, registration),
	REQ("imported", F_U64, imported),
	REQ("aliased", F_U64, aliased),
};
static const fdesc lookup_rp[] = {
	REQX("hits", F_U64, hits, .max = KVS_MAX_KEYS),
	REQX("tiers", F_ENUMS, tiers, .off_n = M(n_tiers), .max = KVS_MAX_KEYS, .aux = tier_names),
};
static const fdesc job_rp[] = {
	REQ("job", F_U64, job),
	REQX("state", F_ENUM, state, .aux = state_names),
	OPTX("reason", F_STR, reason, .max = KVS_MAX_STR), /* a store with complete: the job's end */
};
static const fdesc job_status_rp[] = {
	REQX("jobs", F_OBJS, job_infos, .off_n = M(n_job_infos), .max = KVS_MAX_JOBS_QUERY,
	    .aux = &jobinfo_spec, .esz = sizeof(kvs_job_info)),
};
static const fdesc stats_rp[] = {
	REQX("counters", F_COUNTERS, counters, .off_n = M(n_counters), .max = KVS_MAX_COUNTERS),
};
static const fdesc admin_rp[] = {
	REQX("cmd", F_ENUM, admin_cmd, .aux = admin_cmd_names),
	REQ("draining", F_BOOL, draining),
	REQ("jobs_open", F_U64, jobs_open),
	OPT("drained", F_BOOL, drained),
	OPT("waited_ms", F_U64, waited_ms),
	OPT("cleared_l1", F_U64, cleared_l1),
	OPT("cleared_l2", F_U64, cleared_l2),
	OPT("kept_l1", F_U64, kept_l1),
};
static const fdesc job_done_rp[] = {
	REQ("job", F_U64, job),
	REQX("state", F_ENUM, state, .aux = state_names),
	REQX("reason", F_STR, reason, .max = KVS_MAX_STR),
};

const kvs_opdef kvs__proto_ops[KVS_OP_COUNT_] = {
	[KVS_OP_HELLO] = {"hello", SPEC(hello_rq), SPEC(hello_rp)},
	[KVS_OP_HEARTBEAT] = {"heartbeat", SPEC(session_rq), SPEC(heartbeat_rp)},
	[KVS_OP_BYE] = {"bye", SPEC(session_rq), {NULL, 0}},
	[KVS_OP_REGISTER] = {"register", SPEC(register_rq), SPEC(register_rp)},
	[KVS_OP_UNREGISTER] = {"unregister", SPEC(unregister_rq), {NULL, 0}},
	[KVS_OP_LOOKUP] = {"lookup", SPEC(lookup_rq), SPEC(lookup_rp)},
	[KVS_OP_STORE] = {"store", SPEC(store_rq), SPEC(job_rp)},
	[KVS_OP_RETRIEVE] = {"retrieve", SPEC(retrieve_rq), SPEC(job_rp)},
	[KVS_OP_COMPLETE] = {"complete", SPEC(complete_rq), SPEC(job_rp)},
	[KVS_OP_JOB_STATUS] = {"job_status", SPEC(job_status_rq), SPEC(job_status_rp)},
	[KVS_OP_STATS] = {"stats", SPEC(stats_rq), SPEC(stats_rp)},
	[KVS_OP_JOB_DONE] = {"job_done", {NULL, 0}, SPEC(job_done_rp)},
	[KVS_OP_ADMIN] = {"admin", SPEC(admin_rq), SPEC(admin_rp)},
	[KVS_OP_LANE] = {"lane", SPEC(lane_rq), {NULL, 0}},
};

const char *kvs_op_name(kvs_op op)
{
	return (op > KVS_OP_NONE && op < KVS_OP_COUNT_) ? kvs__proto_ops[op].name : "?";
}

kvs_op kvs_op_from_name(const char *name, size_t len)
{
	for (int i = 1; i < KVS_OP_COUNT_; i++)
		if (strlen(kvs__proto_ops[i].name) == len && memcmp(kvs__proto_ops[i].name, name, len) == 0)
			return (kvs_op)i;
	return KVS_OP_NONE;
}

const char *kvs_job_state_name(int s)
{
	return (s >= 0 && s <= KVS_JOB_UNKNOWN) ? state_names[s] : "?";
}

const char *kvs_tier_name(int t) { return (t >= KVS_TIER_L1 && t <= KVS_TIER_L3) ? tier_names[t] : "?"; }

const char *kvs_admin_cmd_name(int c)
{
	return (c >= KVS_ADMIN_STATUS && c <= KVS_ADMIN_CLEAR) ? admin_cmd_names[c] : "?";
}

int kvs_admin_cmd_from_name(const char *name)
{
	for (int i = 0; admin_cmd_names[i]; i++)
		if (strcmp(name, admin_cmd_names[i]) == 0)
			return i;
	return -1;
}

void kvs_str_copy(char *dst, size_t cap, kvs_str s)
{
	size_t n = s.len < cap - 1 ? s.len : cap - 1;
	if (n)
		memcpy(dst, s.ptr, n);
	dst[n] = '\0';
}

int kvs__proto_fail(kvs_proto_err *err, int code, const char *fmt, ...)
{
	err->code = code;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
	va_end(ap);
	return code;
}
