"""Measures what ZeroMQ holds for peers that send part of an 8 MiB message and
stall (ZMTP 3.0, NULL mechanism, spoken raw over the ipc endpoint): the
server's RSS before and after N such peers (default 48), and after they
close. A measurement for docs/security.md, not a test. Environment as
tests/python/test_binding.py; usage: measure_zmtp_input.py [N]"""
import os, socket, struct, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvt_server import Server

def rss(pid):
    for l in open("/proc/%d/status" % pid):
        if l.startswith("VmRSS:"): return int(l.split()[1])

def peer(path, nbytes):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(path)
    greet = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
    s.sendall(greet)
    s.recv(64)
    props = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    body = b"\x05READY" + props
    s.sendall(bytes([0x04, len(body)]) + body)
    size = 8 << 20
    s.sendall(bytes([0x02]) + struct.pack(">Q", size))
    chunk = b"x" * (1 << 20)
    sent = 0
    while sent < nbytes:
        s.sendall(chunk[: min(len(chunk), nbytes - sent)]); sent += min(len(chunk), nbytes - sent)
    return s

srv = Server(prefix="kvt-zmtp-", ttl_ms=20000); srv.start()
path = os.path.join(srv.run, "kvside.zmq")
r0 = rss(srv.proc.pid)
socks = [peer(path, (8 << 20) - 4096) for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 48)]
time.sleep(1)
r1 = rss(srv.proc.pid)
print("peers %d: server RSS %d KiB -> %d KiB (+%d MiB)" % (len(socks), r0, r1, (r1 - r0) >> 10))
for s in socks: s.close()
time.sleep(1); print("after close: %d KiB" % rss(srv.proc.pid))
srv.stop(); srv.cleanup()
