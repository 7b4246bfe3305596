#!/usr/bin/python3
"""allow-uid for a non-root user (issue 16 #8): the server (root here) lets
one more UID reach its 0700 run directory and 0600 sockets through ACL
entries. A process of that UID registers memory through the broker, stores
and completes a job, and is refused operator commands (E_AUTH); a process of
another UID cannot even connect. Needs root (to run the two UIDs): skipped
otherwise; CI runs as root. Environment as tests/python/test_binding.py."""

import os
import subprocess
import sys
import unittest

from kvt_server import Server

ALLOWED, OTHER = 12345, 23456

CHILD = r'''
import os, sys, kvside
run = sys.argv[1]
try:
    c = kvside.Client("uidtest", "ns", role="worker", rank=0, world=1, broker_dir=run, timeout_ms=2000)
except kvside.KvsideError as e:
    print("open-failed", e); sys.exit(3)
mem = kvside.HostMemory(1 << 20, name="kvt-uid")
mem.view[:] = os.urandom(1 << 20)
c.register_memory([mem], groups=[kvside.Group(0, "attention", 16, 4)],
                  layers=[kvside.Layer(0, 0, 0, 16, 65536, 65536)])
keys = kvside.chunk_keys("ns", list(range(64)), 64)
assert c.store(1, keys, [[0, 1, 2, 3]]) == "open"
c.complete(1)
assert c.job_wait(1, 5000) == "committed"
try:
    c.admin("status")
    print("admin-allowed"); sys.exit(4)
except kvside.KvsideError as e:
    assert "E_AUTH" in str(e), e
c.close()
print("ok")
'''


def as_uid(uid):
    def f():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return f


@unittest.skipIf(os.geteuid() != 0, "needs root to run processes of two other UIDs")
class AllowUidTest(unittest.TestCase):
    def test_second_user(self):
        srv = Server("--allow-uid", str(ALLOWED), prefix="kvt-uid-")
        os.chmod(srv.tmp, 0o711)  # the test's own temp dir: traversable, like /run
        srv.start()
        try:
            env = dict(os.environ, HOME="/")
            p = subprocess.run([sys.executable, "-c", CHILD, srv.run], preexec_fn=as_uid(ALLOWED), env=env,
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("ok", p.stdout)
            q = subprocess.run([sys.executable, "-c", CHILD, srv.run], preexec_fn=as_uid(OTHER), env=env,
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(q.returncode, 3, q.stdout + q.stderr)
        finally:
            srv.stop()


if __name__ == "__main__":
    unittest.main()
