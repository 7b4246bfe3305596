/* GPU suite: stores after a CUDA producer event (issue 16 #10). The rank
 * (this process) holds 64 MiB of cuMem memory; its producer events are
 * recorded on streams held back by cuStreamWaitValue32 on a host word:
 *   - an event that fires 300 ms late: the store waits for it (the job is
 *     still open meanwhile), then commits, and a retrieve into other blocks
 *     is byte-exact;
 *   - an event that never fires: the job aborts by its deadline (3 s), its
 *     lease is released (unregister succeeds), nothing stays retained, the
 *     server keeps serving.
 * Exits 77 (skip) where the server finds no GPU, or the driver lacks
 * cuStreamWaitValue32. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_util.h"

#define SIZE (64ull << 20)
#define BB (64u << 10) /* block bytes */
#define NB (SIZE / BB)
#define BPC 4
#define NK 8 /* chunks per job */

static int job_state(kvs_client *sc, uint64_t job)
{
	int st = -1;
	kvs_job_wait(sc, job, 10000, &st);
	return st;
}

int main(void)
{
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "60000", "--job-deadline-ms", "3000", "--drain-ms", "2000", "--l1-size", "256M",
			NULL);
	if (kvt_server_start(&s) != 0) {
		fprintf(stderr, "server did not start\n");
		return 1;
	}
	kvs_client *sc = kvt_client(&s, "EV", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	const kvs_cuda_api *cu = kvs_cuda();
	if (!gpu_engine_ready(sc) || !cu->cuStreamWaitValue32) {
		printf("SKIP: no usable GPU in the server, or no cuStreamWaitValue32 here\n");
		kvs_client_close(sc);
		kvt_server_stop(&s);
		kvt_server_cleanup(&s);
		return 77;
	}
	gpu_one g;
	CHECK(gpu_one_register(&s, "EV", SIZE, BB, BPC, 13, &g) == 0, "register");
	uint8_t *now = malloc(SIZE), *orig = g.orig, *dev = g.dev;
	kvs_client *w = g.w;
	uint64_t handle = g.handle;
	if (!now || !orig || !dev || !w)
		return 1;

	/* 1: an event that fires late */
	gpu_held a = {0}, b = {0};
	CHECK(gpu_hold(&a) == 0 && gpu_hold(&b) == 0, "held streams");
	int st = -1;
	CHECK(gpu_one_part(&g, 1, true, 0, NK, BPC, &a.h, &st) == 0 && st == KVS_JOB_OPEN, "store after a pending event: %d", st);
	CHECK(kvs_complete(w, 1, true, 20000, &st) == 0, "complete");
	usleep(300000);
	kvs_job_info_out info = {0};
	uint64_t id1 = 1;
	uint32_t n = 0;
	CHECK(kvs_job_status(sc, &id1, 1, 5000, &info, 1, &n) == 0 && n == 1 && info.state == KVS_JOB_OPEN,
	      "the store waits for its event (state %d)", info.state);
	*a.word = 1; /* the producer's work ends: the event fires */
	CHECK(job_state(sc, 1) == KVS_JOB_COMMITTED, "store after the event not committed");
	CHECK(gpu_one_part(&g, 101, false, 512, NK, BPC, NULL, &st) == 0, "retrieve");
	CHECK(kvs_complete(w, 101, true, 20000, &st) == 0, "complete retrieve");
	CHECK(job_state(sc, 101) == KVS_JOB_COMMITTED, "retrieve not committed");
	cu->cuMemcpyDtoH(now, (CUdeviceptr)(uintptr_t)dev, SIZE);
	CHECK(memcmp(now + 512ull * BB, orig, (uint64_t)NK * BPC * BB) == 0, "retrieved bytes differ");
	CHECK(memcmp(now, orig, 512ull * BB) == 0, "source blocks changed");
	printf("late event: the store waited (open after 300 ms), committed once it fired; retrieve byte-exact\n");

	/* 2: an event that never fires */
	uint64_t t0 = kvt_now_ms();
	CHECK(gpu_one_part(&g, 2, true, 64, NK, BPC, &b.h, &st) == 0 && st == KVS_JOB_OPEN, "store after a never-firing event");
	CHECK(kvs_complete(w, 2, true, 20000, &st) == 0, "complete");
	int end = job_state(sc, 2);
	uint64_t took = kvt_now_ms() - t0;
	CHECK(end == KVS_JOB_ABORTED, "job 2 ended %d", end);
	CHECK(took < 3000 + 2000, "job 2 ended after %llu ms (deadline 3000)", (unsigned long long)took);
	CHECK(kvt_stat(sc, "retained_blocks") == 0, "retained blocks");
	CHECK(kvt_stat(sc, "jobs_open") == 0, "jobs open");
	CHECK(kvs_unregister(w, handle, 20000) == 0, "unregister after the aborted store (lease released)");
	CHECK(kvt_stat(sc, "registrations") == 0, "registrations");
	printf("never-firing event: job aborted after %llu ms (deadline 3000), lease released, unregister ok\n",
	       (unsigned long long)took);
	gpu_release(&a); /* fired already: its stream is done */
	gpu_release(&b); /* let the stream finish before teardown */
	CHECK(kvt_stat(sc, "requests") != UINT64_MAX, "server serving");
	gpu_one_free(&g);
	free(now);
	return gpu_finish(&s, sc);
}
