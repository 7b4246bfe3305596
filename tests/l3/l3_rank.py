#!/usr/bin/python3
"""One rank process of the L3 tests (driven by l3lib.Rank): a memfd region
registered with one kvside server; JSON-line commands on stdin, one JSON
reply line each on stdout.

  open     broker_dir engine ns layers nb block rank world timeout_ms
  store    job keys(hex) first      writes each chunk's pattern into blocks
                                    first.. (BPC per chunk), store + complete,
                                    waits for job_done
  retrieve job keys(hex) first      fills blocks first.. with a sentinel,
                                    retrieve + complete, then compares every
                                    byte with the pattern (wrong_bytes), or,
                                    on failure, checks the sentinel is intact
  exit"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvside  # noqa: E402
import l3lib  # noqa: E402

SENTINEL = 0xA5


class RankProc:
    def open(self, broker_dir, engine, ns, layers, nb, block, rank, world, timeout_ms):
        self.layers, self.nb, self.block, self.rank = layers, nb, block, rank
        self.timeout_ms = timeout_ms
        self.mem = kvside.HostMemory(layers * nb * block, name="kvt-l3-rank")
        self.c = kvside.Client(engine, ns, role="worker", rank=rank, world=world, broker_dir=broker_dir,
                               timeout_ms=timeout_ms)
        self.c.register_memory([self.mem], groups=[kvside.Group(0, "attention", l3lib.TPB, l3lib.BPC)],
                               layers=[kvside.Layer(0, 0, l * nb * block, nb, block, block)
                                       for l in range(layers)])
        return {"ok": True}

    def off(self, layer, block_id):
        return (layer * self.nb + block_id) * self.block

    def ids(self, n_keys, first):
        return [[first + i for i in range(n_keys * l3lib.BPC)]]

    def store(self, job, keys, first, timeout_ms=None):
        keys = [bytes.fromhex(k) for k in keys]
        if first + len(keys) * l3lib.BPC > self.nb:
            return {"ok": False, "code": "bad test: blocks out of range"}
        v = self.mem.view
        for i, k in enumerate(keys):
            for l in range(self.layers):
                for j in range(l3lib.BPC):
                    o = self.off(l, first + i * l3lib.BPC + j)
                    v[o:o + self.block] = l3lib.block_pattern(k, l, j, self.block, self.rank)
        t = time.monotonic()
        tm = timeout_ms or self.timeout_ms
        try:
            self.c.store(job, keys, self.ids(len(keys), first), timeout_ms=tm)
            self.c.complete(job, timeout_ms=tm)
            state = self.c.job_wait(job, tm)
        except kvside.KvsideError as e:
            return {"ok": False, "code": e.code_name, "msg": str(e), "t": time.monotonic() - t}
        return {"ok": state == "committed", "state": state, "t": time.monotonic() - t}

    def retrieve(self, job, keys, first, timeout_ms=None):
        keys = [bytes.fromhex(k) for k in keys]
        if first + len(keys) * l3lib.BPC > self.nb:
            return {"ok": False, "code": "bad test: blocks out of range"}
        v = self.mem.view
        sent = bytes([SENTINEL]) * self.block
        ranges = [self.off(l, first + i) for l in range(self.layers) for i in range(len(keys) * l3lib.BPC)]
        for o in ranges:
            v[o:o + self.block] = sent
        t = time.monotonic()
        tm = timeout_ms or self.timeout_ms
        out = {"ok": True}
        try:
            self.c.retrieve(job, keys, self.ids(len(keys), first), timeout_ms=tm)
        except kvside.KvsideError as e:
            out = {"ok": False, "code": e.code_name, "msg": str(e)}
        out["t"] = time.monotonic() - t
        try:
            self.c.complete(job, ok=out["ok"], timeout_ms=tm)
        except kvside.KvsideError as e:
            out.setdefault("complete_error", e.code_name)
        if out["ok"]:
            wrong, wrong_chunks = 0, []
            for i, k in enumerate(keys):
                bad = 0
                for l in range(self.layers):
                    for j in range(l3lib.BPC):
                        o = self.off(l, first + i * l3lib.BPC + j)
                        got = bytes(v[o:o + self.block])
                        want = l3lib.block_pattern(k, l, j, self.block, self.rank)
                        if got != want:
                            bad += sum(a != b for a, b in zip(got, want))
                if bad:
                    wrong_chunks.append(i)
                wrong += bad
            out["wrong_bytes"], out["wrong_chunks"] = wrong, wrong_chunks
        else:
            out["untouched"] = all(bytes(v[o:o + self.block]) == sent for o in ranges)
        return out


def main():
    r = RankProc()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            out = getattr(r, op)(**cmd)
        except kvside.KvsideError as e:
            out = {"ok": False, "code": e.code_name, "msg": str(e)}
        except Exception as e:  # report, keep serving
            out = {"ok": False, "code": "exception", "msg": repr(e)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    try:
        r.c.close()
        r.mem.close()
    except AttributeError:
        pass


if __name__ == "__main__":
    main()
