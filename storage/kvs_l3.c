/* The shared L3 tier: queues, the three workers, records; see kvs_l3.h. */
#include "kvs_l3.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define KVS_LOG_COMPONENT "l3"
#include "kvs_error.h"
#include "kvs_htab.h"
#include "kvs_log.h"
#include "kvs_record.h"
#include "kvs_time.h"

#define HDR KVS_RECORD_HDR_BYTES
#define MAX_PREFIX 63
#define MAX_KEY (MAX_PREFIX + 64 + 12)
#define RETRY_MS 1000
#define KNOWN_MAX (1u << 18) /* remembered objects: 256 K, the oldest forgotten first */
/* A known object whose reads keep failing for reasons other than its
 * absence (its node down, a time-out, a cluster error) is forgotten when
 * they have failed for this long: longer than a Redis Cluster failover
 * (cluster-node-timeout, 15 s by default, plus the election), so that a
 * failover never makes this server forget what the promoted replica holds. */
#define SUSPECT_FORGET_MS 60000
#define SEEN_BITS 16  /* second-hit admission: first uses remembered */

enum { W_PROBE, W_READ, W_WRITE, N_WORKERS };

/* A request. Invariant: on exactly one of the lists or in one worker's
 * hands, until the owner has taken its completion. */
typedef struct item {
	struct item *prev, *next;
	int op;
	kvs_objkey key;
	uint64_t geom, len;
	const void *src; /* write */
	void *dst;       /* read */
	void *cookie;
	uint64_t group;  /* write */
	uint32_t idx;
	int result;
	/* probe */
	uint32_t n;
	kvs_objkey *keys;
	uint64_t *geoms, *lens;
	bool *present;
} item;

typedef struct list {
	item *head, *tail;
	uint64_t n, bytes;
} list;

typedef struct worker {
	kvs_l3 *l3;
	int kind;
	pthread_t th;
	bool started;
	void *_Atomic conn; /* the backend connection, NULL until one opened */
	atomic_bool healthy; /* its last call reached the store (l3_connected) */
	uint64_t next_try_ms;
	char err[256];      /* why the last connect failed */
} worker;

/* An object the store is known to hold (owner thread). Invariant: in the
 * known table iff used (ring slots in insertion order; the oldest is
 * reused when the ring is full). */
typedef struct known_ent {
	kvs_objkey key; /* table key */
	uint64_t geom, len;
	uint64_t failing_since_ms; /* its first read failure (not an absence) since it was last confirmed; 0: none */
	bool used;
} known_ent;

struct kvs_l3 {
	kvs_l3_config cfg;
	char prefix[MAX_PREFIX + 1];
	size_t prefix_len;
	char *seeds, *user, *password; /* copies */
	pthread_mutex_t mu;
	pthread_cond_t cv[N_WORKERS];
	list q[N_WORKERS]; /* probes, reads, writes */
	list done;
	bool stop;
	worker w[N_WORKERS];
	kvs_cq_item ready;        /* posted to cfg.cq when done has entries */
	atomic_bool ready_posted;
	kvs_htab *known;    /* known_ent by key, owner thread */
	known_ent *ring;    /* KNOWN_MAX entries */
	uint32_t ring_next; /* the slot the next new entry takes */
	uint64_t *seen;   /* owner thread */
	kvs_l3_stats st;  /* guarded by mu */
};

static void list_push(list *l, item *it, uint64_t bytes)
{
	it->next = NULL;
	it->prev = l->tail;
	if (l->tail)
		l->tail->next = it;
	else
		l->head = it;
	l->tail = it;
	l->n++;
	l->bytes += bytes;
}

static void list_unlink(list *l, item *it, uint64_t bytes)
{
	if (it->prev)
		it->prev->next = it->next;
	else
		l->head = it->next;
	if (it->next)
		it->next->prev = it->prev;
	else
		l->tail = it->prev;
	it->prev = it->next = NULL;
	l->n--;
	l->bytes -= bytes;
}

static uint64_t item_bytes(const item *it) { return it->op == KVS_L3_WRITE ? it->len : 0; }

static void item_free(item *it)
{
	if (!it)
		return;
	free(it->keys);
	free(it->geoms);
	free(it->lens);
	free(it->present);
	free(it);
}

/* ---- keys and records ------------------------------------------------------ */

/* The store's key of part `part` of key: prefix, the 64 key bytes, "#part". */
static size_t store_key(const kvs_l3 *l3, const kvs_objkey *key, uint32_t part, char *out)
{
	memcpy(out, l3->prefix, l3->prefix_len);
	memcpy(out + l3->prefix_len, key, sizeof(*key));
	size_t n = l3->prefix_len + sizeof(*key);
	if (part)
		n += (size_t)snprintf(out + n, 12, "#%u", part);
	return n;
}

static unsigned log2u(uint64_t x)
{
	unsigned r = 0;
	while (x > 1) {
		x >>= 1;
		r++;
	}
	return r;
}

/* ---- completions (owner thread) -------------------------------------------- */

static uint64_t key_fp(const kvs_objkey *key)
{
	uint64_t fp = XXH3_64bits(key, sizeof(*key));
	return fp ? fp : 1;
}

static void know(kvs_l3 *l3, const kvs_objkey *key, uint64_t geom, uint64_t len)
{
	known_ent *e = kvs_htab_get(l3->known, key);
	if (!e) {
		e = &l3->ring[l3->ring_next];
		l3->ring_next = (l3->ring_next + 1) % KNOWN_MAX;
		if (e->used)
			kvs_htab_del(l3->known, &e->key);
		e->key = *key;
		e->used = kvs_htab_put(l3->known, e) == 0;
	}
	e->geom = geom;
	e->len = len;
	e->failing_since_ms = 0;
}

static void forget(kvs_l3 *l3, const kvs_objkey *key)
{
	known_ent *e = kvs_htab_del(l3->known, key);
	if (e)
		e->used = false;
}

/* A read of key failed. Absent or refused (KVS_E_MISS): forgotten. Any
 * other failure (the node down or failing over, a time-out, a cluster
 * error) says nothing of the record: kept, unless reads have failed for
 * SUSPECT_FORGET_MS (issue 33 #2). */
static void read_failed(kvs_l3 *l3, const kvs_objkey *key, int result)
{
	known_ent *e = kvs_htab_get(l3->known, key);
	if (!e)
		return;
	uint64_t now = kvs_now_ms();
	if (result != KVS_E_MISS && !e->failing_since_ms)
		e->failing_since_ms = now ? now : 1;
	else if (result == KVS_E_MISS || now - e->failing_since_ms >= SUSPECT_FORGET_MS)
		forget(l3, key);
}

bool kvs_l3_known(kvs_l3 *l3, const kvs_objkey *key, uint64_t geom, uint64_t len)
{
	const known_ent *e = kvs_htab_get(l3->known, key);
	return e && e->geom == geom && e->len == len;
}

bool kvs_l3_admit(kvs_l3 *l3, const kvs_objkey *key)
{
	if (l3->cfg.write_policy == KVS_L3_WRITE_ALL)
		return true;
	if (l3->cfg.write_policy == KVS_L3_WRITE_NONE)
		return false;
	if (kvs_htab_get(l3->known, key))
		return false; /* already there */
	uint64_t fp = key_fp(key);
	uint64_t *s = &l3->seen[fp & ((1u << SEEN_BITS) - 1)];
	if (*s == fp) {
		*s = 0;
		return true;
	}
	*s = fp;
	return false;
}

/* Runs on the owner thread: every completion to on_done. */
static void l3_ready(kvs_cq_item *ci)
{
	kvs_l3 *l3 = (kvs_l3 *)((char *)ci - offsetof(kvs_l3, ready));
	atomic_store(&l3->ready_posted, false); /* before taking: later ones post again */
	pthread_mutex_lock(&l3->mu);
	item *it = l3->done.head;
	l3->done = (list){0};
	pthread_mutex_unlock(&l3->mu);
	while (it) {
		item *next = it->next;
		kvs_l3_done d = {.op = it->op, .key = it->key, .result = it->result, .cookie = it->cookie};
		if (it->op == KVS_L3_PROBE) {
			for (uint32_t i = 0; i < it->n; i++)
				if (it->present[i])
					know(l3, &it->keys[i], it->geoms[i], it->lens[i]);
			d.n = it->n;
			d.present = it->present;
		} else if (it->op == KVS_L3_WRITE && it->result == 0) {
			know(l3, &it->key, it->geom, it->len);
		} else if (it->op == KVS_L3_READ && it->result == 0) {
			know(l3, &it->key, it->geom, it->len);
		} else if (it->op == KVS_L3_READ) {
			read_failed(l3, &it->key, it->result);
		}
		if (l3->cfg.on_done)
			l3->cfg.on_done(l3->cfg.done_arg, &d);
		item_free(it);
		it = next;
	}
}

/* Worker or owner, mu held. */
static void complete_locked(kvs_l3 *l3, item *it, int result)
{
	it->result = result;
	list_push(&l3->done, it, 0);
	if (l3->cfg.cq && !atomic_exchange(&l3->ready_posted, true))
		kvs_cq_post(l3->cfg.cq, &l3->ready);
}

/* ---- the workers ----------------------------------------------------------- */

/* The worker's connection, opened (again at most once per RETRY_MS) if it
 * has none; NULL with the reason in w->err. */
static void *connection(worker *w)
{
	void *c = atomic_load(&w->conn);
	if (c)
		return c;
	uint64_t now = kvs_now_ms();
	if (now < w->next_try_ms)
		return NULL;
	w->next_try_ms = now + RETRY_MS;
	char err[256] = "";
	int r = w->l3->cfg.backend->open(&w->l3->cfg, &c, err, sizeof(err));
	if (r != 0) {
		if (strcmp(err, w->err) != 0)
			kvs_warn("L3 %s: cannot reach the store: %s (trying again every %d ms)",
				 w->kind == W_PROBE ? "prober" : w->kind == W_READ ? "reader" : "writer", err, RETRY_MS);
		snprintf(w->err, sizeof(w->err), "%s", err);
		return NULL;
	}
	if (w->err[0])
		kvs_info("L3 %s connected", w->kind == W_PROBE ? "prober" : w->kind == W_READ ? "reader" : "writer");
	w->err[0] = 0;
	atomic_store(&w->healthy, true);
	atomic_store(&w->conn, c);
	return c;
}

static void count(kvs_l3 *l3, uint64_t *field, uint64_t n)
{
	pthread_mutex_lock(&l3->mu);
	*field += n;
	pthread_mutex_unlock(&l3->mu);
}

/* A record found unusable: counted, deleted with its parts 1..parts-1 (it
 * is ours to delete: nothing under the prefix is served without passing
 * these checks). */
static void refuse(kvs_l3 *l3, void *conn, const kvs_objkey *key, uint32_t parts, const char *why)
{
	char k[MAX_KEY];
	count(l3, &l3->st.corrupt, 1);
	kvs_dbg("L3 record refused: %s", why);
	for (uint32_t p = 0; p < (parts ? parts : 1); p++)
		l3->cfg.backend->del(conn, k, store_key(l3, key, p, k));
}

static int do_probe(kvs_l3 *l3, void *conn, item *it)
{
	size_t n = it->n;
	char (*keys)[MAX_KEY] = malloc(n * sizeof(*keys));
	const void **kp = malloc(n * sizeof(*kp));
	size_t *kl = malloc(n * sizeof(*kl)), *hl = malloc(n * sizeof(*hl));
	uint8_t (*hb)[HDR] = malloc(n * sizeof(*hb));
	void **bp = malloc(n * sizeof(*bp));
	int r = 0;
	if (!keys || !kp || !kl || !hl || !hb || !bp) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
		kl[i] = store_key(l3, &it->keys[i], 0, keys[i]);
		kp[i] = keys[i];
		bp[i] = hb[i];
	}
	r = l3->cfg.backend->head_many(conn, kp, kl, n, HDR, bp, hl);
	uint64_t hits = 0, bad = 0;
	for (size_t i = 0; i < n; i++) {
		if (hl[i] == 0)
			continue;
		kvs_record_hdr h;
		int c = hl[i] < HDR ? KVS_RECORD_BAD
				    : kvs_record_check(hb[i], HDR + it->lens[i], &it->keys[i], it->geoms[i], &h);
		it->present[i] = c == KVS_RECORD_OK;
		hits += c == KVS_RECORD_OK;
		bad += c != KVS_RECORD_OK;
	}
	pthread_mutex_lock(&l3->mu);
	l3->st.probe_hits += hits;
	l3->st.corrupt += bad;
	pthread_mutex_unlock(&l3->mu);
out:
	free(keys);
	free(kp);
	free(kl);
	free(hl);
	free(hb);
	free(bp);
	return r;
}

static int do_read(kvs_l3 *l3, void *conn, item *it)
{
	char k[MAX_KEY];
	kvs_record_hdr raw, h;
	size_t got = 0;
	int r = l3->cfg.backend->get2(conn, k, store_key(l3, &it->key, 0, k), &raw, HDR, it->dst, it->len, &got);
	if (r == KVS_E_LIMIT) {
		refuse(l3, conn, &it->key, 1, "longer than the object");
		return KVS_E_MISS;
	}
	if (r)
		return r;
	int c = got < HDR ? KVS_RECORD_BAD : kvs_record_check(&raw, HDR + it->len, &it->key, it->geom, &h);
	if (c == KVS_RECORD_GEOM) { /* another layout's record: refused, but not ours to delete */
		count(l3, &l3->st.corrupt, 1);
		return KVS_E_MISS;
	}
	if (c != KVS_RECORD_OK) {
		refuse(l3, conn, &it->key, 1, c == KVS_RECORD_KEY ? "written under another key" : "bad header");
		return KVS_E_MISS;
	}
	uint64_t first = got - HDR; /* data bytes in part 0 */
	uint32_t parts = 1;
	if (h.flags) {
		uint64_t P = h.flags < 40 ? 1ull << h.flags : 0;
		if (h.flags >= 40 || got != P || P <= HDR || first >= it->len) {
			refuse(l3, conn, &it->key, 1, "bad split");
			return KVS_E_MISS;
		}
		parts = (uint32_t)(1 + (it->len - first + P - 1) / P);
		uint64_t off = first;
		for (uint32_t part = 1; off < it->len; part++) {
			uint64_t want = it->len - off < P ? it->len - off : P;
			size_t pg = 0;
			r = l3->cfg.backend->get2(conn, k, store_key(l3, &it->key, part, k), (uint8_t *)it->dst + off, want,
						  NULL, 0, &pg);
			if (r == KVS_E_MISS || r == KVS_E_LIMIT || (r == 0 && pg != want)) {
				refuse(l3, conn, &it->key, parts, "a part missing or of another size");
				return KVS_E_MISS;
			}
			if (r)
				return r;
			off += want;
		}
	} else if (first != it->len) {
		refuse(l3, conn, &it->key, 1, "short record");
		return KVS_E_MISS;
	}
	if (kvs_record_sum(kvs_record_seed(&h, &it->key), it->dst, it->len) != h.checksum) {
		refuse(l3, conn, &it->key, parts, "checksum");
		return KVS_E_MISS;
	}
	return 0;
}

/* Writes the later parts first and part 0 last: a reader that finds part 0
 * finds the record complete (unless the store evicted a part since). */
static int do_write(kvs_l3 *l3, void *conn, item *it, uint8_t **buf, uint64_t *cap)
{
	char k[MAX_KEY];
	uint64_t P = l3->cfg.part_bytes;
	bool split = HDR + it->len > P;
	uint64_t first = split ? P - HDR : it->len;
	kvs_record_hdr h;
	kvs_record_init(&h, &it->key, it->geom, it->len);
	h.flags = split ? (uint16_t)log2u(P) : 0;
	h.checksum = kvs_record_sum(kvs_record_seed(&h, &it->key), it->src, it->len);
	const uint8_t *src = it->src;
	int r = 0;
	if (split) {
		uint64_t off = first;
		for (uint32_t part = 1; off < it->len && !r; part++) {
			uint64_t n = it->len - off < P ? it->len - off : P;
			r = l3->cfg.backend->put(conn, k, store_key(l3, &it->key, part, k), src + off, n);
			off += n;
		}
		if (r)
			return r;
	}
	if (*cap < HDR + first) {
		uint8_t *nb = realloc(*buf, HDR + first);
		if (!nb)
			return -ENOMEM;
		*buf = nb;
		*cap = HDR + first;
	}
	memcpy(*buf, &h, HDR);
	memcpy(*buf + HDR, src, first);
	return l3->cfg.backend->put(conn, k, store_key(l3, &it->key, 0, k), *buf, HDR + first);
}

static void *worker_main(void *arg)
{
	worker *w = arg;
	kvs_l3 *l3 = w->l3;
	uint8_t *buf = NULL; /* the writer's part-0 buffer, reused */
	uint64_t cap = 0;
	connection(w); /* at start, so that l3_connected says at once whether the store is reachable */
	pthread_mutex_lock(&l3->mu);
	for (;;) {
		while (!l3->q[w->kind].n && !l3->stop)
			pthread_cond_wait(&l3->cv[w->kind], &l3->mu);
		if (l3->stop)
			break;
		item *it = l3->q[w->kind].head;
		list_unlink(&l3->q[w->kind], it, item_bytes(it));
		pthread_mutex_unlock(&l3->mu);
		void *conn = connection(w);
		uint64_t t0 = kvs_now_ns();
		int r = -EHOSTDOWN;
		if (conn)
			r = it->op == KVS_L3_PROBE ? do_probe(l3, conn, it)
			  : it->op == KVS_L3_READ ? do_read(l3, conn, it)
			  : do_write(l3, conn, it, &buf, &cap);
		uint64_t dt = kvs_now_ns() - t0;
		/* reached the store: answered, or refused for a reason of its own */
		atomic_store(&w->healthy, conn && r != -EHOSTDOWN && r != KVS_E_TIMEOUT);
		pthread_mutex_lock(&l3->mu);
		if (it->op == KVS_L3_PROBE) {
			l3->st.probes++;
			l3->st.probe_keys += it->n;
			l3->st.probe_errors += r != 0;
			l3->st.probe_ns += dt;
		} else if (it->op == KVS_L3_READ) {
			l3->st.reads++;
			l3->st.read_ns += dt;
			if (r == 0)
				l3->st.read_bytes += it->len;
			else if (r == KVS_E_MISS)
				l3->st.read_misses++;
			else
				l3->st.read_errors++;
		} else {
			l3->st.write_ns += dt;
			if (r == 0) {
				l3->st.writes++;
				l3->st.write_bytes += it->len;
			} else {
				l3->st.write_errors++;
			}
		}
		if (r && r != KVS_E_MISS && it->op != KVS_L3_PROBE)
			r = r == -EHOSTDOWN || r == KVS_E_TIMEOUT ? r : KVS_E_INTERNAL;
		complete_locked(l3, it, r);
	}
	pthread_mutex_unlock(&l3->mu);
	free(buf);
	return NULL;
}

/* ---- the owner's API ------------------------------------------------------- */

void kvs_l3_config_defaults(kvs_l3_config *cfg)
{
	*cfg = (kvs_l3_config){.prefix = "kvside:", .timeout_ms = 200, .part_bytes = 8ull << 20,
			       .queue_max = 4096, .queue_max_bytes = 1ull << 30, .write_policy = KVS_L3_WRITE_ALL};
}

static char *dup_or_null(const char *s) { return s ? strdup(s) : NULL; }

int kvs_l3_open(const kvs_l3_config *cfg, kvs_l3 **ret, char *err, size_t errlen)
{
	const char *prefix = cfg->prefix ? cfg->prefix : "";
	if (!cfg->backend) {
		snprintf(err, errlen, "no L3 backend in this build (kvside was built without hiredis)");
		return -EINVAL;
	}
	if (!cfg->seeds || !cfg->seeds[0]) {
		snprintf(err, errlen, "no L3 store address");
		return -EINVAL;
	}
	if (strlen(prefix) > MAX_PREFIX) {
		snprintf(err, errlen, "l3-prefix is longer than %d bytes", MAX_PREFIX);
		return -EINVAL;
	}
	if (cfg->part_bytes < (64u << 10) || cfg->part_bytes > (512ull << 20) ||
	    (cfg->part_bytes & (cfg->part_bytes - 1))) {
		snprintf(err, errlen, "l3-part-bytes must be a power of two from 64K to 512M, not %llu",
			 (unsigned long long)cfg->part_bytes);
		return -EINVAL;
	}
	if (cfg->timeout_ms < 1 || cfg->timeout_ms > 60000) {
		snprintf(err, errlen, "l3-timeout-ms must be 1..60000");
		return -EINVAL;
	}
	kvs_l3 *l3 = calloc(1, sizeof(*l3));
	if (!l3)
		return -ENOMEM;
	l3->cfg = *cfg;
	snprintf(l3->prefix, sizeof(l3->prefix), "%s", prefix);
	l3->prefix_len = strlen(l3->prefix);
	l3->seeds = strdup(cfg->seeds);
	l3->user = dup_or_null(cfg->user);
	l3->password = dup_or_null(cfg->password);
	l3->cfg.seeds = l3->seeds, l3->cfg.user = l3->user, l3->cfg.password = l3->password;
	l3->cfg.prefix = l3->prefix;
	l3->ring = calloc(KNOWN_MAX, sizeof(*l3->ring));
	if (kvs_htab_create(sizeof(kvs_objkey), offsetof(known_ent, key), &l3->known) != 0)
		l3->known = NULL;
	l3->seen = calloc(1u << SEEN_BITS, sizeof(*l3->seen));
	l3->ready.done = l3_ready;
	pthread_mutex_init(&l3->mu, NULL);
	for (int i = 0; i < N_WORKERS; i++)
		pthread_cond_init(&l3->cv[i], NULL);
	if (!l3->seeds || !l3->known || !l3->ring || !l3->seen || (cfg->user && !l3->user) || (cfg->password && !l3->password)) {
		kvs_l3_close(l3);
		return -ENOMEM;
	}
	for (int i = 0; i < N_WORKERS; i++) {
		l3->w[i] = (worker){.l3 = l3, .kind = i};
		if (pthread_create(&l3->w[i].th, NULL, worker_main, &l3->w[i]) != 0) {
			kvs_l3_close(l3);
			snprintf(err, errlen, "cannot start the L3 threads");
			return -ENOMEM;
		}
		l3->w[i].started = true;
	}
	*ret = l3;
	return 0;
}

static void list_free(list *l)
{
	for (item *it = l->head, *next; it; it = next) {
		next = it->next;
		item_free(it);
	}
	*l = (list){0};
}

void kvs_l3_close(kvs_l3 *l3)
{
	if (!l3)
		return;
	pthread_mutex_lock(&l3->mu);
	l3->stop = true;
	for (int i = 0; i < N_WORKERS; i++)
		pthread_cond_broadcast(&l3->cv[i]);
	pthread_mutex_unlock(&l3->mu);
	for (int i = 0; i < N_WORKERS; i++) {
		if (l3->w[i].started)
			pthread_join(l3->w[i].th, NULL);
		void *c = atomic_load(&l3->w[i].conn);
		if (c)
			l3->cfg.backend->close(c);
	}
	for (int i = 0; i < N_WORKERS; i++) {
		list_free(&l3->q[i]);
		pthread_cond_destroy(&l3->cv[i]);
	}
	list_free(&l3->done);
	pthread_mutex_destroy(&l3->mu);
	kvs_htab_destroy(l3->known);
	free(l3->ring);
	free(l3->seen);
	free(l3->seeds);
	free(l3->user);
	free(l3->password);
	free(l3);
}

static void enqueue(kvs_l3 *l3, int kind, item *it)
{
	pthread_mutex_lock(&l3->mu);
	list_push(&l3->q[kind], it, item_bytes(it));
	pthread_cond_signal(&l3->cv[kind]);
	pthread_mutex_unlock(&l3->mu);
}

int kvs_l3_probe(kvs_l3 *l3, const kvs_objkey *keys, const uint64_t *geoms, const uint64_t *lens, uint32_t n,
		 void *cookie)
{
	item *it = calloc(1, sizeof(*it));
	if (!it)
		return -ENOMEM;
	it->op = KVS_L3_PROBE;
	it->cookie = cookie;
	it->n = n;
	it->keys = malloc((n ? n : 1) * sizeof(*it->keys));
	it->geoms = malloc((n ? n : 1) * sizeof(*it->geoms));
	it->lens = malloc((n ? n : 1) * sizeof(*it->lens));
	it->present = calloc(n ? n : 1, sizeof(*it->present));
	if (!it->keys || !it->geoms || !it->lens || !it->present) {
		item_free(it);
		return -ENOMEM;
	}
	memcpy(it->keys, keys, n * sizeof(*keys));
	memcpy(it->geoms, geoms, n * sizeof(*geoms));
	memcpy(it->lens, lens, n * sizeof(*lens));
	enqueue(l3, W_PROBE, it);
	return 0;
}

uint32_t kvs_l3_probe_backlog(kvs_l3 *l3)
{
	pthread_mutex_lock(&l3->mu);
	uint32_t n = (uint32_t)l3->q[W_PROBE].n;
	pthread_mutex_unlock(&l3->mu);
	return n;
}

int kvs_l3_read(kvs_l3 *l3, const kvs_objkey *key, uint64_t geom, void *dst, uint64_t len, void *cookie)
{
	item *it = calloc(1, sizeof(*it));
	if (!it)
		return -ENOMEM;
	*it = (item){.op = KVS_L3_READ, .key = *key, .geom = geom, .dst = dst, .len = len, .cookie = cookie};
	enqueue(l3, W_READ, it);
	return 0;
}

/* The write to drop next, mu held: the oldest group's highest idx. */
static item *drop_victim(kvs_l3 *l3)
{
	item *head = l3->q[W_WRITE].head, *v = head;
	for (item *it = head; it && it->group == head->group; it = it->next)
		if (it->idx > v->idx)
			v = it;
	return v;
}

int kvs_l3_write_in(kvs_l3 *l3, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		    void *cookie, uint64_t group, uint32_t idx)
{
	item *it = calloc(1, sizeof(*it));
	if (!it)
		return -ENOMEM;
	*it = (item){.op = KVS_L3_WRITE, .key = *key, .geom = geom, .src = data, .len = len, .cookie = cookie,
		     .group = group, .idx = idx};
	pthread_mutex_lock(&l3->mu);
	list *q = &l3->q[W_WRITE];
	/* a group's writes stay together: one queued after its group's last */
	item *after = NULL;
	if (group)
		for (item *x = q->tail; x; x = x->prev)
			if (x->group == group) {
				after = x;
				break;
			}
	if (after && after != q->tail) {
		it->prev = after;
		it->next = after->next;
		after->next->prev = it;
		after->next = it;
		q->n++;
		q->bytes += len;
	} else {
		list_push(q, it, len);
	}
	while (q->n > 1 && (q->n > l3->cfg.queue_max || q->bytes > l3->cfg.queue_max_bytes)) {
		item *v = drop_victim(l3);
		list_unlink(q, v, v->len);
		l3->st.write_drops++;
		complete_locked(l3, v, KVS_E_NOSPACE);
	}
	pthread_cond_signal(&l3->cv[W_WRITE]);
	pthread_mutex_unlock(&l3->mu);
	return 0;
}

uint32_t kvs_l3_shed(kvs_l3 *l3, uint64_t bytes, void **cookies, uint32_t cap)
{
	uint32_t n = 0;
	uint64_t freed = 0;
	pthread_mutex_lock(&l3->mu);
	list *q = &l3->q[W_WRITE];
	while (q->n && n < cap && freed < bytes) {
		item *v = drop_victim(l3);
		list_unlink(q, v, v->len);
		freed += v->len;
		cookies[n++] = v->cookie;
		l3->st.write_drops++;
		item_free(v);
	}
	pthread_mutex_unlock(&l3->mu);
	return n;
}

void kvs_l3_get_stats(kvs_l3 *l3, kvs_l3_stats *st)
{
	pthread_mutex_lock(&l3->mu);
	*st = l3->st;
	st->queue_depth = l3->q[W_WRITE].n;
	st->queue_bytes = l3->q[W_WRITE].bytes;
	st->probe_queue = l3->q[W_PROBE].n;
	pthread_mutex_unlock(&l3->mu);
	kvs_l3_backend_stats b = {0};
	st->connected = 0;
	for (int i = 0; i < N_WORKERS; i++) {
		void *c = atomic_load(&l3->w[i].conn);
		if (c) {
			st->connected += atomic_load(&l3->w[i].healthy);
			l3->cfg.backend->stats(c, &b);
		}
	}
	st->moved = b.moved, st->ask = b.ask, st->refreshes = b.refreshes;
	st->nodes_down = b.nodes_down, st->timeouts = b.timeouts;
}
