/* Counting a process's mappings of a memfd, by name, in /proc/self/maps:
 * how unit tests see that the server mapped or unmapped engine memory. */
#ifndef KVS_TEST_MEMFD_MAPS_H
#define KVS_TEST_MEMFD_MAPS_H

#include <check.h>
#include <stdio.h>
#include <string.h>

/* Mappings of the memfd called name in this process. */
static inline int memfd_maps(const char *name)
{
	char needle[96], line[512];
	snprintf(needle, sizeof(needle), "/memfd:%s ", name);
	FILE *mf = fopen("/proc/self/maps", "r");
	ck_assert_ptr_nonnull(mf);
	int n = 0;
	while (fgets(line, sizeof(line), mf))
		n += strstr(line, needle) != NULL;
	fclose(mf);
	return n;
}

#endif
