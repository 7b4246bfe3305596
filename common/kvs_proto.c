/* Protocol v1 codec: a structural pre-scan of the raw bytes (limits, nesting,
 * truncation, trailing bytes) followed by msgpack-c decoding and a walk over
 * one field table per op and direction. The tables are the single source of
 * truth for which fields each message carries. */
#include "kvs_proto.h"

#include <errno.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvs_error.h"

/* ---- field tables ------------------------------------------------------ */

enum ftype {
	F_U64,     /* uint64_t, value <= max (0 = no max) */
	F_U32,     /* uint32_t, value <= max (0 = UINT32_MAX) */
	F_I64,     /* int64_t */
	F_BOOL,    /* bool */
	F_STR,     /* kvs_str, len <= max */
	F_BIN16,   /* uint8_t[16], exactly 16 bytes */
	F_BINV,    /* kvs_bytes, len <= max */
	F_ENUM,    /* uint8_t, string from aux names */
	F_ENUMS,   /* const uint8_t * + uint32_t count at off_n, strings from aux */
	F_KEYS,    /* const uint8_t * (32 B each) + uint32_t count at off_n */
	F_BLOCKS,  /* kvs_block_lists */
	F_U64S,    /* const uint64_t * + uint32_t count at off_n */
	F_OBJS,    /* array of maps: const T * + uint32_t count at off_n, aux spec */
	F_OBJ,     /* one nested map decoded in place, aux spec */
	F_COUNTERS /* map str -> uint: const kvs_counter * + count at off_n */
};

typedef struct fdesc {
	const char *name;
	uint8_t type;
	bool req;
	uint16_t off;
	uint16_t off_n;
	uint32_t max;
	const void *aux;
	uint16_t esz;
	int64_t def;
} fdesc;

typedef struct spec {
	const fdesc *f;
	uint8_t n;
} spec;

static const char *const role_names[] = {"scheduler", "worker", NULL};
static const char *const devtype_names[] = {"host", "cuda", NULL};
static const char *const kind_names[] = {"attention", "recurrent", NULL};
static const char *const status_names[] = {"ok", "failed", NULL};
static const char *const state_names[] = {"open", "committed", "aborted", "unknown", NULL};
static const char *const tier_names[] = {"l1", "l2", NULL};
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

static const struct opdef {
	const char *name;
	spec rq, rp;
} ops[KVS_OP_COUNT_] = {
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
};

const char *kvs_op_name(kvs_op op)
{
	return (op > KVS_OP_NONE && op < KVS_OP_COUNT_) ? ops[op].name : "?";
}

kvs_op kvs_op_from_name(const char *name, size_t len)
{
	for (int i = 1; i < KVS_OP_COUNT_; i++)
		if (strlen(ops[i].name) == len && memcmp(ops[i].name, name, len) == 0)
			return (kvs_op)i;
	return KVS_OP_NONE;
}

const char *kvs_job_state_name(int s)
{
	return (s >= 0 && s <= KVS_JOB_UNKNOWN) ? state_names[s] : "?";
}

const char *kvs_tier_name(int t) { return (t == KVS_TIER_L1 || t == KVS_TIER_L2) ? tier_names[t] : "?"; }

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

/* ---- structural pre-scan ----------------------------------------------- */

static int fail(kvs_proto_err *err, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static int fail(kvs_proto_err *err, int code, const char *fmt, ...)
{
	err->code = code;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
	va_end(ap);
	return code;
}

static uint64_t be(const uint8_t *p, int n)
{
	uint64_t v = 0;
	for (int i = 0; i < n; i++)
		v = (v << 8) | p[i];
	return v;
}

/* Walks exactly one msgpack object over buf[*ppos..n) without allocating and
 * advances *ppos past it: rejects truncation, the never-used byte 0xc1,
 * nesting deeper than KVS_MAX_DEPTH and more than 2 * KVS_MAX_BLOCK_IDS items
 * in all, so that msgpack-c never sizes an allocation from a hostile length. */
static int scan_one(const uint8_t *p, size_t n, size_t *ppos, kvs_proto_err *err)
{
	uint64_t stack[KVS_MAX_DEPTH + 1];
	int depth = 0;
	uint64_t need = 1, total = 0;
	size_t pos = *ppos;
	for (;;) {
		if (need == 0) {
			if (depth == 0)
				break;
			need = stack[--depth];
			continue;
		}
		need--;
		if (pos >= n)
			return fail(err, KVS_E_BADMSG, "truncated message");
		uint8_t b = p[pos++];
		uint64_t len = 0, items = 0;
		int hdr = 0, container = 0;
		if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
			len = 0;
		} else if (b >= 0x80 && b <= 0x8f) {
			items = 2u * (b & 0x0f), container = 1;
		} else if (b >= 0x90 && b <= 0x9f) {
			items = b & 0x0f, container = 1;
		} else if (b >= 0xa0 && b <= 0xbf) {
			len = b & 0x1f;
		} else {
			switch (b) {
			case 0xc4: case 0xd9: hdr = 1; break;
			case 0xc5: case 0xda: hdr = 2; break;
			case 0xc6: case 0xdb: hdr = 4; break;
			case 0xc7: hdr = 1; len = 1; break;
			case 0xc8: hdr = 2; len = 1; break;
			case 0xc9: hdr = 4; len = 1; break;
			case 0xca: len = 4; break;
			case 0xcb: len = 8; break;
			case 0xcc: case 0xd0: len = 1; break;
			case 0xcd: case 0xd1: len = 2; break;
			case 0xce: case 0xd2: len = 4; break;
			case 0xcf: case 0xd3: len = 8; break;
			case 0xd4: len = 2; break;
			case 0xd5: len = 3; break;
			case 0xd6: len = 5; break;
			case 0xd7: len = 9; break;
			case 0xd8: len = 17; break;
			case 0xdc: hdr = 2; container = 1; break;
			case 0xdd: hdr = 4; container = 1; break;
			case 0xde: hdr = 2; container = 2; break;
			case 0xdf: hdr = 4; container = 2; break;
			default:
				return fail(err, KVS_E_BADMSG, "invalid msgpack byte 0x%02x", b);
			}
			if (hdr) {
				if (n - pos < (size_t)hdr)
					return fail(err, KVS_E_BADMSG, "truncated message");
				uint64_t v = be(p + pos, hdr);
				pos += (size_t)hdr;
				if (container)
					items = v * (uint64_t)container;
				else
					len += v;
			}
		}
		if (container) {
			if (items > n - pos)
				return fail(err, KVS_E_BADMSG, "truncated message (container of %llu items)",
					    (unsigned long long)items);
			total += items;
			if (total > 2ull * KVS_MAX_BLOCK_IDS)
				return fail(err, KVS_E_LIMIT, "too many elements in message");
			if (depth >= KVS_MAX_DEPTH)
				return fail(err, KVS_E_LIMIT, "nesting deeper than %d", KVS_MAX_DEPTH);
			stack[depth++] = need;
			need = items;
		} else {
			if (len > n - pos)
				return fail(err, KVS_E_BADMSG, "truncated message");
			pos += (size_t)len;
		}
	}
	*ppos = pos;
	return 0;
}

/* One whole message: exactly one object, no trailing bytes. */
static int prescan(const uint8_t *p, size_t n, kvs_proto_err *err)
{
	size_t pos = 0;
	int r = scan_one(p, n, &pos, err);
	if (r)
		return r;
	if (pos != n)
		return fail(err, KVS_E_BADMSG, "%zu trailing bytes after the message", n - pos);
	return 0;
}

/* After a size or structural failure: reads `id` (unsigned) and `op` (string)
 * from the top-level map as far as its pairs are well formed, so that the
 * error reply still names the request it answers (a reply with id 0 would
 * look like a push and leave the sender waiting). Never allocates; O(n). */
static void peek_envelope(const uint8_t *p, size_t n, kvs_proto_err *err)
{
	kvs_proto_err scratch;
	uint64_t pairs;
	size_t pos = 1;
	if (n == 0)
		return;
	if (p[0] >= 0x80 && p[0] <= 0x8f) {
		pairs = p[0] & 0x0f;
	} else if ((p[0] == 0xde && n >= 3) || (p[0] == 0xdf && n >= 5)) {
		int h = p[0] == 0xde ? 2 : 4;
		pairs = be(p + 1, h);
		pos += (size_t)h;
	} else {
		return;
	}
	for (uint64_t i = 0; i < pairs; i++) {
		size_t k = pos, v;
		if (scan_one(p, n, &pos, &scratch))
			return;
		v = pos;
		if (scan_one(p, n, &pos, &scratch))
			return;
		/* both keys are 2-byte fixstr: 0xa2 'i' 'd' / 0xa2 'o' 'p' */
		if (v - k != 3 || p[k] != 0xa2)
			continue;
		uint8_t b = p[v];
		if (memcmp(p + k + 1, "id", 2) == 0) {
			if (b <= 0x7f)
				err->id = b;
			else if (b >= 0xcc && b <= 0xcf)
				err->id = be(p + v + 1, 1 << (b - 0xcc));
		} else if (memcmp(p + k + 1, "op", 2) == 0) {
			size_t hdr = 0, len = 0;
			if (b >= 0xa0 && b <= 0xbf)
				hdr = 1, len = b & 0x1f;
			else if (b >= 0xd9 && b <= 0xdb)
				hdr = 1 + (1u << (b - 0xd9)), len = (size_t)be(p + v + 1, (int)hdr - 1);
			if (hdr)
				err->op = kvs_op_from_name((const char *)p + v + hdr, len);
		}
	}
}

/* ---- decoding ---------------------------------------------------------- */

static bool get_u64(const msgpack_object *o, uint64_t *v)
{
	if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
		return false;
	*v = o->via.u64;
	return true;
}

static bool get_i64(const msgpack_object *o, int64_t *v)
{
	if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
		*v = o->via.i64;
		return true;
	}
	if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX) {
		*v = (int64_t)o->via.u64;
		return true;
	}
	return false;
}

static bool str_eq(const msgpack_object_str *s, const char *c)
{
	size_t n = strlen(c);
	return s->size == n && memcmp(s->ptr, c, n) == 0;
}

static int enum_index(const msgpack_object *o, const char *const *names)
{
	if (o->type != MSGPACK_OBJECT_STR)
		return -1;
	for (int i = 0; names[i]; i++)
		if (str_eq(&o->via.str, names[i]))
			return i;
	return -1;
}

static int decode_map(const spec *sp, const msgpack_object *map, char *base, msgpack_zone *z,
		      uint64_t *present, const char *parent, kvs_proto_err *err);

#define BAD(...) fail(err, KVS_E_BADMSG, __VA_ARGS__)

static int decode_field(const fdesc *f, const msgpack_object *o, char *base, msgpack_zone *z,
			const char *pn, kvs_proto_err *err)
{
	void *dst = base + f->off;
	const char *nm = f->name;
	switch (f->type) {
	case F_U64: {
		uint64_t v;
		if (!get_u64(o, &v))
			return BAD("%s%s: expected unsigned integer", pn, nm);
		if (f->max && v > f->max)
			return BAD("%s%s: %llu exceeds %u", pn, nm, (unsigned long long)v, f->max);
		memcpy(dst, &v, sizeof(v));
		return 0;
	}
	case F_U32: {
		uint64_t v;
		uint64_t max = f->max ? f->max : UINT32_MAX;
		if (!get_u64(o, &v))
			return BAD("%s%s: expected unsigned integer", pn, nm);
		if (v > max)
			return BAD("%s%s: %llu exceeds %llu", pn, nm, (unsigned long long)v,
				   (unsigned long long)max);
		uint32_t w = (uint32_t)v;
		memcpy(dst, &w, sizeof(w));
		return 0;
	}
	case F_I64: {
		int64_t v;
		if (!get_i64(o, &v))
			return BAD("%s%s: expected integer", pn, nm);
		memcpy(dst, &v, sizeof(v));
		return 0;
	}
	case F_BOOL:
		if (o->type != MSGPACK_OBJECT_BOOLEAN)
			return BAD("%s%s: expected boolean", pn, nm);
		*(bool *)dst = o->via.boolean;
		return 0;
	case F_STR: {
		if (o->type != MSGPACK_OBJECT_STR)
			return BAD("%s%s: expected string", pn, nm);
		if (o->via.str.size > f->max)
			return fail(err, KVS_E_LIMIT, "%s%s: string longer than %u bytes", pn, nm, f->max);
		kvs_str s = {o->via.str.ptr, o->via.str.size};
		memcpy(dst, &s, sizeof(s));
		return 0;
	}
	case F_BIN16:
		if (o->type != MSGPACK_OBJECT_BIN || o->via.bin.size != 16)
			return BAD("%s%s: expected 16-byte binary", pn, nm);
		memcpy(dst, o->via.bin.ptr, 16);
		return 0;
	case F_BINV: {
		if (o->type != MSGPACK_OBJECT_BIN)
			return BAD("%s%s: expected binary", pn, nm);
		if (o->via.bin.size > f->max)
			return fail(err, KVS_E_LIMIT, "%s%s: longer than %u bytes", pn, nm, f->max);
		kvs_bytes b = {(const uint8_t *)o->via.bin.ptr, o->via.bin.size};
		memcpy(dst, &b, sizeof(b));
		return 0;
	}
	case F_ENUM: {
		int i = enum_index(o, f->aux);
		if (i < 0)
			return BAD("%s%s: unknown value", pn, nm);
		*(uint8_t *)dst = (uint8_t)i;
		return 0;
	}
	default:
		break;
	}

	/* arrays and maps */
	if (f->type == F_OBJ) {
		if (o->type != MSGPACK_OBJECT_MAP)
			return BAD("%s%s: expected map", pn, nm);
		char path[64];
		snprintf(path, sizeof(path), "%s%s.", pn, nm);
		uint64_t pres = 0;
		return decode_map(f->aux, o, dst, z, &pres, path, err);
	}
	if (f->type == F_COUNTERS) {
		if (o->type != MSGPACK_OBJECT_MAP)
			return BAD("%s%s: expected map", pn, nm);
		uint32_t n = o->via.map.size;
		if (n > f->max)
			return fail(err, KVS_E_LIMIT, "%s%s: more than %u entries", pn, nm, f->max);
		kvs_counter *c = msgpack_zone_malloc(z, sizeof(*c) * (n ? n : 1));
		if (!c)
			return fail(err, KVS_E_INTERNAL, "out of memory");
		for (uint32_t i = 0; i < n; i++) {
			const msgpack_object_kv *kv = &o->via.map.ptr[i];
			if (kv->key.type != MSGPACK_OBJECT_STR || !get_u64(&kv->val, &c[i].value))
				return BAD("%s%s: expected string -> unsigned integer", pn, nm);
			c[i].name = (kvs_str){kv->key.via.str.ptr, kv->key.via.str.size};
		}
		memcpy(dst, &c, sizeof(c));
		memcpy(base + f->off_n, &n, sizeof(n));
		return 0;
	}
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return BAD("%s%s: expected array", pn, nm);
	uint32_t n = o->via.array.size;
	const msgpack_object *el = o->via.array.ptr;
	if (f->type == F_BLOCKS) {
		kvs_block_lists *bl = dst;
		if (n > KVS_MAX_GROUPS)
			return fail(err, KVS_E_LIMIT, "%s%s: more than %d groups", pn, nm, KVS_MAX_GROUPS);
		uint64_t total = 0;
		bl->n = n;
		for (uint32_t g = 0; g < n; g++) {
			if (el[g].type != MSGPACK_OBJECT_ARRAY)
				return BAD("%s%s[%u]: expected array", pn, nm, g);
			uint32_t m = el[g].via.array.size;
			total += m;
			if (total > f->max)
				return fail(err, KVS_E_LIMIT, "%s%s: more than %u block ids", pn, nm, f->max);
			int64_t *ids = msgpack_zone_malloc(z, sizeof(int64_t) * (m ? m : 1));
			if (!ids)
				return fail(err, KVS_E_INTERNAL, "out of memory");
			for (uint32_t i = 0; i < m; i++)
				if (!get_i64(&el[g].via.array.ptr[i], &ids[i]))
					return BAD("%s%s[%u][%u]: expected integer", pn, nm, g, i);
			bl->ids[g] = ids;
			bl->len[g] = m;
		}
		return 0;
	}
	if (n > f->max)
		return fail(err, KVS_E_LIMIT, "%s%s: more than %u elements", pn, nm, f->max);
	void *arr = NULL;
	switch (f->type) {
	case F_KEYS: {
		uint8_t *k = msgpack_zone_malloc(z, (size_t)KVS_KEY_BYTES * (n ? n : 1));
		if (!k)
			return fail(err, KVS_E_INTERNAL, "out of memory");
		for (uint32_t i = 0; i < n; i++) {
			if (el[i].type != MSGPACK_OBJECT_BIN || el[i].via.bin.size != KVS_KEY_BYTES)
				return BAD("%s%s[%u]: expected 32-byte binary", pn, nm, i);
			memcpy(k + (size_t)i * KVS_KEY_BYTES, el[i].via.bin.ptr, KVS_KEY_BYTES);
		}
		arr = k;
		break;
	}
	case F_ENUMS: {
		uint8_t *e = msgpack_zone_malloc(z, n ? n : 1);
		if (!e)
			return fail(err, KVS_E_INTERNAL, "out of memory");
		for (uint32_t i = 0; i < n; i++) {
			int v = enum_index(&el[i], f->aux);
			if (v < 0)
				return BAD("%s%s[%u]: unknown value", pn, nm, i);
			e[i] = (uint8_t)v;
		}
		arr = e;
		break;
	}
	case F_U64S: {
		uint64_t *u = msgpack_zone_malloc(z, sizeof(uint64_t) * (n ? n : 1));
		if (!u)
			return fail(err, KVS_E_INTERNAL, "out of memory");
		for (uint32_t i = 0; i < n; i++)
			if (!get_u64(&el[i], &u[i]))
				return BAD("%s%s[%u]: expected unsigned integer", pn, nm, i);
		arr = u;
		break;
	}
	case F_OBJS: {
		char *objs = msgpack_zone_malloc(z, (size_t)f->esz * (n ? n : 1));
		if (!objs)
			return fail(err, KVS_E_INTERNAL, "out of memory");
		memset(objs, 0, (size_t)f->esz * (n ? n : 1));
		for (uint32_t i = 0; i < n; i++) {
			char path[64];
			snprintf(path, sizeof(path), "%s%s[%u].", pn, nm, i);
			if (el[i].type != MSGPACK_OBJECT_MAP)
				return BAD("%s%s[%u]: expected map", pn, nm, i);
			uint64_t pres = 0;
			int r = decode_map(f->aux, &el[i], objs + (size_t)i * f->esz, z, &pres, path, err);
			if (r)
				return r;
		}
		arr = objs;
		break;
	}
	default:
		return fail(err, KVS_E_INTERNAL, "bad field table");
	}
	memcpy(dst, &arr, sizeof(arr));
	memcpy(base + f->off_n, &n, sizeof(n));
	return 0;
}

static int decode_map(const spec *sp, const msgpack_object *map, char *base, msgpack_zone *z,
		      uint64_t *present, const char *parent, kvs_proto_err *err)
{
	for (uint8_t i = 0; i < sp->n; i++) {
		const fdesc *f = &sp->f[i];
		if (!f->req && (f->type == F_I64))
			memcpy(base + f->off, &f->def, sizeof(int64_t));
	}
	for (uint32_t k = 0; k < map->via.map.size; k++) {
		const msgpack_object_kv *kv = &map->via.map.ptr[k];
		if (kv->key.type != MSGPACK_OBJECT_STR)
			return BAD("%snon-string key in map", parent);
		for (uint8_t i = 0; i < sp->n; i++) {
			if (!str_eq(&kv->key.via.str, sp->f[i].name))
				continue;
			if (*present & (1ull << i))
				return BAD("%s%s: duplicate key", parent, sp->f[i].name);
			*present |= 1ull << i;
			int r = decode_field(&sp->f[i], &kv->val, base, z, parent, err);
			if (r)
				return r;
			break;
		}
	}
	for (uint8_t i = 0; i < sp->n; i++)
		if (sp->f[i].req && !(*present & (1ull << i)))
			return BAD("%s%s: missing field", parent, sp->f[i].name);
	return 0;
}

static const msgpack_object *map_find(const msgpack_object *map, const char *key, int *dups)
{
	const msgpack_object *found = NULL;
	for (uint32_t k = 0; k < map->via.map.size; k++) {
		const msgpack_object_kv *kv = &map->via.map.ptr[k];
		if (kv->key.type == MSGPACK_OBJECT_STR && str_eq(&kv->key.via.str, key)) {
			if (found)
				(*dups)++;
			found = &kv->val;
		}
	}
	return found;
}

int kvs_proto_decode(const void *buf, size_t len, bool is_reply, kvs_msg *msg, kvs_proto_err *err)
{
	memset(msg, 0, sizeof(*msg));
	memset(err, 0, sizeof(*err));
	if (len > KVS_MAX_MSG_BYTES) {
		peek_envelope(buf, len, err);
		if (!is_reply && err->op == KVS_OP_JOB_DONE)
			err->op = KVS_OP_NONE;
		return fail(err, KVS_E_LIMIT, "message of %zu bytes exceeds %u", len, KVS_MAX_MSG_BYTES);
	}
	int r = prescan(buf, len, err);
	if (r) {
		peek_envelope(buf, len, err);
		if (!is_reply && err->op == KVS_OP_JOB_DONE)
			err->op = KVS_OP_NONE;
		return r;
	}
	msgpack_zone *z = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE);
	if (!z)
		return fail(err, KVS_E_INTERNAL, "out of memory");
	msgpack_object root;
	size_t off = 0;
	msgpack_unpack_return ur = msgpack_unpack(buf, len, &off, z, &root);
	if (ur != MSGPACK_UNPACK_SUCCESS) {
		r = ur == MSGPACK_UNPACK_NOMEM_ERROR ? fail(err, KVS_E_INTERNAL, "out of memory")
						     : BAD("not a msgpack message");
		goto out_err;
	}
	if (root.type != MSGPACK_OBJECT_MAP) {
		r = BAD("message is not a map");
		goto out_err;
	}
	int dups = 0;
	const msgpack_object *o_id = map_find(&root, "id", &dups);
	const msgpack_object *o_v = map_find(&root, "v", &dups);
	const msgpack_object *o_op = map_find(&root, "op", &dups);
	if (o_id && get_u64(o_id, &err->id))
		msg->id = err->id;
	if (o_op && o_op->type == MSGPACK_OBJECT_STR)
		err->op = kvs_op_from_name(o_op->via.str.ptr, o_op->via.str.size);
	if (!is_reply && err->op == KVS_OP_JOB_DONE)
		err->op = KVS_OP_NONE; /* an error reply must never read as a push */
	if (dups) {
		r = BAD("duplicate envelope key");
		goto out_err;
	}
	if (!o_id || o_id->type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
		r = BAD(o_id ? "id: expected unsigned integer" : "id: missing field");
		goto out_err;
	}
	uint64_t v;
	if (!o_v || !get_u64(o_v, &v)) {
		r = BAD(o_v ? "v: expected unsigned integer" : "v: missing field");
		goto out_err;
	}
	if (v != KVS_PROTO_VERSION) {
		r = fail(err, KVS_E_VERSION, "protocol version %llu not supported (this side speaks %d)",
			 (unsigned long long)v, KVS_PROTO_VERSION);
		goto out_err;
	}
	msg->v = (uint32_t)v;
	if (!o_op || o_op->type != MSGPACK_OBJECT_STR) {
		r = BAD(o_op ? "op: expected string" : "op: missing field");
		goto out_err;
	}
	msg->op = err->op;
	if (is_reply && msg->op == KVS_OP_NONE) {
		/* an error reply to a request whose op was unreadable carries
		 * op "unknown": accept it so the client can match it by id */
		const msgpack_object *o_ok = map_find(&root, "ok", &dups);
		if (o_ok && o_ok->type == MSGPACK_OBJECT_BOOLEAN && !o_ok->via.boolean &&
		    str_eq(&o_op->via.str, "unknown"))
			msg->op = KVS_OP_NONE, err->op = KVS_OP_NONE;
		else
			goto unknown_op;
	} else if (msg->op == KVS_OP_NONE || (!is_reply && msg->op == KVS_OP_JOB_DONE)) {
	unknown_op:
		err->op = KVS_OP_NONE; /* never answer with op "job_done": it reads as a push */
		r = fail(err, KVS_E_UNKNOWN_OP, "unknown op '%.*s'", (int)(o_op->via.str.size > 32 ? 32 : o_op->via.str.size),
			 o_op->via.str.ptr);
		msg->op = KVS_OP_NONE;
		goto out_err;
	}
	msg->is_reply = is_reply;
	msg->zone_ = z;
	if (is_reply) {
		const msgpack_object *o_ok = map_find(&root, "ok", &dups);
		const msgpack_object *o_ep = map_find(&root, "epoch", &dups);
		if (dups) {
			r = BAD("duplicate envelope key");
			goto out_clear;
		}
		if (!o_ok || o_ok->type != MSGPACK_OBJECT_BOOLEAN) {
			r = BAD("ok: missing or not boolean");
			goto out_clear;
		}
		if (!o_ep || o_ep->type != MSGPACK_OBJECT_BIN || o_ep->via.bin.size != KVS_EPOCH_BYTES) {
			r = BAD("epoch: missing or not 16-byte binary");
			goto out_clear;
		}
		memcpy(msg->epoch, o_ep->via.bin.ptr, KVS_EPOCH_BYTES);
		msg->ok = o_ok->via.boolean;
		if (!msg->ok) {
			const msgpack_object *o_code = map_find(&root, "code", &dups);
			const msgpack_object *o_msg = map_find(&root, "msg", &dups);
			if (dups) {
				r = BAD("duplicate envelope key");
				goto out_clear;
			}
			if (!o_code || o_code->type != MSGPACK_OBJECT_STR) {
				r = BAD("code: missing or not string");
				goto out_clear;
			}
			msg->code = kvs_error_from_name(o_code->via.str.ptr, o_code->via.str.size);
			if (o_msg && o_msg->type == MSGPACK_OBJECT_STR)
				msg->errmsg = (kvs_str){o_msg->via.str.ptr, o_msg->via.str.size};
			return 0;
		}
	}
	if (msg->op == KVS_OP_NONE) {
		r = BAD("op: unknown op in a successful reply");
		goto out_clear;
	}
	const spec *sp = is_reply ? &ops[msg->op].rp : &ops[msg->op].rq;
	r = decode_map(sp, &root, (char *)msg, z, &msg->present_, "", err);
	if (r)
		goto out_clear;
	return 0;

out_clear:
	{
		kvs_op op = msg->op;
		uint64_t id = msg->id;
		kvs_msg_clear(msg);
		msg->op = op;
		msg->id = id;
		return r;
	}
out_err:
	msgpack_zone_free(z);
	return r;
}

void kvs_msg_clear(kvs_msg *msg)
{
	if (msg->zone_)
		msgpack_zone_free(msg->zone_);
	memset(msg, 0, sizeof(*msg));
}

bool kvs_msg_has(const kvs_msg *msg, const char *name)
{
	if (msg->op <= KVS_OP_NONE || msg->op >= KVS_OP_COUNT_)
		return false;
	const spec *sp = msg->is_reply ? &ops[msg->op].rp : &ops[msg->op].rq;
	for (uint8_t i = 0; i < sp->n; i++)
		if (strcmp(sp->f[i].name, name) == 0)
			return (msg->present_ >> i) & 1;
	return false;
}

/* ---- encoding ---------------------------------------------------------- */

static int pack_str(msgpack_packer *pk, const char *s, size_t n)
{
	return msgpack_pack_str(pk, n) | msgpack_pack_str_body(pk, s, n);
}

static int pack_bin(msgpack_packer *pk, const void *b, size_t n)
{
	return msgpack_pack_bin(pk, n) | msgpack_pack_bin_body(pk, b, n);
}

static int encode_map(msgpack_packer *pk, const spec *sp, const char *base);

static int encode_field(msgpack_packer *pk, const fdesc *f, const char *base)
{
	const void *src = base + f->off;
	uint32_t n = 0;
	if (f->off_n)
		memcpy(&n, base + f->off_n, sizeof(n));
	switch (f->type) {
	case F_U64: {
		uint64_t v;
		memcpy(&v, src, sizeof(v));
		return msgpack_pack_uint64(pk, v);
	}
	case F_U32: {
		uint32_t v;
		memcpy(&v, src, sizeof(v));
		return msgpack_pack_uint64(pk, v);
	}
	case F_I64: {
		int64_t v;
		memcpy(&v, src, sizeof(v));
		return msgpack_pack_int64(pk, v);
	}
	case F_BOOL:
		return *(const bool *)src ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
	case F_STR: {
		kvs_str s;
		memcpy(&s, src, sizeof(s));
		if (s.len > f->max)
			return -EINVAL;
		return pack_str(pk, s.ptr ? s.ptr : "", s.len);
	}
	case F_BIN16:
		return pack_bin(pk, src, 16);
	case F_BINV: {
		kvs_bytes b;
		memcpy(&b, src, sizeof(b));
		return pack_bin(pk, b.ptr ? (const void *)b.ptr : "", b.len);
	}
	case F_ENUM: {
		const char *const *names = f->aux;
		uint8_t v = *(const uint8_t *)src;
		const char *s = names[0];
		for (int i = 0; names[i]; i++)
			if (i == v)
				s = names[i];
		return pack_str(pk, s, strlen(s));
	}
	case F_OBJ:
		return encode_map(pk, f->aux, src);
	case F_BLOCKS: {
		const kvs_block_lists *bl = src;
		int r = msgpack_pack_array(pk, bl->n);
		for (uint32_t g = 0; g < bl->n && g < KVS_MAX_GROUPS; g++) {
			r |= msgpack_pack_array(pk, bl->len[g]);
			for (uint32_t i = 0; i < bl->len[g]; i++)
				r |= msgpack_pack_int64(pk, bl->ids[g][i]);
		}
		return r;
	}
	default:
		break;
	}
	const void *arr;
	memcpy(&arr, src, sizeof(arr));
	if (n && !arr)
		return -EINVAL;
	if (f->type == F_COUNTERS) {
		const kvs_counter *c = arr;
		int r = msgpack_pack_map(pk, n);
		for (uint32_t i = 0; i < n; i++)
			r |= pack_str(pk, c[i].name.ptr, c[i].name.len) | msgpack_pack_uint64(pk, c[i].value);
		return r;
	}
	int r = msgpack_pack_array(pk, n);
	for (uint32_t i = 0; i < n && !r; i++) {
		switch (f->type) {
		case F_KEYS:
			r |= pack_bin(pk, (const uint8_t *)arr + (size_t)i * KVS_KEY_BYTES, KVS_KEY_BYTES);
			break;
		case F_ENUMS: {
			const char *const *names = f->aux;
			uint8_t v = ((const uint8_t *)arr)[i];
			const char *s = v < 2 ? names[v] : names[0];
			r |= pack_str(pk, s, strlen(s));
			break;
		}
		case F_U64S:
			r |= msgpack_pack_uint64(pk, ((const uint64_t *)arr)[i]);
			break;
		case F_OBJS:
			r |= encode_map(pk, f->aux, (const char *)arr + (size_t)i * f->esz);
			break;
		default:
			return -EINVAL;
		}
	}
	return r;
}

/* Optional fields holding their default (zero, false, empty, or def) are left
 * out, so "absent" and "default" mean the same on the wire. */
static bool skip_opt(const fdesc *f, const char *base)
{
	if (f->req)
		return false;
	const char *src = base + f->off;
	switch (f->type) {
	case F_U64: return *(const uint64_t *)(const void *)src == 0;
	case F_I64: return *(const int64_t *)(const void *)src == f->def;
	case F_BOOL: return !*(const bool *)src;
	case F_BINV: return ((const kvs_bytes *)(const void *)src)->len == 0;
	case F_U64S:
	case F_KEYS: return *(const uint32_t *)(const void *)(base + f->off_n) == 0;
	default: return false;
	}
}

static uint32_t count_fields(const spec *sp, const char *base)
{
	uint32_t n = 0;
	for (uint8_t i = 0; i < sp->n; i++)
		n += !skip_opt(&sp->f[i], base);
	return n;
}

static int encode_fields(msgpack_packer *pk, const spec *sp, const char *base)
{
	int r = 0;
	for (uint8_t i = 0; i < sp->n && !r; i++) {
		if (skip_opt(&sp->f[i], base))
			continue;
		r |= pack_str(pk, sp->f[i].name, strlen(sp->f[i].name));
		r |= encode_field(pk, &sp->f[i], base);
	}
	return r;
}

static int encode_map(msgpack_packer *pk, const spec *sp, const char *base)
{
	return msgpack_pack_map(pk, count_fields(sp, base)) | encode_fields(pk, sp, base);
}

int kvs_proto_encode(const kvs_msg *msg, void **ret_buf, size_t *ret_len)
{
	bool anon_err = msg->is_reply && !msg->ok && msg->op == KVS_OP_NONE;
	if ((msg->op <= KVS_OP_NONE && !anon_err) || msg->op >= KVS_OP_COUNT_)
		return -EINVAL;
	const spec *sp = msg->is_reply ? &ops[msg->op].rp : &ops[msg->op].rq;
	const char *opname = anon_err ? "unknown" : ops[msg->op].name;
	msgpack_sbuffer sb;
	msgpack_packer pk;
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	uint32_t n = 3;
	if (msg->is_reply)
		n += 2 + (msg->ok ? count_fields(sp, (const char *)msg) : 2);
	else
		n += count_fields(sp, (const char *)msg);
	int r = msgpack_pack_map(&pk, n);
	r |= pack_str(&pk, "v", 1) | msgpack_pack_uint64(&pk, KVS_PROTO_VERSION);
	r |= pack_str(&pk, "op", 2) | pack_str(&pk, opname, strlen(opname));
	r |= pack_str(&pk, "id", 2) | msgpack_pack_uint64(&pk, msg->id);
	if (msg->is_reply) {
		r |= pack_str(&pk, "ok", 2) | (msg->ok ? msgpack_pack_true(&pk) : msgpack_pack_false(&pk));
		r |= pack_str(&pk, "epoch", 5) | pack_bin(&pk, msg->epoch, KVS_EPOCH_BYTES);
		if (!msg->ok) {
			const char *code = kvs_error_name(msg->code);
			uint32_t ml = msg->errmsg.len > KVS_MAX_ERRMSG ? KVS_MAX_ERRMSG : msg->errmsg.len;
			r |= pack_str(&pk, "code", 4) | pack_str(&pk, code, strlen(code));
			r |= pack_str(&pk, "msg", 3) | pack_str(&pk, msg->errmsg.ptr ? msg->errmsg.ptr : "", ml);
			goto done;
		}
	}
	r |= encode_fields(&pk, sp, (const char *)msg);
done:
	if (r) {
		msgpack_sbuffer_destroy(&sb);
		return r < 0 && r != -1 ? r : -ENOMEM;
	}
	*ret_buf = sb.data;
	*ret_len = sb.size;
	return 0;
}

/* ---- KV events (vLLM's wire format) ---------------------------------------------- */

static int pack_nil_field(msgpack_packer *pk, const char *name)
{
	return pack_str(pk, name, strlen(name)) | msgpack_pack_nil(pk);
}

int kvs_kvevents_encode(const kvs_kvevent *evs, uint32_t n, double ts, void **ret_buf, size_t *ret_len)
{
	static const char *kinds[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};
	msgpack_sbuffer sb;
	msgpack_packer pk;
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	/* KVEventBatch: array-like [ts, events] (data_parallel_rank omitted) */
	int r = msgpack_pack_array(&pk, 2) | msgpack_pack_double(&pk, ts) | msgpack_pack_array(&pk, n);
	for (uint32_t i = 0; i < n && !r; i++) {
		const kvs_kvevent *e = &evs[i];
		if (e->kind < KVS_KVEV_STORED || e->kind > KVS_KVEV_CLEARED) {
			r = -EINVAL;
			break;
		}
		const char *kind = kinds[e->kind - KVS_KVEV_STORED];
		/* a tagged struct: a map whose "type" names the class */
		uint32_t fields = e->kind == KVS_KVEV_STORED ? 8 : e->kind == KVS_KVEV_REMOVED ? 3 : 1;
		r |= msgpack_pack_map(&pk, fields) | pack_str(&pk, "type", 4) | pack_str(&pk, kind, strlen(kind));
		if (e->kind == KVS_KVEV_CLEARED)
			continue;
		r |= pack_str(&pk, "block_hashes", 12) | msgpack_pack_array(&pk, e->n_keys);
		for (uint32_t k = 0; k < e->n_keys; k++)
			r |= pack_bin(&pk, e->keys + 32 * (size_t)k, 32);
		if (e->kind == KVS_KVEV_STORED) {
			r |= pack_nil_field(&pk, "parent_block_hash");
			r |= pack_str(&pk, "token_ids", 9) | msgpack_pack_array(&pk, 0);
			r |= pack_str(&pk, "block_size", 10) | msgpack_pack_uint32(&pk, e->block_size);
			r |= pack_nil_field(&pk, "lora_id");
			r |= pack_nil_field(&pk, "lora_name");
		}
		r |= pack_str(&pk, "medium", 6) | pack_str(&pk, e->medium, strlen(e->medium));
	}
	if (r) {
		msgpack_sbuffer_destroy(&sb);
		return r < 0 && r != -1 ? r : -ENOMEM;
	}
	*ret_buf = sb.data;
	*ret_len = sb.size;
	return 0;
}
