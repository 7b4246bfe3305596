/* Logging sink shared by the server, the client library and the tools. */
#include "kvs_log.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvs_time.h"

static atomic_int log_level = KVS_LOG_WARN;
static atomic_int log_format = KVS_LOG_TEXT;


void kvs_log_set_format(int format) { atomic_store(&log_format, format); }
int kvs_log_format_parse(const char *s)
{
	if (strcmp(s, "text") == 0)
		return KVS_LOG_TEXT;
	if (strcmp(s, "json") == 0)
		return KVS_LOG_JSON;
	return -1;
}

void kvs_log_set_level(int level) { atomic_store(&log_level, level); }
int kvs_log_get_level(void) { return atomic_load_explicit(&log_level, memory_order_relaxed); }

int kvs_log_level_parse(const char *s)
{
	static const char *names[] = {"error", "warn", "info", "debug"};
	for (int i = 0; i < 4; i++)
		if (strcmp(s, names[i]) == 0)
			return i;
	return -1;
}

/* JSON string body of s (quotes, backslashes, control bytes escaped) into
 * out; returns the bytes written (out holds at least cap). */
static size_t json_escape(char *out, size_t cap, const char *s)
{
	size_t n = 0;
	for (; *s && n + 7 < cap; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\') {
			out[n++] = '\\';
			out[n++] = (char)c;
		} else if (c < 0x20) {
			n += (size_t)snprintf(out + n, cap - n, "\\u%04x", c);
		} else {
			out[n++] = (char)c;
		}
	}
	return n;
}

/* The first "<word> " followed by n hex digits (session ids: 16) or by
 * decimal digits (job ids) in msg, copied to out; false if none. */
static bool find_id(const char *msg, const char *word, bool hex, char *out, size_t cap)
{
	size_t wl = strlen(word);
	for (const char *p = strstr(msg, word); p; p = strstr(p + 1, word)) {
		if (p != msg && p[-1] != ' ' && p[-1] != '(')
			continue;
		const char *q = p + wl;
		size_t k = 0;
		while (k + 1 < cap && (hex ? isxdigit((unsigned char)q[k]) : isdigit((unsigned char)q[k])))
			k++;
		if (k == 0 || (hex && k != 16))
			continue;
		memcpy(out, q, k);
		out[k] = 0;
		return true;
	}
	return false;
}

#define LINE_MAX_BYTES 2048

/* One log line of msg in the current format, newline included, into line
 * (LINE_MAX_BYTES); returns its length. */
static size_t format_line(int level, const char *comp, const char *msg, char *line)
{
	static const char lv[] = "EWID";
	static const char *names[] = {"error", "warn", "info", "debug"};
	const size_t cap = LINE_MAX_BYTES;
	char when[48];
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	/* ISO 8601, UTC, milliseconds */
	snprintf(when, sizeof(when), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", (tm.tm_year + 1900) % 10000,
		 (tm.tm_mon + 1) % 100, tm.tm_mday % 100, tm.tm_hour % 100, tm.tm_min % 100, tm.tm_sec % 100,
		 (int)(ts.tv_nsec / 1000000) % 1000);
	size_t len;
	if (atomic_load_explicit(&log_format, memory_order_relaxed) == KVS_LOG_JSON) {
		len = (size_t)snprintf(line, cap, "{\"time\":\"%s\",\"level\":\"%s\",\"module\":\"", when,
				       names[level & 3]);
		len += json_escape(line + len, 64, comp);
		len += (size_t)snprintf(line + len, cap - len, "\",\"message\":\"");
		len += json_escape(line + len, cap - len - 96, msg);
		char id[32];
		if (find_id(msg, "session ", true, id, sizeof(id)))
			len += (size_t)snprintf(line + len, cap - len, "\",\"session\":\"%s", id);
		if (find_id(msg, "job ", false, id, sizeof(id)))
			len += (size_t)snprintf(line + len, cap - len, "\",\"job\":\"%s", id);
		len += (size_t)snprintf(line + len, cap - len, "\"}");
	} else {
		len = (size_t)snprintf(line, cap, "%s %c %s: %s", when, lv[level & 3], comp, msg);
	}
	if (len > cap - 2)
		len = cap - 2;
	line[len++] = '\n';
	return len;
}

/* ---- the asynchronous sink (kvs_log_async_start) ------------------------------
 * Lines go into a ring and one thread writes them to stderr, so that a
 * reader of stderr that stalls (a pipe nobody drains, a container's log
 * driver under pressure) never blocks the thread that logs; a line that
 * finds the ring full is dropped and counted.
 * Invariant (under mu): 0 <= len <= size; the bytes queued are
 * buf[head .. head+len) modulo size, whole lines in the order their writers
 * took mu; dropped counts the lines refused since the thread last reported
 * them; on is true from start until stop took the thread's last lines (or
 * gave up on them), and a writer that finds it false writes its line
 * itself. buf is freed only once the thread is joined. */
#define LOGQ_CHUNK (64u << 10)
static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	char *buf, *out; /* the ring (size bytes), the thread's chunk (LOGQ_CHUNK) */
	size_t size, head, len;
	uint64_t dropped;
	bool on, stop;
	pthread_t thr;
} lq = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
static atomic_bool lq_started; /* a hint for the common case, the client library's: no sink */
/* the chunk the thread is writing: out[out_done .. out_len) is still to go
 * (read by the crash handler, kvs_log_fatal, which cannot take mu) */
static _Atomic size_t lq_out_len, lq_out_done;
static atomic_bool lq_crashing; /* kvs_log_fatal took over: the thread writes no more */
static _Atomic uint64_t lq_dropped_total;

/* Writes all of b to stderr, waiting while it is full; gives up on an error
 * (a closed reader: the lines are lost either way). done, if given, counts
 * the bytes written. */
static void write_all(const char *b, size_t n, _Atomic size_t *done)
{
	while (n && !atomic_load_explicit(&lq_crashing, memory_order_relaxed)) {
		ssize_t w = write(STDERR_FILENO, b, n);
		if (w > 0) {
			b += w;
			n -= (size_t)w;
			if (done)
				atomic_fetch_add(done, (size_t)w);
		} else if (w < 0 && errno == EAGAIN) { /* someone made stderr non-blocking */
			struct pollfd p = {.fd = STDERR_FILENO, .events = POLLOUT};
			poll(&p, 1, 1000);
		} else if (!(w < 0 && errno == EINTR)) {
			return;
		}
	}
}

static void *logq_main(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&lq.mu);
	for (;;) {
		while (!lq.len && !lq.dropped && !lq.stop)
			pthread_cond_wait(&lq.cv, &lq.mu);
		if (!lq.len && !lq.dropped)
			break; /* stopping, and everything written */
		if (atomic_load(&lq_crashing)) { /* the ring is the crash handler's now */
			pthread_mutex_unlock(&lq.mu);
			for (;;)
				pause(); /* until the fatal signal's default action */
		}
		size_t n = lq.len < LOGQ_CHUNK ? lq.len : LOGQ_CHUNK;
		size_t first = lq.size - lq.head < n ? lq.size - lq.head : n;
		memcpy(lq.out, lq.buf + lq.head, first);
		memcpy(lq.out + first, lq.buf, n - first);
		lq.head = (lq.head + n) % lq.size;
		lq.len -= n;
		uint64_t dropped = lq.dropped;
		lq.dropped = 0;
		atomic_store(&lq_out_done, 0);
		atomic_store(&lq_out_len, n);
		pthread_mutex_unlock(&lq.mu);
		write_all(lq.out, n, &lq_out_done);
		atomic_store(&lq_out_len, 0);
		if (dropped) { /* in the log's own format, after the lines that were kept */
			char msg[160], line[LINE_MAX_BYTES];
			snprintf(msg, sizeof(msg), "%llu log lines dropped: stderr's reader fell %zu KiB behind",
				 (unsigned long long)dropped, lq.size >> 10);
			write_all(line, format_line(KVS_LOG_WARN, "log", msg, line), NULL);
		}
		pthread_mutex_lock(&lq.mu);
	}
	pthread_mutex_unlock(&lq.mu);
	return NULL;
}

/* Queues a line: true if the sink took it (or dropped it), false when the
 * sink is off and the caller writes it itself. */
static bool logq_put(const char *line, size_t n)
{
	if (!atomic_load_explicit(&lq_started, memory_order_relaxed))
		return false;
	pthread_mutex_lock(&lq.mu);
	if (!lq.on) {
		pthread_mutex_unlock(&lq.mu);
		return false;
	}
	if (n > lq.size - lq.len) {
		lq.dropped++;
		atomic_fetch_add_explicit(&lq_dropped_total, 1, memory_order_relaxed);
	} else {
		size_t tail = (lq.head + lq.len) % lq.size;
		size_t first = lq.size - tail < n ? lq.size - tail : n;
		memcpy(lq.buf + tail, line, first);
		memcpy(lq.buf, line + first, n - first);
		lq.len += n;
	}
	pthread_cond_signal(&lq.cv);
	pthread_mutex_unlock(&lq.mu);
	return true;
}

int kvs_log_async_start(size_t bytes)
{
	if (bytes < 2 * LINE_MAX_BYTES)
		bytes = 2 * LINE_MAX_BYTES;
	pthread_mutex_lock(&lq.mu);
	if (lq.on || lq.buf) { /* running, or a stop that gave up still owns it */
		pthread_mutex_unlock(&lq.mu);
		return -EALREADY;
	}
	int r = 0;
	if (!(lq.buf = malloc(bytes + LOGQ_CHUNK))) {
		r = -ENOMEM;
		goto out;
	}
	lq.out = lq.buf + bytes;
	lq.size = bytes;
	lq.head = lq.len = 0;
	lq.dropped = 0;
	lq.stop = false;
	if ((r = -pthread_create(&lq.thr, NULL, logq_main, NULL)) != 0) {
		free(lq.buf);
		lq.buf = NULL;
		goto out;
	}
	lq.on = true;
	atomic_store(&lq_started, true);
out:
	pthread_mutex_unlock(&lq.mu);
	return r;
}

bool kvs_log_async_stop(int wait_ms)
{
	pthread_mutex_lock(&lq.mu);
	if (!lq.on || lq.stop) {
		pthread_mutex_unlock(&lq.mu);
		return true;
	}
	lq.stop = true;
	pthread_cond_signal(&lq.cv);
	pthread_mutex_unlock(&lq.mu);
	struct timespec until;
	clock_gettime(CLOCK_MONOTONIC, &until);
	until.tv_sec += wait_ms / 1000;
	until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	bool joined = pthread_clockjoin_np(lq.thr, NULL, CLOCK_MONOTONIC, &until) == 0;
	pthread_mutex_lock(&lq.mu);
	lq.on = false; /* later lines are written directly */
	if (joined) {
		free(lq.buf);
		lq.buf = lq.out = NULL;
	} else { /* the thread is stuck in write(2): it keeps the ring; the lines still in it are lost */
		uint64_t lost = 0;
		for (size_t i = 0; i < lq.len; i++)
			lost += lq.buf[(lq.head + i) % lq.size] == '\n';
		atomic_fetch_add(&lq_dropped_total, lost);
	}
	pthread_mutex_unlock(&lq.mu);
	return joined;
}

uint64_t kvs_log_dropped(void) { return atomic_load_explicit(&lq_dropped_total, memory_order_relaxed); }

/* ---- a crash's last lines (kvs_log_fatal) --------------------------------
 * Called from a fatal signal's handler, so only async-signal-safe calls, and
 * no mutex: the crashing thread may hold lq.mu. It reads head and len as
 * they are; a line the log thread is writing at that moment may appear
 * twice, or a line being queued may be cut: duplicates and a torn line
 * beat losing the error that came right before the crash. Each write is at
 * most PIPE_BUF bytes, after poll said stderr takes that much, so a reader
 * that stopped reading delays the process's death by CRASH_FLUSH_MS at
 * most. */
#define CRASH_FLUSH_MS 1000

/* Writes b[0..n) in pieces stderr takes without blocking, until end;
 * false if it gave up. */
static bool crash_write(const char *b, size_t n, uint64_t end)
{
	while (n) {
		uint64_t now = kvs_now_ms();
		struct pollfd pf = {.fd = STDERR_FILENO, .events = POLLOUT};
		if (now >= end || poll(&pf, 1, (int)(end - now)) <= 0 || !(pf.revents & POLLOUT))
			return false;
		ssize_t w = write(STDERR_FILENO, b, n < PIPE_BUF ? n : PIPE_BUF);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return false;
		b += w;
		n -= (size_t)w;
	}
	return true;
}

static void crash_flush(void)
{
	if (!atomic_load_explicit(&lq_started, memory_order_relaxed) || !lq.buf)
		return;
	if (atomic_exchange(&lq_crashing, true))
		return; /* a second fatal signal, on another thread */
	uint64_t end = kvs_now_ms() + CRASH_FLUSH_MS;
	/* one look at both before writing: the rest of the chunk the thread is
	 * writing (a stalled reader: most of what is queued), then the ring
	 * behind it; from here the thread takes no new chunk, and stops
	 * writing its own after the write(2) it is in */
	size_t on = atomic_load(&lq_out_len), od = atomic_load(&lq_out_done);
	size_t size = lq.size, head = lq.head, len = lq.len;
	if (on <= LOGQ_CHUNK && od < on && !crash_write(lq.out + od, on - od, end))
		return;
	if (!size || head >= size || len > size)
		return;
	size_t first = size - head < len ? size - head : len;
	if (crash_write(lq.buf + head, first, end))
		crash_write(lq.buf, len - first, end);
}

void kvs_log_fatal(int sig)
{
	int e = errno;
	crash_flush();
	errno = e;
	/* then the default action: a fault happens again on return, a signal
	 * sent by kill or abort is pending until then */
	struct sigaction dfl = {.sa_handler = SIG_DFL};
	sigemptyset(&dfl.sa_mask);
	sigaction(sig, &dfl, NULL);
	raise(sig);
}

void kvs_log_crash_handlers(void)
{
	static const int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL};
	struct sigaction sa = {.sa_handler = kvs_log_fatal};
	sigemptyset(&sa.sa_mask);
	for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
		/* a handler already there stays (a sanitizer's report says more) */
		struct sigaction old;
		if (sigaction(sigs[i], NULL, &old) == 0 && !(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL)
			sigaction(sigs[i], &sa, NULL);
	}
}

/* Formats fmt (plus, when held, how many similar lines a rate limit held
 * back) as one line and writes it, through the queue when it runs. */
static void log_v(int level, const char *comp, uint64_t held, const char *fmt, va_list ap)
{
	char msg[900], line[LINE_MAX_BYTES];
	int m = vsnprintf(msg, held ? sizeof(msg) - 64 : sizeof(msg), fmt, ap); /* room for the count */
	if (m < 0)
		msg[0] = 0;
	if (held) {
		size_t k = strlen(msg);
		snprintf(msg + k, sizeof(msg) - k, " (%llu similar lines suppressed)", (unsigned long long)held);
	}
	size_t len = format_line(level, comp, msg, line);
	if (!logq_put(line, len)) {
		ssize_t w = write(STDERR_FILENO, line, len);
		(void)w;
	}
}

void kvs_log_write(int level, const char *comp, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	log_v(level, comp, 0, fmt, ap);
	va_end(ap);
}

bool kvs_ratelimit_pass(kvs_ratelimit *rl, uint64_t *ret_suppressed)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	int64_t now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
	int64_t next = atomic_load(&rl->next_ms);
	/* one thread wins the interval; the others count as held back */
	if (now >= next && atomic_compare_exchange_strong(&rl->next_ms, &next, now + rl->interval_ms)) {
		*ret_suppressed = atomic_exchange(&rl->suppressed, 0);
		return true;
	}
	atomic_fetch_add(&rl->suppressed, 1);
	return false;
}

void kvs_log_limited(kvs_ratelimit *rl, int level, const char *comp, const char *fmt, ...)
{
	if (level > kvs_log_get_level())
		return;
	uint64_t held;
	if (!kvs_ratelimit_pass(rl, &held))
		return;
	va_list ap;
	va_start(ap, fmt);
	log_v(level, comp, held, fmt, ap);
	va_end(ap);
}
