/* libFuzzer harnesses for the byte-parsing surfaces beside the message
 * decoder (docs/security.md): one source, one target per surface, chosen by
 * FUZZ_<NAME> at compile time (tests/fuzz/meson.build builds each):
 *
 *   frames  - job-lane framing (common/kvs_frame.c): the input is the byte
 *             stream a lane peer writes, fed in pieces of varying size;
 *   broker  - the fd broker's request record (kvs_broker_rec_unpack): a
 *             record read must pack back to the same bytes;
 *   keys    - authorized-keys lines (server/keyline.c): the input is a file,
 *             split at newlines, every line parsed; a key read must be the
 *             z85 of its bytes;
 *   replay  - the KV-event replay request (kvs_kvevents_replay_request):
 *             the input split into frames by a length byte each;
 *   config  - the YAML configuration (server/config.c, kvs_config_load): the
 *             input is the file.
 *
 * Anything but a clean result or a clean refusal aborts (a crash for
 * libFuzzer); ASan and UBSan catch the rest. */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void require(bool ok, const char *what)
{
	if (!ok) {
		fprintf(stderr, "fuzz: %s\n", what);
		abort();
	}
}

#if defined(FUZZ_FRAMES)
#include "kvs_frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	/* the reader's buffer as kvs_frame_recv leaves it, pieces of the input
	 * appended in turn (the first byte picks the piece size) */
	kvs_frame_in in = {0};
	size_t piece = size ? (size_t)data[0] % 97 + 1 : 1, at = size ? 1 : 0;
	int r = 0;
	while (at < size && r >= 0) {
		if (!in.p) {
			in.p = malloc(KVS_FRAME_START);
			require(in.p != NULL, "malloc");
			in.cap = KVS_FRAME_START;
		}
		size_t room = in.cap - in.len, n = size - at < piece ? size - at : piece;
		if (n > room)
			n = room;
		memcpy(in.p + in.len, data + at, n);
		in.len += n, at += n;
		const uint8_t *body;
		uint32_t blen;
		while ((r = kvs_frame_next(&in, &body, &blen)) == 1) {
			require(blen >= 1 && blen <= KVS_FRAME_MAX, "frame length outside 1..max");
			require(body >= in.p && body + blen <= in.p + in.len, "frame body outside the buffer");
		}
		require(r == 0 || r == -EPROTO, "kvs_frame_next: unexpected result");
		if (r == 0) {
			require(in.pos <= in.len && in.len <= in.cap, "buffer invariants");
			kvs_frame_compact(&in);
			require(in.pos == 0, "compact leaves pos 0");
		}
	}
	kvs_frame_free(&in);
	return 0;
}

#elif defined(FUZZ_BROKER)
#include "kvs_error.h"
#include "kvs_fdpass.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	uint32_t n = 12345;
	int r = kvs_broker_rec_unpack(data, size, e, &n);
	if (r) {
		require(r == KVS_E_BADMSG || r == KVS_E_VERSION, "unpack: not a project error");
		require(n == 12345, "unpack failed but wrote the count");
		return 0;
	}
	require(n >= 1 && n <= KVS_BROKER_MAX_FDS, "unpack: count out of range");
	if (size != KVS_BROKER_V1_BYTES) { /* version 2 packs back to the same bytes */
		uint8_t out[KVS_BROKER_REC_MAX];
		size_t len = kvs_broker_rec_pack(e, n, out);
		require(len == size && memcmp(out, data, size) == 0, "v2 record does not pack back");
	}
	return 0;
}

#elif defined(FUZZ_KEYS)
#include <zmq.h>

#include "keyline.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *buf = malloc(size + 1);
	require(buf != NULL, "malloc");
	memcpy(buf, data, size);
	buf[size] = '\0';
	for (char *line = buf, *next; line; line = next) {
		next = strchr(line, '\n');
		if (next)
			*next++ = '\0';
		char *copy = strdup(line);
		require(copy != NULL, "strdup");
		uint8_t pub[32];
		bool admin = false;
		int r = kvs_keyline_parse(line, pub, &admin);
		require(r >= -1 && r <= 1, "parse: result");
		if (r == 1) {
			/* the key is a 40-character word of the line, and its z85 */
			char z[KVS_KEY_Z85 + 1];
			require(zmq_z85_encode(z, pub, 32) != NULL, "z85 encode");
			require(strstr(copy, z) != NULL, "key read is not in the line");
			const char *hash = strstr(copy, z);
			for (const char *p = copy; p < hash; p++)
				require(*p == ' ' || *p == '\t' || *p == '\r', "text before the key");
			require(!admin || strstr(hash, "admin") != NULL, "admin without the word");
		}
		free(copy);
	}
	free(buf);
	return 0;
}

#elif defined(FUZZ_REPLAY)
#include "kvs_error.h"
#include "kvs_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const uint8_t *frames[8];
	size_t lens[8];
	uint32_t n = 0;
	for (size_t at = 0; at < size && n < 8;) {
		size_t len = data[at++];
		if (len > size - at)
			len = size - at;
		frames[n] = data + at, lens[n++] = len;
		at += len;
	}
	uint64_t start = 7;
	int r = kvs_kvevents_replay_request(frames, lens, n, &start);
	require(r == 0 || r == KVS_E_BADMSG, "replay request: result");
	if (r == 0) {
		require(n >= 1 && lens[n - 1] == 8, "accepted a request without an 8-byte start");
		uint64_t v = 0;
		for (int i = 0; i < 8; i++)
			v = v << 8 | frames[n - 1][i];
		require(v == start, "start is not the big-endian frame");
	} else {
		require(start == 7, "refused but wrote start");
	}
	return 0;
}

#elif defined(FUZZ_CONFIG)
#include <sys/mman.h>

#include "config.h"
#include "server.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static int fd = -1;
	if (fd < 0)
		fd = memfd_create("fuzz-config", MFD_CLOEXEC);
	require(fd >= 0, "memfd");
	require(ftruncate(fd, 0) == 0 && pwrite(fd, data, size, 0) == (ssize_t)size, "write the file");
	char path[64];
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	kvs_server_config cfg;
	memset(&cfg, 0, sizeof(cfg));
	char err[512];
	err[0] = '\0';
	int r = kvs_config_load(&cfg, path, err, sizeof(err));
	require(r == 0 || (r < 0 && err[0]), "a refusal without a message");
	if (r == 0) {
		(void)kvs_config_check(&cfg, err, sizeof(err));
		for (const kvs_config_key *k = kvs_config_keys(); k->name; k++) {
			char v[700];
			kvs_config_format(&cfg, k, v, sizeof(v));
			require(memchr(v, '\0', sizeof(v)) != NULL, "format: unterminated");
		}
	}
	return 0;
}

#else
#error "define one of FUZZ_FRAMES, FUZZ_BROKER, FUZZ_KEYS, FUZZ_REPLAY, FUZZ_CONFIG"
#endif
