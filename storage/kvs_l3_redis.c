/* The L3 tier's Redis Cluster backend: kvs_rcluster behind the seam of
 * kvs_l3.h, one cluster client per worker connection. */
#include <errno.h>
#include <sys/uio.h>

#include "kvs_l3.h"
#include "kvs_rcluster.h"

static int r_open(const kvs_l3_config *cfg, void **conn, char *err, size_t errlen)
{
	kvs_rcluster_config rc;
	kvs_rcluster_config_defaults(&rc);
	rc.seeds = cfg->seeds;
	rc.user = cfg->user && cfg->user[0] ? cfg->user : NULL;
	rc.password = cfg->password;
	rc.connect_timeout_ms = cfg->timeout_ms;
	rc.io_timeout_ms = cfg->timeout_ms;
	rc.op_timeout_ms = 2 * cfg->timeout_ms;
	rc.down_ms = 1000;
	kvs_rcluster *c;
	int r = kvs_rcluster_open(&rc, &c, err, errlen);
	if (r == 0)
		*conn = c;
	return r;
}

static void r_close(void *conn) { kvs_rcluster_close(conn); }

static int r_put(void *conn, const void *key, size_t klen, const void *val, size_t vlen)
{
	return kvs_rcluster_set(conn, key, klen, val, vlen);
}

static int r_get2(void *conn, const void *key, size_t klen, void *a, size_t alen, void *b, size_t blen,
		  size_t *ret_len)
{
	struct iovec iov[2] = {{a, alen}, {b, blen}};
	return kvs_rcluster_getv(conn, key, klen, iov, 2, ret_len);
}

static int r_head_many(void *conn, const void *const *keys, const size_t *klens, size_t n, size_t hlen,
		       void *const *bufs, size_t *lens)
{
	return kvs_rcluster_head_many(conn, keys, klens, n, hlen, bufs, lens);
}

static int r_del(void *conn, const void *key, size_t klen) { return kvs_rcluster_del(conn, key, klen); }

static const char *r_last_error(void *conn) { return kvs_rcluster_last_error(conn); }

static void r_stats(void *conn, kvs_l3_backend_stats *st)
{
	kvs_rcluster_stats s;
	kvs_rcluster_get_stats(conn, &s);
	st->moved += s.moved;
	st->ask += s.ask;
	st->refreshes += s.refreshes;
	st->nodes_down += s.nodes_down;
	st->timeouts += s.timeouts;
}

static const kvs_l3_backend redis_backend = {
	.name = "redis-cluster",
	.open = r_open,
	.close = r_close,
	.put = r_put,
	.get2 = r_get2,
	.head_many = r_head_many,
	.del = r_del,
	.last_error = r_last_error,
	.stats = r_stats,
};

const kvs_l3_backend *kvs_l3_redis_backend(void) { return &redis_backend; }
