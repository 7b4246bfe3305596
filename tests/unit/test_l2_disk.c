/* Unit tests for the L2 tier on a full file system (issue 16 #7): a small
 * tmpfs mounted in a private mount namespace of each test. A full disk must
 * never fault the writer (SIGBUS through the WRITEMAP mapping): writes that
 * cannot fit fail with "No space left on device", eviction keeps writing
 * within what the disk holds, and writing grows again once space is freed.
 * Needs root (CAP_SYS_ADMIN) for the mount; exits 77 (skip) otherwise. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check_main.h"
#include "kvs_error.h"
#include "kvs_l2.h"

#define GEOM 0x77aa55cc33ee1100ull
#define MIB (1ull << 20)
#define OBJ (256u << 10)
#define WAIT_MS 30000

static char g_base[64];
static pid_t g_parent;

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(p);
}

static void rm_base(void)
{
	if (getpid() == g_parent && g_base[0])
		nftw(g_base, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* ---- fixture: an 8 MiB tmpfs of this test's own, stderr into a file ---------- */

typedef struct fx {
	char mnt[128], dir[160], log[160];
	int efd, saved_err;
	kvs_l2_config cfg;
	kvs_l2 *l2;
} fx;

static void fx_init(fx *f, uint64_t l2_size)
{
	memset(f, 0, sizeof(*f));
	snprintf(f->mnt, sizeof(f->mnt), "%s/m-XXXXXX", g_base);
	ck_assert_ptr_nonnull(mkdtemp(f->mnt));
	/* private: the mount goes away with this test's process and never
	 * shows in the namespace it came from */
	ck_assert_int_eq(unshare(CLONE_NEWNS), 0);
	ck_assert_int_eq(mount("none", "/", "none", MS_REC | MS_PRIVATE, NULL), 0);
	ck_assert_int_eq(mount("tmpfs", f->mnt, "tmpfs", 0, "size=8M"), 0);
	snprintf(f->dir, sizeof(f->dir), "%s/l2", f->mnt);
	snprintf(f->log, sizeof(f->log), "%s/log-XXXXXX", g_base);
	int lfd = mkstemp(f->log);
	ck_assert_int_ge(lfd, 0);
	fflush(stderr);
	f->saved_err = dup(STDERR_FILENO);
	ck_assert_int_ge(dup2(lfd, STDERR_FILENO), 0);
	close(lfd);
	f->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	ck_assert_int_ge(f->efd, 0);
	kvs_l2_config_defaults(&f->cfg);
	f->cfg.path = f->dir;
	f->cfg.size = l2_size;
	f->cfg.sync = KVS_L2_SYNC_NONE;
	f->cfg.efd = f->efd;
}

static void fx_open(fx *f)
{
	f->l2 = NULL;
	ck_assert_int_eq(kvs_l2_open(&f->cfg, &f->l2), 0);
}

static void fx_close(fx *f)
{
	kvs_l2_close(f->l2);
	f->l2 = NULL;
}

/* The log so far (NUL-terminated, caller frees); also echoed to the real
 * stderr at the end of the test. */
static char *log_text(fx *f)
{
	int fd = open(f->log, O_RDONLY);
	ck_assert_int_ge(fd, 0);
	char *buf = calloc(1, 1 << 20);
	ck_assert_ptr_nonnull(buf);
	ssize_t n = pread(fd, buf, (1 << 20) - 1, 0);
	ck_assert_int_ge(n, 0);
	close(fd);
	return buf;
}

static int count_lines(const char *log, const char *what)
{
	int n = 0;
	for (const char *p = log; (p = strstr(p, what)) != NULL; p++)
		n++;
	return n;
}

static void fx_done(fx *f)
{
	fx_close(f);
	close(f->efd);
	char *log = log_text(f);
	dup2(f->saved_err, STDERR_FILENO);
	close(f->saved_err);
	fputs(log, stderr);
	free(log);
	ck_assert_int_eq(umount(f->mnt), 0);
}

static kvs_l2_stats stats(fx *f)
{
	kvs_l2_stats st;
	kvs_l2_get_stats(f->l2, &st);
	return st;
}

static kvs_objkey mkkey(uint32_t id)
{
	kvs_objkey k;
	memset(&k, 0, sizeof(k));
	memcpy(k.chunk, &id, sizeof(id));
	memset(k.ns, 0x5d, sizeof(k.ns));
	k.world = 2;
	k.rank = 1;
	return k;
}

static void fill(uint8_t *p, uint64_t len, uint64_t seed)
{
	uint64_t x = (seed + 1) * 0xd1342543de82ef95ull;
	for (uint64_t i = 0; i < len; i += 8) {
		x += 0x9e3779b97f4a7c15ull;
		uint64_t z = x;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		z ^= z >> 31;
		memcpy(p + i, &z, len - i < 8 ? len - i : 8);
	}
}

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static kvs_l2_done wait_one(fx *f)
{
	kvs_l2_done d;
	int64_t deadline = now_ms() + WAIT_MS;
	while (kvs_l2_reap(f->l2, &d, 1) == 0) {
		ck_assert_msg(now_ms() < deadline, "no completion");
		struct pollfd p = {.fd = f->efd, .events = POLLIN};
		ck_assert_int_ge(poll(&p, 1, 1000), 0);
		uint64_t v;
		ssize_t r = read(f->efd, &v, sizeof(v));
		(void)r;
	}
	return d;
}

/* Writes object id (len bytes of seed id) and returns the write's result. */
static int put(fx *f, uint32_t id, uint8_t *buf, uint64_t len)
{
	fill(buf, len, id);
	kvs_objkey k = mkkey(id);
	ck_assert_int_eq(kvs_l2_write(f->l2, &k, GEOM, buf, len, NULL), 0);
	kvs_l2_done d = wait_one(f);
	ck_assert_int_eq(d.op, KVS_L2_WRITE);
	return d.result;
}

/* Reads object id back and compares it with what put wrote. */
static void get(fx *f, uint32_t id, uint64_t len)
{
	uint8_t *want = malloc(len), *got = malloc(len);
	ck_assert(want && got);
	fill(want, len, id);
	kvs_objkey k = mkkey(id);
	ck_assert_int_eq(kvs_l2_read(f->l2, &k, GEOM, got, len, NULL), 0);
	kvs_l2_done d = wait_one(f);
	ck_assert_int_eq(d.op, KVS_L2_READ);
	ck_assert_msg(d.result == 0, "read of %u: %s", id, kvs_strerror(d.result));
	ck_assert(memcmp(want, got, len) == 0);
	free(want);
	free(got);
}

static bool has(fx *f, uint32_t id)
{
	kvs_objkey k = mkkey(id);
	return kvs_l2_contains(f->l2, &k, GEOM, NULL) == 0;
}

/* Fills the file system with path until it refuses (ENOSPC). */
static void fill_disk(const char *path)
{
	int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0600);
	ck_assert_int_ge(fd, 0);
	static uint8_t b[64 << 10];
	memset(b, 0x33, sizeof(b));
	ssize_t w;
	while ((w = write(fd, b, sizeof(b))) > 0)
		;
	ck_assert_int_lt(w, 0);
	ck_assert_int_eq(errno, ENOSPC);
	/* the last page or so */
	while (write(fd, b, 512) > 0)
		;
	close(fd);
	struct statvfs vfs;
	ck_assert_int_eq(statvfs(path, &vfs), 0);
	ck_assert_uint_lt((uint64_t)vfs.f_bavail * vfs.f_frsize, 64 << 10);
}

/* ---- tests ----------------------------------------------------------------------- */

/* Another process fills the disk under a running L2; it keeps writing by
 * eviction, refuses (ENOSPC, logged as such, rate-limited) what cannot fit,
 * and grows again when the filler is deleted. */
START_TEST(disk_full_then_freed)
{
	fx f;
	fx_init(&f, 16 * MIB);
	fx_open(&f);
	uint8_t *buf = malloc(3 * MIB);
	ck_assert_ptr_nonnull(buf);
	char filler[200];
	snprintf(filler, sizeof(filler), "%s/filler", f.mnt);
	fill_disk(filler);
	/* 30 objects of 256 KiB: the first ones in the blocks L2 allocated
	 * ahead, then the disk refuses more and eviction makes room */
	for (uint32_t i = 0; i < 30; i++)
		ck_assert_msg(put(&f, i, buf, OBJ) == 0, "write %u", i);
	kvs_l2_stats st = stats(&f);
	ck_assert_uint_eq(st.disk_full, 1);
	ck_assert_uint_gt(st.evictions, 0);
	ck_assert_uint_eq(st.write_errors, 0);
	ck_assert_uint_lt(st.map_size, 4 * MIB); /* the capacity: what the disk gave */
	ck_assert_uint_eq(st.objects + st.evictions, 30);
	for (uint32_t i = 0; i < 30; i++)
		ck_assert_msg(has(&f, i) == (i >= 30 - st.objects), "object %u", i);
	get(&f, 29, OBJ);
	uint64_t small_cap = st.map_size;
	/* 3 MiB cannot fit in what the disk gave: refused, 20 times */
	for (uint32_t i = 0; i < 20; i++)
		ck_assert_int_eq(put(&f, 100, buf, 3 * MIB), KVS_E_NOSPACE);
	st = stats(&f);
	ck_assert_uint_eq(st.write_errors, 20);
	ck_assert(!has(&f, 100));
	/* space comes back: the same write commits, and the capacity grew */
	ck_assert_int_eq(unlink(filler), 0);
	ck_assert_int_eq(put(&f, 100, buf, 3 * MIB), 0);
	get(&f, 100, 3 * MIB);
	st = stats(&f);
	ck_assert_uint_gt(st.map_size, small_cap + 2 * MIB);
	ck_assert_uint_eq(st.write_errors, 20);
	/* and writing goes on */
	for (uint32_t i = 200; i < 230; i++)
		ck_assert_int_eq(put(&f, i, buf, OBJ), 0);
	get(&f, 229, OBJ);
	char *log = log_text(&f);
	/* said at open: the file system is smaller than l2-size */
	ck_assert_ptr_nonnull(strstr(log, "less than l2-size"));
	ck_assert_ptr_nonnull(strstr(log, "No space left on device"));
	ck_assert_ptr_null(strstr(log, "Input/output error"));
	/* 20 failed commits: one line per 5 s, so fewer lines than failures */
	int lines = count_lines(log, "group commit of 1 objects failed: No space left on device");
	ck_assert_int_ge(lines, 1);
	ck_assert_int_lt(lines, 20);
	free(log);
	free(buf);
	fx_done(&f);
}
END_TEST

/* L2 alone fills a file system smaller than l2-size: it stops growing at
 * what the disk holds and keeps every write committing by eviction; after a
 * restart (the disk still full) it serves what it had and goes on. */
START_TEST(l2_fills_disk)
{
	fx f;
	fx_init(&f, 16 * MIB);
	fx_open(&f);
	uint8_t *buf = malloc(OBJ);
	ck_assert_ptr_nonnull(buf);
	enum { N = 60 }; /* 15 MiB */
	for (uint32_t i = 0; i < N; i++)
		ck_assert_msg(put(&f, i, buf, OBJ) == 0, "write %u", i);
	kvs_l2_stats st = stats(&f);
	ck_assert_uint_eq(st.disk_full, 1);
	ck_assert_uint_gt(st.evictions, 0);
	ck_assert_uint_eq(st.write_errors, 0);
	ck_assert_uint_lt(st.map_size, 8 * MIB);
	ck_assert_uint_gt(st.map_size, 4 * MIB);
	for (uint32_t i = N - 10; i < N; i++)
		get(&f, i, OBJ);
	uint64_t objects = st.objects;
	fx_close(&f);
	fx_open(&f);
	st = stats(&f);
	ck_assert_uint_eq(st.objects, objects);
	ck_assert_uint_lt(st.map_size, 8 * MIB);
	get(&f, N - 1, OBJ);
	for (uint32_t i = N; i < N + 20; i++)
		ck_assert_msg(put(&f, i, buf, OBJ) == 0, "write %u", i);
	get(&f, N + 19, OBJ);
	ck_assert_uint_eq(stats(&f).write_errors, 0);
	free(buf);
	fx_done(&f);
}
END_TEST

static Suite *l2_disk_suite(void)
{
	g_parent = getpid();
	snprintf(g_base, sizeof(g_base), "/tmp/kvs-test-l2disk-XXXXXX");
	if (!mkdtemp(g_base)) {
		perror("mkdtemp");
		exit(EXIT_FAILURE);
	}
	atexit(rm_base);
	Suite *s = suite_create("l2_disk");
	TCase *tc = tcase_create("enospc");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, disk_full_then_freed);
	tcase_add_test(tc, l2_fills_disk);
	suite_add_tcase(s, tc);
	return s;
}

/* Skip (77) unless a tmpfs can be mounted in a private mount namespace:
 * root with CAP_SYS_ADMIN. Probed in a child, so this process stays in its
 * namespace. */
static bool can_mount(void)
{
	if (geteuid() != 0)
		return false;
	pid_t pid = fork();
	if (pid < 0)
		return false;
	if (pid == 0) {
		char d[] = "/tmp/kvs-test-l2probe-XXXXXX";
		if (!mkdtemp(d))
			_exit(1);
		int ok = unshare(CLONE_NEWNS) == 0 && mount("none", "/", "none", MS_REC | MS_PRIVATE, NULL) == 0 &&
			 mount("tmpfs", d, "tmpfs", 0, "size=1M") == 0 && umount(d) == 0;
		rmdir(d);
		_exit(ok ? 0 : 1);
	}
	int status;
	return waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

int main(void)
{
	if (!can_mount()) {
		fprintf(stderr, "l2_disk: needs root and mount(2) (a private tmpfs): skipped\n");
		return 77;
	}
	SRunner *sr = srunner_create(l2_disk_suite());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
