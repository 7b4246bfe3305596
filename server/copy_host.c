/* Host copy engine: memcpy worker threads; see copy_host.h. */
#include "copy_host.h"

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvs_log.h"
#include "kvs_time.h"
#include "kvs_trace.h"

struct kvs_copy_pool {
	kvs_copy_engine engine; /* first: the pool is its own engine */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	kvs_copy_task *q_head, *q_tail; /* queued; guarded by mu */
	atomic_uint queued; /* tasks in the queue: written under mu, read by spinning threads */
	unsigned spinning;  /* threads polling `queued` (guarded by mu): each takes a task without a wake-up */
	uint64_t inline_max; /* parts up to this many bytes are copied by the submitter */
	uint64_t spin_ns; /* a thread that ran a task polls the queue this long before it sleeps */
	unsigned delay_us; /* tests (KVS_TEST_COPY_DELAY_MS): each task waits this long first; nothing inline */
	bool stop;
	kvs_cq *cq;
	unsigned n;
	pthread_t *thr;
	atomic_uint_fast64_t bytes;
};

/* ---- SIGBUS guard ------------------------------------------------------------
 * Engine memory the server could not seal against shrinking
 * (allow-unsealed-memory) may lose pages under a copy: the access raises
 * SIGBUS. A copy thread arms `guard` around its memcpy calls; the handler
 * jumps back there and the task fails with -EFAULT. A SIGBUS anywhere else
 * (no guard armed on that thread) gets the default action. */
/* volatile: memcpy is a builtin the compiler knows not to read `guard`, so
 * a plain store before it would be dropped as dead */
static __thread sigjmp_buf *volatile guard;

static void on_sigbus(int sig, siginfo_t *si, void *ctx)
{
	(void)si;
	(void)ctx;
	sigjmp_buf *g = guard;
	if (g)
		siglongjmp(*g, 1);
	kvs_log_fatal(sig); /* not a guarded copy: the log's last lines, then the default */
}

static void install_guard(void)
{
	struct sigaction sa = {.sa_sigaction = on_sigbus, .sa_flags = SA_SIGINFO | SA_ONSTACK};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGBUS, &sa, NULL);
}

/* Copies the task's segments; -EFAULT if one met a page that is gone. */
static int copy_segs(const kvs_copy_task *t)
{
	sigjmp_buf env;
	if (sigsetjmp(env, 1)) {
		guard = NULL;
		return -EFAULT;
	}
	guard = &env;
	for (uint32_t i = 0; i < t->n_segs; i++)
		memcpy(t->segs[i].dst, t->segs[i].src, t->segs[i].len);
	guard = NULL;
	return 0;
}

static void pool_submit(kvs_copy_engine *e, void *stream, const kvs_copy_part *part);
static void run_here(kvs_copy_pool *p, kvs_copy_task *t);

/* Polls the queue's count (without the mutex) until a task comes or spin_ns
 * ran out. */
static void spin_for_task(kvs_copy_pool *p)
{
	uint64_t end = kvs_now_ns() + p->spin_ns;
	for (unsigned i = 1;; i++) {
		if (atomic_load_explicit(&p->queued, memory_order_relaxed))
			return;
		if (!(i & 63) && kvs_now_ns() >= end)
			return;
#if defined(__x86_64__) || defined(__i386__)
		__builtin_ia32_pause();
#endif
	}
}

static void *worker(void *arg)
{
	kvs_copy_pool *p = arg;
	bool may_spin = false; /* once after each task: a job's next part comes soon */
	pthread_mutex_lock(&p->mu);
	for (;;) {
		while (!p->q_head && !p->stop) {
			if (may_spin && p->spin_ns) {
				may_spin = false;
				p->spinning++;
				pthread_mutex_unlock(&p->mu);
				spin_for_task(p);
				pthread_mutex_lock(&p->mu);
				p->spinning--; /* and looks at the queue under mu again */
				continue;
			}
			pthread_cond_wait(&p->cv, &p->mu);
		}
		if (!p->q_head)
			break;
		kvs_copy_task *t = p->q_head;
		p->q_head = t->next;
		if (!p->q_head)
			p->q_tail = NULL;
		atomic_fetch_sub_explicit(&p->queued, 1, memory_order_relaxed);
		may_spin = true;
		pthread_mutex_unlock(&p->mu);
		run_here(p, t);
		pthread_mutex_lock(&p->mu);
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

int kvs_copy_pool_create(unsigned n, uint32_t spin_us, kvs_cq *cq, kvs_copy_pool **ret)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	pthread_once(&once, install_guard);
	kvs_copy_pool *p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->thr = calloc(n, sizeof(*p->thr));
	if (!p->thr) {
		free(p);
		return -ENOMEM;
	}
	pthread_mutex_init(&p->mu, NULL);
	pthread_cond_init(&p->cv, NULL);
	p->cq = cq;
	p->engine = (kvs_copy_engine){.submit = pool_submit, .name = "host"};
	/* the environment overrides the limit (the bench measures both ways; 0: never inline) */
	const char *im = getenv("KVS_COPY_INLINE_MAX");
	p->inline_max = im ? strtoull(im, NULL, 10) : KVS_COPY_INLINE_MAX;
	/* spinning only where cores are plenty (architecture.md §17.11) */
	const char *sp = getenv("KVS_COPY_SPIN_US");
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	uint64_t us = sp ? strtoull(sp, NULL, 10) : cpus >= KVS_COPY_SPIN_MIN_CPUS ? spin_us : 0;
	p->spin_ns = (us < KVS_COPY_SPIN_MAX_US ? us : KVS_COPY_SPIN_MAX_US) * 1000u; /* destroy waits for a spin */
	/* tests: copies that end late (a store still reading blocks the engine
	 * is about to reuse); on the pool threads only, never the loop's */
	const char *td = getenv("KVS_TEST_COPY_DELAY_MS");
	if (td) {
		p->delay_us = (unsigned)strtoul(td, NULL, 10) * 1000u;
		p->inline_max = 0;
	}
	for (p->n = 0; p->n < n; p->n++) {
		int e = pthread_create(&p->thr[p->n], NULL, worker, p);
		if (e) {
			kvs_copy_pool_destroy(p);
			return -e;
		}
	}
	*ret = p;
	return 0;
}

void kvs_copy_pool_destroy(kvs_copy_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->mu);
	p->stop = true;
	pthread_cond_broadcast(&p->cv);
	pthread_mutex_unlock(&p->mu);
	for (unsigned i = 0; i < p->n; i++)
		pthread_join(p->thr[i], NULL);
	pthread_cond_destroy(&p->cv);
	pthread_mutex_destroy(&p->mu);
	free(p->thr);
	free(p);
}

void kvs_copy_pool_submit(kvs_copy_pool *p, kvs_copy_task *t)
{
	t->next = NULL;
	pthread_mutex_lock(&p->mu);
	if (p->q_tail)
		p->q_tail->next = t;
	else
		p->q_head = t;
	p->q_tail = t;
	unsigned q = atomic_fetch_add_explicit(&p->queued, 1, memory_order_relaxed) + 1;
	/* a spinning thread takes the task without a wake-up: it looks at the
	 * queue under mu once its spin ends, so one counted here cannot miss
	 * it; wake a sleeper only for tasks beyond the spinners */
	bool wake = q > p->spinning;
	pthread_mutex_unlock(&p->mu);
	/* after the unlock: the woken thread finds the mutex free, so the
	 * submitter's unlock need not wake it a second time (a futex call each
	 * way per part, seen in the loop's profile) */
	if (wake)
		pthread_cond_signal(&p->cv);
}

/* Runs one task here and posts it, as a pool thread would. */
static void run_here(kvs_copy_pool *p, kvs_copy_task *t)
{
	if (p->delay_us)
		usleep(p->delay_us);
	int r = copy_segs(t);
	if (r && !t->result)
		t->result = r;
	uint64_t total = 0;
	for (uint32_t i = 0; i < t->n_segs && !r; i++)
		total += t->segs[i].len;
	atomic_fetch_add_explicit(&p->bytes, total, memory_order_relaxed);
	KVS_TRACE(KVS_TP_SRV_GPU_DONE, 1);
	kvs_cq_post(p->cq, &t->cq);
}

static void pool_submit(kvs_copy_engine *e, void *stream, const kvs_copy_part *part)
{
	(void)stream;
	kvs_copy_pool *p = (kvs_copy_pool *)e;
	/* a small part is copied right here, on the submitting (loop) thread:
	 * a few microseconds of memcpy cost less than waking a pool thread and
	 * being woken back (issue 18: tiny jobs' rate) */
	uint64_t bytes = 0;
	for (uint32_t i = 0; i < part->n_tasks && bytes <= p->inline_max; i++)
		for (uint32_t j = 0; j < part->tasks[i]->n_segs; j++)
			bytes += part->tasks[i]->segs[j].len;
	for (uint32_t i = 0; i < part->n_tasks; i++) {
		if (bytes <= p->inline_max && p->inline_max)
			run_here(p, part->tasks[i]);
		else
			kvs_copy_pool_submit(p, part->tasks[i]);
	}
}

kvs_copy_engine *kvs_copy_pool_engine(kvs_copy_pool *p) { return &p->engine; }

uint64_t kvs_copy_pool_bytes(kvs_copy_pool *p) { return atomic_load(&p->bytes); }
