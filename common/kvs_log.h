/* Logging: one line per event to stderr, with the UTC date and time (ISO
 * 8601, milliseconds), level and component; or, in the JSON format, one
 * object per line: time, level, module, message, and the session and job ids
 * the message names. Thread-safe (one write(2) per line). */
#ifndef KVS_LOG_H
#define KVS_LOG_H

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

#define kvs_log(level, ...)                                                  \
	do {                                                                 \
		if ((level) <= kvs_log_get_level())                          \
			kvs_log_write((level), KVS_LOG_COMPONENT, __VA_ARGS__); \
	} while (0)
#define kvs_err(...) kvs_log(KVS_LOG_ERROR, __VA_ARGS__)
#define kvs_warn(...) kvs_log(KVS_LOG_WARN, __VA_ARGS__)
#define kvs_info(...) kvs_log(KVS_LOG_INFO, __VA_ARGS__)
#define kvs_dbg(...) kvs_log(KVS_LOG_DEBUG, __VA_ARGS__)

#endif
