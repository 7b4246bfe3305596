#!/usr/bin/python3
"""A reader of the server's stderr that stops reading (a pipe nobody drains,
a container's log driver under pressure) never stops the server: its
threads queue log lines for a log thread, and lines that find the 1 MiB
queue full are dropped and counted (`log_lines_dropped`, protocol §15).
Before, the loop blocked in write(2) once the pipe's 64 KiB were full and
answered nothing more (at debug level, after ~230 sessions).

Real server with stdout and stderr on a pipe this test does not read at
first; real sessions through libkvside. Environment as
tests/python/test_binding.py."""

import fcntl
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import kvside


def start(run, wfd, *extra, queue="65536", level="debug"):
    # a 64 KiB queue (KVS_TEST_LOG_QUEUE_BYTES; 1 MiB by default) fills
    # after a few hundred sessions at debug level
    env = dict(os.environ, KVS_TEST_LOG_QUEUE_BYTES=queue)
    p = subprocess.Popen([os.environ["KVS_SERVER"], "--broker-dir", run, "--l1-size", "64M",
                          "--metrics-listen", "off", "--log-level", level, "--no-prefault"] + list(extra),
                         stdout=wfd, stderr=wfd, env=env)
    deadline = time.time() + 20
    while not os.path.exists(os.path.join(run, "kvside.zmq")):
        if p.poll() is not None or time.time() > deadline:
            raise RuntimeError("kvside-server did not start (%s)" % p.poll())
        time.sleep(0.05)
    return p


def sessions(run, n):
    """n sessions opened, asked for stats and closed, one after the other:
    each logs a few debug lines (hello, session closed)."""
    for i in range(n):
        with kvside.Client("e%d" % i, "ns", role="scheduler", broker_dir=run, timeout_ms=3000) as c:
            c.stats()


def stat(run, name):
    with kvside.Client("probe", "ns", role="scheduler", broker_dir=run, timeout_ms=3000) as c:
        return c.stats()[name]


class StalledLogTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvt-log-")
        self.run = os.path.join(self.tmp, "run")
        self.r, w = os.pipe()
        # JSON lines: the note of what was dropped must be one too
        self.proc = start(self.run, w, "--log-format", "json")
        os.close(w)

    def tearDown(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.r)

    def test_served_while_the_reader_stalls_then_told_what_was_lost(self):
        # far more than the pipe's 64 KiB and the queue's (~300 bytes of
        # debug lines per session): every session must still be served
        sessions(self.run, 1500)
        self.assertEqual(stat(self.run, "sessions"), 1)
        dropped = stat(self.run, "log_lines_dropped")
        self.assertGreater(dropped, 0)
        # the reader catches up: what was queued arrives, then the note of
        # what was dropped, and new lines flow again
        got = bytearray()
        done = threading.Event()

        def drain():
            while True:
                b = os.read(self.r, 1 << 16)
                if not b:
                    break
                got.extend(b)
            done.set()

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        deadline = time.time() + 20
        while b"log lines dropped" not in got and time.time() < deadline:
            time.sleep(0.05)
        self.assertIn(b"log lines dropped: stderr's reader fell 64 KiB behind", bytes(got))
        # once the queue is written out, nothing is lost any more
        n = -1
        while n != len(got) and time.time() < deadline:
            n = len(got)
            time.sleep(0.3)
        dropped = stat(self.run, "log_lines_dropped")
        sessions(self.run, 3)
        self.assertEqual(stat(self.run, "log_lines_dropped"), dropped)
        self.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.proc.wait(20), 0)
        self.assertTrue(done.wait(10))
        lines = [json.loads(ln) for ln in bytes(got).decode().splitlines()]
        note = [ln for ln in lines if "log lines dropped" in ln["message"]]
        self.assertEqual(note[0]["level"], "warn")
        self.assertEqual(note[0]["module"], "log")
        # the last line before exit was written, not left in the queue
        self.assertEqual(lines[-1]["message"], "stopped")

    def test_stops_while_the_reader_stalls(self):
        # more than the pipe and the queue hold: the log thread waits in
        # write(2) with lines queued behind it
        sessions(self.run, 1000)
        self.assertGreater(stat(self.run, "log_lines_dropped"), 0)
        t0 = time.time()
        self.proc.send_signal(signal.SIGTERM)
        # at exit the log thread gets 2 s to write what is queued, then the
        # server exits anyway (with the flush at exit missing, it would
        # exit at once; with a join that waits, never)
        self.assertEqual(self.proc.wait(60), 0)
        self.assertGreaterEqual(time.time() - t0, 1.9)


class CrashTest(unittest.TestCase):
    """A crash does not lose the lines still queued: the fatal signal's
    handler writes them before the default action (kvs_log_fatal).
    Without it the lines behind a slow reader died with the process, the
    error that came right before a crash among them. SIGABRT stands for
    abort and a failed assertion; SIGBUS goes through the copy pool's own
    handler (copy_host.c), which must end the process too."""

    def crash(self, sig):
        tmp = tempfile.mkdtemp(prefix="kvt-crash-")
        run = os.path.join(tmp, "run")
        r, w = os.pipe()
        fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ: one page fills at once
        proc = start(run, w, queue=str(1 << 20), level="info")
        os.close(w)
        try:
            # ~150 bytes of info lines per session: far more than the pipe
            # holds, far less than the 1 MiB queue (nothing dropped)
            sessions(run, 200)
            with kvside.Client("crashmarker", "ns", role="scheduler", broker_dir=run, timeout_ms=3000) as c:
                c.stats()
            self.assertEqual(stat(run, "log_lines_dropped"), 0)
            proc.send_signal(sig)
            got = bytearray()

            def drain():  # the reader catches up while the server dies
                while True:
                    b = os.read(r, 1 << 16)
                    if not b:
                        break
                    got.extend(b)

            t = threading.Thread(target=drain, daemon=True)
            t.start()
            try:
                code = proc.wait(20)
            except subprocess.TimeoutExpired:
                code = None  # it lived on (finally kills it)
            self.assertEqual(code, -sig)
            t.join(10)
            self.assertIn(b"engine 'e199'", bytes(got))
            self.assertIn(b"engine 'crashmarker'", bytes(got))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(r)

    def test_queued_lines_written_at_an_abort(self):
        self.crash(signal.SIGABRT)

    def test_queued_lines_written_at_a_sigbus(self):
        self.crash(signal.SIGBUS)


if __name__ == "__main__":
    unittest.main()
