#!/bin/sh
# kvside container entrypoint: checks the shared broker directory, then execs
# kvside-server as PID 1 (it reads SIGTERM through a signalfd, so `docker
# stop` / `podman stop` shut it down cleanly, flushing queued L2 writes).
#
# Environment:
#   KVSIDE_BROKER_DIR      the broker directory, shared with the engine as a
#                          volume at the same path (default /run/kvside)
#   KVSIDE_CONFIG          YAML configuration (default /etc/kvside/kvside.yaml;
#                          skipped if absent)
#   KVSIDE_METRICS_LISTEN  HOST:PORT for /metrics and /healthz (e.g.
#                          0.0.0.0:9464 to publish the port; default: the file's)
#   KVSIDE_SERVER          the server binary (default /usr/local/bin/kvside-server)
# Arguments are passed to kvside-server and override the file.
set -eu
dir=${KVSIDE_BROKER_DIR:-/run/kvside}
cfg=${KVSIDE_CONFIG:-/etc/kvside/kvside.yaml}
server=${KVSIDE_SERVER:-/usr/local/bin/kvside-server}
uid=$(id -u)

die() {
	echo "kvside-entrypoint: $*" >&2
	exit 78 # EX_CONFIG: a restart will not help
}

[ -d "$dir" ] || mkdir -p -m 0700 "$dir" || die "cannot create $dir"
[ -L "$dir" ] && die "$dir is a symbolic link; mount the volume at a real directory"
owner=$(stat -c %u "$dir")
# the broker only accepts peers of its own UID (or --allow-uid): the engine and
# the sidecar must run as the same user, and that user must own the directory
[ "$owner" = "$uid" ] || die "$dir belongs to uid $owner but kvside runs as uid $uid; run the container with --user <the engine's uid>:<gid> and give that user the volume"
chmod 0700 "$dir" || die "cannot chmod 0700 $dir"

set -- --broker-dir "$dir" "$@"
[ -n "${KVSIDE_METRICS_LISTEN:-}" ] && set -- --metrics-listen "$KVSIDE_METRICS_LISTEN" "$@"
[ -f "$cfg" ] && set -- --config "$cfg" "$@"
exec "$server" "$@"
