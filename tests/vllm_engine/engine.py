"""One real vLLM engine (vllm.LLM, CPU build) in this process, for the engine
tests (test_vllm_engine.py). Reads a JSON job from argv[1]:

    {"model": dir, "dtype": "float32", "block_size": 32, "kv_bytes": N,
     "connector": {extra config} or null, "policy": "recompute" | "fail",
     "runs": [[prompt token ids, ...], ...], "max_tokens": 32,
     "kill_on_load": pid or absent, "kill_min_skip": tokens (0),
     "max_batched": max_num_batched_tokens or absent, "ignore_eos": false,
     "fail_loads": false}

fail_loads: every retrieve a worker sends fails at once (E_MISS), while
lookups keep answering hits: a load that can never succeed.

block_size null lets vLLM choose (a Mamba hybrid's attention block follows
its state page).

kill_on_load: the first time a worker is about to load (start_load_kv with
a load planned whose skip_tokens, vLLM's local prefix hit, is at least
kill_min_skip: the scheduler's lookup was answered, the load is not yet
sent), this process SIGKILLs that pid (the kvside server) and waits for it
to be gone, then lets the load go on against the dead server.

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
              max_model_len=job.get("max_len", 512), block_size=job.get("block_size", 32) if "block_size" not in job or job["block_size"] else None, seed=0,
              kv_cache_memory_bytes=job.get("kv_bytes", 64 << 20),
              tensor_parallel_size=job.get("tp", 1), enable_prefix_caching=job.get("prefix_caching", True))
    if job.get("max_batched"):
        kw["max_num_batched_tokens"] = job["max_batched"]
    if job.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvsideConnector", kv_connector_module_path="kvside.vllm", kv_role="kv_both",
            kv_load_failure_policy=job.get("policy", "recompute"),
            kv_connector_extra_config=job["connector"])
    if job.get("fail_loads"):
        fail_every_load()
    if job.get("kill_on_load"):
        kill_before_first_load(job["kill_on_load"], job.get("kill_min_skip", 0))
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 32), detokenize=False,
                        ignore_eos=job.get("ignore_eos", False))
    out = {"runs": []}
    for run in job["runs"]:
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in run], sp)
        out["runs"].append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                             "finish": o.outputs[0].finish_reason} for o in res])
    print("RESULT " + json.dumps(out), flush=True)
    del llm


def fail_every_load():
    import kvside

    def retrieve_async(self, job, keys, blocks, skip_tokens=0, timeout_ms=0, callback=None):
        p = kvside.Pending("retrieve", job, callback)
        p.code, p.msg = kvside.E_MISS, "fail_loads (engine.py)"
        p.done.set()
        return p
    kvside.Client.retrieve_async = retrieve_async


def kill_before_first_load(pid, min_skip):
    import signal
    import time
    from kvside.vllm.worker import WorkerSide
    load = WorkerSide.start_load_kv

    def start_load_kv(self, meta):
        if any(op.skip_tokens >= min_skip for op in meta.loads) and not getattr(WorkerSide, "_killed", False):
            WorkerSide._killed = True
            os.kill(pid, signal.SIGKILL)
            while os.path.exists("/proc/%d/stat" % pid) and open("/proc/%d/stat" % pid).read().split()[2] != "Z":
                time.sleep(0.01)
        return load(self, meta)
    WorkerSide.start_load_kv = start_load_kv


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
