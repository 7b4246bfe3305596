/* The memory this server may use (memroom.h). */
#include "memroom.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB(x) ((unsigned long long)((x) >> 20))

/* The first unsigned number in file PATH (v2's "max" or a missing file:
 * UINT64_MAX; v1 reports "no limit" as a number near 2^63). */
static uint64_t read_u64(const char *path)
{
	FILE *f = fopen(path, "re");
	if (!f)
		return UINT64_MAX;
	char buf[64] = "";
	char *ok = fgets(buf, sizeof(buf), f);
	fclose(f);
	if (!ok || strncmp(buf, "max", 3) == 0)
		return UINT64_MAX;
	char *end;
	unsigned long long v = strtoull(buf, &end, 10);
	if (end == buf || v >= (1ull << 62))
		return UINT64_MAX;
	return v;
}

/* The page cache charged to a cgroup (reclaimable: the kernel drops it
 * before it kills), from its memory.stat: v2's "file", v1's
 * "total_cache"; 0 when unknown. */
static uint64_t file_cache(const char *dir, const char *key)
{
	char path[1100], line[128];
	snprintf(path, sizeof(path), "%s/memory.stat", dir);
	FILE *f = fopen(path, "re");
	if (!f)
		return 0;
	size_t kl = strlen(key);
	unsigned long long v = 0;
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, key, kl) == 0 && line[kl] == ' ' && sscanf(line + kl + 1, "%llu", &v) == 1)
			break;
	fclose(f);
	return v;
}

static uint64_t mem_available(void)
{
	const char *path = getenv("KVS_TEST_MEMINFO");
	FILE *f = fopen(path ? path : "/proc/meminfo", "re");
	if (!f)
		return UINT64_MAX;
	char line[128];
	uint64_t kb = UINT64_MAX;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "MemAvailable: %llu kB", (unsigned long long *)&kb) == 1)
			break;
	fclose(f);
	return kb == UINT64_MAX ? kb : kb * 1024;
}

/* The least room left under the limits of DIR and of every directory above
 * it up to ROOT; LIMIT_FILE and USAGE_FILE are the version's names. */
static uint64_t cgroup_room(const char *root, const char *rel, const char *limit_file, const char *usage_file,
			    const char *cache_key, char *where, size_t cap)
{
	char dir[1024];
	snprintf(dir, sizeof(dir), "%s%s", root, rel);
	/* a path that is not there (a cgroup namespace whose root is the
	 * mount's root) is read at the mount's root */
	char probe[1100];
	snprintf(probe, sizeof(probe), "%s/%s", dir, limit_file);
	FILE *f = fopen(probe, "re");
	if (f)
		fclose(f);
	else
		snprintf(dir, sizeof(dir), "%s", root);
	uint64_t best = UINT64_MAX;
	size_t rootlen = strlen(root);
	for (;;) {
		char lp[1100], up[1100];
		snprintf(lp, sizeof(lp), "%s/%s", dir, limit_file);
		snprintf(up, sizeof(up), "%s/%s", dir, usage_file);
		uint64_t lim = read_u64(lp);
		if (lim != UINT64_MAX) {
			uint64_t use = read_u64(up);
			if (use == UINT64_MAX)
				use = 0;
			/* a restart finds the last run's page cache (L2) still
			 * charged here: not in use, it is reclaimed before a kill */
			uint64_t cache = file_cache(dir, cache_key);
			use = use > cache ? use - cache : 0;
			uint64_t room = lim > use ? lim - use : 0;
			if (room < best) {
				best = room;
				snprintf(where, cap, "memory cgroup %s: limit %llu MiB, %llu MiB in use besides page cache", dir,
					 MIB(lim), MIB(use));
			}
		}
		char *slash = strrchr(dir, '/');
		if (strlen(dir) <= rootlen || !slash || (size_t)(slash - dir) < rootlen)
			break;
		*slash = 0;
	}
	return best;
}

/* This process's cgroup paths from /proc/self/cgroup: the v2 one ("0::")
 * and the v1 memory controller's ("N:...memory...:"); "" for the root. */
static void own_cgroups(char *v2, char *v1, size_t cap)
{
	v2[0] = v1[0] = 0;
	FILE *f = fopen("/proc/self/cgroup", "re");
	char line[1024];
	while (f && fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = 0;
		char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
		if (!b)
			continue;
		*b = 0; /* a + 1: the controllers, b + 1: the path */
		const char *path = strcmp(b + 1, "/") ? b + 1 : "";
		if (a[1] == 0)
			snprintf(v2, cap, "%s", path);
		for (char *c = strtok(a + 1, ","); c; c = strtok(NULL, ","))
			if (strcmp(c, "memory") == 0)
				snprintf(v1, cap, "%s", path);
	}
	if (f)
		fclose(f);
}

uint64_t kvs_memroom(char *where, size_t cap)
{
	uint64_t best = mem_available();
	snprintf(where, cap, best == UINT64_MAX ? "nothing known" : "MemAvailable %llu MiB", MIB(best));
	/* under the test hook the root given is the process's own cgroup */
	const char *root = getenv("KVS_TEST_CGROUP_ROOT");
	char v2[512] = "", v1[512] = "";
	if (!root) {
		root = "/sys/fs/cgroup";
		own_cgroups(v2, v1, sizeof(v2));
	}
	char w[1300], v1root[600];
	uint64_t r = cgroup_room(root, v2, "memory.max", "memory.current", "file", w, sizeof(w));
	if (r < best)
		best = r, snprintf(where, cap, "%s", w);
	snprintf(v1root, sizeof(v1root), "%s/memory", root);
	r = cgroup_room(v1root, v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache", w, sizeof(w));
	if (r < best)
		best = r, snprintf(where, cap, "%s", w);
	return best;
}
