/* Unit tests for the work queue (common/kvs_workq.c): work runs off the
 * submitting thread, in submission order; items with a done are posted to the
 * completion queue in that order and run there, items without one are not
 * posted (they free themselves); drain returns only once every earlier item's
 * work ran; destroy runs what is still queued; a NULL queue runs work inline.
 * Ordering is checked with a gate the test opens, not with timing. */
#include <check.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_cq.h"
#include "kvs_workq.h"

typedef struct job {
	kvs_workq_item wi; /* first */
	uint32_t id;
	pthread_t ran_on;
	bool freed_self;
} job;

static uint32_t g_work[256], g_done[256];
static atomic_uint g_nwork;
static uint32_t g_ndone;
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_gate_cv = PTHREAD_COND_INITIALIZER;
static bool g_gate_open = true;

static void gate_set(bool open)
{
	pthread_mutex_lock(&g_gate_mu);
	g_gate_open = open;
	pthread_cond_broadcast(&g_gate_cv);
	pthread_mutex_unlock(&g_gate_mu);
}

static void job_work(kvs_workq_item *it)
{
	job *j = (job *)it;
	pthread_mutex_lock(&g_gate_mu);
	while (!g_gate_open)
		pthread_cond_wait(&g_gate_cv, &g_gate_mu);
	pthread_mutex_unlock(&g_gate_mu);
	j->ran_on = pthread_self();
	g_work[atomic_fetch_add(&g_nwork, 1)] = j->id;
}

static void job_done(kvs_cq_item *it)
{
	job *j = (job *)it;
	g_done[g_ndone++] = j->id;
}

static atomic_uint g_selffreed;

static void self_free_work(kvs_workq_item *it)
{
	atomic_fetch_add(&g_selffreed, 1);
	free(it);
}

static void reset(void)
{
	atomic_store(&g_nwork, 0);
	g_ndone = 0;
	atomic_store(&g_selffreed, 0);
	gate_set(true);
}

START_TEST(fifo_off_thread_and_completions_in_order)
{
	reset();
	kvs_cq *cq;
	kvs_workq *q;
	ck_assert_int_eq(kvs_cq_create(&cq), 0);
	ck_assert_int_eq(kvs_workq_create(cq, &q), 0);
	job js[64];
	gate_set(false); /* nothing runs until every item is queued */
	for (uint32_t i = 0; i < 64; i++) {
		js[i] = (job){.wi = {.work = job_work, .cq.done = job_done}, .id = i};
		kvs_workq_submit(q, &js[i].wi);
	}
	ck_assert_uint_eq(atomic_load(&g_nwork), 0);
	ck_assert_uint_ge(kvs_workq_pending(q), 63);
	gate_set(true);
	kvs_workq_drain(q);
	ck_assert_uint_eq(atomic_load(&g_nwork), 64);
	ck_assert_uint_eq(kvs_workq_pending(q), 0);
	for (uint32_t i = 0; i < 64; i++) {
		ck_assert_uint_eq(g_work[i], i);
		ck_assert(!pthread_equal(js[i].ran_on, pthread_self()));
	}
	/* every completion was posted before drain returned */
	struct pollfd p = {.fd = kvs_cq_fd(cq), .events = POLLIN};
	ck_assert_int_eq(poll(&p, 1, 0), 1);
	ck_assert_uint_eq(kvs_cq_run(cq), 64);
	for (uint32_t i = 0; i < 64; i++)
		ck_assert_uint_eq(g_done[i], i);
	kvs_workq_destroy(q);
	kvs_cq_destroy(cq);
}
END_TEST

START_TEST(fire_and_forget_not_posted)
{
	reset();
	kvs_cq *cq;
	kvs_workq *q;
	ck_assert_int_eq(kvs_cq_create(&cq), 0);
	ck_assert_int_eq(kvs_workq_create(cq, &q), 0);
	for (int i = 0; i < 10; i++) {
		kvs_workq_item *it = calloc(1, sizeof(*it));
		it->work = self_free_work; /* cq.done NULL */
		kvs_workq_submit(q, it);
	}
	kvs_workq_drain(q);
	ck_assert_uint_eq(atomic_load(&g_selffreed), 10);
	ck_assert_uint_eq(kvs_cq_run(cq), 0);
	kvs_workq_destroy(q);
	kvs_cq_destroy(cq);
}
END_TEST

START_TEST(destroy_runs_what_is_queued)
{
	reset();
	kvs_cq *cq;
	kvs_workq *q;
	ck_assert_int_eq(kvs_cq_create(&cq), 0);
	ck_assert_int_eq(kvs_workq_create(cq, &q), 0);
	gate_set(false);
	job js[8];
	for (uint32_t i = 0; i < 8; i++) {
		js[i] = (job){.wi = {.work = job_work}, .id = i};
		kvs_workq_submit(q, &js[i].wi);
	}
	gate_set(true);
	kvs_workq_destroy(q); /* joins after running all eight */
	ck_assert_uint_eq(atomic_load(&g_nwork), 8);
	kvs_cq_destroy(cq);
}
END_TEST

START_TEST(null_queue_runs_inline)
{
	reset();
	job j = {.wi = {.work = job_work, .cq.done = job_done}, .id = 7};
	kvs_workq_submit(NULL, &j.wi);
	ck_assert_uint_eq(atomic_load(&g_nwork), 1);
	ck_assert(pthread_equal(j.ran_on, pthread_self()));
	ck_assert_uint_eq(g_ndone, 0); /* the caller finishes it */
	kvs_workq_drain(NULL);
	kvs_workq_destroy(NULL);
	ck_assert_uint_eq(kvs_workq_pending(NULL), 0);
}
END_TEST

static Suite *workq_suite(void)
{
	Suite *s = suite_create("workq");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, fifo_off_thread_and_completions_in_order);
	tcase_add_test(tc, fire_and_forget_not_posted);
	tcase_add_test(tc, destroy_runs_what_is_queued);
	tcase_add_test(tc, null_queue_runs_inline);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(workq_suite)
