/* Jobs: per-rank store/retrieve parts, completion, commit/abort, source-block
 * retention and the bounded table of terminal ids. Planning is plan.c's,
 * promotions promote.c's, lookup lookup.c's. Main-loop thread only. */
#ifndef KVS_JOBS_H
#define KVS_JOBS_H

#include <stdbool.h>
#include <stdint.h>

#include "server.h"

typedef struct kvs_jobs kvs_jobs;

int kvs_jobs_create(kvs_server *srv, kvs_jobs **ret);
/* Aborts every open job, waits for its copies, frees everything. */
void kvs_jobs_destroy(kvs_server *srv, kvs_jobs *j);

void kvs_jobs_tick(kvs_server *srv);
void kvs_jobs_session_gone(kvs_server *srv, kvs_session *s);
uint64_t kvs_jobs_pending(kvs_server *srv, kvs_session *s);

int kvs__op_store(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_retrieve(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_complete(kvs_server *srv, kvs_session *s, const kvs_msg *rq);
int kvs__op_job_status(kvs_server *srv, kvs_session *s, const kvs_msg *rq);

uint64_t kvs_jobs_open(const kvs_jobs *j);
/* Is job id of this engine open, or remembered as terminal? (A draining
 * server still serves the parts of jobs already started, and repeats.) */
bool kvs_jobs_known(const kvs_jobs *j, const char *engine, uint64_t id);
uint64_t kvs_jobs_retained(const kvs_jobs *j);

typedef struct kvs_jobs_stats {
	uint64_t committed, aborted, terminal_entries;
	uint64_t store_objects, store_skipped, store_staged, retrieve_objects, copy_bytes;
	uint64_t copy_bytes_dir[2][2]; /* [0 store (device->L1) / 1 retrieve][0 host / 1 cuda] */
	uint64_t parts, part_ns; /* store/retrieve parts accepted; loop time doing so */
	uint64_t writes_shed;    /* pending L2 writes dropped to make room for a store */
	uint64_t copy_waves;     /* waves of long parts given to an engine while the rest was planned */
} kvs_jobs_stats;
void kvs_jobs_get_stats(const kvs_jobs *j, kvs_jobs_stats *st);

#endif
