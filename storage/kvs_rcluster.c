/* kvs_rcluster: Redis Cluster routing on hiredis's synchronous API: key
 * slots, the slot map, MOVED/ASK, refresh after a failure, the public calls
 * (kvs_rcluster.h). Connections and waits: kvs_rcluster_node.c. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvs_error.h"
#include "kvs_rcluster_impl.h"

/* ---- key slots ------------------------------------------------------------ */

static const uint16_t crc16_tab[256] = {
	0x0000, 0x1021, 0x2042, 0x3063, 0x4084, 0x50a5, 0x60c6, 0x70e7,
	0x8108, 0x9129, 0xa14a, 0xb16b, 0xc18c, 0xd1ad, 0xe1ce, 0xf1ef,
	0x1231, 0x0210, 0x3273, 0x2252, 0x52b5, 0x4294, 0x72f7, 0x62d6,
	0x9339, 0x8318, 0xb37b, 0xa35a, 0xd3bd, 0xc39c, 0xf3ff, 0xe3de,
	0x2462, 0x3443, 0x0420, 0x1401, 0x64e6, 0x74c7, 0x44a4, 0x5485,
	0xa56a, 0xb54b, 0x8528, 0x9509, 0xe5ee, 0xf5cf, 0xc5ac, 0xd58d,
	0x3653, 0x2672, 0x1611, 0x0630, 0x76d7, 0x66f6, 0x5695, 0x46b4,
	0xb75b, 0xa77a, 0x9719, 0x8738, 0xf7df, 0xe7fe, 0xd79d, 0xc7bc,
	0x48c4, 0x58e5, 0x6886, 0x78a7, 0x0840, 0x1861, 0x2802, 0x3823,
	0xc9cc, 0xd9ed, 0xe98e, 0xf9af, 0x8948, 0x9969, 0xa90a, 0xb92b,
	0x5af5, 0x4ad4, 0x7ab7, 0x6a96, 0x1a71, 0x0a50, 0x3a33, 0x2a12,
	0xdbfd, 0xcbdc, 0xfbbf, 0xeb9e, 0x9b79, 0x8b58, 0xbb3b, 0xab1a,
	0x6ca6, 0x7c87, 0x4ce4, 0x5cc5, 0x2c22, 0x3c03, 0x0c60, 0x1c41,
	0xedae, 0xfd8f, 0xcdec, 0xddcd, 0xad2a, 0xbd0b, 0x8d68, 0x9d49,
	0x7e97, 0x6eb6, 0x5ed5, 0x4ef4, 0x3e13, 0x2e32, 0x1e51, 0x0e70,
	0xff9f, 0xefbe, 0xdfdd, 0xcffc, 0xbf1b, 0xaf3a, 0x9f59, 0x8f78,
	0x9188, 0x81a9, 0xb1ca, 0xa1eb, 0xd10c, 0xc12d, 0xf14e, 0xe16f,
	0x1080, 0x00a1, 0x30c2, 0x20e3, 0x5004, 0x4025, 0x7046, 0x6067,
	0x83b9, 0x9398, 0xa3fb, 0xb3da, 0xc33d, 0xd31c, 0xe37f, 0xf35e,
	0x02b1, 0x1290, 0x22f3, 0x32d2, 0x4235, 0x5214, 0x6277, 0x7256,
	0xb5ea, 0xa5cb, 0x95a8, 0x8589, 0xf56e, 0xe54f, 0xd52c, 0xc50d,
	0x34e2, 0x24c3, 0x14a0, 0x0481, 0x7466, 0x6447, 0x5424, 0x4405,
	0xa7db, 0xb7fa, 0x8799, 0x97b8, 0xe75f, 0xf77e, 0xc71d, 0xd73c,
	0x26d3, 0x36f2, 0x0691, 0x16b0, 0x6657, 0x7676, 0x4615, 0x5634,
	0xd94c, 0xc96d, 0xf90e, 0xe92f, 0x99c8, 0x89e9, 0xb98a, 0xa9ab,
	0x5844, 0x4865, 0x7806, 0x6827, 0x18c0, 0x08e1, 0x3882, 0x28a3,
	0xcb7d, 0xdb5c, 0xeb3f, 0xfb1e, 0x8bf9, 0x9bd8, 0xabbb, 0xbb9a,
	0x4a75, 0x5a54, 0x6a37, 0x7a16, 0x0af1, 0x1ad0, 0x2ab3, 0x3a92,
	0xfd2e, 0xed0f, 0xdd6c, 0xcd4d, 0xbdaa, 0xad8b, 0x9de8, 0x8dc9,
	0x7c26, 0x6c07, 0x5c64, 0x4c45, 0x3ca2, 0x2c83, 0x1ce0, 0x0cc1,
	0xef1f, 0xff3e, 0xcf5d, 0xdf7c, 0xaf9b, 0xbfba, 0x8fd9, 0x9ff8,
	0x6e17, 0x7e36, 0x4e55, 0x5e74, 0x2e93, 0x3eb2, 0x0ed1, 0x1ef0,
};

uint16_t kvs__rcluster_crc16(const void *buf, size_t len)
{
	const uint8_t *p = buf;
	uint16_t crc = 0;
	for (size_t i = 0; i < len; i++)
		crc = (uint16_t)((crc << 8) ^ crc16_tab[((crc >> 8) ^ p[i]) & 0xff]);
	return crc;
}

uint16_t kvs_rcluster_keyslot(const void *key, size_t klen)
{
	const char *k = key;
	const char *open = klen ? memchr(k, '{', klen) : NULL;
	if (open) {
		size_t from = (size_t)(open - k) + 1;
		const char *close = memchr(k + from, '}', klen - from);
		if (close && close > k + from) /* a non-empty tag: hash only it */
			return kvs__rcluster_crc16(k + from, (size_t)(close - k) - from) & (KVS_RCLUSTER_SLOTS - 1);
	}
	return kvs__rcluster_crc16(k, klen) & (KVS_RCLUSTER_SLOTS - 1);
}

/* ---- the slot map --------------------------------------------------------- */

static void ranges_free(rrange *r, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		free(r[i].replicas);
	free(r);
}

/* One node entry of CLUSTER SLOTS ([ip, port, id, ...]): its index, or
 * NODE_NONE if unusable ("?" endpoint) or the table is full. An empty ip
 * means the node that answered. */
static uint16_t slots_node(kvs_rcluster *c, uint32_t from, const redisReply *e, bool *bad)
{
	if (e->type != REDIS_REPLY_ARRAY || e->elements < 2 || e->element[0]->type != REDIS_REPLY_STRING ||
	    e->element[1]->type != REDIS_REPLY_INTEGER || e->element[1]->integer < 1 ||
	    e->element[1]->integer > 65535 || e->element[0]->len >= HOST_MAX) {
		*bad = true;
		return NODE_NONE;
	}
	char host[HOST_MAX];
	memcpy(host, e->element[0]->str, e->element[0]->len);
	host[e->element[0]->len] = '\0';
	if (strcmp(host, "?") == 0)
		return NODE_NONE;
	if (!host[0])
		snprintf(host, sizeof(host), "%s", c->nodes[from].host);
	return kvs__rcl_node_get(c, host, (int)e->element[1]->integer);
}

/* Reads CLUSTER SLOTS from ni and makes it the map. On any failure the map
 * is unchanged. An empty map (a node in no cluster yet) is a failure. */
static int read_slots(kvs_rcluster *c, uint32_t ni, int64_t deadline)
{
	static const char *argv[2] = {"CLUSTER", "SLOTS"};
	static const size_t lens[2] = {7, 5};
	redisReply *r = NULL;
	int rc = kvs__rcl_node_exec(c, ni, false, 2, argv, lens, 0, deadline, &r);
	if (rc)
		return rc;
	char who[HOST_MAX]; /* c->nodes may move as nodes are added below */
	snprintf(who, sizeof(who), "%s", c->nodes[ni].host);
	int port = c->nodes[ni].port;
	if (r->type == REDIS_REPLY_ERROR) {
		rc = kvs__rcl_reply_error(c, ni, r);
		freeReplyObject(r);
		return rc == KVS_E_AUTH ? rc : -EPROTO;
	}
	if (r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
		kvs__rcl_set_err(c, "%s:%d: CLUSTER SLOTS: %s", who, port,
				 r->type == REDIS_REPLY_ARRAY ? "no slot is assigned" : "not an array");
		freeReplyObject(r);
		return -EPROTO;
	}
	uint16_t *map = malloc(sizeof(c->slot));
	rrange *rg = calloc(r->elements, sizeof(*rg));
	if (!map || !rg) {
		free(map);
		free(rg);
		freeReplyObject(r);
		kvs__rcl_set_err(c, "out of memory reading the slot map");
		return -ENOMEM;
	}
	for (uint32_t s = 0; s < KVS_RCLUSTER_SLOTS; s++)
		map[s] = NODE_NONE;
	bool bad = false;
	uint32_t k = 0;
	for (size_t i = 0; i < r->elements && !bad; i++) {
		const redisReply *e = r->element[i];
		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
		    e->element[1]->type != REDIS_REPLY_INTEGER || e->element[0]->integer < 0 ||
		    e->element[1]->integer >= KVS_RCLUSTER_SLOTS || e->element[0]->integer > e->element[1]->integer) {
			bad = true;
			break;
		}
		uint16_t m = slots_node(c, ni, e->element[2], &bad);
		if (bad || m == NODE_NONE)
			continue;
		rrange *x = &rg[k++];
		x->start = (uint16_t)e->element[0]->integer, x->end = (uint16_t)e->element[1]->integer, x->master = m;
		if (e->elements > 3 && !(x->replicas = calloc(e->elements - 3, sizeof(uint16_t)))) {
			bad = true;
			break;
		}
		for (size_t j = 3; j < e->elements && !bad; j++) {
			uint16_t rn = slots_node(c, ni, e->element[j], &bad);
			if (rn != NODE_NONE)
				x->replicas[x->n_replicas++] = rn;
		}
		for (uint32_t s = x->start; s <= x->end; s++)
			map[s] = m;
	}
	freeReplyObject(r);
	if (bad || k == 0) {
		kvs__rcl_set_err(c, "%s:%d: CLUSTER SLOTS: %s", who, port,
				 bad ? "malformed reply (or out of memory)" : "no usable node");
		free(map);
		ranges_free(rg, k);
		return -EPROTO;
	}
	memcpy(c->slot, map, sizeof(c->slot));
	free(map);
	ranges_free(c->ranges, c->n_ranges);
	c->ranges = rg, c->n_ranges = k;
	c->refresh_cursor = ni;
	CNT(c, refreshes, 1);
	return 0;
}

/* Reads the map from a node not down, starting with the one that answered
 * last (down nodes are skipped at no cost). Forced: every such node in turn
 * until one answers or the deadline passes. Otherwise (after a failure): at
 * most once every refresh_min_ms (-EAGAIN when skipped), one node only, and
 * only a node that has not failed since its last answer. So in a cluster
 * that hangs a call waits on two silent nodes at most, and once every node
 * has failed, calls fail at once; commands whose node's down period ends
 * find out when it answers again. */
static int refresh(kvs_rcluster *c, int64_t deadline, bool force)
{
	int64_t now = kvs__rcl_now_ms();
	if (!force && now - c->last_refresh < (int64_t)c->cfg.refresh_min_ms)
		return -EAGAIN;
	c->last_refresh = now;
	int rc = -EHOSTDOWN;
	uint32_t tried = 0;
	for (uint32_t k = 0; k < c->n_nodes && (force || tried == 0); k++) {
		uint32_t ni = (c->refresh_cursor + k) % c->n_nodes;
		const rnode *n = &c->nodes[ni];
		if (!n->ctx && (n->down_until > kvs__rcl_now_ms() || (!force && n->fails > 0)))
			continue;
		if (deadline - kvs__rcl_now_ms() <= 0) {
			rc = KVS_E_TIMEOUT;
			break;
		}
		tried++;
		rc = read_slots(c, ni, deadline);
		if (rc == 0 || rc == -ENOMEM)
			return rc;
		c->refresh_cursor = (ni + 1) % c->n_nodes;
	}
	if (!tried && force)
		kvs__rcl_set_err(c, "every known node is down (%u nodes)", c->n_nodes);
	CNT(c, refresh_failures, 1);
	return rc;
}

/* A refresh after a failure: the failure's text stays what last_error says. */
static void refresh_after(kvs_rcluster *c, int64_t deadline)
{
	char keep[sizeof(c->err)];
	memcpy(keep, c->err, sizeof(keep));
	refresh(c, deadline, false);
	memcpy(c->err, keep, sizeof(keep));
}

/* ---- redirections and the command driver --------------------------------- */

enum { REDIR_NONE, REDIR_MOVED, REDIR_ASK };

/* MOVED/ASK "<slot> <host>:<port>" from ni's reply: the kind, the slot and
 * the node. REDIR_NONE for any other error; -EPROTO if malformed, -ENOMEM. */
static int parse_redirect(kvs_rcluster *c, uint32_t ni, const redisReply *r, uint16_t *ret_slot,
			  uint16_t *ret_node)
{
	int kind;
	size_t off;
	if (kvs__rcl_err_is(r, "MOVED"))
		kind = REDIR_MOVED, off = 6;
	else if (kvs__rcl_err_is(r, "ASK"))
		kind = REDIR_ASK, off = 4;
	else
		return REDIR_NONE;
	const char *p = r->str + off, *end = r->str + r->len;
	uint32_t slot = 0;
	const char *d = p;
	while (p < end && *p >= '0' && *p <= '9' && p - d < 6)
		slot = slot * 10 + (uint32_t)(*p++ - '0');
	char host[HOST_MAX];
	int port;
	if (p == d || p >= end || *p != ' ' || slot >= KVS_RCLUSTER_SLOTS ||
	    kvs__rcl_parse_hostport(p + 1, (size_t)(end - p - 1), host, &port)) {
		kvs__rcl_set_err(c, "%s:%d: malformed redirection: %.*s", c->nodes[ni].host, c->nodes[ni].port,
			(int)(r->len > 200 ? 200 : r->len), r->str);
		return -EPROTO;
	}
	if (!host[0]) /* ":port": the same host as the node that answered */
		snprintf(host, sizeof(host), "%s", c->nodes[ni].host);
	uint16_t to = kvs__rcl_node_get(c, host, port);
	if (to == NODE_NONE) {
		kvs__rcl_set_err(c, "cannot add node %s:%d (out of memory or %d nodes)", host, port, MAX_NODES);
		return -ENOMEM;
	}
	*ret_slot = (uint16_t)slot, *ret_node = to;
	return kind;
}

/* Runs one single-key command for slot: routing, redirections, one retry
 * after a node failure, all within op_timeout_ms. Returns 0 and a reply that
 * is not an error (the caller frees it), or a code. */
static int run(kvs_rcluster *c, uint16_t slot, int argc, const char **argv, const size_t *lens, size_t payload,
	       redisReply **ret)
{
	int64_t deadline = kvs__rcl_now_ms() + c->cfg.op_timeout_ms;
	uint16_t target = NODE_NONE; /* from a redirection; NODE_NONE: the map's */
	bool asking = false;
	int redirects = 0, first_rc = 0;
	uint16_t failed = NODE_NONE;
	char first_err[sizeof(c->err)];
	for (;;) {
		uint16_t ni = target != NODE_NONE ? target : c->slot[slot];
		if (ni == NODE_NONE && !first_rc) {
			refresh_after(c, deadline);
			ni = c->slot[slot];
		}
		if (ni == NODE_NONE) {
			if (first_rc)
				goto fail_first;
			kvs__rcl_set_err(c, "no node serves slot %u", slot);
			return -EHOSTDOWN;
		}
		if (first_rc && ni == failed) /* the refreshed map still names the failed node */
			goto fail_first;
		redisReply *r = NULL;
		int rc = kvs__rcl_node_exec(c, ni, asking, argc, argv, lens, payload, deadline, &r);
		if (rc) {
			if (first_rc || rc == -ENOMEM || rc == KVS_E_AUTH)
				return rc;
			first_rc = rc, failed = ni, target = NODE_NONE, asking = false;
			memcpy(first_err, c->err, sizeof(first_err));
			refresh_after(c, deadline);
			continue;
		}
		if (r->type != REDIS_REPLY_ERROR) {
			*ret = r;
			return 0;
		}
		uint16_t rslot, to;
		int kind = parse_redirect(c, ni, r, &rslot, &to);
		if (kind == REDIR_NONE) {
			rc = kvs__rcl_reply_error(c, ni, r);
			freeReplyObject(r);
			if (rc == -EHOSTDOWN) /* CLUSTERDOWN and the like: the topology may be changing */
				refresh_after(c, deadline);
			return rc;
		}
		freeReplyObject(r);
		if (kind < 0)
			return kind;
		if (++redirects > KVS_RCLUSTER_MAX_REDIRECTS) {
			kvs__rcl_set_err(c, "more than %d redirections for slot %u (last to %s:%d)", KVS_RCLUSTER_MAX_REDIRECTS,
				slot, c->nodes[to].host, c->nodes[to].port);
			return -ELOOP;
		}
		target = to;
		asking = kind == REDIR_ASK;
		if (kind == REDIR_MOVED) {
			c->slot[rslot] = to;
			CNT(c, moved, 1);
		} else {
			CNT(c, ask, 1);
		}
	}
fail_first:
	memcpy(c->err, first_err, sizeof(c->err));
	return first_rc;
}

static int done(kvs_rcluster *c, int rc)
{
	if (rc && rc != KVS_E_MISS && rc != KVS_E_LIMIT)
		CNT(c, errors, 1);
	return rc;
}

static int unexpected(kvs_rcluster *c, const char *cmd, redisReply *r)
{
	kvs__rcl_set_err(c, "%s: unexpected reply type %d", cmd, r->type);
	freeReplyObject(r);
	return -EPROTO;
}

/* ---- the public calls ----------------------------------------------------- */

void kvs_rcluster_config_defaults(kvs_rcluster_config *cfg)
{
	*cfg = (kvs_rcluster_config){.connect_timeout_ms = 500, .io_timeout_ms = 1000, .op_timeout_ms = 2000,
				     .refresh_min_ms = 100, .down_ms = 1000};
}

int kvs_rcluster_open(const kvs_rcluster_config *cfg, kvs_rcluster **ret, char *err, size_t errlen)
{
	char tmp[8];
	if (!err)
		err = tmp, errlen = sizeof(tmp);
	if (errlen)
		err[0] = '\0';
	if (!cfg->seeds || !cfg->seeds[0]) {
		snprintf(err, errlen, "no seed nodes (expected HOST:PORT[,HOST:PORT...])");
		return -EINVAL;
	}
	kvs_rcluster_config d;
	kvs_rcluster_config_defaults(&d);
	kvs_rcluster *c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->cfg = *cfg;
	c->cfg.seeds = NULL;
	if (!c->cfg.connect_timeout_ms)
		c->cfg.connect_timeout_ms = d.connect_timeout_ms;
	if (!c->cfg.io_timeout_ms)
		c->cfg.io_timeout_ms = d.io_timeout_ms;
	if (!c->cfg.op_timeout_ms)
		c->cfg.op_timeout_ms = 2 * c->cfg.io_timeout_ms;
	if (!c->cfg.refresh_min_ms)
		c->cfg.refresh_min_ms = d.refresh_min_ms;
	if (!c->cfg.down_ms)
		c->cfg.down_ms = d.down_ms;
	int rc = -EINVAL;
	const uint32_t hour = 3600000;
	if (c->cfg.connect_timeout_ms > hour || c->cfg.io_timeout_ms > hour || c->cfg.op_timeout_ms > hour) {
		snprintf(err, errlen, "a time-out above one hour");
		goto err_free;
	}
	rc = -ENOMEM;
	if (cfg->password && cfg->password[0]) {
		if (!(c->password = strdup(cfg->password)))
			goto err_free;
		if (cfg->user && cfg->user[0] && !(c->user = strdup(cfg->user)))
			goto err_free;
	}
	c->cfg.user = c->user, c->cfg.password = c->password;
	for (uint32_t s = 0; s < KVS_RCLUSTER_SLOTS; s++)
		c->slot[s] = NODE_NONE;

	for (const char *p = cfg->seeds; *p;) {
		const char *e = strchr(p, ',');
		size_t len = e ? (size_t)(e - p) : strlen(p);
		while (len && (*p == ' ' || *p == '\t'))
			p++, len--;
		while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
			len--;
		char host[HOST_MAX];
		int port;
		if (kvs__rcl_parse_hostport(p, len, host, &port) || !host[0]) {
			snprintf(err, errlen, "seed '%.*s': expected HOST:PORT", (int)(len > 100 ? 100 : len), p);
			rc = -EINVAL;
			goto err_free;
		}
		if (kvs__rcl_node_get(c, host, port) == NODE_NONE)
			goto err_free;
		p = e ? e + 1 : p + len;
	}
	uint32_t n_seeds = c->n_nodes;
	size_t at = 0;
	bool answered = false;
	rc = -EHOSTDOWN;
	for (uint32_t i = 0; i < n_seeds; i++) {
		int64_t deadline = kvs__rcl_now_ms() + c->cfg.connect_timeout_ms + c->cfg.io_timeout_ms;
		int r = read_slots(c, i, deadline);
		if (r == 0) {
			*ret = c;
			return 0;
		}
		if (r == KVS_E_AUTH || r == -ENOMEM) {
			snprintf(err, errlen, "%s", c->err);
			rc = r;
			goto err_free;
		}
		answered |= r == -EPROTO;
		if (at < errlen)
			at += (size_t)snprintf(err + at, errlen - at, "%s%s", at ? "; " : "", c->err);
	}
	rc = answered ? -EPROTO : -EHOSTDOWN;
err_free:
	kvs_rcluster_close(c);
	return rc;
}

void kvs_rcluster_close(kvs_rcluster *c)
{
	if (!c)
		return;
	for (uint32_t i = 0; i < c->n_nodes; i++)
		kvs__rcl_node_drop(&c->nodes[i]);
	free(c->nodes);
	ranges_free(c->ranges, c->n_ranges);
	free(c->user);
	free(c->password);
	free(c);
}

/* hiredis copies argv[i] with memcpy: never hand it NULL, even for 0 bytes */
static const char *bytes(const void *p)
{
	return p ? p : "";
}

int kvs_rcluster_set(kvs_rcluster *c, const void *key, size_t klen, const void *val, size_t vlen)
{
	const char *argv[3] = {"SET", bytes(key), bytes(val)};
	size_t lens[3] = {3, klen, vlen};
	redisReply *r;
	CNT(c, calls, 1);
	int rc = run(c, kvs_rcluster_keyslot(key, klen), 3, argv, lens, klen + vlen, &r);
	if (!rc) {
		if (r->type != REDIS_REPLY_STATUS)
			return done(c, unexpected(c, "SET", r));
		freeReplyObject(r);
	}
	return done(c, rc);
}

int kvs_rcluster_getv(kvs_rcluster *c, const void *key, size_t klen, const struct iovec *iov, int iovcnt,
		      size_t *ret_len)
{
	const char *argv[2] = {"GET", bytes(key)};
	size_t lens[2] = {3, klen};
	size_t cap = 0;
	for (int i = 0; i < iovcnt; i++)
		cap += iov[i].iov_len;
	redisReply *r;
	CNT(c, calls, 1);
	int rc = run(c, kvs_rcluster_keyslot(key, klen), 2, argv, lens, klen, &r);
	if (rc)
		return done(c, rc);
	if (r->type == REDIS_REPLY_NIL) {
		rc = KVS_E_MISS;
	} else if (r->type != REDIS_REPLY_STRING) {
		return done(c, unexpected(c, "GET", r));
	} else {
		CNT(c, bytes_in, r->len);
		if (r->len > cap) {
			kvs__rcl_set_err(c, "value of %zu bytes, buffer of %zu", r->len, cap);
			rc = KVS_E_LIMIT;
		} else {
			size_t off = 0;
			for (int i = 0; i < iovcnt && off < r->len; i++) {
				size_t m = r->len - off < iov[i].iov_len ? r->len - off : iov[i].iov_len;
				memcpy(iov[i].iov_base, r->str + off, m);
				off += m;
			}
		}
		*ret_len = r->len;
	}
	freeReplyObject(r);
	return done(c, rc);
}

int kvs_rcluster_get(kvs_rcluster *c, const void *key, size_t klen, void *buf, size_t cap, size_t *ret_len)
{
	struct iovec iov = {buf, cap};
	return kvs_rcluster_getv(c, key, klen, &iov, 1, ret_len);
}

int kvs_rcluster_del(kvs_rcluster *c, const void *key, size_t klen)
{
	const char *argv[2] = {"DEL", bytes(key)};
	size_t lens[2] = {3, klen};
	redisReply *r;
	CNT(c, calls, 1);
	int rc = run(c, kvs_rcluster_keyslot(key, klen), 2, argv, lens, klen, &r);
	if (rc)
		return done(c, rc);
	if (r->type != REDIS_REPLY_INTEGER)
		return done(c, unexpected(c, "DEL", r));
	rc = r->integer > 0 ? 0 : KVS_E_MISS;
	freeReplyObject(r);
	return done(c, rc);
}

/* exists_many's per-key state. Keys of one node are chained through next in
 * the order their requests were sent (replies come back in that order). */
typedef struct xkey {
	uint32_t next;
	uint16_t slot;
	uint16_t target;   /* from a redirection; NODE_NONE: the map's */
	uint8_t asking;    /* the target came from ASK: send ASKING first */
	uint8_t redirects;
	uint8_t retried;   /* its node failed once already */
	uint8_t state;     /* X_PENDING, X_DONE */
} xkey;
enum { X_PENDING, X_DONE };
#define X_END UINT32_MAX

typedef struct xcall {
	kvs_rcluster *c;
	xkey *x;
	/* head_many: up to hlen bytes of each value into bufs[i], its length to
	 * lens[i] (0: absent); exists_many: hlen 0, bufs NULL */
	size_t hlen;
	void *const *bufs;
	size_t *lens;
	size_t left; /* keys still X_PENDING */
	int first;   /* first failure; its text: */
	char first_err[sizeof(((kvs_rcluster *)0)->err)];
	bool refresh;
} xcall;

static void x_fail(xcall *xc, uint32_t i, int rc)
{
	xc->x[i].state = X_DONE;
	xc->left--;
	if (!xc->first) {
		xc->first = rc;
		memcpy(xc->first_err, xc->c->err, sizeof(xc->first_err));
	}
}

/* i's node failed with rc: once, the key goes round again (after a refresh);
 * the second time it has no answer. */
static void x_retry(xcall *xc, uint32_t i, int rc)
{
	xkey *k = &xc->x[i];
	xc->refresh = true;
	if (k->retried) {
		x_fail(xc, i, rc == RC_STALE ? -EHOSTDOWN : rc);
		return;
	}
	k->retried = 1, k->target = NODE_NONE, k->asking = 0;
}

/* Reads the replies of node ni's chain. */
static void x_collect(kvs_rcluster *c, xcall *xc, uint32_t ni, uint32_t head, int64_t deadline, bool *out)
{
	for (uint32_t i = head; i != X_END; i = xc->x[i].next) {
		xkey *k = &xc->x[i];
		redisReply *r = NULL;
		int rc = 0;
		if (k->asking && !(rc = kvs__rcl_conn_read(c, ni, deadline, &r))) {
			freeReplyObject(r); /* ASKING's +OK (an error here shows again on EXISTS) */
			r = NULL;
		}
		if (!rc)
			rc = kvs__rcl_conn_read(c, ni, deadline, &r);
		if (rc) { /* the connection is gone: this key and the rest of the chain */
			for (uint32_t j = i; j != X_END; j = xc->x[j].next)
				x_retry(xc, j, rc);
			return;
		}
		c->nodes[ni].used = true, c->nodes[ni].fails = 0;
		if (!xc->bufs && r->type == REDIS_REPLY_INTEGER) {
			out[i] = r->integer > 0;
			k->state = X_DONE;
			xc->left--;
		} else if (xc->bufs && r->type == REDIS_REPLY_STRING) {
			size_t n = r->len < xc->hlen ? r->len : xc->hlen; /* GETRANGE never sends more */
			if (n)
				memcpy(xc->bufs[i], r->str, n);
			xc->lens[i] = n;
			out[i] = n > 0;
			CNT(c, bytes_in, n);
			k->state = X_DONE;
			xc->left--;
		} else if (r->type == REDIS_REPLY_ERROR) {
			uint16_t rslot, to;
			int kind = parse_redirect(c, ni, r, &rslot, &to);
			if (kind == REDIR_NONE) {
				rc = kvs__rcl_reply_error(c, ni, r);
				xc->refresh |= rc == -EHOSTDOWN;
				x_fail(xc, i, rc);
			} else if (kind < 0) {
				x_fail(xc, i, kind);
			} else if (++k->redirects > KVS_RCLUSTER_MAX_REDIRECTS) {
				kvs__rcl_set_err(c, "more than %d redirections for slot %u", KVS_RCLUSTER_MAX_REDIRECTS, k->slot);
				x_fail(xc, i, -ELOOP);
			} else {
				k->target = to;
				k->asking = kind == REDIR_ASK;
				if (kind == REDIR_MOVED) {
					c->slot[rslot] = to;
					CNT(c, moved, 1);
				} else {
					CNT(c, ask, 1);
				}
			}
		} else {
			kvs__rcl_set_err(c, "%s: unexpected reply type %d", xc->bufs ? "GETRANGE" : "EXISTS", r->type);
			x_fail(xc, i, -EPROTO);
		}
		freeReplyObject(r);
	}
}

/* exists_many and head_many: one pipelined round per node, then the
 * redirected and retried keys again. */
static int many(kvs_rcluster *c, const void *const *keys, const size_t *klens, size_t n, bool *out,
		size_t hlen, void *const *bufs, size_t *lens)
{
	static const char *ask_argv[1] = {"ASKING"};
	static const size_t ask_len[1] = {6};
	CNT(c, calls, 1);
	for (size_t i = 0; lens && i < n; i++)
		lens[i] = 0;
	if (n == 0)
		return 0;
	assert(n < X_END);
	char range_end[24];
	snprintf(range_end, sizeof(range_end), "%zu", hlen ? hlen - 1 : 0);
	int64_t deadline = kvs__rcl_now_ms() + c->cfg.op_timeout_ms;
	xcall xc = {.c = c, .x = calloc(n, sizeof(xkey)), .left = n, .hlen = hlen, .bufs = bufs, .lens = lens};
	uint32_t *head = NULL, *tail = NULL, cap = 0;
	if (!xc.x) {
		kvs__rcl_set_err(c, "out of memory");
		return done(c, -ENOMEM);
	}
	for (size_t i = 0; i < n; i++) {
		out[i] = false;
		xc.x[i].slot = kvs_rcluster_keyslot(keys[i], klens[i]);
		xc.x[i].target = NODE_NONE;
	}
	while (xc.left > 0) {
		if (xc.refresh) {
			refresh_after(c, deadline);
			xc.refresh = false;
		}
		if (kvs__rcl_now_ms() >= deadline) {
			kvs__rcl_set_err(c, "the call's time (op_timeout_ms %u) ran out with %zu keys unanswered",
				c->cfg.op_timeout_ms, xc.left);
			CNT(c, timeouts, 1);
			for (uint32_t i = 0; i < n; i++)
				if (xc.x[i].state == X_PENDING)
					x_fail(&xc, i, KVS_E_TIMEOUT);
			break;
		}
		if (cap < c->n_nodes) {
			uint32_t *h = realloc(head, 2 * c->n_nodes * sizeof(uint32_t));
			if (!h) {
				kvs__rcl_set_err(c, "out of memory");
				for (uint32_t i = 0; i < n; i++)
					if (xc.x[i].state == X_PENDING)
						x_fail(&xc, i, -ENOMEM);
				break;
			}
			head = h, tail = h + c->n_nodes, cap = c->n_nodes;
		}
		uint32_t nn = c->n_nodes;
		for (uint32_t j = 0; j < nn; j++)
			head[j] = X_END;
		/* group the pending keys by node */
		for (uint32_t i = 0; i < n; i++) {
			xkey *k = &xc.x[i];
			if (k->state != X_PENDING)
				continue;
			uint16_t ni = k->target != NODE_NONE ? k->target : c->slot[k->slot];
			if (ni == NODE_NONE) {
				kvs__rcl_set_err(c, "no node serves slot %u", k->slot);
				xc.refresh = true;
				x_fail(&xc, i, -EHOSTDOWN);
				continue;
			}
			k->next = X_END;
			if (head[ni] == X_END)
				head[ni] = i;
			else
				xc.x[tail[ni]].next = i;
			tail[ni] = i;
		}
		/* send every node its requests, then collect node by node */
		for (uint32_t ni = 0; ni < nn; ni++) {
			if (head[ni] == X_END)
				continue;
			int rc = kvs__rcl_node_connect(c, ni, deadline);
			for (uint32_t i = head[ni]; i != X_END && !rc; i = xc.x[i].next) {
				const char *argv[4] = {bufs ? "GETRANGE" : "EXISTS", bytes(keys[i]), "0", range_end};
				size_t alens[4] = {bufs ? 8 : 6, klens[i], 1, strlen(range_end)};
				if (xc.x[i].asking && (rc = kvs__rcl_append(c, ni, 1, ask_argv, ask_len)))
					break;
				if ((rc = kvs__rcl_append(c, ni, bufs ? 4 : 2, argv, alens)))
					break;
				CNT(c, commands, 1);
				CNT(c, bytes_out, klens[i]);
			}
			if (!rc)
				rc = kvs__rcl_conn_flush(c, ni, deadline);
			if (rc) {
				for (uint32_t i = head[ni]; i != X_END; i = xc.x[i].next)
					x_retry(&xc, i, rc);
				head[ni] = X_END;
			}
		}
		for (uint32_t ni = 0; ni < nn; ni++)
			if (head[ni] != X_END)
				x_collect(c, &xc, ni, head[ni], deadline, out);
	}
	free(head);
	free(xc.x);
	if (xc.first)
		memcpy(c->err, xc.first_err, sizeof(c->err));
	return done(c, xc.first);
}

int kvs_rcluster_exists_many(kvs_rcluster *c, const void *const *keys, const size_t *klens, size_t n,
			     bool *out)
{
	return many(c, keys, klens, n, out, 0, NULL, NULL);
}

int kvs_rcluster_head_many(kvs_rcluster *c, const void *const *keys, const size_t *klens, size_t n,
			   size_t hlen, void *const *bufs, size_t *lens)
{
	bool stack_out[64];
	bool *out = n <= 64 ? stack_out : malloc(n * sizeof(bool));
	if (!out) {
		kvs__rcl_set_err(c, "out of memory");
		return done(c, -ENOMEM);
	}
	if (hlen == 0) {
		kvs__rcl_set_err(c, "head_many: hlen 0");
		if (out != stack_out)
			free(out);
		return done(c, -EINVAL);
	}
	int rc = many(c, keys, klens, n, out, hlen, bufs, lens);
	if (out != stack_out)
		free(out);
	return rc;
}

int kvs_rcluster_refresh(kvs_rcluster *c)
{
	CNT(c, calls, 1);
	int rc = refresh(c, kvs__rcl_now_ms() + c->cfg.op_timeout_ms, true);
	return done(c, rc);
}

int kvs_rcluster_slot_node(const kvs_rcluster *c, uint16_t slot, char *buf, size_t cap)
{
	assert(slot < KVS_RCLUSTER_SLOTS);
	uint16_t ni = c->slot[slot];
	if (ni == NODE_NONE)
		return -ENOENT;
	const rnode *n = &c->nodes[ni];
	bool v6 = strchr(n->host, ':') != NULL;
	int w = snprintf(buf, cap, v6 ? "[%s]:%d" : "%s:%d", n->host, n->port);
	return w < 0 || (size_t)w >= cap ? -ENOSPC : 0;
}

const char *kvs_rcluster_last_error(const kvs_rcluster *c)
{
	return c->err;
}

void kvs_rcluster_get_stats(const kvs_rcluster *c, kvs_rcluster_stats *st)
{
#define LD(f) st->f = atomic_load_explicit(&c->st.f, memory_order_relaxed)
	LD(calls), LD(commands), LD(bytes_out), LD(bytes_in), LD(moved), LD(ask), LD(refreshes);
	LD(refresh_failures), LD(connects), LD(nodes_down), LD(errors), LD(timeouts), LD(nodes);
#undef LD
}
