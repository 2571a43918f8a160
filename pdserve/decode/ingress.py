"""The decode worker's own ingress vocabulary, beside the one every surface shares
(api/ingress.py): `Prepared` is a request the frontend validated, admitted and routed;
`RemotePath` is what the remote-prefill path offers the frontend; `as_request_error` is the
status a client sees for a request the engine could not finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from pdserve.api.ingress import REQUEST_SCOPE, GenerateInput, RequestError
from pdserve.common import Priority
from pdserve.engine import InvalidRequestError, LoRARequest, SamplingParams
from pdserve.router import Decision

from .async_engine import EngineDeadError
from .final_info import FinalInfo
from .prefill_pool import PrefillView


@dataclass
class Prepared:
    """A validated, admitted request with its routing decision.

    ``request_id`` is the id this worker minted for the admission (what the engine, the
    handoff and delivery key on); ``label`` is the id the client named it by."""

    request_id: str
    inp: GenerateInput
    prompt_ids: list[int]
    params: SamplingParams
    priority: Priority
    cached_len: int
    decision: Decision
    arrival: float
    label: str = ""
    tenant: str | None = None  # the API key's identity, or with keys off the client's address (addr:...): the engine's fair share
    residual_ms: float = 0.0  # the learned TTFT residual of the decision's route, included in its prediction
    local_backlog: int = 0  # prompt tokens local prefills had left when it was admitted
    # Prefill worker id -> tokens of this prompt's prefix it holds (their KV events): what the
    # router weighed, and the remote task's prefix_hint. Computed once, at admission.
    prefix_hint: dict[str, int] = field(default_factory=dict)
    # (holder, blocks): a local prefill that first borrows that prefix (decode/borrow.py); None: none.
    borrow: tuple[str, int] | None = None
    # The W3C traceparent of its request span on this worker (decode/tracing.py), which its
    # prefill task carries so the prefill worker's spans join the trace; None: not traced.
    traceparent: str | None = None
    # The LoRA adapter its model named (api/adapters.py); None: the base model.
    lora: LoRARequest | None = None


class RemotePath(Protocol):
    """What the remote-prefill path offers the frontend (decode/remote.py `RemotePrefill`, the
    owner of every request it runs)."""

    view: PrefillView  # the prefill pool and queue as this worker sees them
    pending_requests: int  # routed remote, first token not yet back
    pending_tokens: int  # their uncached prompt tokens
    peers: Any  # prefix loans (decode/borrow.py PeerPrefixes), or None
    prefix_view: Any  # the prefill workers' cached prefixes (cluster/kvindex), or None

    def available(self) -> bool: ...

    def stream(self, prep: Prepared) -> AsyncIterator[tuple[object, FinalInfo | None, dict]]: ...

    def abort(self, request_id: str) -> None: ...


# How `StepError` (engine/engine_types.py) begins, and so a request failed with its step does.
STEP_FAILED = "engine step failed:"


def as_request_error(item) -> RequestError:
    """The status a client sees for a request the engine could not finish.

    Request scope (`RequestError.scope`) only where the engine failed this request alone and
    went on: its sampling, detokenization or block indexing raised (``finish_reason "error"``),
    or it was invalid. Not for a failed forward pass (`StepError`: every request of the step
    failed with it; the device may be at fault, another worker may serve it) nor for an
    exception the engine loop stopped on: those may be the worker's."""
    if isinstance(item, InvalidRequestError):
        return RequestError("invalid_argument", str(item), item.field, scope=REQUEST_SCOPE)
    if isinstance(item, EngineDeadError):
        return RequestError("unavailable", f"the engine stopped: {item}; retry on another decode worker")
    if isinstance(item, BaseException):
        return RequestError("internal", f"engine error: {item.__class__.__name__}: {item}")
    if (item.error or "").startswith(STEP_FAILED):
        return RequestError("internal", f"this request's engine step failed ({item.error}); retry it")
    return RequestError("internal", f"this request failed in the engine ({item.error}); the worker is fine, "
                        "retry or change its sampling parameters", scope=REQUEST_SCOPE)
