/* ZeroMQ sockets in a plain poll(2) set (architecture.md §17.10): the
 * socket's ZMQ_FD only says that its state may have changed, and any send,
 * receive or ZMQ_EVENTS query may take that signal while messages wait, so
 * whoever polls the fd asks kvs_zmq_readable after it fires and again after
 * it used the socket. Used by the server's loop and libkvside's I/O thread. */
#ifndef KVS_ZFD_H
#define KVS_ZFD_H

#include <stdbool.h>
#include <stddef.h>
#include <zmq.h>

/* The socket's ZMQ_FD, or -1. */
static inline int kvs_zmq_fd(void *sock)
{
	int fd = -1;
	size_t l = sizeof(fd);
	return sock && zmq_getsockopt(sock, ZMQ_FD, &fd, &l) == 0 ? fd : -1;
}

/* Whether a message waits on the socket (ZMQ_EVENTS). */
static inline bool kvs_zmq_readable(void *sock)
{
	int ev = 0;
	size_t l = sizeof(ev);
	return zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &l) == 0 && (ev & ZMQ_POLLIN);
}

#endif
