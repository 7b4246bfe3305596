#!/usr/bin/env python3
"""The seeds' qualification at their scale on one GPU (issue 40): a hybrid
model's KV cache on every rank, a 524,288-token request, engine-only and full
restarts, every byte compared.

  RANKS rank processes (one per TP rank, as an engine runs them) share one GPU.
  Each allocates one KV-cache tensor as large as fits beside the others (the
  seeds' 31.25 GiB profile is the aim) and registers one view per layer (as
  vLLM's per-layer tensors over one allocation): ATT attention layers (FP8:
  16 tokens x K,V x 2 heads x 256 = 16 KiB blocks) and REC recurrent
  (GDN-style) layers of 268 KiB states in 272 KiB padded slots. One chunk is
  256 tokens (16 attention blocks, one state slot).

  1. store: the request is stored as prefill produces it: one job per 8,192
     prefill tokens (32 chunks of attention blocks, the recurrent state at the
     step's end boundary; the other chunks' states null), paced by the L2
     write-behind queue; then retrieved into other blocks of the zeroed
     cache, every byte compared, every other byte still zero.
  2. engine-only restart: the ranks exit while the server lives (imports and
     aliases -> 0, L1 kept); new ranks register, restore from L1, compare;
     they are SIGKILLed (their sessions are reaped after the lease: imports
     -> 0 again); new ranks restore again.
  3. full restart: the ranks exit, the server stops (SIGTERM flushes L2) and
     starts again on its L2; new ranks restore from L2, compare.
  Throughout: no job aborted, no L2 write dropped, no session reaped but the
  SIGKILLed ones (a live session missing its heartbeat bound would be reaped),
  no client reconnect.

Memory kinds (QUAL_ALLOC): "kvside" (shareable cuMem memory from
kvside.torch_alloc: POSIX-fd imports), "torch" (plain torch.empty: legacy
CUDA IPC), "host" (memfds, the CPU check of this script itself at small
sizes: tests/python runs it in the test suite).

Environment: KVS_SERVER, KVSIDE_LIB, PYTHONPATH=worker/python:tests/python.
  QUAL_ALLOC kvside|torch|host, QUAL_RANKS (4), QUAL_TOKENS (524288),
  QUAL_KV_GIB per rank (31.25; lowered by 0.5 GiB steps until every rank's
  allocation fits), QUAL_ATT (16), QUAL_REC (36), QUAL_L1 (96G), QUAL_L2_GIB
  (request x 1.3), QUAL_DIR (TMPDIR), QUAL_FULL (1: the full restart),
  QUAL_SMALL (1: small blocks and states, for QUAL_ALLOC=host), QUAL_TTL_MS
  (the session lease, 10000), QUAL_L2_QUEUE (store steps wait for the L2
  write-behind queue to fall below it: 256 MiB).
Prints a markdown report; exit 0 when every check passed.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
for _d in ("worker/python", "tests/python"):  # kvside and kvt_server, here and in the rank processes
    _p = os.path.normpath(os.path.join(ROOT, _d))
    if _p not in sys.path:
        sys.path.insert(0, _p)
        os.environ["PYTHONPATH"] = _p + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                         else "")
NS = "qualify"
CHUNK = 256          # tokens per chunk (both groups)
TPB = 16             # attention tokens per block
BPC = CHUNK // TPB   # attention blocks per chunk
STEP = 8192          # prefill tokens per store job
MiB, GiB = 1 << 20, 1 << 30
RETRIEVE_JOB = {"store": 10001, "hold-reload": 10002, "reload": 10003, "l2": 10004}


def env_int(name, default):
    return int(os.environ.get(name, default))


class Shape:
    """The per-rank layout, the same on every rank."""

    def __init__(self, kv_bytes):
        small = os.environ.get("QUAL_SMALL") == "1"
        self.tokens = env_int("QUAL_TOKENS", 524288)
        self.att, self.rec = env_int("QUAL_ATT", 16), env_int("QUAL_REC", 36)
        self.page = 1024 if small else 16 * 2 * 2 * 256          # FP8 K+V, 2 heads of 256
        self.state = 3 * 1024 + 64 if small else 256 * 1024 + 12 * 1024  # ssm + conv state
        self.state_stride = 4 * 1024 if small else 272 * 1024            # padded slot
        self.chunks = self.tokens // CHUNK
        self.steps = self.tokens // STEP
        self.req_blocks = self.chunks * BPC
        self.slots = self.steps + 64                                     # slot 0 = null
        rec_bytes = self.rec * self.slots * self.state_stride
        self.blocks = (kv_bytes - rec_bytes) // (self.att * self.page)
        if self.blocks < self.req_blocks + 1:
            raise ValueError("%.2f GiB per rank hold %d blocks; the request needs %d" %
                             (kv_bytes / GiB, self.blocks, self.req_blocks))
        self.att_region = self.blocks * self.page
        self.rec_region = self.slots * self.state_stride
        self.bytes = self.att * self.att_region + self.rec * self.rec_region
        # what one rank stores: every attention block of the request and one state per step
        self.req_bytes = self.att * self.req_blocks * self.page + self.rec * self.steps * self.state

    def layer_offset(self, i):
        """Byte offset of layer i (attention layers first, then recurrent)."""
        if i < self.att:
            return i * self.att_region
        return self.att * self.att_region + (i - self.att) * self.rec_region


# ---- the rank process ---------------------------------------------------------------------

def pattern(torch, dev, rank, layer, first, count, width):
    """count units of `width` bytes (blocks or states), unit numbers first..:
    deterministic bytes from (rank, layer, unit), built on the device."""
    n8 = width // 8
    idx = torch.arange(count * n8, device=dev, dtype=torch.int64)
    idx += (first * n8) + ((rank * 1009 + layer) << 40)
    x = idx * -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: multiplication wraps
    x ^= (x >> 29) & 0x7FFFFFFFF
    x = x * 0x5851F42D4C957F2D
    x ^= (x >> 31) & 0x1FFFFFFFF
    return x.view(torch.uint8).view(count, width)


def nonzero(t):
    """Nonzero bytes of a tensor of rows, counted 64 MiB at a time (one
    count_nonzero over GiBs allocates its mask on a full device)."""
    rows = max(1, (64 * MiB) // max(1, t[0].numel())) if t.dim() > 1 and len(t) else 0
    if not rows:
        return int(t.count_nonzero())
    return sum(int(t[i:i + rows].count_nonzero()) for i in range(0, len(t), rows))


class Rank:
    def __init__(self, rank, world, run_dir, alloc, kv_bytes):
        import torch
        import kvside
        self.torch, self.kvside = torch, kvside
        self.rank, self.world, self.run_dir, self.alloc = rank, world, run_dir, alloc
        self.dev = torch.device("cpu" if alloc == "host" else "cuda", 0)
        self.mem = None
        self.kv = self._allocate(kv_bytes)
        self.shape = None

    def _allocate(self, want):
        torch = self.torch
        if self.alloc == "host":
            self.mem = self.kvside.HostMemory(want)
            self.got = want
            return torch.frombuffer(self.mem.buffer, dtype=torch.uint8)
        from kvside import torch_alloc
        step = GiB // 2
        while want >= 2 * GiB:
            try:
                if self.alloc == "kvside":
                    t = torch_alloc.empty((want,), dtype=torch.uint8, device=0)
                else:
                    t = torch.empty((want,), dtype=torch.uint8, device="cuda:0")
                self.got = want
                return t
            except (torch.cuda.OutOfMemoryError, RuntimeError):
                torch.cuda.empty_cache()
                want -= step
        raise RuntimeError("rank %d: not even 2 GiB of device memory" % self.rank)

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def layer(self, i):
        s = self.shape
        size = s.att_region if i < s.att else s.rec_region
        return self.kv[s.layer_offset(i):s.layer_offset(i) + size]

    def blocks_of(self, i):
        s = self.shape
        width = s.page if i < s.att else s.state_stride
        return self.layer(i).view(-1, width)

    def fill_source(self):
        """The request's source bytes: attention blocks 0..req_blocks-1, state
        slot 1+k holds the state at the end of prefill step k; all else zero."""
        s = self.shape
        self.kv.zero_()
        slab = max(1, (64 * MiB) // s.page)
        for i in range(s.att):
            b = self.blocks_of(i)
            for f in range(0, s.req_blocks, slab):
                n = min(slab, s.req_blocks - f)
                b[f:f + n].copy_(pattern(self.torch, self.dev, self.rank, i, f, n, s.page))
        for i in range(s.att, s.att + s.rec):
            b = self.blocks_of(i)
            for k in range(s.steps):
                b[1 + k, :s.state].copy_(pattern(self.torch, self.dev, self.rank, i, k, 1, s.state)[0])
        self.sync()

    def verify(self, shift, slot):
        """After a retrieve into attention blocks shift.. and state slot `slot`:
        every byte equal to the source's, every other byte zero."""
        torch, s = self.torch, self.shape
        bad, slab = [], max(1, (64 * MiB) // s.page)
        for i in range(s.att):
            b = self.blocks_of(i)
            for f in range(0, s.req_blocks, slab):
                n = min(slab, s.req_blocks - f)
                if not torch.equal(b[shift + f:shift + f + n],
                                   pattern(torch, self.dev, self.rank, i, f, n, s.page)):
                    bad.append("attention layer %d blocks %d..%d" % (i, f, f + n - 1))
                    break
            rest = nonzero(b[:shift]) + nonzero(b[shift + s.req_blocks:])
            if rest:
                bad.append("attention layer %d: %d nonzero bytes outside the destination" % (i, rest))
        for i in range(s.att, s.att + s.rec):
            b = self.blocks_of(i)
            want = pattern(torch, self.dev, self.rank, i, s.steps - 1, 1, s.state)[0]
            if not torch.equal(b[slot, :s.state], want):
                bad.append("recurrent layer %d: state slot %d differs" % (i, slot))
            nz = nonzero(b) - nonzero(b[slot, :s.state])
            if nz:
                bad.append("recurrent layer %d: %d nonzero bytes outside slot %d's state" % (i, nz, slot))
        self.sync()
        return bad

    def barrier(self, name):
        open(os.path.join(self.run_dir, "bar-%s-%d" % (name, self.rank)), "w").close()
        t = time.time() + 600
        while time.time() < t:
            if all(os.path.exists(os.path.join(self.run_dir, "bar-%s-%d" % (name, r)))
                   for r in range(self.world)):
                return
            time.sleep(0.01)
        raise RuntimeError("barrier %s timed out" % name)

    def agree_size(self):
        """Every rank registers the same layout: the smallest allocation."""
        with open(os.path.join(self.run_dir, "size-%d" % self.rank), "w") as f:
            f.write(str(self.got))
        self.barrier("size")
        got = min(int(open(os.path.join(self.run_dir, "size-%d" % r)).read()) for r in range(self.world))
        self.shape = Shape(got)

    def register(self, c):
        kvside, s = self.kvside, self.shape
        groups = [kvside.Group(0, "attention", TPB, BPC),
                  kvside.Group(1, "recurrent", CHUNK, 1, null_block=0)]
        n = s.att + s.rec
        if self.alloc == "host":
            layers = [kvside.Layer(0 if i < s.att else 1, 0, s.layer_offset(i),
                                   s.blocks if i < s.att else s.slots,
                                   s.page if i < s.att else s.state_stride,
                                   s.page if i < s.att else s.state) for i in range(n)]
            return c.register_memory([self.mem], groups, layers, timeout_ms=60000)
        from kvside import torch_alloc
        views = [self.layer(i) for i in range(n)]
        layers = [kvside.Layer(0 if i < s.att else 1, i, 0, s.blocks if i < s.att else s.slots,
                               s.page if i < s.att else s.state_stride,
                               s.page if i < s.att else s.state) for i in range(n)]
        return torch_alloc.register(c, views, groups, layers, timeout_ms=60000)


def keys_of(kvside):
    toks = [(i * 7919 + 13) % 151936 for i in range(env_int("QUAL_TOKENS", 524288))]
    return kvside.chunk_keys(NS, toks, CHUNK)


def rank_main(phase, rank, world, run_dir, alloc, kv_bytes, shift, slot, l2_queue_max):
    r = Rank(rank, world, run_dir, alloc, kv_bytes)
    r.agree_size()
    s = r.shape
    kvside = r.kvside
    keys = keys_of(kvside)
    out = {"rank": rank, "phase": phase, "kv_bytes": s.bytes, "allocated": r.got, "blocks": s.blocks,
           "req_bytes": s.req_bytes, "jobs": []}
    t0 = time.time()
    c = kvside.Client("qualify", NS, rank=rank, world=world, broker_dir=run_dir, timeout_ms=60000)
    reg = r.register(c)
    out["register_s"] = time.time() - t0
    r.barrier("registered-" + phase)
    if rank == 0:
        st = c.stats()
        out["at_register"] = {k: st[k] for k in ("imports", "aliases", "registrations", "sessions",
                                                 "l1_objects")}
        if alloc != "host":  # while every rank holds its cache
            out["gpu_memory"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True).stdout.strip()
    # the destination: other blocks than the source's (shift 0 would be the same ones)
    shift = -1 if shift < 0 else shift % (s.blocks - s.req_blocks + 1)
    shift = s.blocks - s.req_blocks if shift < 0 else shift
    if phase == "store":
        r.fill_source()
        r.barrier("filled-" + phase)
        for k in range(s.steps):
            # as prefill produces KV: not faster than the L2 write-behind takes
            # it (its queue is bounded; beyond the bound it drops writes)
            t_wait = time.time()
            while (l2_queue_max and c.stats().get("l2_queue_bytes", 0) > l2_queue_max and
                   time.time() - t_wait < 60):
                time.sleep(0.02)
            ch = range(k * STEP // CHUNK, (k + 1) * STEP // CHUNK)
            att = [b for j in ch for b in range(j * BPC, (j + 1) * BPC)]
            rec = [0] * (len(ch) - 1) + [1 + k]
            ts = time.time()
            c.store(100 + k, keys[ch.start:ch.stop], [att, rec])
            c.complete(100 + k)
            st = c.job_wait(100 + k, 60000)
            out["jobs"].append(("store", k, ts, time.time(), st))
    r.kv.zero_()
    r.sync()
    r.barrier("zeroed-" + phase)
    lk = c.lookup(keys)
    out["hits"], out["tiers"] = lk.hits, sorted(set(lk.tiers))
    r.barrier("looked-" + phase)
    ts = time.time()
    job = RETRIEVE_JOB[phase]
    c.retrieve(job, keys, [list(range(shift, shift + s.req_blocks)), [0] * (s.chunks - 1) + [slot]])
    c.complete(job)
    st = c.job_wait(job, 600000)
    r.sync()
    out["jobs"].append(("retrieve", 0, ts, time.time(), st))
    out["bad"] = r.verify(shift, slot)
    out["reconnects"] = c.reconnects
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    if phase.startswith("hold"):
        # wait to be SIGKILLed: the session and the registration stay behind
        time.sleep(3600)
    c.unregister(reg)
    c.close()
    return 0


# ---- the driver ---------------------------------------------------------------------------

class Driver:
    def __init__(self):
        import kvside
        import kvt_server
        self.kvside, self.kvt_server = kvside, kvt_server
        self.alloc = os.environ.get("QUAL_ALLOC", "kvside")
        self.world = env_int("QUAL_RANKS", 4)
        self.kv_bytes = int(float(os.environ.get("QUAL_KV_GIB", "31.25")) * GiB)
        self.lines, self.failures, self.expected_reaps = [], [], 0
        self.t0 = time.time()

    def say(self, text):
        line = "[%6.1f s] %s" % (time.time() - self.t0, text)
        print(line, flush=True)
        self.lines.append(line)

    def check(self, ok, what):
        if not ok:
            self.failures.append(what)
            self.say("FAIL: " + what)

    def server(self, l2_dir, l2_gib, fresh):
        if fresh:
            self.srv = self.kvt_server.Server(
                "--prefault", "true" if self.alloc != "host" else "false",
                "--job-deadline-ms", "120000", "--l2-path", l2_dir, "--l2-size", "%dG" % l2_gib,
                "--l2-sync", "none", l1_size=os.environ.get("QUAL_L1", "96G"), ttl_ms=env_int("QUAL_TTL_MS", 10000),
                heartbeat_ms=1000, prefix="kvq-")
        t = time.time()
        self.srv.start(timeout=300)
        up = time.time() - t
        self.obs = self.kvside.Client("qualify-observer", NS, role="scheduler", broker_dir=self.srv.run,
                                      timeout_ms=30000)
        return up

    def stats(self):
        return self.obs.stats(timeout_ms=30000)

    def wait_warm(self):
        """The L1 prefault and, on a GPU machine, the pinning done (all of L1
        pinned, or nothing more pinned for 3 s)."""
        t = time.time()
        last, since = -1, t
        while time.time() - t < 400:
            s = self.stats()
            pinned = s.get("cuda_pinned_bytes", 0)
            if pinned != last:
                last, since = pinned, time.time()
            settled = (s.get("cuda_available", 0) == 0 or pinned >= s["l1_capacity"] or
                       (pinned and not s.get("cuda_starting", 0) and time.time() - since > 3))
            if not s.get("l1_prefault_active", 0) and settled:
                break
            time.sleep(0.2)
        return time.time() - t, s

    def ranks(self, phase, shift, slot, l2_queue_max=0, hold=False):
        """Starts the rank processes of a phase; returns (procs, results)."""
        run = self.srv.run
        for f in os.listdir(run):
            if f.startswith(("bar-", "size-")):
                os.unlink(os.path.join(run, f))
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "rank", phase, str(r),
                                   str(self.world), run, self.alloc, str(self.kv_bytes), str(shift),
                                   str(slot), str(l2_queue_max)],
                                  stdout=subprocess.PIPE, text=True) for r in range(self.world)]
        got = [None] * len(procs)

        def read(i, p):
            for line in p.stdout:
                if line.startswith("RESULT "):
                    got[i] = json.loads(line[7:])
                    return

        readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
        for t in readers:
            t.start()
        deadline = time.time() + 900
        try:
            while any(g is None for g in got):
                gone = [p.returncode for p, g in zip(procs, got) if g is None and p.poll() is not None]
                if gone:
                    time.sleep(0.5)  # its result line may still be in the pipe
                    if any(g is None and p.poll() is not None for p, g in zip(procs, got)):
                        raise RuntimeError("a rank of phase %s exited %s without a result" % (phase, gone[0]))
                if time.time() > deadline:
                    raise RuntimeError("phase %s: no result from every rank in 900 s" % phase)
                time.sleep(0.05)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        res = got
        if not hold:
            for p in procs:
                self.check(p.wait(300) == 0, "%s: a rank exited with %s" % (phase, p.returncode))
        return procs, res

    def rate(self, res, kind):
        """Aggregate GB/s of each job (same job on every rank): world x bytes
        over first start .. last end; (median over jobs, min, max)."""
        per_job = {}
        for r in res:
            for k, n, ts, te, st in r["jobs"]:
                if k == kind:
                    per_job.setdefault(n, []).append((ts, te, st))
        rates, nbytes = [], res[0]["req_bytes"]
        steps = max(len(per_job), 1)
        for n, v in sorted(per_job.items()):
            span = max(te for _, te, _ in v) - min(ts for ts, _, _ in v)
            rates.append(len(v) * nbytes / steps / span / 1e9)
            self.check(all(st == "committed" for _, _, st in v), "%s job %d: %s" % (kind, n, v))
        rates.sort()
        return rates[len(rates) // 2], rates[0], rates[-1], sum(max(te for _, te, _ in v) -
                                                                 min(ts for ts, _, _ in v)
                                                                 for v in per_job.values())

    def restored(self, phase, res, tier):
        s = res[0]
        chunks = env_int("QUAL_TOKENS", 524288) // CHUNK
        for r in res:
            self.check(r["hits"] == chunks, "%s rank %d: %d of %d chunks hit" % (phase, r["rank"], r["hits"], chunks))
            self.check(r["tiers"] == [tier], "%s rank %d: tiers %s, not %s" % (phase, r["rank"], r["tiers"], tier))
            self.check(not r["bad"], "%s rank %d: %s" % (phase, r["rank"], "; ".join(r["bad"][:4])))
            self.check(r["reconnects"] == 0, "%s rank %d: %d reconnects" % (phase, r["rank"], r["reconnects"]))
        med, lo, hi, span = self.rate(res, "retrieve")
        self.say("%s: %d ranks x %d chunks hit (%s), retrieve %.2f GB of KV in %.2f s = %.1f GB/s, "
                 "byte-exact on every rank: %s" % (phase, len(res), s["hits"], tier, len(res) * s["req_bytes"] / 1e9,
                                                   span, med, all(not r["bad"] for r in res)))
        return med

    def registered(self, what, res):
        a = res[0]["at_register"]
        self.say("%s: imports %d, aliases %d, registrations %d, sessions %d (with this observer), "
                 "L1 objects %d; register took %.2f s at most" % (
                     what, a["imports"], a["aliases"], a["registrations"], a["sessions"], a["l1_objects"],
                     max(r["register_s"] for r in res)))
        if "gpu_memory" in res[0]:
            self.say("%s: GPU memory used, total: %s" % (what, res[0]["gpu_memory"]))
        self.check(a["imports"] == self.world and a["registrations"] == self.world,
                   "%s: %d imports, %d registrations for %d ranks" % (what, a["imports"], a["registrations"],
                                                                        self.world))

    def counts(self, what):
        s = self.stats()
        self.say("%s: imports %d, aliases %d, registrations %d, sessions %d, L1 objects %d (%.2f GB)" % (
            what, s["imports"], s["aliases"], s["registrations"], s["sessions"], s["l1_objects"],
            s["l1_bytes"] / 1e9))
        return s

    def wait_unregistered(self, what, timeout):
        t = time.time()
        while time.time() - t < timeout:
            s = self.stats()
            if s["imports"] == 0 and s["aliases"] == 0 and s["registrations"] == 0:
                break
            time.sleep(0.1)
        s = self.counts("%s (after %.2f s)" % (what, time.time() - t))
        self.check(s["imports"] == 0 and s["aliases"] == 0, what + ": imports and aliases not 0")
        return s

    def ceiling(self):
        if self.alloc == "host":
            return None
        code = ("import torch,time\n"
                "h=torch.empty(1<<30,dtype=torch.uint8).pin_memory();d=torch.empty(1<<30,dtype=torch.uint8,device='cuda')\n"
                "r={}\n"
                "for n,(a,b) in (('h2d',(d,h)),('d2h',(h,d))):\n"
                "  a.copy_(b);torch.cuda.synchronize();t=time.time()\n"
                "  for _ in range(8): a.copy_(b,non_blocking=True)\n"
                "  torch.cuda.synchronize();r[n]=8*(1<<30)/(time.time()-t)/1e9\n"
                "print(r['h2d'],r['d2h'])\n")
        h2d, d2h = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
        return h2d, d2h

    def main(self):
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 (a failure of the run, reported below)
            import traceback
            traceback.print_exc()
            self.failures.append("%s: %s" % (type(e).__name__, e))
        finally:
            try:
                self.srv.stop()
                log = self.srv.log(6000)
                print("---- server log (tail)\n" + log)
                self.srv.cleanup()
            except Exception as e:  # noqa: BLE001 (report, then the result)
                print("cleanup: %s" % e)
        print("\n## Summary\n")
        for l in self.lines:
            print("    " + l)
        print("\nRESULT: %s" % ("PASS" if not self.failures else "FAILED: " + "; ".join(self.failures)))
        return 0 if not self.failures else 1

    def run(self):
        base = os.environ.get("QUAL_DIR") or tempfile.gettempdir()
        work = tempfile.mkdtemp(prefix="kvq-l2-", dir=base)
        l2 = os.path.join(work, "l2")
        est = Shape(self.kv_bytes)
        need = self.world * est.req_bytes
        free = shutil.disk_usage(work).free
        l2_gib = int(os.environ.get("QUAL_L2_GIB", 0)) or max(1, int(need * 1.3 / GiB) + 1)
        self.say("alloc %s, %d ranks, %d tokens = %d chunks, %d attention + %d recurrent layers; "
                 "request %.2f GiB per rank (%.2f GiB in all); L2 %d GiB in %s (%.1f GiB free)" % (
                     self.alloc, self.world, est.tokens, est.chunks, est.att, est.rec, est.req_bytes / GiB,
                     need / GiB, l2_gib, work, free / GiB))
        if l2_gib * GiB > free:
            raise RuntimeError("the L2 needs %d GiB, the disk has %.1f GiB free" % (l2_gib, free / GiB))
        ceil = self.ceiling()
        if ceil:
            self.say("DMA ceiling (torch, pinned 1 GiB, this run): host->device %.1f GB/s, device->host %.1f GB/s"
                     % ceil)
        up = self.server(l2, l2_gib, True)
        warm, s = self.wait_warm()
        self.say("server up in %.2f s; L1 %.1f GiB prefaulted and pinned %.1f s later (pinned %.1f GiB)" % (
            up, s["l1_capacity"] / GiB, warm, s.get("cuda_pinned_bytes", 0) / GiB))
        # the L2 write-behind queue holds min(1 GiB, L1 / 4) (server/loop.c):
        # a store step waits for it to fall below QUAL_L2_QUEUE
        queue_max = env_int("QUAL_L2_QUEUE", 256 * MiB)

        # 1. store, then retrieve into other blocks in the same processes
        _, res = self.ranks("store", -1, 2, queue_max)
        r0 = res[0]
        self.say("ranks registered %.2f GiB each (allocated %s GiB): %d attention blocks, register %.2f s max" % (
            r0["kv_bytes"] / GiB, ", ".join("%.2f" % (r["allocated"] / GiB) for r in res), r0["blocks"],
            max(r["register_s"] for r in res)))
        self.registered("store ranks registered", res)
        med, lo, hi, span = self.rate(res, "store")
        jobs = [j for r in res for j in r["jobs"] if j[0] == "store"]
        wall = max(j[3] for j in jobs) - min(j[2] for j in jobs)
        self.say("store: %.1f s from the first job to the last (paced by the L2 write-behind: %.2f GB/s)" % (
            wall, self.world * r0["req_bytes"] / wall / 1e9))
        self.say("store: %d jobs of %d tokens per rank, %.2f GB in all; per job %.1f GB/s median "
                 "(%.1f..%.1f), %.1f s in jobs" % (len(r0["jobs"]) - 1, STEP, self.world * r0["req_bytes"] / 1e9,
                                                   med, lo, hi, span))
        if ceil:
            self.say("store at %.2f of the device->host ceiling" % (med / ceil[1]))
        rmed = self.restored("retrieve (same ranks, other blocks)", res, "l1")
        if ceil:
            self.say("retrieve at %.2f of the host->device ceiling" % (rmed / ceil[0]))
        # 2. engine-only restart: imports go to 0, L1 kept
        s = self.wait_unregistered("ranks exited", 30)
        l1_kept = s["l1_objects"]
        procs, res = self.ranks("hold-reload", 4096, est.slots - 1, hold=True)
        self.registered("new ranks registered", res)
        self.restored("engine-only restart 1 (exit)", res, "l1")
        t = time.time()
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(60)
        self.expected_reaps += self.world
        self.say("ranks SIGKILLed")
        s = self.wait_unregistered("ranks SIGKILLed: sessions reaped at the lease", 60)
        self.check(s["l1_objects"] == l1_kept, "L1 objects %d after the engine restart, %d before" % (
            s["l1_objects"], l1_kept))
        _, res = self.ranks("reload", 77, 5)
        self.registered("new ranks registered", res)
        self.restored("engine-only restart 2 (SIGKILL)", res, "l1")
        self.wait_unregistered("ranks exited", 30)
        s = self.stats()
        self.check_health(s, "before the full restart")
        if os.environ.get("QUAL_FULL", "1") != "1":
            return
        # 3. full restart: server and ranks
        self.obs.close()
        t = time.time()
        rc = self.srv.stop()
        self.say("server stopped (SIGTERM, L2 flushed) in %.2f s: exit %d; L2 held %d objects, %.2f GB" % (
            time.time() - t, rc, s["l2_objects"], s["l2_bytes"] / 1e9))
        self.check(rc == 0, "server exit %d" % rc)
        self.expected_reaps = 0
        up = self.server(l2, l2_gib, False)
        s = self.stats()
        self.say("server restarted on the L2 in %.2f s (L2 verified in %.2f s): %d objects in L2" % (
            up, s.get("l2_verify_us", 0) / 1e6, s["l2_objects"]))
        _, res = self.ranks("l2", 1, 3)
        self.registered("new ranks registered", res)
        self.restored("full restart (from L2)", res, "l2")
        self.wait_unregistered("ranks exited", 30)
        self.check_health(self.stats(), "after the full restart")

    def check_health(self, s, when):
        self.say("%s: jobs committed %d, aborted %d; sessions reaped %d (expected %d); L2 writes %d, "
                 "dropped %d, shed %d, errors %d; CUDA errors %d" % (
                     when, s["jobs_committed"], s["jobs_aborted"], s["sessions_reaped"], self.expected_reaps,
                     s["l2_writes"], s["l2_write_drops"], s["l2_writes_shed"], s["l2_write_errors"],
                     s.get("cuda_errors", 0)))
        self.check(s["jobs_aborted"] == 0, "%s: %d jobs aborted" % (when, s["jobs_aborted"]))
        self.check(s["sessions_reaped"] == self.expected_reaps, "%s: %d sessions reaped, %d expected" % (
            when, s["sessions_reaped"], self.expected_reaps))
        self.check(s["l2_write_drops"] == 0 and s["l2_writes_shed"] == 0 and s["l2_write_errors"] == 0,
                   "%s: L2 writes lost" % when)
        self.check(s.get("cuda_errors", 0) == 0, "%s: CUDA errors" % when)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        a = sys.argv[2:]
        sys.exit(rank_main(a[0], int(a[1]), int(a[2]), a[3], a[4], int(a[5]), int(a[6]), int(a[7]), int(a[8])))
    if os.environ.get("QUAL_ALLOC") == "host":
        try:
            import torch  # noqa: F401 (the check needs it)
        except ImportError:
            print("no torch for this python: skipped")
            sys.exit(77)
    sys.exit(Driver().main())


if __name__ == "__main__":
    main()
