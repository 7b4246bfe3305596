"""A minimal stand-in for the ``vllm`` package (vllm-project/vllm), enough to
import and drive a KV connector without vLLM installed.

Only what a connector and tests/vllm/engine.py touch is here; each module's
docstring names the vLLM file and commit it mirrors. Commits:
  A = 003df2961dd8830c317a61f9745ccd557da9fa06 (base.py, request.py,
      scheduler.py, kv_cache_manager.py)
  B = e578de311c2416e66c6a8b9819586bb91de10f9d (everything else; A's base)
Names and semantics follow vLLM; the code is written for these tests.
"""

__version__ = "0.0.0+kvside-stub"
