#!/usr/bin/env python3
"""A throw-away Redis Cluster on loopback ports, for the l3 tests.

As a module:
    with RedisCluster(masters=3, replicas=1) as rc:   # started, cluster_state:ok everywhere
        rc.seeds                                      # "127.0.0.1:P1,127.0.0.1:P2,..."
        rc.call(rc.ports[0], "CLUSTER", "INFO")       # a tiny RESP client
        rc.kill(port)                                 # SIGKILL one node
    # stopped (every node SIGKILLed), its directory removed

From the shell (the C tests use this):
    redis_cluster.py start DIR [--masters 3] [--replicas 1] [--password P] [--node-timeout MS]
        starts the nodes (each in DIR/PORT), creates the cluster, waits for
        cluster_state:ok; writes DIR/cluster.txt ("seeds HOST:PORT,..." then
        one "node PORT PID" line per node) and prints the seeds. The nodes stay
        up after it exits (in the caller's process group, so a test runner that
        kills the group kills them too).
    redis_cluster.py wait-ok DIR [--timeout S]
    redis_cluster.py stop DIR          SIGKILLs every node listed in DIR/cluster.txt

Exit code 77 (the meson "skip" code) when redis-server or redis-cli is missing.

Every node: --cluster-enabled yes, no persistence (--appendonly no --save ''),
cluster-node-timeout 1000 ms by default (failover within a few seconds),
replica-validity-factor 0 (a replica may always be promoted), diskless
replication without delay (replicas in sync at once).
"""
import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77


class RespError(Exception):
    """An error reply (-ERR ...)."""


def _enc(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, int):
            a = str(a)
        if isinstance(a, str):
            a = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _read(f):
    line = f.readline()
    if not line:
        raise ConnectionError("connection closed")
    t, rest = line[:1], line[1:-2]
    if t == b"+":
        return rest.decode()
    if t == b"-":
        raise RespError(rest.decode())
    if t == b":":
        return int(rest)
    if t == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2]
    if t == b"*":
        n = int(rest)
        return None if n < 0 else [_read(f) for _ in range(n)]
    raise ConnectionError("bad reply %r" % line)


def call(port, *args, password=None, host="127.0.0.1", timeout=3.0):
    """One command on one node; returns the reply (bulk strings as bytes)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        f = s.makefile("rb")
        if password:
            s.sendall(_enc(["AUTH", password]))
            _read(f)
        s.sendall(_enc(args))
        return _read(f)


def _free_port(taken):
    """A port P with P and P + 10000 (the cluster bus) free on loopback."""
    for _ in range(200):
        p = random.randrange(20000, 45000)
        if p in taken or p + 10000 in taken:
            continue
        ok = True
        for q in (p, p + 10000):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", q))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok:
            return p
    raise RuntimeError("no free port pair")


def have_redis():
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


class RedisCluster:
    def __init__(self, masters=3, replicas=1, password=None, node_timeout=1000, workdir=None, log=sys.stderr):
        if masters < 3 and not (masters == 1 and replicas == 0):
            raise ValueError("masters >= 3 (redis-cli --cluster create), or one master without replicas")
        self.masters, self.replicas = masters, replicas
        self.password, self.node_timeout = password, node_timeout
        self.own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="kvs-rcluster-")
        self.log = log
        self.procs = {}  # port -> Popen (or a pid when adopted from cluster.txt)
        self.ports = []

    # ---- processes -----------------------------------------------------
    def _spawn(self, port):
        d = os.path.join(self.dir, str(port))
        os.makedirs(d, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", os.path.join(d, "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout), "--cluster-replica-validity-factor", "0",
                "--appendonly", "no", "--save", "", "--dir", d, "--logfile", os.path.join(d, "redis.log"),
                "--daemonize", "no", "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def _ping(self, port):
        try:
            return call(port, "PING", password=self.password, timeout=0.5) == "PONG"
        except (OSError, RespError):
            return False

    def start(self, timeout=60):
        n = self.masters * (1 + self.replicas)
        taken = set()
        for _ in range(n):
            for attempt in range(5):
                port = _free_port(taken)
                p = self._spawn(port)
                t_end = time.monotonic() + 10
                while time.monotonic() < t_end and p.poll() is None and not self._ping(port):
                    time.sleep(0.02)
                if p.poll() is None and self._ping(port):
                    break
                p.kill()
                p.wait()
            else:
                raise RuntimeError("could not start redis-server (last port %d)" % port)
            taken |= {port, port + 10000}
            self.procs[port] = p
            self.ports.append(port)
        self.write_state()
        if self.masters == 1:
            call(self.ports[0], "CLUSTER", "ADDSLOTSRANGE", 0, 16383, password=self.password)
        else:
            env = dict(os.environ)
            if self.password:
                env["REDISCLI_AUTH"] = self.password
            r = subprocess.run(["redis-cli", "--cluster", "create"] + ["127.0.0.1:%d" % p for p in self.ports] +
                               ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
            if r.returncode != 0:
                raise RuntimeError("redis-cli --cluster create failed:\n" + r.stdout.decode(errors="replace"))
        self.wait_ok(timeout)
        return self

    def write_state(self):
        with open(os.path.join(self.dir, "cluster.txt"), "w") as f:
            f.write("seeds %s\n" % self.seeds)
            for port in self.ports:
                f.write("node %d %d\n" % (port, self.pid(port)))

    def pid(self, port):
        p = self.procs[port]
        return p if isinstance(p, int) else p.pid

    @property
    def seeds(self):
        return ",".join("127.0.0.1:%d" % p for p in self.ports)

    def call(self, port, *args, timeout=3.0):
        return call(port, *args, password=self.password, timeout=timeout)

    def _node_ok(self, port):
        info = self.call(port, "CLUSTER", "INFO").decode()
        kv = dict(l.split(":", 1) for l in info.splitlines() if ":" in l)
        if kv.get("cluster_state") != "ok" or kv.get("cluster_slots_ok") != "16384":
            return False
        if int(kv.get("cluster_known_nodes", 0)) != len(self.ports):
            return False
        rep = self.call(port, "INFO", "replication").decode()
        if "role:slave" in rep and "master_link_status:up" not in rep:
            return False
        return True

    def wait_ok(self, timeout=60):
        """Until every node says cluster_state:ok with all slots and nodes known,
        and every replica's link to its master is up."""
        t_end = time.monotonic() + timeout
        last = None
        while time.monotonic() < t_end:
            try:
                if all(self._node_ok(p) for p in self.ports):
                    return
            except (OSError, RespError) as e:
                last = e
            time.sleep(0.1)
        raise RuntimeError("cluster not ok after %ds (%s)" % (timeout, last))

    def kill(self, port, sig=signal.SIGKILL):
        os.kill(self.pid(port), sig)

    def stop(self):
        for port in list(self.procs):
            try:
                os.kill(self.pid(port), signal.SIGKILL)
            except ProcessLookupError:
                pass
            p = self.procs[port]
            if not isinstance(p, int):
                p.wait()
        self.procs.clear()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _adopt(d):
    """A RedisCluster object for the cluster described in d/cluster.txt."""
    rc = RedisCluster.__new__(RedisCluster)
    rc.dir, rc.own_dir, rc.procs, rc.ports, rc.password = d, False, {}, [], None
    with open(os.path.join(d, "cluster.txt")) as f:
        for line in f:
            w = line.split()
            if w and w[0] == "node":
                rc.ports.append(int(w[1]))
                rc.procs[int(w[1])] = int(w[2])
    return rc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("dir")
    s.add_argument("--masters", type=int, default=3)
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--password")
    s.add_argument("--node-timeout", type=int, default=1000)
    w = sub.add_parser("wait-ok")
    w.add_argument("dir")
    w.add_argument("--password")
    w.add_argument("--timeout", type=float, default=60)
    t = sub.add_parser("stop")
    t.add_argument("dir")
    a = ap.parse_args()
    if a.cmd == "start":
        if not have_redis():
            print("redis-server or redis-cli not found: skipped", file=sys.stderr)
            return SKIP
        os.makedirs(a.dir, exist_ok=True)
        rc = RedisCluster(a.masters, a.replicas, a.password, a.node_timeout, workdir=a.dir)
        try:
            rc.start()
        except Exception as e:  # leave nothing running behind a failed start
            print("redis_cluster.py: %s" % e, file=sys.stderr)
            rc.stop()
            return 1
        print(rc.seeds)
        return 0
    rc = _adopt(a.dir)
    if a.cmd == "wait-ok":
        rc.password = a.password
        rc.wait_ok(a.timeout)
    else:
        rc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
