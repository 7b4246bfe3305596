/* The CUDA copy engine of a build without CUDA headers: no engine can be
 * created, so no registration of device memory is ever accepted and nothing
 * else here is reached. Keeps CUDA conditionals out of every other module
 * (they call the same interface either way). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "copy_cuda.h"
#include "kvs_error.h"

int kvs_cuda_engine_create(kvs_cq *cq, void *arena, uint64_t arena_size, const kvs_cuda_opts *opts,
			   kvs_cuda_engine **ret, char *err, size_t errlen)
{
	(void)cq, (void)arena, (void)arena_size, (void)opts, (void)ret;
	snprintf(err, errlen, "not built (no CUDA headers at build time)");
	return -ENODEV;
}

void kvs_cuda_engine_destroy(kvs_cuda_engine *e) { (void)e; }
const char *kvs_cuda_engine_mode(const kvs_cuda_engine *e) { (void)e; return "none"; }
int kvs_cuda_engine_devices(const kvs_cuda_engine *e) { (void)e; return 0; }

static int no_engine(char *err, size_t errlen)
{
	snprintf(err, errlen, "no CUDA engine in this build");
	return KVS_E_DEVICE;
}

int kvs_cuda_import(kvs_cuda_engine *e, const uint8_t uuid[16], int fd, uint64_t size, kvs_cuda_map **ret,
		    char *err, size_t errlen)
{
	(void)e, (void)uuid, (void)size, (void)ret;
	if (fd >= 0)
		close(fd); /* the contract: closed in every case */
	return no_engine(err, errlen);
}

int kvs_cuda_import_ipc(kvs_cuda_engine *e, const uint8_t uuid[16], const uint8_t handle[64], uint64_t size,
			kvs_cuda_map **ret, char *err, size_t errlen)
{
	(void)e, (void)uuid, (void)handle, (void)size, (void)ret;
	return no_engine(err, errlen);
}

void kvs_cuda_unimport(kvs_cuda_engine *e, kvs_cuda_map *m) { (void)e, (void)m; }
uint8_t *kvs_cuda_map_base(const kvs_cuda_map *m) { (void)m; return NULL; }

int kvs_cuda_span_map(kvs_cuda_engine *e, kvs_cuda_map *const *pieces, const uint64_t *sizes, uint32_t n,
		      kvs_cuda_span **ret, char *err, size_t errlen)
{
	(void)e, (void)pieces, (void)sizes, (void)n, (void)ret;
	return no_engine(err, errlen);
}

void kvs_cuda_span_unmap(kvs_cuda_engine *e, kvs_cuda_span *s) { (void)e, (void)s; }
uint8_t *kvs_cuda_span_base(const kvs_cuda_span *s) { (void)s; return NULL; }
int kvs_cuda_map_device(const kvs_cuda_map *m) { (void)m; return -1; }

int kvs_cuda_stream_create(kvs_cuda_engine *e, int device, kvs_cuda_stream **ret)
{
	(void)e, (void)device, (void)ret;
	return KVS_E_DEVICE;
}

void kvs_cuda_stream_destroy(kvs_cuda_engine *e, kvs_cuda_stream *s) { (void)e, (void)s; }
void kvs_cuda_pin_hold(kvs_cuda_engine *e, bool hold) { (void)e, (void)hold; }
bool kvs_cuda_pin_held(kvs_cuda_engine *e) { (void)e; return false; }
bool kvs_cuda_pinning(kvs_cuda_engine *e) { (void)e; return false; }

/* Unreachable: a part reaches an engine only through a CUDA registration's
 * stream, which this build never creates. Fail its tasks all the same. */
void kvs_cuda_submit(kvs_cuda_engine *e, kvs_cuda_stream *s, const kvs_copy_part *part)
{
	(void)e, (void)s;
	for (uint32_t i = 0; i < part->n_tasks; i++) {
		part->tasks[i]->result = KVS_E_DEVICE;
		part->tasks[i]->cq.done(&part->tasks[i]->cq);
	}
}

void kvs_cuda_engine_quiesce(kvs_cuda_engine *e) { (void)e; }
uint64_t kvs_cuda_pinned_prefix(kvs_cuda_engine *e, bool *all)
{
	(void)e;
	*all = true;
	return 0;
}
bool kvs_cuda_poll(kvs_cuda_engine *e, uint32_t *completed)
{
	(void)e;
	*completed = 0;
	return false;
}
int kvs_cuda_stream_device(const kvs_cuda_stream *s) { (void)s; return -1; }

kvs_copy_engine *kvs_cuda_copy_engine(kvs_cuda_engine *e)
{
	(void)e;
	return NULL;
}

void kvs_cuda_get_stats(kvs_cuda_engine *e, kvs_cuda_stats *st)
{
	(void)e;
	memset(st, 0, sizeof(*st));
}
