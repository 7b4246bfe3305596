/* Protocol v1 encoder: packs a kvs_msg by walking its op's field table
 * (optional fields at their default are left out), and packs KV event batches
 * in vLLM's wire format. */
#include <errno.h>
#include <msgpack.h>
#include <stdint.h>
#include <string.h>

#include "kvs_error.h"
#include "kvs_proto_impl.h"

static int pack_str(msgpack_packer *pk, const char *s, size_t n)
{
	return msgpack_pack_str(pk, n) | msgpack_pack_str_body(pk, s, n);
}

static int pack_bin(msgpack_packer *pk, const void *b, size_t n)
{
	return msgpack_pack_bin(pk, n) | msgpack_pack_bin_body(pk, b, n);
}

static int encode_map(msgpack_packer *pk, const spec *sp, const char *base);

/* A packed block list (protocol.md §10.1): n 4-byte little-endian signed
 * ids in one bin. False, with nothing written, if an id does not fit. */
static bool pack_ids(msgpack_packer *pk, const int64_t *ids, uint32_t n, int *r)
{
	for (uint32_t i = 0; i < n; i++)
		if (ids[i] < INT32_MIN || ids[i] > INT32_MAX)
			return false;
	*r |= msgpack_pack_bin(pk, (size_t)n * 4);
	uint8_t buf[4096];
	for (uint32_t i = 0; i < n;) {
		uint32_t k = 0;
		for (; i < n && k < sizeof(buf); i++, k += 4) {
			uint32_t v = (uint32_t)(int32_t)ids[i];
			buf[k] = (uint8_t)v;
			buf[k + 1] = (uint8_t)(v >> 8);
			buf[k + 2] = (uint8_t)(v >> 16);
			buf[k + 3] = (uint8_t)(v >> 24);
		}
		*r |= msgpack_pack_bin_body(pk, buf, k);
	}
	return true;
}

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
			if (bl->packed && pack_ids(pk, bl->ids[g], bl->len[g], &r))
				continue;
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
			uint8_t n_names = 0;
			while (names[n_names])
				n_names++;
			const char *s = v < n_names ? names[v] : names[0];
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
	case F_STR: return ((const kvs_str *)(const void *)src)->len == 0;
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
	const spec *sp = msg->is_reply ? &kvs__proto_ops[msg->op].rp : &kvs__proto_ops[msg->op].rq;
	const char *opname = anon_err ? "unknown" : kvs__proto_ops[msg->op].name;
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
