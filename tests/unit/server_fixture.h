/* In-process fixture for the server unit tests (registry, jobtable): a real
 * kvs_server on a temporary broker directory whose module functions the test
 * thread drives directly, as if it were the main loop. Replies go to ZeroMQ
 * routing ids nobody holds and are dropped; the tests observe return codes,
 * srv->errbuf and the modules' counters instead. Memory is handed over the
 * way the broker does it: memfds parked in srv->parked under a token. */
#ifndef KVS_SERVER_FIXTURE_H
#define KVS_SERVER_FIXTURE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "jobs.h"
#include "kvs_cq.h"
#include "kvs_cuda.h"
#include "kvs_error.h"
#include "kvs_l1.h"
#include "kvs_log.h"
#include "kvs_workq.h"
#include "memfd_maps.h"
#include "workq_gate.h"
#include "registry.h"
#include "reply.h"
#include "session.h"
#include "server.h"

typedef struct fx {
	kvs_server *srv;
	char dir[64];
} fx;

static inline void fx_start(fx *f, uint32_t terminal_jobs, uint64_t job_deadline_ms)
{
	kvs_log_set_level(getenv("KVS_TEST_VERBOSE") ? KVS_LOG_DEBUG : KVS_LOG_ERROR);
	snprintf(f->dir, sizeof(f->dir), "/tmp/kvs-ut-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(f->dir));
	/* Load the CUDA driver (or fail to) here, once per process: the server
	 * otherwise does it on its setup thread, whose dlopen holds
	 * /etc/ld.so.cache open for a moment while a test counts its fds
	 * (fx_count_fds read one too many, 1 run in ~100, before this). */
	(void)kvs_cuda();
	kvs_server_config cfg;
	kvs_server_config_defaults(&cfg);
	snprintf(cfg.broker_dir, sizeof(cfg.broker_dir), "%s", f->dir);
	cfg.l1_size = 64ull << 20;
	cfg.l1_prefault = false;
	cfg.l2_path[0] = '\0';
	cfg.metrics_listen[0] = '\0'; /* no HTTP endpoint */
	cfg.copy_threads = 1;
	if (terminal_jobs)
		cfg.terminal_jobs = terminal_jobs;
	if (job_deadline_ms)
		cfg.job_deadline_ms = job_deadline_ms;
	ck_assert_int_eq(kvs_server_create(&cfg, &f->srv), 0);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb, (void)flag, (void)ftw;
	return remove(p);
}

static inline void fx_stop(fx *f)
{
	kvs_server_destroy(f->srv);
	f->srv = NULL;
	nftw(f->dir, rm_cb, 8, FTW_DEPTH | FTW_PHYS);
}

static inline int fx_count_fds(void)
{
	int n = 0;
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		return -1;
	while (readdir(d))
		n++;
	closedir(d);
	return n;
}

/* The process's open fds once the server's reclaim thread has run what was
 * queued to it (host unmaps and memfd closes happen there, not at the
 * release). */
static inline int fx_settled_fds(fx *f)
{
	kvs_workq_drain(f->srv->reclaimq);
	return fx_count_fds();
}

/* hello; returns the new session (found by its routing id) */
static inline kvs_session *fx_session(fx *f, const char *ident, const char *engine, const char *ns, uint8_t role,
			       uint32_t rank, uint32_t world)
{
	kvs_msg rq = {.op = KVS_OP_HELLO, .id = 1, .engine = kvs_str_c(engine), .ns = kvs_str_c(ns),
		      .role = role, .rank = rank, .world = world};
	ck_assert_int_eq(kvs__op_hello(f->srv, ident, strlen(ident), &rq), 0);
	size_t pos = 0;
	kvs_session *s;
	while ((s = kvs_htab_next(f->srv->sessions, &pos)) != NULL)
		if (s->ident_len == strlen(ident) && memcmp(s->ident, ident, s->ident_len) == 0)
			return s;
	ck_abort_msg("session '%s' not found", ident);
	return NULL;
}

static inline kvs_session *fx_worker(fx *f, const char *ident, uint32_t rank, uint32_t world)
{
	return fx_session(f, ident, "eng", "ns", KVS_ROLE_WORKER, rank, world);
}

/* A sealable memfd of size bytes. */
static inline int fx_memfd(uint64_t size)
{
	int fd = memfd_create("kvs-ut", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	return fd;
}

static inline uint8_t *fx_map(int fd, uint64_t size)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert_ptr_ne(p, MAP_FAILED);
	return p;
}

static inline void fx_id(uint8_t out[16], uint32_t v)
{
	memset(out, 0, 16);
	memcpy(out, &v, sizeof(v));
	out[15] = 0xA5;
}

/* Parks fd (ownership passes to the server) under token, as the broker
 * does for a record (token, alloc_id, size). */
static inline void fx_park(fx *f, uint32_t token, uint32_t alloc_id, uint64_t size, int fd)
{
	kvs_parked *p = calloc(1, sizeof(*p));
	ck_assert_ptr_nonnull(p);
	fx_id(p->token, token);
	fx_id(p->alloc_id, alloc_id);
	p->size = size;
	p->fd = fd;
	p->uid = getuid();
	p->expires_ms = f->srv->now_ms + 3600 * 1000;
	ck_assert_int_eq(kvs_htab_put(f->srv->parked, p), 0);
}

static inline kvs_alloc_desc fx_alloc(uint32_t token, uint32_t alloc_id, uint64_t size)
{
	kvs_alloc_desc a = {.size = size};
	fx_id(a.token, token);
	fx_id(a.alloc_id, alloc_id);
	return a;
}

static inline int fx_register(fx *f, kvs_session *s, const kvs_alloc_desc *allocs, uint32_t n_allocs,
		       const kvs_group_desc *groups, uint32_t n_groups, const kvs_layer_desc *layers,
		       uint32_t n_layers)
{
	kvs_msg rq = {.op = KVS_OP_REGISTER, .id = 2, .session = s->id,
		      .device = {.type = KVS_DEV_HOST},
		      .allocs = allocs, .n_allocs = n_allocs, .groups = groups, .n_groups = n_groups,
		      .layers = layers, .n_layers = n_layers};
	f->srv->errbuf[0] = '\0';
	return kvs__op_register(f->srv, s, &rq);
}

static inline uint64_t fx_mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* The main loop's eventfd branch: wait for it, drain it, collect copies. */
static inline void fx_pump_once(fx *f, int wait_ms)
{
	struct pollfd pfd = {.fd = kvs_cq_fd(f->srv->cq), .events = POLLIN};
	(void)poll(&pfd, 1, wait_ms);
	kvs__server_completions(f->srv); /* drains the eventfd itself */
}

/* Pumps completions until pred holds (or 60 s: valgrind is slow). */
#define FX_PUMP_UNTIL(f, cond)                                                           \
	do {                                                                             \
		uint64_t fx_t0_ = fx_mono_ms();                                          \
		while (!(cond)) {                                                        \
			ck_assert_msg(fx_mono_ms() - fx_t0_ < 60000, "timed out: %s", #cond); \
			fx_pump_once((f), 20);                                           \
		}                                                                        \
	} while (0)

#endif
