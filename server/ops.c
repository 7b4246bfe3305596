/* Data-path op handlers and stats. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVS_LOG_COMPONENT "ops"
#include "kvs_log.h"
#include "ops.h"

int kvs__ops_init(kvs_server *srv) { return 0; }
void kvs__ops_fini(kvs_server *srv) {}
void kvs__ops_tick(kvs_server *srv) {}
void kvs__ops_completions(kvs_server *srv) {}
void kvs__ops_session_gone(kvs_server *srv, kvs_session *s) {}
uint64_t kvs__ops_pending_jobs(kvs_server *srv, kvs_session *s) { return 0; }

#define NOT_YET(fn, name)                                                                  \
	int fn(kvs_server *srv, kvs_session *s, const kvs_msg *rq)                         \
	{                                                                                  \
		return kvs__fail(srv, KVS_E_UNKNOWN_OP, "op '" name "' is not served yet"); \
	}
NOT_YET(kvs__op_register, "register")
NOT_YET(kvs__op_unregister, "unregister")
NOT_YET(kvs__op_lookup, "lookup")
NOT_YET(kvs__op_store, "store")
NOT_YET(kvs__op_retrieve, "retrieve")
NOT_YET(kvs__op_complete, "complete")
NOT_YET(kvs__op_job_status, "job_status")

int kvs__op_stats(kvs_server *srv, kvs_session *s, const kvs_msg *rq)
{
	enum { NE = KVS_E_LAST_ - KVS_E_BASE + 1 };
	kvs_counter c[64 + NE];
	char names[NE][32];
	uint32_t n = 0;
#define C(nm, val) c[n++] = (kvs_counter){kvs_str_c(nm), (uint64_t)(val)}
	C("sessions", kvs_htab_count(srv->sessions));
	C("sessions_opened", srv->st.sessions_opened);
	C("sessions_reaped", srv->st.sessions_reaped);
	C("requests", srv->st.requests);
	C("broker_accepted", srv->st.broker_accepted);
	C("broker_rejected", srv->st.broker_rejected);
	C("broker_parked", srv->st.broker_parked);
	C("broker_expired", srv->st.broker_expired);
	C("parked_fds", kvs_htab_count(srv->parked));
	C("registrations", 0);
	C("imports", 0);
	C("aliases", 0);
	C("retained_blocks", 0);
	C("jobs_open", 0);
	for (int i = 0; i < NE; i++) {
		snprintf(names[i], sizeof(names[i]), "errors.%s", kvs_error_name(KVS_E_BASE + i));
		C(names[i], srv->st.errors[i]);
	}
#undef C
	kvs_msg rep = {.op = KVS_OP_STATS, .id = rq->id, .ok = true, .counters = c, .n_counters = n};
	if (s)
		kvs__reply(srv, s->ident, s->ident_len, &rep);
	else
		return kvs__fail(srv, KVS_E_INTERNAL, "no reply target");
	return 0;
}
