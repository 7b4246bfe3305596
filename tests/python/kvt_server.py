"""kvside-server for the Python tests (tests/python, tests/vllm, tests/sglang,
tests/e2e): a private run directory, started and waited for, stopped with
SIGTERM (queued L2 writes are flushed) or killed with SIGKILL, its log kept
in <tmp>/server.log for failure messages.

KVS_SERVER names the binary; KVT_SERVER_WRAPPER (e.g. valgrind) runs it
under a tool; KVT_LOG_LEVEL sets its log level (warn)."""

import os
import shutil
import signal
import subprocess
import tempfile
import time

import kvside


class Server:
    def __init__(self, *extra, l2=False, l1_size="64M", l2_size="256M", l2_sync="none", binary=None,
                 ttl_ms=3000, heartbeat_ms=100, prefix="kvt-srv-"):
        """extra: more flags (last wins). l2: an L2 directory kept across
        stop()/start() (l2_sync None: the server's default policy)."""
        self.binary = binary or os.environ["KVS_SERVER"]
        self.tmp = tempfile.mkdtemp(prefix=prefix)
        self.run = os.path.join(self.tmp, "run")
        self.log_path = os.path.join(self.tmp, "server.log")
        self.base = ["--broker-dir", self.run, "--ttl-ms", str(ttl_ms), "--heartbeat-ms", str(heartbeat_ms),
                     "--l1-size", l1_size, "--metrics-listen", "off",
                     "--log-level", os.environ.get("KVT_LOG_LEVEL", "warn"), "--no-prefault"]
        if l2:
            self.base += ["--l2-path", os.path.join(self.tmp, "l2"), "--l2-size", l2_size]
            if l2_sync:
                self.base += ["--l2-sync", l2_sync]
        self.extra = list(extra)
        self.proc = None

    def start(self, timeout=None):
        wrapper = os.environ.get("KVT_SERVER_WRAPPER", "").split()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(wrapper + [self.binary] + self.base + self.extra, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.time() + (timeout or (60 if wrapper else 20))
        while time.time() < deadline:
            if os.path.exists(os.path.join(self.run, "kvside.zmq")):
                try:
                    kvside.Client("probe", "probe", role="scheduler", broker_dir=self.run, timeout_ms=1000).close()
                    return
                except kvside.KvsideError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError("kvside-server exited: %s\n%s" % (self.proc.returncode, self.log()))
            time.sleep(0.05)
        raise RuntimeError("kvside-server did not start\n" + self.log())

    def stop(self):
        """SIGTERM, then the exit status (SIGKILL after 60 s)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc, self.proc = self.proc.returncode, None
        return rc

    def kill(self):
        """SIGKILL: nothing is flushed."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stats(self):
        with kvside.Client("probe", "probe", role="scheduler", broker_dir=self.run) as c:
            return c.stats()

    def wait_stat(self, pred, timeout=10):
        """Waits until pred(stats) holds (or timeout seconds); returns the stats."""
        with kvside.Client("probe", "probe", role="scheduler", broker_dir=self.run) as c:
            deadline = time.time() + timeout
            while True:
                st = c.stats()
                if pred(st) or time.time() > deadline:
                    return st
                time.sleep(0.05)

    def log(self, chars=4000):
        """The end of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_tail(self, n=30):
        """Its last n lines."""
        return "".join(self.log(1 << 20).splitlines(True)[-n:])

    def cleanup(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
