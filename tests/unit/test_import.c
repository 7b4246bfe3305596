/* Unit tests for imports (server/import.c), with no server: the host memfd
 * path end to end (sealing, mapping, aliases by alloc_id, release), and the
 * refusals: a memfd that cannot be sealed (unless allow_unsealed), one
 * smaller than declared, another memfd or another size under an alloc_id
 * already imported, fds that are no memfd (pipe, regular file, none), and
 * CUDA kinds with no CUDA engine. The request's fd is consumed in every case:
 * each case counts the process's open fds before and after and checks the
 * very fd is closed (or, for a fresh import, held by the import until its
 * last release). Mappings are counted in /proc/self/maps. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check_main.h"
#include "import.h"
#include "kvs_cq.h"
#include "kvs_workq.h"
#include "memfd_maps.h"
#include "workq_gate.h"
#include "kvs_error.h"
#include "kvs_types.h"

#define SZ 65536u

static int count_fds(void)
{
	int n = 0;
	DIR *d = opendir("/proc/self/fd");
	ck_assert_ptr_nonnull(d);
	while (readdir(d))
		n++;
	closedir(d);
	return n;
}

static bool fd_open(int fd) { return fcntl(fd, F_GETFD) != -1; }

static void assert_closed(int fd)
{
	errno = 0;
	ck_assert_int_eq(fcntl(fd, F_GETFD), -1);
	ck_assert_int_eq(errno, EBADF);
}

static int mkmemfd(const char *name, uint64_t size, unsigned flags)
{
	int fd = memfd_create(name, MFD_CLOEXEC | flags);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	return fd;
}

typedef struct ids {
	uint8_t uuid[16], alloc[16];
} ids;

static kvs_import_req mkreq(ids *d, uint8_t dev, uint8_t uuid, uint8_t alloc, uint64_t size, int fd)
{
	memset(d->uuid, uuid, 16);
	memset(d->alloc, alloc, 16);
	d->alloc[15] = 0x99;
	return (kvs_import_req){.dev_type = dev, .uuid = d->uuid, .alloc_id = d->alloc, .size = size, .fd = fd};
}

typedef struct fx {
	kvs_imports *t;
	char err[256];
} fx;

static void fx_init(fx *f)
{
	memset(f, 0, sizeof(*f));
	ck_assert_int_eq(kvs_imports_create(&f->t), 0);
}

static void fx_done(fx *f)
{
	ck_assert_uint_eq(kvs_imports_count(f->t), 0);
	ck_assert_uint_eq(kvs_imports_aliases(f->t), 0);
	kvs_imports_destroy(f->t);
}

/* A request that must be refused with code and a reason holding needle;
 * its fd (if any) must be closed and the table unchanged. */
static void refused(fx *f, const kvs_import_req *rq, int code, const char *needle)
{
	uint64_t n = kvs_imports_count(f->t), a = kvs_imports_aliases(f->t);
	int fds = count_fds();
	kvs_import *imp = (kvs_import *)(uintptr_t)0x1;
	bool fresh = true;
	f->err[0] = '\0';
	int r = kvs_import_acquire(f->t, rq, &imp, &fresh, f->err, sizeof(f->err));
	ck_assert_msg(r == code, "got %s, want %s (%s)", kvs_error_name(r), kvs_error_name(code), f->err);
	ck_assert_msg(strstr(f->err, needle), "err '%s' lacks '%s'", f->err, needle);
	if (rq->fd >= 0) {
		assert_closed(rq->fd);
		ck_assert_int_eq(count_fds(), fds - 1);
	} else {
		ck_assert_int_eq(count_fds(), fds);
	}
	ck_assert_uint_eq(kvs_imports_count(f->t), n);
	ck_assert_uint_eq(kvs_imports_aliases(f->t), a);
}

static kvs_import *acquire(fx *f, const kvs_import_req *rq, bool want_fresh)
{
	kvs_import *imp = NULL;
	bool fresh = !want_fresh;
	f->err[0] = '\0';
	int r = kvs_import_acquire(f->t, rq, &imp, &fresh, f->err, sizeof(f->err));
	ck_assert_msg(r == 0, "got %s (%s)", kvs_error_name(r), f->err);
	ck_assert_ptr_nonnull(imp);
	ck_assert(fresh == want_fresh);
	return imp;
}

START_TEST(host_import_and_aliases)
{
	fx f;
	fx_init(&f);
	int mfd = mkmemfd("kvt-imp-a", SZ, MFD_ALLOW_SEALING);
	uint8_t pat[SZ];
	for (uint32_t i = 0; i < SZ; i++)
		pat[i] = (uint8_t)(i * 7u + (i >> 9));
	ck_assert_int_eq(pwrite(mfd, pat, SZ, 0), (ssize_t)SZ);
	int fds0 = count_fds();
	ids d;

	/* fresh: the import keeps the fd, maps the memory, seals the memfd */
	int fd1 = dup(mfd);
	kvs_import_req rq = mkreq(&d, KVS_DEV_HOST, 0x11, 0x22, SZ, fd1);
	kvs_import *imp = acquire(&f, &rq, true);
	ck_assert_int_eq(imp->fd, fd1);
	ck_assert(fd_open(fd1));
	ck_assert_int_eq(count_fds(), fds0 + 1);
	ck_assert_uint_eq(imp->size, SZ);
	ck_assert_uint_eq(imp->refs, 1);
	ck_assert(!imp->unsealed);
	ck_assert_uint_eq(imp->key[0], KVS_DEV_HOST);
	ck_assert_mem_eq(imp->key + 1, d.uuid, 16);
	ck_assert_mem_eq(imp->key + 17, d.alloc, 16);
	ck_assert_int_ne(fcntl(mfd, F_GET_SEALS) & F_SEAL_SHRINK, 0);
	ck_assert_int_lt(ftruncate(mfd, SZ / 2), 0); /* the engine cannot shrink it any more */
	ck_assert_int_eq(memfd_maps("kvt-imp-a"), 1);
	ck_assert_uint_eq(kvs_imports_count(f.t), 1);
	ck_assert_uint_eq(kvs_imports_aliases(f.t), 0);
	/* the mapping is the engine's memory, both ways */
	ck_assert_mem_eq(imp->base, pat, SZ);
	imp->base[SZ - 1] ^= 0xff;
	uint8_t last;
	ck_assert_int_eq(pread(mfd, &last, 1, SZ - 1), 1);
	ck_assert_uint_eq(last, (uint8_t)(pat[SZ - 1] ^ 0xff));

	/* an alias through another fd of the same open file */
	int fd2 = dup(mfd);
	rq.fd = fd2;
	ck_assert_ptr_eq(acquire(&f, &rq, false), imp);
	assert_closed(fd2);
	ck_assert_uint_eq(imp->refs, 2);
	ck_assert_uint_eq(kvs_imports_aliases(f.t), 1);
	/* and through another open of the same memfd (another file description) */
	char path[64];
	snprintf(path, sizeof(path), "/proc/self/fd/%d", mfd);
	int fd3 = open(path, O_RDWR | O_CLOEXEC);
	ck_assert_int_ge(fd3, 0);
	rq.fd = fd3;
	ck_assert_ptr_eq(acquire(&f, &rq, false), imp);
	assert_closed(fd3);
	ck_assert_uint_eq(imp->refs, 3);
	ck_assert_uint_eq(kvs_imports_count(f.t), 1);
	ck_assert_uint_eq(kvs_imports_aliases(f.t), 2);
	ck_assert_int_eq(count_fds(), fds0 + 1);
	ck_assert_int_eq(memfd_maps("kvt-imp-a"), 1); /* one mapping for all */

	/* releases: the last one unmaps and closes */
	kvs_import_release(f.t, imp);
	kvs_import_release(f.t, imp);
	ck_assert_uint_eq(imp->refs, 1);
	ck_assert_uint_eq(kvs_imports_aliases(f.t), 0);
	ck_assert_uint_eq(kvs_imports_count(f.t), 1);
	ck_assert_int_eq(memfd_maps("kvt-imp-a"), 1);
	ck_assert(fd_open(fd1));
	ck_assert_mem_eq(imp->base, pat, SZ - 1);
	kvs_import_release(f.t, imp);
	ck_assert_uint_eq(kvs_imports_count(f.t), 0);
	ck_assert_int_eq(memfd_maps("kvt-imp-a"), 0);
	assert_closed(fd1);
	ck_assert_int_eq(count_fds(), fds0);

	/* and the alloc_id is free again: a fresh import */
	rq.fd = dup(mfd);
	imp = acquire(&f, &rq, true);
	kvs_import_release(f.t, imp);
	close(mfd);
	fx_done(&f);
}
END_TEST

START_TEST(alias_refusals)
{
	fx f;
	fx_init(&f);
	int m1 = mkmemfd("kvt-imp-b1", SZ, MFD_ALLOW_SEALING);
	int m2 = mkmemfd("kvt-imp-b2", SZ, MFD_ALLOW_SEALING);
	int fds0 = count_fds();
	ids d;
	kvs_import_req rq = mkreq(&d, KVS_DEV_HOST, 0x11, 0x22, SZ, dup(m1));
	kvs_import *imp = acquire(&f, &rq, true);

	/* another memfd under the alloc_id: refused, the import unchanged */
	rq.fd = dup(m2);
	refused(&f, &rq, KVS_E_AUTH, "already names other memory");
	/* the same memory with another size */
	rq.fd = dup(m1);
	rq.size = SZ / 2;
	refused(&f, &rq, KVS_E_GEOMETRY, "another size");
	rq.fd = dup(m2);
	rq.size = SZ * 2;
	refused(&f, &rq, KVS_E_GEOMETRY, "another size");
	rq.size = SZ;
	/* not a memfd, or no fd at all, under the alloc_id */
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	close(p[1]);
	rq.fd = p[0];
	refused(&f, &rq, KVS_E_AUTH, "other memory");
	rq.fd = -1;
	refused(&f, &rq, KVS_E_DEVICE, "fstat");
	ck_assert_uint_eq(imp->refs, 1);
	ck_assert_int_eq(memfd_maps("kvt-imp-b1"), 1);
	ck_assert_int_eq(memfd_maps("kvt-imp-b2"), 0);

	/* the other memfd under another alloc_id, or another uuid: imports of
	 * their own */
	ids d2, d3;
	kvs_import_req rq2 = mkreq(&d2, KVS_DEV_HOST, 0x11, 0x23, SZ, dup(m2));
	kvs_import *imp2 = acquire(&f, &rq2, true);
	ck_assert_ptr_ne(imp2, imp);
	kvs_import_req rq3 = mkreq(&d3, KVS_DEV_HOST, 0x12, 0x22, SZ, dup(m2));
	kvs_import *imp3 = acquire(&f, &rq3, true);
	ck_assert_ptr_ne(imp3, imp);
	ck_assert_ptr_ne(imp3, imp2);
	ck_assert_uint_eq(kvs_imports_count(f.t), 3);
	ck_assert_int_eq(memfd_maps("kvt-imp-b2"), 2);
	ck_assert_int_eq(count_fds(), fds0 + 3);
	/* the same ids with the CUDA device type: another key, no engine */
	rq.dev_type = KVS_DEV_CUDA;
	rq.fd = dup(m1);
	refused(&f, &rq, KVS_E_DEVICE, "no CUDA engine");

	kvs_import_release(f.t, imp3);
	kvs_import_release(f.t, imp2);
	kvs_import_release(f.t, imp);
	ck_assert_int_eq(count_fds(), fds0);
	ck_assert_int_eq(memfd_maps("kvt-imp-b1"), 0);
	ck_assert_int_eq(memfd_maps("kvt-imp-b2"), 0);
	close(m1);
	close(m2);
	fx_done(&f);
}
END_TEST

START_TEST(unsealable_memfd)
{
	fx f;
	fx_init(&f);
	int fds0 = count_fds();
	ids d;
	/* sealing forbidden by F_SEAL_SEAL, or never allowed (no
	 * MFD_ALLOW_SEALING): refused ... */
	for (int how = 0; how < 2; how++) {
		int m = mkmemfd("kvt-imp-c", SZ, how ? 0 : MFD_ALLOW_SEALING);
		if (!how)
			ck_assert_int_eq(fcntl(m, F_ADD_SEALS, F_SEAL_SEAL), 0);
		kvs_import_req rq = mkreq(&d, KVS_DEV_HOST, 1, 2, SZ, dup(m));
		refused(&f, &rq, KVS_E_DEVICE, "cannot be sealed");
		ck_assert_int_eq(memfd_maps("kvt-imp-c"), 0);
		/* ... unless allowed: imported, marked unsealed */
		rq.fd = dup(m);
		rq.allow_unsealed = true;
		kvs_import *imp = acquire(&f, &rq, true);
		ck_assert(imp->unsealed);
		ck_assert_int_eq(fcntl(m, F_GET_SEALS) & F_SEAL_SHRINK, 0);
		ck_assert_int_eq(memfd_maps("kvt-imp-c"), 1);
		kvs_import_release(f.t, imp);
		ck_assert_int_eq(memfd_maps("kvt-imp-c"), 0);
		close(m);
	}
	/* a memfd the engine sealed itself (shrink, then seal): fine either way */
	int m = mkmemfd("kvt-imp-c", SZ, MFD_ALLOW_SEALING);
	ck_assert_int_eq(fcntl(m, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
	kvs_import_req rq = mkreq(&d, KVS_DEV_HOST, 1, 2, SZ, dup(m));
	kvs_import *imp = acquire(&f, &rq, true);
	ck_assert(!imp->unsealed);
	kvs_import_release(f.t, imp);
	close(m);
	ck_assert_int_eq(count_fds(), fds0);
	fx_done(&f);
}
END_TEST

START_TEST(not_memfd)
{
	fx f;
	fx_init(&f);
	int fds0 = count_fds();
	ids d;
	for (int allow = 0; allow < 2; allow++) {
		/* a pipe */
		int p[2];
		ck_assert_int_eq(pipe(p), 0);
		close(p[1]);
		kvs_import_req rq = mkreq(&d, KVS_DEV_HOST, 1, 2, SZ, p[0]);
		rq.allow_unsealed = allow;
		refused(&f, &rq, KVS_E_DEVICE, "not a memfd");
		/* a socket */
		int sv[2];
		ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
		close(sv[1]);
		rq.fd = sv[0];
		refused(&f, &rq, KVS_E_DEVICE, "not a memfd");
		/* no fd */
		rq.fd = -1;
		refused(&f, &rq, KVS_E_DEVICE, "not a memfd");
	}
	/* a regular file in the working directory (refused: not a memfd, or
	 * on tmpfs not sealable) */
	char name[] = "kvt-import-XXXXXX";
	int rf = mkstemp(name);
	ck_assert_int_ge(rf, 0);
	unlink(name);
	ck_assert_int_eq(ftruncate(rf, SZ), 0);
	kvs_import_req rq = mkreq(&d, KVS_DEV_HOST, 1, 2, SZ, rf);
	refused(&f, &rq, KVS_E_DEVICE, "");
	/* a memfd smaller than declared */
	int m = mkmemfd("kvt-imp-d", SZ, MFD_ALLOW_SEALING);
	rq = mkreq(&d, KVS_DEV_HOST, 1, 2, SZ + 1, dup(m));
	refused(&f, &rq, KVS_E_RANGE, "memfd holds 65536 bytes, 65537 declared");
	ck_assert_int_eq(memfd_maps("kvt-imp-d"), 0);
	close(m);
	ck_assert_int_eq(count_fds(), fds0);
	fx_done(&f);
}
END_TEST

START_TEST(cuda_without_engine)
{
	fx f;
	fx_init(&f);
	int fds0 = count_fds();
	int m = mkmemfd("kvt-imp-e", SZ, MFD_ALLOW_SEALING);
	ids d;
	/* cuMem POSIX fd */
	kvs_import_req rq = mkreq(&d, KVS_DEV_CUDA, 1, 2, SZ, dup(m));
	refused(&f, &rq, KVS_E_DEVICE, "no CUDA engine");
	/* legacy IPC handle, with and without an fd */
	uint8_t handle[64] = {1, 2, 3};
	rq.ipc_handle = handle;
	rq.ipc_len = sizeof(handle);
	rq.fd = -1;
	refused(&f, &rq, KVS_E_DEVICE, "no CUDA engine");
	rq.fd = dup(m);
	refused(&f, &rq, KVS_E_DEVICE, "no CUDA engine");
	ck_assert_int_eq(memfd_maps("kvt-imp-e"), 0);
	ck_assert_int_eq(fcntl(m, F_GET_SEALS) & F_SEAL_SHRINK, 0); /* untouched */
	close(m);
	ck_assert_int_eq(count_fds(), fds0);
	fx_done(&f);
}
END_TEST

/* With a reclaim queue, the last release takes the import out of the table
 * at once but unmaps and closes on the queue's thread (an unmap of memory
 * the copies touched takes time in proportion to it): held there, the
 * mapping and the fd stay; once it runs, both are gone, and a queue
 * destroyed with releases still queued runs them first. */
START_TEST(host_release_on_the_reclaim_thread)
{
	fx f;
	fx_init(&f);
	kvs_cq *cq;
	kvs_workq *q;
	ck_assert_int_eq(kvs_cq_create(&cq), 0);
	ck_assert_int_eq(kvs_workq_create(cq, &q), 0);
	kvs_imports_set_reclaimq(f.t, q);
	int mfd = mkmemfd("kvt-imp-r", SZ, MFD_ALLOW_SEALING);
	int fds0 = count_fds();
	ids d;
	for (int round = 0; round < 2; round++) {
		int fd1 = dup(mfd);
		kvs_import_req rq = mkreq(&d, KVS_DEV_HOST, 0x31, (uint8_t)(0x32 + round), SZ, fd1);
		kvs_import *imp = acquire(&f, &rq, true);
		imp->base[round] = 1; /* the copies touched it */
		ck_assert_int_eq(memfd_maps("kvt-imp-r"), 1);
		gate g;
		gate_hold(&g, q);
		kvs_import_release(f.t, imp);
		ck_assert_uint_eq(kvs_imports_count(f.t), 0); /* out of the table now */
		ck_assert_int_eq(memfd_maps("kvt-imp-r"), 1);  /* unmapped later, not here */
		ck_assert(fd_open(fd1));
		gate_open(&g);
		if (round == 0) {
			kvs_workq_drain(q);
		} else { /* shutdown: the queue runs what is left */
			kvs_workq_destroy(q);
			q = NULL;
			kvs_imports_set_reclaimq(f.t, NULL);
		}
		ck_assert_int_eq(memfd_maps("kvt-imp-r"), 0);
		assert_closed(fd1);
		ck_assert_int_eq(count_fds(), fds0);
	}
	kvs_cq_destroy(cq);
	close(mfd);
	fx_done(&f);
}
END_TEST

static Suite *import_suite(void)
{
	Suite *s = suite_create("import");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, host_import_and_aliases);
	tcase_add_test(tc, alias_refusals);
	tcase_add_test(tc, unsealable_memfd);
	tcase_add_test(tc, not_memfd);
	tcase_add_test(tc, cuda_without_engine);
	tcase_add_test(tc, host_release_on_the_reclaim_thread);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(import_suite)
