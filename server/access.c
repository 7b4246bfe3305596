/* POSIX ACL entries without libacl; see access.h. The attribute is a
 * version word (2) followed by entries {u16 tag, u16 perm, u32 id} sorted by
 * tag (the format of linux/posix_acl_xattr.h). */
#include "access.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>

enum { TAG_USER_OBJ = 0x01, TAG_USER = 0x02, TAG_GROUP_OBJ = 0x04, TAG_MASK = 0x10, TAG_OTHER = 0x20 };
#define UNDEFINED_ID 0xffffffffu

typedef struct acl_entry {
	uint16_t tag, perm;
	uint32_t id;
} acl_entry;

int kvs_access_grant(const char *path, uid_t uid, unsigned perm)
{
	struct stat st;
	if (stat(path, &st) != 0)
		return -errno;
	struct {
		uint32_t version;
		acl_entry e[5];
	} acl = {.version = 2,
		 .e = {{TAG_USER_OBJ, (uint16_t)((st.st_mode >> 6) & 7), UNDEFINED_ID},
		       {TAG_USER, (uint16_t)(perm & 7), (uint32_t)uid},
		       {TAG_GROUP_OBJ, (uint16_t)((st.st_mode >> 3) & 7), UNDEFINED_ID},
		       {TAG_MASK, (uint16_t)((perm | (st.st_mode >> 3)) & 7), UNDEFINED_ID},
		       {TAG_OTHER, (uint16_t)(st.st_mode & 7), UNDEFINED_ID}}};
	if (setxattr(path, "system.posix_acl_access", &acl, sizeof(acl), 0) != 0)
		return -errno;
	return 0;
}
