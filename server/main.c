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
#include "config.h"
#include "kvs_config.h"
#include "kvs_l2.h"
#include "kvs_log.h"
#include "server.h"

static void usage(FILE *f, const kvs_server_config *d)
{
	fprintf(f,
		"Usage: kvside-server [options]\n"
		"KV-cache sidecar for tensor-parallel inference engines.\n\n"
		"  --config FILE            read settings from a YAML file (options given here win)\n"
		"  --print-config           print the effective settings as YAML and exit\n");
	for (const kvs_config_key *k = kvs_config_keys(); k->name; k++) {
		char opt[64], def[600], text[1024];
		snprintf(opt, sizeof(opt), "--%s %s", k->name, k->arg);
		kvs_config_format(d, k, def, sizeof(def));
		snprintf(text, sizeof(text), "%s (default %s)", k->help, def[0] ? def : "\"\"");
		/* word-wrap the text at 80 columns in a column of its own */
		int col = fprintf(f, "  %-24s", opt);
		for (char *w = strtok(text, " "); w; w = strtok(NULL, " ")) {
			if (col + 1 + (int)strlen(w) > 80)
				col = fprintf(f, "\n%26s", "");
			col += fprintf(f, " %s", w);
		}
		fputc('\n', f);
	}
	fprintf(f,
		"  --no-prefault            same as --prefault false\n"
		"  --help                   show this text\n"
		"  --version                show the version\n");
}

/* At exit: the queued log lines are written (at most 2 s for a stalled
 * reader of stderr). */
static void log_flush(void) { kvs_log_async_stop(2000); }

int main(int argc, char **argv)
{
	kvs_server_config cfg;
	kvs_server_config_defaults(&cfg);
	enum { O_KEY = 1000, O_CONFIG = 1, O_PRINT, O_HELP, O_VERSION, O_NOPREFAULT };
	/* one long option per setting of the table, plus the actions */
	struct option opts[80];
	int n = 0;
	for (const kvs_config_key *k = kvs_config_keys(); k->name && n < 70; k++, n++)
		opts[n] = (struct option){k->name, required_argument, NULL, O_KEY + n};
	opts[n++] = (struct option){"config", required_argument, NULL, O_CONFIG};
	opts[n++] = (struct option){"print-config", no_argument, NULL, O_PRINT};
	opts[n++] = (struct option){"help", no_argument, NULL, O_HELP};
	opts[n++] = (struct option){"version", no_argument, NULL, O_VERSION};
	opts[n++] = (struct option){"no-prefault", no_argument, NULL, O_NOPREFAULT};
	opts[n] = (struct option){NULL, 0, NULL, 0};

	/* pass 1: the file, so that the command line overrides it in pass 2 */
	const char *file = NULL;
	int c;
	opterr = 0;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1)
		if (c == O_CONFIG)
			file = optarg;
	char err[512];
	if (file && kvs_config_load(&cfg, file, err, sizeof(err)) < 0) {
		fprintf(stderr, "kvside-server: %s\n", err);
		return 2;
	}
	opterr = 1;
	optind = 0;
	bool print = false;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case O_CONFIG:
			break;
		case O_PRINT:
			print = true;
			break;
		case O_NOPREFAULT:
			cfg.l1_prefault = false;
			break;
		case O_HELP:
			usage(stdout, &cfg);
			return 0;
		case O_VERSION:
			printf("kvside-server %s (protocol v%d)\n", KVS_VERSION, KVS_PROTO_VERSION);
			return 0;
		default:
			if (c < O_KEY || c >= O_KEY + n) {
				usage(stderr, &cfg);
				return 2;
			}
			if (kvs_config_set(&cfg, opts[c - O_KEY].name, optarg, err, sizeof(err)) < 0) {
				fprintf(stderr, "kvside-server: --%s\n", err);
				return 2;
			}
		}
	}
	if (optind < argc) {
		fprintf(stderr, "kvside-server: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (kvs_config_check(&cfg, err, sizeof(err)) < 0) {
		fprintf(stderr, "kvside-server: %s\n", err);
		return 2;
	}
	if (print) {
		kvs_config_print(stdout, &cfg);
		return 0;
	}
	kvs_log_set_level(cfg.log_level);
	kvs_log_set_format(cfg.log_format);
	/* every import holds an fd and every client a socket: raise the soft
	 * limit to the hard one; at the limit, accepts shed the new peer
	 * (fdguard.c: libzmq would abort) */
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	kvs_fdguard_init();

	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	/* blocked before any thread starts, so only the signalfd sees them */
	pthread_sigmask(SIG_BLOCK, &set, NULL);
	signal(SIGPIPE, SIG_IGN);
	/* no thread of the server waits on stderr's reader (architecture.md,
	 * table of decisions); started with the signals blocked, like every
	 * thread, so only the signalfd sees them */
	const char *lqb = getenv("KVS_TEST_LOG_QUEUE_BYTES"); /* tests: a small queue fills sooner */
	if (kvs_log_async_start(lqb ? strtoull(lqb, NULL, 10) : KVS_LOG_QUEUE_BYTES) != 0)
		kvs_warn("cannot start the log thread: logging writes to stderr directly");
	else
		atexit(log_flush); /* every exit from here on writes what is queued */
	kvs_log_crash_handlers(); /* and a crash too, best effort */
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
