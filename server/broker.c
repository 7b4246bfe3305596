/* The fd broker: an AF_UNIX SOCK_SEQPACKET socket in a private run directory.
 * Peers must have our UID (or the configured extra UID, checked with
 * SO_PEERCRED); each record carries one allocation fd and the token under
 * which it is parked until a `register` claims it. Anything else closes the
 * connection and parks nothing. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "broker"
#include "kvs_fdpass.h"
#include "kvs_log.h"
#include "server.h"

/* Makes sure dir is a real directory (not a symlink) owned by us with mode
 * 0700, creating it if missing. */
static int check_run_dir(const char *dir)
{
	struct stat st;
	if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
		int e = errno;
		kvs_err("cannot create broker directory %s: %s", dir, strerror(e));
		return -e;
	}
	if (lstat(dir, &st) < 0) {
		int e = errno;
		kvs_err("cannot stat %s: %s", dir, strerror(e));
		return -e;
	}
	if (!S_ISDIR(st.st_mode)) {
		kvs_err("broker directory %s is not a real directory (symlink or file)", dir);
		return -ENOTDIR;
	}
	if (st.st_uid != geteuid()) {
		kvs_err("broker directory %s is owned by uid %u, not by us (%u)", dir,
			(unsigned)st.st_uid, (unsigned)geteuid());
		return -EPERM;
	}
	if ((st.st_mode & 0777) != 0700 && chmod(dir, 0700) < 0) {
		int e = errno;
		kvs_err("cannot set mode 0700 on %s: %s", dir, strerror(e));
		return -e;
	}
	return 0;
}

int kvs__broker_open(kvs_server *srv)
{
	int r = check_run_dir(srv->cfg.broker_dir);
	if (r)
		return r;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if ((size_t)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s", srv->cfg.broker_dir,
			     KVS_BROKER_SOCK_NAME) >= sizeof(sa.sun_path)) {
		kvs_err("broker path too long");
		return -ENAMETOOLONG;
	}
	snprintf(srv->broker_path, sizeof(srv->broker_path), "%s", sa.sun_path);
	struct stat st;
	if (lstat(sa.sun_path, &st) == 0) {
		if (!S_ISSOCK(st.st_mode)) {
			kvs_err("%s exists and is not a socket", sa.sun_path);
			return -EEXIST;
		}
		unlink(sa.sun_path); /* stale socket from an earlier run */
	}
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	mode_t old = umask(0177);
	r = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	umask(old);
	if (r < 0 || chmod(sa.sun_path, 0600) < 0 || listen(fd, 64) < 0) {
		r = -errno;
		kvs_err("cannot listen on %s: %s", sa.sun_path, strerror(-r));
		close(fd);
		return r;
	}
	srv->broker_fd = fd;
	/* parked fds must never exhaust the process's fd table (libzmq aborts
	 * on EMFILE): keep at most a quarter of it for them */
	struct rlimit rl;
	srv->max_parked = KVS_MAX_PARKED;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur / 4 < KVS_MAX_PARKED)
		srv->max_parked = (uint32_t)(rl.rlim_cur / 4);
	/* a spare fd, released to accept-and-close a peer when the table is full */
	srv->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	return 0;
}

static void conn_remove(kvs_server *srv, int idx)
{
	close(srv->conns[idx].fd);
	srv->conns[idx] = srv->conns[--srv->n_conns];
}

static void parked_free(kvs_parked *p)
{
	close(p->fd);
	free(p);
}

void kvs__broker_close(kvs_server *srv)
{
	while (srv->n_conns)
		conn_remove(srv, 0);
	if (srv->parked) {
		size_t pos = 0;
		kvs_parked *p;
		while ((p = kvs_htab_next(srv->parked, &pos)) != NULL) {
			kvs_htab_iter_del(srv->parked, &pos);
			parked_free(p);
		}
	}
	kvs_htab_destroy(srv->consumed);
	srv->consumed = NULL;
	free(srv->consumed_ring);
	srv->consumed_ring = NULL;
	if (srv->spare_fd >= 0)
		close(srv->spare_fd);
	srv->spare_fd = -1;
	if (srv->broker_fd >= 0) {
		close(srv->broker_fd);
		unlink(srv->broker_path);
		srv->broker_fd = -1;
	}
}

void kvs__broker_accept(kvs_server *srv)
{
	for (;;) {
		int fd = accept4(srv->broker_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0 && (errno == EMFILE || errno == ENFILE) && srv->spare_fd >= 0) {
			/* out of fds: shed this peer instead of spinning on it */
			close(srv->spare_fd);
			fd = accept4(srv->broker_fd, NULL, NULL, SOCK_CLOEXEC);
			if (fd >= 0)
				close(fd);
			srv->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
			srv->st.broker_rejected++;
			kvs_warn("out of file descriptors: refused a broker peer");
			continue;
		}
		if (fd < 0)
			return;
		struct ucred cr;
		socklen_t cl = sizeof(cr);
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) < 0 ||
		    (cr.uid != geteuid() && (srv->cfg.allow_uid < 0 || cr.uid != (uid_t)srv->cfg.allow_uid))) {
			kvs_warn("refused peer pid %d uid %u (not allowed)", (int)cr.pid,
				 (unsigned)cr.uid);
			srv->st.broker_rejected++;
			close(fd);
			continue;
		}
		if (srv->n_conns >= KVS_MAX_BROKER_CONNS) {
			kvs_warn("too many connections, refusing pid %d", (int)cr.pid);
			srv->st.broker_rejected++;
			close(fd);
			continue;
		}
		srv->st.broker_accepted++;
		srv->conns[srv->n_conns++] = (kvs_broker_conn){
			.fd = fd, .uid = cr.uid, .expires_ms = srv->now_ms + KVS_BROKER_CONN_IDLE_MS};
	}
}

static void send_status(int fd, int status)
{
	uint8_t rep[KVS_BROKER_REP_BYTES] = {'K', 'V', 'S', 'R'};
	uint32_t u = (uint32_t)status;
	for (int i = 0; i < 4; i++)
		rep[4 + i] = (uint8_t)(u >> (8 * i));
	(void)kvs_fd_send(fd, rep, sizeof(rep), NULL, 0);
}

void kvs__broker_conn_ready(kvs_server *srv, int idx)
{
	kvs_broker_conn *c = &srv->conns[idx];
	uint8_t rec[KVS_BROKER_REQ_BYTES + 1];
	size_t len = 0;
	int fds[1], nfds = 0;
	int r = kvs_fd_recv(c->fd, rec, sizeof(rec), &len, fds, 1, &nfds);
	if (r == -EAGAIN)
		return;
	if (r < 0) {
		if (r != -ECONNRESET) {
			kvs_warn("dropping peer: %s", strerror(-r));
			srv->st.broker_rejected++;
		}
		conn_remove(srv, idx);
		return;
	}
	kvs_broker_req req;
	const char *why = NULL;
	if (len != KVS_BROKER_REQ_BYTES)
		why = "record of wrong length";
	else if (nfds != 1)
		why = "record without an fd";
	else if (kvs_broker_req_unpack(rec, &req) != 0)
		why = "bad magic, version or flags";
	if (why) {
		kvs_warn("dropping peer: %s", why);
		srv->st.broker_rejected++;
		if (nfds)
			close(fds[0]);
		conn_remove(srv, idx);
		return;
	}
	int status = 0;
	if (kvs_htab_get(srv->parked, req.token) || (srv->consumed && kvs_htab_get(srv->consumed, req.token)))
		status = KVS_E_AUTH; /* a token is good for one fd, once */
	else if (kvs_htab_count(srv->parked) >= srv->max_parked)
		status = KVS_E_LIMIT;
	kvs_parked *p = NULL;
	if (!status) {
		p = calloc(1, sizeof(*p));
		if (!p)
			status = KVS_E_INTERNAL;
	}
	if (!status) {
		memcpy(p->token, req.token, 16);
		memcpy(p->alloc_id, req.alloc_id, 16);
		p->size = req.size;
		p->fd = fds[0];
		p->uid = c->uid;
		p->expires_ms = srv->now_ms + srv->cfg.fd_park_ms;
		if (kvs_htab_put(srv->parked, p) < 0) {
			free(p);
			status = KVS_E_INTERNAL;
		}
	}
	send_status(c->fd, status);
	if (status) {
		kvs_warn("refused record: %s", kvs_strerror(status));
		srv->st.broker_rejected++;
		close(fds[0]);
		conn_remove(srv, idx);
		return;
	}
	srv->st.broker_parked++;
	c->expires_ms = srv->now_ms + KVS_BROKER_CONN_IDLE_MS;
}

void kvs__broker_expire(kvs_server *srv)
{
	for (int i = srv->n_conns - 1; i >= 0; i--)
		if (srv->conns[i].expires_ms <= srv->now_ms)
			conn_remove(srv, i);
	size_t pos = 0;
	kvs_parked *p;
	while ((p = kvs_htab_next(srv->parked, &pos)) != NULL) {
		if (p->expires_ms > srv->now_ms)
			continue;
		kvs_htab_iter_del(srv->parked, &pos);
		srv->st.broker_expired++;
		kvs_info("closing unclaimed fd after %llu ms", (unsigned long long)srv->cfg.fd_park_ms);
		parked_free(p);
	}
}

#define CONSUMED_RING 4096

kvs_parked *kvs__broker_claim(kvs_server *srv, const uint8_t token[16])
{
	kvs_parked *p = kvs_htab_del(srv->parked, token);
	if (!p)
		return NULL;
	/* remember the last CONSUMED_RING claimed tokens so a replay is refused */
	if (!srv->consumed_ring) {
		srv->consumed_ring = calloc(CONSUMED_RING, sizeof(*srv->consumed_ring));
		if (!srv->consumed_ring || kvs_htab_create(16, 0, &srv->consumed) < 0) {
			free(srv->consumed_ring);
			srv->consumed_ring = NULL;
			return p;
		}
	}
	struct kvs_token_ent *e = &srv->consumed_ring[(srv->consumed_head + srv->consumed_n) % CONSUMED_RING];
	if (srv->consumed_n == CONSUMED_RING) {
		e = &srv->consumed_ring[srv->consumed_head];
		kvs_htab_del(srv->consumed, e->token);
		srv->consumed_head = (srv->consumed_head + 1) % CONSUMED_RING;
		srv->consumed_n--;
	}
	memcpy(e->token, token, 16);
	if (kvs_htab_put(srv->consumed, e) == 0)
		srv->consumed_n++;
	return p;
}
