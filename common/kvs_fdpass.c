/* SCM_RIGHTS fd passing and the broker record codec. */
#include "kvs_fdpass.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
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

void kvs_broker_req_pack(const kvs_broker_req *r, uint8_t out[KVS_BROKER_REQ_BYTES])
{
	memcpy(out, "KVSB", 4);
	put_le(out + 4, 1, 2);
	put_le(out + 6, 0, 2);
	memcpy(out + 8, r->token, 16);
	memcpy(out + 24, r->alloc_id, 16);
	put_le(out + 40, r->size, 8);
}

int kvs_broker_req_unpack(const uint8_t in[KVS_BROKER_REQ_BYTES], kvs_broker_req *r)
{
	if (memcmp(in, "KVSB", 4) != 0 || get_le(in + 4, 2) != 1 || get_le(in + 6, 2) != 0)
		return KVS_E_BADMSG;
	memcpy(r->token, in + 8, 16);
	memcpy(r->alloc_id, in + 24, 16);
	r->size = get_le(in + 40, 8);
	return 0;
}

int kvs_fd_send(int sock, const void *buf, size_t len, const int *fds, int n_fds)
{
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	union {
		char buf[CMSG_SPACE(sizeof(int) * 8)];
		struct cmsghdr align;
	} ctl;
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
	if (n_fds < 0 || n_fds > 8)
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
		n = sendmsg(sock, &mh, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	return (size_t)n == len ? 0 : -EIO;
}

int kvs_fd_recv(int sock, void *buf, size_t cap, size_t *ret_len, int *fds, int max_fds,
		int *ret_nfds)
{
	struct iovec iov = {.iov_base = buf, .iov_len = cap};
	union {
		char buf[CMSG_SPACE(sizeof(int) * 16)];
		struct cmsghdr align;
	} ctl;
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
			    .msg_controllen = sizeof(ctl.buf)};
	ssize_t n;
	do
		n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	int got[16], ngot = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k && ngot < 16; i++)
			memcpy(&got[ngot++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	}
	if ((mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) || ngot > max_fds) {
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

int kvs_broker_send(const char *broker_dir, const kvs_broker_req *req, int fd, int timeout_ms)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if ((size_t)snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s", broker_dir,
			     KVS_BROKER_SOCK_NAME) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	int r;
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		r = -errno;
		goto out;
	}
	uint8_t rec[KVS_BROKER_REQ_BYTES];
	kvs_broker_req_pack(req, rec);
	r = kvs_fd_send(s, rec, sizeof(rec), &fd, 1);
	if (r)
		goto out;
	struct pollfd p = {.fd = s, .events = POLLIN};
	int pr;
	do
		pr = poll(&p, 1, timeout_ms);
	while (pr < 0 && errno == EINTR);
	if (pr == 0) {
		r = KVS_E_TIMEOUT;
		goto out;
	}
	uint8_t rep[KVS_BROKER_REP_BYTES];
	size_t len = 0;
	int nfds = 0, dummy;
	r = kvs_fd_recv(s, rep, sizeof(rep), &len, &dummy, 0, &nfds);
	if (r)
		goto out;
	if (len != sizeof(rep) || memcmp(rep, "KVSR", 4) != 0) {
		r = KVS_E_BADMSG;
		goto out;
	}
	r = (int32_t)get_le(rep + 4, 4);
out:
	close(s);
	return r;
}
