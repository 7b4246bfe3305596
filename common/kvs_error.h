/* kvside error space: 0 is success, -errno for system failures, and the
 * project codes below (a reserved negative range) for protocol and policy
 * failures. Every project code maps one-to-one onto a wire `code` string. */
#ifndef KVS_ERROR_H
#define KVS_ERROR_H

#include <stddef.h>

/* KVS_EXPORT marks libkvside's public API. The library is compiled with
 * -fvisibility=hidden, so libkvside.so exports exactly the functions declared
 * with it in the installed headers (kvside.h and this one) and nothing else
 * (the unit test lib_exports checks `nm -D` against these declarations). In the
 * server, which links the same code statically, it has no effect. */
#ifndef KVS_EXPORT
#if defined(__GNUC__) && __GNUC__ >= 4
#define KVS_EXPORT __attribute__((visibility("default")))
#else
#define KVS_EXPORT
#endif
#endif

enum {
	KVS_E_BASE = -20000,
	KVS_E_BADMSG = KVS_E_BASE, /* malformed message or field */
	KVS_E_VERSION,             /* unsupported protocol version */
	KVS_E_UNKNOWN_OP,          /* op not known to this server */
	KVS_E_LIMIT,               /* a size, length or nesting limit exceeded */
	KVS_E_SESSION,             /* unknown, expired or wrong-epoch session */
	KVS_E_AUTH,                /* broker credentials or token refused */
	KVS_E_NOREG,               /* no such registration */
	KVS_E_GEOMETRY,            /* layout or block-list shape invalid */
	KVS_E_RANGE,               /* block id or offset out of range */
	KVS_E_JOB_CONFLICT,        /* job id reused with other content */
	KVS_E_JOB_STATE,           /* operation not valid in the job's state */
	KVS_E_NOSPACE,             /* cache full and nothing evictable */
	KVS_E_MISS,                /* requested chunk not cached */
	KVS_E_BUSY,                /* resource still in use after the drain timeout */
	KVS_E_DEVICE,              /* copy engine / device failure */
	KVS_E_LAZY_RECURRENT,      /* lazy store touching a recurrent group */
	KVS_E_TIMEOUT,             /* no answer in time */
	KVS_E_INTERNAL,            /* server-side bug or resource failure */
	KVS_E_LAST_ = KVS_E_INTERNAL,
};

/* Human text for any code: 0, a project code, a negative errno (ZeroMQ's
 * own errno values included), or, in the server, an LMDB error code (LMDB
 * codes arise only there; libkvside does not link LMDB and calls them
 * "unknown error"). Returns a static string; never NULL. (CUDA results:
 * kvs_cuda_strerror in kvs_cuda.h.) */
KVS_EXPORT const char *kvs_strerror(int code);

/* Wire name ("E_BADMSG", ...) of a project code; for a negative errno or any
 * other value, "E_INTERNAL". Never NULL. */
KVS_EXPORT const char *kvs_error_name(int code);

/* Project code for a wire name; KVS_E_INTERNAL if the name is unknown. */
KVS_EXPORT int kvs_error_from_name(const char *name, size_t len);

/* True if code is one of the project codes. */
static inline int kvs_error_is_project(int code)
{
	return code >= KVS_E_BASE && code <= KVS_E_LAST_;
}

#endif
