/* GPU suite: CUDA copies that land past their job's deadline (issue 33,
 * protocol.md §9.7). The server's second start holds every part's stream
 * with a kernel spinning HOLD_MS (KVS_TEST_CUDA_HOLD_MS) before its copies,
 * under a job deadline of 600 ms:
 *   A retrieve: its reply and a terminal job_status come only once the held
 *     copies ended; blocks poisoned 1,000 ms in (past the deadline) hold the
 *     object afterwards (the copy did land late: the control), blocks
 *     poisoned right after the end and re-read 1 s later keep the poison;
 *   B a retrieve whose request times out on the client (300 ms) and whose
 *     session then closes (its registration goes with it): the job ends
 *     only after its copies, the poison written after the end stays, the
 *     server keeps serving without a copy error;
 *   C a store: the job aborts at its deadline but ends only after its held
 *     copies; nothing of it is committed, nothing stays retained.
 * The chunks retrieved were stored by a first start without the hook
 * (deadline 60 s) and kept in L2; the second start promotes them. A
 * producer event that never fires is test_gpu_event's. Exits 77 (skip)
 * where the server finds no GPU. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_util.h"

#define SIZE (64ull << 20)
#define BB (64u << 10) /* block bytes */
#define BPC 4
#define NK 8 /* chunks per job */
#define PART_BYTES ((uint64_t)NK * BPC * BB)
#define HOLD_MS 2000
#define DEADLINE_MS 600
#define SLACK_MS 150 /* the hold starts when the part is queued, after its promotion */

/* The first time job_status says job is no longer open; UINT64_MAX if it
 * stays open 10 s. *state gets the terminal state. */
static uint64_t ended_at(kvs_client *sc, uint64_t job, int *state)
{
	for (int i = 0; i < 2000; i++) {
		kvs_job_info_out info = {0};
		uint32_t n = 0;
		if (kvs_job_status(sc, &job, 1, 2000, &info, 1, &n) == 0 && n == 1 && info.state != KVS_JOB_OPEN) {
			*state = info.state;
			return kvt_now_ms();
		}
		usleep(5000);
	}
	return UINT64_MAX;
}

static int job_state(kvs_client *sc, uint64_t job)
{
	int st = -1;
	kvs_job_wait(sc, job, 20000, &st);
	return st;
}

/* Fills len bytes at dev with v (an engine writing blocks it owns again). */
static void poison(uint8_t *dev, uint64_t len, uint8_t v)
{
	kvs_cuda()->cuMemsetD8((CUdeviceptr)(uintptr_t)dev, v, len);
}

/* True if each of the len bytes at dev is v. */
static bool holds(const uint8_t *dev, uint64_t len, uint8_t v, uint8_t *tmp)
{
	kvs_cuda()->cuMemcpyDtoH(tmp, (CUdeviceptr)(uintptr_t)dev, len);
	for (uint64_t i = 0; i < len; i++)
		if (tmp[i] != v)
			return false;
	return true;
}

typedef struct reply {
	atomic_bool done;
	_Atomic uint64_t at;
	int code, state;
} reply;

static void on_reply(const kvs_result *res, void *arg)
{
	reply *r = arg;
	r->code = res->code;
	r->state = res->state;
	atomic_store(&r->at, kvt_now_ms());
	atomic_store(&r->done, true);
}

/* Start 1: chunks of jobs 1 and 2 stored, written behind to L2. */
static int store_first(kvt_server *s)
{
	if (kvt_server_start(s) != 0)
		return -1;
	kvs_client *sc = kvt_client(s, "LT", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	if (!gpu_engine_ready(sc)) {
		kvs_client_close(sc);
		return 77;
	}
	gpu_one g;
	CHECK(gpu_one_register(s, "LT", SIZE, BB, BPC, 11, &g) == 0, "register (start 1)");
	int st = -1;
	for (uint64_t job = 1; job <= 2; job++) {
		CHECK(gpu_one_part(&g, job, true, (int64_t)(job - 1) * NK * BPC, NK, BPC, NULL, &st) == 0, "store %llu",
		      (unsigned long long)job);
		CHECK(kvs_complete(g.w, job, true, 20000, &st) == 0, "complete %llu", (unsigned long long)job);
		CHECK(job_state(sc, job) == KVS_JOB_COMMITTED, "store %llu not committed", (unsigned long long)job);
	}
	for (int i = 0; i < 1000 && (kvt_stat(sc, "l2_writes_committed") < 2 * NK || kvt_stat(sc, "l2_queue_depth")); i++)
		usleep(10000);
	CHECK(kvt_stat(sc, "l2_writes_committed") >= 2 * NK, "write-behind did not catch up");
	gpu_one_free(&g);
	kvs_client_close(sc);
	CHECK(kvt_server_stop(s) == 0, "server exit (start 1)");
	return 0;
}

int main(void)
{
	kvt_server s;
	kvt_server_init(&s, "--ttl-ms", "60000", "--job-deadline-ms", "60000", "--drain-ms", "2000", "--l1-size", "256M",
			"--l2-size", "512M", NULL);
	snprintf(s.extra[s.n_extra++], sizeof(s.extra[0]), "--l2-path");
	snprintf(s.extra[s.n_extra++], sizeof(s.extra[0]), "%s/l2", s.dir);
	int rc = store_first(&s);
	if (rc == 77)
		printf("SKIP: no usable GPU in the server\n");
	if (rc) {
		kvt_server_cleanup(&s);
		return rc;
	}
	for (int i = 0; i + 1 < s.n_extra; i++)
		if (!strcmp(s.extra[i], "--job-deadline-ms"))
			snprintf(s.extra[i + 1], sizeof(s.extra[0]), "%d", DEADLINE_MS);
	char hold[16];
	snprintf(hold, sizeof(hold), "%d", HOLD_MS);
	setenv("KVS_TEST_CUDA_HOLD_MS", hold, 1);
	rc = kvt_server_start(&s);
	unsetenv("KVS_TEST_CUDA_HOLD_MS");
	if (rc != 0) {
		fprintf(stderr, "server did not start again\n");
		return 1;
	}
	kvs_client *sc = kvt_client(&s, "LT", KVS_ROLE_SCHEDULER, 0, 1, NULL, NULL);
	CHECK(gpu_engine_ready(sc), "no CUDA engine on start 2");
	gpu_one g;
	CHECK(gpu_one_register(&s, "LT", SIZE, BB, BPC, 11, &g) == 0, "register (start 2)");
	uint8_t *tmp = malloc(PART_BYTES);
	if (!tmp || !g.w || !g.dev)
		return 1;

	/* A: a retrieve past its deadline */
	uint8_t keys[NK * 32];
	int64_t ids[NK * BPC];
	gpu_one_fill(101, false, 512, NK, BPC, keys, ids);
	const int64_t *l[1] = {ids};
	uint32_t len[1] = {NK * BPC};
	kvs_blocks bl = {.n_groups = 1, .ids = l, .len = len};
	uint8_t *dst = g.dev + 512ull * BB;
	poison(dst, PART_BYTES, 0x11);
	reply r = {0};
	uint64_t t0 = kvt_now_ms();
	CHECK(kvs_retrieve_async(g.w, 101, keys, NK, &bl, 0, 20000, on_reply, &r) == 0, "retrieve A queued");
	usleep(1000 * 1000);
	kvs_job_info_out info = {0};
	uint64_t id = 101;
	uint32_t n = 0;
	CHECK(kvs_job_status(sc, &id, 1, 2000, &info, 1, &n) == 0 && n == 1 && info.state == KVS_JOB_OPEN,
	      "A: open (aborting) while its copies are held: state %d", info.state);
	CHECK(!atomic_load(&r.done), "A: answered %llu ms in, before its held copies ended",
	      (unsigned long long)(atomic_load(&r.at) - t0));
	poison(dst, PART_BYTES, 0xee); /* an engine that took the blocks back at its own time-out */
	int state = -1;
	uint64_t end = ended_at(sc, 101, &state);
	for (int i = 0; i < 1000 && !atomic_load(&r.done); i++)
		usleep(10000);
	uint64_t reply_ms = atomic_load(&r.at) - t0, end_ms = end - t0;
	CHECK(atomic_load(&r.done) && reply_ms >= HOLD_MS - SLACK_MS, "A: reply after %llu ms (hold %d)",
	      (unsigned long long)reply_ms, HOLD_MS);
	CHECK(r.code == 0 && r.state == KVS_JOB_ABORTED, "A: reply %d state %d, not aborted", r.code, r.state);
	CHECK(end != UINT64_MAX && end_ms >= HOLD_MS - SLACK_MS && state == KVS_JOB_ABORTED,
	      "A: job_status terminal (%d) after %llu ms (hold %d)", state, (unsigned long long)end_ms, HOLD_MS);
	kvs_cuda()->cuMemcpyDtoH(tmp, (CUdeviceptr)(uintptr_t)dst, PART_BYTES);
	CHECK(memcmp(tmp, g.orig, PART_BYTES) == 0, "A control: the held copy did not overwrite the poison of 1,000 ms");
	poison(dst, PART_BYTES, 0xdd);
	usleep(1000 * 1000);
	CHECK(holds(dst, PART_BYTES, 0xdd, tmp), "A: blocks written after the job's end");
	printf("A retrieve: deadline %d ms, copies held %d ms: open at 1000 ms, reply after %llu ms, terminal "
	       "job_status after %llu ms; the late copy overwrote the poison of 1000 ms (control), the poison "
	       "after the end stayed 1 s\n",
	       DEADLINE_MS, HOLD_MS, (unsigned long long)reply_ms, (unsigned long long)end_ms);

	/* B: the client gives up at 300 ms, then its session closes */
	dst = g.dev + 576ull * BB;
	poison(dst, PART_BYTES, 0x22);
	gpu_one_fill(102, false, 576, NK, BPC, keys, ids);
	t0 = kvt_now_ms();
	int brc = kvs_retrieve(g.w, 102, keys, NK, &bl, 0, 300, &state);
	CHECK(brc == KVS_E_TIMEOUT, "B: the client's time-out: %d", brc);
	kvs_client_close(g.w); /* bye: the session and its registration end */
	g.w = NULL;
	end = ended_at(sc, 102, &state);
	end_ms = end - t0;
	CHECK(end != UINT64_MAX && end_ms >= HOLD_MS - SLACK_MS && state == KVS_JOB_ABORTED,
	      "B: job_status terminal (%d) after %llu ms (hold %d)", state, (unsigned long long)end_ms, HOLD_MS);
	kvs_cuda()->cuMemcpyDtoH(tmp, (CUdeviceptr)(uintptr_t)dst, PART_BYTES);
	CHECK(memcmp(tmp, g.orig + PART_BYTES, PART_BYTES) == 0, "B control: the held copy did not land");
	poison(dst, PART_BYTES, 0xcc);
	usleep(1000 * 1000);
	CHECK(holds(dst, PART_BYTES, 0xcc, tmp), "B: blocks written after the job's end");
	for (int i = 0; i < 500 && kvt_stat(sc, "registrations"); i++)
		usleep(10000);
	CHECK(kvt_stat(sc, "registrations") == 0, "B: the closed session's registration stayed");
	printf("B retrieve: client time-out at 300 ms, session closed: terminal job_status after %llu ms, the "
	       "poison after the end stayed 1 s\n", (unsigned long long)end_ms);

	/* C: a store past its deadline (a new session and memory) */
	gpu_one g2;
	CHECK(gpu_one_register(&s, "LT", SIZE, BB, BPC, 12, &g2) == 0, "register C");
	t0 = kvt_now_ms();
	CHECK(gpu_one_part(&g2, 3, true, 0, NK, BPC, NULL, &state) == 0, "store C");
	kvs_complete(g2.w, 3, true, 20000, &state);
	end = ended_at(sc, 3, &state);
	end_ms = end - t0;
	CHECK(end != UINT64_MAX && end_ms >= HOLD_MS - SLACK_MS && state == KVS_JOB_ABORTED,
	      "C: job_status terminal (%d) after %llu ms (hold %d)", state, (unsigned long long)end_ms, HOLD_MS);
	gpu_one_fill(3, true, 0, NK, BPC, keys, ids);
	uint64_t hits = 99;
	CHECK(kvs_lookup(sc, keys, NK, false, 0, 5000, &hits, NULL) == 0 && hits == 0, "C: %llu chunks hit",
	      (unsigned long long)hits);
	CHECK(kvt_stat(sc, "retained_blocks") == 0, "C: blocks retained");
	CHECK(kvt_stat(sc, "jobs_open") == 0, "jobs open");
	CHECK(kvt_stat(sc, "cuda_errors") == 0, "copy errors");
	printf("C store: aborted at its deadline, terminal after %llu ms, nothing committed or retained\n",
	       (unsigned long long)end_ms);
	gpu_one_free(&g2);
	gpu_one_free(&g);
	free(tmp);
	return gpu_finish(&s, sc);
}
