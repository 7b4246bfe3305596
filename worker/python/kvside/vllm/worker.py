"""The worker half of KvsideConnector: one per TP rank.

Holds a ``worker``-role kvside session with one registration of the rank's
KV caches, and runs the jobs the scheduler half planned: a load is a
retrieve part and its complete sent back to back (the retrieve's reply
means this rank's bytes are in place); a store is one store part that
carries this rank's complete (``store_complete_async``: one message per rank
and job; a store whose blocks hold no valid KV sends its part and a failed
complete instead). The job's end (``job_done``, or the part's reply, which
comes then) means every rank's copies ended, after which vLLM may reuse the
blocks.

Ownership and invariants:
- ``_stores[job]`` is a store this rank submitted whose end it has not seen;
  it ends with job_done, a refused part, a reconnect (the server lost it) or
  ``save_wait_ms``. Until then its blocks may be read by the server.
- a volatile store (sliding-window or Mamba blocks) and every store of a
  preempted request end before the next forward writes KV
  (handle_preemptions, else start_load_kv); under vLLM's V2 model runner
  (``saves_end_in_step``), which writes new blocks before any connector
  hook, every store ends in the wait_for_save that issues it.
- ``_loads[req]`` is an asynchronous load not yet reported; it is reported
  once in finished_recving, with its blocks in the load errors if it failed.
- ``_late[job]`` is a load whose retrieve got no answer from the server (its
  request timed out, or the session was replaced): the server may still be
  copying into its blocks (protocol.md 9.7), so it is reported (as failed)
  only once the job ended: its job_done, or job_status answering a terminal
  state or "unknown" (a restarted server), or the server answering no
  job_status for late_load_gone_ms (taken as killed: its copies died with
  it). A synchronous load waits for that inside start_load_kv; an
  asynchronous one stays out of finished_recving until then.
"""

import logging
import os
import threading
import time

import kvside

from .groups import NULL, kvside_groups
from ..layout import LayoutError, block_views, make_shareable, view_extent, view_layer

log = logging.getLogger("kvside.vllm")


class _Store:
    __slots__ = ("req_id", "volatile", "deadline", "part", "event")

    def __init__(self, req_id, volatile, deadline):
        self.req_id, self.volatile, self.deadline, self.part = req_id, volatile, deadline, None
        self.event = None  # the CUDA event the server waits on, alive until the store ends


# a load that ended with one of these may not have heard from the server: its
# copies may still be running (an answer with E_TIMEOUT costs one job_status)
_NO_ANSWER = tuple(getattr(kvside, n) for n in ("E_TIMEOUT", "E_SESSION"))

# how often a late load asks job_status (a lost job_done push), and how long
# that call may hold the engine's loop
_LATE_POLL_S, _LATE_ASK_MS = 1.0, 100


class _Late:
    __slots__ = ("rid", "dst", "pending", "since", "next_ask", "heard", "ended")

    def __init__(self, rid, dst, pending):
        self.rid, self.dst, self.pending = rid, dst, pending
        self.since = self.next_ask = self.heard = time.monotonic()  # heard: the server's last answer
        self.ended = False


class WorkerSide:
    def __init__(self, cfg, engine, namespace, rank, world, groups, num_blocks, specs, saves_end_in_step=False):
        self.cfg, self.engine, self.ns = cfg, engine, namespace
        self.rank, self.world, self.groups = rank, world, groups
        self._group = {g.index: g for g in groups}  # vLLM group index -> GroupInfo
        # vLLM maps load-error block ids back to requests only with one
        # KV-cache group (block ids are per group): with several, a failed
        # load is reported by request (failed_recving, vLLM >= 0.32), and the
        # scheduler half makes every load of such a model asynchronous
        self._by_request = len(specs) > 1 and _has_failed_recving()
        self.num_blocks, self.specs = num_blocks, specs  # specs: per group, the vLLM spec
        self.saves_end_in_step = saves_end_in_step
        self.client, self.handle, self.device = None, None, None
        self._cv = threading.Condition()
        self._stores = {}        # job -> _Store
        self._ended = set()      # store jobs ended before this rank saw them submitted
        self._loads = {}         # req_id -> (Pending, destination ids)
        self._late = {}          # job -> _Late: a load without the server's answer, not yet ended
        self._load_errors = set()
        self._failed_recv = set()  # requests whose asynchronous load failed, not yet reported
        self._finish_pending = set()
        self._finished_seen = set()
        self._cuda_sync = None
        self._memfds = []  # make_shareable's memfds behind the registered CPU caches (closed at close)
        self._failed_now = set()  # requests whose synchronous load failed this step
        self.stats = {"loads": 0, "load_errors": 0, "stores": 0,
                      "store_failures": 0, "save_waits_ms": 0, "store_messages": 0}

    # ---- registration -----------------------------------------------------------------------

    def register(self, kv_caches, group_of_layer):
        """kv_caches: {layer name: tensor or list of tensors}. group_of_layer:
        {layer name: group index} (names outside every group are skipped, as
        are aliases of a tensor already seen)."""
        # vLLM's CPU caches are anonymous torch.zeros: into sealed memfds
        # (their bytes are still zero; every layer's tensor re-pointed)
        self._memfds = make_shareable([t for n, t in kv_caches.items() if n in group_of_layer])
        views, seen = [], set()
        for name, t in kv_caches.items():
            g = group_of_layer.get(name)
            if g is None:
                continue
            for v in block_views(t, self.num_blocks, name):
                v = self._trim(v, g)
                if (v.ptr, g) in seen:
                    continue
                seen.add((v.ptr, g))
                views.append((g, v, t[0] if isinstance(t, (list, tuple)) else t))
        if not views:
            raise LayoutError("kvside: no KV-cache tensor of a known group to register")
        cuda = {bool(getattr(t, "is_cuda", False)) for _, _, t in views}
        if len(cuda) != 1:
            raise LayoutError("kvside: KV caches are partly on the GPU, partly in host memory")
        self.device = "cuda" if cuda.pop() else "host"
        self._open()
        groups = kvside_groups(self.groups)
        if self.device == "cuda":
            dev = views[0][2].device.index or 0
            self._cuda_sync = views[0][2]
            buffers, layers = [], []
            for i, (g, v, _) in enumerate(views):
                lo, hi = view_extent(v, self.num_blocks)
                buffers.append((lo, hi - lo))
                layers.append(kvside.Layer(g, i, 0, self.num_blocks, v.block_stride, v.block_bytes))
            self.handle = self.client.register_cuda(buffers, groups, layers, device=dev)
            return
        allocs, by_inode, layers = [], {}, []
        try:
            for g, v, _ in views:
                layers.append(view_layer(allocs, by_inode, g, v, self.num_blocks, "KV cache view of group %d" % g))
            self.handle = self.client.register_memory([(a.fd, a.size) for a in allocs], groups, layers)
        finally:
            for a in allocs:
                os.close(a.fd)

    def _trim(self, v, g):
        """A Mamba page holds the states then padding: copy only the states."""
        spec = self.specs[g]
        shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
        if self._group[g].kind != "recurrent" or not shapes or not dtypes:
            return v
        n = 0
        for shape, dt in zip(shapes, dtypes):
            k = 1
            for d in shape:
                k *= d
            n += k * (dt.itemsize if hasattr(dt, "itemsize") else _dtype_size(dt))
        return v._replace(block_bytes=min(v.block_bytes, n))

    def _open(self):
        self.client = kvside.Client(self.engine, self.ns, role="worker", rank=self.rank, world=self.world,
                                    broker_dir=self.cfg.broker_dir, endpoint=self.cfg.endpoint,
                                    timeout_ms=self.cfg.timeout_ms, on_event=self._on_event)

    def close(self):
        if self.client is not None:
            self.client.close()
            self.client = None
        for fd in self._memfds:
            os.close(fd)  # (the engine's mapping of each stays)
        self._memfds = []

    # ---- events -------------------------------------------------------------------------------

    def _on_event(self, ev):
        with self._cv:
            if ev.type == "job_done":
                late = self._late.get(ev.job)
                if late is not None:
                    late.ended = True
                elif self._stores.pop(ev.job, None) is None:
                    self._ended.add(ev.job)
                    if len(self._ended) > 65536:
                        self._ended.clear()
            elif ev.type == "reconnected":
                # the server restarted: the jobs it had are gone
                self._stores.clear()
            self._cv.notify_all()

    def _end_store(self, job):
        with self._cv:
            self._stores.pop(job, None)
            self._cv.notify_all()

    # ---- loads --------------------------------------------------------------------------------

    def _sync_stream(self):
        """The server reads and writes device memory outside this process's
        streams: work queued on the current stream (a forward writing KV,
        vLLM zeroing new blocks) must be done before it starts."""
        if self._cuda_sync is not None:
            import torch
            torch.cuda.current_stream(self._cuda_sync.device).synchronize()

    def _producer_event(self):
        """CUDA: an interprocess event recorded on the current stream, which
        the server waits on before a store's copies (protocol.md 16): the
        step's kernels writing the blocks are ordered before the copies
        without holding this process (vLLM's async scheduling keeps its
        overlap). (event, 64-byte handle), or (None, None) on the host."""
        if self._cuda_sync is None:
            return None, None
        import torch
        ev = torch.cuda.Event(interprocess=True)
        ev.record(torch.cuda.current_stream(self._cuda_sync.device))
        return ev, bytes(ev.ipc_handle())

    def start_load_kv(self, meta):
        self._fence(meta)
        self._failed_now = set()
        early = [op for op in meta.stores if op.at_step_start]
        if meta.loads:
            # the server writes loads into device memory: what the stream
            # has queued for those blocks (vLLM zeroing them) must be done
            self._sync_stream()
        for op in early:
            self._submit_store(op)
        if not meta.loads:
            return
        sync = []
        for op in meta.loads:
            dst = self._dest_ids(op)
            try:
                p = self.client.retrieve_async(op.job, op.keys, op.blocks, op.skip_tokens,
                                               timeout_ms=self.cfg.load_timeout_ms)
                self.client.complete_async(op.job, True, timeout_ms=self.cfg.load_timeout_ms)
            except (kvside.KvsideError, AttributeError) as e:
                log.warning("kvside: load of %s not sent (%s)", op.req_id, e)
                p = kvside.Pending("retrieve", op.job)
                p.code = -1
                p.done.set()
            self.stats["loads"] += 1
            if op.sync:
                sync.append((op.req_id, p, dst))
            else:
                self._loads[op.req_id] = (p, dst)
        deadline = time.monotonic() + self.cfg.load_timeout_ms / 1000.0
        for rid, p, dst in sync:
            ok = p.wait(max(0.0, deadline - time.monotonic())) and not p.code
            if not ok:
                if self._unanswered(p):
                    # the step cannot go on while the server may write its blocks
                    self._wait_late(self._late_load(rid, dst, p))
                self._load_failed(rid, dst, p)
                self._failed_now.add(rid)

    def _unanswered(self, p):
        """True when the server never answered this load's retrieve."""
        return not p.done.is_set() or p.code in _NO_ANSWER

    def _late_load(self, rid, dst, p):
        late = _Late(rid, dst, p)
        with self._cv:
            self._late[p.job] = late
        log.warning("kvside: load of %s got no answer (%s): its %d blocks stay the server's until job %#x ends",
                    rid, kvside.KvsideError(p.code).code_name if p.code else "timeout", len(dst), p.job)
        return late

    def _late_ended(self, job, late):
        """True once the late load's job ended (then it leaves _late). Asks
        job_status at most every _LATE_POLL_S, for a job_done that did not
        reach this session (a replaced session is not on the job's parts)."""
        now = time.monotonic()
        if not late.ended and now >= late.next_ask:
            late.next_ask = now + _LATE_POLL_S
            try:
                st = self.client.job_status([job], timeout_ms=_LATE_ASK_MS)
                late.heard = now
                late.ended = bool(st) and st[0].state in ("committed", "aborted", "unknown")
            except (kvside.KvsideError, AttributeError) as e:  # ask again later
                if getattr(e, "code_name", "E_TIMEOUT") not in ("E_TIMEOUT", "ETIMEDOUT"):
                    late.heard = now  # an answer, if an error: the server is there
                elif now - late.heard >= self.cfg.late_load_gone_ms / 1000.0:
                    log.warning("kvside: the server answered nothing for %.1f s: taken as gone, and with "
                                "it job %#x's copies into %s's blocks", now - late.heard, job, late.rid)
                    late.ended = True
        if late.ended:
            with self._cv:
                self._late.pop(job, None)
            log.warning("kvside: job %#x of %s ended %.1f s after its load gave up", job, late.rid,
                        now - late.since)
        return late.ended

    def _wait_late(self, late):
        job = late.pending.job
        while not self._late_ended(job, late):
            with self._cv:
                if not late.ended:
                    self._cv.wait(max(0.01, late.next_ask - time.monotonic()))

    def _dest_ids(self, op):
        """The blocks the retrieve writes: those past the tokens the engine
        already holds (skip_tokens: vLLM's local prefix-cache hit, whose
        blocks other requests share and kvside never writes)."""
        out = set()
        for g, lst in zip(self.groups, op.blocks):
            first = op.skip_tokens // g.block_size
            out.update(b for b in lst[first:] if b != NULL)
        return out

    def _load_failed(self, rid, dst, p):
        self.stats["load_errors"] += 1
        why = p.msg or (kvside.KvsideError(p.code).code_name if p.code else "timeout")
        if self._by_request:
            self._failed_recv.add(rid)
            log.warning("kvside: load of %s failed (%s): reported for recompute", rid, why)
            return
        self._load_errors |= dst
        log.warning("kvside: load of %s failed (%s): %d blocks reported for recompute", rid, why, len(dst))

    def get_block_ids_with_load_errors(self):
        out, self._load_errors = self._load_errors, set()
        return out

    # ---- stores -------------------------------------------------------------------------------

    def wait_for_save(self, meta):
        ops = [op for op in meta.stores if not op.at_step_start]
        if not ops:
            return
        for op in ops:
            # vLLM discards this step's output of a request whose load failed:
            # its blocks hold no valid KV, so its store is sent and failed
            # (every rank's part is then dropped, nothing is published)
            self._submit_store(op, ok=op.req_id not in self._failed_now)
        if self.saves_end_in_step:
            self._wait_stores({op.job for op in ops})

    def _submit_store(self, op, ok=True):
        if self.client is None:
            return
        rec = _Store(op.req_id, op.volatile, time.monotonic() + self.cfg.save_wait_ms / 1000.0)
        with self._cv:
            if op.job in self._ended:
                return
            self._stores[op.job] = rec
        # the kernels that wrote the blocks, queued on this stream, come first
        rec.event, handle = self._producer_event()
        job = op.job
        self.stats["stores"] += 1

        def refused(p):
            if p.code:
                self.stats["store_failures"] += 1
                self._end_store(job)   # no job_done may come (session lost)
        try:
            if ok:
                # one message per rank and job (protocol.md 6.7): the part
                # carries this rank's complete, and its reply comes at the
                # job's end (a job_done event as well), so it may take as
                # long as the fence waits for a save
                rec.part = self.client.store_complete_async(op.job, op.keys, op.blocks,
                                                            timeout_ms=self.cfg.save_wait_ms,
                                                            callback=refused, event_hashes=op.names,
                                                            producer_event=handle)
                self.stats["store_messages"] += 1
            else:
                rec.part = self.client.store_async(op.job, op.keys, op.blocks, timeout_ms=self.cfg.timeout_ms,
                                                   callback=refused, event_hashes=op.names,
                                                   producer_event=handle)
                self.client.complete_async(op.job, False, timeout_ms=self.cfg.timeout_ms)
                self.stats["store_messages"] += 2
        except kvside.KvsideError as e:
            log.warning("kvside: store of %s not sent (%s)", op.req_id, e)
            self.stats["store_failures"] += 1
            self._end_store(job)

    def _wait_until_ended(self, blocking):
        """Waits while a store for which blocking(job, store) holds has not
        ended; a store past its save_wait_ms deadline is given up (its
        blocks released)."""
        t0 = time.monotonic()
        with self._cv:
            while True:
                now = time.monotonic()
                for job, s in list(self._stores.items()):
                    if now > s.deadline:
                        log.warning("kvside: store job %d of %s did not end in %d ms; its blocks "
                                    "are released", job, s.req_id, self.cfg.save_wait_ms)
                        del self._stores[job]
                left = [s for j, s in self._stores.items() if blocking(j, s)]
                if not left:
                    break
                self._cv.wait(min(s.deadline for s in left) - now + 0.001)
        self.stats["save_waits_ms"] += int((time.monotonic() - t0) * 1000)

    def _wait_stores(self, jobs):
        """Waits until these store jobs ended (bounded by save_wait_ms each)."""
        self._wait_until_ended(lambda j, s: j in jobs)

    def _fence(self, meta):
        """Waits for the stores whose blocks this step may overwrite: volatile
        ones and those of preempted requests (bounded by save_wait_ms)."""
        self._wait_until_ended(lambda j, s: s.volatile or s.req_id in meta.preempted)

    handle_preemptions = _fence

    # ---- completion ---------------------------------------------------------------------------

    def get_finished(self, meta, finished_req_ids):
        if meta is not None:
            self._finish_pending |= meta.finish_pending
        self._finished_seen |= set(finished_req_ids or ())
        sending = set()
        if self._finish_pending:
            with self._cv:
                busy = {s.req_id for s in self._stores.values()}
            for rid in list(self._finish_pending):
                if rid in self._finished_seen and rid not in busy:
                    sending.add(rid)
                    self._finish_pending.discard(rid)
                    self._finished_seen.discard(rid)
        if len(self._finished_seen) > 65536:
            self._finished_seen = set(self._finish_pending)
        recving = set()
        for rid, (p, dst) in list(self._loads.items()):
            if p.done.is_set():
                del self._loads[rid]
                if self._unanswered(p):
                    self._late_load(rid, dst, p)
                    continue
                if p.code:
                    self._load_failed(rid, dst, p)
                recving.add(rid)
        for job, late in list(self._late.items()):
            if self._late_ended(job, late):
                self._load_failed(late.rid, late.dst, late.pending)
                recving.add(late.rid)
        failed, self._failed_recv = self._failed_recv, set()
        return sending, recving, failed

    def pending_work(self):
        with self._cv:
            return bool(self._stores) or bool(self._loads) or bool(self._late)

    def shutdown(self, wait_s=5.0):
        deadline = time.monotonic() + wait_s
        with self._cv:
            while self._stores and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
        self.close()


def _has_failed_recving():
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    except ImportError:
        return False
    return "failed_recving" in getattr(KVConnectorTransferResults, "__dataclass_fields__", {})


def _dtype_size(dt):
    import torch
    return torch.empty((), dtype=dt).element_size()
