/* Writes the seed corpus for fuzz_decode: one valid encoding of every
 * request and reply shape (via kvs_proto_encode), plus a libFuzzer
 * dictionary of the protocol's keys and enum strings as msgpack strings.
 * Usage: fuzz_gen_seeds SEED_DIR DICT_FILE */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvs_error.h"
#include "kvs_proto.h"

static const char *dir;
static int nseeds;

static void put(const char *name, const kvs_msg *m)
{
	void *buf;
	size_t len;
	int r = kvs_proto_encode(m, &buf, &len);
	if (r) {
		fprintf(stderr, "gen_seeds: encoding %s failed: %d\n", name, r);
		exit(1);
	}
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
		perror(path);
		exit(1);
	}
	free(buf);
	nseeds++;
}

#define S(lit) {lit, sizeof(lit) - 1}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: %s SEED_DIR DICT_FILE\n", argv[0]);
		return 2;
	}
	dir = argv[1];
	if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
		perror(dir);
		return 1;
	}

	static uint8_t keys[3][KVS_KEY_BYTES];
	for (int k = 0; k < 3; k++)
		memset(keys[k], 0x10 + k, KVS_KEY_BYTES);
	static const kvs_alloc_desc allocs[2] = {
		{.token = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, .size = 1u << 30},
		{.alloc_id = {9, 9, 9}, .size = 4096},
	};
	static const kvs_group_desc groups[2] = {
		{.id = 0, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16, .blocks_per_chunk = 2,
		 .window_chunks = -1, .null_block = 0},
		{.id = 1, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 16, .blocks_per_chunk = 1,
		 .window_chunks = 2, .null_block = -1},
	};
	static const kvs_layer_desc layers[2] = {
		{.group = 0, .alloc = 0, .offset = 0, .num_blocks = 64, .block_stride = 4096,
		 .block_bytes = 4096},
		{.group = 1, .alloc = 1, .offset = 512, .num_blocks = 8, .block_stride = 512,
		 .block_bytes = 256},
	};
	static const int64_t blk0[4] = {1, 2, -1, 4}, blk1[2] = {7, 8};
	static const uint64_t jobs[2] = {5, 6};
	static const uint8_t tiers[2] = {KVS_TIER_L1, KVS_TIER_L2};
	static const kvs_job_info infos[2] = {
		{.job = 5, .state = KVS_JOB_COMMITTED, .reason = S(""), .ranks_done = 2},
		{.job = 6, .state = KVS_JOB_ABORTED, .reason = S("E_DEVICE on rank 1"), .ranks_done = 1},
	};
	static const kvs_counter counters[2] = {{S("sessions"), 2}, {S("errors.E_MISS"), 9}};
	static const uint8_t event[8] = {1, 2, 3, 4, 5, 6, 7, 8};

	kvs_msg m;
	m = (kvs_msg){.op = KVS_OP_HELLO, .id = 1, .engine = S("vllm"), .role = KVS_ROLE_WORKER,
		      .rank = 1, .world = 2, .ns = S("model:salt")};
	put("q_hello", &m);
	m = (kvs_msg){.op = KVS_OP_HEARTBEAT, .id = 2, .session = 42};
	put("q_heartbeat", &m);
	m.op = KVS_OP_BYE;
	put("q_bye", &m);
	m = (kvs_msg){.op = KVS_OP_REGISTER, .id = 3, .session = 42,
		      .device = {.type = KVS_DEV_CUDA, .uuid = {1, 2, 3}}, .allocs = allocs,
		      .n_allocs = 2, .groups = groups, .n_groups = 2, .layers = layers, .n_layers = 2};
	put("q_register", &m);
	m = (kvs_msg){.op = KVS_OP_UNREGISTER, .id = 4, .session = 42, .registration = 9};
	put("q_unregister", &m);
	m = (kvs_msg){.op = KVS_OP_LOOKUP, .id = 5, .session = 42, .keys = keys[0], .n_keys = 2,
		      .prefetch = true, .pin_ms = 100};
	put("q_lookup", &m);
	m = (kvs_msg){.op = KVS_OP_STORE, .id = 6, .session = 42, .job = 5, .keys = keys[0],
		      .n_keys = 2, .producer_event = {event, 8}, .lazy = true};
	m.blocks.n = 2;
	m.blocks.ids[0] = blk0;
	m.blocks.len[0] = 4;
	m.blocks.ids[1] = blk1;
	m.blocks.len[1] = 2;
	put("q_store", &m);
	m.op = KVS_OP_RETRIEVE;
	m.skip_tokens = 16;
	put("q_retrieve", &m);
	m = (kvs_msg){.op = KVS_OP_COMPLETE, .id = 7, .session = 42, .job = 5,
		      .status = KVS_STATUS_FAILED};
	put("q_complete", &m);
	m = (kvs_msg){.op = KVS_OP_JOB_STATUS, .id = 8, .session = 42, .jobs = jobs, .n_jobs = 2};
	put("q_job_status", &m);
	m = (kvs_msg){.op = KVS_OP_STATS, .id = 9, .session = 42};
	put("q_stats", &m);
	m = (kvs_msg){.op = KVS_OP_ADMIN, .id = 10, .session = 42, .admin_cmd = KVS_ADMIN_DRAIN,
		      .wait_ms = 5000};
	put("q_admin", &m);

	kvs_msg r = {.is_reply = true, .ok = true, .epoch = {0xe0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
							       11, 12, 13, 14, 0xef}};
	m = r;
	m.op = KVS_OP_HELLO, m.id = 1, m.session = 42, m.heartbeat_ms = 1000, m.ttl_ms = 30000;
	m.limits = (kvs_limits_desc){KVS_MAX_MSG_BYTES, KVS_MAX_KEYS, KVS_MAX_BLOCK_IDS};
	put("r_hello", &m);
	m = r;
	m.op = KVS_OP_HEARTBEAT, m.id = 2, m.pending_jobs = 3;
	put("r_heartbeat", &m);
	m = r;
	m.op = KVS_OP_BYE, m.id = 2;
	put("r_bye", &m);
	m = r;
	m.op = KVS_OP_REGISTER, m.id = 3, m.registration = 9, m.imported = 2, m.aliased = 1;
	put("r_register", &m);
	m = r;
	m.op = KVS_OP_LOOKUP, m.id = 5, m.hits = 2, m.tiers = tiers, m.n_tiers = 2;
	put("r_lookup", &m);
	m = r;
	m.op = KVS_OP_STORE, m.id = 6, m.job = 5, m.state = KVS_JOB_OPEN;
	put("r_store", &m);
	m.op = KVS_OP_COMPLETE, m.state = KVS_JOB_COMMITTED;
	put("r_complete", &m);
	m = r;
	m.op = KVS_OP_JOB_STATUS, m.id = 8, m.job_infos = infos, m.n_job_infos = 2;
	put("r_job_status", &m);
	m = r;
	m.op = KVS_OP_STATS, m.id = 9, m.counters = counters, m.n_counters = 2;
	put("r_stats", &m);
	m = r;
	m.op = KVS_OP_ADMIN, m.id = 10, m.admin_cmd = KVS_ADMIN_CLEAR, m.draining = true, m.drained = true;
	m.waited_ms = 12, m.cleared_l1 = 7, m.cleared_l2 = 9, m.kept_l1 = 1;
	put("r_admin", &m);
	m = r;
	m.op = KVS_OP_JOB_DONE, m.id = 0, m.job = 5, m.state = KVS_JOB_ABORTED;
	m.reason = (kvs_str)S("timeout");
	put("r_job_done", &m);
	m = r;
	m.op = KVS_OP_STORE, m.id = 6, m.ok = false, m.code = KVS_E_GEOMETRY;
	m.errmsg = (kvs_str)S("blocks: wrong shape");
	put("r_error", &m);

	/* dictionary: every key and enum string as a msgpack fixstr */
	static const char *const words[] = {
		"v", "op", "id", "ok", "epoch", "code", "msg", "hello", "heartbeat", "bye",
		"register", "unregister", "lookup", "store", "retrieve", "complete", "job_status",
		"stats", "job_done", "engine", "role", "rank", "world", "namespace", "session",
		"registration", "job", "device", "type", "uuid", "allocations", "token", "alloc_id",
		"size", "groups", "kind", "tokens_per_block", "blocks_per_chunk", "window_chunks",
		"null_block", "layers", "group", "alloc", "offset", "num_blocks", "block_stride",
		"block_bytes", "keys", "blocks", "prefetch", "pin_ms", "lazy", "skip_tokens",
		"status", "producer_event", "jobs", "heartbeat_ms", "ttl_ms", "limits",
		"max_msg_bytes", "max_keys", "max_block_ids", "pending_jobs", "imported", "aliased",
		"hits", "tiers", "state", "reason", "ranks_done", "counters", "scheduler", "worker",
		"host", "cuda", "attention", "recurrent", "failed", "open", "committed", "aborted",
		"unknown", "l1", "l2", "E_BADMSG", "E_MISS",
		"admin", "cmd", "timeout_ms", "drain", "resume", "clear", "draining", "drained",
		"jobs_open", "waited_ms", "cleared_l1", "cleared_l2", "kept_l1",
	};
	FILE *d = fopen(argv[2], "w");
	if (!d) {
		perror(argv[2]);
		return 1;
	}
	for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++)
		fprintf(d, "\"\\x%02x%s\"\n", 0xa0 | (unsigned)strlen(words[i]), words[i]);
	/* a few headers worth trying */
	fputs("\"\\xdd\\xff\\xff\\xff\\xff\"\n\"\\xdf\\x00\\x00\\x00\\x01\"\n\"\\xc4\\x20\"\n"
	      "\"\\xc4\\x10\"\n\"\\xcf\\xff\\xff\\xff\\xff\\xff\\xff\\xff\\xff\"\n"
	      "\"\\xd3\\x80\\x00\\x00\\x00\\x00\\x00\\x00\\x00\"\n",
	      d);
	if (fclose(d) != 0) {
		perror(argv[2]);
		return 1;
	}
	fprintf(stderr, "gen_seeds: %d seeds in %s\n", nseeds, dir);
	return 0;
}
