#!/usr/bin/python3
"""Host memory that cannot be sealed against shrinking (issue 19): a memfd
carrying F_SEAL_SEAL without F_SEAL_SHRINK, as engines' shared host pools are.

- Without allow-unsealed-memory the registration is refused (E_DEVICE) and
  the server says which setting would accept it.
- With it the memory registers and serves; once its owner truncates it, a
  store reading the lost pages aborts ("host memory shrank"), a retrieve
  writing into them fails with E_DEVICE, nothing of them is committed, and
  the server goes on serving others (no SIGBUS), exiting cleanly.

Real server, real memfds; Debian's python3, standard library only.
"""

import fcntl
import mmap
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import kvside  # noqa: E402
from test_binding import NS, Server  # noqa: E402

BLOCKS, BLOCK = 64, 4096
SIZE = BLOCKS * BLOCK
BPC = 4


def unsealable_memfd():
    """A memfd sealed with F_SEAL_SEAL only: it can still shrink."""
    fd = os.memfd_create("kvt-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    m = mmap.mmap(fd, SIZE, mmap.MAP_SHARED)
    m[:] = os.urandom(SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
    return fd, m


def register(client, fd):
    return client.register_memory([(fd, SIZE)], groups=[kvside.Group(0, "attention", 16, BPC)],
                                  layers=[kvside.Layer(0, 0, 0, BLOCKS, BLOCK, BLOCK)])


def keys(tag, n):
    return [bytes([tag, i]) * 16 for i in range(n)]


class Unsealed(unittest.TestCase):
    def tearDown(self):
        rc = self.srv.stop()
        log = open(os.path.join(self.srv.tmp, "server.log"), errors="replace").read()
        self.srv.cleanup()
        self.assertEqual(rc, 0, "server exit status; log:\n" + log[-2000:])

    def start(self, *extra):
        self.srv = Server("--log-level", "info", *extra)
        self.srv.start()

    def log(self):
        return open(os.path.join(self.srv.tmp, "server.log"), errors="replace").read()

    def test_refused_without_the_setting(self):
        self.start()
        fd, m = unsealable_memfd()
        with kvside.Client("eng", NS, rank=0, world=1, broker_dir=self.srv.run) as c:
            with self.assertRaises(kvside.KvsideError) as e:
                register(c, fd)
            self.assertEqual(e.exception.code_name, "E_DEVICE")
            self.assertEqual(c.stats()["registrations"], 0)
        self.assertIn("allow-unsealed-memory", self.log())
        m.close()
        os.close(fd)

    def test_shrink_fails_the_copy_not_the_server(self):
        self.start("--allow-unsealed-memory", "true")
        fd, m = unsealable_memfd()
        sealed = kvside.HostMemory(SIZE)
        sealed.view[:] = os.urandom(SIZE)
        with kvside.Client("eng", NS, rank=0, world=1, broker_dir=self.srv.run) as c, \
                kvside.Client("eng2", NS, rank=0, world=1, broker_dir=self.srv.run) as c2:
            register(c, fd)
            register(c2, sealed.fd)
            # it serves while intact
            k = keys(1, 2)
            c.store(1, k, [list(range(0, 2 * BPC))])
            c.complete(1)
            self.assertEqual(c.job_wait(1, 5000), "committed")
            self.assertEqual(c.retrieve(2, k, [list(range(32, 32 + 2 * BPC))]), "open")
            c.complete(2)
            self.assertEqual(m[32 * BLOCK:(32 + 2 * BPC) * BLOCK], m[0:2 * BPC * BLOCK])
            # the owner truncates it to 16 blocks: blocks 16.. are gone
            m.close()
            os.ftruncate(fd, 16 * BLOCK)
            k2 = keys(2, 2)
            c.store(3, k2, [list(range(40, 40 + 2 * BPC))])
            c.complete(3)
            self.assertEqual(c.job_wait(3, 5000), "aborted")
            reason = c.job_status([3])[0].reason
            self.assertIn("host memory shrank", reason)
            self.assertEqual(c.lookup(k2).hits, 0, "a store of lost pages was committed")
            with self.assertRaises(kvside.KvsideError) as e:
                c.retrieve(4, k, [list(range(48, 48 + 2 * BPC))])
            self.assertEqual(e.exception.code_name, "E_DEVICE")
            # pages still there keep working; the server serves everyone else
            c.store(5, keys(3, 1), [list(range(0, BPC))])
            c.complete(5)
            self.assertEqual(c.job_wait(5, 5000), "committed")
            c2.store(6, keys(4, 2), [list(range(0, 2 * BPC))])
            c2.complete(6)
            self.assertEqual(c2.job_wait(6, 5000), "committed")
            self.assertEqual(c2.lookup(keys(4, 2)).hits, 2)
            st = c2.stats()
            self.assertEqual(st["retained_blocks"], 0)
            self.assertEqual(st["registrations"], 2)
        sealed.close()
        os.close(fd)


if __name__ == "__main__":
    unittest.main(verbosity=2)
