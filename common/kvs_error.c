/* Error names and texts: the single table that ties project codes to wire
 * strings. */
#include "kvs_error.h"

#ifdef KVS_ERROR_LMDB
#include <lmdb.h>
#endif
#include <string.h>
#include <zmq.h>

static const struct {
	const char *name;
	const char *text;
} errtab[] = {
	{"E_BADMSG", "malformed message"},
	{"E_VERSION", "unsupported protocol version"},
	{"E_UNKNOWN_OP", "unknown operation"},
	{"E_LIMIT", "limit exceeded"},
	{"E_SESSION", "unknown or expired session"},
	{"E_AUTH", "not authorized"},
	{"E_NOREG", "no such registration"},
	{"E_GEOMETRY", "invalid geometry"},
	{"E_RANGE", "out of range"},
	{"E_JOB_CONFLICT", "job id reused with different content"},
	{"E_JOB_STATE", "invalid job state for this operation"},
	{"E_NOSPACE", "no space in cache"},
	{"E_MISS", "not cached"},
	{"E_BUSY", "resource busy"},
	{"E_DEVICE", "device or copy engine failure"},
	{"E_LAZY_RECURRENT", "lazy store cannot include recurrent state"},
	{"E_TIMEOUT", "timed out"},
	{"E_INTERNAL", "internal error"},
};

_Static_assert(sizeof(errtab) / sizeof(errtab[0]) == KVS_E_LAST_ - KVS_E_BASE + 1,
	       "error table out of step with the enum");

const char *kvs_strerror(int code)
{
	if (code == 0)
		return "success";
	if (kvs_error_is_project(code))
		return errtab[code - KVS_E_BASE].text;
#ifdef KVS_ERROR_LMDB /* the server's build (common/meson.build) */
	if (code >= MDB_KEYEXIST && code <= MDB_LAST_ERRCODE)
		return mdb_strerror(code); /* LMDB's own codes pass through unchanged */
#endif
	if (code < 0 && -code >= ZMQ_HAUSNUMERO && -code < ZMQ_HAUSNUMERO + 100)
		return zmq_strerror(-code); /* ZeroMQ-specific errno values */
	if (code < 0 && code > -4096)
		return strerror(-code);
	return "unknown error";
}

const char *kvs_error_name(int code)
{
	if (kvs_error_is_project(code))
		return errtab[code - KVS_E_BASE].name;
	return "E_INTERNAL";
}

int kvs_error_from_name(const char *name, size_t len)
{
	for (size_t i = 0; i < sizeof(errtab) / sizeof(errtab[0]); i++)
		if (strlen(errtab[i].name) == len && memcmp(errtab[i].name, name, len) == 0)
			return KVS_E_BASE + (int)i;
	return KVS_E_INTERNAL;
}
