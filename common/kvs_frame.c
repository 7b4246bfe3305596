/* Length-prefixed frames: see kvs_frame.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "kvs_frame.h"

long kvs_frame_recv(kvs_frame_in *in, int fd, int *full)
{
	if (!in->p) {
		if (!(in->p = malloc(KVS_FRAME_START)))
			return -ENOMEM;
		in->cap = KVS_FRAME_START;
	}
	size_t room = in->cap - in->len;
	ssize_t r;
	do
		r = recv(fd, in->p + in->len, room, MSG_DONTWAIT);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;
	in->len += (size_t)r;
	*full = (size_t)r == room;
	return (long)r;
}

int kvs_frame_next(kvs_frame_in *in, const uint8_t **body, uint32_t *n)
{
	if (in->len - in->pos < 4)
		return 0;
	const uint8_t *h = in->p + in->pos;
	uint32_t len = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
	if (len == 0 || len > KVS_FRAME_MAX)
		return -EPROTO;
	if (in->len - in->pos - 4 < len) {
		if (len + 4u > in->cap) { /* room for the whole frame, at the front */
			uint8_t *b = malloc(len + 4u);
			if (!b)
				return -ENOMEM;
			memcpy(b, in->p + in->pos, in->len - in->pos);
			free(in->p);
			in->p = b;
			in->cap = len + 4u;
			in->len -= in->pos;
			in->pos = 0;
		}
		return 0;
	}
	*body = h + 4;
	*n = len;
	in->pos += 4 + (size_t)len;
	return 1;
}

void kvs_frame_compact(kvs_frame_in *in)
{
	if (in->pos) {
		memmove(in->p, in->p + in->pos, in->len - in->pos);
		in->len -= in->pos;
		in->pos = 0;
	}
	if (in->len == 0 && in->cap > KVS_FRAME_START) {
		uint8_t *b = malloc(KVS_FRAME_START);
		if (b) {
			free(in->p);
			in->p = b;
			in->cap = KVS_FRAME_START;
		}
	}
}

void kvs_frame_free(kvs_frame_in *in)
{
	free(in->p);
	memset(in, 0, sizeof(*in));
}
