/* kvside-server: command line, signals, and the main loop. */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <unistd.h>

#define KVS_LOG_COMPONENT "main"
#include "kvs_config.h"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "server.h"

static void usage(FILE *f, const kvs_server_config *d)
{
	fprintf(f,
		"Usage: kvside-server [options]\n"
		"KV-cache sidecar for tensor-parallel inference engines.\n\n"
		"  --listen ENDPOINT        ZeroMQ endpoint to bind (default ipc://BROKER_DIR/kvside.zmq)\n"
		"  --broker-dir DIR         private run directory for the fd broker (default %s)\n"
		"  --l1-size BYTES          DRAM tier size, suffixes K M G (default %llu MiB)\n"
		"  --ttl-ms MS              session lease (default %llu)\n"
		"  --heartbeat-ms MS        heartbeat period advised to clients (default %llu)\n"
		"  --job-deadline-ms MS     jobs abort after this long (default %llu)\n"
		"  --fd-park-ms MS          unclaimed broker fds close after this long (default %llu)\n"
		"  --drain-ms MS            unregister waits this long for leases (default %llu)\n"
		"  --copy-threads N         host copy threads (default %u)\n"
		"  --terminal-jobs N        terminal job ids remembered to answer repeats (default 65536)\n"
		"  --no-prefault            do not fault the L1 arena in at start-up\n"
		"  --allow-uid UID          also accept broker peers with this UID\n"
		"  --l2-path DIR            LMDB directory of the persistent L2 tier (default: none)\n"
		"  --l2-size BYTES          L2 capacity (LMDB map size), suffixes K M G (default %llu GiB)\n"
		"  --l2-sync MODE           full (default): fsync every group commit; nometa: power loss\n"
		"                           may lose the last commit; none: process crashes lose nothing\n"
		"                           committed, power loss may lose recent commits\n"
		"  --log-level LEVEL        error, warn, info, debug (default info)\n"
		"  --help                   show this text\n"
		"  --version                show the version\n",
		d->broker_dir, (unsigned long long)(d->l1_size >> 20), (unsigned long long)d->ttl_ms,
		(unsigned long long)d->heartbeat_ms, (unsigned long long)d->job_deadline_ms,
		(unsigned long long)d->fd_park_ms, (unsigned long long)d->drain_ms, d->copy_threads,
		(unsigned long long)(d->l2_size >> 30));
}

static int parse_u64(const char *s, uint64_t *out, bool sizes)
{
	char *end;
	errno = 0;
	if (!*s || *s == '-')
		return -1;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno)
		return -1;
	unsigned shift = 0;
	if (sizes && *end) {
		switch (*end) {
		case 'k': case 'K': shift = 10; break;
		case 'm': case 'M': shift = 20; break;
		case 'g': case 'G': shift = 30; break;
		default: return -1;
		}
		end++;
		if (*end == 'i' || *end == 'B')
			end += (*end == 'i' && end[1] == 'B') ? 2 : 1;
	}
	if (*end || (shift && v > (UINT64_MAX >> shift)))
		return -1;
	*out = (uint64_t)v << shift;
	return 0;
}

int main(int argc, char **argv)
{
	kvs_server_config cfg;
	kvs_server_config_defaults(&cfg);
	enum { O_LISTEN = 1, O_BROKER, O_L1, O_TTL, O_HB, O_DEADLINE, O_PARK, O_DRAIN, O_THREADS,
	       O_UID, O_LOG, O_HELP, O_VERSION, O_L2PATH, O_L2SIZE, O_L2SYNC, O_TERMINAL, O_NOPREFAULT };
	static const struct option opts[] = {
		{"listen", required_argument, NULL, O_LISTEN},
		{"broker-dir", required_argument, NULL, O_BROKER},
		{"l1-size", required_argument, NULL, O_L1},
		{"ttl-ms", required_argument, NULL, O_TTL},
		{"heartbeat-ms", required_argument, NULL, O_HB},
		{"job-deadline-ms", required_argument, NULL, O_DEADLINE},
		{"fd-park-ms", required_argument, NULL, O_PARK},
		{"drain-ms", required_argument, NULL, O_DRAIN},
		{"copy-threads", required_argument, NULL, O_THREADS},
		{"allow-uid", required_argument, NULL, O_UID},
		{"log-level", required_argument, NULL, O_LOG},
		{"help", no_argument, NULL, O_HELP},
		{"version", no_argument, NULL, O_VERSION},
		{"l2-path", required_argument, NULL, O_L2PATH},
		{"l2-size", required_argument, NULL, O_L2SIZE},
		{"l2-sync", required_argument, NULL, O_L2SYNC},
		{"terminal-jobs", required_argument, NULL, O_TERMINAL},
		{"no-prefault", no_argument, NULL, O_NOPREFAULT},
		{NULL, 0, NULL, 0},
	};
	int c;
	uint64_t v;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		const char *name = c > 0 && c <= O_NOPREFAULT ? opts[c - 1].name : "?";
		switch (c) {
		case O_LISTEN:
			if (strlen(optarg) >= sizeof(cfg.listen))
				goto bad;
			strcpy(cfg.listen, optarg);
			break;
		case O_BROKER:
			if (strlen(optarg) >= sizeof(cfg.broker_dir) - 16 || !*optarg)
				goto bad;
			strcpy(cfg.broker_dir, optarg);
			break;
		case O_L1:
			if (parse_u64(optarg, &cfg.l1_size, true) || cfg.l1_size < (1u << 20))
				goto bad;
			break;
		case O_TTL: case O_HB: case O_DEADLINE: case O_PARK: case O_DRAIN: case O_THREADS:
			if (parse_u64(optarg, &v, false) || v == 0 || v > 86400000)
				goto bad;
			if (c == O_TTL) cfg.ttl_ms = v;
			else if (c == O_HB) cfg.heartbeat_ms = v;
			else if (c == O_DEADLINE) cfg.job_deadline_ms = v;
			else if (c == O_PARK) cfg.fd_park_ms = v;
			else if (c == O_DRAIN) cfg.drain_ms = v;
			else if (v > 64) goto bad;
			else cfg.copy_threads = (uint32_t)v;
			break;
		case O_UID:
			if (parse_u64(optarg, &v, false) || v > 0x7fffffff)
				goto bad;
			cfg.allow_uid = (long)v;
			break;
		case O_LOG:
			if ((cfg.log_level = kvs_log_level_parse(optarg)) < 0)
				goto bad;
			break;
		case O_NOPREFAULT:
			cfg.l1_prefault = false;
			break;
		case O_TERMINAL:
			if (parse_u64(optarg, &v, false) || v == 0 || v > (1u << 24))
				goto bad;
			cfg.terminal_jobs = (uint32_t)v;
			break;
		case O_L2PATH:
			if (strlen(optarg) >= sizeof(cfg.l2_path) || !*optarg)
				goto bad;
			strcpy(cfg.l2_path, optarg);
			break;
		case O_L2SIZE:
			if (parse_u64(optarg, &cfg.l2_size, true) || cfg.l2_size < (4u << 20))
				goto bad;
			break;
		case O_L2SYNC:
			if (strcmp(optarg, "full") == 0)
				cfg.l2_sync = KVS_L2_SYNC_FULL;
			else if (strcmp(optarg, "nometa") == 0)
				cfg.l2_sync = KVS_L2_SYNC_NOMETA;
			else if (strcmp(optarg, "none") == 0)
				cfg.l2_sync = KVS_L2_SYNC_NONE;
			else
				goto bad;
			break;
		case O_HELP:
			usage(stdout, &cfg);
			return 0;
		case O_VERSION:
			printf("kvside-server %s (protocol v%d)\n", KVS_VERSION, KVS_PROTO_VERSION);
			return 0;
		default:
			usage(stderr, &cfg);
			return 2;
		}
		continue;
	bad:
		fprintf(stderr, "kvside-server: invalid value '%s' for --%s\n", optarg, name);
		return 2;
	}
	if (optind < argc) {
		fprintf(stderr, "kvside-server: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (cfg.heartbeat_ms >= cfg.ttl_ms) {
		fprintf(stderr, "kvside-server: --heartbeat-ms must be below --ttl-ms\n");
		return 2;
	}
	kvs_log_set_level(cfg.log_level);
	/* every import holds an fd and every client a socket: raise the soft
	 * limit to the hard one (libzmq aborts when it runs out of fds) */
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}

	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	/* blocked before any thread starts, so only the signalfd sees them */
	pthread_sigmask(SIG_BLOCK, &set, NULL);
	signal(SIGPIPE, SIG_IGN);
	int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
	if (sfd < 0) {
		perror("signalfd");
		return 1;
	}
	kvs_server *srv;
	int r = kvs_server_create(&cfg, &srv);
	if (r) {
		kvs_err("start-up failed: %s", kvs_strerror(r));
		close(sfd);
		return 1;
	}
	kvs_info("kvside-server %s ready (pid %d)", KVS_VERSION, (int)getpid());
	r = kvs_server_run(srv, sfd);
	kvs_server_destroy(srv);
	close(sfd);
	kvs_info("stopped");
	return r ? 1 : 0;
}
