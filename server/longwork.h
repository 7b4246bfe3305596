/* Long work the server does in the background, and the lines it logs for it
 * (longwork.c): the L1 prefault (whose thread lives here), the CUDA
 * engine's pinning of L1, a write-behind backlog draining into L2, and the
 * flush of L2's queue at shutdown. Each logs when it starts, every
 * KVS_PROGRESS_MS while it runs, and when it ends, so an operator can tell
 * a busy server from a stuck one. */
#ifndef KVS_LONGWORK_H
#define KVS_LONGWORK_H

#include <stdint.h>

#define KVS_PROGRESS_MS 10000
/* a write-behind backlog is logged from this many queued bytes on, and
 * called drained below an eighth of it */
#define KVS_BACKLOG_LOG_BYTES (256ull << 20)

struct kvs_server;

/* Starts the L1 prefault thread (cfg.l1_prefault) once the sockets are
 * bound; a failure to start it only skips the prefault. */
void kvs__prefault_start(struct kvs_server *srv);
/* Stops and joins the prefault thread (if running). */
void kvs__prefault_stop(struct kvs_server *srv);
/* The loop's tick: start, progress and end lines. */
void kvs__longwork_tick(struct kvs_server *srv);
/* At shutdown, before L2 closes: logs the queue it writes first; the
 * returned time goes to kvs__longwork_flushed. */
uint64_t kvs__longwork_flushing(struct kvs_server *srv);
void kvs__longwork_flushed(struct kvs_server *srv, uint64_t t0_ms);

#endif
