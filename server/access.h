/* File access for one more UID (access.c): `allow-uid` lets a second user
 * (an engine running under its own account) reach the broker directory and
 * the sockets in it. The server grants it with a POSIX ACL entry (the mode
 * bits stay 0700 / 0600 for everyone else), written as the
 * system.posix_acl_access attribute, so no libacl is needed. */
#ifndef KVS_ACCESS_H
#define KVS_ACCESS_H

#include <sys/types.h>

/* Grants uid the permissions perm (r 4, w 2, x 1) on path, on top of its
 * owner-only mode. 0, or -errno (EOPNOTSUPP: the filesystem has no ACLs). */
int kvs_access_grant(const char *path, uid_t uid, unsigned perm);

#endif
