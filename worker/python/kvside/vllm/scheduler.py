"""The scheduler half of KvsideConnector: lookups, load and store plans.

Runs in vLLM's EngineCore process. It holds a ``scheduler``-role kvside
session (opened lazily, retried every ``reconnect_ms`` while the server is
absent: no server means no hits, never an error to vLLM). It mirrors each
request's block tables from the SchedulerOutputs (vLLM tells the connector
only of new blocks, so ids re-allocated to anyone else are marked stale),
and decides per step which chunks to load and to store.

Job ids are this engine's: a random 62-bit base plus a counter, so that a
restarted vLLM never reuses an id the server still remembers (protocol.md
9.5).
"""

import array
import logging
import os
import threading
import time

import kvside

from .config import chunk_key, ns_digest
from .groups import NULL, chunk_ids, has_blocks
from .meta import JobOp, KvsideConnectorMetadata

log = logging.getLogger("kvside.vllm")


class _Req:
    __slots__ = ("req", "keys", "tables", "hit", "stored", "jobs", "load_job", "finished", "lookup",
                 "pending", "load_failed")

    def __init__(self, req, n_groups):
        self.req = req
        self.keys = []            # chunk keys computed so far
        self.tables = [[] for _ in range(n_groups)]   # mirrored block tables
        self.hit = None           # (chunks, sync) answered by get_num_new_matched_tokens
        self.stored = 0           # chunks [0, stored) stored or planned
        self.jobs = set()         # store jobs not yet seen terminal
        self.load_job = None
        self.finished = False
        self.lookup = None        # (chunks asked, valid until, hits, tiers)
        self.pending = None       # (chunks asked, kvside.Pending): a lookup on its way
        self.load_failed = False  # a load of it failed: it recomputes, no more hits


class SchedulerSide:
    def __init__(self, cfg, engine, namespace, world, groups, n_tables, hash_block_size, load, store):
        """groups: the GroupInfos kvside keeps; n_tables: vLLM's number of
        KV-cache groups (block tables are mirrored for all, by vLLM index)."""
        self.cfg, self.engine, self.ns, self.world = cfg, engine, namespace, world
        self.groups, self.n_tables, self.hbs = groups, n_tables, hash_block_size
        self.C = cfg.chunk_tokens
        self.hashes_per_chunk = self.C // hash_block_size
        self.load_enabled, self.store_policy = load, store
        self.ns_key = ns_digest(namespace)
        self.has_recurrent = any(g.kind == "recurrent" for g in groups)
        self.volatile_groups = {g.index for g in groups if g.kind != "full"}
        self._reqs = {}
        self._owner = {}            # volatile groups' block id -> (req_id, group, slot)
        self._pending_loads, self._pending_stores = [], []
        self._finish_pending = set()
        self._job = (int.from_bytes(os.urandom(8), "little") >> 2) | 1
        self._client, self._next_open = None, 0.0
        self._no_lookup_until = 0.0
        self._lock = threading.Lock()
        self._done_jobs = {}        # job -> state, from job_done pushes
        self.stats = {"lookups": 0, "lookup_errors": 0, "hit_tokens": 0, "loads_planned": 0,
                      "stores_planned": 0, "chunks_planned": 0}

    # ---- the session --------------------------------------------------------------------

    def _on_event(self, ev):
        if ev.type == "job_done":
            with self._lock:
                self._done_jobs[ev.job] = ev.state

    def client(self):
        """The session, or None while the server is unreachable (retried every
        reconnect_ms)."""
        if self._client is not None:
            return self._client
        now = time.monotonic()
        if now < self._next_open:
            return None
        try:
            self._client = kvside.Client(self.engine, self.ns, role="scheduler", world=self.world,
                                         broker_dir=self.cfg.broker_dir, endpoint=self.cfg.endpoint,
                                         timeout_ms=self.cfg.open_timeout_ms or self.cfg.timeout_ms,
                                         on_event=self._on_event)
        except kvside.KvsideError as e:
            self._next_open = now + self.cfg.reconnect_ms / 1000.0
            log.warning("kvside: no server (%s); answering no hits for %d ms", e, self.cfg.reconnect_ms)
            return None
        return self._client

    def close(self):
        if self._client is not None:
            self._client.close()
            self._client = None

    def next_job(self):
        self._job += 1
        return self._job

    # ---- keys -----------------------------------------------------------------------------

    def _track(self, request):
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request, self.n_tables)
        st.req = request
        return st

    def _keys(self, st):
        """Extends st.keys from the request's block hashes (chunks whose last
        hash exists)."""
        hashes = st.req.block_hashes
        n = len(hashes) // self.hashes_per_chunk
        for c in range(len(st.keys), n):
            st.keys.append(chunk_key(self.ns_key, hashes[(c + 1) * self.hashes_per_chunk - 1]))
        return st.keys

    # ---- lookup and loads ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        st = self._track(request)
        st.hit = None
        if not self.load_enabled or st.load_job is not None or st.load_failed:
            # after a failed load the request recomputes: offering the same
            # hit again would fail the same way, load after load
            return 0, False
        keys = self._keys(st)
        # a hit must leave one token to compute (vLLM asserts it for a
        # synchronous load and recomputes the last token of an asynchronous
        # one, which a recurrent state at the chunk's end cannot allow)
        n_max = min(len(keys), (request.num_tokens - 1) // self.C)
        if n_max * self.C <= num_computed_tokens:
            return 0, False
        now = time.monotonic()
        cached = st.lookup
        if cached is not None and cached[0] == n_max and now < cached[1]:
            # a request waiting for blocks is asked again every step: its hit
            # is pinned for pin_ms, so the answer holds a while
            hits, tiers = cached[2], cached[3]
        else:
            lk = self._lookup(st, keys[:n_max], n_max, now)
            if lk is None:
                return 0, False
            if lk == "pending":
                return None, False  # vLLM asks again at a later step
            hits, tiers = lk.hits, lk.tiers
            st.lookup = (n_max, now + min(1.0, self.cfg.pin_ms / 2000.0), hits, tiers)
        n = hits
        if n * self.C <= num_computed_tokens:
            return 0, False
        # asynchronous: an L2 promotion (it does not hold the step); a model
        # with a recurrent group (vLLM align mode copies the state before
        # start_load_kv: only an asynchronous load lands before that); and
        # any model of several KV-cache groups, whose failed load vLLM
        # recovers only by request (failed_recving), never by block
        sync = self.n_tables == 1 and not self.has_recurrent and all(t == "l1" for t in tiers[:n])
        st.hit = (n, sync)
        ext = n * self.C - num_computed_tokens
        self.stats["hit_tokens"] += ext
        return ext, not sync

    def _lookup(self, st, keys, n_max, now):
        """The server's answer (a Lookup), "pending" while it is on its way,
        or None (no hit) when the server cannot be asked. Never blocks the
        EngineCore loop for longer than lookup_wait_ms: the lookup is sent
        asynchronously and the request is asked about again (vLLM re-asks a
        request for which get_num_new_matched_tokens answered None). After a
        failed lookup no lookup is tried for reconnect_ms, so an absent or
        restarting server does not hold requests for a time-out each."""
        pend = st.pending
        if pend is not None and pend[0] != n_max:
            pend = st.pending = None  # asked for other keys: a new lookup
        if pend is None:
            if now < self._no_lookup_until:
                return None
            c = self.client()
            if c is None:
                return None
            self.stats["lookups"] += 1
            try:
                p = c.lookup_async(keys, prefetch=True, pin_ms=self.cfg.pin_ms,
                                   timeout_ms=self.cfg.lookup_timeout_ms)
            except kvside.KvsideError as e:
                return self._lookup_failed(e.code_name, str(e), now)
            pend = st.pending = (n_max, p)
        p = pend[1]
        if not p.wait(self.cfg.lookup_wait_ms / 1000.0):
            return "pending"
        st.pending = None
        if p.code:
            err = kvside.KvsideError(p.code, "lookup", p.msg)
            return self._lookup_failed(err.code_name, str(err), now)
        return kvside.Lookup(p.hits, p.tiers)

    def _lookup_failed(self, code_name, what, now):
        self.stats["lookup_errors"] += 1
        if code_name in ("E_TIMEOUT", "ETIMEDOUT", "E_SESSION"):
            self._no_lookup_until = now + self.cfg.reconnect_ms / 1000.0
        log.warning("kvside: lookup failed (%s): no hit%s", what,
                    " for %d ms" % self.cfg.reconnect_ms if now < self._no_lookup_until else "")
        return None

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        st = self._track(request)
        hit, st.hit, st.lookup = st.hit, None, None
        st.tables = [[] for _ in range(self.n_tables)]
        self._append(request.request_id, st, blocks.get_block_ids())
        if num_external_tokens <= 0 or hit is None:
            return
        n, sync = hit
        skip = n * self.C - num_external_tokens
        lists = [array.array("q", chunk_ids(st.tables[g.index], g, 0, n, store=False)) for g in self.groups]
        op = JobOp(request.request_id, self.next_job(), b"".join(st.keys[:n]), lists, skip_tokens=skip,
                   sync=sync)
        st.load_job = op.job
        # st.stored stays: should the load fail, vLLM recomputes the prefix and
        # it is stored again; after a good load the server skips the chunks it
        # holds (protocol.md 10.2)
        self._pending_loads.append(op)
        self.stats["loads_planned"] += 1

    # ---- per step -------------------------------------------------------------------------

    def _mirror(self, so):
        """Updates the mirrored block tables from a SchedulerOutput; returns
        {req_id: tokens computed once this step ran}."""
        cr = so.scheduled_cached_reqs
        resumed = getattr(cr, "resumed_req_ids", set()) or set()
        fresh = set()
        for nr in so.scheduled_new_reqs:
            for t in nr.block_ids:
                fresh.update(t)
        for new in cr.new_block_ids:
            for t in (new or ()):
                fresh.update(t)
        fresh.discard(NULL)
        # a block handed out this step no longer holds what an older reference
        # to it saw: vLLM frees sliding-window blocks and old Mamba states while
        # a request runs, without telling connectors. Full-attention blocks are
        # freed only when a request finishes or is preempted, so only the
        # tables of those groups are indexed (block -> (request, group, slot)).
        for b in fresh:
            ref = self._owner.pop(b, None)
            if ref is not None:
                st = self._reqs.get(ref[0])
                if st is not None and ref[2] < len(st.tables[ref[1]]) and st.tables[ref[1]][ref[2]] == b:
                    st.tables[ref[1]][ref[2]] = NULL
        ends = {}
        for nr in so.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.tables = [[] for _ in range(self.n_tables)]
            self._append(nr.req_id, st, nr.block_ids)
            ends[nr.req_id] = nr.num_computed_tokens + so.num_scheduled_tokens.get(nr.req_id, 0)
        for i, rid in enumerate(cr.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new = cr.new_block_ids[i]
            if new is not None:
                if rid in resumed:
                    st.tables = [[] for _ in range(self.n_tables)]
                self._append(rid, st, new)
            ends[rid] = cr.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
        return ends

    def _append(self, rid, st, tables):
        for gi, t in enumerate(tables):
            tab = st.tables[gi]
            if gi in self.volatile_groups:
                for b in t:
                    if b != NULL:
                        self._owner[b] = (rid, gi, len(tab))
                    tab.append(b)
            else:
                tab.extend(t)

    def build_connector_meta(self, so):
        meta = KvsideConnectorMetadata()
        meta.loads, self._pending_loads = self._pending_loads, []
        meta.stores, self._pending_stores = self._pending_stores, []
        meta.finish_pending, self._finish_pending = self._finish_pending, set()
        meta.preempted = set(getattr(so, "preempted_req_ids", None) or ())
        for rid in meta.preempted:
            st = self._reqs.get(rid)
            if st is not None:
                st.tables = [[] for _ in range(self.n_tables)]
                st.load_job = None
        ends = self._mirror(so)
        if self.store_policy == "eager":
            for rid, end in ends.items():
                op = self._store_op(self._reqs[rid], end, step_end=end)
                if op is not None:
                    meta.stores.append(op)
        return meta

    def _store_op(self, st, end_tokens, step_end=None, at_step_start=False):
        """A store of the request's complete chunks [st.stored, end) that
        have keys, or None."""
        keys = self._keys(st)
        n_end = min(end_tokens // self.C, len(keys))
        first = st.stored
        if n_end <= first:
            return None
        lists, volatile = [], False
        for g in self.groups:
            ids = chunk_ids(st.tables[g.index], g, first, n_end - first, store=True)
            if g.kind == "recurrent":
                # a state exists only where a step ended: at end_tokens
                bpc = g.blocks_per_chunk
                for c in range(first, n_end):
                    if step_end is None or (c + 1) * self.C != step_end:
                        ids[(c - first) * bpc + bpc - 1] = NULL
            if g.index in self.volatile_groups and has_blocks(ids):
                volatile = True
            lists.append(array.array("q", ids))
        st.stored = n_end
        op = JobOp(st.req.request_id, self.next_job(), b"".join(keys[first:n_end]), lists,
                   volatile=volatile, at_step_start=at_step_start, names=self._names(st, first, n_end))
        st.jobs.add(op.job)
        self.stats["stores_planned"] += 1
        self.stats["chunks_planned"] += n_end - first
        return op

    def _names(self, st, first, end):
        """vLLM's own block hash of each chunk's last block, so that kvside's
        KV events (protocol.md 17) name chunks as vLLM's do; None unless they
        are 32-byte hashes (sha256 and sha256_cbor are)."""
        hashes = st.req.block_hashes
        out = []
        for c in range(first, end):
            h = hashes[(c + 1) * self.hashes_per_chunk - 1]
            if not isinstance(h, (bytes, bytearray)) or len(h) != 32:
                return None
            out.append(bytes(h))
        return b"".join(out)

    def _drain_done(self):
        """Forgets, in every request, the store jobs whose job_done came in."""
        with self._lock:
            done, self._done_jobs = self._done_jobs, {}
        if done:
            for st in self._reqs.values():
                st.jobs.difference_update(done)

    def update_connector_output(self, out):
        self._drain_done()
        bad = getattr(out, "invalid_block_ids", None)
        if bad:
            # vLLM recomputes from the first block that failed to load: those
            # chunks must be stored again (the workers did not publish them)
            for st in self._reqs.values():
                for g in self.groups:
                    t = st.tables[g.index]
                    first = next((i for i, b in enumerate(t) if b in bad), None)
                    if first is not None:
                        st.stored = min(st.stored, first // g.blocks_per_chunk)
                        st.load_failed = True
        for rid in (getattr(out, "failed_recving", None) or ()):
            st = self._reqs.get(rid)
            if st is not None:
                st.load_failed = True  # vLLM recomputes it from 0: stored again from 0
                st.stored = 0
        for rid in (out.finished_recving or ()):
            st = self._reqs.get(rid)
            if st is not None:
                st.load_job = None
        for rid in (out.finished_sending or ()):
            self._reqs.pop(rid, None)

    def request_finished(self, request, block_ids):
        """request_finished_all_groups: True (free later) while a store of the
        request may still read its blocks."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return False, None
        if block_ids and len(block_ids) == self.n_tables:
            st.tables = [[] for _ in range(self.n_tables)]
            self._append(request.request_id, st, block_ids)
        if self.store_policy == "finished":
            op = self._store_op(st, request.num_computed_tokens, at_step_start=True)
            if op is not None:
                self._pending_stores.append(op)
        self._drain_done()
        if st.jobs:
            st.finished = True
            self._finish_pending.add(request.request_id)
            return True, None
        self._reqs.pop(request.request_id, None)
        return False, None
