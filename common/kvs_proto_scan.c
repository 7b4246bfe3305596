/* Protocol v1 structural pre-scan: walks the raw bytes of a message before
 * msgpack-c sees them (limits, nesting, truncation, trailing bytes), and reads
 * the envelope's id and op from bytes that failed it, so that the error reply
 * still names the request it answers. */
#include <string.h>

#include "kvs_error.h"
#include "kvs_proto_impl.h"

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
			return kvs__proto_fail(err, KVS_E_BADMSG, "truncated message");
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
				return kvs__proto_fail(err, KVS_E_BADMSG, "invalid msgpack byte 0x%02x", b);
			}
			if (hdr) {
				if (n - pos < (size_t)hdr)
					return kvs__proto_fail(err, KVS_E_BADMSG, "truncated message");
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
				return kvs__proto_fail(err, KVS_E_BADMSG, "truncated message (container of %llu items)",
					    (unsigned long long)items);
			total += items;
			if (total > 2ull * KVS_MAX_BLOCK_IDS)
				return kvs__proto_fail(err, KVS_E_LIMIT, "too many elements in message");
			if (depth >= KVS_MAX_DEPTH)
				return kvs__proto_fail(err, KVS_E_LIMIT, "nesting deeper than %d", KVS_MAX_DEPTH);
			stack[depth++] = need;
			need = items;
		} else {
			if (len > n - pos)
				return kvs__proto_fail(err, KVS_E_BADMSG, "truncated message");
			pos += (size_t)len;
		}
	}
	*ppos = pos;
	return 0;
}

/* One whole message: exactly one object, no trailing bytes. */
int kvs__proto_prescan(const uint8_t *p, size_t n, kvs_proto_err *err)
{
	size_t pos = 0;
	int r = scan_one(p, n, &pos, err);
	if (r)
		return r;
	if (pos != n)
		return kvs__proto_fail(err, KVS_E_BADMSG, "%zu trailing bytes after the message", n - pos);
	return 0;
}

/* After a size or structural failure: reads `id` (unsigned) and `op` (string)
 * from the top-level map as far as its pairs are well formed, so that the
 * error reply still names the request it answers (a reply with id 0 would
 * look like a push and leave the sender waiting). Never allocates; O(n). */
void kvs__proto_peek_envelope(const uint8_t *p, size_t n, kvs_proto_err *err)
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
