/* libkvside registrations: kvs_register / kvs_unregister and the copies of
 * each registration (duplicated fds, layout) the client keeps so that it can
 * register again by itself after a server restart (kvs__restore). The list is
 * guarded by reg_mu; nothing blocks while it is held. */
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "libkvside"
#include "client_int.h"
#include "kvs_log.h"


static void creg_free(kvs__creg *g)
{
	for (uint32_t i = 0; i < g->n_allocs; i++)
		if (g->allocs[i].fd >= 0)
			close(g->allocs[i].fd);
	free(g->allocs);
	free(g->groups);
	free(g->layers);
	free(g);
}

void kvs__creg_unref(kvs__creg *g)
{
	if (g && atomic_fetch_sub(&g->refs, 1) == 1)
		creg_free(g);
}

/* The `register` request for g, its fds to be pushed under fresh tokens
 * first. Returns 0 or -ENOMEM / KVS_E_LIMIT. */
static int register_req(kvs_client *c, kvs__creg *g, int timeout_ms, kvs__req **ret)
{
	kvs__push *p = kvs__push_new(g);
	kvs_alloc_desc ad[KVS_MAX_ALLOCS];
	kvs_group_desc gd[KVS_MAX_GROUPS];
	kvs_layer_desc *ld = calloc(g->n_layers ? g->n_layers : 1, sizeof(*ld));
	if (!p || !ld) {
		kvs__push_free(p);
		free(ld);
		return -ENOMEM;
	}
	kvs_msg m = {.op = KVS_OP_REGISTER, .session = atomic_load(&c->session)};
	m.device.type = (uint8_t)g->device_type;
	memcpy(m.device.uuid, g->uuid, 16);
	for (uint32_t i = 0; i < g->n_allocs; i++) {
		memcpy(ad[i].token, p->tokens[i], 16);
		memcpy(ad[i].alloc_id, g->allocs[i].alloc_id, 16);
		ad[i].size = g->allocs[i].size;
		ad[i].follows = g->allocs[i].follows;
		ad[i].ipc_handle = (kvs_bytes){NULL, 0};
		if (g->allocs[i].fd < 0 && g->device_type == KVS_DEV_CUDA)
			ad[i].ipc_handle = (kvs_bytes){g->allocs[i].ipc_handle, KVS_IPC_HANDLE_LEN};
	}
	for (uint32_t i = 0; i < g->n_groups; i++)
		gd[i] = (kvs_group_desc){g->groups[i].id, (uint8_t)g->groups[i].kind,
					 g->groups[i].tokens_per_block, g->groups[i].blocks_per_chunk,
					 g->groups[i].window_chunks, g->groups[i].null_block};
	for (uint32_t i = 0; i < g->n_layers; i++)
		ld[i] = (kvs_layer_desc){g->layers[i].group, g->layers[i].alloc, g->layers[i].offset,
					 g->layers[i].num_blocks, g->layers[i].block_stride,
					 g->layers[i].block_bytes};
	m.allocs = ad;
	m.n_allocs = g->n_allocs;
	m.groups = gd;
	m.n_groups = g->n_groups;
	m.layers = ld;
	m.n_layers = g->n_layers;
	int e = kvs__req_new(c, &m, timeout_ms, ret);
	free(ld);
	if (e) {
		kvs__push_free(p);
		return e;
	}
	(*ret)->push = p;
	return 0;
}

/* Copies d into a new kept registration (refs 1, fds duplicated). */
static int creg_new(const kvs_registration_desc *d, kvs__creg **ret)
{
	kvs__creg *g = calloc(1, sizeof(*g));
	if (!g)
		return -ENOMEM;
	atomic_init(&g->refs, 1);
	int r = -ENOMEM;
	g->allocs = calloc(d->n_allocs, sizeof(*g->allocs));
	g->groups = calloc(d->n_groups ? d->n_groups : 1, sizeof(*g->groups));
	g->layers = calloc(d->n_layers ? d->n_layers : 1, sizeof(*g->layers));
	if (!g->allocs || !g->groups || !g->layers)
		goto err;
	g->device_type = d->device_type;
	memcpy(g->uuid, d->device_uuid, 16);
	for (uint32_t i = 0; i < d->n_allocs; i++) {
		g->allocs[i] = d->allocs[i];
		g->allocs[i].fd = -1;
		g->n_allocs = i + 1; /* creg_free closes what is set */
		if (d->allocs[i].fd < 0 && d->device_type == KVS_DEV_CUDA) {
			/* legacy CUDA IPC: the handle travels in the message (copied
			 * with the entry above); an entry with neither is refused */
			static const uint8_t none[KVS_IPC_HANDLE_LEN];
			if (memcmp(d->allocs[i].ipc_handle, none, sizeof(none)) == 0) {
				r = -EBADF;
				goto err;
			}
			continue;
		}
		g->allocs[i].fd = fcntl(d->allocs[i].fd, F_DUPFD_CLOEXEC, 3);
		if (g->allocs[i].fd < 0) {
			r = -errno;
			goto err;
		}
		static const uint8_t zero[16];
		if (memcmp(g->allocs[i].alloc_id, zero, 16) == 0)
			randombytes_buf(g->allocs[i].alloc_id, 16);
	}
	memcpy(g->groups, d->groups, d->n_groups * sizeof(*g->groups));
	g->n_groups = d->n_groups;
	memcpy(g->layers, d->layers, d->n_layers * sizeof(*g->layers));
	g->n_layers = d->n_layers;
	*ret = g;
	return 0;
err:
	creg_free(g);
	return r;
}

/* Inserts g by handle (handles grow with registration order). reg_mu held. */
static void list_insert(kvs_client *c, kvs__creg *g)
{
	kvs__creg **pp = &c->regs;
	while (*pp && (*pp)->handle < g->handle)
		pp = &(*pp)->next;
	g->next = *pp;
	*pp = g;
}

int kvs_register(kvs_client *c, const kvs_registration_desc *d, int timeout_ms, uint64_t *ret_handle)
{
	if (!d || d->n_allocs == 0 || d->n_allocs > KVS_MAX_ALLOCS || d->n_groups > KVS_MAX_GROUPS ||
	    d->n_layers > KVS_MAX_LAYERS)
		return KVS_E_LIMIT;
	if (kvs__forked(c))
		return KVS_E_SESSION;
	if (kvs__on_io_thread(c))
		return -EDEADLK;
	kvs__creg *g = NULL;
	kvs__req *r = NULL;
	int e = creg_new(d, &g);
	if (e)
		return e;
	if ((e = register_req(c, g, timeout_ms, &r)) != 0) {
		kvs__creg_unref(g);
		return e;
	}
	/* the I/O thread pushes the fds (client_broker.c), then sends r */
	kvs__waiter w = {0};
	if ((e = kvs__call_req(c, r, &w)) != 0) {
		kvs__creg_unref(g);
		return e;
	}
	pthread_mutex_lock(&c->reg_mu);
	g->server_id = w.res.registration;
	g->handle = c->next_handle++;
	list_insert(c, g); /* oldest first: a restore ends with the newest */
	*ret_handle = g->handle;
	pthread_mutex_unlock(&c->reg_mu);
	return 0;
}

int kvs_unregister(kvs_client *c, uint64_t handle, int timeout_ms)
{
	if (kvs__forked(c))
		return KVS_E_SESSION;
	/* out of the list while the request runs: a restore starting meanwhile
	 * does not bring it back, and one already pushing it unregisters what it
	 * restored (on_reregister) */
	pthread_mutex_lock(&c->reg_mu);
	kvs__creg **pp = &c->regs;
	while (*pp && (*pp)->handle != handle)
		pp = &(*pp)->next;
	kvs__creg *g = *pp;
	if (g)
		*pp = g->next;
	uint64_t sid = g ? g->server_id : 0;
	pthread_mutex_unlock(&c->reg_mu);
	if (!g)
		return KVS_E_NOREG;
	kvs_msg m = {.op = KVS_OP_UNREGISTER, .session = atomic_load(&c->session), .registration = sid};
	kvs__waiter w = {0};
	int r = kvs__call(c, &m, timeout_ms, &w);
	if (r && r != KVS_E_NOREG) { /* still registered (E_BUSY, a timeout...): keep it */
		pthread_mutex_lock(&c->reg_mu);
		list_insert(c, g);
		pthread_mutex_unlock(&c->reg_mu);
		return r;
	}
	kvs__creg_unref(g);
	return r;
}

/* ---- restore after a restart (I/O thread) ----------------------------------- */

static void on_orphan_unregistered(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	(void)c, (void)r, (void)rep, (void)code;
}

static void on_reregister(kvs_client *c, kvs__req *r, const kvs_msg *rep, int code)
{
	uint64_t handle = (uint64_t)(uintptr_t)r->iarg;
	bool kept = false;
	pthread_mutex_lock(&c->reg_mu);
	for (kvs__creg *g = c->regs; g; g = g->next)
		if (g->handle == handle) {
			kept = true;
			if (code == 0)
				g->server_id = rep->registration;
		}
	pthread_mutex_unlock(&c->reg_mu);
	if (code == 0 && !kept) {
		/* the application unregistered it while it was being restored */
		kvs_msg m = {.op = KVS_OP_UNREGISTER, .session = atomic_load(&c->session),
			     .registration = rep->registration};
		(void)kvs__submit(c, &m, 0, NULL, NULL, on_orphan_unregistered, NULL);
	}
	kvs__restore_step_done(c, code);
}

int kvs__restore(kvs_client *c)
{
	int n = 0;
	/* building the requests takes no I/O: the pushes run from the poll loop */
	pthread_mutex_lock(&c->reg_mu);
	for (kvs__creg *g = c->regs; g; g = g->next) {
		kvs__req *r;
		g->server_id = 0;
		int e = register_req(c, g, 0, &r);
		if (!e) {
			r->internal = on_reregister;
			r->iarg = (void *)(uintptr_t)g->handle;
			e = kvs__req_submit(c, r);
		}
		if (e) {
			if (!c->restore_err)
				c->restore_err = e;
			continue;
		}
		c->restore_left++;
		n++;
	}
	pthread_mutex_unlock(&c->reg_mu);
	return n;
}

void kvs__regs_free(kvs_client *c)
{
	while (c->regs) {
		kvs__creg *g = c->regs;
		c->regs = g->next;
		kvs__creg_unref(g);
	}
}
