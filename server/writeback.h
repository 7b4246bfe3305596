/* Write-behind (writeback.c): committed L1 objects go to the persistent
 * tiers, L2 and L3, each pinning the object until that tier's writer has
 * copied it; under L1 pressure, pending writes give way (the oldest job's
 * latest chunks first), never a store. Main-loop thread only. */
#ifndef KVS_WRITEBACK_H
#define KVS_WRITEBACK_H

#include "kvs_l1.h"
#include "server.h"

/* A store committed o (layout geom), chunk idx of write-behind group
 * `group` (the job): queue it to L2, and to L3 if its policy admits it. */
void kvs_writeback_stored(kvs_server *srv, kvs_l1_obj *o, uint64_t geom, uint64_t group, uint32_t idx);
/* A lookup hit o in L1: a use that L3's second-hit policy counts. */
void kvs_writeback_used(kvs_server *srv, kvs_l1_obj *o, uint64_t geom);
/* Drops pending writes (L2's, then L3's) until `bytes` of pins are released;
 * *ret_n gets how many writes were dropped. Returns the bytes released. */
uint64_t kvs_writeback_shed(kvs_server *srv, uint64_t bytes, uint32_t *ret_n);

#endif
