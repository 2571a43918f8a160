"""The offline batch API: `LLM` runs a list of prompts to completion on its own engine.

``LLM(model_dir, **engine_args).generate(prompts, params)``; serving loops drive the
`LLMEngine` underneath (llm_engine.py) one step at a time instead.
"""

from __future__ import annotations

import time

from .config import EngineConfig
from .llm_engine import LLMEngine
from .lora_request import LoRARequest
from .request import InvalidRequestError, RequestOutput, SamplingParams
from .tokenizer import Tokenizer


class LLM:
    """Offline batch generation: ``LLM(model_dir, **engine_args).generate(prompts, params)``."""

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (also on ``with LLM(...)`` exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 timeout_s: float | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion; ``lora_request``: one adapter for every prompt, or a list
        with one per prompt (None: the base model), as vLLM's ``LLM.generate``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidRequestError("prompts", "must be a non-empty list of strings or token-id lists")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("params", f"{len(params)} SamplingParams for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequestError("lora_request", f"{len(loras)} LoRARequests for {len(prompts)} prompts")
        eng = self.engine
        reqs = []
        try:  # validate everything before any work starts
            for prompt, p, lora in zip(prompts, params, loras):
                reqs.append(eng.make_request(prompt, p, lora_request=lora))
        except Exception:
            for r in reqs:
                eng._forget(r)
            raise
        for r in reqs:
            eng.scheduler.add(r)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = {r.request_id for r in reqs}
        while pending:
            for d in eng.step():
                if d.finished:
                    pending.discard(d.request_id)
            if deadline is not None and time.monotonic() > deadline:
                for rid in pending:
                    eng.abort_request(rid)
                raise TimeoutError(f"generate did not finish within timeout_s={timeout_s}")
            if pending and not eng.scheduler.has_work():
                raise RuntimeError("engine has unfinished requests but nothing schedulable")
        outs = []
        for r in reqs:
            out = eng.release(r.request_id)
            if out is None:  # every request above finished and only release() forgets one
                raise RuntimeError(f"request {r.request_id!r} finished but the engine no longer holds it")
            outs.append(out)
        return outs
