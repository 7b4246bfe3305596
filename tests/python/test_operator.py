#!/usr/bin/python3
"""What an operator sees (issue 39), against the real kvside-server and
libkvside: each case checks the words a user gets, not only the code.

- One server per broker directory and per L2 directory: a second server on
  either exits at once naming the first one's pid, and the first keeps
  serving with its sockets in place; a restart after kill -9 is not blocked
  by the dead server's lock.
- Client errors that name the cause, without waiting for the 10 s hello
  time-out: a missing broker directory, a directory with no server, a stale
  socket left by a killed server, another user's directory (both uids), a
  CURVE key the server does not list; the same words from kvside-ctl.
- Errors that say what is wrong: a block list of the wrong length names the
  list, its group, the count given and the count expected (the exception
  and the job's reason); a job whose deadline passed names the rank that
  sent nothing (job_status, the job_done event, the server's log).
- Memory limits: l1-size above the memory the server may use (MemAvailable
  read from a file the test points the server at, and a real memory cgroup
  where this machine lets the test make one) is refused with both numbers,
  or clamped with l1-size-clamp; an l2-size below the existing file is
  logged with what is kept and how to shrink it.
- Long work is logged: the L1 prefault's start and end, a write-behind
  backlog (the L2 writer held by a test hook) and its drain, the flush of
  L2's queue at shutdown; stats and /metrics name the server (pid,
  version, start time, uptime, epoch).

Environment: KVS_SERVER, KVS_CTL, KVSIDE_LIB, PYTHONPATH with worker/python.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import kvside

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvt_server import Server  # noqa: E402

SERVER = os.environ["KVS_SERVER"]
CTL = os.environ["KVS_CTL"]


def run_server(*args, env=None, timeout=20):
    """A server that is expected to exit: (returncode, its output)."""
    p = subprocess.run([SERVER, "--metrics-listen", "off", "--no-prefault", "--l1-size", "64M"] + list(args),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout.decode("utf-8", "replace")


def open_error(broker_dir=None, endpoint=None, timeout_ms=10000, **kw):
    """(KvsideError, seconds) of a client open that must fail."""
    t0 = time.monotonic()
    try:
        kvside.Client("op-eng", "ns", role="scheduler", broker_dir=broker_dir, endpoint=endpoint,
                      timeout_ms=timeout_ms, **kw).close()
    except kvside.KvsideError as e:
        return e, time.monotonic() - t0
    raise AssertionError("the open succeeded")


def start_with(srv, env):
    """srv.start() with env (test hooks) in the server's environment only."""
    os.environ.update(env)
    try:
        srv.start()
    finally:
        for k in env:
            del os.environ[k]


def ctl_stderr(*args):
    p = subprocess.run([CTL] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    return p.returncode, p.stderr.decode("utf-8", "replace")


class OwnershipTest(unittest.TestCase):
    def setUp(self):
        self.a = Server(l2=True, prefix="kvt-op-own-")
        self.a.start()
        self.addCleanup(self.a.cleanup)
        self.addCleanup(self.a.stop)

    def serves(self, srv):
        with kvside.Client("op-eng", "ns", role="scheduler", broker_dir=srv.run, timeout_ms=5000) as c:
            return c.stats()

    def test_second_server_on_broker_dir(self):
        t0 = time.monotonic()
        rc, out = run_server("--broker-dir", self.a.run)
        self.assertEqual(rc, 1, out)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertIn("broker directory %s is in use by kvside-server pid %d" % (self.a.run, self.a.proc.pid), out)
        # the first one's sockets are still its own, and it serves
        for name in ("kvside.zmq", "kvside.sock"):
            self.assertTrue(os.path.exists(os.path.join(self.a.run, name)), name)
        self.assertEqual(self.serves(self.a)["server_pid"], self.a.proc.pid)

    def test_second_server_on_l2(self):
        other = tempfile.mkdtemp(prefix="kvt-op-b-")
        rc, out = run_server("--broker-dir", os.path.join(other, "run"), "--l2-path", os.path.join(self.a.tmp, "l2"))
        self.assertEqual(rc, 1, out)
        self.assertIn("L2 directory %s is in use by kvside-server pid %d" % (os.path.join(self.a.tmp, "l2"),
                                                                            self.a.proc.pid), out)
        self.assertNotIn("not closed cleanly", out)
        self.assertEqual(self.serves(self.a)["l2_enabled"], 1)

    def test_restart_after_kill9(self):
        self.a.kill()
        self.a.start()  # the same broker and L2 directories: the dead server's locks went with it
        st = self.serves(self.a)
        self.assertEqual(st["server_pid"], self.a.proc.pid)
        self.assertEqual(st["l2_enabled"], 1)


class ClientErrorTest(unittest.TestCase):
    """Each failing open says why within the 3 s a starting server is given,
    not after the 10 s hello time-out."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvt-op-cli-")

    def check(self, e, secs, code, *words):
        self.assertEqual(e.code_name, code, str(e))
        for w in words:
            self.assertIn(w, str(e))
        self.assertLess(secs, 6, "waited %.1f s" % secs)

    def test_missing_directory(self):
        d = os.path.join(self.tmp, "nope")
        e, secs = open_error(d)
        self.check(e, secs, "ENOENT", "broker directory %s does not exist" % d)
        rc, err = ctl_stderr("--broker-dir", d, "stats")
        self.assertEqual(rc, 3)
        self.assertIn("broker directory %s does not exist" % d, err)

    def test_directory_without_server(self):
        d = os.path.join(self.tmp, "empty")
        os.mkdir(d, 0o700)
        e, secs = open_error(d)
        self.check(e, secs, "ECONNREFUSED", "no kvside-server is listening in %s" % d)

    def test_stale_socket(self):
        srv = Server(prefix="kvt-op-stale-")
        srv.start()
        self.addCleanup(srv.cleanup)
        srv.kill()
        e, secs = open_error(srv.run)
        self.check(e, secs, "ECONNREFUSED", "left by a server that is gone")
        rc, err = ctl_stderr("--broker-dir", srv.run, "stats")
        self.assertIn("left by a server that is gone", err)

    @unittest.skipUnless(os.geteuid() == 0, "needs root to run a client as another uid")
    def test_other_uid(self):
        srv = Server(prefix="kvt-op-uid-")
        srv.start()
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        os.chmod(srv.tmp, 0o755)  # the broker directory itself stays 0700
        code = ("import os, kvside\nos.setgid(65534); os.setuid(65534)\n"
                "try:\n    kvside.Client('e', 'ns', role='scheduler', broker_dir=%r, timeout_ms=10000)\n"
                "except kvside.KvsideError as e:\n    print(e)\n" % srv.run)
        p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=30)
        out = p.stdout.decode()
        self.assertIn("permission denied", out)
        self.assertIn("belongs to uid 0", out)
        self.assertIn("runs as uid 65534", out)
        self.assertIn("allow-uid: 65534", out)

    def test_curve_key_refused(self):
        try:
            import zmq
        except ImportError:
            self.skipTest("pyzmq (python3-zmq) is not installed")
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        state = os.path.join(self.tmp, "state")
        os.mkdir(state, 0o700)
        listed = zmq.curve_keypair()
        keys = os.path.join(self.tmp, "authorized_keys")
        with open(keys, "w") as f:
            f.write(listed[0].decode() + "\n")
        srv = Server("--listen", "tcp://127.0.0.1:%d" % port, "--state-dir", state, "--authorized-keys", keys,
                     prefix="kvt-op-curve-")
        srv.start()
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        with open(os.path.join(state, "server.key")) as f:
            server_pub = f.read().split()[0].encode()
        stranger = zmq.curve_keypair()
        e, secs = open_error(endpoint="tcp://127.0.0.1:%d" % port, timeout_ms=2000,
                             curve_keys=(server_pub, stranger[0], stranger[1]))
        self.assertEqual(e.code_name, "E_TIMEOUT")
        self.assertIn("refused this client's CURVE key", str(e))
        # the listed key opens
        kvside.Client("e", "ns", role="scheduler", endpoint="tcp://127.0.0.1:%d" % port, timeout_ms=5000,
                      curve_keys=(server_pub, listed[0], listed[1])).close()
        # nothing listening there
        e, _ = open_error(endpoint="tcp://127.0.0.1:%d" % (port ^ 1 if port > 1025 else port + 1), timeout_ms=1000)
        self.assertIn("nothing is listening at", str(e))


class ErrorTextTest(unittest.TestCase):
    def setUp(self):
        self.srv = Server("--job-deadline-ms", "1500", "--log-level", "info", prefix="kvt-op-err-")
        self.srv.start()
        self.addCleanup(self.srv.cleanup)
        self.addCleanup(self.srv.stop)
        self.mem = kvside.HostMemory(1 << 20)
        self.addCleanup(self.mem.close)

    def rank(self, rank, world, **kw):
        c = kvside.Client("op-eng", "ns", role="worker", rank=rank, world=world, broker_dir=self.srv.run,
                          timeout_ms=5000, **kw)
        self.addCleanup(c.close)
        c.register_memory([self.mem], groups=[kvside.Group(3, "attention", 16, 4)],
                          layers=[kvside.Layer(3, 0, 0, 64, 4096, 4096)])
        return c

    def test_wrong_block_count(self):
        c = self.rank(0, 1)
        keys = kvside.chunk_keys("ns", list(range(128)), 64)
        with self.assertRaises(kvside.KvsideError) as e:
            c.store(1, keys, [[0, 1, 2]])
        self.assertEqual(e.exception.code_name, "E_GEOMETRY")
        self.assertIn("blocks[0] (group id 3): 3 ids given, expected 8 (2 keys x 4 blocks per chunk)",
                      str(e.exception))
        with self.assertRaises(kvside.KvsideError) as e:
            c.store(2, keys, [list(range(8)), list(range(8))])
        self.assertIn("2 lists given, the registration has 1 groups", str(e.exception))
        info = c.job_status([1])[0]
        self.assertEqual(info.state, "aborted")
        self.assertTrue(info.reason.startswith("rank 0 part refused: E_GEOMETRY: blocks[0] (group id 3)"),
                        info.reason)

    def test_deadline_names_missing_rank(self):
        events = []
        r0 = self.rank(0, 2, on_event=events.append)
        keys = kvside.chunk_keys("ns", list(range(64)), 64)
        self.assertEqual(r0.store(7, keys, [list(range(4))]), "open")
        r0.complete(7)
        deadline = time.time() + 10
        while time.time() < deadline and not [e for e in events if e.type == "job_done"]:
            time.sleep(0.05)
        done = [e for e in events if e.type == "job_done"]
        self.assertTrue(done, "no job_done within 10 s")
        want = "deadline of 1500 ms passed: rank 1 of 2 sent no part"
        self.assertEqual(done[0].reason, want)
        self.assertEqual(r0.job_status([7])[0].reason, want)
        self.assertIn(want, self.srv.log(1 << 20))


class MemoryTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvt-op-mem-")
        self.meminfo = os.path.join(self.tmp, "meminfo")
        with open(self.meminfo, "w") as f:
            f.write("MemTotal:       2097152 kB\nMemFree:         1048576 kB\nMemAvailable:    1048576 kB\n")

    def test_l1_above_memavailable_refused(self):
        rc, out = run_server("--broker-dir", os.path.join(self.tmp, "r"), "--l1-size", "2G",
                             env={"KVS_TEST_MEMINFO": self.meminfo})
        self.assertEqual(rc, 1, out)
        self.assertIn("l1-size 2048 MiB and 256 MiB for the server itself are more than this server may use: "
                      "1024 MiB (MemAvailable 1024 MiB); choose an l1-size of at most 768 MiB", out)
        self.assertNotIn("ready", out)

    def test_l1_clamped_when_asked(self):
        srv = Server("--l1-size", "2G", "--l1-size-clamp", "true", prefix="kvt-op-clamp-")
        start_with(srv, {"KVS_TEST_MEMINFO": self.meminfo})
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        with kvside.Client("e", "ns", role="scheduler", broker_dir=srv.run) as c:
            self.assertEqual(c.stats()["l1_capacity"], 768 << 20)
        self.assertIn("l1-size 2048 MiB clamped to 768 MiB (l1-size-clamp)", srv.log(1 << 20))

    def fake_cgroup(self, limit_mib, used_mib, cache_mib):
        """A cgroup v2 directory of files for KVS_TEST_CGROUP_ROOT, MemAvailable ample."""
        root = os.path.join(self.tmp, "cg-%d-%d-%d" % (limit_mib, used_mib, cache_mib))
        os.makedirs(root)
        for name, text in (("memory.max", str(limit_mib << 20)), ("memory.current", str(used_mib << 20)),
                           ("memory.stat", "anon %d\nfile %d\nkernel 0\n" % ((used_mib - cache_mib) << 20,
                                                                       cache_mib << 20))):
            with open(os.path.join(root, name), "w") as f:
                f.write(text + "\n")
        with open(self.meminfo, "w") as f:
            f.write("MemTotal: 67108864 kB\nMemAvailable: 67108864 kB\n")
        return root

    def test_cgroup_page_cache_not_counted(self):
        """A cgroup whose usage is mostly page cache (a restart after L2
        reads): the cache is reclaimable, so the server starts; the same
        usage held by the processes is refused, naming the cgroup."""
        env = {"KVS_TEST_MEMINFO": self.meminfo}
        env["KVS_TEST_CGROUP_ROOT"] = self.fake_cgroup(1024, 900, 0)
        rc, out = run_server("--broker-dir", os.path.join(self.tmp, "c1"), "--l1-size", "512M", env=env,
                             timeout=20)
        self.assertEqual(rc, 1, out)
        self.assertIn("124 MiB (memory cgroup %s: limit 1024 MiB, 900 MiB in use besides page cache)"
                      % env["KVS_TEST_CGROUP_ROOT"], out)
        env["KVS_TEST_CGROUP_ROOT"] = self.fake_cgroup(1024, 900, 800)
        srv = Server("--l1-size", "512M", prefix="kvt-op-cache-")
        start_with(srv, env)
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        self.assertEqual(srv.stats()["l1_capacity"], 512 << 20)

    def test_real_memory_cgroup(self):
        """A memory cgroup made here, the server started inside it."""
        cg = None
        with open("/proc/self/cgroup") as f:
            lines = f.readlines()
        for line in lines:
            ident, ctrls, path = line.rstrip("\n").split(":", 2)
            if ctrls == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                base, limit = "/sys/fs/cgroup" + path.rstrip("/"), "memory.max"
            elif "memory" in ctrls.split(",") and os.path.isdir("/sys/fs/cgroup/memory"):
                base, limit = "/sys/fs/cgroup/memory" + path.rstrip("/"), "memory.limit_in_bytes"
            else:
                continue
            try:
                cg = os.path.join(base, "kvt-op-%d" % os.getpid())
                os.mkdir(cg)
                with open(os.path.join(cg, limit), "w") as f:
                    f.write(str(512 << 20))
                break
            except OSError:
                if cg and os.path.isdir(cg):
                    os.rmdir(cg)
                cg = None
        if not cg:
            self.skipTest("no memory cgroup can be made here")
        self.addCleanup(os.rmdir, cg)
        cmd = "echo $$ > %s/cgroup.procs && exec %s --broker-dir %s --l1-size 2G --metrics-listen off" % (
            cg, SERVER, os.path.join(self.tmp, "cg"))
        p = subprocess.run(["sh", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=20)
        out = p.stdout.decode()
        self.assertEqual(p.returncode, 1, out)
        self.assertRegex(out, r"more than this server may use: \d+ MiB \(memory cgroup %s: limit 512 MiB"
                         % re.escape(cg))

    def test_l2_size_below_existing(self):
        srv = Server(l2=True, l2_size="256M", prefix="kvt-op-l2s-")
        srv.start()
        self.addCleanup(srv.cleanup)
        store_jobs(srv, range(1, 25))  # 24 MiB (write-behind may drop some under the burst)
        kept = srv.wait_stat(lambda st: st["l2_queue_depth"] == 0)["l2_objects"]
        self.assertGreater(kept * (256 << 10), 8 << 20)  # more than the smaller l2-size holds
        srv.stop()
        srv.base[srv.base.index("--l2-size") + 1] = "8M"
        srv.start()
        self.assertEqual(srv.stats()["l2_objects"], kept)  # kept: nothing was dropped at the start
        srv.stop()
        self.assertRegex(srv.log(1 << 20), r"l2-size is 8 MiB but the existing file already holds data up to "
                         r"\d+ MiB: kept at that size")
        self.assertIn("remove %s/data.mdb" % os.path.join(srv.tmp, "l2"), srv.log(1 << 20))


def store_jobs(srv, jobs):
    """Stores and commits 1 MiB per job (4 chunks of 256 KiB) through one rank."""
    mem = kvside.HostMemory(8 << 20)
    try:
        with kvside.Client("e", "ns", role="worker", rank=0, world=1, broker_dir=srv.run, timeout_ms=5000) as c:
            c.register_memory([mem], groups=[kvside.Group(0, "attention", 16, 4)],
                              layers=[kvside.Layer(0, 0, 0, 128, 65536, 65536)])
            for job in jobs:
                keys = kvside.chunk_keys("ns", [job * 100000 + i for i in range(256)], 64)
                c.store(job, keys, [list(range(16))])
                c.complete(job)
                if c.job_wait(job, 5000) != "committed":
                    raise AssertionError("job %d did not commit" % job)
    finally:
        mem.close()


class LongWorkTest(unittest.TestCase):
    def test_prefault_and_identity(self):
        srv = Server("--prefault", "true", "--l1-size", "256M", "--log-level", "info", prefix="kvt-op-pf-")
        srv.base.remove("--no-prefault")
        srv.start()
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        with kvside.Client("e", "ns", role="scheduler", broker_dir=srv.run) as c:
            deadline = time.time() + 20
            while c.stats()["l1_prefault_active"] and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)  # the next tick logs the end
            st = c.stats()
        self.assertIn("L1 prefault: faulting in 256 MiB in the background", srv.log(1 << 20))
        self.assertRegex(srv.log(1 << 20), r"L1 prefault done: 256 MiB in [\d.]+ s")
        self.assertEqual(st["server_pid"], srv.proc.pid)
        self.assertEqual(st["server_version"], 1000)  # 0.1.0
        self.assertLess(abs(st["server_start_unix_ms"] / 1000 - time.time()), 60)
        self.assertGreater(st["server_uptime_ms"], 0)
        self.assertGreater(st["server_epoch"], 0)

    def held_writer(self, srv, hold_ms, backlog_bytes=None):
        """Starts srv with its L2 writer held hold_ms (KVS_TEST_L2_WRITER_HOLD_MS)."""
        env = {"KVS_TEST_L2_WRITER_HOLD_MS": str(hold_ms)}
        if backlog_bytes:
            env["KVS_TEST_BACKLOG_LOG_BYTES"] = str(backlog_bytes)
        start_with(srv, env)

    def test_backlog_and_flush_logged(self):
        srv = Server("--log-level", "info", "--l1-size", "128M", l2=True, l2_sync="full", prefix="kvt-op-bl-")
        self.addCleanup(srv.cleanup)
        self.held_writer(srv, 1500, backlog_bytes=1 << 20)
        store_jobs(srv, range(1, 9))  # 8 MiB queued while the writer waits
        deadline = time.time() + 20
        while time.time() < deadline and "backlog drained" not in srv.log(1 << 20):
            time.sleep(0.1)
        self.assertRegex(srv.log(1 << 20), r"write-behind: a backlog of \d+ objects \(\d+ MiB\) waits for L2")
        self.assertRegex(srv.log(1 << 20), r"write-behind: backlog drained in [\d.]+ s \(\d+ objects written\)")
        srv.stop()
        # the writer held for good: what is queued at SIGTERM is written first
        self.held_writer(srv, 60000)
        store_jobs(srv, [50])
        t0 = time.monotonic()
        srv.stop()
        self.assertLess(time.monotonic() - t0, 30)
        self.assertRegex(srv.log(1 << 20), r"shutting down: writing \d+ queued objects \(1 MiB\) to L2 first")
        self.assertRegex(srv.log(1 << 20), r"L2 flushed in [\d.]+ s")
        srv.start()
        self.assertEqual(srv.stats()["l2_objects"], 36)  # 32 + 4: the flushed job is there

    def test_metrics_name_the_server(self):
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        srv = Server(prefix="kvt-op-met-")
        srv.base[srv.base.index("--metrics-listen") + 1] = "127.0.0.1:%d" % port
        srv.start()
        self.addCleanup(srv.cleanup)
        self.addCleanup(srv.stop)
        body = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5).read().decode()
        self.assertRegex(body, r'kvside_build_info\{version="0\.1\.0",pid="%d",epoch="[0-9a-f]{16}"\} 1'
                         % srv.proc.pid)
        self.assertRegex(body, r"\nkvside_start_time_seconds \d{10}\.\d+\n")
        self.assertRegex(body, r"\nkvside_uptime_seconds [\d.]+\n")


if __name__ == "__main__":
    unittest.main(verbosity=2)
