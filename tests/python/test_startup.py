#!/usr/bin/python3
"""Start-up refusals and limits of the real server (issue 16 #9, #11):
an L1 larger than the machine's physical memory (so larger than the memory
the server may use: MemAvailable, test_operator.py has the cgroup cases) is
refused at start with a clear message (exit status non-zero, nothing left
running); a hello beyond
max-sessions gets E_LIMIT, and a bye makes room again.

Environment as tests/python/test_binding.py."""

import os
import subprocess
import tempfile
import unittest


class StartupTest(unittest.TestCase):
    def test_l1_beyond_physical_memory_refused(self):
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with tempfile.TemporaryDirectory(prefix="kvt-start-") as tmp:
            too_big = "%dM" % ((phys >> 20) + 1024)
            p = subprocess.run([os.environ["KVS_SERVER"], "--broker-dir", os.path.join(tmp, "run"),
                                "--l1-size", too_big, "--metrics-listen", "off", "--no-prefault"],
                               capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("are more than this server may use", p.stderr)
            # and within memory it starts (the same flags, a small L1)
            srv = subprocess.Popen([os.environ["KVS_SERVER"], "--broker-dir", os.path.join(tmp, "run2"),
                                    "--l1-size", "16M", "--metrics-listen", "off", "--no-prefault"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                with self.assertRaises(subprocess.TimeoutExpired):
                    srv.wait(1.5)
            finally:
                srv.terminate()
                self.assertEqual(srv.wait(30), 0)


    def test_session_limit(self):
        import kvside
        from kvt_server import Server
        srv = Server("--max-sessions", "3")
        srv.start()  # its probe session said bye
        clients = []
        try:
            for i in range(3):
                clients.append(kvside.Client("eng", "ns", role="worker", rank=0, world=1, broker_dir=srv.run,
                                             timeout_ms=3000))
            with self.assertRaises(kvside.KvsideError) as cm:
                kvside.Client("eng", "ns", role="worker", rank=0, world=1, broker_dir=srv.run, timeout_ms=3000)
            self.assertIn("E_LIMIT", str(cm.exception))
            clients.pop().close()  # bye: room for one more
            clients.append(kvside.Client("eng", "ns", role="worker", rank=0, world=1, broker_dir=srv.run,
                                         timeout_ms=3000))
            self.assertEqual(clients[0].stats()["sessions"], 3)
        finally:
            for c in clients:
                c.close()
            srv.stop()


if __name__ == "__main__":
    unittest.main()
