/* Unit tests for the protocol v1 codec (common/kvs_proto_*.c).
 *
 * Three parts:
 *  - round trips: every request and every reply shape is encoded from a
 *    filled kvs_msg, decoded again and compared field by field;
 *  - rejection: malformed inputs built by hand (msgpack-c packer, raw bytes,
 *    or a valid encoding rewritten by mutate()) must fail with the exact
 *    project error code, and err.op / err.id must name the message when its
 *    envelope was readable;
 *  - encoder details: optional fields at their default are left out,
 *    kvs_msg_has() reports presence, over-limit content is refused. */
#include <check.h>
#include <errno.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_main.h"
#include "kvs_error.h"
#include "kvs_proto.h"

/* ---- helpers ----------------------------------------------------------- */

typedef struct buf {
	uint8_t *p;
	size_t n;
} buf;

static void buf_free(buf *b)
{
	free(b->p);
	b->p = NULL;
	b->n = 0;
}

static buf enc(const kvs_msg *m)
{
	buf b = {0};
	void *p = NULL;
	int r = kvs_proto_encode(m, &p, &b.n);
	ck_assert_msg(r == 0, "encode of %s (reply %d) failed: %d", kvs_op_name(m->op), m->is_reply, r);
	ck_assert_ptr_nonnull(p);
	b.p = p;
	return b;
}

typedef struct pk {
	msgpack_sbuffer sb;
	msgpack_packer pk;
} pk_t;

static void pk_init(pk_t *w)
{
	msgpack_sbuffer_init(&w->sb);
	msgpack_packer_init(&w->pk, &w->sb, msgpack_sbuffer_write);
}

static buf pk_take(pk_t *w)
{
	buf b = {(uint8_t *)w->sb.data, w->sb.size};
	w->sb.data = NULL;
	w->sb.size = w->sb.alloc = 0;
	return b;
}

static void ps(pk_t *w, const char *s) { msgpack_pack_str_with_body(&w->pk, s, strlen(s)); }
static void pu(pk_t *w, uint64_t u) { msgpack_pack_uint64(&w->pk, u); }
static void praw(pk_t *w, const void *p, size_t n) { msgpack_sbuffer_write(&w->sb, p, n); }

/* Starts a map of 3 + extra entries holding v:1, op, id. */
static void pk_env(pk_t *w, uint32_t extra, const char *op, uint64_t id)
{
	msgpack_pack_map(&w->pk, 3 + extra);
	ps(w, "v");
	pu(w, 1);
	ps(w, "op");
	ps(w, op);
	ps(w, "id");
	pu(w, id);
}

/* Values written by mutate() and the hand-built messages. */
enum vt { V_U, V_I, V_STR, V_STRN, V_BIN, V_NIL, V_TRUE, V_FALSE, V_FLOAT, V_MAP0, V_ARR0,
	  V_ARR_U, V_NEST };
typedef struct val {
	enum vt t;
	uint64_t u;
	int64_t i;
	const char *s;
	uint32_t n;
} val;
/* T*: brace initialisers (for static tables); V*: the same as values. */
#define TU(x) {.t = V_U, .u = (x)}
#define TI(x) {.t = V_I, .i = (x)}
#define TS(x) {.t = V_STR, .s = (x)}
#define TSN(len) {.t = V_STRN, .n = (len)}   /* string of len 'x' */
#define TB(len) {.t = V_BIN, .n = (len)}     /* binary of len bytes */
#define TNIL {.t = V_NIL}
#define TTRUE {.t = V_TRUE}
#define TFALSE {.t = V_FALSE}
#define TFLOAT {.t = V_FLOAT}                /* 1.0 */
#define TMAP0 {.t = V_MAP0}
#define TARR0 {.t = V_ARR0}
#define TARRU(cnt, x) {.t = V_ARR_U, .n = (cnt), .u = (x)}
#define TNEST(d) {.t = V_NEST, .n = (d)}     /* d nested arrays around nil */
#define VU(x) ((val)TU(x))
#define VI(x) ((val)TI(x))
#define VS(x) ((val)TS(x))
#define VSN(len) ((val)TSN(len))
#define VB(len) ((val)TB(len))
#define VNIL ((val)TNIL)
#define VTRUE ((val)TTRUE)
#define VFALSE ((val)TFALSE)
#define VFLOAT ((val)TFLOAT)
#define VMAP0 ((val)TMAP0)
#define VARR0 ((val)TARR0)
#define VARRU(cnt, x) ((val)TARRU(cnt, x))
#define VNEST(d) ((val)TNEST(d))

static void pack_val(msgpack_packer *pk, val v)
{
	switch (v.t) {
	case V_U: msgpack_pack_uint64(pk, v.u); break;
	case V_I: msgpack_pack_int64(pk, v.i); break;
	case V_STR: msgpack_pack_str_with_body(pk, v.s, strlen(v.s)); break;
	case V_STRN: {
		char *s = malloc(v.n + 1);
		ck_assert_ptr_nonnull(s);
		memset(s, 'x', v.n);
		msgpack_pack_str_with_body(pk, s, v.n);
		free(s);
		break;
	}
	case V_BIN: {
		uint8_t *s = malloc(v.n + 1);
		ck_assert_ptr_nonnull(s);
		memset(s, 0xab, v.n);
		msgpack_pack_bin_with_body(pk, s, v.n);
		free(s);
		break;
	}
	case V_NIL: msgpack_pack_nil(pk); break;
	case V_TRUE: msgpack_pack_true(pk); break;
	case V_FALSE: msgpack_pack_false(pk); break;
	case V_FLOAT: msgpack_pack_double(pk, 1.0); break;
	case V_MAP0: msgpack_pack_map(pk, 0); break;
	case V_ARR0: msgpack_pack_array(pk, 0); break;
	case V_ARR_U:
		msgpack_pack_array(pk, v.n);
		for (uint32_t i = 0; i < v.n; i++)
			msgpack_pack_uint64(pk, v.u);
		break;
	case V_NEST:
		for (uint32_t i = 0; i < v.n; i++)
			msgpack_pack_array(pk, 1);
		msgpack_pack_nil(pk);
		break;
	}
}

/* mutate(): re-packs a valid encoding with one change at a dotted path
 * ("groups.0.kind"; numbers index arrays). M_SET replaces a value, M_DROP
 * removes a key, M_ADD appends key = value to the map at the path's parent
 * (making a duplicate if the key exists), M_ADD_UKEY / M_ADD_BINKEY append an
 * entry whose key is an integer / a binary instead of a string. */
enum mode { M_SET, M_DROP, M_ADD, M_ADD_UKEY, M_ADD_BINKEY };
static int mut_hits;

static void pack_mut(msgpack_packer *pk, const msgpack_object *o, const char *path, enum mode md,
		     val v)
{
	const char *dot = strchr(path, '.');
	size_t sl = dot ? (size_t)(dot - path) : strlen(path);
	bool last = dot == NULL;
	if (o->type == MSGPACK_OBJECT_MAP) {
		const msgpack_object_map *mp = &o->via.map;
		uint32_t n = mp->size;
		for (uint32_t i = 0; i < mp->size; i++) {
			const msgpack_object *k = &mp->ptr[i].key;
			if (last && md == M_DROP && k->type == MSGPACK_OBJECT_STR &&
			    k->via.str.size == sl && memcmp(k->via.str.ptr, path, sl) == 0)
				n--;
		}
		if (last && md >= M_ADD)
			n++;
		msgpack_pack_map(pk, n);
		for (uint32_t i = 0; i < mp->size; i++) {
			const msgpack_object_kv *kv = &mp->ptr[i];
			bool match = kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == sl &&
				     memcmp(kv->key.via.str.ptr, path, sl) == 0;
			if (match && last && md == M_DROP) {
				mut_hits++;
				continue;
			}
			msgpack_pack_object(pk, kv->key);
			if (match && last && md == M_SET) {
				mut_hits++;
				pack_val(pk, v);
			} else if (match && !last) {
				pack_mut(pk, &kv->val, dot + 1, md, v);
			} else {
				msgpack_pack_object(pk, kv->val);
			}
		}
		if (last && md >= M_ADD) {
			mut_hits++;
			if (md == M_ADD)
				msgpack_pack_str_with_body(pk, path, sl);
			else if (md == M_ADD_UKEY)
				msgpack_pack_uint64(pk, 7);
			else
				msgpack_pack_bin_with_body(pk, path, sl);
			pack_val(pk, v);
		}
	} else if (o->type == MSGPACK_OBJECT_ARRAY) {
		char *end;
		unsigned long idx = strtoul(path, &end, 10);
		ck_assert_msg(end == path + sl, "bad array index in path '%s'", path);
		msgpack_pack_array(pk, o->via.array.size);
		for (uint32_t i = 0; i < o->via.array.size; i++) {
			const msgpack_object *el = &o->via.array.ptr[i];
			if (i != idx) {
				msgpack_pack_object(pk, *el);
			} else if (last) {
				ck_assert_msg(md == M_SET, "only M_SET applies to array elements");
				mut_hits++;
				pack_val(pk, v);
			} else {
				pack_mut(pk, el, dot + 1, md, v);
			}
		}
	} else {
		ck_abort_msg("mutation path '%s' runs into a scalar", path);
	}
}

static buf mutate(buf in, const char *path, enum mode md, val v)
{
	msgpack_unpacked u;
	msgpack_unpacked_init(&u);
	size_t off = 0;
	ck_assert_int_eq(msgpack_unpack_next(&u, (const char *)in.p, in.n, &off), MSGPACK_UNPACK_SUCCESS);
	pk_t w;
	pk_init(&w);
	mut_hits = 0;
	pack_mut(&w.pk, &u.data, path, md, v);
	ck_assert_msg(mut_hits == 1, "mutation path '%s' matched %d times", path, mut_hits);
	msgpack_unpacked_destroy(&u);
	return pk_take(&w);
}

/* Decodes b and checks the result; on failure also that err carries the
 * same code and a message and that msg holds nothing to free. */
static int expect_(int line, const char *what, buf b, bool rep, int want, kvs_proto_err *eo)
{
	kvs_msg m;
	kvs_proto_err e;
	memset(&m, 0xa5, sizeof(m));
	memset(&e, 0xa5, sizeof(e));
	int r = kvs_proto_decode(b.p, b.n, rep, &m, &e);
	ck_assert_msg(r == want, "line %d (%s): decode returned %s (%d) [%s], want %s", line, what,
		      r ? kvs_error_name(r) : "ok", r, r ? e.msg : "", want ? kvs_error_name(want) : "ok");
	if (r) {
		ck_assert_int_eq(e.code, r);
		ck_assert_msg(e.msg[0] != '\0', "line %d: empty error message", line);
		ck_assert_msg(memchr(e.msg, 0, sizeof(e.msg)) != NULL, "unterminated err.msg");
		ck_assert_ptr_null(m.zone_);
	} else {
		ck_assert_int_eq(e.code, 0);
		kvs_msg_clear(&m);
	}
	if (eo)
		*eo = e;
	return r;
}
#define EXPECT(b, rep, want) expect_(__LINE__, #b, b, rep, want, NULL)
#define EXPECT_E(b, rep, want, e) expect_(__LINE__, #b, b, rep, want, e)

static buf raw(const void *p, size_t n)
{
	buf b = {malloc(n ? n : 1), n};
	ck_assert_ptr_nonnull(b.p);
	if (n)
		memcpy(b.p, p, n);
	return b;
}

/* Navigates an encoding to a dotted path: the msgpack type of what is
 * there (*size: its array/map/bin/str size, if asked), or -1 if absent. */
static int wire_type(buf b, const char *path, uint32_t *size)
{
	msgpack_unpacked u;
	msgpack_unpacked_init(&u);
	size_t off = 0;
	ck_assert_int_eq(msgpack_unpack_next(&u, (const char *)b.p, b.n, &off), MSGPACK_UNPACK_SUCCESS);
	const msgpack_object *o = &u.data;
	bool found = true;
	while (found && *path) {
		const char *dot = strchr(path, '.');
		size_t sl = dot ? (size_t)(dot - path) : strlen(path);
		found = false;
		if (o->type == MSGPACK_OBJECT_MAP) {
			for (uint32_t i = 0; i < o->via.map.size; i++) {
				const msgpack_object_kv *kv = &o->via.map.ptr[i];
				if (kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == sl &&
				    memcmp(kv->key.via.str.ptr, path, sl) == 0) {
					o = &kv->val;
					found = true;
					break;
				}
			}
		} else if (o->type == MSGPACK_OBJECT_ARRAY) {
			unsigned long idx = strtoul(path, NULL, 10);
			if (idx < o->via.array.size) {
				o = &o->via.array.ptr[idx];
				found = true;
			}
		}
		path = dot ? dot + 1 : path + sl;
	}
	int t = found ? (int)o->type : -1;
	if (found && size)
		*size = o->type == MSGPACK_OBJECT_BIN	? o->via.bin.size
			: o->type == MSGPACK_OBJECT_STR ? o->via.str.size
			: o->type == MSGPACK_OBJECT_MAP ? o->via.map.size
							: o->via.array.size;
	msgpack_unpacked_destroy(&u);
	return t;
}

static bool wire_has(buf b, const char *path) { return wire_type(b, path, NULL) >= 0; }

/* Number of entries of the top-level map of an encoding. */
static uint32_t wire_map_size(buf b)
{
	msgpack_unpacked u;
	msgpack_unpacked_init(&u);
	size_t off = 0;
	ck_assert_int_eq(msgpack_unpack_next(&u, (const char *)b.p, b.n, &off), MSGPACK_UNPACK_SUCCESS);
	ck_assert_int_eq(u.data.type, MSGPACK_OBJECT_MAP);
	uint32_t n = u.data.via.map.size;
	msgpack_unpacked_destroy(&u);
	return n;
}

/* ---- fixtures ---------------------------------------------------------- */

#define S(lit) {lit, sizeof(lit) - 1}

static uint8_t KEYS[4][KVS_KEY_BYTES];
static uint8_t EVENT[64];
static uint8_t EPOCH[KVS_EPOCH_BYTES];

static const kvs_alloc_desc ALLOCS[2] = {
	{.token = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
	 .alloc_id = {0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xab, 0xac,
		      0xad, 0xae, 0xaf},
	 .size = 1ull << 34},
	{.token = {0xff, 0, 0xff, 0, 0xff, 0, 0xff, 0, 0xff, 0, 0xff, 0, 0xff, 0, 0xff, 0},
	 .alloc_id = {16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1},
	 .size = UINT64_MAX, .follows = true},
};
static const kvs_group_desc GROUPS[2] = {
	{.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = 4,
	 .window_chunks = -1, .null_block = 0},
	{.id = 7, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 16, .blocks_per_chunk = 1,
	 .window_chunks = 4, .null_block = -1},
};
static const kvs_layer_desc LAYERS[3] = {
	{.group = 0, .alloc = 0, .offset = 0, .num_blocks = 1024, .block_stride = 65536,
	 .block_bytes = 65536},
	{.group = 0, .alloc = 1, .offset = 4096, .num_blocks = 1024, .block_stride = 131072,
	 .block_bytes = 65536},
	{.group = 7, .alloc = 1, .offset = UINT64_MAX, .num_blocks = 1, .block_stride = 0,
	 .block_bytes = UINT64_MAX},
};
static const int64_t BLK0[8] = {0, 1, 2, 3, -1, 1000000, INT64_MAX, 7};
static const int64_t BLK1[2] = {5, INT64_MIN};
static const int64_t BLKP0[8] = {0, 1, -1, INT32_MAX, INT32_MIN, 7, 8, 9};
static const int64_t BLKP1[2] = {5, -2};
static const uint64_t JOBS[3] = {1, 2, UINT64_MAX};
static const uint8_t TIERS[3] = {KVS_TIER_L1, KVS_TIER_L2, KVS_TIER_L1};
static const kvs_job_info JINFOS[4] = {
	{.job = 10, .state = KVS_JOB_OPEN, .reason = S(""), .ranks_done = 0},
	{.job = 11, .state = KVS_JOB_COMMITTED, .reason = S("ok"), .ranks_done = 8},
	{.job = UINT64_MAX, .state = KVS_JOB_ABORTED, .reason = S("rank 3 failed: E_DEVICE"),
	 .ranks_done = UINT32_MAX},
	{.job = 12, .state = KVS_JOB_UNKNOWN, .reason = S("no such job"), .ranks_done = 1},
};
static const kvs_counter COUNTERS[3] = {
	{.name = S("sessions"), .value = 3},
	{.name = S("l1_bytes"), .value = UINT64_MAX},
	{.name = S("errors.E_MISS"), .value = 0},
};

static void fixtures(void)
{
	for (int k = 0; k < 4; k++)
		for (int j = 0; j < KVS_KEY_BYTES; j++)
			KEYS[k][j] = (uint8_t)(k * 37 + j * 11 + 1);
	for (int j = 0; j < 64; j++)
		EVENT[j] = (uint8_t)(255 - j);
	for (int j = 0; j < KVS_EPOCH_BYTES; j++)
		EPOCH[j] = (uint8_t)(0x5a ^ j);
}

typedef kvs_msg (*builder)(void);

/* requests */
static kvs_msg q_hello(void)
{
	return (kvs_msg){.op = KVS_OP_HELLO, .id = 1, .engine = S("vllm-0.9.1"), .role = KVS_ROLE_WORKER,
			 .rank = 3, .world = 8, .ns = S("meta-llama/Llama-3-70B:salt42")};
}
static kvs_msg q_hello_sched(void)
{
	return (kvs_msg){.op = KVS_OP_HELLO, .id = 2, .engine = S(""), .role = KVS_ROLE_SCHEDULER,
			 .rank = 65535, .world = 65536, .ns = S("n")};
}
static kvs_msg q_heartbeat(void)
{
	return (kvs_msg){.op = KVS_OP_HEARTBEAT, .id = 3, .session = 0xdeadbeefcafef00dull};
}
static kvs_msg q_bye(void) { return (kvs_msg){.op = KVS_OP_BYE, .id = UINT64_MAX, .session = 77}; }
static kvs_msg q_register(void)
{
	fixtures();
	return (kvs_msg){.op = KVS_OP_REGISTER, .id = 4, .session = 5,
			 .device = {.type = KVS_DEV_CUDA,
				    .uuid = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6}},
			 .allocs = ALLOCS, .n_allocs = 2, .groups = GROUPS, .n_groups = 2,
			 .layers = LAYERS, .n_layers = 3};
}
static kvs_msg q_register_host(void)
{
	return (kvs_msg){.op = KVS_OP_REGISTER, .id = 5, .session = 6, .device = {.type = KVS_DEV_HOST},
			 .allocs = ALLOCS + 1, .n_allocs = 1, .groups = GROUPS, .n_groups = 1,
			 .layers = LAYERS, .n_layers = 1};
}
static kvs_msg q_unregister(void)
{
	return (kvs_msg){.op = KVS_OP_UNREGISTER, .id = 6, .session = 5, .registration = 1ull << 40};
}
static kvs_msg q_lookup(void)
{
	fixtures();
	return (kvs_msg){.op = KVS_OP_LOOKUP, .id = 7, .session = 5, .keys = KEYS[0], .n_keys = 3,
			 .prefetch = true, .pin_ms = 600000};
}
static kvs_msg q_lookup_min(void)
{
	fixtures();
	return (kvs_msg){.op = KVS_OP_LOOKUP, .id = 8, .session = 5, .keys = KEYS[1], .n_keys = 1};
}
static kvs_msg q_store(void)
{
	fixtures();
	kvs_msg m = {.op = KVS_OP_STORE, .id = 9, .session = 5, .job = 99, .keys = KEYS[0],
		     .n_keys = 2, .producer_event = {EVENT, 64}, .lazy = true, .event_hashes = KEYS[1],
		     .n_event_hashes = 2, .complete = true};
	m.blocks.n = 2;
	m.blocks.ids[0] = BLK0;
	m.blocks.len[0] = 8;
	m.blocks.ids[1] = BLK1;
	m.blocks.len[1] = 2;
	return m;
}
static kvs_msg q_store_packed(void)
{
	/* block lists packed (protocol.md §10.1): 4-byte ids, signs kept */
	kvs_msg m = q_store();
	m.id = 19;
	m.blocks.ids[0] = BLKP0;
	m.blocks.ids[1] = BLKP1;
	m.blocks.packed = true;
	return m;
}
static kvs_msg q_store_min(void)
{
	/* no keys, no block lists: a legal shape for the codec */
	return (kvs_msg){.op = KVS_OP_STORE, .id = 10, .session = 5, .job = 100};
}
static kvs_msg q_retrieve(void)
{
	fixtures();
	kvs_msg m = {.op = KVS_OP_RETRIEVE, .id = 11, .session = 5, .job = 101, .keys = KEYS[2],
		     .n_keys = 2, .skip_tokens = 48};
	m.blocks.n = 2;
	m.blocks.ids[0] = BLK0;
	m.blocks.len[0] = 8;
	m.blocks.ids[1] = BLK1;
	m.blocks.len[1] = 0;
	return m;
}
static kvs_msg q_complete(void)
{
	return (kvs_msg){.op = KVS_OP_COMPLETE, .id = 12, .session = 5, .job = 99,
			 .status = KVS_STATUS_FAILED};
}
static kvs_msg q_complete_ok(void)
{
	return (kvs_msg){.op = KVS_OP_COMPLETE, .id = 13, .session = 5, .job = 0,
			 .status = KVS_STATUS_OK};
}
static kvs_msg q_job_status(void)
{
	return (kvs_msg){.op = KVS_OP_JOB_STATUS, .id = 14, .session = 5, .jobs = JOBS, .n_jobs = 3};
}
static kvs_msg q_job_status_all(void)
{
	return (kvs_msg){.op = KVS_OP_JOB_STATUS, .id = 15, .session = 5};
}
static kvs_msg q_stats(void) { return (kvs_msg){.op = KVS_OP_STATS, .id = 16}; }
static kvs_msg q_stats_session(void)
{
	return (kvs_msg){.op = KVS_OP_STATS, .id = 17, .session = 1234567890123ull};
}

/* replies */
#define RP(o, i, ...)                                                                            \
	fixtures();                                                                              \
	kvs_msg m = {.op = (o), .id = (i), .is_reply = true, .ok = true, __VA_ARGS__};          \
	memcpy(m.epoch, EPOCH, sizeof(m.epoch));                                                 \
	return m
static kvs_msg r_hello(void)
{
	RP(KVS_OP_HELLO, 1, .session = 42, .heartbeat_ms = 1000, .ttl_ms = 30000,
	   .limits = {.max_msg_bytes = KVS_MAX_MSG_BYTES, .max_keys = KVS_MAX_KEYS,
		      .max_block_ids = KVS_MAX_BLOCK_IDS},
	   .packed_blocks = true);
}
static kvs_msg r_heartbeat(void) { RP(KVS_OP_HEARTBEAT, 3, .pending_jobs = 12); }
static kvs_msg r_bye(void) { RP(KVS_OP_BYE, UINT64_MAX, .code = 0); }
static kvs_msg r_register(void)
{
	RP(KVS_OP_REGISTER, 4, .registration = 1ull << 40, .imported = 2, .aliased = 1);
}
static kvs_msg r_unregister(void) { RP(KVS_OP_UNREGISTER, 6, .code = 0); }
static kvs_msg r_lookup(void) { RP(KVS_OP_LOOKUP, 7, .hits = 3, .tiers = TIERS, .n_tiers = 3); }
static kvs_msg r_lookup_miss(void) { RP(KVS_OP_LOOKUP, 8, .hits = 0); }
static kvs_msg r_store(void) { RP(KVS_OP_STORE, 9, .job = 99, .state = KVS_JOB_OPEN); }
/* a store that carried its complete, answered at the job's end */
static kvs_msg r_store_end(void)
{
	RP(KVS_OP_STORE, 19, .job = 99, .state = KVS_JOB_ABORTED, .reason = S("rank 1 reported failure"));
}
static kvs_msg r_retrieve(void) { RP(KVS_OP_RETRIEVE, 11, .job = 101, .state = KVS_JOB_COMMITTED); }
static kvs_msg r_complete(void) { RP(KVS_OP_COMPLETE, 12, .job = 99, .state = KVS_JOB_ABORTED); }
static kvs_msg r_job_status(void)
{
	RP(KVS_OP_JOB_STATUS, 14, .job_infos = JINFOS, .n_job_infos = 4);
}
static kvs_msg r_job_status_empty(void) { RP(KVS_OP_JOB_STATUS, 15, .code = 0); }
static kvs_msg r_stats(void) { RP(KVS_OP_STATS, 16, .counters = COUNTERS, .n_counters = 3); }
static kvs_msg r_stats_empty(void) { RP(KVS_OP_STATS, 17, .code = 0); }
static kvs_msg r_job_done(void)
{
	RP(KVS_OP_JOB_DONE, 0, .job = 99, .state = KVS_JOB_COMMITTED, .reason = S("all 8 ranks done"));
}
static kvs_msg r_job_done_unknown(void)
{
	RP(KVS_OP_JOB_DONE, 0, .job = UINT64_MAX, .state = KVS_JOB_UNKNOWN, .reason = S(""));
}
static kvs_msg r_error(void)
{
	fixtures();
	kvs_msg m = {.op = KVS_OP_STORE, .id = 9, .is_reply = true, .ok = false,
		     .code = KVS_E_GEOMETRY, .errmsg = S("blocks[1]: expected 2 ids, got 3")};
	memcpy(m.epoch, EPOCH, sizeof(m.epoch));
	return m;
}

static const struct {
	const char *name;
	builder fn;
} ALL[] = {
#define B(f) {#f, f}
	B(q_hello), B(q_hello_sched), B(q_heartbeat), B(q_bye), B(q_register), B(q_register_host),
	B(q_unregister), B(q_lookup), B(q_lookup_min), B(q_store), B(q_store_packed), B(q_store_min), B(q_retrieve),
	B(q_complete), B(q_complete_ok), B(q_job_status), B(q_job_status_all), B(q_stats),
	B(q_stats_session),
	B(r_hello), B(r_heartbeat), B(r_bye), B(r_register), B(r_unregister), B(r_lookup),
	B(r_lookup_miss), B(r_store), B(r_retrieve), B(r_complete), B(r_job_status),
	B(r_job_status_empty), B(r_stats), B(r_stats_empty), B(r_job_done), B(r_job_done_unknown), B(r_store_end),
	B(r_error),
#undef B
};
#define N_ALL ((int)(sizeof(ALL) / sizeof(ALL[0])))

/* ---- field-by-field comparison ----------------------------------------- */

static void str_eq(const char *what, kvs_str a, kvs_str b)
{
	ck_assert_msg(a.len == b.len, "%s: length %u != %u", what, a.len, b.len);
	if (a.len)
		ck_assert_msg(memcmp(a.ptr, b.ptr, a.len) == 0, "%s: '%.*s' != '%.*s'", what,
			      (int)a.len, a.ptr, (int)b.len, b.ptr);
}

#define EQ(f) ck_assert_msg(a->f == b->f, "field " #f ": %llu != %llu", \
			    (unsigned long long)(a->f), (unsigned long long)(b->f))

/* a: what was encoded; b: what was decoded. */
static void assert_msg_eq(const kvs_msg *a, const kvs_msg *b)
{
	ck_assert_uint_eq(b->v, KVS_PROTO_VERSION);
	EQ(op);
	EQ(id);
	EQ(is_reply);
	EQ(ok);
	EQ(code);
	str_eq("msg", a->errmsg, b->errmsg);
	ck_assert_mem_eq(a->epoch, b->epoch, KVS_EPOCH_BYTES);

	str_eq("engine", a->engine, b->engine);
	EQ(role);
	EQ(rank);
	EQ(world);
	str_eq("namespace", a->ns, b->ns);
	EQ(session);
	EQ(registration);
	EQ(job);
	EQ(device.type);
	ck_assert_mem_eq(a->device.uuid, b->device.uuid, 16);

	EQ(n_allocs);
	for (uint32_t i = 0; i < a->n_allocs; i++) {
		ck_assert_mem_eq(a->allocs[i].token, b->allocs[i].token, KVS_TOKEN_BYTES);
		ck_assert_mem_eq(a->allocs[i].alloc_id, b->allocs[i].alloc_id, 16);
		EQ(allocs[i].size);
		EQ(allocs[i].follows);
	}
	EQ(n_groups);
	for (uint32_t i = 0; i < a->n_groups; i++) {
		EQ(groups[i].id);
		EQ(groups[i].kind);
		EQ(groups[i].tokens_per_block);
		EQ(groups[i].blocks_per_chunk);
		EQ(groups[i].window_chunks);
		EQ(groups[i].null_block);
	}
	EQ(n_layers);
	for (uint32_t i = 0; i < a->n_layers; i++) {
		EQ(layers[i].group);
		EQ(layers[i].alloc);
		EQ(layers[i].offset);
		EQ(layers[i].num_blocks);
		EQ(layers[i].block_stride);
		EQ(layers[i].block_bytes);
	}
	EQ(n_keys);
	EQ(n_event_hashes);
	if (a->n_event_hashes)
		ck_assert_mem_eq(a->event_hashes, b->event_hashes, (size_t)a->n_event_hashes * KVS_KEY_BYTES);
	if (a->n_keys)
		ck_assert_mem_eq(a->keys, b->keys, (size_t)a->n_keys * KVS_KEY_BYTES);
	EQ(blocks.n);
	EQ(blocks.packed);
	EQ(packed_blocks);
	for (uint32_t g = 0; g < a->blocks.n; g++) {
		EQ(blocks.len[g]);
		for (uint32_t i = 0; i < a->blocks.len[g]; i++)
			EQ(blocks.ids[g][i]);
	}
	EQ(prefetch);
	EQ(pin_ms);
	EQ(lazy);
	EQ(complete);
	EQ(skip_tokens);
	EQ(status);
	EQ(producer_event.len);
	if (a->producer_event.len)
		ck_assert_mem_eq(a->producer_event.ptr, b->producer_event.ptr, a->producer_event.len);
	EQ(n_jobs);
	for (uint32_t i = 0; i < a->n_jobs; i++)
		EQ(jobs[i]);

	EQ(heartbeat_ms);
	EQ(ttl_ms);
	EQ(limits.max_msg_bytes);
	EQ(limits.max_keys);
	EQ(limits.max_block_ids);
	EQ(pending_jobs);
	EQ(imported);
	EQ(aliased);
	EQ(hits);
	EQ(n_tiers);
	for (uint32_t i = 0; i < a->n_tiers; i++)
		EQ(tiers[i]);
	EQ(state);
	str_eq("reason", a->reason, b->reason);
	EQ(n_job_infos);
	for (uint32_t i = 0; i < a->n_job_infos; i++) {
		EQ(job_infos[i].job);
		EQ(job_infos[i].state);
		str_eq("job_infos.reason", a->job_infos[i].reason, b->job_infos[i].reason);
		EQ(job_infos[i].ranks_done);
	}
	EQ(n_counters);
	for (uint32_t i = 0; i < a->n_counters; i++) {
		str_eq("counter name", a->counters[i].name, b->counters[i].name);
		EQ(counters[i].value);
	}
}

/* ---- round trips ------------------------------------------------------- */

START_TEST(test_roundtrip)
{
	kvs_msg a = ALL[_i].fn();
	buf b = enc(&a);
	kvs_msg d;
	kvs_proto_err e;
	int r = kvs_proto_decode(b.p, b.n, a.is_reply, &d, &e);
	ck_assert_msg(r == 0, "%s: decode failed: %s %s", ALL[_i].name, kvs_error_name(r), e.msg);
	assert_msg_eq(&a, &d);
	/* the encoding is canonical: decoding and re-encoding gives the same bytes */
	buf b2 = enc(&d);
	ck_assert_uint_eq(b2.n, b.n);
	ck_assert_mem_eq(b2.p, b.p, b.n);
	/* clear releases and zeroes; clearing twice is harmless */
	kvs_msg_clear(&d);
	ck_assert_ptr_null(d.zone_);
	ck_assert_int_eq(d.op, KVS_OP_NONE);
	kvs_msg_clear(&d);
	/* a request is not a reply and vice versa (no ok/epoch, or no spec) */
	if (!a.is_reply)
		EXPECT(b, true, KVS_E_BADMSG);
	buf_free(&b);
	buf_free(&b2);
}
END_TEST

/* Every project error code survives an error reply, whatever the op. */
START_TEST(test_roundtrip_error_codes)
{
	fixtures();
	for (int code = KVS_E_BASE; code <= KVS_E_LAST_; code++) {
		kvs_op op = (kvs_op)(1 + (code - KVS_E_BASE) % (KVS_OP_COUNT_ - 1));
		kvs_msg a = {.op = op, .id = (uint64_t)(code - KVS_E_BASE) * 1000003u, .is_reply = true,
			     .ok = false, .code = code, .errmsg = kvs_str_c(kvs_strerror(code))};
		memcpy(a.epoch, EPOCH, sizeof(a.epoch));
		buf b = enc(&a);
		ck_assert_uint_eq(wire_map_size(b), 7); /* v op id ok epoch code msg */
		kvs_msg d;
		kvs_proto_err e;
		ck_assert_int_eq(kvs_proto_decode(b.p, b.n, true, &d, &e), 0);
		assert_msg_eq(&a, &d);
		ck_assert_str_eq(kvs_error_name(d.code), kvs_error_name(code));
		ck_assert(!kvs_msg_has(&d, "job"));
		kvs_msg_clear(&d);
		buf_free(&b);
	}
}
END_TEST

START_TEST(test_error_reply_shape)
{
	/* Op fields of an error reply are not written; an errno code is E_INTERNAL;
	 * msg is cut to KVS_MAX_ERRMSG. */
	kvs_msg a = r_store();
	a.ok = false;
	a.code = -ENOENT;
	char longmsg[KVS_MAX_ERRMSG + 100];
	memset(longmsg, 'm', sizeof(longmsg));
	a.errmsg = (kvs_str){longmsg, sizeof(longmsg)};
	buf b = enc(&a);
	ck_assert_uint_eq(wire_map_size(b), 7);
	ck_assert(!wire_has(b, "job"));
	ck_assert(!wire_has(b, "state"));
	kvs_msg d;
	kvs_proto_err e;
	ck_assert_int_eq(kvs_proto_decode(b.p, b.n, true, &d, &e), 0);
	ck_assert(!d.ok);
	ck_assert_int_eq(d.code, KVS_E_INTERNAL);
	ck_assert_uint_eq(d.errmsg.len, KVS_MAX_ERRMSG);
	ck_assert_uint_eq(d.job, 0);
	kvs_msg_clear(&d);
	buf_free(&b);

	/* NULL msg encodes as "" */
	a.code = KVS_E_MISS;
	a.errmsg = (kvs_str){NULL, 0};
	b = enc(&a);
	ck_assert_int_eq(kvs_proto_decode(b.p, b.n, true, &d, &e), 0);
	ck_assert_int_eq(d.code, KVS_E_MISS);
	ck_assert_uint_eq(d.errmsg.len, 0);
	kvs_msg_clear(&d);

	/* unknown code name decodes as E_INTERNAL; a missing msg is allowed;
	 * op fields are not required in an error reply */
	buf c = mutate(b, "code", M_SET, VS("E_FROM_THE_FUTURE"));
	ck_assert_int_eq(kvs_proto_decode(c.p, c.n, true, &d, &e), 0);
	ck_assert_int_eq(d.code, KVS_E_INTERNAL);
	kvs_msg_clear(&d);
	buf_free(&c);
	c = mutate(b, "msg", M_DROP, VNIL);
	ck_assert_int_eq(kvs_proto_decode(c.p, c.n, true, &d, &e), 0);
	ck_assert_int_eq(d.code, KVS_E_MISS);
	ck_assert_uint_eq(d.errmsg.len, 0);
	kvs_msg_clear(&d);
	buf_free(&c);
	buf_free(&b);
}
END_TEST

/* ---- presence and defaults --------------------------------------------- */

static kvs_msg decode_ok(buf b, bool rep)
{
	kvs_msg d;
	kvs_proto_err e;
	int r = kvs_proto_decode(b.p, b.n, rep, &d, &e);
	ck_assert_msg(r == 0, "decode failed: %s %s", kvs_error_name(r), e.msg);
	return d;
}

START_TEST(test_optional_omitted)
{
	kvs_msg a = q_lookup_min();
	buf b = enc(&a);
	ck_assert_uint_eq(wire_map_size(b), 5); /* v op id session keys */
	ck_assert(!wire_has(b, "prefetch"));
	ck_assert(!wire_has(b, "pin_ms"));
	kvs_msg d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "session"));
	ck_assert(kvs_msg_has(&d, "keys"));
	ck_assert(!kvs_msg_has(&d, "prefetch"));
	ck_assert(!kvs_msg_has(&d, "pin_ms"));
	ck_assert(!kvs_msg_has(&d, "engine")); /* not a lookup field */
	ck_assert(!kvs_msg_has(&d, "nonexistent"));
	ck_assert(!d.prefetch);
	ck_assert_uint_eq(d.pin_ms, 0);
	kvs_msg_clear(&d);
	ck_assert(!kvs_msg_has(&d, "session")); /* cleared: nothing */
	buf_free(&b);

	a = q_lookup();
	b = enc(&a);
	ck_assert_uint_eq(wire_map_size(b), 7);
	d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "prefetch"));
	ck_assert(kvs_msg_has(&d, "pin_ms"));
	kvs_msg_clear(&d);
	buf_free(&b);

	/* store: lazy false, an empty producer_event and no event_hashes are left out */
	a = q_store();
	a.lazy = false;
	a.complete = false;
	a.producer_event = (kvs_bytes){NULL, 0};
	a.n_event_hashes = 0;
	b = enc(&a);
	ck_assert_uint_eq(wire_map_size(b), 7); /* v op id session job keys blocks */
	ck_assert(!wire_has(b, "lazy"));
	ck_assert(!wire_has(b, "complete"));
	ck_assert(!wire_has(b, "producer_event"));
	ck_assert(!wire_has(b, "event_hashes"));
	d = decode_ok(b, false);
	ck_assert(!kvs_msg_has(&d, "lazy"));
	ck_assert(!kvs_msg_has(&d, "producer_event"));
	ck_assert(kvs_msg_has(&d, "blocks"));
	ck_assert_uint_eq(d.producer_event.len, 0);
	kvs_msg_clear(&d);
	buf_free(&b);
	a = q_store();
	b = enc(&a);
	d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "lazy"));
	ck_assert(kvs_msg_has(&d, "producer_event"));
	kvs_msg_clear(&d);
	buf_free(&b);

	/* retrieve: skip_tokens 0 left out */
	a = q_retrieve();
	b = enc(&a);
	ck_assert(wire_has(b, "skip_tokens"));
	d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "skip_tokens"));
	kvs_msg_clear(&d);
	buf_free(&b);
	a.skip_tokens = 0;
	b = enc(&a);
	ck_assert(!wire_has(b, "skip_tokens"));
	d = decode_ok(b, false);
	ck_assert(!kvs_msg_has(&d, "skip_tokens"));
	kvs_msg_clear(&d);
	buf_free(&b);

	/* job_status: no jobs list when empty */
	a = q_job_status_all();
	b = enc(&a);
	ck_assert_uint_eq(wire_map_size(b), 4);
	ck_assert(!wire_has(b, "jobs"));
	d = decode_ok(b, false);
	ck_assert(!kvs_msg_has(&d, "jobs"));
	ck_assert_uint_eq(d.n_jobs, 0);
	ck_assert_ptr_null(d.jobs);
	kvs_msg_clear(&d);
	buf_free(&b);
	a = q_job_status();
	b = enc(&a);
	d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "jobs"));
	kvs_msg_clear(&d);
	buf_free(&b);

	/* stats: session optional */
	a = q_stats();
	b = enc(&a);
	ck_assert_uint_eq(wire_map_size(b), 3);
	d = decode_ok(b, false);
	ck_assert(!kvs_msg_has(&d, "session"));
	kvs_msg_clear(&d);
	buf_free(&b);
	a = q_stats_session();
	b = enc(&a);
	ck_assert_uint_eq(wire_map_size(b), 4);
	d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "session"));
	kvs_msg_clear(&d);
	buf_free(&b);
}
END_TEST

START_TEST(test_required_always_written)
{
	/* required fields are written even at zero / empty */
	kvs_msg a = {.op = KVS_OP_HEARTBEAT};
	buf b = enc(&a);
	ck_assert(wire_has(b, "session"));
	kvs_msg d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "session"));
	kvs_msg_clear(&d);
	buf_free(&b);

	a = r_job_status_empty();
	b = enc(&a);
	ck_assert(wire_has(b, "jobs"));
	d = decode_ok(b, true);
	ck_assert(kvs_msg_has(&d, "jobs"));
	ck_assert_uint_eq(d.n_job_infos, 0);
	kvs_msg_clear(&d);
	buf_free(&b);

	a = r_stats_empty();
	b = enc(&a);
	ck_assert(wire_has(b, "counters"));
	d = decode_ok(b, true);
	ck_assert_uint_eq(d.n_counters, 0);
	kvs_msg_clear(&d);
	buf_free(&b);

	a = q_store_min();
	b = enc(&a);
	ck_assert(wire_has(b, "keys"));
	ck_assert(wire_has(b, "blocks"));
	buf_free(&b);
}
END_TEST

START_TEST(test_group_defaults)
{
	/* window_chunks / null_block of -1 are left out and come back as -1;
	 * 0 is written */
	kvs_msg a = q_register();
	buf b = enc(&a);
	ck_assert(!wire_has(b, "groups.0.window_chunks"));
	ck_assert(wire_has(b, "groups.0.null_block"));
	ck_assert(wire_has(b, "groups.1.window_chunks"));
	ck_assert(!wire_has(b, "groups.1.null_block"));
	kvs_msg d = decode_ok(b, false);
	ck_assert_int_eq(d.groups[0].window_chunks, -1);
	ck_assert_int_eq(d.groups[0].null_block, 0);
	ck_assert_int_eq(d.groups[1].window_chunks, 4);
	ck_assert_int_eq(d.groups[1].null_block, -1);
	kvs_msg_clear(&d);
	/* dropping both from a group on the wire gives -1 too */
	buf c = mutate(b, "groups.0.null_block", M_DROP, VNIL);
	buf c2 = mutate(c, "groups.1.window_chunks", M_DROP, VNIL);
	d = decode_ok(c2, false);
	ck_assert_int_eq(d.groups[0].null_block, -1);
	ck_assert_int_eq(d.groups[1].window_chunks, -1);
	ck_assert_int_eq(d.groups[0].window_chunks, -1);
	kvs_msg_clear(&d);
	buf_free(&c);
	buf_free(&c2);
	/* any int64 is accepted, negative included */
	c = mutate(b, "groups.1.window_chunks", M_SET, VI(INT64_MIN));
	d = decode_ok(c, false);
	ck_assert_int_eq(d.groups[1].window_chunks, INT64_MIN);
	kvs_msg_clear(&d);
	buf_free(&c);
	buf_free(&b);
}
END_TEST

START_TEST(test_explicit_defaults_present)
{
	/* presence is what was on the wire, even when the value is the default */
	pk_t w;
	pk_init(&w);
	pk_env(&w, 4, "lookup", 5);
	ps(&w, "session");
	pu(&w, 1);
	ps(&w, "keys");
	msgpack_pack_array(&w.pk, 0);
	ps(&w, "prefetch");
	msgpack_pack_false(&w.pk);
	ps(&w, "pin_ms");
	pu(&w, 0);
	buf b = pk_take(&w);
	kvs_msg d = decode_ok(b, false);
	ck_assert(kvs_msg_has(&d, "prefetch"));
	ck_assert(kvs_msg_has(&d, "pin_ms"));
	ck_assert(!d.prefetch);
	ck_assert_uint_eq(d.n_keys, 0);
	kvs_msg_clear(&d);
	buf_free(&b);
}
END_TEST

START_TEST(test_encode_refuses)
{
	void *p = (void *)0x1;
	size_t n = 0;
	kvs_msg a = {.op = KVS_OP_NONE};
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);
	a.op = KVS_OP_COUNT_;
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);

	char s[KVS_MAX_STR + 1];
	memset(s, 'e', sizeof(s));
	a = q_hello();
	a.engine = (kvs_str){s, KVS_MAX_STR};
	buf b = enc(&a);
	buf_free(&b);
	a.engine = (kvs_str){s, KVS_MAX_STR + 1};
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);
	a = q_hello();
	a.ns = (kvs_str){s, KVS_MAX_STR + 1};
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);
	a = r_job_done();
	a.reason = (kvs_str){s, KVS_MAX_STR + 1};
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);
	/* nested: a job info's reason */
	kvs_job_info ji[2] = {JINFOS[0], JINFOS[1]};
	ji[1].reason = (kvs_str){s, KVS_MAX_STR + 1};
	a = r_job_status();
	a.job_infos = ji;
	a.n_job_infos = 2;
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);
	/* a count with no array */
	a = q_lookup();
	a.keys = NULL;
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);
	a = q_job_status();
	a.jobs = NULL;
	ck_assert_int_eq(kvs_proto_encode(&a, &p, &n), -EINVAL);
	ck_assert_ptr_eq(p, (void *)0x1); /* nothing handed out on failure */
}
END_TEST

START_TEST(test_names)
{
	for (int op = 1; op < KVS_OP_COUNT_; op++) {
		const char *nm = kvs_op_name((kvs_op)op);
		ck_assert_int_eq(kvs_op_from_name(nm, strlen(nm)), op);
	}
	ck_assert_str_eq(kvs_op_name(KVS_OP_HELLO), "hello");
	ck_assert_str_eq(kvs_op_name(KVS_OP_JOB_STATUS), "job_status");
	ck_assert_str_eq(kvs_op_name(KVS_OP_JOB_DONE), "job_done");
	ck_assert_str_eq(kvs_op_name(KVS_OP_NONE), "?");
	ck_assert_str_eq(kvs_op_name(KVS_OP_COUNT_), "?");
	ck_assert_int_eq(kvs_op_from_name("hell", 4), KVS_OP_NONE);
	ck_assert_int_eq(kvs_op_from_name("hello!", 6), KVS_OP_NONE);
	ck_assert_int_eq(kvs_op_from_name("hello", 4), KVS_OP_NONE);
	ck_assert_int_eq(kvs_op_from_name("", 0), KVS_OP_NONE);
	ck_assert_str_eq(kvs_job_state_name(KVS_JOB_OPEN), "open");
	ck_assert_str_eq(kvs_job_state_name(KVS_JOB_COMMITTED), "committed");
	ck_assert_str_eq(kvs_job_state_name(KVS_JOB_ABORTED), "aborted");
	ck_assert_str_eq(kvs_job_state_name(99), "?");
	ck_assert_str_eq(kvs_job_state_name(-1), "?");
	ck_assert_str_eq(kvs_tier_name(KVS_TIER_L1), "l1");
	ck_assert_str_eq(kvs_tier_name(KVS_TIER_L2), "l2");
	ck_assert_str_eq(kvs_tier_name(KVS_TIER_L3), "l3");
	ck_assert_str_eq(kvs_tier_name(3), "?");
	for (int c = KVS_E_BASE; c <= KVS_E_LAST_; c++) {
		const char *nm = kvs_error_name(c);
		ck_assert_int_eq(kvs_error_from_name(nm, strlen(nm)), c);
	}
	ck_assert_str_eq(kvs_error_name(KVS_E_LIMIT), "E_LIMIT");
	ck_assert_str_eq(kvs_error_name(-EIO), "E_INTERNAL");

	char dst[5];
	kvs_str_copy(dst, sizeof(dst), (kvs_str){"abcdefg", 7});
	ck_assert_str_eq(dst, "abcd");
	kvs_str_copy(dst, sizeof(dst), (kvs_str){"ab", 2});
	ck_assert_str_eq(dst, "ab");
	kvs_str_copy(dst, sizeof(dst), (kvs_str){NULL, 0});
	ck_assert_str_eq(dst, "");
}
END_TEST

/* ---- structural rejection ---------------------------------------------- */

START_TEST(test_not_msgpack)
{
	static const uint8_t c1[] = {0xc1};
	buf b = raw(c1, 1);
	EXPECT(b, false, KVS_E_BADMSG);
	EXPECT(b, true, KVS_E_BADMSG);
	buf_free(&b);
	b = raw("", 0);
	EXPECT(b, false, KVS_E_BADMSG);
	buf_free(&b);
	/* 0xc1 as a value inside an otherwise valid map */
	pk_t w;
	pk_init(&w);
	pk_env(&w, 2, "heartbeat", 9);
	ps(&w, "session");
	pu(&w, 1);
	ps(&w, "x");
	praw(&w, c1, 1);
	b = pk_take(&w);
	kvs_proto_err e;
	EXPECT_E(b, false, KVS_E_BADMSG, &e);
	buf_free(&b);
	/* text */
	b = raw("{\"v\":1,\"op\":\"hello\",\"id\":1}", 27);
	EXPECT(b, false, KVS_E_BADMSG);
	buf_free(&b);
}
END_TEST

/* Every proper prefix of every example message is a truncated message. */
START_TEST(test_truncated)
{
	kvs_msg a = ALL[_i].fn();
	buf b = enc(&a);
	for (size_t n = 0; n < b.n; n++) {
		kvs_msg d;
		kvs_proto_err e;
		int r = kvs_proto_decode(b.p, n, a.is_reply, &d, &e);
		ck_assert_msg(r == KVS_E_BADMSG, "%s: prefix of %zu/%zu bytes: %s", ALL[_i].name, n,
			      b.n, r ? kvs_error_name(r) : "ok");
		ck_assert_ptr_null(d.zone_);
	}
	buf_free(&b);
}
END_TEST

START_TEST(test_trailing)
{
	kvs_msg a = ALL[_i].fn();
	buf b = enc(&a);
	buf t = {malloc(2 * b.n), b.n + 1};
	memcpy(t.p, b.p, b.n);
	t.p[b.n] = 0xc0;
	EXPECT(t, a.is_reply, KVS_E_BADMSG);
	memcpy(t.p + b.n, b.p, b.n); /* two messages in one frame */
	t.n = 2 * b.n;
	EXPECT(t, a.is_reply, KVS_E_BADMSG);
	buf_free(&t);
	buf_free(&b);
}
END_TEST

START_TEST(test_top_not_map)
{
	pk_t w;
	buf b;
	/* array holding what would be a valid envelope */
	pk_init(&w);
	msgpack_pack_array(&w.pk, 6);
	ps(&w, "v");
	pu(&w, 1);
	ps(&w, "op");
	ps(&w, "stats");
	ps(&w, "id");
	pu(&w, 1);
	b = pk_take(&w);
	EXPECT(b, false, KVS_E_BADMSG);
	EXPECT(b, true, KVS_E_BADMSG);
	buf_free(&b);
	static const val tops[] = {TU(1), TI(-5), TS("hello"), TNIL, TTRUE, TFLOAT, TB(16), TARR0};
	for (size_t i = 0; i < sizeof(tops) / sizeof(tops[0]); i++) {
		pk_init(&w);
		pack_val(&w.pk, tops[i]);
		b = pk_take(&w);
		kvs_proto_err e;
		EXPECT_E(b, false, KVS_E_BADMSG, &e);
		ck_assert_int_eq(e.op, KVS_OP_NONE);
		ck_assert_uint_eq(e.id, 0);
		EXPECT(b, true, KVS_E_BADMSG);
		buf_free(&b);
	}
	/* an ext value at the top */
	static const uint8_t ext[] = {0xd4, 0x01, 0x00};
	b = raw(ext, sizeof(ext));
	EXPECT(b, false, KVS_E_BADMSG);
	buf_free(&b);
	/* an empty map lacks everything */
	static const uint8_t m0[] = {0x80};
	b = raw(m0, 1);
	EXPECT(b, false, KVS_E_BADMSG);
	buf_free(&b);
}
END_TEST

/* Length headers far larger than the buffer must be refused before any
 * allocation is sized from them (msgpack-c would otherwise try to allocate
 * tens of GiB and report out-of-memory, i.e. E_INTERNAL). */
START_TEST(test_huge_headers)
{
	static const uint8_t hdrs[][5] = {
		{0xdd, 0xff, 0xff, 0xff, 0xff}, /* array32 */
		{0xdf, 0xff, 0xff, 0xff, 0xff}, /* map32 */
		{0xdb, 0xff, 0xff, 0xff, 0xff}, /* str32 */
		{0xc6, 0xff, 0xff, 0xff, 0xff}, /* bin32 */
		{0xc9, 0xff, 0xff, 0xff, 0xff}, /* ext32 */
		{0xdc, 0xff, 0xff, 0x00, 0x00}, /* array16 (+ filler) */
		{0xde, 0xff, 0xff, 0x00, 0x00}, /* map16 */
	};
	for (size_t i = 0; i < sizeof(hdrs) / sizeof(hdrs[0]); i++) {
		/* at the top */
		uint8_t top[64];
		memset(top, 0, sizeof(top));
		memcpy(top, hdrs[i], 5);
		buf b = raw(top, sizeof(top));
		EXPECT(b, false, KVS_E_BADMSG);
		buf_free(&b);
		/* as the value of a field in a valid envelope */
		pk_t w;
		pk_init(&w);
		pk_env(&w, 2, "lookup", 77);
		ps(&w, "session");
		pu(&w, 1);
		ps(&w, "keys");
		praw(&w, hdrs[i], 5);
		praw(&w, top, 16);
		b = pk_take(&w);
		EXPECT(b, false, KVS_E_BADMSG);
		buf_free(&b);
	}
	/* header itself cut short */
	static const uint8_t cut[] = {0x81, 0xa1, 'x', 0xdd, 0xff, 0xff};
	buf b = raw(cut, sizeof(cut));
	EXPECT(b, false, KVS_E_BADMSG);
	buf_free(&b);
}
END_TEST

static buf nested(uint32_t arrays)
{
	/* {v, op, id, session, "x": [[[...nil...]]]}: the root map is level 1 */
	pk_t w;
	pk_init(&w);
	pk_env(&w, 2, "heartbeat", 1);
	ps(&w, "session");
	pu(&w, 1);
	ps(&w, "x");
	pack_val(&w.pk, VNEST(arrays));
	return pk_take(&w);
}

START_TEST(test_depth)
{
	buf b = nested(KVS_MAX_DEPTH - 1);
	EXPECT(b, false, 0);
	buf_free(&b);
	b = nested(KVS_MAX_DEPTH);
	EXPECT(b, false, KVS_E_LIMIT);
	buf_free(&b);
	b = nested(10000);
	EXPECT(b, false, KVS_E_LIMIT);
	buf_free(&b);
	/* maps count too */
	pk_t w;
	pk_init(&w);
	pk_env(&w, 1, "stats", 1);
	for (int i = 0; i < KVS_MAX_DEPTH; i++) {
		ps(&w, "m");
		msgpack_pack_map(&w.pk, 1);
	}
	ps(&w, "z");
	msgpack_pack_nil(&w.pk);
	b = pk_take(&w);
	EXPECT(b, false, KVS_E_LIMIT);
	buf_free(&b);
	/* nesting alone at the top, without a map */
	uint8_t deep[200];
	memset(deep, 0x91, sizeof(deep));
	deep[sizeof(deep) - 1] = 0xc0;
	b = raw(deep, sizeof(deep));
	EXPECT(b, false, KVS_E_LIMIT);
	buf_free(&b);
}
END_TEST

/* A heartbeat padded with an ignored string to exactly total bytes. */
static buf padded(size_t total)
{
	pk_t w;
	pk_init(&w);
	pk_env(&w, 2, "heartbeat", 1);
	ps(&w, "session");
	pu(&w, 1);
	ps(&w, "pad");
	size_t used = w.sb.size + 5; /* str32 header */
	ck_assert(total > used);
	pack_val(&w.pk, VSN((uint32_t)(total - used)));
	ck_assert_uint_eq(w.sb.size, total);
	return pk_take(&w);
}

START_TEST(test_msg_size)
{
	buf b = padded(KVS_MAX_MSG_BYTES);
	EXPECT(b, false, 0);
	buf_free(&b);
	b = padded(KVS_MAX_MSG_BYTES + 1);
	kvs_proto_err e;
	EXPECT_E(b, false, KVS_E_LIMIT, &e);
	buf_free(&b);
	/* the length alone decides: a bogus buffer over the limit is E_LIMIT */
	b.n = KVS_MAX_MSG_BYTES + 1;
	b.p = calloc(1, b.n);
	b.p[0] = 0xc1;
	EXPECT(b, false, KVS_E_LIMIT);
	buf_free(&b);
}
END_TEST

START_TEST(test_element_total)
{
	/* more than 2 * KVS_MAX_BLOCK_IDS elements in all (here in an ignored
	 * field) is refused up front */
	pk_t w;
	pk_init(&w);
	pk_env(&w, 2, "heartbeat", 1);
	ps(&w, "session");
	pu(&w, 1);
	ps(&w, "pad");
	uint32_t n = 2 * KVS_MAX_BLOCK_IDS;
	msgpack_pack_array(&w.pk, n);
	for (uint32_t i = 0; i < n; i++)
		msgpack_pack_nil(&w.pk);
	buf b = pk_take(&w);
	EXPECT(b, false, KVS_E_LIMIT);
	buf_free(&b);
	/* well under it: fine */
	pk_init(&w);
	pk_env(&w, 2, "heartbeat", 1);
	ps(&w, "session");
	pu(&w, 1);
	ps(&w, "pad");
	n = KVS_MAX_BLOCK_IDS;
	msgpack_pack_array(&w.pk, n);
	for (uint32_t i = 0; i < n; i++)
		msgpack_pack_nil(&w.pk);
	b = pk_take(&w);
	EXPECT(b, false, 0);
	buf_free(&b);
}
END_TEST

/* ---- envelope ---------------------------------------------------------- */

START_TEST(test_envelope_missing)
{
	pk_t w;
	buf b;
	kvs_proto_err e;

	/* no id: op still reported */
	pk_init(&w);
	msgpack_pack_map(&w.pk, 3);
	ps(&w, "v");
	pu(&w, 1);
	ps(&w, "op");
	ps(&w, "heartbeat");
	ps(&w, "session");
	pu(&w, 1);
	b = pk_take(&w);
	EXPECT_E(b, false, KVS_E_BADMSG, &e);
	ck_assert_int_eq(e.op, KVS_OP_HEARTBEAT);
	ck_assert_uint_eq(e.id, 0);
	ck_assert_ptr_nonnull(strstr(e.msg, "id"));
	buf_free(&b);

	/* no v: id and op reported */
	pk_init(&w);
	msgpack_pack_map(&w.pk, 3);
	ps(&w, "op");
	ps(&w, "heartbeat");
	ps(&w, "id");
	pu(&w, 42);
	ps(&w, "session");
	pu(&w, 1);
	b = pk_take(&w);
	EXPECT_E(b, false, KVS_E_BADMSG, &e);
	ck_assert_int_eq(e.op, KVS_OP_HEARTBEAT);
	ck_assert_uint_eq(e.id, 42);
	buf_free(&b);

	/* no op: id reported */
	pk_init(&w);
	msgpack_pack_map(&w.pk, 3);
	ps(&w, "v");
	pu(&w, 1);
	ps(&w, "id");
	pu(&w, 43);
	ps(&w, "session");
	pu(&w, 1);
	b = pk_take(&w);
	EXPECT_E(b, false, KVS_E_BADMSG, &e);
	ck_assert_int_eq(e.op, KVS_OP_NONE);
	ck_assert_uint_eq(e.id, 43);
	buf_free(&b);
}
END_TEST

/* The rejections of bad id, v and op values are rows of CASES. */
START_TEST(test_envelope_types)
{
	kvs_msg a = q_heartbeat();
	buf base = enc(&a);
	/* the largest id is fine */
	buf b = mutate(base, "id", M_SET, VU(UINT64_MAX));
	kvs_msg d = decode_ok(b, false);
	ck_assert_uint_eq(d.id, UINT64_MAX);
	kvs_msg_clear(&d);
	buf_free(&b);
	buf_free(&base);
}
END_TEST

/* Unsupported versions are rows of CASES. */
START_TEST(test_version)
{
	kvs_msg a = q_register();
	buf base = enc(&a);
	/* the version is judged before the op and the fields */
	buf b = mutate(base, "v", M_SET, VU(2));
	buf c = mutate(b, "op", M_SET, VS("frobnicate"));
	EXPECT(c, false, KVS_E_VERSION);
	buf_free(&c);
	c = mutate(b, "session", M_DROP, VNIL);
	EXPECT(c, false, KVS_E_VERSION);
	buf_free(&c);
	buf_free(&b);
	buf_free(&base);
}
END_TEST

/* Unknown op names are rows of CASES; here what a mutation cannot say. */
START_TEST(test_unknown_op)
{
	kvs_msg a = q_heartbeat();
	buf base = enc(&a);
	kvs_proto_err e;
	/* an op name with a NUL inside */
	buf b = mutate(base, "op", M_SET, VS("x"));
	for (size_t i = 0; i + 1 < b.n; i++)
		if (b.p[i] == 0xa1 && b.p[i + 1] == 'x')
			b.p[i + 1] = '\0';
	EXPECT(b, false, KVS_E_UNKNOWN_OP);
	buf_free(&b);
	buf_free(&base);

	/* job_done is a push: never a request */
	kvs_msg j = {.op = KVS_OP_JOB_DONE, .id = 5};
	b = enc(&j);
	EXPECT_E(b, false, KVS_E_UNKNOWN_OP, &e);
	ck_assert_uint_eq(e.id, 5);
	buf_free(&b);
	j = r_job_done();
	b = enc(&j);
	EXPECT(b, false, KVS_E_UNKNOWN_OP);
	EXPECT(b, true, 0);
	buf_free(&b);
}
END_TEST

/* ---- the decode cases: one table ----------------------------------------- */

/* Every case that is one change to a valid message: fn builds the message,
 * mutate() applies (path, md, v) to its encoding, which is decoded in fn's
 * direction and must give want (0: accepted). A rejection must leave err
 * with the same code, some text and the message's op and id (ENV rows: the
 * op and id the envelope still tells), and msg with nothing to free; REQ
 * rows (a required field dropped) also want the field named in the text;
 * .both rows fail the same when decoded in the other direction. An
 * accepted M_ADD (an unknown key) must change nothing. */
typedef struct dcase {
	builder fn;
	const char *path;
	enum mode md;
	val v;
	int want;
	bool env;      /* err.op and err.id are e_op and e_id, not the message's */
	int e_op;
	uint64_t e_id;
	bool named;    /* err.msg names the path's last component */
	bool both;     /* decoding as the other direction fails the same */
} dcase;

#define ROW(f, p, m, val, w) {.fn = f, .path = p, .md = m, .v = val, .want = w}
#define BOTH(f, p, m, val, w) {.fn = f, .path = p, .md = m, .v = val, .want = w, .both = true}
#define REQ(f, p) {.fn = f, .path = p, .md = M_DROP, .v = TNIL, .want = KVS_E_BADMSG, .named = true}
#define ENV(f, p, m, val, w, op, id) \
	{.fn = f, .path = p, .md = m, .v = val, .want = w, .env = true, .e_op = (op), .e_id = (id)}
#define ENV2(f, p, m, val, w, op, id) \
	{.fn = f, .path = p, .md = m, .v = val, .want = w, .env = true, .e_op = (op), .e_id = (id), .both = true}

static const dcase CASES[] = {
	/* envelope of a request (q_heartbeat: id 3): a bad id is no id, a bad op no op */
	ENV(q_heartbeat, "id", M_SET, TS("3"), KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ENV(q_heartbeat, "id", M_SET, TI(-1), KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ENV(q_heartbeat, "id", M_SET, TFLOAT, KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ENV(q_heartbeat, "id", M_SET, TNIL, KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ENV(q_heartbeat, "id", M_SET, TTRUE, KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ENV(q_heartbeat, "id", M_SET, TB(8), KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ENV(q_heartbeat, "id", M_SET, TARR0, KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ENV(q_heartbeat, "id", M_SET, TMAP0, KVS_E_BADMSG, KVS_OP_HEARTBEAT, 0),
	ROW(q_heartbeat, "v", M_SET, TS("1"), KVS_E_BADMSG),
	ROW(q_heartbeat, "v", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_heartbeat, "v", M_SET, TFLOAT, KVS_E_BADMSG),
	ROW(q_heartbeat, "v", M_SET, TNIL, KVS_E_BADMSG),
	ROW(q_heartbeat, "v", M_SET, TTRUE, KVS_E_BADMSG),
	ROW(q_heartbeat, "v", M_SET, TB(1), KVS_E_BADMSG),
	ENV(q_heartbeat, "op", M_SET, TU(2), KVS_E_BADMSG, KVS_OP_NONE, 3),
	ENV(q_heartbeat, "op", M_SET, TNIL, KVS_E_BADMSG, KVS_OP_NONE, 3),
	ENV(q_heartbeat, "op", M_SET, TB(5), KVS_E_BADMSG, KVS_OP_NONE, 3),
	ENV(q_heartbeat, "op", M_SET, TARR0, KVS_E_BADMSG, KVS_OP_NONE, 3),
	ENV(q_heartbeat, "op", M_SET, TTRUE, KVS_E_BADMSG, KVS_OP_NONE, 3),
	/* versions (q_register: id 4) */
	BOTH(q_register, "v", M_SET, TU(0), KVS_E_VERSION),
	BOTH(q_register, "v", M_SET, TU(2), KVS_E_VERSION),
	BOTH(q_register, "v", M_SET, TU(255), KVS_E_VERSION),
	BOTH(q_register, "v", M_SET, TU(UINT64_MAX), KVS_E_VERSION),
	/* unknown ops: never answered with an op name */
	ENV2(q_heartbeat, "op", M_SET, TS("frobnicate"), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV2(q_heartbeat, "op", M_SET, TS(""), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV2(q_heartbeat, "op", M_SET, TS("HELLO"), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV2(q_heartbeat, "op", M_SET, TS("Heartbeat"), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV2(q_heartbeat, "op", M_SET, TS("heartbeat "), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV2(q_heartbeat, "op", M_SET, TS("hello\x01"), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV2(q_heartbeat, "op", M_SET, TS("job_done_"), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV2(q_heartbeat, "op", M_SET, TS("put"), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3),
	ENV(q_heartbeat, "op", M_SET, TSN(5000), KVS_E_UNKNOWN_OP, KVS_OP_NONE, 3), /* very long */
	/* duplicate envelope keys, the same value too */
	ROW(q_heartbeat, "id", M_ADD, TU(3), KVS_E_BADMSG),
	ROW(q_heartbeat, "v", M_ADD, TU(1), KVS_E_BADMSG),
	ROW(q_heartbeat, "op", M_ADD, TS("heartbeat"), KVS_E_BADMSG),
	ROW(q_heartbeat, "session", M_ADD, TU(1), KVS_E_BADMSG),
	/* envelope of a reply (r_heartbeat: id 3) */
	ROW(r_heartbeat, "ok", M_DROP, TNIL, KVS_E_BADMSG),
	ROW(r_heartbeat, "ok", M_SET, TU(1), KVS_E_BADMSG),
	ROW(r_heartbeat, "ok", M_SET, TS("true"), KVS_E_BADMSG),
	ROW(r_heartbeat, "ok", M_SET, TNIL, KVS_E_BADMSG),
	ROW(r_heartbeat, "epoch", M_DROP, TNIL, KVS_E_BADMSG),
	ROW(r_heartbeat, "epoch", M_SET, TB(15), KVS_E_BADMSG),
	ROW(r_heartbeat, "epoch", M_SET, TB(17), KVS_E_BADMSG),
	ROW(r_heartbeat, "epoch", M_SET, TB(0), KVS_E_BADMSG),
	ROW(r_heartbeat, "epoch", M_SET, TSN(16), KVS_E_BADMSG),
	ROW(r_heartbeat, "epoch", M_SET, TU(1), KVS_E_BADMSG),
	ROW(r_heartbeat, "ok", M_ADD, TTRUE, KVS_E_BADMSG),
	ROW(r_heartbeat, "epoch", M_ADD, TB(16), KVS_E_BADMSG),
	ROW(r_heartbeat, "pending_jobs", M_DROP, TNIL, KVS_E_BADMSG),
	ROW(r_heartbeat, "pending_jobs", M_SET, TI(-1), KVS_E_BADMSG),
	/* envelope of an error reply (r_error: store, id 9) */
	ROW(r_error, "code", M_DROP, TNIL, KVS_E_BADMSG),
	ROW(r_error, "code", M_SET, TU(KVS_E_MISS - KVS_E_BASE), KVS_E_BADMSG),
	ROW(r_error, "code", M_SET, TB(8), KVS_E_BADMSG),
	ROW(r_error, "code", M_ADD, TS("E_MISS"), KVS_E_BADMSG),
	ROW(r_error, "msg", M_ADD, TS("again"), KVS_E_BADMSG),
	ROW(r_error, "ok", M_ADD, TFALSE, KVS_E_BADMSG),
	ROW(r_error, "epoch", M_SET, TB(15), KVS_E_BADMSG),

	/* required fields, one dropped at a time */
	REQ(q_hello, "engine"), REQ(q_hello, "role"), REQ(q_hello, "rank"),
	REQ(q_hello, "world"), REQ(q_hello, "namespace"),
	REQ(q_heartbeat, "session"),
	REQ(q_bye, "session"),
	REQ(q_register, "session"), REQ(q_register, "device"), REQ(q_register, "allocations"),
	REQ(q_register, "groups"), REQ(q_register, "layers"), REQ(q_register, "device.type"),
	REQ(q_register, "device.uuid"), REQ(q_register, "allocations.1.token"), REQ(q_register, "allocations.0.alloc_id"),
	REQ(q_register, "allocations.0.size"), REQ(q_register, "groups.0.id"), REQ(q_register, "groups.1.kind"),
	REQ(q_register, "groups.0.tokens_per_block"), REQ(q_register, "groups.0.blocks_per_chunk"), REQ(q_register, "layers.2.group"),
	REQ(q_register, "layers.0.alloc"), REQ(q_register, "layers.0.offset"), REQ(q_register, "layers.0.num_blocks"),
	REQ(q_register, "layers.0.block_stride"), REQ(q_register, "layers.1.block_bytes"),
	REQ(q_unregister, "session"), REQ(q_unregister, "registration"),
	REQ(q_lookup, "session"), REQ(q_lookup, "keys"),
	REQ(q_store, "session"), REQ(q_store, "job"), REQ(q_store, "keys"),
	REQ(q_store, "blocks"),
	REQ(q_retrieve, "session"), REQ(q_retrieve, "job"), REQ(q_retrieve, "keys"),
	REQ(q_retrieve, "blocks"),
	REQ(q_complete, "session"), REQ(q_complete, "job"), REQ(q_complete, "status"),
	REQ(q_job_status, "session"),
	REQ(r_hello, "session"), REQ(r_hello, "heartbeat_ms"), REQ(r_hello, "ttl_ms"),
	REQ(r_hello, "limits"), REQ(r_hello, "limits.max_msg_bytes"), REQ(r_hello, "limits.max_keys"),
	REQ(r_hello, "limits.max_block_ids"),
	REQ(r_heartbeat, "pending_jobs"),
	REQ(r_register, "registration"), REQ(r_register, "imported"), REQ(r_register, "aliased"),
	REQ(r_lookup, "hits"), REQ(r_lookup, "tiers"),
	REQ(r_store, "job"), REQ(r_store, "state"),
	REQ(r_retrieve, "job"), REQ(r_retrieve, "state"),
	REQ(r_complete, "job"), REQ(r_complete, "state"),
	REQ(r_job_status, "jobs"), REQ(r_job_status, "jobs.0.job"), REQ(r_job_status, "jobs.1.state"),
	REQ(r_job_status, "jobs.2.reason"), REQ(r_job_status, "jobs.3.ranks_done"),
	REQ(r_stats, "counters"),
	REQ(r_job_done, "job"), REQ(r_job_done, "state"), REQ(r_job_done, "reason"),
	REQ(r_error, "code"), REQ(r_error, "ok"), REQ(r_error, "epoch"),
	REQ(r_heartbeat, "ok"),
	REQ(r_bye, "epoch"),

	/* field values: type, range, length, enums, keys */
	/* hello */
	ROW(q_hello, "engine", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_hello, "engine", M_SET, TB(4), KVS_E_BADMSG),
	ROW(q_hello, "engine", M_SET, TSN(KVS_MAX_STR), 0),
	ROW(q_hello, "engine", M_SET, TSN(KVS_MAX_STR + 1), KVS_E_LIMIT),
	ROW(q_hello, "engine", M_SET, TSN(100000), KVS_E_LIMIT),
	ROW(q_hello, "namespace", M_SET, TSN(KVS_MAX_STR + 1), KVS_E_LIMIT),
	ROW(q_hello, "namespace", M_SET, TNIL, KVS_E_BADMSG),
	ROW(q_hello, "role", M_SET, TS("admin"), KVS_E_BADMSG),
	ROW(q_hello, "role", M_SET, TS("Worker"), KVS_E_BADMSG),
	ROW(q_hello, "role", M_SET, TS(""), KVS_E_BADMSG),
	ROW(q_hello, "role", M_SET, TU(0), KVS_E_BADMSG),
	ROW(q_hello, "role", M_SET, TS("scheduler"), 0),
	ROW(q_hello, "rank", M_SET, TS("3"), KVS_E_BADMSG),
	ROW(q_hello, "rank", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_hello, "rank", M_SET, TFLOAT, KVS_E_BADMSG),
	ROW(q_hello, "rank", M_SET, TU(65535), 0),
	ROW(q_hello, "rank", M_SET, TU(65536), KVS_E_BADMSG),
	ROW(q_hello, "world", M_SET, TU(65536), 0),
	ROW(q_hello, "world", M_SET, TU(65537), KVS_E_BADMSG),
	ROW(q_hello, "world", M_SET, TU(UINT64_MAX), KVS_E_BADMSG),
	/* heartbeat / bye */
	ROW(q_heartbeat, "session", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_heartbeat, "session", M_SET, TS("1"), KVS_E_BADMSG),
	ROW(q_heartbeat, "session", M_SET, TFLOAT, KVS_E_BADMSG),
	ROW(q_heartbeat, "session", M_SET, TNIL, KVS_E_BADMSG),
	ROW(q_heartbeat, "session", M_SET, TTRUE, KVS_E_BADMSG),
	ROW(q_heartbeat, "session", M_SET, TU(UINT64_MAX), 0),
	ROW(q_bye, "session", M_SET, TB(8), KVS_E_BADMSG),
	/* register */
	ROW(q_register, "session", M_SET, TI(-7), KVS_E_BADMSG),
	ROW(q_register, "device", M_SET, TS("cuda"), KVS_E_BADMSG),
	ROW(q_register, "device", M_SET, TARR0, KVS_E_BADMSG),
	ROW(q_register, "device.type", M_SET, TS("tpu"), KVS_E_BADMSG),
	ROW(q_register, "device.type", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_register, "device.uuid", M_SET, TB(15), KVS_E_BADMSG),
	ROW(q_register, "device.uuid", M_SET, TB(17), KVS_E_BADMSG),
	ROW(q_register, "device.uuid", M_SET, TSN(16), KVS_E_BADMSG),
	ROW(q_register, "allocations", M_SET, TMAP0, KVS_E_BADMSG),
	ROW(q_register, "allocations", M_SET, TARR0, 0),
	ROW(q_register, "allocations.0", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_register, "allocations.0", M_SET, TARR0, KVS_E_BADMSG),
	ROW(q_register, "allocations.0.token", M_SET, TB(15), KVS_E_BADMSG),
	ROW(q_register, "allocations.1.token", M_SET, TB(17), KVS_E_BADMSG),
	ROW(q_register, "allocations.0.token", M_SET, TB(0), KVS_E_BADMSG),
	ROW(q_register, "allocations.0.token", M_SET, TSN(16), KVS_E_BADMSG),
	ROW(q_register, "allocations.0.alloc_id", M_SET, TB(32), KVS_E_BADMSG),
	ROW(q_register, "allocations.0.size", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_register, "allocations.0.size", M_SET, TS("1G"), KVS_E_BADMSG),
	ROW(q_register, "groups", M_SET, TU(2), KVS_E_BADMSG),
	ROW(q_register, "groups.0", M_SET, TNIL, KVS_E_BADMSG),
	ROW(q_register, "groups.0.id", M_SET, TU(1ull << 32), KVS_E_BADMSG),
	ROW(q_register, "groups.0.id", M_SET, TU(UINT32_MAX), 0),
	ROW(q_register, "groups.1.kind", M_SET, TS("mamba"), KVS_E_BADMSG),
	ROW(q_register, "groups.1.kind", M_SET, TS("Attention"), KVS_E_BADMSG),
	ROW(q_register, "groups.0.tokens_per_block", M_SET, TI(-16), KVS_E_BADMSG),
	ROW(q_register, "groups.0.blocks_per_chunk", M_SET, TS("4"), KVS_E_BADMSG),
	ROW(q_register, "groups.1.window_chunks", M_SET, TS("full"), KVS_E_BADMSG),
	ROW(q_register, "groups.1.window_chunks", M_SET, TU((uint64_t)INT64_MAX + 1), KVS_E_BADMSG),
	ROW(q_register, "groups.1.window_chunks", M_SET, TU(INT64_MAX), 0),
	ROW(q_register, "groups.0.null_block", M_SET, TFLOAT, KVS_E_BADMSG),
	ROW(q_register, "groups.0.null_block", M_SET, TU(UINT64_MAX), KVS_E_BADMSG),
	ROW(q_register, "layers", M_SET, TS("x"), KVS_E_BADMSG),
	ROW(q_register, "layers.1", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_register, "layers.0.group", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_register, "layers.0.alloc", M_SET, TU(1ull << 32), KVS_E_BADMSG),
	ROW(q_register, "layers.2.offset", M_SET, TS("0"), KVS_E_BADMSG),
	ROW(q_register, "layers.0.num_blocks", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_register, "layers.0.block_stride", M_SET, TTRUE, KVS_E_BADMSG),
	ROW(q_register, "layers.0.block_bytes", M_SET, TNIL, KVS_E_BADMSG),
	/* unregister */
	ROW(q_unregister, "registration", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_unregister, "registration", M_SET, TS("r1"), KVS_E_BADMSG),
	/* lookup */
	ROW(q_lookup, "keys", M_SET, TB(32), KVS_E_BADMSG),
	ROW(q_lookup, "keys", M_SET, TMAP0, KVS_E_BADMSG),
	ROW(q_lookup, "keys.0", M_SET, TB(31), KVS_E_BADMSG),
	ROW(q_lookup, "keys.1", M_SET, TB(33), KVS_E_BADMSG),
	ROW(q_lookup, "keys.2", M_SET, TB(0), KVS_E_BADMSG),
	ROW(q_lookup, "keys.0", M_SET, TSN(32), KVS_E_BADMSG),
	ROW(q_lookup, "keys.0", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_lookup, "keys", M_SET, TARR0, 0),
	ROW(q_lookup, "prefetch", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_lookup, "prefetch", M_SET, TS("true"), KVS_E_BADMSG),
	ROW(q_lookup, "pin_ms", M_SET, TU(600001), KVS_E_BADMSG),
	ROW(q_lookup, "pin_ms", M_SET, TI(-1), KVS_E_BADMSG),
	/* store / retrieve */
	ROW(q_store, "job", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_store, "job", M_SET, TS("99"), KVS_E_BADMSG),
	ROW(q_store, "keys.1", M_SET, TB(16), KVS_E_BADMSG),
	ROW(q_store, "blocks", M_SET, TU(0), KVS_E_BADMSG),
	ROW(q_store, "blocks", M_SET, TMAP0, KVS_E_BADMSG),
	ROW(q_store, "blocks.0", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_store, "blocks.1", M_SET, TMAP0, KVS_E_BADMSG),
	ROW(q_store, "blocks.0.3", M_SET, TS("3"), KVS_E_BADMSG),
	ROW(q_store, "blocks.0.3", M_SET, TFLOAT, KVS_E_BADMSG),
	ROW(q_store, "blocks.0.3", M_SET, TNIL, KVS_E_BADMSG),
	ROW(q_store, "blocks.1.0", M_SET, TU((uint64_t)INT64_MAX + 1), KVS_E_BADMSG),
	ROW(q_store, "blocks.1.0", M_SET, TI(INT64_MIN), 0),
	ROW(q_store, "blocks", M_SET, TARR0, 0),
	ROW(q_store, "producer_event", M_SET, TB(0), 0),
	ROW(q_store, "producer_event", M_SET, TB(64), 0),
	ROW(q_store, "producer_event", M_SET, TB(65), KVS_E_LIMIT),
	ROW(q_store, "producer_event", M_SET, TSN(8), KVS_E_BADMSG),
	ROW(q_store, "lazy", M_SET, TS("yes"), KVS_E_BADMSG),
	ROW(q_store, "complete", M_SET, TS("yes"), KVS_E_BADMSG),
	ROW(q_store, "complete", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_store, "lazy", M_SET, TU(0), KVS_E_BADMSG),
	ROW(q_retrieve, "skip_tokens", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_retrieve, "skip_tokens", M_SET, TS("16"), KVS_E_BADMSG),
	ROW(q_retrieve, "blocks.1", M_SET, TARRU(3, 1), 0),
	/* complete */
	ROW(q_complete, "status", M_SET, TS("done"), KVS_E_BADMSG),
	ROW(q_complete, "status", M_SET, TS("OK"), KVS_E_BADMSG),
	ROW(q_complete, "status", M_SET, TTRUE, KVS_E_BADMSG),
	ROW(q_complete, "status", M_SET, TS("ok"), 0),
	/* job_status / stats */
	ROW(q_job_status, "jobs", M_SET, TU(1), KVS_E_BADMSG),
	ROW(q_job_status, "jobs.1", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(q_job_status, "jobs.0", M_SET, TS("1"), KVS_E_BADMSG),
	ROW(q_job_status, "jobs", M_SET, TARRU(KVS_MAX_JOBS_QUERY, 7), 0),
	ROW(q_job_status, "jobs", M_SET, TARRU(KVS_MAX_JOBS_QUERY + 1, 7), KVS_E_LIMIT),
	ROW(q_stats_session, "session", M_SET, TS("s"), KVS_E_BADMSG),
	ROW(q_stats_session, "session", M_SET, TI(-1), KVS_E_BADMSG),
	/* replies */
	ROW(r_hello, "limits", M_SET, TU(1), KVS_E_BADMSG),
	ROW(r_hello, "limits", M_SET, TMAP0, KVS_E_BADMSG),
	ROW(r_hello, "limits.max_keys", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(r_hello, "ttl_ms", M_SET, TS("30s"), KVS_E_BADMSG),
	ROW(r_register, "imported", M_SET, TI(-1), KVS_E_BADMSG),
	ROW(r_lookup, "hits", M_SET, TU(KVS_MAX_KEYS), 0),
	ROW(r_lookup, "hits", M_SET, TU(KVS_MAX_KEYS + 1), KVS_E_BADMSG),
	ROW(r_lookup, "tiers.1", M_SET, TS("l4"), KVS_E_BADMSG),
	ROW(r_lookup, "tiers.0", M_SET, TS("L1"), KVS_E_BADMSG),
	ROW(r_lookup, "tiers.2", M_SET, TU(0), KVS_E_BADMSG),
	ROW(r_lookup, "tiers", M_SET, TS("l1"), KVS_E_BADMSG),
	ROW(r_store, "state", M_SET, TS("pending"), KVS_E_BADMSG),
	ROW(r_store, "state", M_SET, TU(0), KVS_E_BADMSG),
	ROW(r_complete, "state", M_SET, TS("unknown"), 0),
	ROW(r_job_status, "jobs", M_SET, TMAP0, KVS_E_BADMSG),
	ROW(r_job_status, "jobs.0", M_SET, TU(10), KVS_E_BADMSG),
	ROW(r_job_status, "jobs.1.state", M_SET, TS("done"), KVS_E_BADMSG),
	ROW(r_job_status, "jobs.2.reason", M_SET, TSN(KVS_MAX_STR), 0),
	ROW(r_job_status, "jobs.2.reason", M_SET, TSN(KVS_MAX_STR + 1), KVS_E_LIMIT),
	ROW(r_job_status, "jobs.3.ranks_done", M_SET, TU(1ull << 32), KVS_E_BADMSG),
	ROW(r_stats, "counters", M_SET, TARR0, KVS_E_BADMSG),
	ROW(r_stats, "counters.sessions", M_SET, TS("3"), KVS_E_BADMSG),
	ROW(r_stats, "counters.sessions", M_SET, TI(-3), KVS_E_BADMSG),
	ROW(r_stats, "counters.x", M_ADD_UKEY, TU(1), KVS_E_BADMSG),
	ROW(r_stats, "counters.x", M_ADD_BINKEY, TU(1), KVS_E_BADMSG),
	ROW(r_job_done, "reason", M_SET, TSN(KVS_MAX_STR + 1), KVS_E_LIMIT),
	ROW(r_job_done, "reason", M_SET, TU(0), KVS_E_BADMSG),
	ROW(r_job_done, "state", M_SET, TS("closed"), KVS_E_BADMSG),
	/* duplicate keys, at the top and nested */
	ROW(q_hello, "engine", M_ADD, TS("other"), KVS_E_BADMSG),
	ROW(q_register, "groups.0.kind", M_ADD, TS("attention"), KVS_E_BADMSG),
	ROW(q_register, "device.uuid", M_ADD, TB(16), KVS_E_BADMSG),
	ROW(q_register, "layers.2.offset", M_ADD, TU(0), KVS_E_BADMSG),
	ROW(q_register, "allocations.0.size", M_ADD, TU(1), KVS_E_BADMSG),
	ROW(q_lookup, "keys", M_ADD, TARR0, KVS_E_BADMSG),
	ROW(q_lookup, "prefetch", M_ADD, TTRUE, KVS_E_BADMSG),
	ROW(r_hello, "limits.max_keys", M_ADD, TU(1), KVS_E_BADMSG),
	ROW(r_job_status, "jobs.0.reason", M_ADD, TS("x"), KVS_E_BADMSG),
	ROW(r_job_done, "job", M_ADD, TU(99), KVS_E_BADMSG),
	/* non-string keys */
	ROW(q_heartbeat, "x", M_ADD_UKEY, TU(1), KVS_E_BADMSG),
	ROW(q_heartbeat, "session", M_ADD_BINKEY, TU(1), KVS_E_BADMSG),
	ROW(q_register, "groups.0.x", M_ADD_UKEY, TU(1), KVS_E_BADMSG),
	ROW(q_register, "device.x", M_ADD_BINKEY, TU(1), KVS_E_BADMSG),
	ROW(r_heartbeat, "x", M_ADD_UKEY, TNIL, KVS_E_BADMSG),
	/* unknown keys are ignored, wherever they are */
	ROW(q_hello, "x_future", M_ADD, TMAP0, 0),
	ROW(q_hello, "ok", M_ADD, TTRUE, 0),
	ROW(q_hello, "epoch", M_ADD, TU(3), 0),
	ROW(q_heartbeat, "pending_jobs", M_ADD, TS("not mine"), 0),
	ROW(q_register, "groups.0.x_future", M_ADD, TARRU(3, 1), 0),
	ROW(q_register, "allocations.1.x_future", M_ADD, TS("s"), 0),
	ROW(q_register, "device.x_future", M_ADD, TNIL, 0),
	ROW(q_register, "layers.0.x_future", M_ADD, TB(3), 0),
	ROW(q_store, "x_future", M_ADD, TNEST(3), 0),
	ROW(r_hello, "limits.max_things", M_ADD, TU(1), 0),
	ROW(r_job_status, "jobs.0.x_future", M_ADD, TU(1), 0),
	ROW(r_error, "details", M_ADD, TMAP0, 0),
	ROW(r_bye, "x", M_ADD, TU(1), 0),
};

START_TEST(test_cases)
{
	const dcase *c = &CASES[_i];
	kvs_msg a = c->fn();
	buf base = enc(&a);
	buf b = mutate(base, c->path, c->md, c->v);
	kvs_msg d;
	kvs_proto_err e;
	memset(&d, 0x5a, sizeof(d));
	memset(&e, 0xa5, sizeof(e));
	int r = kvs_proto_decode(b.p, b.n, a.is_reply, &d, &e);
	ck_assert_msg(r == c->want, "case %d: %s %s (mode %d): got %s [%s], want %s", _i,
		      kvs_op_name(a.op), c->path, c->md, r ? kvs_error_name(r) : "ok",
		      r ? e.msg : "", c->want ? kvs_error_name(c->want) : "ok");
	if (r) {
		ck_assert_int_eq(e.code, r);
		ck_assert_int_eq(e.op, c->env ? (kvs_op)c->e_op : a.op);
		ck_assert_uint_eq(e.id, c->env ? c->e_id : a.id);
		ck_assert_ptr_null(d.zone_);
		ck_assert_msg(e.msg[0], "case %d: no error text", _i);
		ck_assert_msg(memchr(e.msg, 0, sizeof(e.msg)) != NULL, "case %d: unterminated err.msg", _i);
		if (c->named) {
			const char *leaf = strrchr(c->path, '.');
			leaf = leaf ? leaf + 1 : c->path;
			ck_assert_msg(strstr(e.msg, leaf) != NULL, "'%s' does not name %s", e.msg, leaf);
		}
		if (c->both)
			expect_(__LINE__, c->path, b, !a.is_reply, c->want, NULL);
	} else if (c->md == M_ADD) {
		/* an ignored key changes nothing */
		assert_msg_eq(&a, &d);
		kvs_msg_clear(&d);
	} else {
		kvs_msg_clear(&d);
	}
	buf_free(&b);
	buf_free(&base);
}
END_TEST

/* Decoded values of accepted edge cases. */
START_TEST(test_field_values)
{
	kvs_msg a = q_store();
	buf base = enc(&a);
	buf b = mutate(base, "blocks.1.0", M_SET, VI(INT64_MIN));
	kvs_msg d = decode_ok(b, false);
	ck_assert_int_eq(d.blocks.ids[1][0], INT64_MIN);
	ck_assert_int_eq(d.blocks.ids[0][4], -1);
	ck_assert_int_eq(d.blocks.ids[0][6], INT64_MAX);
	kvs_msg_clear(&d);
	buf_free(&b);
	/* a positive id sent as a signed msgpack int is still fine */
	b = mutate(base, "job", M_SET, VI(5));
	d = decode_ok(b, false);
	ck_assert_uint_eq(d.job, 5);
	kvs_msg_clear(&d);
	buf_free(&b);
	buf_free(&base);

	a = r_complete();
	base = enc(&a);
	b = mutate(base, "state", M_SET, VS("unknown"));
	d = decode_ok(b, true);
	ck_assert_int_eq(d.state, KVS_JOB_UNKNOWN);
	kvs_msg_clear(&d);
	buf_free(&b);
	buf_free(&base);

	/* decoded strings borrow from the input and are not NUL-terminated */
	a = q_hello();
	base = enc(&a);
	d = decode_ok(base, false);
	ck_assert_ptr_ne(d.engine.ptr, a.engine.ptr);
	ck_assert((const uint8_t *)d.engine.ptr >= base.p &&
		  (const uint8_t *)d.engine.ptr < base.p + base.n);
	char tmp[KVS_MAX_STR + 1];
	kvs_str_copy(tmp, sizeof(tmp), d.ns);
	ck_assert_str_eq(tmp, "meta-llama/Llama-3-70B:salt42");
	kvs_msg_clear(&d);
	buf_free(&base);
}
END_TEST

/* ---- array limits ------------------------------------------------------ */

static int decode_code(const kvs_msg *a, kvs_proto_err *e)
{
	buf b = enc(a);
	kvs_msg d;
	int r = kvs_proto_decode(b.p, b.n, a->is_reply, &d, e);
	if (r == 0)
		kvs_msg_clear(&d);
	else
		ck_assert_ptr_null(d.zone_);
	buf_free(&b);
	return r;
}

START_TEST(test_array_limits)
{
	kvs_proto_err e;
	/* keys */
	uint8_t *keys = calloc(KVS_MAX_KEYS + 1, KVS_KEY_BYTES);
	kvs_msg a = q_lookup();
	a.keys = keys;
	a.n_keys = KVS_MAX_KEYS;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.n_keys = KVS_MAX_KEYS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	ck_assert_int_eq(e.op, KVS_OP_LOOKUP);
	ck_assert_uint_eq(e.id, a.id);
	a = q_store();
	a.keys = keys;
	a.n_keys = KVS_MAX_KEYS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	a = q_retrieve();
	a.keys = keys;
	a.n_keys = KVS_MAX_KEYS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	free(keys);

	/* register arrays */
	kvs_alloc_desc *al = calloc(KVS_MAX_ALLOCS + 1, sizeof(*al));
	kvs_group_desc *gr = calloc(KVS_MAX_GROUPS + 1, sizeof(*gr));
	kvs_layer_desc *ly = calloc(KVS_MAX_LAYERS + 1, sizeof(*ly));
	a = q_register();
	a.allocs = al;
	a.n_allocs = KVS_MAX_ALLOCS;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.n_allocs = KVS_MAX_ALLOCS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	ck_assert_int_eq(e.op, KVS_OP_REGISTER);
	a = q_register();
	a.groups = gr;
	a.n_groups = KVS_MAX_GROUPS;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.n_groups = KVS_MAX_GROUPS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	a = q_register();
	a.layers = ly;
	a.n_layers = KVS_MAX_LAYERS;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.n_layers = KVS_MAX_LAYERS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	free(al);
	free(gr);
	free(ly);

	/* job_status request / reply */
	uint64_t *jobs = calloc(KVS_MAX_JOBS_QUERY + 1, sizeof(*jobs));
	a = q_job_status();
	a.jobs = jobs;
	a.n_jobs = KVS_MAX_JOBS_QUERY + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	free(jobs);
	kvs_job_info *ji = calloc(KVS_MAX_JOBS_QUERY + 1, sizeof(*ji));
	a = r_job_status();
	a.job_infos = ji;
	a.n_job_infos = KVS_MAX_JOBS_QUERY;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.n_job_infos = KVS_MAX_JOBS_QUERY + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	free(ji);

	/* lookup reply tiers */
	uint8_t *tiers = calloc(KVS_MAX_KEYS + 1, 1);
	a = r_lookup();
	a.tiers = tiers;
	a.n_tiers = KVS_MAX_KEYS;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.n_tiers = KVS_MAX_KEYS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	free(tiers);

	/* stats counters */
	kvs_counter *c = calloc(KVS_MAX_COUNTERS + 1, sizeof(*c));
	char (*names)[8] = calloc(KVS_MAX_COUNTERS + 1, 8);
	for (int i = 0; i <= KVS_MAX_COUNTERS; i++) {
		snprintf(names[i], 8, "c%d", i);
		c[i].name = kvs_str_c(names[i]);
		c[i].value = (uint64_t)i;
	}
	a = r_stats();
	a.counters = c;
	a.n_counters = KVS_MAX_COUNTERS;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.n_counters = KVS_MAX_COUNTERS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	free(c);
	free(names);
}
END_TEST

START_TEST(test_block_limits)
{
	kvs_proto_err e;
	int64_t *ids = calloc(KVS_MAX_BLOCK_IDS + 1, sizeof(int64_t));
	ck_assert_ptr_nonnull(ids);
	kvs_msg a = q_store();
	/* groups: at most KVS_MAX_GROUPS lists */
	kvs_msg g = q_store();
	g.blocks.n = KVS_MAX_GROUPS;
	for (int i = 0; i < KVS_MAX_GROUPS; i++) {
		g.blocks.ids[i] = ids;
		g.blocks.len[i] = 2;
	}
	ck_assert_int_eq(decode_code(&g, &e), 0);
	/* 17 lists, built by hand (the encoder's struct holds 16) */
	buf base = enc(&g);
	pk_t w;
	pk_init(&w);
	msgpack_pack_array(&w.pk, KVS_MAX_GROUPS + 1);
	for (int i = 0; i <= KVS_MAX_GROUPS; i++)
		pack_val(&w.pk, VARRU(2, 0));
	buf lists = pk_take(&w);
	{
		/* splice the hand-made array in as "blocks" */
		msgpack_unpacked u;
		msgpack_unpacked_init(&u);
		size_t off = 0;
		ck_assert_int_eq(msgpack_unpack_next(&u, (const char *)base.p, base.n, &off),
				 MSGPACK_UNPACK_SUCCESS);
		pk_init(&w);
		msgpack_pack_map(&w.pk, u.data.via.map.size);
		for (uint32_t i = 0; i < u.data.via.map.size; i++) {
			const msgpack_object_kv *kv = &u.data.via.map.ptr[i];
			msgpack_pack_object(&w.pk, kv->key);
			if (kv->key.via.str.size == 6 && memcmp(kv->key.via.str.ptr, "blocks", 6) == 0)
				praw(&w, lists.p, lists.n);
			else
				msgpack_pack_object(&w.pk, kv->val);
		}
		msgpack_unpacked_destroy(&u);
	}
	buf b17 = pk_take(&w);
	EXPECT_E(b17, false, KVS_E_LIMIT, &e);
	ck_assert_int_eq(e.op, KVS_OP_STORE);
	ck_assert_uint_eq(e.id, 9);
	buf_free(&b17);
	buf_free(&lists);
	buf_free(&base);

	/* block ids: KVS_MAX_BLOCK_IDS in all groups together */
	a.blocks.n = 1;
	a.blocks.ids[0] = ids;
	a.blocks.len[0] = KVS_MAX_BLOCK_IDS;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.blocks.len[0] = KVS_MAX_BLOCK_IDS + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	a.blocks.n = 2;
	a.blocks.len[0] = KVS_MAX_BLOCK_IDS / 2 + 1;
	a.blocks.ids[1] = ids;
	a.blocks.len[1] = KVS_MAX_BLOCK_IDS / 2;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	a.blocks.len[0] = KVS_MAX_BLOCK_IDS / 2;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.op = KVS_OP_RETRIEVE;
	a.blocks.len[0] = KVS_MAX_BLOCK_IDS / 2 + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	ck_assert_int_eq(e.op, KVS_OP_RETRIEVE);
	free(ids);
}
END_TEST

/* Packed block lists (protocol.md §10.1): a list whose ids do not fit 32
 * bits stays an array, lists of both kinds mix, a bin that is not whole ids
 * is E_BADMSG, and the id limit counts packed ids too. */
START_TEST(test_packed_blocks)
{
	kvs_proto_err e;
	/* list 0 has INT64_MAX: an array; list 1 packed */
	kvs_msg a = q_store();
	a.blocks.ids[1] = BLKP1;
	a.blocks.packed = true;
	buf b = enc(&a);
	uint32_t bin_len = 0;
	ck_assert_int_eq(wire_type(b, "blocks.0", NULL), MSGPACK_OBJECT_ARRAY);
	ck_assert_int_eq(wire_type(b, "blocks.1", &bin_len), MSGPACK_OBJECT_BIN);
	ck_assert_uint_eq(bin_len, 8);
	kvs_msg d;
	ck_assert_int_eq(kvs_proto_decode(b.p, b.n, false, &d, &e), 0);
	ck_assert(!d.blocks.packed); /* mixed */
	ck_assert_uint_eq(d.blocks.len[0], 8);
	ck_assert_uint_eq(d.blocks.len[1], 2);
	for (uint32_t i = 0; i < 8; i++)
		ck_assert_int_eq(d.blocks.ids[0][i], BLK0[i]);
	ck_assert_int_eq(d.blocks.ids[1][0], 5);
	ck_assert_int_eq(d.blocks.ids[1][1], -2);
	kvs_msg_clear(&d);
	buf_free(&b);
	/* a bin of 6 bytes: not whole ids */
	kvs_msg rt = q_retrieve();
	buf base = enc(&rt);
	b = mutate(base, "blocks.0", M_SET, VB(6));
	buf_free(&base);
	EXPECT_E(b, false, KVS_E_BADMSG, &e);
	ck_assert_msg(strstr(e.msg, "not a multiple of 4"), "%s", e.msg);
	ck_assert_int_eq(e.op, KVS_OP_RETRIEVE);
	buf_free(&b);
	/* limits: KVS_MAX_BLOCK_IDS ids in all, packed as well */
	int64_t *ids = calloc(KVS_MAX_BLOCK_IDS + 1, sizeof(int64_t));
	ck_assert_ptr_nonnull(ids);
	a = q_store();
	a.blocks.packed = true;
	a.blocks.n = 2;
	a.blocks.ids[0] = ids;
	a.blocks.len[0] = KVS_MAX_BLOCK_IDS / 2;
	a.blocks.ids[1] = ids;
	a.blocks.len[1] = KVS_MAX_BLOCK_IDS / 2;
	ck_assert_int_eq(decode_code(&a, &e), 0);
	a.blocks.len[1] = KVS_MAX_BLOCK_IDS / 2 + 1;
	ck_assert_int_eq(decode_code(&a, &e), KVS_E_LIMIT);
	free(ids);
}
END_TEST

/* ---- robustness -------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
	uint64_t x = rng_state;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return rng_state = x;
}

/* Random damage to valid messages: decode must either succeed (and then
 * re-encode and decode again) or fail with a project code, never crash. */
START_TEST(test_random_damage)
{
	rng_state ^= (uint64_t)(_i + 1) * 0x2545f4914f6cdd1dull;
	kvs_msg a = ALL[_i].fn();
	buf base = enc(&a);
	for (int it = 0; it < 400; it++) {
		buf b = {malloc(base.n + 8), base.n};
		memcpy(b.p, base.p, base.n);
		int edits = 1 + (int)(rnd() % 3);
		for (int k = 0; k < edits; k++) {
			size_t pos = rnd() % b.n;
			switch (rnd() % 4) {
			case 0: b.p[pos] ^= (uint8_t)(1u << (rnd() % 8)); break;
			case 1: b.p[pos] = (uint8_t)rnd(); break;
			case 2: b.n = pos + 1; break;
			case 3: /* interesting bytes */
				b.p[pos] = (uint8_t[]){0xc1, 0xdd, 0xdf, 0xff, 0x00, 0x7f, 0x80, 0xc0}[rnd() % 8];
				break;
			}
		}
		for (int rep = 0; rep < 2; rep++) {
			kvs_msg d;
			kvs_proto_err e;
			int r = kvs_proto_decode(b.p, b.n, rep, &d, &e);
			if (r) {
				ck_assert(kvs_error_is_project(r));
				ck_assert_int_eq(e.code, r);
				ck_assert_ptr_null(d.zone_);
				continue;
			}
			buf re = enc(&d);
			kvs_msg d2;
			r = kvs_proto_decode(re.p, re.n, rep, &d2, &e);
			ck_assert_msg(r == 0, "re-decode failed: %s", e.msg);
			kvs_msg_clear(&d2);
			kvs_msg_clear(&d);
			buf_free(&re);
		}
		buf_free(&b);
	}
	buf_free(&base);
}
END_TEST

/* ---- suite ------------------------------------------------------------- */

static Suite *proto_suite(void)
{
	Suite *s = suite_create("proto");
	TCase *tc = tcase_create("roundtrip");
	tcase_add_loop_test(tc, test_roundtrip, 0, N_ALL);
	tcase_add_test(tc, test_roundtrip_error_codes);
	tcase_add_test(tc, test_error_reply_shape);
	suite_add_tcase(s, tc);

	tc = tcase_create("encoder");
	tcase_add_test(tc, test_optional_omitted);
	tcase_add_test(tc, test_required_always_written);
	tcase_add_test(tc, test_group_defaults);
	tcase_add_test(tc, test_explicit_defaults_present);
	tcase_add_test(tc, test_encode_refuses);
	tcase_add_test(tc, test_names);
	suite_add_tcase(s, tc);

	tc = tcase_create("structure");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_not_msgpack);
	tcase_add_loop_test(tc, test_truncated, 0, N_ALL);
	tcase_add_loop_test(tc, test_trailing, 0, N_ALL);
	tcase_add_test(tc, test_top_not_map);
	tcase_add_test(tc, test_huge_headers);
	tcase_add_test(tc, test_depth);
	tcase_add_test(tc, test_msg_size);
	tcase_add_test(tc, test_element_total);
	suite_add_tcase(s, tc);

	tc = tcase_create("envelope");
	tcase_add_test(tc, test_envelope_missing);
	tcase_add_test(tc, test_envelope_types);
	tcase_add_test(tc, test_version);
	tcase_add_test(tc, test_unknown_op);
	suite_add_tcase(s, tc);

	tc = tcase_create("cases");
	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, test_cases, 0, (int)(sizeof(CASES) / sizeof(CASES[0])));
	tcase_add_test(tc, test_field_values);
	tcase_add_test(tc, test_array_limits);
	tcase_add_test(tc, test_block_limits);
	tcase_add_test(tc, test_packed_blocks);
	suite_add_tcase(s, tc);

	tc = tcase_create("robustness");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, test_random_damage, 0, N_ALL);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(proto_suite)
