"""kvside: Python binding of libkvside, the kvside-server client library.

ctypes over ``libkvside.so``; standard library only. The library is found
through ``$KVSIDE_LIB`` (a path), else the copy a wheel bundles
(``kvside/_lib/libkvside.so.0``), else the system's library search
(``libkvside.so.0``). Every call maps one-to-one onto a function of
``kvside.h``; see that header for the semantics.

    import kvside
    mem = kvside.HostMemory(64 << 20)            # a memfd, mapped here
    with kvside.Client("vllm-0", "llama-3-8b:salt", rank=0, world=2) as c:
        reg = c.register_memory([mem], groups=[kvside.Group(0, blocks_per_chunk=4)],
                                layers=[kvside.Layer(0, 0, 0, 64, 4096, 4096)])
        keys = kvside.chunk_keys("llama-3-8b:salt", tokens, 64)
        c.store(job=1, keys=keys, blocks=[[0, 1, 2, 3] * ...])
        c.complete(1)

Blocking calls release the GIL (ctypes does), so ranks may live in threads of
one process. Failures raise :class:`KvsideError`, whose ``code_name`` is the
wire name (``E_MISS``...) or the errno name (``ETIMEDOUT``...). Event
callbacks run on the library's I/O thread: keep them short and do not call
the blocking methods from them.
"""

import array as _array
import ctypes
import ctypes.util
import errno as _errno
import fcntl as _fcntl
import mmap as _mmap
import os
import threading
from collections import namedtuple

__all__ = [
    "KvsideError", "Client", "HostMemory", "Group", "Layer", "Event", "JobInfo", "Lookup", "Pending",
    "chunk_keys", "library", "KEY_BYTES", "ERROR_NAMES", "ABI_VERSION",
]

KEY_BYTES = 32
# kvside.h's KVS_ABI_VERSION: the struct layouts mirrored below (the unit test
# ctypes_layout compares them with the header); a library built with another
# is refused at import
ABI_VERSION = 2
# kvside.h's KVS_REASON_LEN: a job's reason and its NUL
REASON_LEN = 129

# kvs_error.h: the project codes, from KVS_E_BASE = -20000 upwards, in order
ERROR_NAMES = ["E_BADMSG", "E_VERSION", "E_UNKNOWN_OP", "E_LIMIT", "E_SESSION", "E_AUTH",
               "E_NOREG", "E_GEOMETRY", "E_RANGE", "E_JOB_CONFLICT", "E_JOB_STATE",
               "E_NOSPACE", "E_MISS", "E_BUSY", "E_DEVICE", "E_LAZY_RECURRENT", "E_TIMEOUT",
               "E_INTERNAL"]
_E_BASE = -20000
for _i, _n in enumerate(ERROR_NAMES):
    globals()[_n] = _E_BASE + _i
__all__ += ERROR_NAMES

_ROLES = {"scheduler": 0, "worker": 1}
_STATES = ["open", "committed", "aborted", "unknown"]
_TIERS = ["l1", "l2", "l3"]
_KINDS = {"attention": 0, "recurrent": 1}
_ADMIN = {"status": 0, "drain": 1, "resume": 2, "clear": 3}
_EVENTS = {1: "reconnected", 2: "job_done"}


# ---- the library ------------------------------------------------------------------------

class _ClientConfig(ctypes.Structure):
    pass


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("session", ctypes.c_uint64), ("job", ctypes.c_uint64),
                ("state", ctypes.c_int), ("reason", ctypes.c_char_p), ("error", ctypes.c_int)]


_EVENT_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Event), ctypes.c_void_p)

_ClientConfig._fields_ = [
    ("endpoint", ctypes.c_char_p), ("broker_dir", ctypes.c_char_p), ("engine", ctypes.c_char_p),
    ("ns", ctypes.c_char_p), ("role", ctypes.c_int), ("rank", ctypes.c_uint32),
    ("world", ctypes.c_uint32), ("timeout_ms", ctypes.c_int), ("on_event", _EVENT_FN),
    ("event_arg", ctypes.c_void_p), ("curve_server_key", ctypes.c_char_p),
    ("curve_public_key", ctypes.c_char_p), ("curve_secret_key", ctypes.c_char_p)]


class _JobInfoOut(ctypes.Structure):
    _fields_ = [("job", ctypes.c_uint64), ("state", ctypes.c_int), ("ranks_done", ctypes.c_uint32),
                ("reason", ctypes.c_char * REASON_LEN)]


class _StatOut(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 48), ("value", ctypes.c_uint64)]


class _Alloc(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("size", ctypes.c_uint64), ("alloc_id", ctypes.c_uint8 * 16),
                ("follows", ctypes.c_bool), ("ipc_handle", ctypes.c_uint8 * 64)]


class _Group(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("kind", ctypes.c_int), ("tokens_per_block", ctypes.c_uint32),
                ("blocks_per_chunk", ctypes.c_uint32), ("window_chunks", ctypes.c_int64),
                ("null_block", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("group", ctypes.c_uint32), ("alloc", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("num_blocks", ctypes.c_uint64), ("block_stride", ctypes.c_uint64),
                ("block_bytes", ctypes.c_uint64)]


class _RegDesc(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_uuid", ctypes.c_uint8 * 16),
                ("allocs", ctypes.POINTER(_Alloc)), ("n_allocs", ctypes.c_uint32),
                ("groups", ctypes.POINTER(_Group)), ("n_groups", ctypes.c_uint32),
                ("layers", ctypes.POINTER(_Layer)), ("n_layers", ctypes.c_uint32)]


class _Blocks(ctypes.Structure):
    _fields_ = [("n_groups", ctypes.c_uint32), ("ids", ctypes.POINTER(ctypes.POINTER(ctypes.c_int64))),
                ("len", ctypes.POINTER(ctypes.c_uint32))]


class _StoreOpts(ctypes.Structure):
    _fields_ = [("lazy", ctypes.c_bool), ("producer_event", ctypes.POINTER(ctypes.c_uint8)),
                ("producer_event_len", ctypes.c_uint32), ("event_hashes", ctypes.c_char_p)]


class _AdminInfo(ctypes.Structure):
    _fields_ = [("cmd", ctypes.c_int), ("draining", ctypes.c_bool), ("drained", ctypes.c_bool),
                ("jobs_open", ctypes.c_uint64), ("waited_ms", ctypes.c_uint64),
                ("cleared_l1", ctypes.c_uint64), ("cleared_l2", ctypes.c_uint64),
                ("kept_l1", ctypes.c_uint64), ("msg", ctypes.c_char * 256)]


class _Result(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char_p), ("session", ctypes.c_uint64),
                ("registration", ctypes.c_uint64), ("imported", ctypes.c_uint64),
                ("aliased", ctypes.c_uint64), ("pending_jobs", ctypes.c_uint64),
                ("hits", ctypes.c_uint64), ("tiers", ctypes.POINTER(ctypes.c_uint8)),
                ("state", ctypes.c_int), ("jobs", ctypes.POINTER(_JobInfoOut)),
                ("n_jobs", ctypes.c_uint32), ("stats", ctypes.POINTER(_StatOut)),
                ("n_stats", ctypes.c_uint32), ("admin", ctypes.POINTER(_AdminInfo))]


_DONE_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Result), ctypes.c_void_p)


def _find_library():
    path = os.environ.get("KVSIDE_LIB")
    if path:
        return path
    # the copy bundled in the wheel (tools/build-wheel.sh), next to this file
    bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", "libkvside.so.0")
    if os.path.isfile(bundled):
        return bundled
    found = ctypes.util.find_library("kvside")
    return found or "libkvside.so.0"


def _load():
    path = _find_library()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError("kvside: cannot load libkvside (%s): %s; set KVSIDE_LIB to the path of "
                          "libkvside.so" % (path, e)) from None
    P, u32, u64, i32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
    sigs = {
        "kvs_abi_version": (ctypes.c_uint, []),
        "kvs_client_open": (i32, [ctypes.POINTER(_ClientConfig), ctypes.POINTER(P)]),
        "kvs_last_error": (ctypes.c_char_p, []),
        "kvs_client_close": (None, [P]),
        "kvs_client_session": (u64, [P]),
        "kvs_client_reconnects": (u64, [P]),
        "kvs_memfd_create": (i32, [ctypes.c_char_p, u64, ctypes.POINTER(i32), ctypes.POINTER(P)]),
        "kvs_register": (i32, [P, ctypes.POINTER(_RegDesc), i32, ctypes.POINTER(u64)]),
        "kvs_unregister": (i32, [P, u64, i32]),
        "kvs_store": (i32, [P, u64, ctypes.c_char_p, u32, ctypes.POINTER(_Blocks),
                            ctypes.POINTER(_StoreOpts), i32, ctypes.POINTER(i32)]),
        "kvs_retrieve": (i32, [P, u64, ctypes.c_char_p, u32, ctypes.POINTER(_Blocks), u64, i32,
                               ctypes.POINTER(i32)]),
        "kvs_complete": (i32, [P, u64, ctypes.c_bool, i32, ctypes.POINTER(i32)]),
        "kvs_lookup": (i32, [P, ctypes.c_char_p, u32, ctypes.c_bool, u32, i32, ctypes.POINTER(u64),
                             ctypes.POINTER(ctypes.c_uint8)]),
        "kvs_store_async": (i32, [P, u64, ctypes.c_char_p, u32, ctypes.POINTER(_Blocks),
                                  ctypes.POINTER(_StoreOpts), i32, _DONE_FN, P]),
        "kvs_retrieve_async": (i32, [P, u64, ctypes.c_char_p, u32, ctypes.POINTER(_Blocks), u64, i32,
                                     _DONE_FN, P]),
        "kvs_complete_async": (i32, [P, u64, ctypes.c_bool, i32, _DONE_FN, P]),
        "kvs_store_complete_async": (i32, [P, u64, ctypes.c_char_p, u32, ctypes.POINTER(_Blocks),
                                           ctypes.POINTER(_StoreOpts), i32, _DONE_FN, P]),
        "kvs_lookup_async": (i32, [P, ctypes.c_char_p, u32, ctypes.c_bool, u32, i32, _DONE_FN, P]),
        "kvs_job_status": (i32, [P, ctypes.POINTER(u64), u32, i32, ctypes.POINTER(_JobInfoOut), u32,
                                 ctypes.POINTER(u32)]),
        "kvs_stats": (i32, [P, i32, ctypes.POINTER(_StatOut), u32, ctypes.POINTER(u32)]),
        "kvs_job_wait": (i32, [P, u64, i32, ctypes.POINTER(i32)]),
        "kvs_admin": (i32, [P, i32, u32, i32, ctypes.POINTER(_AdminInfo)]),
        "kvs_keys_for_tokens": (ctypes.c_long, [ctypes.c_char_p, ctypes.POINTER(u32), ctypes.c_size_t,
                                                u32, ctypes.c_char_p, ctypes.c_size_t]),
        "kvs_strerror": (ctypes.c_char_p, [i32]),
        "kvs_error_name": (ctypes.c_char_p, [i32]),
        # CUDA (present when libkvside was built with CUDA headers)
        "kvs_cuda_available": (ctypes.c_bool, []),
        "kvs_cuda_export": (i32, [P, ctypes.POINTER(_Alloc), ctypes.POINTER(u64)]),
        "kvs_cuda_device_uuid": (i32, [i32, ctypes.c_uint8 * 16]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name, None)
        if fn is None:
            if name.startswith("kvs_cuda_"):
                continue
            raise ImportError("kvside: %s lacks %s (an older libkvside?)" % (path, name))
        fn.restype = res
        fn.argtypes = args
    if lib.kvs_abi_version() != ABI_VERSION:
        raise ImportError("kvside: %s has ABI version %d, this binding mirrors version %d" % (
            path, lib.kvs_abi_version(), ABI_VERSION))
    return lib, path


_lib, _lib_path = _load()


def library():
    """Path of the loaded libkvside."""
    return _lib_path


# ---- errors --------------------------------------------------------------------------------

def _code_name(code):
    if _E_BASE <= code <= _E_BASE + len(ERROR_NAMES) - 1:
        return ERROR_NAMES[code - _E_BASE]
    return _errno.errorcode.get(-code, "E%d" % -code)


class KvsideError(Exception):
    """A libkvside call failed. ``code`` is the negative code, ``code_name`` its
    wire name (E_MISS...) or errno name (ETIMEDOUT...), ``op`` the call."""

    def __init__(self, code, op="", detail=""):
        self.code = code
        self.code_name = _code_name(code)
        self.op = op
        text = detail or _lib.kvs_strerror(code).decode("utf-8", "replace")
        super().__init__("%s: %s (%s)" % (op, text, self.code_name) if op else
                         "%s (%s)" % (text, self.code_name))


def _check(code, op, detail=""):
    if code:
        raise KvsideError(code, op, detail)


def _check_sync(code, op):
    """_check for libkvside's blocking requests: the error carries the
    server's text (kvs_last_error), e.g. which block list has the wrong
    length."""
    if code:
        raise KvsideError(code, op, _lib.kvs_last_error().decode("utf-8", "replace"))


# ---- values --------------------------------------------------------------------------------

Event = namedtuple("Event", "type session job state reason error")
Event.__doc__ = """An event: type "reconnected" (error: 0 or the first re-registration
failure) or "job_done" (job, state, reason)."""
JobInfo = namedtuple("JobInfo", "job state ranks_done reason")
Lookup = namedtuple("Lookup", "hits tiers")


class Pending:
    """An asynchronous request (store_async, retrieve_async, complete_async,
    lookup_async). ``done`` is set once the reply (or the failure) is in; then
    ``code`` (0 or the negative error), ``msg`` (the server's text), ``state``
    (job state name, jobs) and ``hits`` / ``tiers`` (lookup) hold it. An
    optional callback(pending) runs on the library's I/O thread when it ends:
    keep it short."""

    __slots__ = ("op", "job", "code", "msg", "state", "hits", "tiers", "done", "callback")

    def __init__(self, op, job=0, callback=None):
        self.op, self.job, self.callback = op, job, callback
        self.code, self.msg, self.state, self.hits, self.tiers = None, "", None, 0, []
        self.done = threading.Event()

    def wait(self, timeout=None):
        """True once it has ended (timeout in seconds, None: forever)."""
        return self.done.wait(timeout)

    def result(self, timeout=None):
        """Waits, then returns the job state (or the Lookup) or raises
        KvsideError; ETIMEDOUT if it did not end within timeout seconds."""
        if not self.done.wait(timeout):
            raise KvsideError(-_errno.ETIMEDOUT, self.op, "no reply within %s s" % timeout)
        if self.code:
            raise KvsideError(self.code, self.op, self.msg)
        return Lookup(self.hits, self.tiers) if self.op == "lookup" else self.state


class Group:
    """An object group of a registration (kvs_group)."""

    def __init__(self, id, kind="attention", tokens_per_block=16, blocks_per_chunk=16,
                 window_chunks=-1, null_block=-1):
        if kind not in _KINDS:
            raise ValueError("kind must be 'attention' or 'recurrent'")
        self.id, self.kind, self.tokens_per_block = id, kind, tokens_per_block
        self.blocks_per_chunk, self.window_chunks, self.null_block = (
            blocks_per_chunk, window_chunks, null_block)


class Layer:
    """A layer view (kvs_layer): block b of this layer lives at byte
    offset + b * block_stride of allocation `alloc`; block_bytes are copied."""

    def __init__(self, group, alloc, offset, num_blocks, block_stride, block_bytes):
        self.group, self.alloc, self.offset = group, alloc, offset
        self.num_blocks, self.block_stride, self.block_bytes = num_blocks, block_stride, block_bytes


class HostMemory:
    """Host KV memory the server can map: a sealed memfd (it can grow, never
    shrink) mapped shared into this process. ``buffer`` is the mmap object,
    ``view`` a writable memoryview of it. Close it (or use ``with``) after
    unregistering."""

    def __init__(self, size, name="kvside-kv"):
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # the server maps it: forbid shrinking underneath it
            _fcntl.fcntl(self.fd, _fcntl.F_ADD_SEALS, _fcntl.F_SEAL_SHRINK)
            self.buffer = _mmap.mmap(self.fd, size, _mmap.MAP_SHARED,
                                     _mmap.PROT_READ | _mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.buffer)

    def close(self):
        if self.fd >= 0:
            self.view.release()
            self.buffer.close()
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _keys_arg(keys):
    """bytes of n*32, or a sequence of 32-byte keys -> (bytes, n)."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        b = bytes(keys)
    else:
        b = b"".join(bytes(k) for k in keys)
        if any(len(bytes(k)) != KEY_BYTES for k in keys):
            raise ValueError("every key must be %d bytes" % KEY_BYTES)
    if len(b) % KEY_BYTES:
        raise ValueError("keys must be a multiple of %d bytes" % KEY_BYTES)
    return b, len(b) // KEY_BYTES


def _event_hashes_arg(hashes, n):
    """One 32-byte engine hash per key -> bytes of n * 32."""
    b, m = _keys_arg(hashes)
    if m != n:
        raise ValueError("event_hashes: %d hashes for %d keys" % (m, n))
    return b


def _check_int64(ids):
    """Unsigned 64-bit ids are read as int64: one above 2^63 - 1 would turn
    negative (2^64 - 1 into -1), so such a buffer is refused."""
    top = int(max(ids)) if len(ids) else 0
    if top > 0x7FFFFFFFFFFFFFFF:
        raise ValueError("block ids must be 64-bit signed integers: %d is above 2^63 - 1" % top)


def _ids_buffer(ids):
    """One group's block ids -> (address, count, keepalive), without touching
    the ids one by one where they already sit in a buffer of int64: an
    array('q'), a C-contiguous numpy int64 array, or a CPU torch int64 tensor.
    Anything else (a list, a range) is converted once by array('q')."""
    if isinstance(ids, _array.array) and ids.itemsize == 8 and ids.typecode in "qlQL":
        if ids.typecode in "QL":
            _check_int64(ids)
        addr, n = ids.buffer_info()
        return addr, n, ids
    ai = getattr(ids, "__array_interface__", None)
    if ai is not None and ai.get("typestr") in ("<i8", "<u8") and len(ai.get("shape", ())) == 1:
        if ai.get("strides") in (None, (8,)):
            if ai["typestr"] == "<u8":
                _check_int64(ids)
            return ai["data"][0], ai["shape"][0], ids
    if hasattr(ids, "data_ptr") and hasattr(ids, "dtype") and str(ids.dtype) == "torch.int64":
        if getattr(ids, "is_cuda", False):
            raise ValueError("block ids must be in host memory, not on a CUDA device")
        t = ids.reshape(-1).contiguous()
        return t.data_ptr(), t.numel(), t
    try:
        a = _array.array("q", ids)
    except (TypeError, OverflowError) as e:
        raise ValueError("block ids must be 64-bit integers: %s" % e) from None
    addr, n = a.buffer_info()
    return addr, n, a


def _blocks_arg(blocks):
    """blocks: one sequence of block ids per group -> (_Blocks, keepalive)."""
    n = len(blocks)
    bufs = [_ids_buffer(g) for g in blocks]
    P64 = ctypes.POINTER(ctypes.c_int64)
    ptrs = (P64 * max(n, 1))(*[ctypes.cast(addr, P64) for addr, _, _ in bufs])
    lens = (ctypes.c_uint32 * max(n, 1))(*[cnt for _, cnt, _ in bufs])
    b = _Blocks(n, ctypes.cast(ptrs, ctypes.POINTER(P64)), ctypes.cast(lens, ctypes.POINTER(ctypes.c_uint32)))
    return b, (bufs, ptrs, lens)


def chunk_keys(namespace, tokens, chunk_tokens=256):
    """The 32-byte chunk keys of a token sequence (BLAKE2b-256 chained over
    chunk_tokens-token chunks, seeded by the namespace), as a list of bytes.
    A trailing partial chunk gets no key."""
    toks = list(tokens)
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    if toks and (min(toks) < 0 or max(toks) > 0xFFFFFFFF):
        raise ValueError("token ids must be 32-bit unsigned integers")
    n_max = len(toks) // chunk_tokens
    if n_max == 0:
        return []
    arr = (ctypes.c_uint32 * len(toks))(*toks)
    out = ctypes.create_string_buffer(n_max * KEY_BYTES)
    r = _lib.kvs_keys_for_tokens(namespace.encode(), arr, len(toks), chunk_tokens, out, n_max)
    if r < 0:
        raise KvsideError(r, "chunk_keys")
    raw = out.raw
    return [raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(r)]


# ---- the client ----------------------------------------------------------------------------

class Client:
    """A session with kvside-server (kvs_client): opened by the constructor,
    heartbeating from then on, re-opened by itself after a server restart
    (then on_event gets a "reconnected" Event). Close it, or use ``with``.

    role: "worker" (a TP rank) or "scheduler". on_event(Event) runs on the
    library's I/O thread."""

    def __init__(self, engine, namespace, role="worker", rank=0, world=1, broker_dir=None,
                 endpoint=None, timeout_ms=10000, on_event=None, curve_keys=None):
        """curve_keys: (server public key, client public key, client secret
        key), Z85 strings, for a tcp:// endpoint of a server with CURVE."""
        if role not in _ROLES:
            raise ValueError("role must be 'worker' or 'scheduler'")
        self._c = None
        self._user_event = on_event
        self._done_fn = _DONE_FN(self._on_done)
        self._inflight = {}
        self._inflight_lock = threading.Lock()
        self._next_token = 1
        self._event_fn = _EVENT_FN(self._on_event) if on_event else _EVENT_FN()
        keys = tuple(curve_keys) if curve_keys else (None, None, None)
        if len(keys) != 3:
            raise ValueError("curve_keys: (server public key, client public key, client secret key)")
        self._strings = [s if isinstance(s, bytes) or s is None else s.encode()
                         for s in (endpoint, broker_dir, engine, namespace) + keys]
        cfg = _ClientConfig(self._strings[0], self._strings[1], self._strings[2], self._strings[3],
                            _ROLES[role], rank, world, timeout_ms, self._event_fn, None,
                            self._strings[4], self._strings[5], self._strings[6])
        c = ctypes.c_void_p()
        r = _lib.kvs_client_open(ctypes.byref(cfg), ctypes.byref(c))
        if r:
            raise KvsideError(r, "open", _lib.kvs_last_error().decode("utf-8", "replace"))
        self._c = c
        self.engine, self.namespace, self.role, self.rank, self.world = (
            engine, namespace, role, rank, world)

    def _on_event(self, ev, arg):
        e = ev.contents
        out = Event(_EVENTS.get(e.type, str(e.type)), e.session, e.job,
                    _STATES[e.state] if 0 <= e.state < len(_STATES) else str(e.state),
                    e.reason.decode("utf-8", "replace") if e.reason else "", e.error)
        try:
            self._user_event(out)
        except Exception:  # never let an exception unwind into C
            import traceback
            traceback.print_exc()

    def _on_done(self, res, arg):
        with self._inflight_lock:
            p = self._inflight.pop(arg or 0, None)
        if p is None:
            return
        r = res.contents
        p.code = r.code
        p.msg = r.msg.decode("utf-8", "replace") if r.msg else ""
        p.state = _STATES[r.state] if 0 <= r.state < len(_STATES) else None
        if p.op == "lookup" and not r.code:
            p.hits = r.hits
            p.tiers = [_TIERS[r.tiers[i]] for i in range(r.hits)]
        p.done.set()
        if p.callback is not None:
            try:
                p.callback(p)
            except Exception:  # never let an exception unwind into C
                import traceback
                traceback.print_exc()

    def _submit(self, p, call):
        """Queues an asynchronous call(done_fn, token); returns p, or raises
        (then the callback never runs)."""
        with self._inflight_lock:
            tok = self._next_token
            self._next_token += 1
            self._inflight[tok] = p
        r = call(self._done_fn, ctypes.c_void_p(tok))
        if r:
            with self._inflight_lock:
                self._inflight.pop(tok, None)
            raise KvsideError(r, p.op)
        return p

    def _h(self):
        if self._c is None:
            raise KvsideError(-_errno.EBADF, "client", "client is closed")
        return self._c

    def close(self):
        """Says bye and stops the I/O thread (idempotent)."""
        if self._c is not None:
            _lib.kvs_client_close(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @property
    def session(self):
        """The current session id (changes after a reconnect)."""
        return _lib.kvs_client_session(self._h())

    @property
    def reconnects(self):
        return _lib.kvs_client_reconnects(self._h())

    # -- registrations

    def _register(self, allocs, groups, layers, device_type, uuid, timeout_ms):
        a = (_Alloc * len(allocs))(*allocs)
        g = (_Group * max(len(groups), 1))(*[
            _Group(x.id, _KINDS[x.kind], x.tokens_per_block, x.blocks_per_chunk, x.window_chunks,
                   x.null_block) for x in groups])
        ly = (_Layer * max(len(layers), 1))(*[
            _Layer(x.group, x.alloc, x.offset, x.num_blocks, x.block_stride, x.block_bytes)
            for x in layers])
        d = _RegDesc(device_type, (ctypes.c_uint8 * 16)(*uuid), a, len(allocs), g, len(groups), ly,
                     len(layers))
        h = ctypes.c_uint64()
        _check(_lib.kvs_register(self._h(), ctypes.byref(d), timeout_ms, ctypes.byref(h)), "register")
        return h.value

    def register_memory(self, allocations, groups, layers, timeout_ms=0):
        """Registers host memory: allocations are HostMemory objects or
        (fd, size) pairs (the library keeps a duplicate of each fd), or
        (fd, size, True) for one mapped right after the previous entry (a
        range: layers name its first entry and may run across); layer
        offsets are relative to their allocation. Returns the handle."""
        allocs = []
        for m in allocations:
            if isinstance(m, HostMemory):
                fd, size, follows = m.fd, m.size, False
            else:
                fd, size, follows = (tuple(m) + (False,))[:3]
            allocs.append(_Alloc(fd, size, (ctypes.c_uint8 * 16)(), bool(follows)))
        return self._register(allocs, groups, layers, 0, bytes(16), timeout_ms)

    def register_cuda(self, buffers, groups, layers, device=0, timeout_ms=0):
        """Registers CUDA memory: buffers are (device pointer, size) pairs of
        shareable cuMem memory (e.g. from kvside.torch_alloc); layer offsets
        are relative to their buffer's pointer. The library exports the
        allocation behind each pointer as a POSIX fd. Raises KvsideError
        (ENODEV) without a CUDA driver, or when libkvside lacks CUDA support."""
        if getattr(_lib, "kvs_cuda_export", None) is None:
            raise KvsideError(-_errno.ENOTSUP, "register_cuda",
                              "this libkvside was built without CUDA support")
        uuid = (ctypes.c_uint8 * 16)()
        _check(_lib.kvs_cuda_device_uuid(device, uuid), "register_cuda")
        allocs, head, shift, fds = [], [], [], []
        try:
            for ptr, size in buffers:
                # the allocation under ptr, then every one mapped after it
                # until the buffer's end (PyTorch's expandable segments map a
                # tensor over several): one range of entries
                first, end, at = len(allocs), ptr + size, ptr
                while True:
                    al, base = _Alloc(), ctypes.c_uint64()
                    _check(_lib.kvs_cuda_export(ctypes.c_void_p(at), ctypes.byref(al), ctypes.byref(base)),
                           "register_cuda")
                    if al.fd >= 0:
                        fds.append(al.fd)
                    if len(allocs) == first:
                        shift.append(ptr - base.value)
                        start = base.value
                    elif base.value != at or al.fd < 0:
                        raise ValueError("buffer 0x%x+%d crosses from one allocation into %s at 0x%x" % (
                            ptr, size, "memory without a cuMem handle" if al.fd < 0 else "unmapped memory",
                            at))
                    al.follows = len(allocs) > first
                    allocs.append(al)
                    at = base.value + al.size
                    if at >= end:
                        break
                    if allocs[first].fd < 0:
                        raise ValueError("buffer 0x%x+%d lies outside its allocation (legacy CUDA IPC "
                                         "memory cannot span allocations)" % (ptr, size))
                del start
                head.append(first)
            moved = [Layer(x.group, head[x.alloc], x.offset + shift[x.alloc], x.num_blocks, x.block_stride,
                           x.block_bytes) for x in layers]
            return self._register(allocs, groups, moved, 1, bytes(uuid), timeout_ms)
        finally:
            for fd in fds:
                os.close(fd)

    def unregister(self, handle, timeout_ms=0):
        _check(_lib.kvs_unregister(self._h(), handle, timeout_ms), "unregister")

    # -- jobs

    def store(self, job, keys, blocks, lazy=False, producer_event=None, timeout_ms=0, event_hashes=None):
        """Stores chunks (one block list per group, blocks_per_chunk ids per
        key); returns the job state ("open" once accepted). event_hashes: the
        engine's 32-byte name of each chunk, published by KV events."""
        kb, n = _keys_arg(keys)
        bl, keep = _blocks_arg(blocks)
        opts = None
        if event_hashes is not None:
            opts = _StoreOpts(False, None, 0, _event_hashes_arg(event_hashes, n))
        if lazy or producer_event:
            ev = None
            if producer_event:
                raw = (ctypes.c_uint8 * len(producer_event)).from_buffer_copy(bytes(producer_event))
                keep = (keep, raw)
                ev = ctypes.cast(raw, ctypes.POINTER(ctypes.c_uint8))
            opts = _StoreOpts(bool(lazy), ev, len(producer_event or b""), opts.event_hashes if opts else None)
        st = ctypes.c_int(-1)
        _check_sync(_lib.kvs_store(self._h(), job, kb, n, ctypes.byref(bl),
                              ctypes.byref(opts) if opts else None, timeout_ms, ctypes.byref(st)), "store")
        return _STATES[st.value]

    def retrieve(self, job, keys, blocks, skip_tokens=0, timeout_ms=0):
        """Copies cached chunks into the blocks; returns when the bytes are in
        place (the job state), or raises (E_MISS: nothing was written)."""
        kb, n = _keys_arg(keys)
        bl, keep = _blocks_arg(blocks)
        st = ctypes.c_int(-1)
        _check_sync(_lib.kvs_retrieve(self._h(), job, kb, n, ctypes.byref(bl), skip_tokens, timeout_ms,
                                 ctypes.byref(st)), "retrieve")
        del keep
        return _STATES[st.value]

    def complete(self, job, ok=True, timeout_ms=0):
        """This rank's part of job is done (ok or failed); returns the state."""
        st = ctypes.c_int(-1)
        _check_sync(_lib.kvs_complete(self._h(), job, bool(ok), timeout_ms, ctypes.byref(st)), "complete")
        return _STATES[st.value]

    def lookup(self, keys, prefetch=False, pin_ms=0, timeout_ms=0):
        """How many leading chunks are cached: Lookup(hits, tiers)."""
        kb, n = _keys_arg(keys)
        hits = ctypes.c_uint64()
        tiers = (ctypes.c_uint8 * max(n, 1))()
        _check_sync(_lib.kvs_lookup(self._h(), kb, n, bool(prefetch), pin_ms, timeout_ms, ctypes.byref(hits),
                               tiers), "lookup")
        return Lookup(hits.value, [_TIERS[tiers[i]] for i in range(hits.value)])

    # -- asynchronous jobs: each returns a Pending at once (protocol.md 6.9: a
    #    part and its complete may be queued back to back)

    def _store_part(self, call, job, keys, blocks, timeout_ms, callback, event_hashes, producer_event):
        kb, n = _keys_arg(keys)
        bl, keep = _blocks_arg(blocks)
        opts = None
        if event_hashes is not None or producer_event:
            ev, ev_len = None, 0
            if producer_event:
                raw = (ctypes.c_uint8 * len(producer_event)).from_buffer_copy(bytes(producer_event))
                keep = (keep, raw)
                ev, ev_len = ctypes.cast(raw, ctypes.POINTER(ctypes.c_uint8)), len(producer_event)
            opts = _StoreOpts(False, ev, ev_len,
                              _event_hashes_arg(event_hashes, n) if event_hashes is not None else None)
        h = self._h()
        # the call copies keys, blocks and options before it returns
        return self._submit(Pending("store", job, callback), lambda fn, tok: call(
            h, job, kb, n, ctypes.byref(bl), ctypes.byref(opts) if opts else None, timeout_ms, fn, tok))

    def store_async(self, job, keys, blocks, timeout_ms=0, callback=None, event_hashes=None,
                    producer_event=None):
        """Queues a store part; the Pending ends with the part's reply.
        event_hashes and producer_event (a CUDA IPC event handle the server
        waits on before the part's copies) as for store()."""
        return self._store_part(_lib.kvs_store_async, job, keys, blocks, timeout_ms, callback, event_hashes,
                                producer_event)

    def store_complete_async(self, job, keys, blocks, timeout_ms=0, callback=None, event_hashes=None,
                             producer_event=None):
        """Queues a store part that carries this rank's complete ("ok"): one
        message per rank and job (protocol.md 6.7). The Pending ends when the
        job is terminal, with "committed" or "aborted" (job_wait sees it too),
        or with the part's error. Give timeout_ms room for the whole job."""
        return self._store_part(_lib.kvs_store_complete_async, job, keys, blocks, timeout_ms, callback,
                                event_hashes, producer_event)

    def retrieve_async(self, job, keys, blocks, skip_tokens=0, timeout_ms=0, callback=None):
        """Queues a retrieve part; the Pending ends once the bytes are in
        place (or with the error: then nothing was written, except E_DEVICE)."""
        kb, n = _keys_arg(keys)
        bl, keep = _blocks_arg(blocks)
        h = self._h()
        return self._submit(Pending("retrieve", job, callback), lambda fn, tok: _lib.kvs_retrieve_async(
            h, job, kb, n, ctypes.byref(bl), skip_tokens, timeout_ms, fn, tok))

    def complete_async(self, job, ok=True, timeout_ms=0, callback=None):
        h = self._h()
        return self._submit(Pending("complete", job, callback), lambda fn, tok: _lib.kvs_complete_async(
            h, job, bool(ok), timeout_ms, fn, tok))

    def lookup_async(self, keys, prefetch=False, pin_ms=0, timeout_ms=0, callback=None):
        kb, n = _keys_arg(keys)
        h = self._h()
        return self._submit(Pending("lookup", 0, callback), lambda fn, tok: _lib.kvs_lookup_async(
            h, kb, n, bool(prefetch), pin_ms, timeout_ms, fn, tok))

    def job_status(self, jobs=None, timeout_ms=0):
        """States of these job ids, or of the engine's open jobs: [JobInfo]."""
        ids = list(jobs or [])
        arr = (ctypes.c_uint64 * max(len(ids), 1))(*ids)
        cap = 1024
        out = (_JobInfoOut * cap)()
        n = ctypes.c_uint32()
        _check_sync(_lib.kvs_job_status(self._h(), arr, len(ids), timeout_ms, out, cap, ctypes.byref(n)),
               "job_status")
        return [JobInfo(out[i].job, _STATES[out[i].state], out[i].ranks_done,
                        out[i].reason.decode("utf-8", "replace")) for i in range(n.value)]

    def job_wait(self, job, timeout_ms=0):
        """Waits for job's job_done; returns its terminal state."""
        st = ctypes.c_int(-1)
        _check(_lib.kvs_job_wait(self._h(), job, timeout_ms, ctypes.byref(st)), "job_wait")
        return _STATES[st.value]

    def stats(self, timeout_ms=0):
        """The server's counters as a dict."""
        cap = 256
        out = (_StatOut * cap)()
        n = ctypes.c_uint32()
        _check_sync(_lib.kvs_stats(self._h(), timeout_ms, out, cap, ctypes.byref(n)), "stats")
        return {out[i].name.decode(): out[i].value for i in range(n.value)}

    def admin(self, cmd, wait_ms=0, timeout_ms=0):
        """Operator commands: "status", "drain" (waits up to wait_ms for open
        jobs), "resume", "clear". Returns a dict of the answer."""
        if cmd not in _ADMIN:
            raise ValueError("cmd must be one of %s" % ", ".join(_ADMIN))
        a = _AdminInfo()
        if not timeout_ms:
            timeout_ms = wait_ms + 10000
        r = _lib.kvs_admin(self._h(), _ADMIN[cmd], wait_ms, timeout_ms, ctypes.byref(a))
        _check(r, "admin " + cmd, a.msg.decode("utf-8", "replace"))
        return {"cmd": cmd, "draining": a.draining, "drained": a.drained, "jobs_open": a.jobs_open,
                "waited_ms": a.waited_ms, "cleared_l1": a.cleared_l1, "cleared_l2": a.cleared_l2,
                "kept_l1": a.kept_l1}


def cuda_available():
    """True if libkvside has CUDA support and a driver and device are usable."""
    fn = getattr(_lib, "kvs_cuda_available", None)
    return bool(fn and fn())
