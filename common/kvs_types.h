/* Enumerations shared by the wire protocol and the public client API. */
#ifndef KVS_TYPES_H
#define KVS_TYPES_H

enum kvs_role { KVS_ROLE_SCHEDULER, KVS_ROLE_WORKER };
enum kvs_devtype { KVS_DEV_HOST, KVS_DEV_CUDA };
enum kvs_group_kind { KVS_GROUP_ATTENTION, KVS_GROUP_RECURRENT };
enum kvs_status { KVS_STATUS_OK, KVS_STATUS_FAILED };
enum kvs_job_state { KVS_JOB_OPEN, KVS_JOB_COMMITTED, KVS_JOB_ABORTED, KVS_JOB_UNKNOWN };
enum kvs_tier { KVS_TIER_L1, KVS_TIER_L2, KVS_TIER_L3 };
/* admin op commands (kvside-ctl) */
enum kvs_admin_cmd { KVS_ADMIN_STATUS, KVS_ADMIN_DRAIN, KVS_ADMIN_RESUME, KVS_ADMIN_CLEAR };

#endif
