/* Chained BLAKE2b-256 chunk keys (libsodium crypto_generichash). */
#include "kvs_chunkkey.h"

#include <errno.h>
#include <sodium.h>
#include <string.h>

long kvs_chunk_keys(const char *ns, size_t ns_len, const uint32_t *tokens, size_t n_tokens,
		    uint32_t chunk_tokens, uint8_t *out, size_t max_keys)
{
	if (chunk_tokens == 0)
		return -EINVAL;
	if (sodium_init() < 0)
		return -EIO;
	uint8_t prev[32];
	crypto_generichash_state st;
	static const char tag[] = "kvside/v1/ns";
	crypto_generichash_init(&st, NULL, 0, 32);
	crypto_generichash_update(&st, (const unsigned char *)tag, sizeof(tag) - 1);
	crypto_generichash_update(&st, (const unsigned char *)ns, ns_len);
	crypto_generichash_final(&st, prev, 32);
	size_t n = n_tokens / chunk_tokens;
	if (n > max_keys)
		n = max_keys;
	uint8_t buf[1024];
	for (size_t i = 0; i < n; i++) {
		crypto_generichash_init(&st, NULL, 0, 32);
		crypto_generichash_update(&st, prev, 32);
		const uint32_t *t = tokens + i * chunk_tokens;
		for (size_t j = 0; j < chunk_tokens;) {
			size_t k = 0;
			for (; k < sizeof(buf) / 4 && j < chunk_tokens; k++, j++) {
				uint32_t v = t[j];
				buf[4 * k] = (uint8_t)v;
				buf[4 * k + 1] = (uint8_t)(v >> 8);
				buf[4 * k + 2] = (uint8_t)(v >> 16);
				buf[4 * k + 3] = (uint8_t)(v >> 24);
			}
			crypto_generichash_update(&st, buf, 4 * k);
		}
		crypto_generichash_final(&st, prev, 32);
		memcpy(out + 32 * i, prev, 32);
	}
	return (long)n;
}
