#!/usr/bin/python3
"""kvside.layout on the tensors vLLM hands to register_kv_caches
(layouts as described in docs/vllm.md, mirrored from vllm-project/vllm at
e578de311c2416e66c6a8b9819586bb91de10f9d: vllm/v1/attention/backends/
flash_attn.py get_kv_cache_shape / stride order, mla_attention.py,
gpu_model_runner.py _reshape_kv_cache_tensors for Mamba pages, the
cross-layer tensor of kv_connector_model_runner_mixin.py), plus host-memory
discovery from an address. Needs torch (exit 77 without)."""

import mmap
import os
import sys
import unittest

try:
    import torch
except ImportError:
    print("SKIP: torch cannot be imported")
    sys.exit(77)

# kvside/layout.py needs neither vLLM nor libkvside
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "worker", "python", "kvside"))
import layout  # noqa: E402

NB, BS, H, D = 10, 16, 4, 8


class Views(unittest.TestCase):
    def test_flash_attention_nhd_and_hnd(self):
        page = BS * H * 2 * D * 2
        # physical NHD (nb, bs, H, 2D), logical (nb, H, bs, 2D)
        t = torch.zeros(NB, BS, H, 2 * D, dtype=torch.float16).permute(0, 2, 1, 3)
        (v,) = layout.block_views(t, NB)
        self.assertEqual((v.ptr, v.block_stride, v.block_bytes), (t.data_ptr(), page, page))
        hnd = torch.zeros(NB, H, BS, 2 * D, dtype=torch.float16)
        (v,) = layout.block_views(hnd, NB)
        self.assertEqual(v.block_bytes, page)

    def test_kv_first_and_padded_pages(self):
        t = torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16)
        k, v = layout.block_views(t, NB)
        self.assertEqual(v.ptr - k.ptr, NB * BS * H * D * 2)
        self.assertEqual(k.block_stride, BS * H * D * 2)
        # hybrid layout: K and V of one block share a padded page
        raw = torch.zeros(NB * 4096, dtype=torch.int8)
        kv = torch.as_strided(raw.view(torch.float16), (2, NB, BS, H, D),
                              (BS * H * D, 2048, H * D, D, 1))
        k, v = layout.block_views(kv, NB)
        self.assertEqual((k.block_stride, k.block_bytes, v.ptr - k.ptr), (4096, 1024, 1024))

    def test_mla_mamba_and_cross_layer(self):
        mla = torch.zeros(NB, BS, 576, dtype=torch.bfloat16)
        (v,) = layout.block_views(mla, NB)
        self.assertEqual(v.block_bytes, BS * 576 * 2)
        mamba = torch.zeros(NB * 8192, dtype=torch.int8).view(NB, 1, 1, 8192)
        (v,) = layout.block_views(mamba, NB)
        self.assertEqual((v.block_stride, v.block_bytes), (8192, 8192))
        # cross-layer, NHD: (nb, layers, bs, H, 2D): every layer of a block in one page
        x = torch.zeros(NB, 6, BS, H, 2 * D, dtype=torch.float16)
        (v,) = layout.block_views(x, NB)
        self.assertEqual(v.block_bytes, 6 * BS * H * 2 * D * 2)
        two = layout.block_views([mla, mamba], NB)
        self.assertEqual(len(two), 2)

    def test_kernel_block_splitting(self):
        # vLLM with a kernel block of BS/4 tokens: (2, nb*4, bs/4, H, D) and
        # (nb*4, H, bs/4, 2D) (HND); manager block b = kernel blocks 4b..4b+3
        kb = BS // 4
        t = torch.arange(2 * NB * 4 * kb * H * D, dtype=torch.float32).view(2, NB * 4, kb, H, D)
        views = layout.block_views(t, NB)
        self.assertEqual(len(views), 8, "4 kernel blocks per manager block, K and V")
        kbytes = kb * H * D * 4
        for i, v in enumerate(views):
            plane, j = divmod(i, 4)
            self.assertEqual((v.block_stride, v.block_bytes), (4 * kbytes, kbytes))
            # view j of block b is kernel block 4b+j of its plane
            b = 3
            off = v.ptr + b * v.block_stride - t.data_ptr()
            self.assertEqual(off // 4, t[plane, 4 * b + j].flatten()[0].item())
        hnd = torch.zeros(NB * 4, H, kb, 2 * D, dtype=torch.float16)
        views = layout.block_views(hnd, NB)
        self.assertEqual([(v.ptr - hnd.data_ptr(), v.block_stride) for v in views],
                         [(j * H * kb * 2 * D * 2, 4 * H * kb * 2 * D * 2) for j in range(4)])
        with self.assertRaises(layout.LayoutError):  # 7 kernel blocks do not split 10 blocks
            layout.block_views(torch.zeros(NB * 7 // 2, kb, H, D), NB)

    def test_refused(self):
        with self.assertRaises(layout.LayoutError) as e:
            layout.block_views(torch.zeros(7, BS, H, D), NB)
        self.assertIn("no block dimension", str(e.exception))
        # a block that is not dense (every other head)
        t = torch.zeros(NB, BS, 2 * H, D)[:, :, ::2, :]
        with self.assertRaises(layout.LayoutError) as e:
            layout.block_views(t, NB)
        self.assertIn("not dense", str(e.exception))


class Host(unittest.TestCase):
    def test_memfd_found_and_sealed(self):
        fd = os.memfd_create("kvt-layout", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 1 << 20)
        m = mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED)
        import numpy
        arr = numpy.frombuffer(m, dtype=numpy.uint8)
        t = torch.from_numpy(arr)[4096:]
        a = layout.host_allocation(t.data_ptr(), 8192)
        try:
            self.assertEqual(a.size, 1 << 20)
            self.assertEqual(t.data_ptr() - a.map_start + a.file_offset, 4096)
            self.assertEqual(os.fstat(a.fd).st_ino, os.fstat(fd).st_ino)
            import fcntl
            self.assertTrue(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
        finally:
            os.close(a.fd)
        with self.assertRaises(layout.LayoutError) as e:
            layout.host_allocation(t.data_ptr() + (1 << 20) - 8192, 8192)
        self.assertIn("runs past", str(e.exception))
        del t, arr
        m.close()
        os.close(fd)

    def test_anonymous_refused(self):
        t = torch.zeros(1 << 20, dtype=torch.uint8)
        with self.assertRaises(layout.LayoutError) as e:
            layout.host_allocation(t.data_ptr(), 4096)
        self.assertIn("anonymous memory", str(e.exception))


if __name__ == "__main__":
    unittest.main(verbosity=2)
