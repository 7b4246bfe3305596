"""PyTorch with expandable segments allocates through cuMemCreate (dlsym'd from
libcuda). Under libkvside-preload.so those allocations become exportable as
POSIX fds: kvs_cuda_export() on a tensor's data pointer succeeds.
Run: LD_PRELOAD=.../libkvside-preload.so PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
     python3 torch_preload_check.py .../libkvside.so"""
import ctypes
import os
import sys

import torch


class KvsAlloc(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("size", ctypes.c_uint64), ("alloc_id", ctypes.c_uint8 * 16),
                ("follows", ctypes.c_bool)]


lib = ctypes.CDLL(sys.argv[1])
lib.kvs_cuda_export.argtypes = [ctypes.c_void_p, ctypes.POINTER(KvsAlloc), ctypes.POINTER(ctypes.c_uint64)]
t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
a = KvsAlloc()
base = ctypes.c_uint64()
rc = lib.kvs_cuda_export(ctypes.c_void_p(t.data_ptr()), ctypes.byref(a), ctypes.byref(base))
print("torch %s, expandable segments, LD_PRELOAD=%s: kvs_cuda_export rc=%d fd=%d size=%d" %
      (torch.__version__, "yes" if "kvside-preload" in os.environ.get("LD_PRELOAD", "") else "no", rc, a.fd, a.size))
sys.exit(0 if rc == 0 else 1)
