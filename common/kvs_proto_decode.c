/* Protocol v1 decoder: after the structural pre-scan (kvs_proto_scan.c),
 * msgpack-c decodes the message into a zone, the envelope is checked, and the
 * op's field table (kvs_proto_fields.c) is walked to fill a flat kvs_msg. */
#include <msgpack.h>
#include <stdio.h>
#include <string.h>

#include "kvs_error.h"
#include "kvs_proto_impl.h"

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

#define BAD(...) kvs__proto_fail(err, KVS_E_BADMSG, __VA_ARGS__)

/* Scalar fields: integers, booleans, strings, binaries, one enum value. */
static int decode_scalar(const fdesc *f, const msgpack_object *o, void *dst, const char *pn, kvs_proto_err *err)
{
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
			return kvs__proto_fail(err, KVS_E_LIMIT, "%s%s: string longer than %u bytes", pn, nm, f->max);
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
			return kvs__proto_fail(err, KVS_E_LIMIT, "%s%s: longer than %u bytes", pn, nm, f->max);
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
		return kvs__proto_fail(err, KVS_E_INTERNAL, "bad field table");
	}
}

/* Maps: one nested object decoded in place (F_OBJ), or counters, a map of
 * name -> unsigned integer (F_COUNTERS). */
static int decode_nested(const fdesc *f, const msgpack_object *o, char *base, msgpack_zone *z,
			 const char *pn, kvs_proto_err *err)
{
	void *dst = base + f->off;
	const char *nm = f->name;
	if (o->type != MSGPACK_OBJECT_MAP)
		return BAD("%s%s: expected map", pn, nm);
	if (f->type == F_OBJ) {
		char path[64];
		snprintf(path, sizeof(path), "%s%s.", pn, nm);
		uint64_t pres = 0;
		return decode_map(f->aux, o, dst, z, &pres, path, err);
	}
	uint32_t n = o->via.map.size;
	if (n > f->max)
		return kvs__proto_fail(err, KVS_E_LIMIT, "%s%s: more than %u entries", pn, nm, f->max);
	kvs_counter *c = msgpack_zone_malloc(z, sizeof(*c) * (n ? n : 1));
	if (!c)
		return kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory");
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

/* Block lists: one array of block ids per group, f->max ids in all. */
static int decode_blocks(const fdesc *f, const msgpack_object *o, kvs_block_lists *bl, msgpack_zone *z,
			 const char *pn, kvs_proto_err *err)
{
	const char *nm = f->name;
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return BAD("%s%s: expected array", pn, nm);
	uint32_t n = o->via.array.size;
	const msgpack_object *el = o->via.array.ptr;
	if (n > KVS_MAX_GROUPS)
		return kvs__proto_fail(err, KVS_E_LIMIT, "%s%s: more than %d groups", pn, nm, KVS_MAX_GROUPS);
	uint64_t total = 0;
	bl->n = n;
	bl->packed = n > 0; /* every list packed: encodes back the same way */
	for (uint32_t g = 0; g < n; g++) {
		/* a list is an array of integers, or packed: a bin of 4-byte
		 * little-endian signed ids (protocol.md §10.1) */
		bool packed = el[g].type == MSGPACK_OBJECT_BIN;
		if (!packed && el[g].type != MSGPACK_OBJECT_ARRAY)
			return BAD("%s%s[%u]: expected array or bin", pn, nm, g);
		if (packed && el[g].via.bin.size % 4)
			return BAD("%s%s[%u]: packed list of %u bytes, not a multiple of 4", pn, nm, g,
				   el[g].via.bin.size);
		uint32_t m = packed ? el[g].via.bin.size / 4 : el[g].via.array.size;
		bl->packed = bl->packed && packed;
		total += m;
		if (total > f->max)
			return kvs__proto_fail(err, KVS_E_LIMIT, "%s%s: more than %u block ids", pn, nm, f->max);
		int64_t *ids = msgpack_zone_malloc(z, sizeof(int64_t) * (m ? m : 1));
		if (!ids)
			return kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory");
		if (packed) {
			const uint8_t *b = (const uint8_t *)el[g].via.bin.ptr;
			for (uint32_t i = 0; i < m; i++, b += 4)
				ids[i] = (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
						   (uint32_t)b[3] << 24);
		}
		for (uint32_t i = 0; i < m && !packed; i++)
			if (!get_i64(&el[g].via.array.ptr[i], &ids[i]))
				return BAD("%s%s[%u][%u]: expected integer", pn, nm, g, i);
		bl->ids[g] = ids;
		bl->len[g] = m;
	}
	return 0;
}

/* Arrays of one element type (keys, enum values, unsigned integers, maps):
 * a zone array at f->off and its length at f->off_n. */
static int decode_array(const fdesc *f, const msgpack_object *o, char *base, msgpack_zone *z,
			const char *pn, kvs_proto_err *err)
{
	const char *nm = f->name;
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return BAD("%s%s: expected array", pn, nm);
	uint32_t n = o->via.array.size;
	const msgpack_object *el = o->via.array.ptr;
	if (n > f->max)
		return kvs__proto_fail(err, KVS_E_LIMIT, "%s%s: more than %u elements", pn, nm, f->max);
	void *arr = NULL;
	switch (f->type) {
	case F_KEYS: {
		uint8_t *k = msgpack_zone_malloc(z, (size_t)KVS_KEY_BYTES * (n ? n : 1));
		if (!k)
			return kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory");
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
			return kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory");
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
			return kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory");
		for (uint32_t i = 0; i < n; i++)
			if (!get_u64(&el[i], &u[i]))
				return BAD("%s%s[%u]: expected unsigned integer", pn, nm, i);
		arr = u;
		break;
	}
	case F_OBJS: {
		char *objs = msgpack_zone_malloc(z, (size_t)f->esz * (n ? n : 1));
		if (!objs)
			return kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory");
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
		return kvs__proto_fail(err, KVS_E_INTERNAL, "bad field table");
	}
	memcpy(base + f->off, &arr, sizeof(arr));
	memcpy(base + f->off_n, &n, sizeof(n));
	return 0;
}

/* One field of a table, by type family. */
static int decode_field(const fdesc *f, const msgpack_object *o, char *base, msgpack_zone *z,
			const char *pn, kvs_proto_err *err)
{
	switch (f->type) {
	case F_U64:
	case F_U32:
	case F_I64:
	case F_BOOL:
	case F_STR:
	case F_BIN16:
	case F_BINV:
	case F_ENUM:
		return decode_scalar(f, o, base + f->off, pn, err);
	case F_OBJ:
	case F_COUNTERS:
		return decode_nested(f, o, base, z, pn, err);
	case F_BLOCKS:
		return decode_blocks(f, o, (kvs_block_lists *)(void *)(base + f->off), z, pn, err);
	default:
		return decode_array(f, o, base, z, pn, err);
	}
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

/* The envelope of a reply beyond v, op and id: ok and epoch, and for an
 * error reply (*ret_error set: no op fields follow) code and msg. */
static int decode_reply_head(const msgpack_object *root, kvs_msg *msg, kvs_proto_err *err, bool *ret_error)
{
	int dups = 0;
	const msgpack_object *o_ok = map_find(root, "ok", &dups);
	const msgpack_object *o_ep = map_find(root, "epoch", &dups);
	*ret_error = false;
	if (dups)
		return BAD("duplicate envelope key");
	if (!o_ok || o_ok->type != MSGPACK_OBJECT_BOOLEAN)
		return BAD("ok: missing or not boolean");
	if (!o_ep || o_ep->type != MSGPACK_OBJECT_BIN || o_ep->via.bin.size != KVS_EPOCH_BYTES)
		return BAD("epoch: missing or not 16-byte binary");
	memcpy(msg->epoch, o_ep->via.bin.ptr, KVS_EPOCH_BYTES);
	msg->ok = o_ok->via.boolean;
	if (msg->ok)
		return 0;
	const msgpack_object *o_code = map_find(root, "code", &dups);
	const msgpack_object *o_msg = map_find(root, "msg", &dups);
	if (dups)
		return BAD("duplicate envelope key");
	if (!o_code || o_code->type != MSGPACK_OBJECT_STR)
		return BAD("code: missing or not string");
	msg->code = kvs_error_from_name(o_code->via.str.ptr, o_code->via.str.size);
	if (o_msg && o_msg->type == MSGPACK_OBJECT_STR)
		msg->errmsg = (kvs_str){o_msg->via.str.ptr, o_msg->via.str.size};
	*ret_error = true;
	return 0;
}

int kvs_proto_decode(const void *buf, size_t len, bool is_reply, kvs_msg *msg, kvs_proto_err *err)
{
	memset(msg, 0, sizeof(*msg));
	memset(err, 0, sizeof(*err));
	if (len > KVS_MAX_MSG_BYTES) {
		kvs__proto_peek_envelope(buf, len, err);
		if (!is_reply && err->op == KVS_OP_JOB_DONE)
			err->op = KVS_OP_NONE;
		return kvs__proto_fail(err, KVS_E_LIMIT, "message of %zu bytes exceeds %u", len, KVS_MAX_MSG_BYTES);
	}
	int r = kvs__proto_prescan(buf, len, err);
	if (r) {
		kvs__proto_peek_envelope(buf, len, err);
		if (!is_reply && err->op == KVS_OP_JOB_DONE)
			err->op = KVS_OP_NONE;
		return r;
	}
	msgpack_zone *z = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE);
	if (!z)
		return kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory");
	msgpack_object root;
	size_t off = 0;
	msgpack_unpack_return ur = msgpack_unpack(buf, len, &off, z, &root);
	if (ur != MSGPACK_UNPACK_SUCCESS) {
		r = ur == MSGPACK_UNPACK_NOMEM_ERROR ? kvs__proto_fail(err, KVS_E_INTERNAL, "out of memory")
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
		r = kvs__proto_fail(err, KVS_E_VERSION, "protocol version %llu not supported (this side speaks %d)",
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
		r = kvs__proto_fail(err, KVS_E_UNKNOWN_OP, "unknown op '%.*s'", (int)(o_op->via.str.size > 32 ? 32 : o_op->via.str.size),
			 o_op->via.str.ptr);
		msg->op = KVS_OP_NONE;
		goto out_err;
	}
	msg->is_reply = is_reply;
	msg->zone_ = z;
	if (is_reply) {
		bool error_reply;
		r = decode_reply_head(&root, msg, err, &error_reply);
		if (r)
			goto out_clear;
		if (error_reply)
			return 0;
	}
	if (msg->op == KVS_OP_NONE) {
		r = BAD("op: unknown op in a successful reply");
		goto out_clear;
	}
	const spec *sp = is_reply ? &kvs__proto_ops[msg->op].rp : &kvs__proto_ops[msg->op].rq;
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
	const spec *sp = msg->is_reply ? &kvs__proto_ops[msg->op].rp : &kvs__proto_ops[msg->op].rq;
	for (uint8_t i = 0; i < sp->n; i++)
		if (strcmp(sp->f[i].name, name) == 0)
			return (msg->present_ >> i) & 1;
	return false;
}

int kvs_kvevents_replay_request(const uint8_t *const *frames, const size_t *lens, uint32_t n, uint64_t *start)
{
	/* (a DEALER sends exactly (b"", start); older clients may omit the
	 * delimiter: the last frame is the start) */
	if (n < 1 || n > 2 || lens[n - 1] != 8 || (n == 2 && lens[0] != 0))
		return KVS_E_BADMSG;
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v = v << 8 | frames[n - 1][i];
	*start = v;
	return 0;
}
