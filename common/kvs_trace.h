/* Timeline trace points for profiling one job's path across processes
 * (issue 18: where a lone job's time goes). Off unless the environment names
 * a directory in KVS_TRACE: then each process that records appends fixed-size
 * records {ns, point, thread, arg} to a file <dir>/trace.<pid>, memory-mapped
 * (records survive _exit and kills; nothing is flushed). CLOCK_MONOTONIC is
 * shared by every process of the machine, so the files of a server and its
 * clients merge into one timeline (tools/kvs-trace-report). Off, a point
 * costs one predictable branch. The file holds at most KVS_TRACE_MAX records;
 * later ones are dropped. */
#ifndef KVS_TRACE_H
#define KVS_TRACE_H
#include <stdint.h>

enum kvs_trace_point {
	/* client (libkvside) */
	KVS_TP_APP_SUBMIT = 1, /* a request queued by an application thread; arg: op */
	KVS_TP_IO_SEND,        /* the I/O thread sent it; arg: op */
	KVS_TP_IO_RECV,        /* the I/O thread received a reply or push; arg: op of the request, 0 push */
	KVS_TP_IO_JOB_DONE,    /* job_done handed to waiters */
	KVS_TP_APP_JOB_DONE,   /* kvs_job_wait returned */
	/* server */
	KVS_TP_SRV_WAKE = 32,  /* zmq_poll returned with something ready */
	KVS_TP_SRV_DISPATCH,   /* a request decoded and about to run; arg: op */
	KVS_TP_SRV_SUBMIT,     /* a copy part handed to its engine */
	KVS_TP_SRV_QUEUED,     /* the engine queued it (driver calls done) */
	KVS_TP_SRV_GPU_DONE,   /* the part's completion seen (host function or poll) */
	KVS_TP_SRV_PART_DONE,  /* the loop ran the part's completion */
	KVS_TP_SRV_COMMIT,     /* a job committed */
	KVS_TP_SRV_SENT,       /* job_done sent */
};

extern int kvs_trace_on; /* 1 when KVS_TRACE named a usable directory */
void kvs_trace_rec(int point, uint32_t arg);
#define KVS_TRACE(pt, arg)                                                                                            \
	do {                                                                                                          \
		if (__builtin_expect(kvs_trace_on, 0))                                                                \
			kvs_trace_rec((pt), (uint32_t)(arg));                                                         \
	} while (0)
#endif
