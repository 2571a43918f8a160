"""A task as the prefill engine's request: its first token's sampling, and its LoRA adapter.

`TaskAdmission.admit` turns a `PrefillTask` into an export of the engine (its KV stays for the
transfer to read, engine/kv_connector.py): the sampling of its one first token as the decode
worker's local path would draw it, and the LoRA adapter the task names (docs/lora.md, "Across
prefill and decode"). A worker started with ``enable_lora`` that does not hold the adapter
reads it from the task's path (the same host or a shared filesystem) when the task is
admitted, with the checks a decode worker makes (engine/lora.py: a bad adapter is a
`LoRAError` naming the field, and the task fails as a bad task, so its decode worker prefills
locally); without ``enable_lora`` such a task is refused the same way (field
``lora_request``). How long that load took rides back in the task's `PrefillDone`
(``lora_load_ms``: the decode worker's cost model learns it, router/costs.py).

`held` is what the worker's etcd record publishes as ``load["lora_adapters"]`` (the names of
the adapters its engine holds read and checked, sorted): refreshed on the compute thread after
each batch, read from the event loop.
"""

from __future__ import annotations

import time

from pdserve.engine import LLMEngine, LoRARequest, SamplingParams
from pdserve.kvtransfer.task import PrefillTask

# The keys of a prefill worker's etcd record (cluster/records.py WorkerInfo): in `capacity`,
# that it runs adapters (its engine has enable_lora); in `load`, the adapters it holds.
LORA_CAPACITY_KEY = "enable_lora"
LORA_ADAPTERS_KEY = "lora_adapters"


def lora_capacity(engine: LLMEngine) -> dict[str, bool]:
    """What a prefill worker's record adds to its `capacity`: that it runs adapters, if it does."""
    return {LORA_CAPACITY_KEY: True} if getattr(engine.config, "enable_lora", False) else {}


def task_adapter(t: PrefillTask) -> LoRARequest | None:
    """The adapter ``t`` runs under (None: the base model)."""
    return LoRARequest(t.lora_name, t.lora_int_id, t.lora_path) if t.lora_name else None


class TaskAdmission:
    """Admits a batch's tasks into one engine (the compute thread) and remembers what loading
    their adapters took until their `PrefillDone` reports it."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        config = getattr(engine, "config", None)
        self.enabled = bool(getattr(config, "enable_lora", False))  # (a test's stand-in engine: no adapters)
        self.held: tuple[str, ...] = ()
        self._load_ms: dict[str, float] = {}  # export id -> ms its adapter took to load (absent: held)

    def admit(self, t: PrefillTask) -> str:
        """Queue ``t`` in the engine; its export id. Raises for a bad task (its sampling, its
        blocks, its adapter: InvalidRequestError naming the field, TypeError, ValueError)."""
        eng = self.engine
        if not isinstance(t.sampling_params, dict):
            raise TypeError(f"sampling_params must be a map, got {type(t.sampling_params).__name__}")
        # The first token's logprob always (the decode side reports it when asked), and its top-N
        # alternatives when the request asked for them, so the remote path returns what local does.
        asked = t.sampling_params.get("logprobs") or 0
        least = t.sampling_params.get("min_tokens", 0)  # it holds for this first token too; decode counts it
        params = SamplingParams.from_dict({**t.sampling_params, "max_tokens": 1, "stop": [], "logprobs": asked,
                                           "min_tokens": min(least, 1) if type(least) is int else least})
        params.validate(eng.model_config.vocab_size)  # a NaN temperature fails here, not in the sampler
        if not t.target_block_ids or not all(isinstance(b, int) and b >= 0 for b in t.target_block_ids):
            raise ValueError("target_block_ids must be a non-empty list of block ids")
        rid = f"{t.request_id}#{t.epoch}"
        lora = task_adapter(t)
        loading = lora is not None and self.enabled and lora.lora_name not in eng.connector.lora_adapters()
        t0 = time.perf_counter()
        eng.connector.add_export(t.token_ids, params, rid, t.priority, lora_request=lora,  # (reads the adapter)
                                 draft=bool(t.draft_block_ids) and eng.connector.draft is not None)
        if loading:
            self._load_ms[rid] = (time.perf_counter() - t0) * 1e3
        return rid

    def load_ms(self, rid: str) -> float:
        """What loading export ``rid``'s adapter took (0: held already, or none); forgotten after."""
        return self._load_ms.pop(rid, 0.0)

    def load(self) -> dict[str, list[str]]:
        """What the worker's record adds to its `load`: the adapters it holds (when it runs any)."""
        return {LORA_ADAPTERS_KEY: list(self.held)} if self.enabled else {}

    def refresh(self) -> None:
        """Note the adapters the engine holds now (compute thread: the engine's own)."""
        if self.enabled:
            self.held = tuple(self.engine.connector.lora_adapters())
        self._load_ms.clear()  # (the batch is over: its notices are sent)
