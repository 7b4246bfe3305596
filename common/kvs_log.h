/* Logging: one line per event to stderr, with the UTC date and time (ISO
 * 8601, milliseconds), level and component; or, in the JSON format, one
 * object per line: time, level, module, message, and the session and job ids
 * the message names. Thread-safe (one write(2) per line, or one queued line
 * with the asynchronous sink). */
#ifndef KVS_LOG_H
#define KVS_LOG_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kvs_log_level { KVS_LOG_ERROR, KVS_LOG_WARN, KVS_LOG_INFO, KVS_LOG_DEBUG };
enum kvs_log_format { KVS_LOG_TEXT, KVS_LOG_JSON };

void kvs_log_set_format(int format);
/* Parses "text", "json"; returns -1 if unknown. */
int kvs_log_format_parse(const char *s);

void kvs_log_set_level(int level);
int kvs_log_get_level(void);
/* Parses "error", "warn", "info", "debug"; returns -1 if unknown. */
int kvs_log_level_parse(const char *s);
void kvs_log_write(int level, const char *comp, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* The asynchronous sink (the server's): from the call on, lines go into a
 * ring of `bytes` (at least two lines' worth) that one thread writes to
 * stderr, so a stalled reader of stderr never blocks a thread that logs; a
 * line that finds the ring full is dropped, counted (kvs_log_dropped) and
 * reported, in the log's format, once the reader catches up. 0, or -errno
 * (the sink stays synchronous). Start it with the signals the process
 * handles blocked: the thread inherits the mask. */
int kvs_log_async_start(size_t bytes);
#define KVS_LOG_QUEUE_BYTES (1u << 20) /* the server's */
/* Writes what is queued and stops the thread, waiting at most wait_ms for a
 * stalled reader; false if it gave up (the lines still queued are lost and
 * counted). Lines logged from then on are written directly. */
bool kvs_log_async_stop(int wait_ms);
/* Lines the asynchronous sink dropped since the process started. */
uint64_t kvs_log_dropped(void);
/* A fatal signal's handler: writes the lines still queued (async-signal-safe,
 * best effort: a line may be written twice or torn; at most 1 s with a
 * stalled reader), then takes the signal's default action (a core, the exit
 * status). kvs_log_crash_handlers installs it for SIGSEGV, SIGBUS, SIGABRT,
 * SIGFPE and SIGILL, leaving a handler already there (a sanitizer's); a
 * handler of its own calls it for what it does not handle (copy_host.c). */
void kvs_log_fatal(int sig);
void kvs_log_crash_handlers(void);

#define kvs_log(level, ...)                                                  \
	do {                                                                 \
		if ((level) <= kvs_log_get_level())                          \
			kvs_log_write((level), KVS_LOG_COMPONENT, __VA_ARGS__); \
	} while (0)
#define kvs_err(...) kvs_log(KVS_LOG_ERROR, __VA_ARGS__)
#define kvs_warn(...) kvs_log(KVS_LOG_WARN, __VA_ARGS__)
#define kvs_info(...) kvs_log(KVS_LOG_INFO, __VA_ARGS__)
#define kvs_dbg(...) kvs_log(KVS_LOG_DEBUG, __VA_ARGS__)

/* Rate limit for one cause of a repeated line (a failing disk must not
 * write thousands of lines a second): at most one line per interval_ms; the
 * lines held back meanwhile are counted and the next line that passes says
 * how many. Thread-safe (atomics); zero-initialised except interval_ms.
 * One kvs_ratelimit per cause, e.g. a field of the object that logs. */
typedef struct kvs_ratelimit {
	int64_t interval_ms;
	_Atomic int64_t next_ms;       /* CLOCK_MONOTONIC ms before which lines are held back */
	_Atomic uint64_t suppressed;   /* lines held back since the last one written */
} kvs_ratelimit;
#define KVS_RATELIMIT_MS 5000 /* the default interval: one line per cause per 5 s */

/* true if a line may be written now; then *ret_suppressed is the number of
 * lines held back since the previous one (and the count restarts). */
bool kvs_ratelimit_pass(kvs_ratelimit *rl, uint64_t *ret_suppressed);
/* kvs_log_write through a rate limit: a line that passes and follows held-back
 * ones ends with " (N similar lines suppressed)". Lines below the log level are
 * neither written nor counted. */
void kvs_log_limited(kvs_ratelimit *rl, int level, const char *comp, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
#define kvs_err_rl(rl, ...) kvs_log_limited((rl), KVS_LOG_ERROR, KVS_LOG_COMPONENT, __VA_ARGS__)
#define kvs_warn_rl(rl, ...) kvs_log_limited((rl), KVS_LOG_WARN, KVS_LOG_COMPONENT, __VA_ARGS__)

#endif
