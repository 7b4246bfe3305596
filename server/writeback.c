/* Write-behind to L2 and L3; see writeback.h. */
#include "writeback.h"

#include "kvs_l2.h"
#include "kvs_l3.h"

/* Queues o to L3, pinned until the L3 writer has it (or drops it). */
static void to_l3(kvs_server *srv, kvs_l1_obj *o, uint64_t geom, uint64_t group, uint32_t idx)
{
	kvs_l1_pin(srv->l1, o);
	if (kvs_l3_write_in(srv->l3, kvs_l1_key(o), geom, kvs_l1_data(o), kvs_l1_len(o), o, group, idx) != 0)
		kvs_l1_unpin(srv->l1, o);
}

void kvs_writeback_stored(kvs_server *srv, kvs_l1_obj *o, uint64_t geom, uint64_t group, uint32_t idx)
{
	if (srv->l2) {
		/* written behind; pinned until the writer has copied it */
		kvs_l1_pin(srv->l1, o);
		if (kvs_l2_write_in(srv->l2, kvs_l1_key(o), geom, kvs_l1_data(o), kvs_l1_len(o), o, group, idx) != 0)
			kvs_l1_unpin(srv->l1, o);
	}
	/* not when L3 is known to hold it already (a chunk stored again) */
	if (srv->l3 && !kvs_l3_known(srv->l3, kvs_l1_key(o), geom, kvs_l1_len(o)) &&
	    kvs_l3_admit(srv->l3, kvs_l1_key(o)))
		to_l3(srv, o, geom, group, idx);
}

void kvs_writeback_used(kvs_server *srv, kvs_l1_obj *o, uint64_t geom)
{
	if (srv->l3 && srv->cfg.l3_write == KVS_L3_WRITE_SECOND_HIT && kvs_l3_admit(srv->l3, kvs_l1_key(o)))
		to_l3(srv, o, geom, 0, 0);
}

static uint64_t release(kvs_server *srv, void **cookies, uint32_t n)
{
	uint64_t freed = 0;
	for (uint32_t i = 0; i < n; i++) {
		freed += kvs_l1_len(cookies[i]);
		kvs_l1_unpin(srv->l1, cookies[i]); /* the write-behind pin */
	}
	return freed;
}

uint64_t kvs_writeback_shed(kvs_server *srv, uint64_t bytes, uint32_t *ret_n)
{
	void *cookies[256];
	uint64_t freed = 0;
	uint32_t n = 0, total = 0;
	if (srv->l2) {
		n = kvs_l2_shed(srv->l2, bytes, cookies, 256);
		freed += release(srv, cookies, n);
		total += n;
	}
	if (srv->l3 && freed < bytes) {
		n = kvs_l3_shed(srv->l3, bytes - freed, cookies, 256);
		freed += release(srv, cookies, n);
		total += n;
	}
	*ret_n = total;
	return freed;
}
