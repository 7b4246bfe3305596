/* See kvs_trace.h. */
#include "kvs_trace.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kvs_time.h"

#define KVS_TRACE_MAX (1u << 20)

typedef struct rec {
	uint64_t ns;
	uint16_t point;
	uint16_t tid;
	uint32_t arg;
} rec;

int kvs_trace_on;
static rec *recs;
static atomic_uint n_recs;

static void trace_open(void);

/* a forked child records into a file of its own */
static void trace_child(void)
{
	if (recs)
		munmap(recs, (size_t)KVS_TRACE_MAX * sizeof(rec));
	recs = NULL;
	kvs_trace_on = 0;
	atomic_store(&n_recs, 0);
	trace_open();
}

__attribute__((constructor)) static void trace_init(void)
{
	const char *dir = getenv("KVS_TRACE");
	if (!dir || !*dir)
		return;
	pthread_atfork(NULL, NULL, trace_child);
	trace_open();
}

static void trace_open(void)
{
	const char *dir = getenv("KVS_TRACE");
	if (!dir || !*dir)
		return;
	char path[512];
	snprintf(path, sizeof(path), "%s/trace.%d", dir, (int)getpid());
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	size_t bytes = (size_t)KVS_TRACE_MAX * sizeof(rec);
	if (ftruncate(fd, (off_t)bytes) == 0) {
		void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p != MAP_FAILED) {
			recs = p;
			kvs_trace_on = 1;
		}
	}
	close(fd);
}

void kvs_trace_rec(int point, uint32_t arg)
{
	unsigned i = atomic_fetch_add_explicit(&n_recs, 1, memory_order_relaxed);
	if (!recs || i >= KVS_TRACE_MAX)
		return;
	uint16_t tid = (uint16_t)syscall(SYS_gettid);
	recs[i] = (rec){.ns = kvs_now_ns(), .point = (uint16_t)point, .tid = tid, .arg = arg};
}
