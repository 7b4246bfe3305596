/* Logging sink shared by the server, the client library and the tools. */
#include "kvs_log.h"

#include <ctype.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int log_level = KVS_LOG_WARN;
static atomic_int log_format = KVS_LOG_TEXT;

/* The asynchronous sink (kvs_log_async_start): lines go into a ring of
 * LOGQ_BYTES and one thread writes them to stderr, so that a reader of
 * stderr that stalls (a pipe nobody drains, a container's log driver under
 * pressure) never blocks the thread that logs; a line that finds the ring
 * full is dropped and counted.
 * Invariant (under mu): 0 <= len <= LOGQ_BYTES; the bytes queued are
 * buf[head .. head+len) modulo LOGQ_BYTES, whole lines in the order their
 * writers took mu; dropped counts the lines refused since the writer last
 * reported them. */
#define LOGQ_BYTES (1u << 20)
#define LOGQ_CHUNK (64u << 10)
static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	char *buf;
	size_t head, len;
	uint64_t dropped;
	bool stop;
	pthread_t thr;
} lq = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
static atomic_bool lq_on;
static _Atomic uint64_t lq_dropped_total;

/* Writes all of b to stderr, waiting while it is full; gives up on an error
 * (a closed reader: the lines are lost either way). */
static void write_all(const char *b, size_t n)
{
	while (n) {
		ssize_t w = write(STDERR_FILENO, b, n);
		if (w > 0) {
			b += w;
			n -= (size_t)w;
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
	static char out[LOGQ_CHUNK];
	pthread_mutex_lock(&lq.mu);
	for (;;) {
		while (!lq.len && !lq.dropped && !lq.stop)
			pthread_cond_wait(&lq.cv, &lq.mu);
		if (!lq.len && !lq.dropped)
			break; /* stopping, and everything written */
		size_t n = lq.len < LOGQ_CHUNK ? lq.len : LOGQ_CHUNK;
		size_t first = LOGQ_BYTES - lq.head < n ? LOGQ_BYTES - lq.head : n;
		memcpy(out, lq.buf + lq.head, first);
		memcpy(out + first, lq.buf, n - first);
		lq.head = (lq.head + n) % LOGQ_BYTES;
		lq.len -= n;
		uint64_t dropped = lq.dropped;
		lq.dropped = 0;
		pthread_mutex_unlock(&lq.mu);
		write_all(out, n);
		if (dropped) {
			char note[160];
			int k = snprintf(note, sizeof(note),
					 "kvside: %llu log lines dropped: stderr's reader fell %u KiB behind\n",
					 (unsigned long long)dropped, LOGQ_BYTES >> 10);
			write_all(note, (size_t)k);
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
	if (!atomic_load_explicit(&lq_on, memory_order_acquire))
		return false;
	pthread_mutex_lock(&lq.mu);
	if (n > LOGQ_BYTES - lq.len) {
		lq.dropped++;
		atomic_fetch_add_explicit(&lq_dropped_total, 1, memory_order_relaxed);
	} else {
		size_t tail = (lq.head + lq.len) % LOGQ_BYTES;
		size_t first = LOGQ_BYTES - tail < n ? LOGQ_BYTES - tail : n;
		memcpy(lq.buf + tail, line, first);
		memcpy(lq.buf, line + first, n - first);
		lq.len += n;
	}
	pthread_cond_signal(&lq.cv);
	pthread_mutex_unlock(&lq.mu);
	return true;
}

int kvs_log_async_start(void)
{
	if (atomic_load(&lq_on))
		return 0;
	lq.buf = malloc(LOGQ_BYTES);
	if (!lq.buf)
		return -ENOMEM;
	lq.head = lq.len = 0;
	lq.dropped = 0;
	lq.stop = false;
	int r = pthread_create(&lq.thr, NULL, logq_main, NULL);
	if (r) {
		free(lq.buf);
		lq.buf = NULL;
		return -r;
	}
	atomic_store_explicit(&lq_on, true, memory_order_release);
	return 0;
}

bool kvs_log_async_stop(int wait_ms)
{
	if (!atomic_load(&lq_on))
		return true;
	pthread_mutex_lock(&lq.mu);
	lq.stop = true;
	pthread_cond_signal(&lq.cv);
	pthread_mutex_unlock(&lq.mu);
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += wait_ms / 1000;
	until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	if (pthread_timedjoin_np(lq.thr, NULL, &until) != 0)
		return false; /* stderr's reader is stuck: the rest stays unwritten (and the ring allocated) */
	atomic_store(&lq_on, false);
	free(lq.buf);
	lq.buf = NULL;
	return true;
}

uint64_t kvs_log_dropped(void) { return atomic_load_explicit(&lq_dropped_total, memory_order_relaxed); }

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

void kvs_log_write(int level, const char *comp, const char *fmt, ...)
{
	static const char lv[] = "EWID";
	static const char *names[] = {"error", "warn", "info", "debug"};
	char msg[900], line[2048], when[48];
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	/* ISO 8601, UTC, milliseconds */
	snprintf(when, sizeof(when), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", (tm.tm_year + 1900) % 10000,
		 (tm.tm_mon + 1) % 100, tm.tm_mday % 100, tm.tm_hour % 100, tm.tm_min % 100, tm.tm_sec % 100,
		 (int)(ts.tv_nsec / 1000000) % 1000);
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (m < 0)
		msg[0] = 0;
	size_t len;
	if (atomic_load_explicit(&log_format, memory_order_relaxed) == KVS_LOG_JSON) {
		len = (size_t)snprintf(line, sizeof(line), "{\"time\":\"%s\",\"level\":\"%s\",\"module\":\"", when,
				       names[level & 3]);
		len += json_escape(line + len, 64, comp);
		len += (size_t)snprintf(line + len, sizeof(line) - len, "\",\"message\":\"");
		len += json_escape(line + len, sizeof(line) - len - 96, msg);
		char id[32];
		if (find_id(msg, "session ", true, id, sizeof(id)))
			len += (size_t)snprintf(line + len, sizeof(line) - len, "\",\"session\":\"%s", id);
		if (find_id(msg, "job ", false, id, sizeof(id)))
			len += (size_t)snprintf(line + len, sizeof(line) - len, "\",\"job\":\"%s", id);
		len += (size_t)snprintf(line + len, sizeof(line) - len, "\"}");
	} else {
		len = (size_t)snprintf(line, sizeof(line), "%s %c %s: %s", when, lv[level & 3], comp, msg);
	}
	if (len > sizeof(line) - 2)
		len = sizeof(line) - 2;
	line[len++] = '\n';
	if (!logq_put(line, len)) {
		ssize_t w = write(STDERR_FILENO, line, len);
		(void)w;
	}
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
	char msg[800];
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (m < 0)
		msg[0] = 0;
	if (held)
		kvs_log_write(level, comp, "%s (%llu similar lines suppressed)", msg, (unsigned long long)held);
	else
		kvs_log_write(level, comp, "%s", msg);
}
