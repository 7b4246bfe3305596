"""Turns the KV-cache tensors an engine hands over into kvside registrations
(used by the vLLM connector and the SGLang backend).

Pure functions over anything tensor-like (``data_ptr``, ``shape``, ``stride``,
``element_size``, ``is_cuda``), so they are testable without vLLM. A *view* is
one kvside layer: block ``b`` lives at ``ptr + b * block_stride`` and its
``block_bytes`` are dense.

Host tensors must live in shareable memory: a MAP_SHARED mapping of a memfd
(or of a file in a tmpfs such as /dev/shm) that this process can name by an
fd. :func:`host_allocation` finds it from the address through
/proc/self/maps and the process's open fds; anonymous memory (what
``torch.zeros`` gives) is refused with :class:`LayoutError` saying so.
:func:`make_shareable` moves the anonymous storage of torch tensors into
sealed memfds, re-pointing the tensors (what the vLLM connector does with
vLLM's CPU caches at ``register_kv_caches``).
"""

import fcntl
import os
from collections import namedtuple

View = namedtuple("View", "ptr block_stride block_bytes")
View.__doc__ = "One kvside layer view: block b at ptr + b * block_stride, block_bytes dense."

HostAlloc = namedtuple("HostAlloc", "fd size inode map_start map_end file_offset")


class LayoutError(ValueError):
    """A cache tensor kvside cannot register as it is (the text says why)."""


def _dense_bytes(shape, strides, elem):
    """Bytes of a dense region with these sizes and strides (any order of
    dims), or None if the elements do not tile it exactly."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return None
        expect *= sz
    return expect * elem


def block_views(t, num_blocks, name="cache"):
    """The kvside views of one layer's cache tensor.

    Shapes understood (``nb`` = num_blocks):
    - ``[2, nb, ...]`` (FlashAttention; K and V planes, also the hybrid
      layout where K and V of a block share one page): two views;
    - ``[nb, ...]`` (FlashInfer ``[nb, 2, ...]``, MLA ``[nb, bs, dim]``,
      a Mamba state ``[nb, ...]`` with a padded page stride): one view;
    - either with ``nb * r`` in place of ``nb``: vLLM's kernel-block
      splitting (an attention kernel whose block is 1/r of the manager's;
      manager block b is kernel blocks b*r .. b*r+r-1, as vLLM's
      ``group_kernel_blocks``): r views per plane, view j holding kernel
      block j of every manager block. Not one view of r kernel blocks: with
      the heads outside the tokens (HND) those bytes are not a manager
      block's, and engines whose kernels differ must not share objects (the
      number of views is part of the server's geometry fingerprint).
    A list or tuple of tensors (a Mamba layer's conv and ssm states) gives
    the views of each in order. Every block must be dense in memory (any
    order of its inner dims, e.g. NHD or HND); the stride between blocks may
    be padded."""
    if isinstance(t, (list, tuple)):
        out = []
        for i, x in enumerate(t):
            out += block_views(x, num_blocks, "%s[%d]" % (name, i))
        return out
    shape, strides = tuple(t.shape), tuple(t.stride())
    elem = t.element_size()

    def ratio(n):
        return n // num_blocks if num_blocks > 0 and n >= num_blocks and n % num_blocks == 0 else 0
    if len(shape) >= 2 and shape[0] == 2 and num_blocks != 2 and ratio(shape[1]):
        planes = [(t.data_ptr() + i * strides[0] * elem) for i in range(2)]
        inner_shape, inner_strides, kstride, r = shape[2:], strides[2:], strides[1], ratio(shape[1])
    elif len(shape) >= 1 and ratio(shape[0]):
        planes = [t.data_ptr()]
        inner_shape, inner_strides, kstride, r = shape[1:], strides[1:], strides[0], ratio(shape[0])
    else:
        raise LayoutError("%s: shape %s has no block dimension of %d blocks (expected [2, %d, ...] "
                          "or [%d, ...], or a multiple of %d kernel blocks)"
                          % (name, list(shape), num_blocks, num_blocks, num_blocks, num_blocks))
    nbytes = _dense_bytes(inner_shape, inner_strides, elem)
    if nbytes is None:
        raise LayoutError("%s: a block is not dense in memory (shape %s, strides %s)"
                          % (name, list(shape), list(strides)))
    if kstride * elem < nbytes:
        raise LayoutError("%s: blocks overlap (stride %d B < %d B per block)"
                          % (name, kstride * elem, nbytes))
    return [View(p + j * kstride * elem, r * kstride * elem, nbytes) for p in planes for j in range(r)]


def view_extent(v, num_blocks):
    """(first byte, one past the last byte) a view covers."""
    return v.ptr, v.ptr + (num_blocks - 1) * v.block_stride + v.block_bytes


# ---- host memory ---------------------------------------------------------------------------

def _maps():
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            yield lo, hi, parts[1], int(parts[2], 16), int(parts[4]), path


def host_allocation(ptr, nbytes, what="cache"):
    """The shareable file behind host addresses [ptr, ptr + nbytes): a
    HostAlloc whose fd is a new descriptor the caller closes. Seals the file
    against shrinking when it is not yet and can be (the server requires
    F_SEAL_SHRINK unless it runs with allow-unsealed-memory).
    Raises LayoutError when the memory is anonymous, private, spans several
    mappings, or no fd of this process names the file."""
    for lo, hi, perms, off, inode, path in _maps():
        if not lo <= ptr < hi:
            continue
        if inode == 0 or not path:
            raise LayoutError(
                "%s at 0x%x is anonymous memory (%s): kvside maps host KV memory into its own "
                "process, so the engine must allocate it in a memfd or a /dev/shm file mapped "
                "MAP_SHARED (e.g. kvside.HostMemory, then torch.frombuffer)" % (what, ptr, path or "no file"))
        if "s" not in perms:
            raise LayoutError("%s at 0x%x is a private mapping of %s: it must be MAP_SHARED" % (what, ptr, path))
        if ptr + nbytes > hi:
            raise LayoutError("%s at 0x%x+%d runs past its mapping of %s (ends 0x%x)" % (what, ptr, nbytes, path, hi))
        fd = _fd_of_inode(inode, lo, hi)
        if fd is None:
            raise LayoutError("%s: no open fd of this process names %s (inode %d); keep the memfd open"
                              % (what, path, inode))
        try:
            size = os.fstat(fd).st_size
            _seal_shrink(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return HostAlloc(fd, size, inode, lo, hi, off)
    raise LayoutError("%s at 0x%x is not mapped in this process" % (what, ptr))


def view_layer(allocs, by_inode, group, v, num_blocks, what="cache"):
    """The kvside Layer of view v (its group, num_blocks blocks) over the
    file behind it: one registration allocation per file (allocs, indexed
    by inode in by_inode; a view in a file already listed reuses its entry,
    the new fd closed). The caller closes the fds of allocs."""
    import kvside
    lo, hi = view_extent(v, num_blocks)
    a = host_allocation(lo, hi - lo, what)
    if a.inode in by_inode:
        os.close(a.fd)
        a = allocs[by_inode[a.inode]]
    else:
        by_inode[a.inode] = len(allocs)
        allocs.append(a)
    return kvside.Layer(group, by_inode[a.inode], lo - a.map_start + a.file_offset, num_blocks, v.block_stride,
                        v.block_bytes)


def _anonymous(ptr):
    for lo, hi, _perms, _off, inode, path in _maps():
        if lo <= ptr < hi:
            return inode == 0 or not path
    return False


def make_shareable(tensors, name="kvside-kv"):
    """Moves the anonymous host storage behind ``tensors`` (torch tensors; a
    list or tuple nests) into sealed memfds, one per storage, copying its
    bytes and re-pointing every given tensor with ``Tensor.set_`` (same
    offset, sizes and strides), so views that shared a storage share the new
    one. Tensors on a device, or already in a file mapping, are left alone.

    Returns the memfds (the caller keeps them open while the memory is
    registered: :func:`host_allocation` names the memory by them). Tensor
    objects not given keep the old storage, which is freed once they go:
    pass every view the engine uses (vLLM's ``kv_caches`` values are the
    layers' own tensors)."""
    flat = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif hasattr(x, "untyped_storage") and getattr(getattr(x, "device", None), "type", "") == "cpu":
            flat.append(x)
    walk(tensors)
    groups = {}
    for t in flat:
        st = t.untyped_storage()
        groups.setdefault(st.data_ptr(), (st, []))[1].append(t)
    fds = []
    add, shrink, grow = (getattr(fcntl, "F_ADD_SEALS", 1033), getattr(fcntl, "F_SEAL_SHRINK", 0x0002),
                         getattr(fcntl, "F_SEAL_GROW", 0x0004))
    try:
        for ptr, (st, ts) in groups.items():
            if st.nbytes() == 0 or not _anonymous(ptr):
                continue
            import torch
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(fd)
            os.ftruncate(fd, st.nbytes())
            fcntl.fcntl(fd, add, shrink | grow)
            new = torch.UntypedStorage.from_file("/proc/self/fd/%d" % fd, shared=True, nbytes=st.nbytes())
            new.copy_(st)
            for t in ts:
                t.set_(new, t.storage_offset(), t.size(), t.stride())
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _fd_of_inode(inode, lo, hi):
    """A new fd for the file of this inode: one of ours duplicated, else the
    mapping itself through /proc/self/map_files."""
    base = "/proc/self/fd"
    for name in os.listdir(base):
        try:
            st = os.stat(os.path.join(base, name))
        except OSError:
            continue
        if st.st_ino == inode:
            try:
                return os.dup(int(name))
            except OSError:
                continue
    try:
        return os.open("/proc/self/map_files/%x-%x" % (lo, hi), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None


def _seal_shrink(fd, path):
    add, get = getattr(fcntl, "F_ADD_SEALS", 1033), getattr(fcntl, "F_GET_SEALS", 1034)
    shrink = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
    try:
        seals = fcntl.fcntl(fd, get)
    except OSError:
        return  # not a memfd (a tmpfs file): the server decides what it accepts
    if seals & shrink:
        return
    try:
        fcntl.fcntl(fd, add, shrink)
    except OSError:
        # F_SEAL_SEAL without F_SEAL_SHRINK (engines' shared host pools): the
        # server accepts it only with allow-unsealed-memory, and says so
        pass
