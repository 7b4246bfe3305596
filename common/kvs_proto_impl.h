/* Internals of the protocol codec, shared by its files and by nothing else
 * (not installed): the field-table types, the op table, the structural
 * pre-scan and the error helper.
 *
 *   kvs_proto_fields.c  which fields each op carries (the single source of
 *                       truth), op/state/tier/admin names
 *   kvs_proto_scan.c    structural pre-scan of the raw bytes, envelope peek
 *   kvs_proto_decode.c  msgpack-c decoding and the walk over a field table
 *   kvs_proto_encode.c  encoding from a field table; KV events */
#ifndef KVS_PROTO_IMPL_H
#define KVS_PROTO_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "kvs_proto.h"

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

/* An op's wire name and its request and reply tables ({NULL, 0}: the op has
 * no such direction). Indexed by kvs_op. */
typedef struct kvs_opdef {
	const char *name;
	spec rq, rp;
} kvs_opdef;

extern const kvs_opdef kvs__proto_ops[KVS_OP_COUNT_];

/* Sets err->code and err->msg (printf-style) and returns code. */
int kvs__proto_fail(kvs_proto_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Structural check of one whole message (kvs_proto_scan.c): exactly one
 * msgpack object, no trailing bytes, within the nesting and element limits,
 * so that msgpack-c never sizes an allocation from a hostile length. 0 or a
 * code with err filled. */
int kvs__proto_prescan(const uint8_t *p, size_t n, kvs_proto_err *err);
/* After a size or structural failure: err->id and err->op from the raw
 * top-level map, as far as it is well formed. Never allocates. */
void kvs__proto_peek_envelope(const uint8_t *p, size_t n, kvs_proto_err *err);

#endif
