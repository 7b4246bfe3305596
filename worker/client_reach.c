/* Why a client cannot reach its server (issue 39), said before it waits:
 * an ipc:// endpoint's directory and socket are checked at open (missing,
 * another user's, no server listening behind a stale socket), and a
 * tcp:// connection is watched by a ZeroMQ monitor whose events explain a
 * hello that timed out (nothing listening, the CURVE key refused, the
 * handshake failed). The text goes to the log and to kvs_last_error(). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#define KVS_LOG_COMPONENT "client"
#include "client_int.h"
#include "kvs_log.h"

static _Thread_local char last_error[1400];

const char *kvs_last_error(void) { return last_error; }

void kvs__last_error_set(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
}

/* The directory part of PATH into dir. */
static void dir_of(const char *path, char *dir, size_t cap)
{
	snprintf(dir, cap, "%s", path);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir)
		*slash = 0;
	else if (slash)
		slash[1] = 0;
	else
		snprintf(dir, cap, ".");
}

/* "owned by uid U (mode M)" for dir, into b. */
static void owner_of(const char *dir, char *b, size_t cap)
{
	struct stat st;
	if (stat(dir, &st) == 0)
		snprintf(b, cap, "belongs to uid %u (mode %04o)", (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
	else
		snprintf(b, cap, "cannot be read");
}

int kvs__reach_ipc(const char *endpoint, char *why, size_t cap)
{
	if (strncmp(endpoint, "ipc://", 6) != 0)
		return 0;
	const char *path = endpoint + 6;
	char dir[600], own[80];
	dir_of(path, dir, sizeof(dir));
	struct stat st;
	if (stat(dir, &st) < 0) {
		int e = errno;
		if (e == ENOENT)
			snprintf(why, cap, "broker directory %s does not exist: no kvside-server runs with --broker-dir %s "
				 "(start one, or point this client at the directory its server uses)", dir, dir);
		else
			snprintf(why, cap, "cannot reach broker directory %s: %s (this process runs as uid %u)", dir,
				 strerror(e), (unsigned)geteuid());
		return -e;
	}
	if (stat(path, &st) < 0) {
		int e = errno;
		owner_of(dir, own, sizeof(own));
		if (e == EACCES)
			snprintf(why, cap, "permission denied on %s: the directory %s and this process runs as uid %u "
				 "(run the engine as the server's user, or start the server with allow-uid: %u)", path, own,
				 (unsigned)geteuid(), (unsigned)geteuid());
		else if (e == ENOENT)
			snprintf(why, cap, "no kvside-server is listening in %s: %s is not there (the server stopped, "
				 "or has not started)", dir, path);
		else
			snprintf(why, cap, "cannot reach %s: %s", path, strerror(e));
		return e == ENOENT ? -ECONNREFUSED : -e;
	}
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(sa.sun_path))
		return 0; /* libzmq says what it makes of it */
	memcpy(sa.sun_path, path, strlen(path) + 1);
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return 0;
	int r = connect(s, (struct sockaddr *)&sa, sizeof(sa));
	int e = errno;
	close(s);
	if (r == 0)
		return 0;
	if (e == ECONNREFUSED) {
		snprintf(why, cap, "no kvside-server is listening on %s: the socket was left by a server that is "
			 "gone (killed?); start kvside-server --broker-dir %s", path, dir);
		return -ECONNREFUSED;
	}
	if (e == EACCES) {
		owner_of(path, own, sizeof(own));
		snprintf(why, cap, "permission denied on %s: it %s and this process runs as uid %u (run the engine "
			 "as the server's user, or start the server with allow-uid: %u)", path, own, (unsigned)geteuid(),
			 (unsigned)geteuid());
		return -EACCES;
	}
	return 0; /* EAGAIN (a full backlog) and the like: the hello tells */
}

/* ---- tcp:// --------------------------------------------------------------- */

#define MON_EVENTS (ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED | \
		    ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | \
		    ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)

int kvs__monitor_start(kvs_client *c)
{
	if (strncmp(c->endpoint, "tcp://", 6) != 0)
		return 0;
	char ep[64];
	snprintf(ep, sizeof(ep), "inproc://kvs-monitor-%p", (void *)c);
	if (zmq_socket_monitor(c->dealer, ep, MON_EVENTS) != 0)
		return 0; /* only the explanation is lost */
	c->monitor = zmq_socket(c->zctx, ZMQ_PAIR);
	if (c->monitor && zmq_connect(c->monitor, ep) != 0) {
		zmq_close(c->monitor);
		c->monitor = NULL;
	}
	return 0;
}

void kvs__monitor_explain(kvs_client *c, int timeout_ms, char *why, size_t cap)
{
	unsigned seen = 0;
	uint32_t auth_status = 0;
	while (c->monitor) {
		zmq_msg_t ev, addr;
		zmq_msg_init(&ev);
		if (zmq_msg_recv(&ev, c->monitor, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&ev);
			break;
		}
		if (zmq_msg_size(&ev) >= 6) {
			const uint8_t *d = zmq_msg_data(&ev);
			uint16_t id;
			uint32_t val;
			memcpy(&id, d, 2);
			memcpy(&val, d + 2, 4);
			seen |= id;
			if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
				auth_status = val;
		}
		zmq_msg_close(&ev);
		zmq_msg_init(&addr); /* the second frame: the address */
		if (zmq_msg_recv(&addr, c->monitor, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&addr);
			break;
		}
		zmq_msg_close(&addr);
	}
	if (seen & ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
		snprintf(why, cap, "the server at %s refused this client's CURVE key (ZAP status %u): add the client's "
			 "public key to the server's authorized-keys", c->endpoint, (unsigned)auth_status);
	else if (seen & (ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL))
		snprintf(why, cap, "the ZeroMQ handshake with %s failed: a wrong server key, a client without CURVE "
			 "keys for a CURVE server (or keys for one without), or not a kvside-server", c->endpoint);
	else if ((seen & ZMQ_EVENT_CONNECT_RETRIED) && !(seen & ZMQ_EVENT_CONNECTED))
		snprintf(why, cap, "nothing is listening at %s (connection refused, retried for %d ms)", c->endpoint,
			 timeout_ms);
	else if (seen & ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
		snprintf(why, cap, "connected to %s, but its hello was not answered within %d ms (a stalled server?)",
			 c->endpoint, timeout_ms);
	else if (seen & ZMQ_EVENT_CONNECTED)
		snprintf(why, cap, "connected to %s, but no ZeroMQ handshake within %d ms (not a kvside-server?)",
			 c->endpoint, timeout_ms);
	else
		snprintf(why, cap, "no answer from %s within %d ms (no route to it, or a firewall drops it?)",
			 c->endpoint, timeout_ms);
}

void kvs__monitor_stop(kvs_client *c)
{
	if (!c->monitor)
		return;
	/* the dealer's monitor first (libzmq guards it with a lock of its own,
	 * so the I/O thread may be using the dealer): its last event goes to
	 * a peer that still reads */
	zmq_socket_monitor(c->dealer, NULL, 0);
	zmq_close(c->monitor);
	c->monitor = NULL;
}
