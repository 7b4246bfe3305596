/* libFuzzer harness for the protocol v1 decoder (common/kvs_proto_*.c).
 *
 * Every input is decoded both as a request and as a reply/push. A failure
 * must be a project error code with err filled and nothing left to free. A
 * success must re-encode, the re-encoding must decode again, and encoding
 * that second decode must give the same bytes (the encoder is canonical).
 * Anything else aborts, which libFuzzer reports as a crash. Built with
 * -fsanitize=fuzzer,address,undefined by tests/fuzz/meson.build. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvs_error.h"
#include "kvs_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void require(bool ok, const char *what, int rep)
{
	if (!ok) {
		fprintf(stderr, "fuzz_decode (%s): %s\n", rep ? "reply" : "request", what);
		abort();
	}
}

static const char *const names[] = {
	"session", "engine", "role", "rank", "world", "namespace", "keys", "blocks", "jobs",
	"prefetch", "pin_ms", "lazy", "skip_tokens", "producer_event", "counters", "nonexistent",
};

static void one(const uint8_t *data, size_t size, bool rep)
{
	kvs_msg m;
	kvs_proto_err e;
	int r = kvs_proto_decode(data, size, rep, &m, &e);
	if (r) {
		require(kvs_error_is_project(r), "decode returned a non-project code", rep);
		require(e.code == r, "err.code differs from the return value", rep);
		require(m.zone_ == NULL, "failed decode left memory behind", rep);
		require(memchr(e.msg, '\0', sizeof(e.msg)) != NULL, "err.msg unterminated", rep);
		require(e.msg[0] != '\0', "err.msg empty", rep);
		return;
	}
	require(e.code == 0, "err.code set on success", rep);
	require(m.op > KVS_OP_NONE && m.op < KVS_OP_COUNT_, "decoded op out of range", rep);
	require(m.is_reply == rep, "is_reply not set from the direction", rep);
	require(m.v == KVS_PROTO_VERSION, "wrong version accepted", rep);
	require(rep || m.op != KVS_OP_JOB_DONE, "job_done accepted as a request", rep);
	require(m.n_keys <= KVS_MAX_KEYS && m.n_groups <= KVS_MAX_GROUPS &&
			m.blocks.n <= KVS_MAX_GROUPS && m.n_allocs <= KVS_MAX_ALLOCS &&
			m.n_layers <= KVS_MAX_LAYERS && m.n_jobs <= KVS_MAX_JOBS_QUERY &&
			m.n_job_infos <= KVS_MAX_JOBS_QUERY && m.n_counters <= KVS_MAX_COUNTERS &&
			m.n_tiers <= KVS_MAX_KEYS,
		"array over its limit accepted", rep);
	require(m.engine.len <= KVS_MAX_STR && m.ns.len <= KVS_MAX_STR && m.reason.len <= KVS_MAX_STR,
		"string over its limit accepted", rep);
	uint64_t total = 0;
	for (uint32_t g = 0; g < m.blocks.n; g++) {
		total += m.blocks.len[g];
		for (uint32_t i = 0; i < m.blocks.len[g]; i++)
			(void)*(volatile const int64_t *)&m.blocks.ids[g][i];
	}
	require(total <= KVS_MAX_BLOCK_IDS, "too many block ids accepted", rep);
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		(void)kvs_msg_has(&m, names[i]);

	void *b1 = NULL, *b2 = NULL;
	size_t n1 = 0, n2 = 0;
	require(kvs_proto_encode(&m, &b1, &n1) == 0, "re-encoding a decoded message failed", rep);
	kvs_msg m2;
	r = kvs_proto_decode(b1, n1, rep, &m2, &e);
	if (r)
		fprintf(stderr, "fuzz_decode: %s: %s\n", kvs_error_name(r), e.msg);
	require(r == 0, "decoding the re-encoding failed", rep);
	require(m2.op == m.op && m2.id == m.id && m2.ok == m.ok && m2.code == m.code,
		"envelope changed in the round trip", rep);
	require(kvs_proto_encode(&m2, &b2, &n2) == 0, "second encoding failed", rep);
	require(n1 == n2 && memcmp(b1, b2, n1) == 0, "encoding is not canonical", rep);
	kvs_msg_clear(&m2);
	kvs_msg_clear(&m);
	require(m.zone_ == NULL && m.op == KVS_OP_NONE, "kvs_msg_clear did not zero", rep);
	free(b1);
	free(b2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	one(data, size, false);
	one(data, size, true);
	return 0;
}
