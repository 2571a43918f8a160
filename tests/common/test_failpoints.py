"""Failpoints (common/failpoints.py): off unless PDSERVE_FAILPOINTS names them; `request.poison`
fails a poison prompt through the engine's own per-request failure path (the rest of the batch
goes on token-exact); a prefill worker's `hang_compute` is refused while its failpoint is off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
from pdserve.common.failpoints import POISON_PREFIX
from pdserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=256)
p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
plain = [11, 12, 13, 14, 15, 16]
outs = llm.generate([list(POISON_PREFIX) + plain, plain], p)
print(json.dumps([[o.finish_reason, list(o.token_ids)] for o in outs]))
"""


def _run(llama_dir, failpoints: str | None):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_FAILPOINTS"}
    if failpoints is not None:
        env["PDSERVE_FAILPOINTS"] = failpoints
    out = subprocess.run([sys.executable, "-c", SCRIPT, llama_dir], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_poison_failpoint_fails_only_the_poison_request_and_only_when_on(llama_dir):
    (poison_off, _), (plain_off, plain_tokens) = _run(llama_dir, None)
    assert poison_off == plain_off == "length"
    (poison_on, poison_tokens), (plain_on, plain_tokens_on) = _run(llama_dir, "request.poison")
    assert poison_on == "error" and not poison_tokens
    assert plain_on == "length" and plain_tokens_on == plain_tokens  # the batch's other request, token-exact


def test_hang_compute_is_refused_while_its_failpoint_is_off():
    import asyncio

    from pdserve.prefill.worker import PrefillWorker

    if "prefill.hang_compute" in os.environ.get("PDSERVE_FAILPOINTS", ""):
        pytest.skip("this process has the failpoint on")
    with pytest.raises(PermissionError, match="PDSERVE_FAILPOINTS"):
        asyncio.run(PrefillWorker.hang_compute(object.__new__(PrefillWorker), 1.0))
