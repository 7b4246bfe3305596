"""Shared pieces of the L3 tier tests (tests/l3/test_l3_*.py): two kvside
servers sharing one Redis Cluster, rank processes (tests/l3/l3_rank.py, one
process per rank, driven over pipes), the data pattern every test checks
byte for byte, and the L3 record format (storage/kvs_record.h) to read and
plant records in Redis under kvside keys.

Environment: KVS_SERVER, KVSIDE_LIB, PYTHONPATH (worker/python and
tests/python), as tests/python. KVT_L3_BREAK=nol3 starts the servers without
--l3-redis: every test must then fail (how their assertions were shown able
to fail)."""

import ctypes
import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time

import kvside
from kvt_server import Server

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import redis_cluster  # noqa: E402
from redis_cluster import RedisCluster, RespError  # noqa: E402,F401

SKIP = 77
NS = "l3-model:salt"
TPB, BPC = 16, 4           # tokens per block, blocks per chunk
CHUNK_TOKENS = TPB * BPC
HDR = 96
MAGIC = b"KVL2"
VERSION = 2


def skip_unless_ready():
    """Exit 77 (meson skip) without redis-server or pyzmq."""
    if not redis_cluster.have_redis():
        print("redis-server or redis-cli not found: skipped")
        sys.exit(SKIP)


def broken():
    return os.environ.get("KVT_L3_BREAK", "")


# ---- keys and data ------------------------------------------------------------

def prompt_tokens(prompt, n_chunks):
    """Token ids of prompt number `prompt` (distinct prompts share no chunk)."""
    base = (prompt * 7919 + 13) * 100003
    return [(base + i) & 0x7fffffff for i in range(n_chunks * CHUNK_TOKENS)]


def prompt_keys(prompt, n_chunks, ns=NS):
    return kvside.chunk_keys(ns, prompt_tokens(prompt, n_chunks), CHUNK_TOKENS)


def block_pattern(chunk_key, layer, j, size, rank=0):
    """The bytes of block j (0..BPC-1) of layer `layer` of a chunk on a rank: a
    function of the chunk key and rank alone, so that any process can check them."""
    tag = bytes([layer, j]) + (struct.pack("<I", rank) if rank else b"")
    seed = int.from_bytes(hashlib.blake2b(chunk_key + tag, digest_size=8).digest(), "little")
    return random.Random(seed).randbytes(size)


def object_data(chunk_key, layers, block, rank=0):
    """An object's data as the server lays it out: layer by layer, the chunk's
    blocks_per_chunk blocks each (protocol.md §14.2)."""
    return b"".join(block_pattern(chunk_key, l, j, block, rank) for l in range(layers) for j in range(BPC))


def ns_digest(ns=NS):
    return hashlib.blake2b(ns.encode(), digest_size=16).digest()  # libsodium generichash, 16 bytes


def objkey(chunk_key, world=1, rank=0, group=0, ns=NS):
    """kvs_objkey (storage/kvs_l1.h, server/keys.c kvs_obj_key): 64 bytes."""
    return bytes(chunk_key) + ns_digest(ns) + struct.pack("<IIII", world, rank, group, 0)


def geom_fingerprint(layers, block, kind=0, tpb=TPB, bpc=BPC, window=-1):
    """Geometry fingerprint of a group (protocol.md §14.2)."""
    raw = struct.pack("<QQQqQ", kind, tpb, bpc, window, layers) + b"".join(struct.pack("<Q", block)
                                                                        for _ in range(layers))
    return hashlib.blake2b(raw, digest_size=8).digest()


def redis_key(okey, prefix="kvside:", part=0):
    k = prefix.encode() + okey
    return k if part == 0 else k + b"#%d" % part


# ---- the record format (storage/kvs_record.h) ---------------------------------

_xxh = ctypes.CDLL("libxxhash.so.0")
_xxh.XXH3_64bits.restype = ctypes.c_uint64
_xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_xxh.XXH3_64bits_withSeed.restype = ctypes.c_uint64
_xxh.XXH3_64bits_withSeed.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]


def xxh3(data, seed=None):
    if seed is None:
        return _xxh.XXH3_64bits(data, len(data))
    return _xxh.XXH3_64bits_withSeed(data, len(data), seed)


class Header:
    """The 96-byte header: magic, version, flags, geom, len, checksum, key."""
    FMT = "<4sHH8sQQ64s"

    def __init__(self, raw):
        (self.magic, self.version, self.flags, self.geom, self.len, self.checksum,
         self.key) = struct.unpack(self.FMT, raw[:HDR])

    def pack(self, checksum=None):
        return struct.pack(self.FMT, self.magic, self.version, self.flags, self.geom, self.len,
                           self.checksum if checksum is None else checksum, self.key)

    def seed(self, read_key):
        """kvs_record_seed: XXH3-64 of the header, checksum 0, key = read_key."""
        return xxh3(struct.pack(self.FMT, self.magic, self.version, self.flags, self.geom, self.len, 0,
                                read_key))

    def sum(self, data, read_key):
        return xxh3(data, self.seed(read_key))


def make_record(okey, data, geom, read_key=None, version=VERSION, key_field=None, flags=0):
    """A record (header + data) with a valid checksum for read_key (default:
    okey); key_field/version/geom as given (planted foreign records)."""
    h = Header(bytes(HDR))
    h.magic, h.version, h.flags, h.geom, h.len = MAGIC, version, flags, geom, len(data)
    h.key = key_field if key_field is not None else okey
    h.checksum = 0
    return h.pack(h.sum(data, read_key if read_key is not None else okey)) + data


def split_record(record, part_bytes):
    """Parts of a record as the tier writes them: part 0 = the first
    part_bytes bytes (header included), then part_bytes each."""
    if len(record) <= part_bytes:
        return [record]
    return [record[i:i + part_bytes] for i in range(0, len(record), part_bytes)]


# ---- the cluster ----------------------------------------------------------------

class Cluster(RedisCluster):
    """RedisCluster plus routing by key (MOVED followed), masters, and a
    wait for a cluster that lost nodes."""

    def alive(self):
        out = []
        for p in self.ports:
            try:
                if self.call(p, "PING", timeout=0.5) == "PONG":
                    out.append(p)
            except (OSError, RespError):
                pass
        return out

    def slot_map(self, port=None):
        """[(first, last, master port, [replica ports])] from CLUSTER SLOTS."""
        for p in ([port] if port else self.alive()):
            try:
                return [(r[0], r[1], r[2][1], [x[1] for x in r[3:]]) for r in self.call(p, "CLUSTER", "SLOTS")]
            except (OSError, RespError):
                continue
        raise RuntimeError("no node answers CLUSTER SLOTS")

    def masters_now(self):
        return sorted({m for _, _, m, _ in self.slot_map()})

    def node_id(self, port):
        return self.call(port, "CLUSTER", "MYID").decode()

    def route(self, *args, key=None, tries=6):
        """One keyed command, following MOVED/ASK like a cluster client."""
        key = key if key is not None else args[1]
        slot = self.call(self.alive()[0], "CLUSTER", "KEYSLOT", key)
        port = next(m for a, b, m, _ in self.slot_map() if a <= slot <= b)
        asking = False
        for _ in range(tries):
            try:
                if asking:
                    return self._asking(port, *args)
                return self.call(port, *args)
            except RespError as e:
                w = str(e).split()
                if w[0] in ("MOVED", "ASK"):
                    port, asking = int(w[2].rsplit(":", 1)[1]), w[0] == "ASK"
                    continue
                raise
        raise RuntimeError("too many redirections for %r" % (args,))

    def _asking(self, port, *args):
        import socket
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            f = s.makefile("rb")
            s.sendall(redis_cluster._enc(["ASKING"]) + redis_cluster._enc(list(args)))
            redis_cluster._read(f)
            return redis_cluster._read(f)

    def wait_serving(self, timeout=30):
        """Until every slot is served by a live master and every live node says
        cluster_state:ok (after a kill: the replica promoted)."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            try:
                alive = self.alive()
                ok = True
                for p in alive:
                    info = self.call(p, "CLUSTER", "INFO").decode()
                    if "cluster_state:ok" not in info:
                        ok = False
                if ok and alive and all(m in alive for m in self.masters_now()):
                    return True
            except (OSError, RespError, RuntimeError):
                pass
            time.sleep(0.1)
        return False

    def count_prefix(self, prefix=b"kvside:"):
        """Keys with the prefix over all live masters (SCAN)."""
        n = 0
        for p in self.masters_now():
            cur = b"0"
            while True:
                cur, keys = self.call(p, "SCAN", cur, "MATCH", prefix + b"*", "COUNT", 1000)
                n += len(keys)
                if cur == b"0":
                    break
        return n


def start_cluster(masters=3, replicas=1, node_timeout=1000):
    rc = Cluster(masters=masters, replicas=replicas, node_timeout=node_timeout)
    rc.start()
    return rc


# ---- servers ----------------------------------------------------------------------

def l3_server(seeds, *extra, l2=True, l1_size="64M", prefix="kvt-l3-", lookup_ms=None, timeout_ms=None,
              part_bytes=None, write=None, log_level=None):
    """A Server with L3 on (unless KVT_L3_BREAK=nol3), L2 in its own directory."""
    args = []
    if broken() == "slowlookup":  # lookups that wait 3 s for L3: the down test's bounds must fail
        lookup_ms = 3000
    if broken() != "nol3":
        args += ["--l3-redis", seeds]
    if lookup_ms is not None:
        args += ["--l3-lookup-ms", str(lookup_ms)]
    if timeout_ms is not None:
        args += ["--l3-timeout-ms", str(timeout_ms)]
    if part_bytes is not None:
        args += ["--l3-part-bytes", str(part_bytes)]
    if write is not None:
        args += ["--l3-write", write]
    if log_level:
        args += ["--log-level", log_level]
    if broken() == "nol3":  # the deliberately broken run: no L3 flag at all
        args = [a for i, a in enumerate(args) if not a.startswith("--l3-") and
                not (i and args[i - 1].startswith("--l3-"))]
    return Server(*(args + list(extra)), l2=l2, l1_size=l1_size, prefix=prefix, ttl_ms=5000)


def teardown(holder, ranks=(), servers=("s1", "s2")):
    """Closes holder's ranks (the attributes named, and any Rank in a list
    named "ranks"), stops and removes its servers, stops its cluster: a
    test class's tearDownClass, whatever setUpClass got to."""
    for name in ranks:
        if hasattr(holder, name):
            getattr(holder, name).close()
    for r in getattr(holder, "ranks", None) or []:
        r.close()
    for name in servers:
        if hasattr(holder, name):
            getattr(holder, name).stop()
            getattr(holder, name).cleanup()
    if hasattr(holder, "rc"):
        holder.rc.stop()


def scheduler(srv, timeout_ms=5000, ns=NS):
    return kvside.Client("sched", ns, role="scheduler", broker_dir=srv.run, timeout_ms=timeout_ms)


def wait_written(srv, n_objects, timeout=20):
    """Until srv's write-behind has dealt with n_objects L3 writes (written,
    failed or dropped) and its queue is empty; returns the stats."""
    return srv.wait_stat(lambda s: s.get("l3_writes", 0) + s.get("l3_write_errors", 0) +
                         s.get("l3_write_drops", 0) >= n_objects and s.get("l3_queue_bytes", 1) == 0,
                         timeout)


def delta(after, before, name):
    return after.get(name, 0) - before.get(name, 0)


def l3_stats(st):
    return {k: v for k, v in st.items() if k.startswith("l3_") or k in ("hits_l3", "hits_l2")}


# ---- rank processes -------------------------------------------------------------

class Rank:
    """A rank process (l3_rank.py): its own memfd region of `layers` layers of
    nb blocks of `block` bytes, one attention group (TPB, BPC), registered
    with srv under NS. Calls go over its stdin/stdout as JSON lines."""

    def __init__(self, srv, engine, layers=2, nb=256, block=16 << 10, rank=0, world=1, timeout_ms=5000, ns=NS):
        self.layers, self.nb, self.block = layers, nb, block
        env = dict(os.environ)
        # the rank imports what this process imports (kvside, l3lib)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(x) for x in sys.path if x)
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "l3_rank.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env)
        r = self.call(op="open", broker_dir=srv.run, engine=engine, ns=ns, layers=layers, nb=nb, block=block,
                      rank=rank, world=world, timeout_ms=timeout_ms)
        if not r.get("ok"):
            raise RuntimeError("rank open: %s" % r)

    def send(self, **cmd):
        """Sends a command without waiting (ranks of one job run at once)."""
        self.p.stdin.write((json.dumps(cmd) + "\n").encode())
        self.p.stdin.flush()

    def recv(self):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("rank process died (%s)" % self.p.poll())
        return json.loads(line)

    def call(self, **cmd):
        self.send(**cmd)
        return self.recv()

    def store_async(self, job, keys, first_block, timeout_ms=None):
        self.send(op="store", job=job, keys=[k.hex() for k in keys], first=first_block, timeout_ms=timeout_ms)

    def retrieve_async(self, job, keys, first_block, timeout_ms=None):
        self.send(op="retrieve", job=job, keys=[k.hex() for k in keys], first=first_block, timeout_ms=timeout_ms)

    def store(self, job, keys, first_block, timeout_ms=None):
        return self.call(op="store", job=job, keys=[k.hex() for k in keys], first=first_block, timeout_ms=timeout_ms)

    def retrieve(self, job, keys, first_block, timeout_ms=None):
        """{ok, wrong_bytes, untouched, code, t}: wrong_bytes counts bytes that
        differ from the pattern after a successful retrieve; untouched says
        the destination still holds its sentinel after a failed one."""
        return self.call(op="retrieve", job=job, keys=[k.hex() for k in keys], first=first_block,
                         timeout_ms=timeout_ms)

    def close(self):
        if self.p.poll() is None:
            try:
                self.call(op="exit")
            except (RuntimeError, BrokenPipeError, ValueError):
                pass
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.send_signal(signal.SIGKILL)
                self.p.wait()
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass


# ---- raw heartbeats (pyzmq + msgpack) ------------------------------------------

class RawPeer:
    """A raw ZeroMQ session (the protocol as any engine speaks it): round trips
    of heartbeat and stats, timed without libkvside's I/O thread."""

    def __init__(self, srv):
        import msgpack
        import zmq
        self.msgpack, self.zmq = msgpack, zmq
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect("ipc://" + os.path.join(srv.run, "kvside.zmq"))
        self.id = 0
        r = self.call("hello", engine="hb", role="scheduler", rank=0, world=1, namespace=NS)
        if not r or not r.get("ok"):
            raise RuntimeError("raw hello: %r" % r)
        self.session = r["session"]

    def call(self, op, timeout_ms=5000, **fields):
        self.id += 1
        m = {"v": 1, "op": op, "id": self.id}
        m.update(fields)
        self.s.send(self.msgpack.packb(m))
        t_end = time.monotonic() + timeout_ms / 1000
        while True:
            left = int((t_end - time.monotonic()) * 1000)
            if left <= 0 or not self.s.poll(left):
                return None
            r = self.msgpack.unpackb(self.s.recv(), raw=False)
            if r.get("id") == self.id:
                return r

    def rtt(self, op, **fields):
        t = time.monotonic()
        r = self.call(op, session=self.session, **fields)
        if not r or not r.get("ok"):
            raise RuntimeError("%s: %r" % (op, r))
        return time.monotonic() - t

    def close(self):
        self.s.close(0)
        self.ctx.term()


def pct(v, p):
    v = sorted(v)
    if not v:
        return 0.0
    k = max(0, min(len(v) - 1, int(-(-p * len(v) // 1)) - 1))
    return v[k]
