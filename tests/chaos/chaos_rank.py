#!/usr/bin/python3
"""One rank process of the chaos suite: a kvside.Client session (worker role)
with a memfd HostMemory region registered as one attention group (one layer,
blocks_per_chunk bpc, 16 tokens per block). The first half of the blocks are
store sources, the second half retrieve destinations. Reads JSON commands on
stdin, answers each with one JSON line on stdout (the first line: ready).

Every object it stores is chaos_lib.object_bytes(rank, key); every object it
retrieves is compared with that, byte by byte: `wrong_bytes` in a reply is
what the server served wrong. Every request is timed against its own timeout
(`dl`: requests made, those answered late).

Usage: chaos_rank.py RUN_DIR ENGINE NS RANK WORLD BLOCKS BLOCK_BYTES BPC TIMEOUT_MS"""

import json
import os
import select
import sys
import time

import kvside
from chaos_lib import Deadlines, err_name, keys_of, object_bytes

SENTINEL = 0xA5


class LineIn:
    """stdin as lines, with a non-blocking "is a line there?" (select on the
    fd would miss lines already read into a buffer)."""

    def __init__(self, fd=0):
        self.fd, self.buf = fd, b""

    def _fill(self, timeout):
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return True
        data = os.read(self.fd, 65536)
        self.buf += data
        return bool(data)

    def ready(self):
        return b"\n" in self.buf or (self._fill(0) and b"\n" in self.buf)

    def readline(self):
        while b"\n" not in self.buf:
            if not self._fill(None):
                return None
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


STDIN = LineIn()


class RankProc:
    def __init__(self, run, engine, ns, rank, world, blocks, block_bytes, bpc, timeout_ms):
        self.ns, self.rank, self.world = ns, rank, world
        self.blocks, self.bb, self.bpc = blocks, block_bytes, bpc
        self.obj = bpc * block_bytes
        self.ct = 16 * bpc
        self.timeout_ms = timeout_ms
        self.half = blocks // 2
        self.slots = max(1, self.half // bpc)  # source chunk slots, used round-robin
        self.next_slot = 0
        self.flip = os.environ.get("KVT_CHAOS_FLIP_BYTE") == "1"
        self.flipped = False
        self.events = []
        self.mem = kvside.HostMemory(blocks * block_bytes, name="kvt-chaos-r%d" % rank)
        self.c = kvside.Client(engine, ns, role="worker", rank=rank, world=world, broker_dir=run,
                               timeout_ms=timeout_ms, on_event=self.events.append)
        self.handle = self.c.register_memory(
            [self.mem], groups=[kvside.Group(0, "attention", 16, bpc)],
            layers=[kvside.Layer(0, 0, 0, blocks, block_bytes, block_bytes)], timeout_ms=timeout_ms)

    # -- blocks
    def src_ids(self, n):
        """Source block ids for n chunks: consecutive slots of the ring (a
        slot is reused only after every other one, so a copy that a killed
        server left unfinished never meets a rewrite of its source)."""
        if n > self.slots:
            raise ValueError("%d chunks, %d slots" % (n, self.slots))
        ids = []
        for _ in range(n):
            s = self.next_slot
            self.next_slot = (self.next_slot + 1) % self.slots
            ids += [s * self.bpc + i for i in range(self.bpc)]
        return ids

    def write_obj(self, ids, data):
        v = self.mem.view
        for i, b in enumerate(ids):
            v[b * self.bb:(b + 1) * self.bb] = data[i * self.bb:(i + 1) * self.bb]

    def read_obj(self, ids):
        v = self.mem.view
        return b"".join(bytes(v[b * self.bb:(b + 1) * self.bb]) for b in ids)

    # -- commands
    def store(self, dl, job, prompt, first=0, n=1, timeout_ms=None, complete=True, ok=True, wait=True):
        t = timeout_ms or self.timeout_ms
        keys = keys_of(self.ns, prompt, first + n, self.ct)[first:]
        ids = self.src_ids(n)
        for k in range(n):
            self.write_obj(ids[k * self.bpc:(k + 1) * self.bpc], object_bytes(self.rank, keys[k], self.obj))
        out = {"job": job}
        t0 = time.monotonic()
        st, e = dl.call("store", t, self.c.store, job, keys, [ids])
        out["store"] = err_name(e) or st
        if complete and e is None:
            st, e = dl.call("complete", t, self.c.complete, job, ok)
            out["complete"] = err_name(e) or st
        if wait and complete and e is None:
            st, e = dl.call("job_wait", t, self.c.job_wait, job)
            out["final"] = err_name(e) or st
        out["ms"] = round((time.monotonic() - t0) * 1000)
        return out

    def retrieve(self, dl, job, prompt, first=0, n=1, timeout_ms=None, complete=True):
        t = timeout_ms or self.timeout_ms
        keys = keys_of(self.ns, prompt, first + n, self.ct)[first:]
        ids = [self.half + i for i in range(n * self.bpc)]
        v = self.mem.view
        v[self.half * self.bb:(self.half + n * self.bpc) * self.bb] = bytes([SENTINEL]) * (n * self.bpc * self.bb)
        st, e = dl.call("retrieve", t, self.c.retrieve, job, keys, [ids])
        out = {"job": job, "retrieve": err_name(e) or st, "wrong_bytes": 0, "wrong_chunks": [],
               "written_on_error": 0, "chunks_ok": 0, "chunks_unwritten": 0}
        if e is None:
            unwritten = bytes([SENTINEL]) * self.obj
            for k in range(n):
                cids = ids[k * self.bpc:(k + 1) * self.bpc]
                if self.flip and not self.flipped and st == "open":  # dry run: the check must catch this
                    b = cids[0] * self.bb + 7
                    v[b] = v[b] ^ 0x01
                    self.flipped = True
                got = self.read_obj(cids)
                want = object_bytes(self.rank, keys[k], self.obj)
                if got == want:
                    out["chunks_ok"] += 1
                elif st == "aborted" and got == unwritten:
                    # a part that reached a job another rank had aborted
                    # already: answered "aborted", nothing copied (§9.3)
                    out["chunks_unwritten"] += 1
                else:
                    out["wrong_bytes"] += sum(1 for x, y in zip(got, want) if x != y)
                    out["wrong_chunks"].append(first + k)
        else:
            got = bytes(v[self.half * self.bb:(self.half + n * self.bpc) * self.bb])
            out["written_on_error"] = len(got) - got.count(SENTINEL)
        if complete:
            st, e2 = dl.call("complete", t, self.c.complete, job, e is None)
            out["complete"] = err_name(e2) or st
        return out

    def loop(self, dl, job0, prompt0, n=4, timeout_ms=None, sync_dir=None):
        """Stores jobs job0, job0+1, ... (prompt prompt0+i, n chunks each)
        until a line arrives on stdin — or, with sync_dir (the ranks of one
        job), until the job id in sync_dir/stop is passed: each rank writes
        the job it is at to sync_dir/rank<r>, the test writes a stop id
        beyond them all, and every rank stops after the same job."""
        res = []
        i = 0
        prog = os.open(os.path.join(sync_dir, "rank%d" % self.rank), os.O_WRONLY | os.O_CREAT, 0o600) \
            if sync_dir else -1
        stop_at = None
        while True:
            if sync_dir:
                if stop_at is None:
                    try:
                        with open(os.path.join(sync_dir, "stop")) as f:
                            stop_at = int(f.read())
                    except (OSError, ValueError):
                        pass
                if stop_at is not None and job0 + i > stop_at:
                    break
                os.pwrite(prog, b"%20d" % (job0 + i), 0)
            if STDIN.ready():  # with sync_dir: only when the test gives up
                STDIN.readline()
                break
            res.append(self.store(dl, job0 + i, prompt0 + i, 0, n, timeout_ms))
            i += 1
        if prog >= 0:
            os.close(prog)
        return {"jobs": res}

    def wait_reconnect(self, count, timeout_ms=20000):
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline:
            if self.c.reconnects >= count and any(ev.type == "reconnected" for ev in self.events):
                errs = [ev.error for ev in self.events if ev.type == "reconnected"]
                return {"reconnects": self.c.reconnects, "error": errs[-1]}
            time.sleep(0.02)
        return {"reconnects": self.c.reconnects, "error": "not reconnected"}

    def handle_cmd(self, cmd):
        op = cmd.pop("op")
        dl = Deadlines()
        if op == "store":
            out = self.store(dl, **cmd)
        elif op == "retrieve":
            out = self.retrieve(dl, **cmd)
        elif op == "loop":
            out = self.loop(dl, **cmd)
        elif op == "wait_reconnect":
            out = self.wait_reconnect(**cmd)
        elif op == "unregister":
            _, e = dl.call("unregister", cmd.get("timeout_ms", self.timeout_ms), self.c.unregister, self.handle)
            out = {"unregister": err_name(e) or "ok"}
        elif op == "stats":
            st, e = dl.call("stats", self.timeout_ms, self.c.stats)
            out = {"stats": st, "error": err_name(e)}
        else:
            out = {"error": "unknown op %s" % op}
        out["dl"] = {"requests": dl.requests, "late": dl.late}
        return out


def main():
    a = sys.argv[1:]
    try:
        rp = RankProc(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5]), int(a[6]), int(a[7]), int(a[8]))
    except kvside.KvsideError as e:
        print(json.dumps({"ok": False, "error": err_name(e), "msg": str(e)}), flush=True)
        return 3
    print(json.dumps({"ok": True}), flush=True)
    while True:
        line = STDIN.readline()
        if line is None:
            break
        cmd = json.loads(line)
        if cmd.get("op") == "exit":
            break
        print(json.dumps(rp.handle_cmd(cmd)), flush=True)
    rp.c.close()
    rp.mem.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
