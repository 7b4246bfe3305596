/* Unit tests for the fd broker: the record codec and SCM_RIGHTS helpers
 * (common/kvs_fdpass.c) on socketpairs, and the server's side
 * (server/broker.c) in process: a real kvs_server whose broker socket the
 * test connects to, driving kvs__broker_accept / kvs__broker_conn_ready /
 * kvs__broker_expire / kvs__broker_claim as the main loop would. Covered:
 * several fds in one record (up to 253), version 1 records, partial and
 * malformed records, too many or too few fds, bad tokens (parked, replayed,
 * twice in a record), the parked-fd limit, an unknown version, a peer that
 * connects and sends nothing, one that hangs up, expiry, and an allocation
 * failure half-way through parking a record. Every refusal is checked to park
 * nothing and to leak no fd. */
#include "server_fixture.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "check_main.h"
#include "kvs_fdpass.h"

/* ---- allocation failure injection (as in test_l1.c) ------------------------ */

#if defined(__SANITIZE_ADDRESS__)
#define NO_CALLOC_HOOK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NO_CALLOC_HOOK 1
#endif
#endif

#ifndef NO_CALLOC_HOOK
static volatile int calloc_fail_in; /* 0: never; volatile: calloc is a builtin */
extern void *__libc_calloc(size_t n, size_t size);
void *calloc(size_t n, size_t size)
{
	if (calloc_fail_in > 0 && --calloc_fail_in == 0) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_calloc(n, size);
}
#endif

/* ---- helpers ---------------------------------------------------------------- */

static void entry(kvs_broker_entry *e, uint32_t token, uint32_t alloc_id, uint64_t size)
{
	fx_id(e->token, token);
	fx_id(e->alloc_id, alloc_id);
	e->size = size;
}

static void memfds(int *fds, int n)
{
	for (int i = 0; i < n; i++)
		fds[i] = fx_memfd(4096);
}

static void close_all(int *fds, int n)
{
	for (int i = 0; i < n; i++)
		close(fds[i]);
}

/* Connects to the server's broker socket and has the server accept it:
 * returns our end; the server's connection is the last in srv->conns. */
static int peer(fx *f)
{
	int n0 = f->srv->n_conns;
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	ck_assert_int_ge(s, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	ck_assert_uint_lt(strlen(f->srv->broker_path), sizeof(sa.sun_path));
	memcpy(sa.sun_path, f->srv->broker_path, strlen(f->srv->broker_path) + 1);
	ck_assert_int_eq(connect(s, (struct sockaddr *)&sa, sizeof(sa)), 0);
	kvs__broker_accept(f->srv);
	ck_assert_int_eq(f->srv->n_conns, n0 + 1);
	return s;
}

/* The server handles what the peer of connection idx sent (one record). */
static void serve(fx *f, int idx)
{
	struct pollfd p = {.fd = f->srv->conns[idx].fd, .events = POLLIN};
	ck_assert_int_eq(poll(&p, 1, 2000), 1);
	kvs__broker_conn_ready(f->srv, idx);
}

/* The reply on s: its status, or 1 if the server closed without one. */
static int reply(int s)
{
	uint8_t rep[KVS_BROKER_REP_BYTES + 1];
	struct pollfd p = {.fd = s, .events = POLLIN};
	ck_assert_int_eq(poll(&p, 1, 2000), 1);
	ssize_t n = recv(s, rep, sizeof(rep), MSG_DONTWAIT);
	if (n <= 0)
		return 1;
	int st;
	ck_assert_int_eq(kvs_broker_rep_unpack(rep, (size_t)n, &st), 0);
	return st;
}

/* After a refused record: the server closed the connection (our next read
 * sees the end), and nothing more is parked. */
static void expect_closed(int s)
{
	ck_assert_int_eq(reply(s), 1);
	close(s);
}

static size_t parked(fx *f) { return kvs_htab_count(f->srv->parked); }

/* ---- the codec ---------------------------------------------------------------- */

START_TEST(codec_round_trips)
{
	kvs_broker_entry e[KVS_BROKER_MAX_FDS], out[KVS_BROKER_MAX_FDS];
	for (uint32_t i = 0; i < KVS_BROKER_MAX_FDS; i++)
		entry(&e[i], 1000 + i, 2000 + i, 4096ull << (i % 20));
	uint8_t rec[KVS_BROKER_REC_MAX];
	uint32_t n = 0;
	for (uint32_t k = 1; k <= KVS_BROKER_MAX_FDS; k += 63) {
		size_t len = kvs_broker_rec_pack(e, k, rec);
		ck_assert_uint_eq(len, KVS_BROKER_HDR_BYTES + k * KVS_BROKER_ENTRY_BYTES);
		ck_assert_int_eq(kvs_broker_rec_unpack(rec, len, out, &n), 0);
		ck_assert_uint_eq(n, k);
		ck_assert_int_eq(memcmp(out, e, k * sizeof(*e)), 0);
	}
	size_t len = kvs_broker_rec_pack(e, KVS_BROKER_MAX_FDS, rec);
	ck_assert_uint_eq(len, KVS_BROKER_REC_MAX);
	ck_assert_int_eq(kvs_broker_rec_unpack(rec, len, out, &n), 0);
	ck_assert_uint_eq(n, KVS_BROKER_MAX_FDS);
	ck_assert_uint_eq(out[252].size, e[252].size);
	/* wire layout: magic, version 2, flags 0, n, reserved, then entries */
	len = kvs_broker_rec_pack(e, 2, rec);
	ck_assert_int_eq(memcmp(rec, "KVSB\x02\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00", 16), 0);
	ck_assert_int_eq(memcmp(rec + 16, e[0].token, 16), 0);
	ck_assert_int_eq(memcmp(rec + 56, e[1].token, 16), 0);
	ck_assert_int_eq(rec[16 + 32], (uint8_t)e[0].size);
	/* version 1 */
	uint8_t v1[KVS_BROKER_V1_BYTES];
	kvs_broker_v1_pack(&e[7], v1);
	ck_assert_int_eq(memcmp(v1, "KVSB\x01\x00\x00\x00", 8), 0);
	ck_assert_int_eq(kvs_broker_rec_unpack(v1, sizeof(v1), out, &n), 0);
	ck_assert_uint_eq(n, 1);
	ck_assert_int_eq(memcmp(&out[0], &e[7], sizeof(e[7])), 0);
	/* replies */
	uint8_t rep[KVS_BROKER_REP_BYTES];
	int st = 0;
	kvs_broker_rep_pack(KVS_E_AUTH, rep);
	ck_assert_int_eq(kvs_broker_rep_unpack(rep, sizeof(rep), &st), 0);
	ck_assert_int_eq(st, KVS_E_AUTH);
	ck_assert_int_eq(kvs_broker_rep_unpack(rep, sizeof(rep) - 1, &st), KVS_E_BADMSG);
	rep[0] = 'X';
	ck_assert_int_eq(kvs_broker_rep_unpack(rep, sizeof(rep), &st), KVS_E_BADMSG);
	/* counts the packer refuses */
	ck_assert_uint_eq(kvs_broker_rec_pack(e, 0, rec), 0);
	ck_assert_uint_eq(kvs_broker_rec_pack(e, KVS_BROKER_MAX_FDS + 1, rec), 0);
}
END_TEST

START_TEST(codec_refusals)
{
	kvs_broker_entry e[3], out[KVS_BROKER_MAX_FDS];
	for (int i = 0; i < 3; i++)
		entry(&e[i], 1 + (uint32_t)i, 1, 4096);
	uint8_t rec[KVS_BROKER_REC_MAX + 64], bad[KVS_BROKER_REC_MAX + 64];
	size_t len = kvs_broker_rec_pack(e, 3, rec);
	uint32_t n = 77;
#define REFUSED(buf, l, code)                                                      \
	do {                                                                       \
		ck_assert_int_eq(kvs_broker_rec_unpack(buf, l, out, &n), code);    \
		ck_assert_uint_eq(n, 77); /* untouched */                          \
	} while (0)
	REFUSED(rec, len - 1, KVS_E_BADMSG);  /* cut short: a partial record */
	REFUSED(rec, len - 40, KVS_E_BADMSG); /* one entry missing */
	REFUSED(rec, len + 1, KVS_E_BADMSG);  /* a byte too many */
	REFUSED(rec, 16, KVS_E_BADMSG);       /* header alone */
	REFUSED(rec, 7, KVS_E_BADMSG);        /* not even a header */
	REFUSED(rec, 0, KVS_E_BADMSG);
	memcpy(bad, rec, len);
	bad[0] = 'X';
	REFUSED(bad, len, KVS_E_BADMSG); /* magic */
	memcpy(bad, "KVSR", 4);
	REFUSED(bad, len, KVS_E_BADMSG); /* a reply's magic */
	memcpy(bad, rec, len);
	bad[4] = 3;
	REFUSED(bad, len, KVS_E_VERSION);
	bad[4] = 0;
	REFUSED(bad, len, KVS_E_VERSION);
	memcpy(bad, rec, len);
	bad[6] = 1;
	REFUSED(bad, len, KVS_E_BADMSG); /* flags */
	memcpy(bad, rec, len);
	bad[12] = 1;
	REFUSED(bad, len, KVS_E_BADMSG); /* reserved */
	memcpy(bad, rec, len);
	bad[8] = 0;
	REFUSED(bad, KVS_BROKER_HDR_BYTES, KVS_E_BADMSG); /* n = 0 */
	/* n = 254, with a length that would match it */
	memset(bad, 0, sizeof(bad));
	memcpy(bad, rec, 16);
	bad[8] = 254 & 0xff;
	bad[9] = 0;
	REFUSED(bad, KVS_BROKER_HDR_BYTES + 254 * KVS_BROKER_ENTRY_BYTES, KVS_E_BADMSG);
	/* version 1 of the wrong length */
	uint8_t v1[KVS_BROKER_V1_BYTES + 1];
	kvs_broker_v1_pack(&e[0], v1);
	REFUSED(v1, KVS_BROKER_V1_BYTES - 1, KVS_E_BADMSG);
	REFUSED(v1, KVS_BROKER_V1_BYTES + 1, KVS_E_BADMSG);
#undef REFUSED
}
END_TEST

START_TEST(fd_passing_limits)
{
	int sp[2];
	ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp), 0);
	int fds0 = fx_count_fds();
	int fds[KVS_BROKER_MAX_FDS + 1], got[KVS_BROKER_MAX_FDS];
	memfds(fds, KVS_BROKER_MAX_FDS + 1);
	uint8_t buf[64] = "x";
	size_t len = 0;
	int n = 0;
	/* nothing there yet */
	ck_assert_int_eq(kvs_fd_recv(sp[1], buf, sizeof(buf), &len, got, 4, &n), -EAGAIN);
	/* 253 fds in one message, in order */
	ck_assert_int_eq(kvs_fd_send(sp[0], buf, 1, fds, KVS_BROKER_MAX_FDS), 0);
	ck_assert_int_eq(kvs_fd_recv(sp[1], buf, sizeof(buf), &len, got, KVS_BROKER_MAX_FDS, &n), 0);
	ck_assert_int_eq(n, KVS_BROKER_MAX_FDS);
	ck_assert_uint_eq(len, 1);
	for (int i = 0; i < n; i += 50) {
		struct stat a, b;
		ck_assert_int_eq(fstat(fds[i], &a), 0);
		ck_assert_int_eq(fstat(got[i], &b), 0);
		ck_assert_uint_eq(a.st_ino, b.st_ino);
		ck_assert_int_ne(fcntl(got[i], F_GETFD) & FD_CLOEXEC, 0);
	}
	close_all(got, n);
	/* 254: refused before the kernel would (it allows SCM_MAX_FD = 253) */
	ck_assert_int_eq(kvs_fd_send(sp[0], buf, 1, fds, KVS_BROKER_MAX_FDS + 1), -EINVAL);
	ck_assert_int_eq(kvs_fd_send(sp[0], buf, 1, fds, -1), -EINVAL);
	/* and the kernel agrees: a raw sendmsg of 254 fds fails */
	{
		struct iovec iov = {.iov_base = buf, .iov_len = 1};
		union {
			char b[CMSG_SPACE(sizeof(int) * (KVS_BROKER_MAX_FDS + 1))];
			struct cmsghdr align;
		} ctl;
		memset(&ctl, 0, sizeof(ctl));
		struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
				    .msg_controllen = sizeof(ctl.b)};
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * (KVS_BROKER_MAX_FDS + 1));
		memcpy(CMSG_DATA(c), fds, sizeof(int) * (KVS_BROKER_MAX_FDS + 1));
		ck_assert_int_lt(sendmsg(sp[0], &mh, MSG_DONTWAIT), 0);
		ck_assert_int_eq(errno, EINVAL);
	}
	/* more fds than the receiver takes: all closed, -EMSGSIZE */
	ck_assert_int_eq(kvs_fd_send(sp[0], buf, 1, fds, 5), 0);
	ck_assert_int_eq(kvs_fd_recv(sp[1], buf, sizeof(buf), &len, got, 4, &n), -EMSGSIZE);
	/* a record longer than the buffer: its fds closed too */
	uint8_t big[200] = {0};
	ck_assert_int_eq(kvs_fd_send(sp[0], big, sizeof(big), fds, 3), 0);
	ck_assert_int_eq(kvs_fd_recv(sp[1], buf, sizeof(buf), &len, got, 8, &n), -EMSGSIZE);
	close_all(fds, KVS_BROKER_MAX_FDS + 1);
	ck_assert_int_eq(fx_count_fds(), fds0); /* nothing leaked */
	/* a full socket buffer: -EAGAIN, never blocking */
	int r = 0, sent = 0;
	while ((r = kvs_fd_send(sp[0], big, sizeof(big), NULL, 0)) == 0)
		sent++;
	ck_assert_int_eq(r, -EAGAIN);
	ck_assert_int_gt(sent, 0);
	/* end of stream */
	close(sp[0]);
	while (kvs_fd_recv(sp[1], big, sizeof(big), &len, got, 0, &n) == 0)
		;
	ck_assert_int_eq(kvs_fd_recv(sp[1], buf, sizeof(buf), &len, got, 4, &n), -ECONNRESET);
	close(sp[1]);
}
END_TEST

/* ---- the server's broker -------------------------------------------------------- */

START_TEST(several_fds_in_one_record)
{
	int fds0 = fx_count_fds();
	fx f;
	fx_start(&f, 0, 0);
	int s = peer(&f);
	int fds[3];
	memfds(fds, 3);
	kvs_broker_entry e[3];
	for (int i = 0; i < 3; i++)
		entry(&e[i], 10 + (uint32_t)i, 20 + (uint32_t)i, 4096 * (1u + (uint32_t)i));
	uint8_t rec[KVS_BROKER_REC_MAX];
	size_t len = kvs_broker_rec_pack(e, 3, rec);
	ck_assert_int_eq(kvs_fd_send(s, rec, len, fds, 3), 0);
	serve(&f, 0);
	ck_assert_int_eq(reply(s), 0);
	ck_assert_uint_eq(parked(&f), 3);
	ck_assert_uint_eq(f.srv->st.broker_parked, 3);
	ck_assert_uint_eq(f.srv->st.broker_rejected, 0);
	/* each fd under its own token, with its alloc_id and size */
	for (int i = 0; i < 3; i++) {
		kvs_parked *p = kvs__broker_claim(f.srv, e[i].token);
		ck_assert_ptr_nonnull(p);
		ck_assert_int_eq(memcmp(p->alloc_id, e[i].alloc_id, 16), 0);
		ck_assert_uint_eq(p->size, e[i].size);
		struct stat a, b;
		ck_assert_int_eq(fstat(p->fd, &a), 0);
		ck_assert_int_eq(fstat(fds[i], &b), 0);
		ck_assert_uint_eq(a.st_ino, b.st_ino);
		close(p->fd);
		free(p);
	}
	/* the connection stays open for more records: a version 1 one too */
	ck_assert_int_eq(f.srv->n_conns, 1);
	uint8_t v1[KVS_BROKER_V1_BYTES];
	entry(&e[0], 30, 31, 4096);
	kvs_broker_v1_pack(&e[0], v1);
	ck_assert_int_eq(kvs_fd_send(s, v1, sizeof(v1), fds, 1), 0);
	serve(&f, 0);
	ck_assert_int_eq(reply(s), 0);
	ck_assert_uint_eq(parked(&f), 1);
	/* a peer hanging up is forgotten, not counted as refused */
	close(s);
	serve(&f, 0);
	ck_assert_int_eq(f.srv->n_conns, 0);
	ck_assert_uint_eq(f.srv->st.broker_rejected, 0);
	close_all(fds, 3);
	fx_stop(&f);
	ck_assert_int_eq(fx_count_fds(), fds0);
}
END_TEST

START_TEST(a_full_record_of_253)
{
	fx f;
	fx_start(&f, 0, 0);
	ck_assert_uint_ge(f.srv->max_parked, KVS_BROKER_MAX_FDS);
	int s = peer(&f);
	int fds[KVS_BROKER_MAX_FDS];
	memfds(fds, KVS_BROKER_MAX_FDS);
	kvs_broker_entry e[KVS_BROKER_MAX_FDS];
	for (uint32_t i = 0; i < KVS_BROKER_MAX_FDS; i++)
		entry(&e[i], 100 + i, 100 + i, 4096);
	uint8_t rec[KVS_BROKER_REC_MAX];
	size_t len = kvs_broker_rec_pack(e, KVS_BROKER_MAX_FDS, rec);
	ck_assert_int_eq(kvs_fd_send(s, rec, len, fds, KVS_BROKER_MAX_FDS), 0);
	serve(&f, 0);
	ck_assert_int_eq(reply(s), 0);
	ck_assert_uint_eq(parked(&f), KVS_BROKER_MAX_FDS);
	ck_assert_ptr_nonnull(kvs_htab_get(f.srv->parked, e[252].token));
	close(s);
	close_all(fds, KVS_BROKER_MAX_FDS);
	fx_stop(&f); /* closes the parked fds */
}
END_TEST

/* Sends data with n fds on a fresh connection, has the server handle it and
 * returns the reply status (1: closed without one). Checks the connection is
 * closed afterwards, nothing was parked and the refusal was counted. */
static int refused(fx *f, const void *data, size_t len, int n_fds)
{
	size_t parked0 = parked(f);
	uint64_t rejected0 = f->srv->st.broker_rejected;
	int fds[KVS_BROKER_MAX_FDS];
	memfds(fds, n_fds);
	int s = peer(f);
	ck_assert_int_eq(kvs_fd_send(s, data, len, fds, n_fds), 0);
	close_all(fds, n_fds); /* the server holds the only copies now */
	serve(f, f->srv->n_conns - 1);
	int st = reply(s);
	if (st != 1)
		expect_closed(s);
	else
		close(s);
	ck_assert_uint_eq(parked(f), parked0);
	ck_assert_uint_eq(f->srv->st.broker_rejected, rejected0 + 1);
	ck_assert_int_eq(f->srv->n_conns, 0);
	return st;
}

START_TEST(partial_and_malformed_records)
{
	int fds0 = fx_count_fds();
	fx f;
	fx_start(&f, 0, 0);
	kvs_broker_entry e[4];
	for (int i = 0; i < 4; i++)
		entry(&e[i], 200 + (uint32_t)i, 1, 4096);
	uint8_t rec[KVS_BROKER_REC_MAX + 100];
	size_t len = kvs_broker_rec_pack(e, 3, rec);
	ck_assert_int_eq(refused(&f, rec, len - 40, 3), 1); /* header says 3, 2 entries */
	ck_assert_int_eq(refused(&f, rec, len - 1, 3), 1);
	ck_assert_int_eq(refused(&f, rec, 16, 3), 1);       /* header only */
	ck_assert_int_eq(refused(&f, rec, len, 2), 1);      /* fewer fds than entries */
	ck_assert_int_eq(refused(&f, rec, len, 4), 1);      /* more fds than entries */
	ck_assert_int_eq(refused(&f, rec, len, 0), 1);      /* no fd at all */
	ck_assert_int_eq(refused(&f, "0123456789", 10, 1), 1);
	/* longer than the longest valid record: truncated on receipt */
	memset(rec, 0, sizeof(rec));
	len = kvs_broker_rec_pack(e, 3, rec);
	ck_assert_int_eq(refused(&f, rec, KVS_BROKER_REC_MAX + 50, 3), 1);
	/* version 1 with two fds */
	uint8_t v1[KVS_BROKER_V1_BYTES];
	kvs_broker_v1_pack(&e[0], v1);
	ck_assert_int_eq(refused(&f, v1, sizeof(v1), 2), 1);
	/* a version this server does not read: told so, then closed */
	len = kvs_broker_rec_pack(e, 3, rec);
	rec[4] = 3;
	ck_assert_int_eq(refused(&f, rec, len, 3), KVS_E_VERSION);
	ck_assert_uint_eq(f.srv->st.broker_parked, 0);
	fx_stop(&f);
	ck_assert_int_eq(fx_count_fds(), fds0);
}
END_TEST

START_TEST(bad_tokens_refuse_the_whole_record)
{
	int fds0 = fx_count_fds();
	fx f;
	fx_start(&f, 0, 0);
	kvs_broker_entry e[3];
	uint8_t rec[KVS_BROKER_REC_MAX];
	/* park token 300 first */
	int s = peer(&f);
	int fd = fx_memfd(4096);
	entry(&e[0], 300, 1, 4096);
	size_t len = kvs_broker_rec_pack(e, 1, rec);
	ck_assert_int_eq(kvs_fd_send(s, rec, len, &fd, 1), 0);
	close(fd);
	serve(&f, 0);
	ck_assert_int_eq(reply(s), 0);
	close(s);
	serve(&f, 0);
	ck_assert_uint_eq(parked(&f), 1);
	/* a record naming it again among fresh tokens: none of it parks */
	entry(&e[0], 301, 1, 4096);
	entry(&e[1], 300, 1, 4096);
	entry(&e[2], 302, 1, 4096);
	len = kvs_broker_rec_pack(e, 3, rec);
	ck_assert_int_eq(refused(&f, rec, len, 3), KVS_E_AUTH);
	ck_assert_ptr_null(kvs_htab_get(f.srv->parked, e[0].token));
	/* one token twice in a record */
	entry(&e[0], 310, 1, 4096);
	entry(&e[1], 311, 1, 4096);
	entry(&e[2], 310, 1, 4096);
	len = kvs_broker_rec_pack(e, 3, rec);
	ck_assert_int_eq(refused(&f, rec, len, 3), KVS_E_AUTH);
	/* a token a register already claimed: a replay */
	kvs_parked *p = kvs__broker_claim(f.srv, (uint8_t[16]){0});
	ck_assert_ptr_null(p);
	entry(&e[0], 300, 1, 4096);
	p = kvs__broker_claim(f.srv, e[0].token);
	ck_assert_ptr_nonnull(p);
	close(p->fd);
	free(p);
	entry(&e[0], 320, 1, 4096);
	entry(&e[1], 300, 1, 4096);
	len = kvs_broker_rec_pack(e, 2, rec);
	ck_assert_int_eq(refused(&f, rec, len, 2), KVS_E_AUTH);
	ck_assert_uint_eq(parked(&f), 0);
	fx_stop(&f);
	ck_assert_int_eq(fx_count_fds(), fds0);
}
END_TEST

START_TEST(parked_limit_counts_the_whole_record)
{
	fx f;
	fx_start(&f, 0, 0);
	f.srv->max_parked = 4;
	f.srv->parked_quota = 4;
	kvs_broker_entry e[5];
	for (int i = 0; i < 5; i++)
		entry(&e[i], 400 + (uint32_t)i, 1, 4096);
	uint8_t rec[KVS_BROKER_REC_MAX];
	size_t len = kvs_broker_rec_pack(e, 5, rec);
	ck_assert_int_eq(refused(&f, rec, len, 5), KVS_E_LIMIT);
	/* four fit; then one more does not */
	int s = peer(&f);
	int fds[4];
	memfds(fds, 4);
	len = kvs_broker_rec_pack(e, 4, rec);
	ck_assert_int_eq(kvs_fd_send(s, rec, len, fds, 4), 0);
	close_all(fds, 4);
	serve(&f, 0);
	ck_assert_int_eq(reply(s), 0);
	close(s);
	serve(&f, 0);
	len = kvs_broker_rec_pack(&e[4], 1, rec);
	ck_assert_int_eq(refused(&f, rec, len, 1), KVS_E_LIMIT);
	ck_assert_uint_eq(parked(&f), 4);
	fx_stop(&f);
}
END_TEST

/* A child process pushes one record of n fds (tokens from first) and exits
 * with the reply's status (1: closed without one). */
static pid_t push_from_child(fx *f, uint32_t first, int n)
{
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid)
		return pid;
	kvs_broker_entry e[8];
	uint8_t rec[KVS_BROKER_REC_MAX];
	int fds[8];
	for (int i = 0; i < n; i++)
		entry(&e[i], first + (uint32_t)i, 1, 4096);
	memfds(fds, n);
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	memcpy(sa.sun_path, f->srv->broker_path, strlen(f->srv->broker_path) + 1);
	if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
	    kvs_fd_send(s, rec, kvs_broker_rec_pack(e, (uint32_t)n, rec), fds, n) != 0)
		_exit(100);
	uint8_t rep[KVS_BROKER_REP_BYTES];
	struct pollfd p = {.fd = s, .events = POLLIN};
	int st = 1;
	if (poll(&p, 1, 5000) == 1 && recv(s, rep, sizeof(rep), 0) == (ssize_t)sizeof(rep))
		kvs_broker_rep_unpack(rep, sizeof(rep), &st);
	_exit(st == 0 ? 0 : st == KVS_E_LIMIT ? 2 : 3);
}

/* The parent serves the child's connection, then the child's exit code. */
static int serve_child(fx *f, pid_t pid)
{
	uint64_t t0 = fx_mono_ms();
	while (f->srv->n_conns == 0 && fx_mono_ms() - t0 < 5000) {
		kvs__broker_accept(f->srv);
		usleep(1000);
	}
	ck_assert_int_eq(f->srv->n_conns, 1);
	serve(f, 0);
	int ws = 0;
	ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
	if (f->srv->n_conns) { /* an accepted record leaves the connection open: end it */
		f->srv->conns[0].expires_ms = 0;
		kvs__broker_expire(f->srv);
	}
	ck_assert_int_eq(f->srv->n_conns, 0);
	return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

/* One process cannot fill the table: its share is parked_quota; another
 * process still parks (issue 16 #9). */
START_TEST(per_process_quota)
{
	fx f;
	fx_start(&f, 0, 0);
	f.srv->max_parked = 16;
	f.srv->parked_quota = 4;
	kvs_broker_entry e[5];
	uint8_t rec[KVS_BROKER_REC_MAX];
	for (int i = 0; i < 5; i++)
		entry(&e[i], 700 + (uint32_t)i, 1, 4096);
	/* this process: 4 fit, a fifth is refused (the table has room) */
	int s = peer(&f);
	int fds[4];
	memfds(fds, 4);
	ck_assert_int_eq(kvs_fd_send(s, rec, kvs_broker_rec_pack(e, 4, rec), fds, 4), 0);
	close_all(fds, 4);
	serve(&f, 0);
	ck_assert_int_eq(reply(s), 0);
	close(s);
	serve(&f, 0);
	size_t len = kvs_broker_rec_pack(&e[4], 1, rec);
	ck_assert_int_eq(refused(&f, rec, len, 1), KVS_E_LIMIT);
	ck_assert_uint_eq(parked(&f), 4);
	/* another process: its own share */
	ck_assert_int_eq(serve_child(&f, push_from_child(&f, 800, 3)), 0);
	ck_assert_uint_eq(parked(&f), 7);
	ck_assert_int_eq(serve_child(&f, push_from_child(&f, 900, 5)), 2); /* 5 at once: over its own share */
	ck_assert_uint_eq(parked(&f), 7);
	fx_stop(&f);
}
END_TEST

#ifndef NO_CALLOC_HOOK
START_TEST(allocation_failure_parks_nothing)
{
	int fds0 = fx_count_fds();
	fx f;
	fx_start(&f, 0, 0);
	kvs_broker_entry e[3];
	for (int i = 0; i < 3; i++)
		entry(&e[i], 500 + (uint32_t)i, 1, 4096);
	uint8_t rec[KVS_BROKER_REC_MAX];
	size_t len = kvs_broker_rec_pack(e, 3, rec);
	/* the third entry's allocation fails: the first two are unparked again */
	int s = peer(&f);
	int fds[3];
	memfds(fds, 3);
	ck_assert_int_eq(kvs_fd_send(s, rec, len, fds, 3), 0);
	close_all(fds, 3);
	calloc_fail_in = 3;
	serve(&f, 0);
	calloc_fail_in = 0;
	ck_assert_int_eq(reply(s), KVS_E_INTERNAL);
	expect_closed(s);
	ck_assert_uint_eq(parked(&f), 0);
	ck_assert_uint_eq(f.srv->st.broker_parked, 0);
	fx_stop(&f);
	ck_assert_int_eq(fx_count_fds(), fds0);
}
END_TEST
#endif

START_TEST(silent_peer_and_expiry)
{
	fx f;
	fx_start(&f, 0, 0);
	/* connects and sends nothing: the server does not block on it, and
	 * closes it after the idle time without counting a refusal */
	int s = peer(&f);
	kvs__broker_conn_ready(f.srv, 0); /* nothing to read: no-op */
	ck_assert_int_eq(f.srv->n_conns, 1);
	f.srv->now_ms += KVS_BROKER_CONN_IDLE_MS - 1;
	kvs__broker_expire(f.srv);
	ck_assert_int_eq(f.srv->n_conns, 1);
	f.srv->now_ms += 1;
	kvs__broker_expire(f.srv);
	ck_assert_int_eq(f.srv->n_conns, 0);
	ck_assert_uint_eq(f.srv->st.broker_rejected, 0);
	expect_closed(s);
	/* an unclaimed record's fds close after fd-park-ms */
	s = peer(&f);
	int fds[2];
	memfds(fds, 2);
	kvs_broker_entry e[2];
	entry(&e[0], 600, 1, 4096);
	entry(&e[1], 601, 1, 4096);
	uint8_t rec[KVS_BROKER_REC_MAX];
	size_t len = kvs_broker_rec_pack(e, 2, rec);
	ck_assert_int_eq(kvs_fd_send(s, rec, len, fds, 2), 0);
	serve(&f, 0);
	ck_assert_int_eq(reply(s), 0);
	ck_assert_uint_eq(parked(&f), 2);
	f.srv->now_ms += f.srv->cfg.fd_park_ms;
	/* closed on the reclaim thread (a parked memfd's last reference frees
	 * its memory there), not by the loop: held, they stay open */
	gate gt;
	gate_hold(&gt, f.srv->reclaimq);
	int conns0 = f.srv->n_conns;
	int open0 = fx_count_fds();
	kvs__broker_expire(f.srv);
	ck_assert_uint_eq(parked(&f), 0);
	ck_assert_uint_eq(f.srv->st.broker_expired, 2);
	open0 -= conns0 - f.srv->n_conns; /* the idle connection, closed by the loop */
	ck_assert_int_eq(fx_count_fds(), open0);
	gate_open(&gt);
	ck_assert_int_eq(fx_settled_fds(&f), open0 - 2);
	close(s);
	close_all(fds, 2);
	fx_stop(&f);
}
END_TEST

static Suite *broker_suite(void)
{
	Suite *s = suite_create("broker");
	TCase *tc = tcase_create("broker");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, codec_round_trips);
	tcase_add_test(tc, codec_refusals);
	tcase_add_test(tc, fd_passing_limits);
	tcase_add_test(tc, several_fds_in_one_record);
	tcase_add_test(tc, a_full_record_of_253);
	tcase_add_test(tc, partial_and_malformed_records);
	tcase_add_test(tc, bad_tokens_refuse_the_whole_record);
	tcase_add_test(tc, parked_limit_counts_the_whole_record);
	tcase_add_test(tc, per_process_quota);
#ifndef NO_CALLOC_HOOK
	tcase_add_test(tc, allocation_failure_parks_nothing);
#endif
	tcase_add_test(tc, silent_peer_and_expiry);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(broker_suite)
