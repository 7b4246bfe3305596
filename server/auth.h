/* Authentication (auth.c): who may talk to the server and who may run
 * operator commands. tcp:// endpoints use ZeroMQ CURVE by default: the
 * server's key pair lives in state-dir (created at first start), clients are
 * admitted by public key through a ZAP handler reading authorized-keys (one
 * z85 key per line, optionally followed by `admin`; looked at every
 * KVS_AUTH_RELOAD_MS and re-read when the file changes). A connection's
 * messages carry its key (the ZAP user id): a key removed from the file is
 * refused from the next re-read on, on connections already open too, and
 * the server closes the sessions it opened (loop.c). Plain TCP only with insecure-tcp. ipc:// peers are identified by
 * their UID (SO_PEERCRED, ZeroMQ's Peer-Address). Main-loop thread only. */
#ifndef KVS_AUTH_H
#define KVS_AUTH_H

#include <stdbool.h>
#include <zmq.h>

#include "server.h"

typedef struct kvs_auth kvs_auth;

/* Who sent a request. */
typedef enum kvs_peer_kind {
	KVS_PEER_UNKNOWN = 0,
	KVS_PEER_OWNER,      /* ipc, the server's own UID */
	KVS_PEER_LOCAL,      /* ipc, another UID (allow-uid) */
	KVS_PEER_KEY,        /* tcp, an authorized CURVE key */
	KVS_PEER_ADMIN_KEY,  /* tcp, an authorized CURVE key marked admin */
	KVS_PEER_INSECURE,   /* tcp without CURVE (insecure-tcp) */
	KVS_PEER_REVOKED,    /* tcp, a CURVE key no longer in authorized-keys */
} kvs_peer_kind;

/* Installs the ZAP handler in zctx and, when cfg->listen is a tcp://
 * endpoint without insecure-tcp, loads (or creates) the server key pair.
 * 0, or a negative code with the reason logged. */
int kvs_auth_create(void *zctx, const kvs_server_config *cfg, kvs_auth **ret);
void kvs_auth_destroy(kvs_auth *a);
/* Binds router to endpoint: CURVE server for tcp:// (unless insecure-tcp),
 * with a loud warning for a non-loopback address. 0 or -errno (logged). */
int kvs_auth_bind(kvs_auth *a, void *router, const char *endpoint);
/* The ZAP socket the loop polls, and its handler (answers every pending
 * request without blocking). */
void *kvs_auth_zap_socket(kvs_auth *a);
void kvs_auth_zap_ready(kvs_auth *a);
#define KVS_AUTH_RELOAD_MS 1000

/* The sender of a received message (its body frame); for KVS_PEER_KEY,
 * KVS_PEER_ADMIN_KEY and KVS_PEER_REVOKED its CURVE public key in key. */
kvs_peer_kind kvs_auth_peer(kvs_auth *a, zmq_msg_t *msg, uint8_t key[32]);
/* The loop's tick: every KVS_AUTH_RELOAD_MS, authorized-keys is re-read if
 * it changed. True when it was (the caller closes the sessions of keys no
 * longer in it: kvs_auth_key_ok). */
bool kvs_auth_tick(kvs_auth *a, uint64_t now_ms);
bool kvs_auth_key_ok(const kvs_auth *a, const uint8_t pub[32]);
/* The server's public key (z85, 40 characters), or NULL without CURVE. */
const char *kvs_auth_public_key(const kvs_auth *a);
uint64_t kvs_auth_refused(const kvs_auth *a); /* CURVE handshakes refused */
uint64_t kvs_auth_revoked(const kvs_auth *a); /* messages refused: their key was removed */

#endif
