#!/usr/bin/python3
"""Authenticated TCP (issue 16 #5): a tcp:// listen uses ZeroMQ CURVE by
default. The server creates its key pair in state-dir (0600) at first start
and admits clients by public key (authorized-keys, re-read when it changes);
a client without a key or with an unknown key gets nothing; operator
(admin) commands need an `admin` key on tcp (or the server's UID over ipc);
plain TCP only with insecure-tcp, and then never admin; a non-loopback bind
is warned about. Raw ZeroMQ clients (pyzmq, msgpack): the protocol as any
engine speaks it. Environment as tests/python/test_binding.py."""

import os
import socket
import stat
import subprocess
import time
import unittest

import kvside
from kvt_server import Server

try:
    import msgpack
    import zmq
except ImportError:  # not on the GPU image
    zmq = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    def __init__(self, ctx, endpoint, server_key=None, keys=None):
        self.s = ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        if server_key:
            pub, sec = keys
            self.s.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            self.s.setsockopt(zmq.CURVE_PUBLICKEY, pub)
            self.s.setsockopt(zmq.CURVE_SECRETKEY, sec)
        self.s.connect(endpoint)
        self.id = 0

    def call(self, op, timeout_ms=1500, **fields):
        self.id += 1
        m = {"v": 1, "op": op, "id": self.id}
        m.update(fields)
        self.s.send(msgpack.packb(m))
        if not self.s.poll(timeout_ms):
            return None
        return msgpack.unpackb(self.s.recv(), raw=False)

    def hello(self):
        return self.call("hello", engine="e", role="scheduler", rank=0, world=1, namespace="ns")

    def close(self):
        self.s.close(0)


@unittest.skipIf(zmq is None, "pyzmq/msgpack not installed")
class AuthTest(unittest.TestCase):
    def setUp(self):
        self.ctx = zmq.Context()
        self.peers = []

    def tearDown(self):
        for p in self.peers:
            p.close()
        self.ctx.destroy(linger=0)

    def peer(self, *a, **kw):
        p = Peer(self.ctx, *a, **kw)
        self.peers.append(p)
        return p

    def test_curve_keys_and_admin(self):
        port = free_port()
        srv = Server(prefix="kvt-auth-")
        state = os.path.join(srv.tmp, "state")
        keys = os.path.join(srv.tmp, "authorized_keys")
        client, admin, stranger = zmq.curve_keypair(), zmq.curve_keypair(), zmq.curve_keypair()
        # z85 keys may contain '#': only a '#' that begins a word starts a comment
        while b"#" not in client[0]:
            client = zmq.curve_keypair()
        with open(keys, "w") as f:
            f.write("# engines\n%s\n%s admin  # operator\nnot-a-key\n" % (client[0].decode(), admin[0].decode()))
        srv.extra = ["--listen", "tcp://127.0.0.1:%d" % port, "--state-dir", state, "--authorized-keys", keys]
        srv.start()
        try:
            kf = os.path.join(state, "server.key")
            self.assertEqual(stat.S_IMODE(os.stat(kf).st_mode), 0o600)
            with open(kf) as f:
                server_pub = f.read().split()[0].encode()
            ep = "tcp://127.0.0.1:%d" % port
            # no CURVE at all, and an unknown key: nothing comes back
            self.assertIsNone(self.peer(ep).hello())
            self.assertIsNone(self.peer(ep, server_pub, stranger).hello())
            # an authorized key: served, but not as an operator
            c = self.peer(ep, server_pub, client)
            rep = c.hello()
            self.assertTrue(rep and rep["ok"], rep)
            st = c.call("stats", session=rep["session"])
            self.assertTrue(st["ok"])
            self.assertGreaterEqual(st["counters"]["auth_refused"], 1)
            ad = c.call("admin", session=rep["session"], cmd="status")
            self.assertFalse(ad["ok"])
            self.assertEqual(ad["code"], "E_AUTH")
            # an admin key may
            a = self.peer(ep, server_pub, admin)
            rep = a.hello()
            self.assertTrue(a.call("admin", session=rep["session"], cmd="status")["ok"])
            # a key added while running is admitted without a restart
            time.sleep(0.01)
            with open(keys, "a") as f:
                f.write(stranger[0].decode() + "\n")
            os.utime(keys, None)
            self.assertTrue(self.peer(ep, server_pub, stranger).hello()["ok"])
            # libkvside (the Python binding) over tcp with CURVE keys
            with kvside.Client("lib", "ns", role="scheduler", endpoint=ep, timeout_ms=3000,
                               curve_keys=(server_pub, client[0], client[1])) as lc:
                self.assertIn("auth_refused", lc.stats())
                with self.assertRaises(kvside.KvsideError) as cm:
                    lc.admin("status")
                self.assertIn("E_AUTH", str(cm.exception))
            with kvside.Client("lib", "ns", role="scheduler", endpoint=ep, timeout_ms=3000,
                               curve_keys=(server_pub, admin[0], admin[1])) as lc:
                lc.admin("status")
            with self.assertRaises(kvside.KvsideError):  # a key not listed: no session
                kvside.Client("lib", "ns", role="scheduler", endpoint=ep, timeout_ms=1000,
                              curve_keys=(server_pub,) + zmq.curve_keypair())
            with self.assertRaises(ValueError):
                kvside.Client("lib", "ns", role="scheduler", endpoint=ep, curve_keys=(server_pub, client[0]))
            # kvside-ctl over tcp: an admin key may, a client key may not
            ctl = os.path.join(os.path.dirname(os.path.dirname(os.environ["KVS_SERVER"])), "worker", "kvside-ctl")
            for name, kp, want in (("admin", admin, 0), ("client", client, None)):
                kf2 = os.path.join(srv.tmp, name + ".keys")
                with open(kf2, "w") as f:
                    f.write("%s\n%s\n" % (kp[0].decode(), kp[1].decode()))
                p = subprocess.run([ctl, "--endpoint", ep, "--curve-server-key", server_pub.decode(),
                                    "--curve-keys", kf2, "--timeout", "3000", "drain", "--wait", "0"],
                                   capture_output=True, text=True, timeout=60)
                if want == 0:
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                else:
                    self.assertNotEqual(p.returncode, 0)
                    self.assertIn("E_AUTH", p.stdout + p.stderr)
            p = subprocess.run([ctl, "--endpoint", ep, "--timeout", "3000", "resume"], capture_output=True,
                               text=True, timeout=60)  # no key: no answer
            self.assertNotEqual(p.returncode, 0)
            p = subprocess.run([ctl, "--broker-dir", srv.run, "resume"], capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)  # the server's UID over ipc
            # over ipc, the server's own UID is an operator
            with kvside.Client("ops", "ns", role="scheduler", broker_dir=srv.run) as lc:
                self.assertTrue(lc.admin("status") is not None)
            # the key pair survives a restart (clients keep the server's key)
            srv.stop()
            srv.start()
            with open(kf) as f:
                self.assertEqual(f.read().split()[0].encode(), server_pub)
            self.assertTrue(self.peer(ep, server_pub, client).hello()["ok"])
        finally:
            srv.stop()
            srv.cleanup()

    def test_insecure_tcp_and_warnings(self):
        port = free_port()
        srv = Server("--listen", "tcp://0.0.0.0:%d" % port, "--insecure-tcp", "true", prefix="kvt-auth-")
        srv.start()
        try:
            p = self.peer("tcp://127.0.0.1:%d" % port)
            rep = p.hello()
            self.assertTrue(rep["ok"])
            ad = p.call("admin", session=rep["session"], cmd="status")
            self.assertEqual(ad["code"], "E_AUTH")  # never an operator without a key
        finally:
            srv.stop()
        self.assertIn("ANYONE who can reach this port", srv.log(20000))
        # a non-loopback bind with CURVE is announced too
        port = free_port()
        srv2 = Server("--listen", "tcp://0.0.0.0:%d" % port, prefix="kvt-auth-")
        srv2.extra += ["--state-dir", os.path.join(srv2.tmp, "state")]
        srv2.start()
        srv2.stop()
        self.assertIn("non-loopback address", srv2.log(20000))
        srv.cleanup()
        srv2.cleanup()


if __name__ == "__main__":
    unittest.main()
