/* SCM_RIGHTS fd passing and the broker record codec. */
#include "kvs_fdpass.h"

#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvs_error.h"

static void put_le(uint8_t *p, uint64_t v, int n)
{
	for (int i = 0; i < n; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
	uint64_t v = 0;
	for (int i = n - 1; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

static void entry_put(uint8_t *p, const kvs_broker_entry *e)
{
	memcpy(p, e->token, 16);
	memcpy(p + 16, e->alloc_id, 16);
	put_le(p + 32, e->size, 8);
}

static void entry_get(const uint8_t *p, kvs_broker_entry *e)
{
	memcpy(e->token, p, 16);
	memcpy(e->alloc_id, p + 16, 16);
	e->size = get_le(p + 32, 8);
}

size_t kvs_broker_rec_pack(const kvs_broker_entry *e, uint32_t n, uint8_t *out)
{
	if (n == 0 || n > KVS_BROKER_MAX_FDS)
		return 0;
	memset(out, 0, KVS_BROKER_HDR_BYTES);
	memcpy(out, "KVSB", 4);
	put_le(out + 4, 2, 2);
	put_le(out + 8, n, 2);
	for (uint32_t i = 0; i < n; i++)
		entry_put(out + KVS_BROKER_HDR_BYTES + (size_t)i * KVS_BROKER_ENTRY_BYTES, &e[i]);
	return KVS_BROKER_HDR_BYTES + (size_t)n * KVS_BROKER_ENTRY_BYTES;
}

void kvs_broker_v1_pack(const kvs_broker_entry *e, uint8_t out[KVS_BROKER_V1_BYTES])
{
	memcpy(out, "KVSB", 4);
	put_le(out + 4, 1, 2);
	put_le(out + 6, 0, 2);
	entry_put(out + 8, e);
}

int kvs_broker_rec_unpack(const uint8_t *in, size_t len, kvs_broker_entry *out, uint32_t *ret_n)
{
	static const uint8_t zero[6];
	if (len < 8 || memcmp(in, "KVSB", 4) != 0)
		return KVS_E_BADMSG;
	uint64_t version = get_le(in + 4, 2);
	if (version != 1 && version != 2)
		return KVS_E_VERSION;
	if (get_le(in + 6, 2) != 0)
		return KVS_E_BADMSG;
	if (version == 1) {
		if (len != KVS_BROKER_V1_BYTES)
			return KVS_E_BADMSG;
		entry_get(in + 8, &out[0]);
		*ret_n = 1;
		return 0;
	}
	if (len < KVS_BROKER_HDR_BYTES || memcmp(in + 10, zero, sizeof(zero)) != 0)
		return KVS_E_BADMSG;
	uint32_t n = (uint32_t)get_le(in + 8, 2);
	if (n == 0 || n > KVS_BROKER_MAX_FDS ||
	    len != KVS_BROKER_HDR_BYTES + (size_t)n * KVS_BROKER_ENTRY_BYTES)
		return KVS_E_BADMSG;
	for (uint32_t i = 0; i < n; i++)
		entry_get(in + KVS_BROKER_HDR_BYTES + (size_t)i * KVS_BROKER_ENTRY_BYTES, &out[i]);
	*ret_n = n;
	return 0;
}

void kvs_broker_rep_pack(int status, uint8_t out[KVS_BROKER_REP_BYTES])
{
	memcpy(out, "KVSR", 4);
	put_le(out + 4, (uint32_t)status, 4);
}

int kvs_broker_rep_unpack(const uint8_t *in, size_t len, int *ret_status)
{
	if (len != KVS_BROKER_REP_BYTES || memcmp(in, "KVSR", 4) != 0)
		return KVS_E_BADMSG;
	*ret_status = (int32_t)(uint32_t)get_le(in + 4, 4);
	return 0;
}

int kvs_fd_send(int sock, const void *buf, size_t len, const int *fds, int n_fds)
{
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	union {
		char buf[CMSG_SPACE(sizeof(int) * KVS_BROKER_MAX_FDS)];
		struct cmsghdr align;
	} ctl;
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
	if (n_fds < 0 || n_fds > KVS_BROKER_MAX_FDS)
		return -EINVAL;
	if (n_fds > 0) {
		memset(&ctl, 0, sizeof(ctl));
		mh.msg_control = ctl.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n_fds);
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n_fds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)n_fds);
	}
	ssize_t n;
	do
		n = sendmsg(sock, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;
	return (size_t)n == len ? 0 : -EIO;
}

int kvs_fd_recv(int sock, void *buf, size_t cap, size_t *ret_len, int *fds, int max_fds,
		int *ret_nfds)
{
	struct iovec iov = {.iov_base = buf, .iov_len = cap};
	/* room for the most the kernel passes in one message, so that a record
	 * carrying more fds than max_fds is seen whole (and refused) rather than
	 * cut short by MSG_CTRUNC */
	union {
		char buf[CMSG_SPACE(sizeof(int) * KVS_BROKER_MAX_FDS)];
		struct cmsghdr align;
	} ctl;
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
			    .msg_controllen = sizeof(ctl.buf)};
	ssize_t n;
	do
		n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;
	int got[KVS_BROKER_MAX_FDS], ngot = 0;
	bool extra = false; /* fds beyond what got holds: cannot happen on Linux */
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
			if (ngot < KVS_BROKER_MAX_FDS) {
				got[ngot++] = fd;
			} else {
				close(fd);
				extra = true;
			}
		}
	}
	if ((mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) || extra || ngot > max_fds) {
		for (int i = 0; i < ngot; i++)
			close(got[i]);
		return -EMSGSIZE;
	}
	if (n == 0 && ngot == 0)
		return -ECONNRESET;
	for (int i = 0; i < ngot; i++)
		fds[i] = got[i];
	*ret_nfds = ngot;
	*ret_len = (size_t)n;
	return 0;
}
