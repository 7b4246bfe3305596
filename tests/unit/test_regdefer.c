/* Unit tests for deferred registers (server/registry.c, issue 18): a
 * register whose driver work runs on the setup thread and is answered from
 * the completion queue. No GPU: the test hook KVS_TEST_REGISTER_DELAY_MS
 * defers host registers too and makes their work that much slower, a stand-in
 * for a driver held by pinning. In process (server_fixture.h), the test
 * thread playing the main loop. Covers: the register returns at once with
 * the session marked pending and nothing built; the session is not reaped
 * while pending, however long, and its lease is renewed at the answer; the
 * registration appears only when the completion runs; a session closed while
 * its register is pending leaves no registration, import or fd behind; an
 * alias of an import another pending register is making works; an alias of
 * one whose open fails fails too, and the table empties; requests held
 * behind a pending register are bounded and freed with the session. */
#include <stdlib.h>

#include "kvs_workq.h"
#include "server_fixture.h"

#include "check_main.h"

#define ASZ 16384u
#define DELAY_MS 300

static const kvs_group_desc G3 = {.id = 3, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16,
				  .blocks_per_chunk = 2, .window_chunks = -1, .null_block = -1};
static const kvs_layer_desc L1X[1] = {
	{.group = 3, .alloc = 0, .offset = 0, .num_blocks = 16, .block_stride = 256, .block_bytes = 256},
};

static void start(fx *f)
{
	char v[16];
	snprintf(v, sizeof(v), "%d", DELAY_MS);
	setenv("KVS_TEST_REGISTER_DELAY_MS", v, 1);
	fx_start(f, 0, 0);
	unsetenv("KVS_TEST_REGISTER_DELAY_MS");
}

static int reg_fd(fx *f, kvs_session *s, int fd, uint32_t token, uint32_t alloc_id)
{
	fx_park(f, token, alloc_id, ASZ, fd);
	kvs_alloc_desc a = fx_alloc(token, alloc_id, ASZ);
	return fx_register(f, s, &a, 1, &G3, 1, L1X, 1);
}

START_TEST(pending_then_answered)
{
	fx f;
	start(&f);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	uint64_t t0 = fx_mono_ms();
	ck_assert_int_eq(reg_fd(&f, a, dup(fd), 1, 100), 0);
	ck_assert_uint_lt(fx_mono_ms() - t0, DELAY_MS / 2); /* the loop did not wait for the work */
	ck_assert(a->reg_pending);
	ck_assert_ptr_null(kvs_registry_of_session(R, a->id));
	/* far past the lease: a pending register is the server's wait */
	f.srv->now_ms += 10 * f.srv->cfg.ttl_ms;
	kvs__sessions_reap(f.srv);
	ck_assert_ptr_eq(kvs__session_get(f.srv, a->id), a);
	ck_assert_uint_eq(f.srv->st.sessions_reaped, 0);
	FX_PUMP_UNTIL(&f, !a->reg_pending);
	ck_assert_uint_ge(fx_mono_ms() - t0, DELAY_MS);
	ck_assert_ptr_nonnull(kvs_registry_of_session(R, a->id));
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	/* the lease runs from the answer */
	ck_assert_uint_eq(a->expires_ms, f.srv->now_ms + f.srv->cfg.ttl_ms);
	kvs__sessions_reap(f.srv);
	ck_assert_ptr_eq(kvs__session_get(f.srv, a->id), a);
	close(fd);
	fx_stop(&f);
}
END_TEST

START_TEST(session_gone_while_pending)
{
	fx f;
	start(&f);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	int fds0 = fx_count_fds();
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	uint64_t id = a->id;
	ck_assert_int_eq(reg_fd(&f, a, dup(fd), 1, 100), 0);
	/* requests held behind it go with the session */
	static const uint8_t msg[64] = {0};
	ck_assert_int_eq(kvs__session_hold(f.srv, a, (const uint8_t *)"a", 1, msg, sizeof(msg)), 0);
	ck_assert_uint_eq(a->n_held, 1);
	kvs__session_close(f.srv, a, "test");
	ck_assert_ptr_null(kvs__session_get(f.srv, id));
	kvs_workq_drain(f.srv->setupq);
	kvs__server_completions(f.srv);
	ck_assert_uint_eq(kvs_registry_count(R), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 0);
	ck_assert_int_eq(fx_settled_fds(&f), fds0); /* the claimed fd was closed */
	close(fd);
	fx_stop(&f);
}
END_TEST

START_TEST(alias_of_pending_import)
{
	fx f;
	start(&f);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 2);
	kvs_session *b = fx_worker(&f, "b", 1, 2);
	ck_assert_int_eq(reg_fd(&f, a, dup(fd), 1, 100), 0);
	ck_assert_int_eq(reg_fd(&f, b, dup(fd), 2, 100), 0); /* reserved as an alias of a's pending import */
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	FX_PUMP_UNTIL(&f, !a->reg_pending && !b->reg_pending);
	ck_assert_ptr_nonnull(kvs_registry_of_session(R, a->id));
	ck_assert_ptr_nonnull(kvs_registry_of_session(R, b->id));
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 1);
	close(fd);
	fx_stop(&f);
}
END_TEST

START_TEST(alias_of_failing_import)
{
	fx f;
	start(&f);
	kvs_registry *R = f.srv->reg;
	int fds0 = fx_count_fds();
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0); /* not a memfd: the open fails on the setup thread */
	kvs_session *a = fx_worker(&f, "a", 0, 2);
	kvs_session *b = fx_worker(&f, "b", 1, 2);
	ck_assert_int_eq(reg_fd(&f, a, dup(pfd[0]), 1, 100), 0);
	ck_assert_int_eq(reg_fd(&f, b, dup(pfd[0]), 2, 100), 0);
	FX_PUMP_UNTIL(&f, !a->reg_pending && !b->reg_pending);
	ck_assert_ptr_null(kvs_registry_of_session(R, a->id));
	ck_assert_ptr_null(kvs_registry_of_session(R, b->id));
	ck_assert_uint_eq(kvs_registry_count(R), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 0);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	close(pfd[0]);
	close(pfd[1]);
	ck_assert_int_eq(fx_settled_fds(&f), fds0 + 0);
	/* a fresh register of that alloc_id imports anew */
	int fd = fx_memfd(ASZ);
	ck_assert_int_eq(reg_fd(&f, a, dup(fd), 3, 100), 0);
	FX_PUMP_UNTIL(&f, !a->reg_pending);
	ck_assert_ptr_nonnull(kvs_registry_of_session(R, a->id));
	close(fd);
	fx_stop(&f);
}
END_TEST

START_TEST(replaces_only_when_answered)
{
	fx f;
	start(&f);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	ck_assert_int_eq(reg_fd(&f, a, dup(fd), 1, 100), 0);
	FX_PUMP_UNTIL(&f, !a->reg_pending);
	kvs_reg *g1 = kvs_registry_of_session(R, a->id);
	ck_assert_ptr_nonnull(g1);
	uint64_t id1 = g1->id;
	int fd2 = fx_memfd(ASZ);
	ck_assert_int_eq(reg_fd(&f, a, dup(fd2), 2, 200), 0);
	/* the old registration serves until the new one is answered */
	ck_assert_ptr_eq(kvs_registry_of_session(R, a->id), g1);
	FX_PUMP_UNTIL(&f, !a->reg_pending);
	kvs_reg *g2 = kvs_registry_of_session(R, a->id);
	ck_assert_ptr_nonnull(g2);
	ck_assert_uint_ne(g2->id, id1);
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	close(fd);
	close(fd2);
	fx_stop(&f);
}
END_TEST

START_TEST(held_requests_bounded)
{
	fx f;
	start(&f);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	int fd = fx_memfd(ASZ);
	ck_assert_int_eq(reg_fd(&f, a, dup(fd), 1, 100), 0);
	static const uint8_t msg[256] = {0};
	int r = 0;
	uint32_t n = 0;
	while ((r = kvs__session_hold(f.srv, a, (const uint8_t *)"a", 1, msg, sizeof(msg))) == 0 && n < 100000)
		n++;
	ck_assert_int_eq(r, KVS_E_BUSY);
	ck_assert_uint_gt(n, 100);
	ck_assert_uint_eq(a->n_held, n);
	/* freed with the session at shutdown (ASan/valgrind would see a leak) */
	close(fd);
	fx_stop(&f);
}
END_TEST

static Suite *regdefer_suite(void)
{
	Suite *s = suite_create("regdefer");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, pending_then_answered);
	tcase_add_test(tc, session_gone_while_pending);
	tcase_add_test(tc, alias_of_pending_import);
	tcase_add_test(tc, alias_of_failing_import);
	tcase_add_test(tc, replaces_only_when_answered);
	tcase_add_test(tc, held_requests_bounded);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(regdefer_suite)
