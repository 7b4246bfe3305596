/* Authentication; see auth.h. */
#include "auth.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "auth"
#include "kvs_log.h"
#include "keyline.h"

#define KEY_Z85 KVS_KEY_Z85
#define MAX_KEYS 4096

typedef struct akey {
	uint8_t pub[32];
	bool admin;
} akey;

struct kvs_auth {
	void *zap;          /* REP on inproc://zeromq.zap.01 */
	bool curve;         /* a CURVE key pair is loaded */
	bool insecure_tcp;
	char pub_z85[KEY_Z85 + 1];
	char sec_z85[KEY_Z85 + 1];
	char keys_path[512];
	struct timespec keys_mtime;
	uint64_t keys_size;
	uint64_t next_reload_ms; /* kvs_auth_tick's next look at the file */
	uint64_t revoked;
	bool keys_loaded;
	akey *keys;
	uint32_t n_keys;
	uid_t uid;
	uint64_t refused;
};

/* ---- key files -------------------------------------------------------------- */

static int mkdirs(const char *path, mode_t mode)
{
	char tmp[512];
	snprintf(tmp, sizeof(tmp), "%s", path);
	for (char *p = tmp + 1; *p; p++)
		if (*p == '/') {
			*p = '\0';
			if (mkdir(tmp, mode) != 0 && errno != EEXIST)
				return -errno;
			*p = '/';
		}
	return mkdir(tmp, mode) != 0 && errno != EEXIST ? -errno : 0;
}

/* server.key: "<public z85>\n<secret z85>\n", 0600, created once. */
static int load_server_key(kvs_auth *a, const char *dir)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/server.key", dir);
	FILE *f = fopen(path, "r");
	if (f) {
		char pub[64] = "", sec[64] = "";
		int ok = fscanf(f, "%63s %63s", pub, sec) == 2 && strlen(pub) == KEY_Z85 && strlen(sec) == KEY_Z85;
		fclose(f);
		if (!ok) {
			kvs_err("%s is not a kvside key file (two z85 keys of 40 characters)", path);
			return -EINVAL;
		}
		snprintf(a->pub_z85, sizeof(a->pub_z85), "%s", pub);
		snprintf(a->sec_z85, sizeof(a->sec_z85), "%s", sec);
		return 0;
	}
	int r = mkdirs(dir, 0700);
	if (r) {
		kvs_err("cannot create the state directory %s: %s", dir, strerror(-r));
		return r;
	}
	if (zmq_curve_keypair(a->pub_z85, a->sec_z85) != 0) {
		kvs_err("cannot make a CURVE key pair: %s (libzmq without CURVE?)", zmq_strerror(errno));
		return -ENOTSUP;
	}
	int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0) {
		kvs_err("cannot create %s: %s", path, strerror(errno));
		return -errno;
	}
	char buf[2 * KEY_Z85 + 3];
	int n = snprintf(buf, sizeof(buf), "%s\n%s\n", a->pub_z85, a->sec_z85);
	bool ok = write(fd, buf, (size_t)n) == n && fsync(fd) == 0;
	close(fd);
	if (!ok) {
		unlink(path);
		return -EIO;
	}
	kvs_info("created the server's CURVE key pair in %s", path);
	return 0;
}

static int key_cmp(const void *x, const void *y) { return memcmp(((const akey *)x)->pub, ((const akey *)y)->pub, 32); }

/* authorized-keys: "<z85 public key> [admin] [# comment]" per line, lines of
 * any length (getline: a long comment line is one line, never several).
 * Re-read when its mtime or size changes; a missing file admits no key. The
 * keys are kept sorted (kvs_auth_peer looks up every message's key). */
static bool load_keys(kvs_auth *a)
{
	struct stat st;
	if (stat(a->keys_path, &st) != 0) {
		bool had = a->n_keys > 0;
		a->n_keys = 0;
		a->keys_loaded = false;
		return had;
	}
	if (a->keys_loaded && st.st_mtim.tv_sec == a->keys_mtime.tv_sec &&
	    st.st_mtim.tv_nsec == a->keys_mtime.tv_nsec && (uint64_t)st.st_size == a->keys_size)
		return false;
	FILE *f = fopen(a->keys_path, "r");
	if (!f)
		return false;
	if (!a->keys && !(a->keys = calloc(MAX_KEYS, sizeof(*a->keys)))) {
		fclose(f);
		return false;
	}
	uint32_t n = 0, bad = 0, lineno = 0;
	char *line = NULL;
	size_t cap = 0;
	ssize_t got;
	while ((got = getline(&line, &cap, f)) >= 0 && n < MAX_KEYS) {
		lineno++;
		if (memchr(line, '\0', (size_t)got)) { /* a NUL would hide the rest of the line */
			bad++;
			continue;
		}
		int r = kvs_keyline_parse(line, a->keys[n].pub, &a->keys[n].admin);
		if (r < 0) {
			if (bad++ == 0)
				kvs_warn("%s:%u: not \"<z85 key> [admin]\": line ignored", a->keys_path, lineno);
			continue;
		}
		n += (uint32_t)r;
	}
	free(line);
	fclose(f);
	qsort(a->keys, n, sizeof(*a->keys), key_cmp);
	a->n_keys = n;
	a->keys_mtime = st.st_mtim;
	a->keys_size = (uint64_t)st.st_size;
	a->keys_loaded = true;
	kvs_info("authorized keys: %u from %s%s", n, a->keys_path, bad ? " (some lines are not keys: ignored)" : "");
	return true;
}

static const akey *find_key(const kvs_auth *a, const uint8_t pub[32])
{
	akey k;
	memcpy(k.pub, pub, 32);
	return a->n_keys ? bsearch(&k, a->keys, a->n_keys, sizeof(*a->keys), key_cmp) : NULL;
}

bool kvs_auth_tick(kvs_auth *a, uint64_t now_ms)
{
	if (!a->curve || now_ms < a->next_reload_ms)
		return false;
	a->next_reload_ms = now_ms + KVS_AUTH_RELOAD_MS;
	return load_keys(a);
}

bool kvs_auth_key_ok(const kvs_auth *a, const uint8_t pub[32]) { return find_key(a, pub) != NULL; }

int kvs_auth_create(void *zctx, const kvs_server_config *cfg, kvs_auth **ret)
{
	kvs_auth *a = calloc(1, sizeof(*a));
	if (!a)
		return -ENOMEM;
	a->uid = geteuid();
	a->insecure_tcp = cfg->insecure_tcp;
	if (cfg->authorized_keys[0])
		snprintf(a->keys_path, sizeof(a->keys_path), "%s", cfg->authorized_keys);
	else
		snprintf(a->keys_path, sizeof(a->keys_path), "%s/authorized_keys", cfg->state_dir);
	bool tcp = strncmp(cfg->listen, "tcp://", 6) == 0;
	if (tcp && !cfg->insecure_tcp) {
		int r = load_server_key(a, cfg->state_dir);
		if (r) {
			free(a);
			return r;
		}
		a->curve = true;
		load_keys(a);
	}
	a->zap = zmq_socket(zctx, ZMQ_REP);
	int zero = 0;
	if (!a->zap || zmq_setsockopt(a->zap, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
	    zmq_bind(a->zap, "inproc://zeromq.zap.01") != 0) {
		int r = -errno;
		kvs_err("cannot install the ZAP handler: %s", zmq_strerror(errno));
		if (a->zap)
			zmq_close(a->zap);
		free(a);
		return r;
	}
	*ret = a;
	return 0;
}

void kvs_auth_destroy(kvs_auth *a)
{
	if (!a)
		return;
	zmq_close(a->zap);
	free(a->keys);
	free(a);
}

static bool loopback(const char *endpoint)
{
	const char *h = endpoint + 6; /* after tcp:// */
	if (strncmp(h, "127.", 4) == 0 || strncmp(h, "localhost:", 10) == 0 || strncmp(h, "[::1]", 5) == 0)
		return true;
	return false;
}

int kvs_auth_bind(kvs_auth *a, void *router, const char *endpoint)
{
	bool tcp = strncmp(endpoint, "tcp://", 6) == 0;
	int on = tcp && a->curve, off = 0;
	/* tcp peers always meet the ZAP handler (also plain ones, through a
	 * domain), so every tcp message carries a User-Id and only ipc ones do
	 * not; options apply to the binds that follow them, so the ipc endpoint
	 * is bound first (libzmq refuses to reset the domain to "") */
	if ((tcp && zmq_setsockopt(router, ZMQ_ZAP_DOMAIN, "kvside-tcp", 10) != 0) ||
	    zmq_setsockopt(router, ZMQ_CURVE_SERVER, on ? &on : &off, sizeof(int)) != 0 ||
	    (on && zmq_setsockopt(router, ZMQ_CURVE_SECRETKEY, a->sec_z85, KEY_Z85) != 0)) {
		kvs_err("cannot set up CURVE on %s: %s", endpoint, zmq_strerror(errno));
		return -errno;
	}
	if (zmq_bind(router, endpoint) != 0) {
		int r = -errno;
		kvs_err("cannot bind %s: %s", endpoint, zmq_strerror(errno));
		return r;
	}
	if (tcp && !loopback(endpoint))
		kvs_warn("listening on a non-loopback address (%s): %s", endpoint,
			 a->curve ? "only clients whose key is in authorized-keys are admitted"
				  : "insecure-tcp: ANYONE who can reach this port can read and change the cache");
	else if (tcp && !a->curve)
		kvs_warn("insecure-tcp: every local user can use %s without a key", endpoint);
	if (on)
		kvs_info("CURVE on %s, server key %s (clients need it; authorized keys in %s)", endpoint, a->pub_z85,
			 a->keys_path);
	return 0;
}

void *kvs_auth_zap_socket(kvs_auth *a) { return a->zap; }

/* RFC 27 (ZAP): version, request id, domain, address, identity, mechanism,
 * credentials... -> version, request id, status code, status text, user id,
 * metadata. The user id becomes the message's "User-Id" property. */
void kvs_auth_zap_ready(kvs_auth *a)
{
	for (int budget = 0; budget < 64; budget++) {
		zmq_msg_t f[8];
		int n = 0, more = 1;
		while (more && n < 8) {
			zmq_msg_init(&f[n]);
			if (zmq_msg_recv(&f[n], a->zap, n ? 0 : ZMQ_DONTWAIT) < 0) {
				zmq_msg_close(&f[n]);
				if (n == 0)
					return;
				more = 0;
				break;
			}
			more = zmq_msg_more(&f[n]);
			n++;
		}
		while (more) { /* more frames than a ZAP request has: drain them */
			zmq_msg_t x;
			zmq_msg_init(&x);
			zmq_msg_recv(&x, a->zap, 0);
			more = zmq_msg_more(&x);
			zmq_msg_close(&x);
		}
		const char *status = "400", *text = "bad request", *user = "";
		char user_buf[2 + KEY_Z85 + 1];
		if (n >= 7 && zmq_msg_size(&f[5]) == 5 && memcmp(zmq_msg_data(&f[5]), "CURVE", 5) == 0 &&
		    zmq_msg_size(&f[6]) == 32) {
			load_keys(a);
			status = "400";
			text = "key not authorized";
			const akey *k = find_key(a, zmq_msg_data(&f[6]));
			if (k) {
				status = "200";
				text = "OK";
				/* "<kind> <z85 key>": every message of the connection
				 * names its key, checked against the file as it is now */
				user_buf[0] = k->admin ? 'A' : 'C';
				user_buf[1] = ' ';
				zmq_z85_encode(user_buf + 2, k->pub, 32);
				user = user_buf;
			}
			if (status[0] != '2')
				a->refused++;
		} else if (n >= 6 && zmq_msg_size(&f[5]) == 4 && memcmp(zmq_msg_data(&f[5]), "NULL", 4) == 0) {
			/* plain tcp: reached only with insecure-tcp (else CURVE) */
			status = "200", text = "OK", user = "insecure";
		}
		/* reply: echo version and request id */
		zmq_send(a->zap, n > 0 ? zmq_msg_data(&f[0]) : "1.0", n > 0 ? zmq_msg_size(&f[0]) : 3, ZMQ_SNDMORE);
		zmq_send(a->zap, n > 1 ? zmq_msg_data(&f[1]) : "", n > 1 ? zmq_msg_size(&f[1]) : 0, ZMQ_SNDMORE);
		zmq_send(a->zap, status, 3, ZMQ_SNDMORE);
		zmq_send(a->zap, text, strlen(text), ZMQ_SNDMORE);
		zmq_send(a->zap, user, strlen(user), ZMQ_SNDMORE);
		zmq_send(a->zap, "", 0, 0);
		for (int i = 0; i < n; i++)
			zmq_msg_close(&f[i]);
	}
}

kvs_peer_kind kvs_auth_peer(kvs_auth *a, zmq_msg_t *msg, uint8_t key[32])
{
	const char *uid = zmq_msg_gets(msg, "User-Id");
	if (uid && (uid[0] == 'A' || uid[0] == 'C') && uid[1] == ' ' && strlen(uid + 2) == KEY_Z85 &&
	    zmq_z85_decode(key, uid + 2)) {
		const akey *k = find_key(a, key);
		if (!k) {
			a->revoked++;
			return KVS_PEER_REVOKED;
		}
		/* the file's flag now, not the one of the handshake */
		return k->admin ? KVS_PEER_ADMIN_KEY : KVS_PEER_KEY;
	}
	if (uid && strcmp(uid, "insecure") == 0)
		return KVS_PEER_INSECURE;
	/* no User-Id: an ipc peer, "<host>:<uid>:<gid>:<pid>" from SO_PEERCRED
	 * (the uid is the third field from the end) */
	const char *pa = zmq_msg_gets(msg, "Peer-Address");
	const char *f[3] = {NULL, NULL, NULL};
	for (const char *p = pa; p && *p; p++)
		if (*p == ':')
			f[0] = f[1], f[1] = f[2], f[2] = p;
	if (!f[0])
		return KVS_PEER_UNKNOWN;
	char *end;
	unsigned long u = strtoul(f[0] + 1, &end, 10);
	if (end != f[1])
		return KVS_PEER_UNKNOWN;
	return (uid_t)u == a->uid ? KVS_PEER_OWNER : KVS_PEER_LOCAL;
}

const char *kvs_auth_public_key(const kvs_auth *a) { return a->curve ? a->pub_z85 : NULL; }
uint64_t kvs_auth_refused(const kvs_auth *a) { return a->refused; }
uint64_t kvs_auth_revoked(const kvs_auth *a) { return a->revoked; }
