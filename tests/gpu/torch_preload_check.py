"""PyTorch with expandable segments allocates through cuMemCreate (dlsym'd from
libcuda). Under libkvside-preload.so those allocations become exportable as
POSIX fds: kvs_cuda_export() on a tensor's data pointer succeeds.
Run: LD_PRELOAD=.../libkvside-preload.so PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
     python3 torch_preload_check.py .../libkvside.so"""
import ctypes
import os
import sys

import torch

# the binding's own mirror of kvs_alloc (checked against kvside.h by the
# unit test ctypes_layout), with the library given on the command line
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "worker", "python"))
os.environ["KVSIDE_LIB"] = sys.argv[1]
import kvside  # noqa: E402

lib = kvside._lib
t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
a = kvside._Alloc()
base = ctypes.c_uint64()
rc = lib.kvs_cuda_export(ctypes.c_void_p(t.data_ptr()), ctypes.byref(a), ctypes.byref(base))
print("torch %s, expandable segments, LD_PRELOAD=%s: kvs_cuda_export rc=%d fd=%d size=%d" %
      (torch.__version__, "yes" if "kvside-preload" in os.environ.get("LD_PRELOAD", "") else "no", rc, a.fd, a.size))
sys.exit(0 if rc == 0 else 1)
