/* SCM_RIGHTS helpers and the fd-broker wire format (docs/protocol.md, "fd
 * broker"). The broker speaks SOCK_SEQPACKET: one datagram-like record per
 * message, with the allocation's fd attached to the request record. */
#ifndef KVS_FDPASS_H
#define KVS_FDPASS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define KVS_BROKER_SOCK_NAME "kvside.sock"
#define KVS_BROKER_REQ_BYTES 48
#define KVS_BROKER_REP_BYTES 8

/* Request record, little-endian on the wire:
 *   0  4  magic "KVSB"
 *   4  2  version (1)
 *   6  2  flags (0)
 *   8 16  token
 *  24 16  alloc_id
 *  40  8  size
 * Reply record: 0 4 magic "KVSR", 4 4 status (int32: 0 or a kvs error). */
typedef struct kvs_broker_req {
	uint8_t token[16];
	uint8_t alloc_id[16];
	uint64_t size;
} kvs_broker_req;

void kvs_broker_req_pack(const kvs_broker_req *r, uint8_t out[KVS_BROKER_REQ_BYTES]);
/* Returns 0, or KVS_E_BADMSG for a bad magic, version or flags. */
int kvs_broker_req_unpack(const uint8_t in[KVS_BROKER_REQ_BYTES], kvs_broker_req *r);

/* Sends buf with fds attached (n_fds may be 0) in one sendmsg. Returns 0 or
 * -errno. */
int kvs_fd_send(int sock, const void *buf, size_t len, const int *fds, int n_fds);

/* Receives one record into buf (cap bytes) and up to max_fds fds (close-on-exec).
 * *ret_len gets the record length, *ret_nfds the fds received. If more fds
 * arrived than fit, or the record was truncated, every received fd is closed
 * and -EMSGSIZE returned. Returns 0, -errno, or -ECONNRESET at end of stream. */
int kvs_fd_recv(int sock, void *buf, size_t cap, size_t *ret_len, int *fds, int max_fds,
		int *ret_nfds);

/* Client side: connects to <broker_dir>/kvside.sock, sends one allocation fd
 * and waits (up to timeout_ms) for the reply. Returns 0 or a kvs error/-errno. */
int kvs_broker_send(const char *broker_dir, const kvs_broker_req *req, int fd, int timeout_ms);

#endif
