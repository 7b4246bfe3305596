/* Unit tests for the completion queue (common/kvs_cq.c): items run in
 * posting order, an empty run, items posted from several threads at once
 * each run exactly once (and in each thread's order), an item re-posted
 * from its own done runs on the next run and not the current one, the
 * eventfd readable after a post and cleared by a run, no lost wake-up (a
 * queued item always leaves the eventfd readable once its post returned),
 * and a queue destroyed with items still queued leaving them untouched.
 * No test depends on timing: the eventfd is polled with a zero timeout only
 * to read its state, and the threaded test blocks on it (a lost wake-up
 * hangs until the test case's timeout fails it). The lost-wake-up test is a
 * stress test: correct code never fails it, a run that clears the eventfd
 * after taking the list fails it in a few of its rounds. */
#include <check.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_cq.h"

/* An item that records the order it ran in. */
typedef struct rec {
	kvs_cq_item it; /* first: done gets &rec->it */
	uint32_t id;
	uint32_t runs;
	uint32_t reposts; /* how many times done posts it again */
	kvs_cq *q;
} rec;

static uint32_t g_order[1024];
static uint32_t g_n;

static void rec_done(kvs_cq_item *it)
{
	rec *r = (rec *)it;
	r->runs++;
	ck_assert_uint_lt(g_n, 1024);
	g_order[g_n++] = r->id;
	ck_assert_ptr_null(it->next); /* off the queue when run */
	if (r->reposts) {
		r->reposts--;
		kvs_cq_post(r->q, it);
	}
}

/* Is the eventfd readable right now? (a zero-timeout poll: no waiting) */
static bool signalled(kvs_cq *q)
{
	struct pollfd p = {.fd = kvs_cq_fd(q), .events = POLLIN};
	int r = poll(&p, 1, 0);
	ck_assert_int_ge(r, 0);
	return r == 1 && (p.revents & POLLIN);
}

static kvs_cq *mkq(void)
{
	kvs_cq *q = NULL;
	ck_assert_int_eq(kvs_cq_create(&q), 0);
	ck_assert_ptr_nonnull(q);
	ck_assert_int_ge(kvs_cq_fd(q), 0);
	g_n = 0;
	return q;
}

START_TEST(fifo_order)
{
	kvs_cq *q = mkq();
	ck_assert_uint_eq(kvs_cq_run(q), 0); /* empty */
	ck_assert_uint_eq(g_n, 0);
	static rec r[100];
	/* posted in a shuffled id order: the run follows the posting order */
	uint32_t order[100];
	for (uint32_t i = 0; i < 100; i++)
		order[i] = (i * 37u) % 100u;
	for (uint32_t i = 0; i < 100; i++) {
		rec *x = &r[order[i]];
		memset(x, 0, sizeof(*x));
		x->it.done = rec_done;
		x->id = order[i];
		kvs_cq_post(q, &x->it);
	}
	ck_assert_uint_eq(g_n, 0); /* nothing runs at post */
	ck_assert_uint_eq(kvs_cq_run(q), 100);
	ck_assert_uint_eq(g_n, 100);
	for (uint32_t i = 0; i < 100; i++) {
		ck_assert_uint_eq(g_order[i], order[i]);
		ck_assert_uint_eq(r[i].runs, 1);
	}
	/* drained: a second run has nothing */
	ck_assert_uint_eq(kvs_cq_run(q), 0);
	ck_assert_uint_eq(g_n, 100);
	/* the same items can be posted again once run */
	g_n = 0;
	kvs_cq_post(q, &r[5].it);
	kvs_cq_post(q, &r[3].it);
	ck_assert_uint_eq(kvs_cq_run(q), 2);
	ck_assert_uint_eq(g_order[0], 5);
	ck_assert_uint_eq(g_order[1], 3);
	kvs_cq_destroy(q);
}
END_TEST

START_TEST(eventfd_state)
{
	kvs_cq *q = mkq();
	rec a = {.it.done = rec_done, .id = 1}, b = {.it.done = rec_done, .id = 2};
	ck_assert(!signalled(q));
	kvs_cq_post(q, &a.it);
	ck_assert(signalled(q));
	ck_assert(signalled(q)); /* stays readable until run */
	kvs_cq_post(q, &b.it);
	ck_assert(signalled(q));
	ck_assert_uint_eq(kvs_cq_run(q), 2);
	ck_assert(!signalled(q)); /* cleared by the run */
	/* a run with nothing posted leaves it clear */
	ck_assert_uint_eq(kvs_cq_run(q), 0);
	ck_assert(!signalled(q));
	kvs_cq_post(q, &a.it);
	ck_assert(signalled(q));
	ck_assert_uint_eq(kvs_cq_run(q), 1);
	ck_assert(!signalled(q));
	kvs_cq_destroy(q);
}
END_TEST

START_TEST(repost_from_done)
{
	kvs_cq *q = mkq();
	rec a = {.it.done = rec_done, .id = 1, .reposts = 3, .q = q};
	rec b = {.it.done = rec_done, .id = 2, .q = q};
	kvs_cq_post(q, &a.it);
	kvs_cq_post(q, &b.it);
	/* a re-posts itself from its done: it runs once per run, after the
	 * items posted before it, and wakes the loop again */
	ck_assert_uint_eq(kvs_cq_run(q), 2);
	ck_assert_uint_eq(a.runs, 1);
	ck_assert_uint_eq(b.runs, 1);
	ck_assert(signalled(q));
	kvs_cq_post(q, &b.it); /* posted after a's re-post */
	ck_assert_uint_eq(kvs_cq_run(q), 2);
	ck_assert_uint_eq(a.runs, 2);
	ck_assert(signalled(q));
	ck_assert_uint_eq(kvs_cq_run(q), 1);
	ck_assert_uint_eq(a.runs, 3);
	ck_assert(signalled(q));
	ck_assert_uint_eq(kvs_cq_run(q), 1); /* the last run: no re-post */
	ck_assert_uint_eq(a.runs, 4);
	ck_assert(!signalled(q));
	ck_assert_uint_eq(kvs_cq_run(q), 0);
	static const uint32_t want[] = {1, 2, 1, 2, 1, 1};
	ck_assert_uint_eq(g_n, 6);
	ck_assert_mem_eq(g_order, want, sizeof(want));
	kvs_cq_destroy(q);
}
END_TEST

/* Destroying a queue with items queued drops them: their done never runs
 * (ASan/valgrind also see that nothing touches them). */
START_TEST(destroy_drops_queued)
{
	kvs_cq *q = mkq();
	rec *a = calloc(1, sizeof(*a));
	ck_assert_ptr_nonnull(a);
	a->it.done = rec_done;
	kvs_cq_post(q, &a->it);
	kvs_cq_destroy(q);
	ck_assert_uint_eq(a->runs, 0);
	ck_assert_uint_eq(g_n, 0);
	free(a);
	kvs_cq_destroy(NULL);
}
END_TEST

/* ---- several producer threads ---------------------------------------------- */

#define NTHREADS 4
#define PER_THREAD 10000

typedef struct titem {
	kvs_cq_item it;
	uint32_t thread, seq;
	uint32_t runs;
} titem;

typedef struct tctx {
	kvs_cq *q;
	titem *items;
	uint32_t thread;
	pthread_barrier_t *start;
} tctx;

static uint32_t g_last[NTHREADS]; /* next expected seq per thread */
static uint64_t g_ran;
static bool g_order_ok = true;

static void titem_done(kvs_cq_item *it)
{
	titem *t = (titem *)it;
	t->runs++;
	if (t->seq != g_last[t->thread])
		g_order_ok = false; /* checked after the loop: ck_assert off the main thread would not do */
	g_last[t->thread] = t->seq + 1;
	g_ran++;
}

static void lw_done(kvs_cq_item *it)
{
	(void)it;
	g_ran++;
}

static void *producer(void *arg)
{
	tctx *c = arg;
	pthread_barrier_wait(c->start);
	for (uint32_t i = 0; i < PER_THREAD; i++)
		kvs_cq_post(c->q, &c->items[i].it);
	return NULL;
}

START_TEST(threads_post)
{
	kvs_cq *q = mkq();
	titem *items = calloc((size_t)NTHREADS * PER_THREAD, sizeof(*items));
	ck_assert_ptr_nonnull(items);
	pthread_barrier_t start;
	pthread_barrier_init(&start, NULL, NTHREADS + 1);
	pthread_t th[NTHREADS];
	tctx ctx[NTHREADS];
	memset(g_last, 0, sizeof(g_last));
	g_ran = 0;
	g_order_ok = true;
	for (uint32_t t = 0; t < NTHREADS; t++) {
		for (uint32_t i = 0; i < PER_THREAD; i++) {
			titem *x = &items[(size_t)t * PER_THREAD + i];
			x->it.done = titem_done;
			x->thread = t;
			x->seq = i;
		}
		ctx[t] = (tctx){q, items + (size_t)t * PER_THREAD, t, &start};
		ck_assert_int_eq(pthread_create(&th[t], NULL, producer, &ctx[t]), 0);
	}
	pthread_barrier_wait(&start);
	/* the loop: wait for the eventfd, run, until every item ran; runs
	 * interleave with the posts */
	uint64_t total = 0, runs = 0;
	while (total < (uint64_t)NTHREADS * PER_THREAD) {
		struct pollfd p = {.fd = kvs_cq_fd(q), .events = POLLIN};
		int r = poll(&p, 1, -1);
		ck_assert_int_eq(r, 1);
		total += kvs_cq_run(q);
		runs++;
	}
	for (uint32_t t = 0; t < NTHREADS; t++)
		ck_assert_int_eq(pthread_join(th[t], NULL), 0);
	/* a run after the last: nothing left, nothing signalled that would
	 * yield an item */
	total += kvs_cq_run(q);
	ck_assert_uint_eq(total, (uint64_t)NTHREADS * PER_THREAD);
	ck_assert_uint_eq(g_ran, total);
	ck_assert(g_order_ok);
	for (size_t i = 0; i < (size_t)NTHREADS * PER_THREAD; i++)
		ck_assert_uint_eq(items[i].runs, 1);
	for (uint32_t t = 0; t < NTHREADS; t++)
		ck_assert_uint_eq(g_last[t], PER_THREAD);
	ck_assert(!signalled(q));
	ck_assert_uint_ge(runs, 1);
	pthread_barrier_destroy(&start);
	free(items);
	kvs_cq_destroy(q);
}
END_TEST

/* No lost wake-up: once every post has returned, an item still queued has
 * left the eventfd readable. A run that clears the eventfd after taking the
 * list (instead of before) can swallow the signal of a post that lands in
 * between, leaving an item queued that the loop never wakes up for. Each
 * round races one run against two producers' posts, waits for the posts to
 * return, and checks the state; correct code can never fail this, a wrong
 * order fails it in some rounds. */
#define LW_ROUNDS 20000
#define LW_BURST 2

typedef struct lwctx {
	kvs_cq *q;
	titem items[LW_BURST];
	pthread_barrier_t *start, *end;
	atomic_uint *posted;
} lwctx;

static void *lw_producer(void *arg)
{
	lwctx *c = arg;
	for (uint32_t r = 0; r < LW_ROUNDS; r++) {
		pthread_barrier_wait(c->start);
		for (uint32_t i = 0; i < LW_BURST; i++)
			kvs_cq_post(c->q, &c->items[i].it);
		atomic_fetch_add(c->posted, 1);
		pthread_barrier_wait(c->end);
	}
	return NULL;
}

START_TEST(no_lost_wakeup)
{
	kvs_cq *q = mkq();
	pthread_barrier_t start, end;
	pthread_barrier_init(&start, NULL, 3);
	pthread_barrier_init(&end, NULL, 3);
	atomic_uint posted;
	lwctx ctx[2];
	pthread_t th[2];
	memset(ctx, 0, sizeof(ctx));
	g_ran = 0;
	for (uint32_t t = 0; t < 2; t++) {
		ctx[t].q = q;
		ctx[t].start = &start;
		ctx[t].end = &end;
		ctx[t].posted = &posted;
		for (uint32_t i = 0; i < LW_BURST; i++)
			ctx[t].items[i].it.done = lw_done;
	}
	uint32_t lost = 0;
	uint64_t ran = 0;
	atomic_store(&posted, 0);
	for (uint32_t t = 0; t < 2; t++)
		ck_assert_int_eq(pthread_create(&th[t], NULL, lw_producer, &ctx[t]), 0);
	for (uint32_t r = 0; r < LW_ROUNDS; r++) {
		pthread_barrier_wait(&start);
		ran += kvs_cq_run(q); /* races the posts */
		while (atomic_load(&posted) < 2)
			sched_yield();
		/* every post returned: queued items must be signalled */
		bool sig = signalled(q);
		uint32_t n = kvs_cq_run(q);
		if (n && !sig)
			lost++;
		ran += n;
		ck_assert_uint_eq(ran, (uint64_t)(r + 1) * 2 * LW_BURST);
		atomic_store(&posted, 0);
		pthread_barrier_wait(&end);
	}
	for (uint32_t t = 0; t < 2; t++)
		ck_assert_int_eq(pthread_join(th[t], NULL), 0);
	ck_assert_msg(lost == 0, "%u of %u rounds left items queued with the eventfd clear", lost, LW_ROUNDS);
	ck_assert_uint_eq(g_ran, ran);
	pthread_barrier_destroy(&start);
	pthread_barrier_destroy(&end);
	kvs_cq_destroy(q);
}
END_TEST

static Suite *cq_suite(void)
{
	Suite *s = suite_create("cq");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, fifo_order);
	tcase_add_test(tc, eventfd_state);
	tcase_add_test(tc, repost_from_done);
	tcase_add_test(tc, destroy_drops_queued);
	tcase_add_test(tc, threads_post);
	tcase_add_test(tc, no_lost_wakeup);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(cq_suite)
