/* Job lanes (lane.c, protocol.md §18): a session's second, local channel. A
 * client passes one end of an AF_UNIX stream socket pair through the fd
 * broker and claims it with `lane`; from then on the loop reads the
 * session's requests from it directly (length-prefixed msgpack, the same
 * messages as on ZeroMQ) and answers on it, so a job's messages skip
 * ZeroMQ's I/O threads: two thread hand-offs per direction fewer.
 *
 * A lane is addressed like a ZeroMQ peer, by a routing id of its own (a
 * "lane ident": a prefix no ZeroMQ routing id carries, the lane's number and
 * the ZeroMQ routing id of the `lane` request). Requests read from a lane
 * are dispatched with that ident, so sessions, held requests and deferred
 * replies need no change; reply.c hands every message for a lane ident to
 * kvs__lane_send, which collects them until the loop iteration ends
 * (kvs__lanes_flush); what a lane cannot take (gone, or its socket full of
 * earlier bytes) goes to the embedded ZeroMQ routing id instead: replies
 * may arrive out of order (§4).
 *
 * Main-loop thread only. */
#ifndef KVS_LANE_H
#define KVS_LANE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <poll.h>

#include "server.h"

int kvs__lanes_create(kvs_server *srv);
/* Closes every lane (after the sessions are gone). */
void kvs__lanes_destroy(kvs_server *srv);

/* Makes fd (a claimed broker fd, now the lane's) s's lane; a lane s had is
 * closed. 0, or a kvs error with *why, fd closed. */
int kvs__lane_attach(kvs_server *srv, kvs_session *s, int fd, const char **why);
/* The session is closing: its lane (if any) is closed. */
void kvs__lane_session_gone(kvs_server *srv, kvs_session *s);

/* Poll entries of the open lanes, appended at fds[0..]; returns how many (at
 * most cap). kvs__lanes_ready takes the same entries back after the poll. */
int kvs__lanes_items(kvs_server *srv, struct pollfd *fds, int cap);
void kvs__lanes_ready(kvs_server *srv, const struct pollfd *fds, int n);
int kvs__lanes_count(const kvs_server *srv);
/* The loop's tick: lanes whose large frame stalled are closed (lane.c). */
void kvs__lanes_tick(kvs_server *srv);

/* True if ident starts like a lane ident (ZeroMQ peers may not use these). */
bool kvs__in_lane_space(const void *ident, size_t ident_len);
/* True if ident is a lane ident. */
bool kvs__is_lane_ident(const void *ident, size_t ident_len);
/* The ZeroMQ routing id inside a lane ident (ident itself otherwise). */
void kvs__zmq_ident(const void **ident, size_t *ident_len);
/* reply.c: queues buf (len bytes, malloc'd) for the lane named by a lane
 * ident. Returns 1 if the lane took it (buf is freed: its bytes are in the
 * lane's buffer), 0 when the caller must send it over ZeroMQ (buf still the
 * caller's: the lane is gone or full), -1 when the ident names a live lane
 * but is not that lane's (another secret or routing id: forged; the caller
 * drops buf). The bytes leave at kvs__lanes_flush. */
int kvs__lane_send(kvs_server *srv, const void *ident, size_t ident_len, void *buf, size_t len);
/* The end of a loop iteration: every lane writes what it was given during
 * it, in one system call where the socket takes it all (a job's replies
 * to one session, say a store's, its complete's and the job_done push,
 * leave together). A lane whose socket is full keeps the rest for POLLOUT.
 * Whatever makes replies outside an iteration's handling (the parts
 * kvs_cuda_poll completes before the poll) calls it before the loop
 * sleeps: a reply left in a buffer waits for the next wake-up (50 ms, the
 * tick, when nothing else comes). */
void kvs__lanes_flush(kvs_server *srv);

/* Before the loop builds its poll set (and so before it sleeps): a lane
 * still holding replies given since the last kvs__lanes_flush means a path
 * that made replies outside an iteration without flushing (kvs_cuda_poll's
 * completions flush themselves). Such bytes would wait for the next wake-up
 * (the 50 ms tick when nothing comes): they are written now, counted
 * (lane_late_flushes; the GPU suite checks it stays 0) and logged. */
void kvs__lanes_before_poll(kvs_server *srv);

typedef struct kvs_lane_stats {
	uint64_t open;      /* lanes open now */
	uint64_t attached;  /* cum. lanes attached */
	uint64_t closed_bad; /* cum. lanes closed for a bad frame or a read error */
	uint64_t requests;  /* cum. requests read from lanes */
	uint64_t replies;   /* cum. replies and pushes written to lanes */
	uint64_t diverted;  /* cum. replies for a lane sent over ZeroMQ instead */
	uint64_t writes;    /* cum. system calls that wrote lane bytes */
	uint64_t late;      /* cum. kvs__lanes_before_poll calls that found replies left unwritten */
	uint64_t forged;    /* cum. replies dropped: their ident named a live lane but was not its own */
	uint64_t closed_budget;  /* cum. lanes closed: their large frame would pass the lanes' input budget */
	uint64_t closed_stalled; /* cum. lanes closed: their large frame received nothing for 5 s */
	uint64_t big_bytes;      /* input held now for frames above 64 KiB, over every lane */
} kvs_lane_stats;
void kvs__lanes_stats(const kvs_server *srv, kvs_lane_stats *out);

#endif
