"""One real vLLM engine (vllm.LLM, CPU build) in this process, for the engine
tests (test_vllm_engine.py). Reads a JSON job from argv[1]:

    {"model": dir, "dtype": "float32", "block_size": 32, "kv_bytes": N,
     "connector": {extra config} or null, "policy": "recompute" | "fail",
     "runs": [[prompt token ids, ...], ...], "max_tokens": 32}

and prints one line "RESULT <json>": for every run, every prompt's generated
token ids, vLLM's num_cached_tokens and the finish reason.
Greedy decoding, no tokenizer (skip_tokenizer_init, prompt token ids)."""

import json
import os
import sys


def main():
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = dict(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=job.get("dtype", "float32"),
              max_model_len=job.get("max_len", 512), block_size=job.get("block_size", 32), seed=0,
              kv_cache_memory_bytes=job.get("kv_bytes", 64 << 20),
              tensor_parallel_size=job.get("tp", 1), enable_prefix_caching=job.get("prefix_caching", True))
    if job.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvsideConnector", kv_connector_module_path="kvside.vllm", kv_role="kv_both",
            kv_load_failure_policy=job.get("policy", "recompute"),
            kv_connector_extra_config=job["connector"])
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 32), detokenize=False)
    out = {"runs": []}
    for run in job["runs"]:
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run], sp)
        out["runs"].append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                             "finish": o.outputs[0].finish_reason} for o in res])
    print("RESULT " + json.dumps(out), flush=True)
    del llm


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
