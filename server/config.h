/* kvside-server configuration: one table of settings shared by the YAML file
 * (--config FILE) and the command line, so both accept exactly the same
 * names and values. The file is a YAML mapping of setting name to scalar;
 * names are the long option names (`l1-size`; `l1_size` is accepted too).
 * The command line overrides the file; --print-config shows the result. */
#ifndef KVS_SERVER_CONFIG_H
#define KVS_SERVER_CONFIG_H

#include <stddef.h>
#include <stdio.h>

/* defined in server.h; tools that only read a file need not see it */
typedef struct kvs_server_config kvs_server_config;

/* Value kinds of the settings. */
enum kvs_config_type {
	KVS_CFG_STR,   /* text; "" allowed only where the setting says so */
	KVS_CFG_SIZE,  /* bytes, suffixes K M G (KiB, MiB, GiB; "KB"/"K"/"KiB" alike) */
	KVS_CFG_MS,    /* milliseconds, 1 .. 86400000 */
	KVS_CFG_COUNT, /* unsigned integer within [min, max] */
	KVS_CFG_UID,   /* a UID, or none (-1, "none", empty or null) */
	KVS_CFG_LEVEL, /* error, warn, info, debug */
	KVS_CFG_SYNC,  /* full, nometa, none */
	KVS_CFG_LOGFMT, /* text, json */
	KVS_CFG_BOOL,  /* true/false (also yes/no, on/off, 1/0) */
	KVS_CFG_L3WRITE, /* all, none, second-hit */
};

typedef struct kvs_config_key {
	const char *name; /* as on the command line, without "--" */
	int type;         /* enum kvs_config_type */
	size_t off;       /* offset of the field in kvs_server_config */
	size_t cap;       /* STR: buffer size (the value must be shorter) */
	unsigned long long min, max; /* SIZE, COUNT, MS bounds; STR: min 1 = non-empty */
	const char *arg;  /* argument placeholder for --help */
	const char *help; /* one line for --help and the example file */
} kvs_config_key;

/* The settings, in the order --help and --print-config list them. Ends with
 * an entry whose name is NULL. */
const kvs_config_key *kvs_config_keys(void);
/* The setting of this name ("l1-size" or "l1_size"), or NULL. */
const kvs_config_key *kvs_config_find(const char *name);

/* A zeroed configuration on the heap, for tools that only read a file and
 * query it with kvs_config_format(); free() it. NULL if out of memory. */
kvs_server_config *kvs_config_new(void);

/* Sets one setting from its text. Returns 0, or -ENOENT (no such setting)
 * or -EINVAL (bad value) with a message naming the setting in err (always
 * NUL-terminated; cfg untouched on failure). */
int kvs_config_set(kvs_server_config *cfg, const char *name, const char *value, char *err,
		   size_t cap);

/* Reads the YAML file at path over cfg: every setting it names is set, the
 * others keep their values. Returns 0, or -errno (file unreadable) or
 * -EINVAL (syntax error, unknown setting, bad value, duplicate, non-scalar
 * value) with "PATH:LINE: ..." in err naming the setting. On failure cfg may
 * hold the settings read before the bad one: callers discard it. */
int kvs_config_load(kvs_server_config *cfg, const char *path, char *err, size_t cap);

/* Checks rules between settings (heartbeat below the session lease).
 * Returns 0 or -EINVAL with the message in err. */
int kvs_config_check(const kvs_server_config *cfg, char *err, size_t cap);

/* Formats the value of one setting as kvs_config_set accepts it (sizes with
 * the largest exact suffix, strings unquoted). */
void kvs_config_format(const kvs_server_config *cfg, const kvs_config_key *k, char *buf,
		       size_t cap);

/* Splits "HOST:PORT" ("[v6addr]:PORT" for IPv6) into host (brackets
 * removed) and port. Returns 0 or -EINVAL. */
int kvs_config_hostport(const char *s, char *host, size_t cap, unsigned *ret_port);

/* Writes cfg as a YAML document that kvs_config_load reads back to the same
 * values. */
void kvs_config_print(FILE *f, const kvs_server_config *cfg);

#endif
