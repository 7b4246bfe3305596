/* Opening an L2 environment, and never crash-looping on a corrupt one: the
 * state file (how the last run ended), the fatal-signal handler that notes a
 * death inside L2 work, and setting data.mdb aside (docs/architecture.md §6).
 * See kvs_l2_impl.h. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "l2"
#include "kvs_l2_impl.h"
#include "kvs_l2_verify.h"

/* runs in a row dying inside a write transaction (each after the first
 * before committing any) that make the next open set the environment aside */
#define STRIKES_MAX 2
#define STATE_FILE "l2.state"

/* How the last run that opened this environment ended (STATE_FILE, 16
 * bytes). Single bytes are rewritten in place with pwrite and never synced:
 * the file must survive the death of the process, not a power loss. */
typedef struct l2_state {
	char magic[8];   /* "KVL2RUN1" */
	uint8_t open;    /* a process has the environment open (cleared by a clean close) */
	uint8_t in_txn;  /* ... and is inside a write transaction */
	uint8_t fault;   /* a fatal signal (its number) hit a thread inside L2 work, or FAULT_LMDB */
	uint8_t strikes; /* deaths inside a write transaction in a row, no commit between them */
	uint8_t pad[4];
} l2_state;
_Static_assert(sizeof(l2_state) == 16, "state layout");
#define FAULT_LMDB 0xff /* LMDB reported corruption (MDB_CORRUPTED, MDB_PAGE_NOTFOUND, MDB_PANIC) */

/* LMDB errors that mean the file is damaged, not that it is busy or full. */
bool kvs__l2_corrupt_err(int rc)
{
	return rc == MDB_CORRUPTED || rc == MDB_PAGE_NOTFOUND || rc == MDB_PANIC || rc == MDB_INVALID ||
	       rc == MDB_VERSION_MISMATCH || rc == MDB_INCOMPATIBLE;
}

/* ---- crash-loop detection --------------------------------------------------
 * The state file records whether a run is inside a write transaction, and
 * the fatal-signal handler records a signal that hits a thread doing L2 work
 * (tl_state_fd set). kvs_l2_open reads how the last run ended (§6). */

static _Thread_local int tl_state_fd = -1; /* this thread is inside L2 work */
static _Thread_local bool tl_l2_thread;     /* the writer or reader: all its work is L2 work */
static struct sigaction fatal_prev[NSIG];   /* the handlers installed before ours */
static const int fatal_sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

/* Async-signal-safe: pwrite, sigaction, raise. */
static void on_fatal(int sig, siginfo_t *si, void *ctx)
{
	int fd = tl_state_fd;
	if (fd >= 0) {
		uint8_t b = (uint8_t)sig;
		ssize_t w = pwrite(fd, &b, 1, offsetof(l2_state, fault));
		(void)w;
	}
	const struct sigaction *p = &fatal_prev[sig];
	if ((p->sa_flags & SA_SIGINFO) && p->sa_sigaction) {
		p->sa_sigaction(sig, si, ctx);
		return;
	}
	if (!(p->sa_flags & SA_SIGINFO) && p->sa_handler != SIG_DFL && p->sa_handler != SIG_IGN) {
		p->sa_handler(sig);
		return;
	}
	/* the default action: taken when the handler returns (the signal is
	 * blocked until then) */
	struct sigaction dfl = {.sa_handler = SIG_DFL};
	sigemptyset(&dfl.sa_mask);
	sigaction(sig, &dfl, NULL);
	raise(sig);
}

void kvs__l2_install_fatal(void)
{
	for (size_t i = 0; i < sizeof(fatal_sigs) / sizeof(fatal_sigs[0]); i++) {
		struct sigaction sa = {.sa_sigaction = on_fatal, .sa_flags = SA_SIGINFO | SA_ONSTACK};
		sigemptyset(&sa.sa_mask);
		sigaction(fatal_sigs[i], &sa, &fatal_prev[fatal_sigs[i]]);
	}
}

static const char *sig_name(int sig)
{
	switch (sig) {
	case SIGSEGV: return "SIGSEGV";
	case SIGBUS: return "SIGBUS";
	case SIGILL: return "SIGILL";
	case SIGFPE: return "SIGFPE";
	case SIGABRT: return "SIGABRT";
	default: return "a fatal signal";
	}
}

static void state_put(kvs_l2 *l2, size_t off, uint8_t v)
{
	if (l2->state_fd < 0)
		return;
	ssize_t w = pwrite(l2->state_fd, &v, 1, (off_t)off);
	(void)w;
}

/* Enters or leaves L2 work on this thread (the signal handler's marker);
 * write transactions also set in_txn in the state file, and the first one
 * of the run that commits clears the strikes. */
void kvs__l2_work_enter(kvs_l2 *l2, bool write)
{
	tl_state_fd = l2->state_fd;
	if (!write)
		return;
	pthread_mutex_lock(&l2->state_mu);
	if (l2->txn_depth++ == 0)
		state_put(l2, offsetof(l2_state, in_txn), 1);
	pthread_mutex_unlock(&l2->state_mu);
}

void kvs__l2_work_leave(kvs_l2 *l2, bool write, bool committed)
{
	if (write) {
		pthread_mutex_lock(&l2->state_mu);
		if (committed && !l2->committed) {
			l2->committed = true;
			state_put(l2, offsetof(l2_state, strikes), 0);
		}
		if (--l2->txn_depth == 0)
			state_put(l2, offsetof(l2_state, in_txn), 0);
		pthread_mutex_unlock(&l2->state_mu);
	}
	if (!tl_l2_thread)
		tl_state_fd = -1;
}

/* An LMDB error that means a damaged file: the next open sets it aside. */
void kvs__l2_note_error(kvs_l2 *l2, int rc, const char *what)
{
	if (!kvs__l2_corrupt_err(rc))
		return;
	state_put(l2, offsetof(l2_state, fault), FAULT_LMDB);
	kvs_err_rl(&l2->rl_corrupt, "L2 %s: %s: %s; the environment is damaged and will be set aside at the next start",
		   l2->path, what, mdb_strerror(rc));
}

/* Moves data.mdb aside as data.mdb.corrupt-<UTC time> and removes lock.mdb,
 * so that the next mdb_env_open creates an empty environment. */
int kvs__l2_set_aside(kvs_l2 *l2, const char *why)
{
	char from[600], to[700], lock[600], stamp[32];
	snprintf(from, sizeof(from), "%s/data.mdb", l2->path);
	snprintf(lock, sizeof(lock), "%s/lock.mdb", l2->path);
	time_t now = time(NULL);
	struct tm tm;
	gmtime_r(&now, &tm);
	strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", &tm);
	snprintf(to, sizeof(to), "%s.corrupt-%s", from, stamp);
	for (int i = 2; access(to, F_OK) == 0 && i < 1000; i++)
		snprintf(to, sizeof(to), "%s.corrupt-%s-%d", from, stamp, i);
	if (rename(from, to) < 0) {
		int e = errno;
		if (e != ENOENT) {
			kvs_err("L2 %s is corrupt (%s) and cannot be moved aside to %s: %s", l2->path, why, to,
				strerror(e));
			return -e;
		}
		snprintf(to, sizeof(to), "(no data.mdb to move)");
	}
	if (unlink(lock) < 0 && errno != ENOENT)
		kvs_warn("cannot remove %s: %s", lock, strerror(errno));
	kvs_err("L2 %s is corrupt (%s): moved data.mdb aside to %s, starting with an empty L2", l2->path, why, to);
	l2->st.corrupt_recoveries++;
	state_put(l2, offsetof(l2_state, fault), 0);
	state_put(l2, offsetof(l2_state, strikes), 0);
	return 0;
}

/* Opens the state file and decides from the last run's record whether the
 * environment must be set aside: *ret_why says why (or stays NULL). Marks
 * this run open. The state file is an aid: without it (an error opening it)
 * the L2 works, without crash-loop detection. */
void kvs__l2_state_open(kvs_l2 *l2, const char **ret_why, char *buf, size_t cap)
{
	char p[600];
	snprintf(p, sizeof(p), "%s/" STATE_FILE, l2->path);
	l2->state_fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (l2->state_fd < 0) {
		kvs_warn("cannot open %s: %s; no crash-loop detection for this L2", p, strerror(errno));
		return;
	}
	l2_state prev, cur = {.magic = "KVL2RUN1", .open = 1};
	if (pread(l2->state_fd, &prev, sizeof(prev), 0) != (ssize_t)sizeof(prev) ||
	    memcmp(prev.magic, "KVL2RUN1", 8) != 0)
		memset(&prev, 0, sizeof(prev)); /* a new environment, or an unreadable record */
	/* what calls for a set-aside stays recorded until set_aside succeeds:
	 * a start that dies (or fails) before that tries again */
	cur.fault = prev.fault;
	if (prev.fault == FAULT_LMDB) {
		snprintf(buf, cap, "the previous run met LMDB errors that mean a damaged file");
		*ret_why = buf;
	} else if (prev.fault) {
		snprintf(buf, cap, "the previous run died of %s inside L2 work", sig_name(prev.fault));
		*ret_why = buf;
	} else if (prev.open && prev.in_txn) {
		cur.strikes = (uint8_t)(prev.strikes < 0xff ? prev.strikes + 1 : 0xff);
		if (cur.strikes >= STRIKES_MAX) {
			snprintf(buf, cap, "%u runs in a row died inside a write transaction, the last before committing any",
				 (unsigned)cur.strikes);
			*ret_why = buf;
		} else {
			kvs_warn("L2 %s: the previous run died inside a write transaction; kept (strike %u: the file is "
				 "set aside when %u runs in a row die so, the later ones before committing any)",
				 l2->path, (unsigned)cur.strikes, (unsigned)STRIKES_MAX);
		}
	} else if (prev.open) {
		kvs_info("L2 %s: the previous run was not closed cleanly (outside L2 write work); kept", l2->path);
	}
	ssize_t w = pwrite(l2->state_fd, &cur, sizeof(cur), 0);
	(void)w;
}

/* A clean close: not open, no transaction, no strikes — a recorded fault
 * stays for the next open. */
void kvs__l2_state_close(kvs_l2 *l2)
{
	if (l2->state_fd < 0)
		return;
	state_put(l2, offsetof(l2_state, in_txn), 0);
	state_put(l2, offsetof(l2_state, strikes), 0);
	state_put(l2, offsetof(l2_state, open), 0);
	close(l2->state_fd);
	l2->state_fd = -1;
}

/* Altstack for the fault handler on the writer and reader threads, so that
 * even a stack overflow inside L2 work is noted. */
static void *altstack_on(void)
{
	stack_t ss = {.ss_size = 64 << 10};
	ss.ss_sp = malloc(ss.ss_size);
	if (ss.ss_sp && sigaltstack(&ss, NULL) != 0) {
		free(ss.ss_sp);
		ss.ss_sp = NULL;
	}
	return ss.ss_sp;
}

static void altstack_off(void *sp)
{
	if (!sp)
		return;
	stack_t ss = {.ss_flags = SS_DISABLE};
	sigaltstack(&ss, NULL);
	free(sp);
}

void *kvs__l2_thread_begin(kvs_l2 *l2)
{
	tl_l2_thread = true; /* a fault anywhere on this thread is noted */
	tl_state_fd = l2->state_fd;
	return altstack_on();
}

void kvs__l2_thread_end(void *alt) { altstack_off(alt); }

/* ---- opening ------------------------------------------------------------------ */

/* Reads the environment's structure without writing: the four databases
 * exist (or none, in a new environment) and the first and last entries of
 * each can be reached. LMDB asserts and aborts when a *write* meets some
 * damaged pages, so this runs before the first write transaction. */
static int env_check(kvs_l2 *l2)
{
	static const char *names[4] = {"obj", "lru", "atime", "meta"};
	MDB_txn *txn;
	int rc = mdb_txn_begin(l2->env, NULL, MDB_RDONLY, &txn);
	if (rc)
		return rc;
	MDB_dbi main;
	MDB_stat ms;
	if ((rc = mdb_dbi_open(txn, NULL, 0, &main)) || (rc = mdb_stat(txn, main, &ms)))
		goto out;
	int found = 0;
	for (int i = 0; i < 4 && !rc; i++) {
		MDB_dbi d;
		MDB_cursor *cur;
		MDB_val k, v;
		int r = mdb_dbi_open(txn, names[i], 0, &d);
		if (r == MDB_NOTFOUND)
			continue;
		if (r || (r = mdb_cursor_open(txn, d, &cur))) {
			rc = r;
			break;
		}
		found++;
		if ((r = mdb_cursor_get(cur, &k, &v, MDB_FIRST)) == 0)
			r = mdb_cursor_get(cur, &k, &v, MDB_LAST);
		mdb_cursor_close(cur);
		if (r && r != MDB_NOTFOUND)
			rc = r;
	}
	/* the four are created together: some missing, or none in a main
	 * database that has entries, is not an environment of ours intact */
	if (!rc && found != 4 && (found || ms.ms_entries))
		rc = MDB_CORRUPTED;
out:
	mdb_txn_abort(txn);
	return rc;
}

/* The structural walk of data.mdb (kvs_l2_verify.c) before LMDB maps it:
 * MDB_CORRUPTED with the damage in l2->damage when it finds any. A file that
 * cannot be read is left to mdb_env_open to report. */
static int env_verify(kvs_l2 *l2)
{
	char file[600];
	snprintf(file, sizeof(file), "%s/data.mdb", l2->path);
	kvs_l2_verify_report rep;
	int rc = kvs_l2_verify(file, &rep, l2->damage, sizeof(l2->damage));
	if (rc == -ENOENT)
		return 0;
	l2->st.verify_us = rep.us;
	l2->st.verify_bytes = rep.used_bytes;
	if (rc == KVS_L2_VERIFY_DAMAGED)
		return MDB_CORRUPTED;
	if (rc < 0) {
		kvs_warn("L2 %s: cannot check data.mdb (%s); opening it unchecked", l2->path, strerror(-rc));
		return 0;
	}
	if (rep.used_bytes > (64u << 10))
		kvs_info("L2 %s: structure intact: %llu MiB in use, %llu B-tree pages read, %llu entries, in %.1f ms",
			 l2->path, (unsigned long long)(rep.used_bytes >> 20), (unsigned long long)rep.pages_read,
			 (unsigned long long)rep.entries, rep.us / 1000.0);
	return 0;
}

/* Creates the environment handle, checks data.mdb (when verify is on),
 * opens it, checks its databases can be reached and opens them; on failure
 * nothing stays open. */
int kvs__l2_env_open(kvs_l2 *l2)
{
	int rc;
	l2->damage[0] = 0;
	if (l2->cfg.verify && (rc = env_verify(l2)) != 0)
		return rc;
	if ((rc = mdb_env_create(&l2->env)) != 0)
		return rc;
	mdb_env_set_maxdbs(l2->env, 4);
	mdb_env_set_maxreaders(l2->env, 64);
	if ((rc = mdb_env_set_mapsize(l2->env, l2->map_full)) != 0)
		goto fail;
	/* WRITEMAP: MDB_RESERVE hands out space straight in the map, so an
	 * object is copied once, from L1 into the page cache */
	unsigned flags = MDB_NOTLS | MDB_NORDAHEAD | MDB_WRITEMAP;
	if (l2->cfg.sync == KVS_L2_SYNC_NOMETA)
		flags |= MDB_NOMETASYNC;
	else if (l2->cfg.sync == KVS_L2_SYNC_NONE)
		flags |= MDB_NOSYNC;
	kvs__l2_work_enter(l2, false); /* a fault from here on is noted */
	if ((rc = mdb_env_open(l2->env, l2->path, flags, 0600)) != 0)
		goto fail;
	MDB_stat est;
	mdb_env_stat(l2->env, &est);
	l2->psize = est.ms_psize ? est.ms_psize : 4096;
	int dead = 0;
	mdb_reader_check(l2->env, &dead); /* slots of a killed earlier process */
	if ((rc = env_check(l2)) != 0)
		goto fail;
	MDB_txn *txn;
	if ((rc = mdb_txn_begin(l2->env, NULL, 0, &txn)) != 0)
		goto fail;
	kvs__l2_work_enter(l2, true);
	if ((rc = mdb_dbi_open(txn, "obj", MDB_CREATE, &l2->obj)) ||
	    (rc = mdb_dbi_open(txn, "lru", MDB_CREATE, &l2->lru)) ||
	    (rc = mdb_dbi_open(txn, "atime", MDB_CREATE, &l2->atime)) ||
	    (rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &l2->meta))) {
		mdb_txn_abort(txn);
		kvs__l2_work_leave(l2, true, false);
		goto fail;
	}
	l2->st.bytes = kvs__l2_meta_get(txn, l2->meta, "bytes");
	l2->st.objects = kvs__l2_meta_get(txn, l2->meta, "objects");
	l2->clock = kvs__l2_meta_get(txn, l2->meta, "clock");
	rc = mdb_txn_commit(txn);
	/* not a commit of the run's work: the strikes stay until the writer's */
	kvs__l2_work_leave(l2, true, false);
	if (rc)
		goto fail;
	kvs__l2_work_leave(l2, false, false);
	return 0;
fail:
	kvs__l2_work_leave(l2, false, false);
	mdb_env_close(l2->env);
	l2->env = NULL;
	return rc;
}
