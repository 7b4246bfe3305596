/* Logging sink shared by the server, the client library and the tools. */
#include "kvs_log.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
	ssize_t w = write(STDERR_FILENO, line, len);
	(void)w;
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
