/* kvs_l3: the shared tier. Objects written here are seen by every kvside
 * server using the same store (a Redis Cluster today), so a prefix cached on
 * one machine is a hit on the others (docs/architecture.md §15).
 *
 * An object is one self-checking record (storage/kvs_record.h: the header
 * binds the bytes to the full object key, the layout's geometry fingerprint
 * and the data's checksum) under the key prefix + the 64-byte object key. A
 * record larger than part_bytes is split: part 0 (the header and the first
 * part_bytes - 96 data bytes) under the key, part k under the key + "#k",
 * and the header's flags hold log2(part_bytes) (0: not split). Part 0 is
 * written last, so it is the commit point. A record whose header does not
 * match (magic, version, length, key, geometry) or whose checksum fails is a
 * miss, counted, deleted, and never served.
 *
 * Threads: the owner (the server's main loop) calls every function here;
 * none of them waits on the network. Three worker threads, each with its own
 * backend connection, do the I/O: the prober (lookups' header checks), the
 * reader (promotions) and the writer (write-behind). They report through the
 * completion queue: running the tier's item hands each completion to
 * on_done on the owner thread. A worker whose store cannot be reached fails
 * its requests at once and tries to connect again at most once a second.
 *
 * Ownership: data handed to kvs_l3_write_in and dst handed to kvs_l3_read
 * must stay valid until the completion is reported (the caller pins or
 * reserves them); keys are copied. */
#ifndef KVS_L3_H
#define KVS_L3_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvs_cq.h"
#include "kvs_l1.h"

struct kvs_l3_done;
struct kvs_l3_backend;

enum kvs_l3_write_policy {
	KVS_L3_WRITE_ALL,        /* every committed object is written behind */
	KVS_L3_WRITE_NONE,       /* read-only: this server never writes */
	KVS_L3_WRITE_SECOND_HIT, /* an object is written at its second use (store or lookup hit) */
};

typedef struct kvs_l3_config {
	const struct kvs_l3_backend *backend; /* kvs_l3_redis_backend() */
	const char *seeds;        /* backend address list */
	const char *user, *password;
	const char *prefix;       /* key prefix (copied), at most 63 bytes */
	uint32_t timeout_ms;      /* one wait for a node; one call at most twice that */
	uint64_t part_bytes;      /* largest value: a power of two, 64 KiB .. 512 MiB */
	uint32_t queue_max;       /* pending writes before the oldest group's tail is dropped */
	uint64_t queue_max_bytes;
	int write_policy;         /* enum kvs_l3_write_policy */
	struct kvs_cq *cq;
	void (*on_done)(void *arg, const struct kvs_l3_done *d);
	void *done_arg;
} kvs_l3_config;

void kvs_l3_config_defaults(kvs_l3_config *cfg);

typedef struct kvs_l3 kvs_l3;

/* Checks the configuration and starts the workers; connecting is theirs
 * (open does not wait for the store). Returns 0, or -EINVAL with a sentence
 * in err (a bad prefix, part size, no backend), or -ENOMEM. */
int kvs_l3_open(const kvs_l3_config *cfg, kvs_l3 **ret, char *err, size_t errlen);
/* Stops the workers (a request in progress ends within its time-out; queued
 * ones are dropped without completion: the owner releases what they hold
 * only if it reaps first, as at shutdown it does not care) and frees. Accepts
 * NULL. */
void kvs_l3_close(kvs_l3 *l3);

enum kvs_l3_op { KVS_L3_PROBE = 1, KVS_L3_READ = 2, KVS_L3_WRITE = 3 };

typedef struct kvs_l3_done {
	int op;         /* enum kvs_l3_op */
	kvs_objkey key; /* read, write */
	int result;     /* 0; read: KVS_E_MISS (absent or refused record) or a store error;
	                 * write: KVS_E_NOSPACE (dropped), a store error; probe: the first store error */
	void *cookie;   /* as given */
	uint32_t n;            /* probe: keys asked */
	const bool *present;   /* probe: present[i] for each key (valid during the callback) */
} kvs_l3_done;

/* Asks which of n objects the store holds with this geometry and length
 * (each record's header, not its data). Keys are copied. 0 or -ENOMEM. */
int kvs_l3_probe(kvs_l3 *l3, const kvs_objkey *keys, const uint64_t *geoms, const uint64_t *lens, uint32_t n,
		 void *cookie);
/* Probes waiting for the prober (a lookup asks L3 only below a bound). */
uint32_t kvs_l3_probe_backlog(kvs_l3 *l3);
/* Reads the object into dst (exactly len bytes), verified. 0 or -ENOMEM. */
int kvs_l3_read(kvs_l3 *l3, const kvs_objkey *key, uint64_t geom, void *dst, uint64_t len, void *cookie);
/* Queues a write-behind of len bytes at data, as member idx of group (a
 * job; 0 = none): over the queue's bounds, the oldest group loses its highest
 * idx first (completed with KVS_E_NOSPACE, counted). Writes of one group are
 * queued together. 0 or -ENOMEM (nothing queued). */
int kvs_l3_write_in(kvs_l3 *l3, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		    void *cookie, uint64_t group, uint32_t idx);
/* Drops queued writes (as above) until bytes are freed or cap are dropped;
 * their cookies go to cookies[], with no completion. Returns how many. */
uint32_t kvs_l3_shed(kvs_l3 *l3, uint64_t bytes, void **cookies, uint32_t cap);

/* Owner-thread memory of what the store holds, learned from probes, reads
 * and this server's own writes (bounded): does the store hold key with this
 * geometry and length, as far as known? A read that finds the record absent
 * or unusable forgets it; a read that fails otherwise (its node down or
 * failing over, a time-out) does not, unless the object's reads have failed
 * so for a minute — longer than a cluster failover. */
bool kvs_l3_known(kvs_l3 *l3, const kvs_objkey *key, uint64_t geom, uint64_t len);
/* The write policy's verdict for a use of key (a store's commit or a lookup
 * hit): write it behind now? all: yes; none: no; second-hit: yes at its
 * second use (uses are remembered in a bounded table), not when known. */
bool kvs_l3_admit(kvs_l3 *l3, const kvs_objkey *key);

typedef struct kvs_l3_stats {
	uint64_t connected;     /* workers whose connection's last call reached the store (3 = all) */
	uint64_t probes, probe_keys, probe_hits, probe_errors;
	uint64_t reads, read_bytes, read_misses, read_errors;
	uint64_t corrupt;       /* records refused: header, key, geometry, length, checksum */
	uint64_t writes, write_bytes, write_errors, write_drops;
	uint64_t queue_depth, queue_bytes; /* write-behind queue */
	uint64_t probe_queue;              /* probes waiting for the prober */
	uint64_t read_ns, write_ns, probe_ns; /* time in the store, summed */
	uint64_t moved, ask, refreshes, nodes_down, timeouts; /* the backend's, all connections */
} kvs_l3_stats;
void kvs_l3_get_stats(kvs_l3 *l3, kvs_l3_stats *st);

/* ---- the backend seam ---------------------------------------------------- */

/* A store the tier runs on. Every call is made by one worker thread on its
 * own connection and may block within the configured time-outs; codes are
 * kvside's (KVS_E_MISS, KVS_E_LIMIT, KVS_E_TIMEOUT, -EHOSTDOWN ...). */
typedef struct kvs_l3_backend_stats {
	uint64_t moved, ask, refreshes, nodes_down, timeouts;
} kvs_l3_backend_stats;

typedef struct kvs_l3_backend {
	const char *name;
	int (*open)(const kvs_l3_config *cfg, void **conn, char *err, size_t errlen);
	void (*close)(void *conn);
	int (*put)(void *conn, const void *key, size_t klen, const void *val, size_t vlen);
	/* the value scattered over two buffers; KVS_E_LIMIT if it exceeds both */
	int (*get2)(void *conn, const void *key, size_t klen, void *a, size_t alen, void *b, size_t blen,
		    size_t *ret_len);
	/* the first hlen bytes of n values (lens[i] 0: absent) */
	int (*head_many)(void *conn, const void *const *keys, const size_t *klens, size_t n, size_t hlen,
			 void *const *bufs, size_t *lens);
	int (*del)(void *conn, const void *key, size_t klen);
	const char *(*last_error)(void *conn);
	void (*stats)(void *conn, kvs_l3_backend_stats *st); /* any thread */
} kvs_l3_backend;

/* The Redis Cluster backend (kvs_rcluster), or NULL in a build without
 * hiredis. */
const kvs_l3_backend *kvs_l3_redis_backend(void);

#endif
