/* Monotonic time in milliseconds and nanoseconds. */
#ifndef KVS_TIME_H
#define KVS_TIME_H
#include <stdint.h>
#include <time.h>

static inline uint64_t kvs_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static inline uint64_t kvs_now_ms(void) { return kvs_now_ns() / 1000000ull; }
#endif
