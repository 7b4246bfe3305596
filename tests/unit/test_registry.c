/* Unit tests for the registry (server/registry.c), in process: a real
 * kvs_server, memfds parked the way the broker parks them, and
 * kvs__op_register / kvs__op_unregister called directly. Covers imports and
 * aliases, the alloc_id identity check, geometry and range validation,
 * tokens (unknown, replayed), non-memfd fds, all-or-nothing re-registration,
 * unregister, and refs == live registrations referencing the import. */
#include "server_fixture.h"

#include "check_main.h"

#define ASZ 16384u /* allocation size used throughout */

static const kvs_group_desc G3 = {.id = 3, .kind = KVS_GROUP_ATTENTION, .tokens_per_block = 16,
				  .blocks_per_chunk = 2, .window_chunks = -1, .null_block = -1};

/* two layers of group 3 in allocation 0 */
static const kvs_layer_desc L2X[2] = {
	{.group = 3, .alloc = 0, .offset = 0, .num_blocks = 16, .block_stride = 256, .block_bytes = 256},
	{.group = 3, .alloc = 0, .offset = 4096, .num_blocks = 16, .block_stride = 256, .block_bytes = 256},
};

/* registers memfd (a dup of fd is parked) as alloc_id under token */
static int reg_simple(fx *f, kvs_session *s, int fd, uint32_t token, uint32_t alloc_id)
{
	fx_park(f, token, alloc_id, ASZ, dup(fd));
	kvs_alloc_desc a = fx_alloc(token, alloc_id, ASZ);
	return fx_register(f, s, &a, 1, &G3, 1, L2X, 2);
}

#define ERRMSG(f) (f)->srv->errbuf

START_TEST(test_register_ok_and_alias)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	kvs_session *b = fx_worker(&f, "b", 0, 1);

	ck_assert_int_eq(reg_simple(&f, a, fd, 1, 100), 0);
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	kvs_reg *ga = kvs_registry_of_session(R, a->id);
	ck_assert_ptr_nonnull(ga);
	ck_assert_uint_eq(ga->n_views, 2);
	ck_assert_uint_eq(ga->n_groups, 1);
	ck_assert_uint_eq(ga->groups[0].obj_bytes, 2 * 2 * 256);
	ck_assert_ptr_nonnull(kvs_registry_of_session(R, a->id));
	ck_assert_uint_eq(kvs_htab_count(f.srv->parked), 0);
	/* the memfd is sealed against shrinking now */
	ck_assert_int_ne(fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK, 0);

	/* the same memory and alloc_id from another session: an alias */
	ck_assert_int_eq(reg_simple(&f, b, fd, 2, 100), 0);
	ck_assert_uint_eq(kvs_registry_count(R), 2);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 1);
	kvs_reg *gb = kvs_registry_of_session(R, b->id);
	ck_assert_ptr_nonnull(gb);
	ck_assert_ptr_eq(gb->imports[0], ga->imports[0]);
	ck_assert_uint_eq(ga->imports[0]->refs, 2);
	/* both views address the same mapping */
	ck_assert_ptr_eq(gb->views[1].base, ga->views[1].base);

	/* a second alloc_id: a fresh import next to the alias */
	int fd2 = fx_memfd(ASZ);
	ck_assert_int_eq(reg_simple(&f, a, fd2, 3, 101), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 2); /* a's old registration replaced */
	ck_assert_uint_eq(kvs_registry_count(R), 2);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	ck_assert_ptr_nonnull(kvs_registry_of_session(R, a->id));
	close(fd);
	close(fd2);
	fx_stop(&f);
}
END_TEST

START_TEST(test_alias_within_one_registration)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	/* one entry per layer tensor of one allocation: the second aliases */
	fx_park(&f, 1, 100, ASZ, dup(fd));
	fx_park(&f, 2, 100, ASZ, dup(fd));
	kvs_alloc_desc al[2] = {fx_alloc(1, 100, ASZ), fx_alloc(2, 100, ASZ)};
	kvs_layer_desc ly[2] = {L2X[0], L2X[1]};
	ly[1].alloc = 1;
	ck_assert_int_eq(fx_register(&f, a, al, 2, &G3, 1, ly, 2), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 1);
	kvs_reg *g = kvs_registry_of_session(R, a->id);
	ck_assert_ptr_eq(g->imports[0], g->imports[1]);
	ck_assert_uint_eq(g->imports[0]->refs, 2);
	kvs_msg un = {.op = KVS_OP_UNREGISTER, .id = 9, .registration = g->id};
	ck_assert_int_eq(kvs__op_unregister(f.srv, a, &un), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 0);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	/* two entries of one allocation cannot hide overlapping views */
	fx_park(&f, 3, 100, ASZ, dup(fd));
	fx_park(&f, 4, 100, ASZ, dup(fd));
	kvs_alloc_desc al2[2] = {fx_alloc(3, 100, ASZ), fx_alloc(4, 100, ASZ)};
	kvs_layer_desc same[2] = {L2X[0], L2X[0]};
	same[1].alloc = 1;
	ck_assert_int_eq(fx_register(&f, a, al2, 2, &G3, 1, same, 2), KVS_E_GEOMETRY);
	ck_assert_uint_eq(kvs_registry_imports(R), 0);
	close(fd);
	fx_stop(&f);
}
END_TEST

START_TEST(test_same_alloc_id_other_memory)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ), other = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	kvs_session *b = fx_worker(&f, "b", 0, 1);
	ck_assert_int_eq(reg_simple(&f, a, fd, 1, 100), 0);
	int fds0 = fx_count_fds();
	ck_assert_int_eq(reg_simple(&f, b, other, 2, 100), KVS_E_AUTH);
	ck_assert_ptr_nonnull(strstr(ERRMSG(&f), "other memory"));
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	ck_assert_ptr_null(kvs_registry_of_session(R, b->id));
	ck_assert_ptr_null(kvs_registry_of_session(R, b->id));
	/* the claimed fd was closed, the token consumed */
	ck_assert_int_eq(fx_settled_fds(&f), fds0);
	ck_assert_uint_eq(kvs_htab_count(f.srv->parked), 0);
	/* same memory, other declared size: refused too */
	fx_park(&f, 3, 100, ASZ / 2, dup(fd));
	kvs_alloc_desc al = fx_alloc(3, 100, ASZ / 2);
	kvs_layer_desc ly = L2X[0];
	ck_assert_int_eq(fx_register(&f, b, &al, 1, &G3, 1, &ly, 1), KVS_E_GEOMETRY);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	close(fd);
	close(other);
	fx_stop(&f);
}
END_TEST

/* one bad-geometry case: validation happens before any token is claimed */
static void expect_bad(fx *f, kvs_session *s, const kvs_group_desc *g, uint32_t ng, const kvs_layer_desc *l,
		       uint32_t nl, int code, const char *needle)
{
	kvs_alloc_desc a = fx_alloc(1, 100, ASZ);
	size_t parked = kvs_htab_count(f->srv->parked);
	int r = fx_register(f, s, &a, 1, g, ng, l, nl);
	ck_assert_msg(r == code, "expected %s, got %s (%s)", kvs_error_name(code), kvs_error_name(r),
		      f->srv->errbuf);
	ck_assert_msg(strstr(f->srv->errbuf, needle), "errbuf '%s' lacks '%s'", f->srv->errbuf, needle);
	ck_assert_uint_eq(kvs_htab_count(f->srv->parked), parked);
	ck_assert_uint_eq(kvs_registry_count(f->srv->reg), 0);
	ck_assert_uint_eq(kvs_registry_imports(f->srv->reg), 0);
}

/* like expect_bad, with the allocations given */
static void expect_bad2(fx *f, kvs_session *s, const kvs_alloc_desc *a, uint32_t na, const kvs_layer_desc *l,
			int code, const char *needle)
{
	int r = fx_register(f, s, a, na, &G3, 1, l, 1);
	ck_assert_msg(r == code, "expected %s, got %s (%s)", kvs_error_name(code), kvs_error_name(r),
		      f->srv->errbuf);
	ck_assert_msg(strstr(f->srv->errbuf, needle), "errbuf '%s' lacks '%s'", f->srv->errbuf, needle);
	ck_assert_uint_eq(kvs_registry_count(f->srv->reg), 0);
	ck_assert_uint_eq(kvs_registry_imports(f->srv->reg), 0);
}

START_TEST(test_bad_geometry)
{
	fx f;
	fx_start(&f, 0, 0);
	int fd = fx_memfd(ASZ);
	kvs_session *s = fx_worker(&f, "a", 0, 1);
	fx_park(&f, 1, 100, ASZ, dup(fd)); /* stays parked through every refusal */
	kvs_layer_desc l[2];

	/* block_bytes > stride */
	memcpy(l, L2X, sizeof(l));
	l[0].block_bytes = 257;
	expect_bad(&f, s, &G3, 1, l, 1, KVS_E_GEOMETRY, "exceeds block_stride");
	/* view past the allocation */
	memcpy(l, L2X, sizeof(l));
	l[0].offset = ASZ - 16 * 256 + 1;
	expect_bad(&f, s, &G3, 1, l, 1, KVS_E_RANGE, "beyond allocation");
	/* exactly up to the end is fine: checked below with the good case */
	/* offset overflow */
	memcpy(l, L2X, sizeof(l));
	l[0].offset = UINT64_MAX - 100;
	expect_bad(&f, s, &G3, 1, l, 1, KVS_E_RANGE, "overflows");
	/* num_blocks * stride overflow */
	memcpy(l, L2X, sizeof(l));
	l[0].num_blocks = 1ull << 40;
	l[0].block_stride = 1ull << 30;
	l[0].block_bytes = 256;
	l[1].num_blocks = 1ull << 40;
	expect_bad(&f, s, &G3, 1, l, 1, KVS_E_RANGE, "overflows");
	/* overlapping views, equal stride */
	memcpy(l, L2X, sizeof(l));
	l[1].offset = 16 * 256 - 256; /* last block of layer 0 */
	expect_bad(&f, s, &G3, 1, l, 2, KVS_E_GEOMETRY, "overlaps");
	/* interleaved, equal stride, intersecting bytes */
	l[0] = (kvs_layer_desc){.group = 3, .alloc = 0, .offset = 0, .num_blocks = 16, .block_stride = 512, .block_bytes = 256};
	l[1] = (kvs_layer_desc){.group = 3, .alloc = 0, .offset = 128, .num_blocks = 16, .block_stride = 512, .block_bytes = 256};
	expect_bad(&f, s, &G3, 1, l, 2, KVS_E_GEOMETRY, "overlaps");
	/* b wraps around into a's bytes */
	l[1].offset = 384;
	expect_bad(&f, s, &G3, 1, l, 2, KVS_E_GEOMETRY, "overlaps");
	/* overlapping ranges with different strides: conservatively refused */
	l[1] = (kvs_layer_desc){.group = 3, .alloc = 0, .offset = 256, .num_blocks = 16, .block_stride = 256, .block_bytes = 128};
	expect_bad(&f, s, &G3, 1, l, 2, KVS_E_GEOMETRY, "overlaps");
	/* unknown group */
	memcpy(l, L2X, sizeof(l));
	l[1].group = 4;
	expect_bad(&f, s, &G3, 1, l, 2, KVS_E_GEOMETRY, "unknown group 4");
	/* duplicate group id */
	kvs_group_desc gg[2] = {G3, G3};
	expect_bad(&f, s, gg, 2, L2X, 2, KVS_E_GEOMETRY, "duplicate group id 3");
	/* window 0 */
	kvs_group_desc w0 = G3;
	w0.window_chunks = 0;
	expect_bad(&f, s, &w0, 1, L2X, 2, KVS_E_GEOMETRY, "window_chunks");
	/* a group without a layer */
	gg[1].id = 5;
	expect_bad(&f, s, gg, 2, L2X, 2, KVS_E_GEOMETRY, "no layer");
	/* layers of one group with different num_blocks */
	memcpy(l, L2X, sizeof(l));
	l[1].num_blocks = 8;
	expect_bad(&f, s, &G3, 1, l, 2, KVS_E_GEOMETRY, "num_blocks differs");
	/* allocation index out of range */
	memcpy(l, L2X, sizeof(l));
	l[1].alloc = 1;
	expect_bad(&f, s, &G3, 1, l, 2, KVS_E_RANGE, "allocation index");
	/* nothing at all */
	expect_bad(&f, s, &G3, 1, l, 0, KVS_E_GEOMETRY, "at least one");

	/* interleaved, non-overlapping views with equal stride: accepted, and
	 * the view reaching exactly the end of the allocation too */
	l[0] = (kvs_layer_desc){.group = 3, .alloc = 0, .offset = 0, .num_blocks = 16, .block_stride = 512, .block_bytes = 256};
	l[1] = (kvs_layer_desc){.group = 3, .alloc = 0, .offset = 256, .num_blocks = 16, .block_stride = 512, .block_bytes = 256};
	kvs_alloc_desc a = fx_alloc(1, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, s, &a, 1, &G3, 1, l, 2), 0);
	ck_assert_uint_eq(kvs_registry_count(f.srv->reg), 1);
	kvs_reg *g = kvs_registry_of_session(f.srv->reg, s->id);
	ck_assert_ptr_eq(g->views[1].base, g->views[0].base + 256);
	close(fd);
	fx_stop(&f);
}
END_TEST

/* A view whose stride is padded past its blocks ends at its last block's
 * bytes, offset + (n - 1) * stride + block_bytes, not at n * stride: vLLM's
 * Mamba SSM view starts inside each page (after the conv state) with the
 * page as its stride, and in an exactly-sized memfd its last block ends at
 * the allocation's end (issue 31). One byte further is refused. */
START_TEST(test_padded_stride_view_to_the_end)
{
	fx f;
	fx_start(&f, 0, 0);
	int fd = fx_memfd(ASZ);
	kvs_session *s = fx_worker(&f, "a", 0, 1);
	fx_park(&f, 1, 100, ASZ, dup(fd));
	kvs_layer_desc l = {.group = 3, .alloc = 0, .offset = ASZ - 15 * 512 - 256, .num_blocks = 16,
			    .block_stride = 512, .block_bytes = 256};
	l.offset++;
	expect_bad(&f, s, &G3, 1, &l, 1, KVS_E_RANGE, "beyond allocation");
	l.offset--;
	kvs_alloc_desc a = fx_alloc(1, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, s, &a, 1, &G3, 1, &l, 1), 0);
	ck_assert_uint_eq(kvs_registry_count(f.srv->reg), 1);
	close(fd);
	fx_stop(&f);
}
END_TEST

/* Views of different groups may share bytes (vLLM's hybrid allocator lays
 * attention pages and recurrent state pages over one block pool); views of
 * one group still may not. */
START_TEST(test_groups_share_memory)
{
	fx f;
	fx_start(&f, 0, 0);
	int fd = fx_memfd(ASZ);
	kvs_session *s = fx_worker(&f, "a", 0, 1);
	kvs_group_desc gg[2] = {G3, {.id = 4, .kind = KVS_GROUP_RECURRENT, .tokens_per_block = 32,
				     .blocks_per_chunk = 1, .window_chunks = -1, .null_block = 0}};
	/* page of 512 B: K [0,256) V [256,512) of group 3; state [0,384) of group 4 */
	kvs_layer_desc l[3] = {
		{.group = 3, .alloc = 0, .offset = 0, .num_blocks = 16, .block_stride = 512, .block_bytes = 256},
		{.group = 3, .alloc = 0, .offset = 256, .num_blocks = 16, .block_stride = 512, .block_bytes = 256},
		{.group = 4, .alloc = 0, .offset = 0, .num_blocks = 16, .block_stride = 512, .block_bytes = 384},
	};
	fx_park(&f, 1, 100, ASZ, dup(fd));
	kvs_alloc_desc a = fx_alloc(1, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, s, &a, 1, gg, 2, l, 3), 0);
	ck_assert_uint_eq(kvs_registry_count(f.srv->reg), 1);
	kvs_msg un = {.op = KVS_OP_UNREGISTER, .id = 9, .registration = kvs_registry_of_session(f.srv->reg, s->id)->id};
	ck_assert_int_eq(kvs__op_unregister(f.srv, s, &un), 0);
	/* the same state view in group 3 overlaps K and V: refused */
	l[2].group = 3;
	l[2].block_bytes = 256;
	l[2].offset = 128;
	expect_bad(&f, s, gg, 2, l, 3, KVS_E_GEOMETRY, "overlaps");
	close(fd);
	fx_stop(&f);
}
END_TEST

/* A range of several allocations (entries that follow the previous one) is
 * mapped back to back: a view may cross from one memfd into the next. */
START_TEST(test_ranges)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_session *s = fx_worker(&f, "a", 0, 1);
	int fd0 = fx_memfd(ASZ), fd1 = fx_memfd(ASZ);
	ck_assert_int_eq(pwrite(fd0, "AAAA", 4, ASZ - 4), 4);
	ck_assert_int_eq(pwrite(fd1, "BBBB", 4, 0), 4);
	/* one layer of 16 blocks of 1 KiB starting 8 KiB into piece 0: blocks
	 * 8..15 lie in piece 1 */
	kvs_layer_desc l = {.group = 3, .alloc = 0, .offset = ASZ / 2, .num_blocks = 16, .block_stride = 1024,
			    .block_bytes = 1024};
	fx_park(&f, 1, 100, ASZ, dup(fd0));
	fx_park(&f, 2, 101, ASZ, dup(fd1));
	kvs_alloc_desc a[2] = {fx_alloc(1, 100, ASZ), fx_alloc(2, 101, ASZ)};
	a[1].follows = true;
	ck_assert_msg(fx_register(&f, s, a, 2, &G3, 1, &l, 1) == 0, "%s", ERRMSG(&f));
	kvs_reg *g = kvs_registry_of_session(f.srv->reg, s->id);
	ck_assert_uint_eq(g->n_spans, 1);
	ck_assert_uint_eq(kvs_registry_imports(f.srv->reg), 2);
	const uint8_t *v = g->views[0].base;
	ck_assert_mem_eq(v + ASZ / 2 - 4, "AAAA", 4); /* end of piece 0 */
	ck_assert_mem_eq(v + ASZ / 2, "BBBB", 4);     /* start of piece 1, right after */
	/* the server's mappings: each piece's import and the range's pieces */
	ck_assert_int_eq(memfd_maps("kvs-ut"), 4);
	kvs_msg un = {.op = KVS_OP_UNREGISTER, .id = 9, .registration = g->id};
	gate gt; /* unmapped on the reclaim thread, not on the loop */
	gate_hold(&gt, f.srv->reclaimq);
	ck_assert_int_eq(kvs__op_unregister(f.srv, s, &un), 0);
	ck_assert_uint_eq(kvs_registry_imports(f.srv->reg), 0);
	ck_assert_int_eq(memfd_maps("kvs-ut"), 4);
	gate_open(&gt);
	kvs_workq_drain(f.srv->reclaimq);
	ck_assert_int_eq(memfd_maps("kvs-ut"), 0);

	/* refused, nothing kept: a first entry that follows; a layer naming an
	 * entry inside a range; a view past the range's end; a piece of a host
	 * range that is not a whole number of pages */
	kvs_alloc_desc b[2] = {fx_alloc(1, 100, ASZ), fx_alloc(2, 101, ASZ)};
	b[0].follows = true;
	expect_bad2(&f, s, b, 2, &l, KVS_E_GEOMETRY, "follows no allocation");
	b[0].follows = false;
	b[1].follows = true;
	kvs_layer_desc l1 = l;
	l1.alloc = 1;
	expect_bad2(&f, s, b, 2, &l1, KVS_E_GEOMETRY, "continues a range");
	kvs_layer_desc past = l;
	past.offset = ASZ + 1024;
	expect_bad2(&f, s, b, 2, &past, KVS_E_RANGE, "beyond allocation 0");
	b[0].size = ASZ - 100;
	expect_bad2(&f, s, b, 2, &l, KVS_E_RANGE, "not a multiple of the page size");
	close(fd0);
	close(fd1);
	fx_stop(&f);
}
END_TEST

START_TEST(test_tokens)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	kvs_session *b = fx_worker(&f, "b", 0, 1);
	kvs_alloc_desc al = fx_alloc(77, 100, ASZ);
	/* never parked */
	ck_assert_int_eq(fx_register(&f, a, &al, 1, &G3, 1, L2X, 2), KVS_E_AUTH);
	ck_assert_ptr_nonnull(strstr(ERRMSG(&f), "token unknown"));
	ck_assert_uint_eq(kvs_registry_count(R), 0);
	/* a good one, then its replay from another session */
	ck_assert_int_eq(reg_simple(&f, a, fd, 1, 100), 0);
	kvs_alloc_desc replay = fx_alloc(1, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, b, &replay, 1, &G3, 1, L2X, 2), KVS_E_AUTH);
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	ck_assert_ptr_nonnull(f.srv->consumed);
	uint8_t tok[16];
	fx_id(tok, 1);
	ck_assert_ptr_nonnull(kvs_htab_get(f.srv->consumed, tok));
	/* alloc_id or size differing from the broker record: refused, consumed */
	int fds0 = fx_count_fds();
	fx_park(&f, 2, 100, ASZ, dup(fd));
	kvs_alloc_desc wrong_id = fx_alloc(2, 101, ASZ);
	ck_assert_int_eq(fx_register(&f, b, &wrong_id, 1, &G3, 1, L2X, 2), KVS_E_AUTH);
	ck_assert_ptr_nonnull(strstr(ERRMSG(&f), "differ"));
	fx_park(&f, 3, 100, ASZ, dup(fd));
	kvs_alloc_desc wrong_size = fx_alloc(3, 100, ASZ * 2);
	ck_assert_int_eq(fx_register(&f, b, &wrong_size, 1, &G3, 1, L2X, 2), KVS_E_AUTH);
	ck_assert_uint_eq(kvs_htab_count(f.srv->parked), 0);
	ck_assert_int_eq(fx_settled_fds(&f), fds0);
	/* two allocations, the second token unknown: the first claim is undone
	 * (its fd closed), nothing imported */
	fx_park(&f, 4, 200, ASZ, fx_memfd(ASZ));
	kvs_alloc_desc two[2] = {fx_alloc(4, 200, ASZ), fx_alloc(99, 201, ASZ)};
	ck_assert_int_eq(fx_register(&f, b, two, 2, &G3, 1, L2X, 2), KVS_E_AUTH);
	ck_assert_ptr_nonnull(strstr(ERRMSG(&f), "allocations[1]"));
	ck_assert_int_eq(fx_settled_fds(&f), fds0);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	/* a scheduler session cannot register */
	kvs_session *sch = fx_session(&f, "sch", "eng", "ns", KVS_ROLE_SCHEDULER, 0, 1);
	fx_park(&f, 5, 300, ASZ, dup(fd));
	kvs_alloc_desc al5 = fx_alloc(5, 300, ASZ);
	ck_assert_int_eq(fx_register(&f, sch, &al5, 1, &G3, 1, L2X, 2), KVS_E_SESSION);
	close(fd);
	fx_stop(&f);
}
END_TEST

START_TEST(test_not_memfd)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	int fds0 = fx_count_fds();
	/* a pipe */
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	fx_park(&f, 1, 100, ASZ, p[0]);
	kvs_alloc_desc al = fx_alloc(1, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, a, &al, 1, &G3, 1, L2X, 2), KVS_E_DEVICE);
	ck_assert_ptr_nonnull(strstr(ERRMSG(&f), "memfd"));
	close(p[1]);
	/* an unnamed regular file */
	int tf = open(f.dir, O_TMPFILE | O_RDWR, 0600);
	ck_assert_int_ge(tf, 0);
	ck_assert_int_eq(ftruncate(tf, ASZ), 0);
	fx_park(&f, 2, 100, ASZ, tf);
	al = fx_alloc(2, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, a, &al, 1, &G3, 1, L2X, 2), KVS_E_DEVICE);
	/* a memfd that cannot be sealed */
	int ns = memfd_create("nosea", MFD_CLOEXEC);
	ck_assert_int_ge(ns, 0);
	ck_assert_int_eq(ftruncate(ns, ASZ), 0);
	fx_park(&f, 3, 100, ASZ, ns);
	al = fx_alloc(3, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, a, &al, 1, &G3, 1, L2X, 2), KVS_E_DEVICE);
	ck_assert_ptr_nonnull(strstr(ERRMSG(&f), "sealed"));
	/* a memfd smaller than declared */
	fx_park(&f, 4, 100, ASZ, fx_memfd(ASZ / 2));
	al = fx_alloc(4, 100, ASZ);
	ck_assert_int_eq(fx_register(&f, a, &al, 1, &G3, 1, L2X, 2), KVS_E_RANGE);
	/* first allocation good, second a pipe: the fresh import is undone */
	ck_assert_int_eq(pipe(p), 0);
	fx_park(&f, 5, 200, ASZ, fx_memfd(ASZ));
	fx_park(&f, 6, 201, ASZ, p[0]);
	kvs_alloc_desc two[2] = {fx_alloc(5, 200, ASZ), fx_alloc(6, 201, ASZ)};
	kvs_layer_desc ly[2] = {L2X[0], L2X[1]};
	ly[1].alloc = 1;
	ck_assert_int_eq(fx_register(&f, a, two, 2, &G3, 1, ly, 2), KVS_E_DEVICE);
	ck_assert_ptr_nonnull(strstr(ERRMSG(&f), "allocations[1]"));
	close(p[1]);
	ck_assert_uint_eq(kvs_registry_count(R), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 0);
	ck_assert_uint_eq(kvs_htab_count(f.srv->parked), 0);
	ck_assert_int_eq(fx_settled_fds(&f), fds0); /* every claimed fd closed */
	fx_stop(&f);
}
END_TEST

START_TEST(test_failed_reregistration_keeps_old)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	ck_assert_int_eq(reg_simple(&f, a, fd, 1, 100), 0);
	kvs_reg *g = kvs_registry_of_session(R, a->id);
	uint64_t gid = g->id;
	/* geometry failure */
	kvs_group_desc w0 = G3;
	w0.window_chunks = 0;
	kvs_alloc_desc al = fx_alloc(2, 100, ASZ);
	fx_park(&f, 2, 100, ASZ, dup(fd));
	ck_assert_int_eq(fx_register(&f, a, &al, 1, &w0, 1, L2X, 2), KVS_E_GEOMETRY);
	ck_assert_ptr_eq(kvs_registry_of_session(R, a->id), g);
	/* import failure (a pipe as a second allocation) */
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	fx_park(&f, 3, 101, ASZ, p[0]);
	kvs_alloc_desc two[2] = {fx_alloc(2, 100, ASZ), fx_alloc(3, 101, ASZ)};
	kvs_layer_desc ly[2] = {L2X[0], L2X[1]};
	ly[1].alloc = 1;
	ck_assert_int_eq(fx_register(&f, a, two, 2, &G3, 1, ly, 2), KVS_E_DEVICE);
	close(p[1]);
	g = kvs_registry_of_session(R, a->id);
	ck_assert_ptr_nonnull(g);
	ck_assert_uint_eq(g->id, gid);
	ck_assert(!g->dead);
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0); /* the alias taken for [0] was dropped */
	ck_assert_uint_eq(g->imports[0]->refs, 1);
	ck_assert_ptr_nonnull(kvs_registry_of_session(R, a->id));
	/* and it still works: a store through it commits */
	kvs_msg st = {.op = KVS_OP_STORE, .id = 5, .job = 1};
	uint8_t key[32] = {1};
	int64_t ids[2] = {0, 1};
	st.keys = key;
	st.n_keys = 1;
	st.blocks.n = 1;
	st.blocks.ids[0] = ids;
	st.blocks.len[0] = 2;
	ck_assert_int_eq(kvs__op_store(f.srv, a, &st), 0);
	kvs_msg cp = {.op = KVS_OP_COMPLETE, .id = 6, .job = 1, .status = KVS_STATUS_OK};
	ck_assert_int_eq(kvs__op_complete(f.srv, a, &cp), 0);
	FX_PUMP_UNTIL(&f, kvs_jobs_open(f.srv->jobs) == 0);
	kvs_jobs_stats js;
	kvs_jobs_get_stats(f.srv->jobs, &js);
	ck_assert_uint_eq(js.committed, 1);
	close(fd);
	fx_stop(&f);
}
END_TEST

START_TEST(test_unregister)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	kvs_session *b = fx_worker(&f, "b", 0, 1);
	int fds0 = fx_count_fds();
	int fd = fx_memfd(ASZ);
	uint8_t *m = fx_map(fd, ASZ);
	ck_assert_int_eq(reg_simple(&f, a, fd, 1, 100), 0);
	kvs_reg *g = kvs_registry_of_session(R, a->id);
	kvs_msg un = {.op = KVS_OP_UNREGISTER, .id = 9, .registration = g->id};
	/* not b's */
	ck_assert_int_eq(kvs__op_unregister(f.srv, b, &un), KVS_E_NOREG);
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	int maps0 = memfd_maps("kvs-ut"); /* ours and the server's */
	ck_assert_int_ge(maps0, 2);
	/* no leases: released at once, but unmapped and closed on the reclaim
	 * thread, not on the loop (held here to see it) */
	gate gt;
	gate_hold(&gt, f.srv->reclaimq);
	ck_assert_int_eq(kvs__op_unregister(f.srv, a, &un), 0);
	ck_assert_uint_eq(kvs_registry_count(R), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 0);
	ck_assert_ptr_null(kvs_registry_of_session(R, a->id));
	ck_assert_ptr_null(kvs_registry_of_session(R, a->id));
	ck_assert_int_eq(memfd_maps("kvs-ut"), maps0);
	ck_assert_int_eq(fx_count_fds(), fds0 + 2);
	gate_open(&gt);
	/* the server's fd and mappings are gone: only ours remain */
	ck_assert_int_eq(fx_settled_fds(&f), fds0 + 1);
	ck_assert_int_eq(memfd_maps("kvs-ut"), 1);
	/* twice: no such registration any more */
	ck_assert_int_eq(kvs__op_unregister(f.srv, a, &un), KVS_E_NOREG);
	/* the memory is ours alone again: writable, and may be registered anew */
	m[0] = 1;
	ck_assert_int_eq(reg_simple(&f, a, fd, 2, 100), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	munmap(m, ASZ);
	close(fd);
	fx_stop(&f);
}
END_TEST

/* imports hold one ref per live registration that references them:
 * aliases == sum over imports of (refs - 1), checked as registrations come
 * (new, replacing) and go (unregister, session close) */
static void check_refs(fx *f)
{
	kvs_registry *R = f->srv->reg;
	kvs_import *imps[64];
	uint32_t cnt[64], ni = 0;
	uint64_t regs = 0;
	size_t pos = 0;
	kvs_session *s;
	while ((s = kvs_htab_next(f->srv->sessions, &pos)) != NULL) {
		kvs_reg *g = kvs_registry_of_session(R, s->id);
		if (!g)
			continue;
		regs++;
		for (uint32_t i = 0; i < g->n_imports; i++) {
			uint32_t k = 0;
			while (k < ni && imps[k] != g->imports[i])
				k++;
			if (k == ni) {
				ck_assert_uint_lt(ni, 64);
				imps[ni] = g->imports[i];
				cnt[ni++] = 0;
			}
			cnt[k]++;
		}
	}
	uint64_t aliases = 0;
	for (uint32_t k = 0; k < ni; k++) {
		ck_assert_uint_eq(imps[k]->refs, cnt[k]);
		aliases += cnt[k] - 1;
	}
	ck_assert_uint_eq(kvs_registry_count(R), regs);
	ck_assert_uint_eq(kvs_registry_imports(R), ni);
	ck_assert_uint_eq(kvs_registry_aliases(R), aliases);
}

START_TEST(test_refs_invariant)
{
	fx f;
	fx_start(&f, 0, 0);
	kvs_registry *R = f.srv->reg;
	int fds0 = fx_count_fds();
	int fd = fx_memfd(ASZ);
	kvs_session *a = fx_worker(&f, "a", 0, 1);
	kvs_session *b = fx_worker(&f, "b", 0, 1);
	kvs_session *c = fx_worker(&f, "c", 0, 1);
	ck_assert_int_eq(reg_simple(&f, a, fd, 1, 100), 0);
	kvs_import *imp = kvs_registry_of_session(R, a->id)->imports[0];
	ck_assert_uint_eq(imp->refs, 1);
	ck_assert_int_eq(reg_simple(&f, b, fd, 2, 100), 0);
	ck_assert_int_eq(reg_simple(&f, c, fd, 3, 100), 0);
	ck_assert_uint_eq(imp->refs, 3);
	ck_assert_uint_eq(kvs_registry_aliases(R), 2);
	ck_assert_uint_eq(kvs_registry_imports(R), 1);
	check_refs(&f);
	/* b registers again: the new registration refs, the replaced one unrefs */
	ck_assert_int_eq(reg_simple(&f, b, fd, 4, 100), 0);
	ck_assert_uint_eq(imp->refs, 3);
	ck_assert_uint_eq(kvs_registry_aliases(R), 2);
	ck_assert_uint_eq(kvs_registry_count(R), 3);
	check_refs(&f);
	/* a failed registration leaves refs alone */
	fx_park(&f, 5, 100, ASZ, dup(fd));
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	fx_park(&f, 6, 101, ASZ, p[0]);
	kvs_alloc_desc two[2] = {fx_alloc(5, 100, ASZ), fx_alloc(6, 101, ASZ)};
	kvs_layer_desc ly[2] = {L2X[0], L2X[1]};
	ly[1].alloc = 1;
	ck_assert_int_eq(fx_register(&f, c, two, 2, &G3, 1, ly, 2), KVS_E_DEVICE);
	close(p[1]);
	ck_assert_uint_eq(imp->refs, 3);
	ck_assert_uint_eq(kvs_registry_aliases(R), 2);
	/* unregister a */
	kvs_msg un = {.op = KVS_OP_UNREGISTER, .id = 9, .registration = kvs_registry_of_session(R, a->id)->id};
	ck_assert_int_eq(kvs__op_unregister(f.srv, a, &un), 0);
	ck_assert_uint_eq(imp->refs, 2);
	ck_assert_uint_eq(kvs_registry_aliases(R), 1);
	ck_assert_uint_eq(kvs_registry_count(R), 2);
	check_refs(&f);
	/* c's session ends */
	kvs__session_close(f.srv, c, "test");
	ck_assert_uint_eq(imp->refs, 1);
	ck_assert_uint_eq(kvs_registry_aliases(R), 0);
	ck_assert_uint_eq(kvs_registry_count(R), 1);
	check_refs(&f);
	/* the last one: import released, mapping and fd gone */
	un.registration = kvs_registry_of_session(R, b->id)->id;
	ck_assert_int_eq(kvs__op_unregister(f.srv, b, &un), 0);
	ck_assert_uint_eq(kvs_registry_imports(R), 0);
	ck_assert_uint_eq(kvs_registry_count(R), 0);
	ck_assert_int_eq(fx_settled_fds(&f), fds0 + 1);
	check_refs(&f);
	close(fd);
	fx_stop(&f);
}
END_TEST

static Suite *registry_suite(void)
{
	Suite *s = suite_create("registry");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_register_ok_and_alias);
	tcase_add_test(tc, test_alias_within_one_registration);
	tcase_add_test(tc, test_same_alloc_id_other_memory);
	tcase_add_test(tc, test_bad_geometry);
	tcase_add_test(tc, test_padded_stride_view_to_the_end);
	tcase_add_test(tc, test_groups_share_memory);
	tcase_add_test(tc, test_ranges);
	tcase_add_test(tc, test_tokens);
	tcase_add_test(tc, test_not_memfd);
	tcase_add_test(tc, test_failed_reregistration_keeps_old);
	tcase_add_test(tc, test_unregister);
	tcase_add_test(tc, test_refs_invariant);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(registry_suite)
