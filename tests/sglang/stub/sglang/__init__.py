"""Stand-in for SGLang (sgl-project/sglang), only what kvside.sglang and the
tests touch. Each module names the file and commit it mirrors; the storage
interface is pinned at 001067fffe33427bee0ed2f007fb7551a1d76b44
(tests/sglang/sglang_api.txt)."""
