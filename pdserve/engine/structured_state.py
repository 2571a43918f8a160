"""Structured outputs in a running engine: each request's grammar matcher and the step's masks.

A request with ``structured_outputs`` gets a `RequestGrammar` when it is made
(`LLMEngine.make_request`): its compile starts on the compiler's threads
(engine/structured.py), and the scheduler admits it only once its matcher exists
(`RequestGrammar.ready`); the requests behind it are admitted meanwhile, as vLLM does. Each
step (`LLMEngine.step`), `StructuredOutputs.poll` makes the matchers of the grammars that
compiled and hands back those that failed or ran past the time bound (the engine fails them
with an error delta); before the sampler, `mask` sets the logits of every token the grammar
does not allow next to -inf, for the constrained rows only, in one batched bitmask; each
appended token advances the matcher (`accept`), and a grammar that has ended finishes the
request ("stop").

A request whose prompt KV another worker writes (``remote_kv``) is never failed from
`poll`: its reserved blocks may still be written. Its first token, sampled under the same
grammar on the prefill worker, advances the matcher in `LLMEngine.append_token`, which waits
for the compile (up to its time bound) if it is still under way; a failure then ends the
request once its pages are in (the connector's ``remote_ready``), and a request that falls
back to a local prefill is failed by `poll` as any other.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

import torch

from .request import InvalidRequestError, Request
from .structured import GrammarCompiler
from .structured_spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar as xgr


class RequestGrammar:
    """One request's grammar in the engine: its compile under way, then its matcher."""

    def __init__(self, spec: GrammarSpec, future: Future, deadline: float):
        self.spec = spec
        self.future = future
        self.deadline = deadline  # time.monotonic() by which the compile must be done
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """The matcher exists: the request may be scheduled (engine/scheduler.py)."""
        return self.matcher is not None

    def __repr__(self) -> str:
        return f"RequestGrammar({self.spec.kind}, ready={self.ready})"


# Byte -> its 8 tokens' additive mask (0: allowed, -inf: not), bit i of a byte being token i of
# its 8: xgrammar's bitmask is int32 words whose bit j allows token 32 x word + j, and a word's
# bytes are little-endian in memory (x86, arm64), so byte k of the flat byte view covers tokens
# 8k to 8k + 7.
_BYTE_MASK = torch.tensor([[0.0 if (b >> i) & 1 else float("-inf") for i in range(8)] for b in range(256)])


def _declare_bitmask(lib) -> None:
    import ctypes

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_apply_token_bitmask_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64]
    lib.pdserve_apply_token_bitmask_f32.restype = None


def add_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """Mask ``logits[rows]`` by their bitmask rows (the same row numbers), in place, on the CPU:
    the native kernel (csrc/token_bitmask.c: only the words with a clear bit are touched) for
    float32 logits, 0.05-0.1 ms for 64 rows of a 32k vocabulary where xgrammar's CPU kernel took
    3.4-6.4 ms (2 cores); without a C compiler, or for another dtype, one table lookup per byte
    of mask (an embedding) and one add, 0.4 ms (logits are finite: adding 0 leaves an allowed
    token's value exact, adding -inf masks the others)."""
    import torch.nn.functional as F

    from . import native

    lib = native.load_library("token_bitmask.c", _declare_bitmask)
    if (lib is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1 and bitmask.stride(-1) == 1
            and bitmask.dtype == torch.int32):
        idx = torch.tensor(rows, dtype=torch.int64)
        lib.pdserve_apply_token_bitmask_f32(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(),
                                            bitmask.stride(0), idx.data_ptr(), len(rows), vocab)
        return
    n = len(rows)
    whole = n == logits.shape[0] and rows == list(range(n))
    with torch.inference_mode():  # the step's logits are inference tensors (updated in place here)
        words = bitmask if whole else bitmask[torch.tensor(rows)]
        table = _BYTE_MASK if logits.dtype == torch.float32 else _BYTE_MASK.to(logits.dtype)
        bias = F.embedding(words.contiguous().view(torch.uint8).long(), table).view(n, -1)[:, :vocab]
        if whole:
            logits.add_(bias)
        else:
            idx = torch.tensor(rows)
            logits[idx] = logits[idx] + bias


class StructuredOutputs:
    """The engine's side of structured outputs: the grammars waiting for their compile, the
    matchers' token masks on each step's logits, and each new token through its matcher."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.pending: dict[str, Request] = {}  # request id -> request whose matcher is not made yet
        self._bitmask: torch.Tensor | None = None  # (rows, ceil(vocab / 32)) int32, reused across steps

    # -- a request's grammar ---------------------------------------------------------------
    def start(self, req: Request, spec: GrammarSpec) -> None:
        """Start ``req``'s compile; when it is done already (cached), make its matcher now, so
        a grammar that fails or a resumed token it refuses is an `InvalidRequestError` here."""
        fut = self.compiler.submit(spec)
        req.grammar = RequestGrammar(spec, fut, time.monotonic() + self.compiler.timeout_s)
        if fut.done():
            self._materialize(req)
        else:
            self.pending[req.request_id] = req

    def _materialize(self, req: Request) -> None:
        """The matcher, advanced over the tokens the request has already (a resumed stream's)."""
        import xgrammar as xgr

        g = req.grammar
        assert g is not None
        compiled = g.future.result()  # raises the compile's InvalidRequestError
        m = xgr.GrammarMatcher(compiled)  # its stop tokens: the model's EOS ids (the compiler's)
        for i, tok in enumerate(req.output_token_ids):
            if not m.accept_token(tok):
                raise InvalidRequestError("resume_token_ids", f"resumed token {i} ({tok}) is not allowed by "
                                          f"the request's grammar ({g.spec.field})")
            if m.is_terminated():
                raise InvalidRequestError("resume_token_ids", f"the request's grammar had already ended at "
                                          f"resumed token {i}; nothing is left to resume")
        g.matcher = m

    def poll(self) -> list[tuple[Request, Exception]]:
        """Make the matchers of the waiting grammars that compiled; hand back the requests whose
        compile failed or ran past its time bound, with their error (the engine fails them).
        Requests whose KV another worker writes wait (see the module docstring)."""
        failed: list[tuple[Request, Exception]] = []
        now = time.monotonic()
        for rid, req in list(self.pending.items()):
            g = req.grammar
            if g is None or req.finish_reason is not None or g.ready:
                del self.pending[rid]
                continue
            if g.future.done():
                try:
                    self._materialize(req)
                except Exception as exc:  # noqa: BLE001  (this request fails; the others go on)
                    if req.remote_kv:
                        continue
                    failed.append((req, exc))
                del self.pending[rid]
            elif now >= g.deadline and not req.remote_kv:
                del self.pending[rid]
                self.compiler.note_timeout()
                failed.append((req, InvalidRequestError(
                    "structured_outputs", f"the grammar did not compile within {self.compiler.timeout_s:g} s")))
        return failed

    def wait_any(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for one of the pending compiles: a step that had nothing to
        run but requests waiting for their grammar does not spin."""
        futures = [r.grammar.future for r in self.pending.values() if r.grammar is not None]
        if futures:
            wait_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def ensure(self, req: Request) -> xgr.GrammarMatcher:
        """``req``'s matcher, waiting for its compile up to the time bound when it is not made yet
        (a first token sampled elsewhere can arrive before it); `InvalidRequestError` otherwise."""
        g = req.grammar
        assert g is not None
        if g.matcher is None:
            self.pending.pop(req.request_id, None)
            self.compiler.wait(g.future, g.deadline - time.monotonic())
            self._materialize(req)
        assert g.matcher is not None
        return g.matcher

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    # -- each step ------------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, reqs: list[Request]) -> dict[int, Exception]:
        """Set to -inf, in place, the logits of the tokens each constrained row's grammar does
        not allow next (rows of ``reqs`` without a grammar are untouched); the rows that could
        not be masked, with their error (the engine fails those requests)."""
        import xgrammar as xgr

        rows, vocab = len(reqs), logits.shape[-1]
        bitmask = self._bitmask_for(rows, vocab)
        failed: dict[int, Exception] = {}
        masked: list[int] = []
        for i, req in enumerate(reqs):
            if req.grammar is None:
                continue
            try:
                self.ensure(req).fill_next_token_bitmask(bitmask, i)
                masked.append(i)
            except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
                failed[i] = exc
        if masked:
            bm = bitmask[:rows]
            if logits.device.type == "cpu" and sys.byteorder == "little":
                add_bitmask(logits, bm, masked, vocab)
            else:
                bm = bm.to(logits.device, non_blocking=True)  # (the copy is ordered before the kernel)
                xgr.apply_token_bitmask_inplace(logits, bm, vocab_size=vocab, indices=masked)
        return failed

    def _bitmask_for(self, rows: int, vocab: int) -> torch.Tensor:
        import xgrammar as xgr

        bm = self._bitmask
        if bm is None or bm.shape[0] < rows or bm.shape[1] * 32 < vocab:
            cap = 1 << max(3, (rows - 1).bit_length())  # grow by powers of two
            bm = self._bitmask = xgr.allocate_token_bitmask(cap, vocab)
        return bm

    def accept(self, req: Request, token_id: int) -> bool:
        """Advance ``req``'s matcher by the token it is given (sampled here or elsewhere); True
        when the grammar has ended with it. A token the grammar refuses raises
        `InvalidRequestError` naming the grammar (that request fails, never the batch)."""
        m = self.ensure(req)
        if not m.accept_token(token_id):
            g = req.grammar
            assert g is not None
            raise InvalidRequestError(g.spec.field, f"token {token_id} is not allowed by the request's grammar "
                                      f"after {len(req.output_token_ids)} generated tokens")
        return bool(m.is_terminated())
