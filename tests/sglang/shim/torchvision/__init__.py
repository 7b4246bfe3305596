"""An import-only stand-in for torchvision, for the SGLang tests.

Why: SGLang's mem_cache.memory_pool imports sglang.srt.configs, whose
multimodal configs (internvl_utils, deepseek_ocr) import torchvision at
module level. PyPI's torchvision wheels are CUDA builds tied to one torch
(their _C.so needs libtorch_cuda.so): none loads beside this machine's
torch 2.13.0+cpu. The tests use no image model; anything here used for real
raises, naming this file.
"""


def __getattr__(name):
    raise AttributeError("torchvision stand-in (tests/sglang/shim): %s is not available" % name)
