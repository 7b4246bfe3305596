/* The fd broker: an AF_UNIX SOCK_SEQPACKET socket in a private run directory.
 * Peers must have our UID (or the configured extra UID, checked with
 * SO_PEERCRED); each record carries up to KVS_BROKER_MAX_FDS allocation fds,
 * each with the token under which it is parked until a `register` claims it
 * (all of a record's fds are parked, or none). Anything else closes the
 * connection and parks nothing. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "broker"
#include "kvs_dirlock.h"
#include "kvs_fdpass.h"
#include "import.h"
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
	/* before anything in the directory is touched: a second server would
	 * replace the first one's sockets, and remove them when it exits */
	char why[600];
	if ((r = kvs_dirlock_take(srv->cfg.broker_dir, "kvside-server.lock", "broker directory", why, sizeof(why))) < 0) {
		kvs_err("%s", why);
		return r;
	}
	srv->dir_lock = r;
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
	/* one process may hold at most a share of the table (issue 16 #9) */
	srv->parked_quota = srv->max_parked / 8;
	if (srv->parked_quota < 2 * KVS_MAX_ALLOCS)
		srv->parked_quota = 2 * KVS_MAX_ALLOCS < srv->max_parked ? 2 * KVS_MAX_ALLOCS : srv->max_parked;
	/* a spare fd, released to accept-and-close a peer when the table is full */
	srv->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	return 0;
}

static void conn_remove(kvs_server *srv, int idx)
{
	close(srv->conns[idx].fd);
	srv->conns[idx] = srv->conns[--srv->n_conns];
}

/* The fd may be a memfd's last reference (its engine died before it
 * registered): closed on the reclaim thread, which frees such memory off
 * the loop (inline once the queue is gone, at shutdown). */
static void parked_free(kvs_server *srv, kvs_parked *p)
{
	kvs_host_release(srv->reclaimq, NULL, 0, p->fd);
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
			parked_free(srv, p);
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

atomic_uint_fast64_t kvs_accept_shed;

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
			.fd = fd, .uid = cr.uid, .pid = cr.pid, .expires_ms = srv->now_ms + KVS_BROKER_CONN_IDLE_MS};
	}
}

static void send_status(int fd, int status)
{
	uint8_t rep[KVS_BROKER_REP_BYTES];
	kvs_broker_rep_pack(status, rep);
	(void)kvs_fd_send(fd, rep, sizeof(rep), NULL, 0); /* non-blocking; a full buffer loses it */
}

/* Parks every fd of one record under its entry's token, or none: returns 0,
 * or the status to refuse the whole record with (the caller then still owns
 * and closes every fd). */
static int park_all(kvs_server *srv, const kvs_broker_conn *c, const kvs_broker_entry *e,
		    const int *fds, uint32_t n)
{
	/* a token is good for one fd, once: not parked, not recently claimed, not
	 * twice in this record */
	for (uint32_t i = 0; i < n; i++) {
		if (kvs_htab_get(srv->parked, e[i].token) ||
		    (srv->consumed && kvs_htab_get(srv->consumed, e[i].token)))
			return KVS_E_AUTH;
		for (uint32_t j = 0; j < i; j++)
			if (memcmp(e[i].token, e[j].token, 16) == 0)
				return KVS_E_AUTH;
	}
	if (kvs_htab_count(srv->parked) + n > srv->max_parked)
		return KVS_E_LIMIT;
	/* one process may hold at most a share of the table, so a single client
	 * cannot block every other registration (issue 16 #9) */
	uint32_t mine = 0, quota = srv->parked_quota;
	size_t pos = 0;
	kvs_parked *q;
	while ((q = kvs_htab_next(srv->parked, &pos)) != NULL)
		mine += q->pid == c->pid;
	if (mine + n > quota)
		return KVS_E_LIMIT;
	for (uint32_t i = 0; i < n; i++) {
		kvs_parked *p = calloc(1, sizeof(*p));
		if (p) {
			memcpy(p->token, e[i].token, 16);
			memcpy(p->alloc_id, e[i].alloc_id, 16);
			p->size = e[i].size;
			p->fd = fds[i];
			p->uid = c->uid;
			p->pid = c->pid;
			p->expires_ms = srv->now_ms + srv->cfg.fd_park_ms;
		}
		if (!p || kvs_htab_put(srv->parked, p) < 0) {
			free(p);
			while (i-- > 0) /* unpark what this record parked; fds stay the caller's */
				free(kvs_htab_del(srv->parked, e[i].token));
			return KVS_E_INTERNAL;
		}
	}
	return 0;
}

/* One record from a peer (protocol.md §13): version 1 (one entry) or 2 (up to
 * KVS_BROKER_MAX_FDS entries). Reads at most one record per call and never
 * blocks: the socket is non-blocking and the reply is sent MSG_DONTWAIT. */
void kvs__broker_conn_ready(kvs_server *srv, int idx)
{
	kvs_broker_conn *c = &srv->conns[idx];
	uint8_t rec[KVS_BROKER_REC_MAX + 1]; /* one more: a longer record is truncated, refused */
	kvs_broker_entry ents[KVS_BROKER_MAX_FDS];
	int fds[KVS_BROKER_MAX_FDS], nfds = 0;
	size_t len = 0;
	int r = kvs_fd_recv(c->fd, rec, sizeof(rec), &len, fds, KVS_BROKER_MAX_FDS, &nfds);
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
	uint32_t n = 0;
	int status = kvs_broker_rec_unpack(rec, len, ents, &n);
	bool reply = true; /* refusals of a well-formed record say why; garbage gets no reply */
	const char *why = NULL;
	if (status == KVS_E_VERSION) {
		why = "unsupported record version (this server reads 1 and 2)";
	} else if (status) {
		why = "malformed record (length, magic, flags or entry count)";
		reply = false;
	} else if ((uint32_t)nfds != n) {
		why = "fd count differs from the record's entry count";
		status = KVS_E_BADMSG;
		reply = false;
	} else {
		status = park_all(srv, c, ents, fds, n);
	}
	if (reply)
		send_status(c->fd, status);
	if (status) {
		kvs_warn("refused a record of %d fds: %s", nfds, why ? why : kvs_strerror(status));
		srv->st.broker_rejected++;
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		conn_remove(srv, idx);
		return;
	}
	srv->st.broker_parked += n;
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
		parked_free(srv, p);
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
