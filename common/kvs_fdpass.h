/* SCM_RIGHTS helpers and the fd-broker record codec (docs/protocol.md §13,
 * "fd broker"). The broker speaks SOCK_SEQPACKET: one datagram-like record
 * per message, the allocation fds attached to the request record. */
#ifndef KVS_FDPASS_H
#define KVS_FDPASS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define KVS_BROKER_SOCK_NAME "kvside.sock"
/* Linux's SCM_MAX_FD: the kernel refuses to pass more fds in one message. */
#define KVS_BROKER_MAX_FDS 253
#define KVS_BROKER_V1_BYTES 48   /* a version 1 request: one entry, one fd */
#define KVS_BROKER_HDR_BYTES 16  /* a version 2 request: header ... */
#define KVS_BROKER_ENTRY_BYTES 40 /* ... then one entry per fd */
#define KVS_BROKER_REC_MAX (KVS_BROKER_HDR_BYTES + KVS_BROKER_MAX_FDS * KVS_BROKER_ENTRY_BYTES)
#define KVS_BROKER_REP_BYTES 8

/* One fd's entry: the token it is parked under until a `register` claims it,
 * and what the client says it is.
 *
 * Version 2 request (the client's), little-endian, 16 + 40 n bytes with
 * exactly n fds attached in order (fd i belongs to entry i):
 *   0  4  magic "KVSB"
 *   4  2  version (2)
 *   6  2  flags (0)
 *   8  2  n, 1 .. KVS_BROKER_MAX_FDS
 *  10  6  reserved (0)
 *  16 + 40 i:  0 16 token, 16 16 alloc_id, 32 8 size
 * Version 1 request (older clients, still accepted): magic, version 1, flags,
 * then one entry at offset 8: 48 bytes, one fd.
 * Reply record: 0 4 magic "KVSR", 4 4 status (int32: 0 or a kvs error). */
typedef struct kvs_broker_entry {
	uint8_t token[16];
	uint8_t alloc_id[16];
	uint64_t size;
} kvs_broker_entry;

/* Packs a version 2 record of n entries into out (room for
 * KVS_BROKER_REC_MAX bytes). Returns its length, or 0 if n is 0 or above
 * KVS_BROKER_MAX_FDS. */
size_t kvs_broker_rec_pack(const kvs_broker_entry *e, uint32_t n, uint8_t *out);
/* Packs a version 1 record (one entry; for compatibility tests). */
void kvs_broker_v1_pack(const kvs_broker_entry *e, uint8_t out[KVS_BROKER_V1_BYTES]);
/* Reads a request record of either version: the entries into out (room for
 * KVS_BROKER_MAX_FDS), their count into *ret_n. Returns 0; KVS_E_VERSION for
 * the right magic with a version other than 1 or 2; KVS_E_BADMSG for anything
 * else wrong (magic, flags, reserved bytes, a count of 0 or above
 * KVS_BROKER_MAX_FDS, a length that does not match the count). *ret_n is
 * untouched on failure. */
int kvs_broker_rec_unpack(const uint8_t *in, size_t len, kvs_broker_entry *out, uint32_t *ret_n);

void kvs_broker_rep_pack(int status, uint8_t out[KVS_BROKER_REP_BYTES]);
/* Returns 0 and the status in *ret_status, or KVS_E_BADMSG (length, magic). */
int kvs_broker_rep_unpack(const uint8_t *in, size_t len, int *ret_status);

/* Sends buf with n_fds fds attached (0 .. KVS_BROKER_MAX_FDS) in one sendmsg,
 * never blocking (MSG_DONTWAIT) and never raising SIGPIPE. Returns 0,
 * -EINVAL for a bad n_fds, -EAGAIN when the socket buffer is full, or another
 * -errno; -EIO if the kernel took only part of a record. */
int kvs_fd_send(int sock, const void *buf, size_t len, const int *fds, int n_fds);

/* Receives one record into buf (cap bytes) and up to max_fds fds
 * (close-on-exec; max_fds <= KVS_BROKER_MAX_FDS), never blocking. *ret_len
 * gets the record length, *ret_nfds the fds received. If more fds arrived than
 * fit, or the record or its fds were truncated, every received fd is closed
 * and -EMSGSIZE returned. Returns 0, -EAGAIN (nothing there), another
 * -errno, or -ECONNRESET at end of stream. */
int kvs_fd_recv(int sock, void *buf, size_t cap, size_t *ret_len, int *fds, int max_fds,
		int *ret_nfds);

#endif
