/* Logging sink shared by the server, the client library and the tools. */
#include "kvs_log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int log_level = KVS_LOG_WARN;

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

void kvs_log_write(int level, const char *comp, const char *fmt, ...)
{
	static const char lv[] = "EWID";
	char line[1024];
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	int n = snprintf(line, sizeof(line), "%02d:%02d:%02d.%03ld %c %s: ", tm.tm_hour, tm.tm_min,
			 tm.tm_sec, ts.tv_nsec / 1000000, lv[level & 3], comp);
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
	if (len > sizeof(line) - 2)
		len = sizeof(line) - 2;
	line[len++] = '\n';
	ssize_t w = write(STDERR_FILENO, line, len);
	(void)w;
}
