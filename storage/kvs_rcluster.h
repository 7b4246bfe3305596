/* kvs_rcluster: a Redis Cluster client, the foundation of the L3 tier
 * (docs/architecture.md §15). Built on hiredis's synchronous API (Debian 12
 * ships hiredis 0.14, which has no cluster support), so kvside routes by
 * slot itself: CRC16 key slots, the slot map from CLUSTER SLOTS, MOVED and
 * ASK redirections, a topology refresh after a node fails.
 *
 * Routing: a key's slot is CRC16-XMODEM(key or its {hash tag}) mod 16384;
 * the slot map gives the slot's master, and the command goes there.
 *   - MOVED slot host:port: the map's entry for that slot becomes that node
 *     and the command is sent again there.
 *   - ASK slot host:port: ASKING then the command go to that node, once; the
 *     map is not changed (the slot is being migrated).
 *   - At most KVS_RCLUSTER_MAX_REDIRECTS redirections per command, then -ELOOP.
 *   - A connection failure or a time-out marks the node down: it is not
 *     contacted for down_ms, doubled for each further failure without an
 *     answer in between, up to 8 x down_ms. The call then refreshes the map
 *     (at most once every refresh_min_ms, from one node that has not failed
 *     since its last answer) and sends the command once more if the slot
 *     now maps to another node. A command for a slot whose node is down
 *     fails at once with -EHOSTDOWN: once every node has failed, calls fail
 *     fast.
 *   - A connection that was used before and fails (the node closed it, was
 *     restarted) is reopened once before the node is called down.
 * Connections are opened lazily, one per node, and kept.
 *
 * Time: no call waits longer than op_timeout_ms in all (connects, waits,
 * redirections, a refresh and the retry included). Each single wait is also
 * bounded by connect_timeout_ms or io_timeout_ms, trimmed to what is left of
 * the call's op_timeout_ms (a call may overrun by timer and scheduling slack,
 * tens of ms at most). kvs_rcluster_open is the exception: each seed it
 * tries costs at most connect_timeout_ms + io_timeout_ms.
 *
 * Threading: a kvs_rcluster is used by one thread at a time (it is meant for
 * the L3 worker thread; never call it from the server's main loop: every call
 * blocks on the network). kvs_rcluster_get_stats alone may be called from any
 * thread at any time (the counters are atomic).
 *
 * Errors (0 is success; everything else is a kvside code, kvs_strerror):
 *   KVS_E_MISS     the key is absent (get, del)
 *   KVS_E_LIMIT    the value is larger than the caller's buffer (get)
 *   KVS_E_TIMEOUT  a wait ran out (io_timeout_ms, or what was left of the
 *                  call's op_timeout_ms): the silent node is marked down; or
 *                  the call's time was spent before it could reach a node
 *   KVS_E_AUTH     the node refused AUTH or the command (NOAUTH, WRONGPASS,
 *                  NOPERM)
 *   KVS_E_NOSPACE  the node answered OOM (maxmemory with noeviction)
 *   -EHOSTDOWN     the slot's node is down or unreachable, no node serves the
 *                  slot, or the cluster answered CLUSTERDOWN
 *   -ELOOP         more than KVS_RCLUSTER_MAX_REDIRECTS redirections
 *   -EREMOTEIO     any other error reply (its text: kvs_rcluster_last_error)
 *   -EPROTO        a reply of an unexpected type or shape
 *   -ENOMEM        out of memory
 * kvs_rcluster_last_error() says which node and what happened. */
#ifndef KVS_RCLUSTER_H
#define KVS_RCLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVS_RCLUSTER_SLOTS 16384
#define KVS_RCLUSTER_MAX_REDIRECTS 5

typedef struct kvs_rcluster_config {
	/* "HOST:PORT[,HOST:PORT...]" (an IPv6 address as [ADDR]:PORT); the
	 * string is copied. Required. */
	const char *seeds;
	const char *user;     /* ACL user for AUTH; NULL: AUTH with the password alone */
	const char *password; /* NULL or "": no AUTH. Sent in clear (no TLS) */
	uint32_t connect_timeout_ms; /* one TCP connect (default 500) */
	uint32_t io_timeout_ms;      /* one wait for a node to take or answer a request (default 1000) */
	uint32_t op_timeout_ms;      /* the longest one call may take, all included (default 2 x io_timeout_ms) */
	uint32_t refresh_min_ms;     /* least time between two topology refreshes (default 100) */
	uint32_t down_ms;            /* a failed node is not contacted for this long, at first (default 1000) */
} kvs_rcluster_config;

/* Fills in the defaults (seeds, user and password NULL). A field left 0 in
 * a config given to kvs_rcluster_open also means its default. */
void kvs_rcluster_config_defaults(kvs_rcluster_config *cfg);

typedef struct kvs_rcluster kvs_rcluster;

/* Reads CLUSTER SLOTS from the first seed that answers (seeds in the order
 * given) and builds the slot map. Nothing is copied from cfg's strings after
 * the call. Returns 0 and *ret (close with kvs_rcluster_close), or, with a
 * sentence in err (always NUL-terminated when errlen > 0; err may be NULL)
 * and *ret untouched:
 *   -EINVAL      seeds missing or malformed, a time-out out of range
 *   KVS_E_AUTH   a seed refused the credentials (other seeds are not tried)
 *   -EHOSTDOWN   no seed answered (err gives each seed's failure)
 *   -EPROTO      a seed answered but not with a slot map (not in cluster mode)
 *   -ENOMEM */
int kvs_rcluster_open(const kvs_rcluster_config *cfg, kvs_rcluster **ret, char *err, size_t errlen);
/* Closes every connection and frees c. Accepts NULL. */
void kvs_rcluster_close(kvs_rcluster *c);

/* SET key val (no expiry). Keys and values are binary (any bytes, any
 * length; klen 0 is a valid key). Returns 0 or an error above. A failed SET
 * may or may not have been applied. */
int kvs_rcluster_set(kvs_rcluster *c, const void *key, size_t klen, const void *val, size_t vlen);

/* GET key into buf (cap bytes). Returns 0 and *ret_len; KVS_E_MISS if the key
 * is absent; KVS_E_LIMIT if the value is larger than cap: *ret_len then holds
 * its size and buf is untouched (the value did cross the network: Redis has
 * no way to send part of it). Other errors leave buf and *ret_len
 * untouched. */
int kvs_rcluster_get(kvs_rcluster *c, const void *key, size_t klen, void *buf, size_t cap, size_t *ret_len);

/* Which of n keys exist: out[i] = true if keys[i] (klens[i] bytes) exists.
 * One pipelined round per node (keys grouped by the node of their slot: all
 * requests sent, then the replies collected), more rounds only for
 * redirected or retried keys. Returns 0 when every key got an answer;
 * otherwise the first error met, with out[i] = false for the keys without an
 * answer (a caller treats them as misses). The call's time bound covers all
 * rounds. */
int kvs_rcluster_exists_many(kvs_rcluster *c, const void *const *keys, const size_t *klens, size_t n,
			     bool *out);

/* The first hlen bytes (hlen > 0) of each of n values: GETRANGE key 0
 * hlen-1, pipelined as exists_many (one round per node, redirections and
 * retries as there). bufs[i] (hlen bytes each) receives them and lens[i]
 * how many came (0: the key is absent or its value empty, or no answer).
 * Returns 0 when every key got an answer, else the first error met (the
 * keys without an answer have lens[i] 0: a caller treats them as misses). */
int kvs_rcluster_head_many(kvs_rcluster *c, const void *const *keys, const size_t *klens, size_t n,
			   size_t hlen, void *const *bufs, size_t *lens);

/* GET key scattered over iovcnt buffers in order (a header into one, the
 * data into another). As kvs_rcluster_get: 0 and *ret_len (the bytes beyond
 * the value's end are untouched); KVS_E_MISS; KVS_E_LIMIT with *ret_len the
 * value's size when it exceeds the buffers' total, nothing written. */
int kvs_rcluster_getv(kvs_rcluster *c, const void *key, size_t klen, const struct iovec *iov, int iovcnt,
		      size_t *ret_len);

/* DEL key. Returns 0 if it was deleted, KVS_E_MISS if it was absent. */
int kvs_rcluster_del(kvs_rcluster *c, const void *key, size_t klen);

/* Reads the slot map again now (from any node not down), ignoring
 * refresh_min_ms. Returns 0, -EHOSTDOWN (no node answered), KVS_E_TIMEOUT,
 * -EPROTO, -ENOMEM. On failure the map is unchanged. */
int kvs_rcluster_refresh(kvs_rcluster *c);

/* The key's slot (Redis Cluster spec: CRC16-XMODEM mod 16384 of the key, or
 * of the part between the first '{' and the first '}' after it when that part
 * is not empty). Pure; any thread. */
uint16_t kvs_rcluster_keyslot(const void *key, size_t klen);
/* CRC16-XMODEM (poly 0x1021, init 0) as the spec defines it; exposed for the
 * unit test's vectors. */
uint16_t kvs__rcluster_crc16(const void *buf, size_t len);

/* "host:port" of the slot's master in the current map, into buf (cap bytes,
 * NUL-terminated). Returns 0, -ENOENT (no node serves the slot as far as the
 * map knows), -ENOSPC (buf too small). No network. */
int kvs_rcluster_slot_node(const kvs_rcluster *c, uint16_t slot, char *buf, size_t cap);

/* Text of the most recent failure ("127.0.0.1:7001: Connection refused",
 * "MOVED loop: 6 redirections for slot 42", a node's error reply), or "" if
 * none. Owned by c; valid until the next call on c. */
const char *kvs_rcluster_last_error(const kvs_rcluster *c);

typedef struct kvs_rcluster_stats {
	uint64_t calls;          /* set/get/del/exists_many/refresh calls */
	uint64_t commands;       /* commands sent to nodes (retries and redirections included; ASKING and AUTH not) */
	uint64_t bytes_out;      /* key and value bytes sent */
	uint64_t bytes_in;       /* value bytes received */
	uint64_t moved, ask;     /* redirections followed */
	uint64_t refreshes;      /* slot maps read (open included) */
	uint64_t refresh_failures; /* refreshes for which no node answered */
	uint64_t connects;       /* connections opened */
	uint64_t nodes_down;     /* times a node was marked down */
	uint64_t errors;         /* calls that failed (KVS_E_MISS and KVS_E_LIMIT are answers, not failures) */
	uint64_t timeouts;       /* waits that ran out */
	uint64_t nodes;          /* nodes known now (masters and replicas) */
} kvs_rcluster_stats;
/* A snapshot of the counters; any thread. */
void kvs_rcluster_get_stats(const kvs_rcluster *c, kvs_rcluster_stats *st);

#endif
