/* A build without hiredis: no Redis backend (the server refuses l3-redis
 * with a clear message). */
#include <stddef.h>

#include "kvs_l3.h"

const kvs_l3_backend *kvs_l3_redis_backend(void) { return NULL; }
