/* Length-prefixed frames on a byte stream: the job lane's framing
 * (protocol.md §18), shared by the server (server/lane.c) and libkvside
 * (worker/client_lane.c). A frame is a 4-byte little-endian length n, then n
 * bytes. The reader keeps what arrived in a buffer that grows to hold the
 * largest frame in progress and shrinks back when it is empty. */
#ifndef KVS_FRAME_H
#define KVS_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "kvs_proto.h"

/* Lengths above this close the stream (protocol.md §18). */
#define KVS_FRAME_MAX (KVS_MAX_MSG_BYTES + 4096u)
#define KVS_FRAME_START (64u << 10) /* the reader's buffer when no large frame is in progress */

static inline void kvs_frame_hdr(uint8_t hdr[4], uint32_t n)
{
	hdr[0] = (uint8_t)n, hdr[1] = (uint8_t)(n >> 8), hdr[2] = (uint8_t)(n >> 16), hdr[3] = (uint8_t)(n >> 24);
}

/* Received bytes: [0, len) of cap at p; pos is where the next frame starts.
 * Zero-initialise; kvs_frame_free releases it. */
typedef struct kvs_frame_in {
	uint8_t *p;
	size_t len, cap, pos;
} kvs_frame_in;

/* One recv() into the free room (allocating the buffer first). Returns the
 * bytes read (> 0), 0 at end of stream, -EAGAIN when nothing is there,
 * -ENOMEM, or another -errno. *full is set when the read filled the room (more
 * may be waiting). */
long kvs_frame_recv(kvs_frame_in *in, int fd, int *full);
/* The next whole frame: 1 with its body in *body and *n (valid until the next
 * kvs_frame_recv or kvs_frame_compact), 0 when more bytes are needed (the
 * buffer then has room for the whole frame), -EPROTO for a length of 0 or
 * above KVS_FRAME_MAX, -ENOMEM. */
int kvs_frame_next(kvs_frame_in *in, const uint8_t **body, uint32_t *n);
/* Drops the frames handled so far (moves the rest to the front; shrinks a
 * grown buffer that emptied). */
void kvs_frame_compact(kvs_frame_in *in);
void kvs_frame_free(kvs_frame_in *in);

#endif
