/* Chunk keys: BLAKE2b-256 chained over fixed-size token chunks, seeded by the
 * namespace. key[0] = H(seed || tokens[0..C)), key[i] = H(key[i-1] ||
 * tokens[iC..(i+1)C)) with seed = H("kvside/v1/ns" || namespace) and every
 * token as 4 little-endian bytes. Stable across processes, hosts and restarts;
 * a trailing partial chunk gets no key. */
#ifndef KVS_CHUNKKEY_H
#define KVS_CHUNKKEY_H

#include <stddef.h>
#include <stdint.h>

#define KVS_DEFAULT_CHUNK_TOKENS 256

/* Writes up to max_keys keys (32 bytes each) into out and returns how many
 * were written (n_tokens / chunk_tokens, capped at max_keys), or -EINVAL for
 * chunk_tokens == 0, -EIO if libsodium cannot start. */
long kvs_chunk_keys(const char *ns, size_t ns_len, const uint32_t *tokens, size_t n_tokens,
		    uint32_t chunk_tokens, uint8_t *out, size_t max_keys);

#endif
