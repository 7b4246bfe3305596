"""Raw access to a kvside L2 environment for the chaos suite, with the server
stopped: ctypes over liblmdb.so.0 (the library the server links), and the
page-level edits LMDB itself would never make — swapping two records'
overflow-page pointers in their leaf nodes, and writing random bytes over
B-tree pages. Everything here is deliberate damage."""

import ctypes
import mmap
import os
import random

MDB_RDONLY = 0x20000
MDB_FIRST, MDB_NEXT = 0, 8
MDB_NOTFOUND = -30798
PAGEHDRSZ = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA = 0x01
OBJKEY_BYTES = 64   # the server's object key (kvs_objkey)


class _Val(ctypes.Structure):
    _fields_ = [("mv_size", ctypes.c_size_t), ("mv_data", ctypes.c_void_p)]


class _EnvInfo(ctypes.Structure):
    _fields_ = [("me_mapaddr", ctypes.c_void_p), ("me_mapsize", ctypes.c_size_t),
                ("me_last_pgno", ctypes.c_size_t), ("me_last_txnid", ctypes.c_size_t),
                ("me_maxreaders", ctypes.c_uint), ("me_numreaders", ctypes.c_uint)]


class _Stat(ctypes.Structure):
    _fields_ = [("ms_psize", ctypes.c_uint), ("ms_depth", ctypes.c_uint), ("ms_branch_pages", ctypes.c_size_t),
                ("ms_leaf_pages", ctypes.c_size_t), ("ms_overflow_pages", ctypes.c_size_t),
                ("ms_entries", ctypes.c_size_t)]


_lib = ctypes.CDLL("liblmdb.so.0")
_lib.mdb_strerror.restype = ctypes.c_char_p
_P = ctypes.c_void_p


class LmdbError(Exception):
    pass


def _ck(rc, what):
    if rc:
        raise LmdbError("%s: %s" % (what, _lib.mdb_strerror(rc).decode()))


class Env:
    """An LMDB environment opened on the L2 directory (server stopped)."""

    def __init__(self, path, readonly=False):
        self.env = _P()
        _ck(_lib.mdb_env_create(ctypes.byref(self.env)), "env_create")
        _lib.mdb_env_set_maxdbs(self.env, 4)
        size = os.path.getsize(os.path.join(path, "data.mdb"))
        _ck(_lib.mdb_env_set_mapsize(self.env, ctypes.c_size_t(size)), "set_mapsize")
        _ck(_lib.mdb_env_open(self.env, path.encode(), MDB_RDONLY if readonly else 0, 0o600), "env_open")
        self.readonly = readonly
        self.path = os.path.realpath(os.path.join(path, "data.mdb"))

    def map_base(self):
        """Where LMDB mapped data.mdb in this process (me_mapaddr is only
        set with MDB_FIXEDMAP)."""
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5] == self.path and parts[2] == "00000000":
                    return int(parts[0].split("-")[0], 16)
        raise LmdbError("data.mdb is not mapped")

    def close(self):
        if self.env:
            _lib.mdb_env_close(self.env)
            self.env = None

    def info(self):
        i = _EnvInfo()
        _lib.mdb_env_info(self.env, ctypes.byref(i))
        return i

    def psize(self):
        s = _Stat()
        _lib.mdb_env_stat(self.env, ctypes.byref(s))
        return s.ms_psize

    def _txn(self, readonly):
        t = _P()
        _ck(_lib.mdb_txn_begin(self.env, None, MDB_RDONLY if readonly else 0, ctypes.byref(t)), "txn_begin")
        return t

    def _dbi(self, txn, name):
        d = ctypes.c_uint()
        _ck(_lib.mdb_dbi_open(txn, name.encode(), 0, ctypes.byref(d)), "dbi_open " + name)
        return d

    def records(self, db="obj"):
        """[(key bytes, value bytes, page number of the value's first page)]."""
        txn = self._txn(True)
        try:
            dbi = self._dbi(txn, db)
            cur = _P()
            _ck(_lib.mdb_cursor_open(txn, dbi, ctypes.byref(cur)), "cursor_open")
            base = self.map_base()
            ps = self.psize()
            out = []
            k, v = _Val(), _Val()
            op = MDB_FIRST
            while _lib.mdb_cursor_get(cur, ctypes.byref(k), ctypes.byref(v), op) == 0:
                kb = ctypes.string_at(k.mv_data, k.mv_size)
                vb = ctypes.string_at(v.mv_data, v.mv_size)
                out.append((kb, vb, (v.mv_data - PAGEHDRSZ - base) // ps))
                op = MDB_NEXT
            _lib.mdb_cursor_close(cur)
            return out
        finally:
            _lib.mdb_txn_abort(txn)

    def put_raw(self, pairs, db="obj"):
        """Writes values under keys as they are (no header, no checksum)."""
        txn = self._txn(False)
        try:
            dbi = self._dbi(txn, db)
            for key, val in pairs:
                kb = ctypes.create_string_buffer(key, len(key))
                vb = ctypes.create_string_buffer(val, len(val))
                _ck(_lib.mdb_put(txn, dbi, ctypes.byref(_Val(len(key), ctypes.addressof(kb))),
                                 ctypes.byref(_Val(len(val), ctypes.addressof(vb))), 0), "put")
        except BaseException:
            _lib.mdb_txn_abort(txn)
            raise
        _ck(_lib.mdb_txn_commit(txn), "commit")


def swap_values(l2dir, key_a, key_b):
    """Re-puts record a's bytes under key b and b's under a (LMDB calls)."""
    env = Env(l2dir)
    try:
        recs = {k: v for k, v, _ in env.records()}
        env.put_raw([(key_a, recs[key_b]), (key_b, recs[key_a])])
    finally:
        env.close()


def swap_overflow_pointers(l2dir, key_a, key_b):
    """Swaps the overflow-page numbers in the live leaf nodes of two big
    records of the `obj` database, in data.mdb itself: each key then leads to
    the other's intact value. Returns the number of leaf nodes rewritten (at
    least 2: stale copies of a leaf in freed pages are rewritten too)."""
    env = Env(l2dir, readonly=True)
    try:
        pg = {k: p for k, _, p in env.records() if k in (key_a, key_b)}
    finally:
        env.close()
    path = os.path.join(l2dir, "data.mdb")
    done = 0
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        try:
            for key, mine, other in ((key_a, pg[key_a], pg[key_b]), (key_b, pg[key_b], pg[key_a])):
                at = m.find(key)
                while at >= 0:
                    flags = int.from_bytes(m[at - 4:at - 2], "little")
                    ksize = int.from_bytes(m[at - 2:at], "little")
                    ptr = int.from_bytes(m[at + len(key):at + len(key) + 8], "little")
                    if ksize == len(key) and flags & F_BIGDATA and ptr == mine:
                        # every such node: the live leaf, and copies of it in
                        # pages freed by earlier commits (harmless there)
                        m[at + len(key):at + len(key) + 8] = other.to_bytes(8, "little")
                        done += 1
                    at = m.find(key, at + 1)
            m.flush()
        finally:
            m.close()
    return done


def used_pages(l2dir):
    """(page size, last page number in use)."""
    env = Env(l2dir, readonly=True)
    try:
        return env.psize(), env.info().me_last_pgno
    finally:
        env.close()


def btree_pages(path, psize, last_pgno):
    """Page numbers of branch and leaf pages (header's own page number
    matches its place, flags say branch or leaf) up to last_pgno."""
    out = []
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            for p in range(2, last_pgno + 1):
                off = p * psize
                if int.from_bytes(m[off:off + 8], "little") != p:
                    continue
                flags = int.from_bytes(m[off + 10:off + 12], "little")
                if flags & (P_BRANCH | P_LEAF) and not flags & (P_OVERFLOW | P_META):
                    out.append(p)
        finally:
            m.close()
    return out


def corrupt_pages(path, seed, psize, last_pgno, n_btree=3, n_any=1):
    """Random bytes over random spans of n_btree B-tree pages and n_any pages
    of the used range (seeded: the same damage for the same seed and file).
    Returns [(page, offset, length, kind)]."""
    rng = random.Random(seed)
    tree = btree_pages(path, psize, last_pgno)
    picks = [(p, "btree") for p in rng.sample(tree, min(n_btree, len(tree)))]
    picks += [(rng.randint(2, last_pgno), "any") for _ in range(n_any)]
    done = []
    with open(path, "r+b") as f:
        for p, kind in picks:
            if rng.random() < 0.25:
                off, n = 0, psize           # the whole page, header included
            else:
                off = rng.randrange(0, psize - 16)
                n = rng.randint(8, min(512, psize - off))
            f.seek(p * psize + off)
            f.write(bytes(rng.getrandbits(8) for _ in range(n)))
            done.append((p, off, n, kind))
        f.flush()
        os.fsync(f.fileno())
    return done
