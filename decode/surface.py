"""What the decode worker's APIs serve (gRPC, decode/grpc_service.py; HTTP, decode/http_app.py):
a `Surface`. A decode worker's is its `Frontend` (decode/frontend.py); a gateway's routes each
request to a decode worker (gateway/frontend.py). One implementation of both APIs serves either.

The base holds what does not depend on where a sequence runs: request validation against
the model (`PromptChecker`), the serving limits, the per-API-key share of sequences, several
prompts and samples as one call (`generate_many`), detokenization, and the model card.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from pdserve.engine import SamplingParams
from pdserve.engine.prompts import PromptChecker

from .ingress import Chunk, GenerateInput, RequestError, ServingLimits, sample_input
from .validate import Validator


@dataclass(frozen=True)
class ModelCard:
    """The served model as ListModels and /v1/models describe it."""

    id: str
    max_model_len: int
    vocab_size: int
    dtype: str


def identity(caller) -> str | None:
    """Whose request-id namespace a request lives in: its API key's identity (None: keys off)."""
    return None if caller is None else caller.identity


class Surface(abc.ABC):
    """The request handling both APIs call. Subclasses run one sequence (`_generate`), abort
    one by its client's id (`abort`), and say whether they serve (`health`)."""

    def __init__(self, checker: PromptChecker, limits: ServingLimits | None, metrics, worker_id: str,
                 served_model: str):
        self.checker = checker
        self.limits = limits or ServingLimits()
        self.max_prompt_chars = self.limits.max_prompt_chars or checker.max_model_len * checker.tokenizer.max_token_chars
        self.validator = Validator(checker, self.limits, served_model, self.max_prompt_chars)
        # Bounded: a burst of huge prompts queues here instead of starving the event loop.
        self._tokenizer_pool = ThreadPoolExecutor(self.limits.tokenizer_threads, thread_name_prefix="pdserve-tokenize")
        self.metrics = metrics
        self.worker_id = worker_id
        self.served_model = served_model
        self.draining = False
        self.sequences_per_key: Counter = Counter()  # key identity -> sequences its calls hold (keys on)

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def tokenizer(self):
        return self.checker.tokenizer

    def model_card(self) -> ModelCard:
        return ModelCard(self.served_model, self.checker.max_model_len, self.checker.vocab_size, self.dtype())

    @abc.abstractmethod
    def dtype(self) -> str:
        """The dtype of the served weights (the model card's)."""

    def health(self) -> str | None:
        """None while it serves; else why not (the HTTP health check's 503)."""
        return "draining" if self.draining else None

    def refresh_gauges(self) -> None:
        """Bring the gauges up to date before /metrics renders them."""

    def validate(self, inp: GenerateInput) -> tuple[list[int], SamplingParams, int]:
        """Check and tokenize one request (CPU work: call it off the event loop)."""
        return self.validator.validate(inp)

    async def validated(self, inp: GenerateInput) -> tuple[list[int], SamplingParams, int]:
        """`validate` in the tokenizer pool."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self.validate, inp)

    @abc.abstractmethod
    def abort(self, request_id: str, caller=None) -> bool:
        """Abort an in-flight request by the id its client gave; False if unknown."""

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        """One sequence, within its key's share."""
        with self._key_share(inp.caller, 1):
            async for chunk in self._generate(inp):
                yield chunk

    @abc.abstractmethod
    def _generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        """One sequence, validated, run and streamed (`generate` holds its key share)."""

    @contextlib.contextmanager
    def _key_share(self, caller, sequences: int):
        """Hold `sequences` of the caller's API key's share (limits.max_sequences_per_key) for
        one call; refused (429) before any work when the key's calls would hold more. With keys
        off every client is the same anonymous tenant: no per-key bound then."""
        who = identity(caller)
        if who is None:
            yield
            return
        cap, held = self.limits.max_sequences_per_key, self.sequences_per_key[who]
        if held + sequences > cap:
            self.metrics.refused("key_sequences")
            raise RequestError("resource_exhausted", f"this API key has {held} sequence(s) in flight on this "
                               f"worker and this call adds {sequences}, over its limit of {cap} "
                               "(limits.max_sequences_per_key); wait for some to finish", None, None, 1000)
        self.sequences_per_key[who] += sequences
        try:
            yield
        finally:
            self.sequences_per_key[who] -= sequences
            if self.sequences_per_key[who] <= 0:
                del self.sequences_per_key[who]

    async def generate_many(self, inputs: list[GenerateInput], n: int = 1) -> AsyncIterator[tuple[int, Chunk]]:
        """Several prompts, ``n`` samples each: ``(index, chunk)`` as chunks come, where
        index = prompt index * n + sample index (OpenAI's choice index).

        Every sequence is validated and admitted before the first chunk is yielded, so a
        refusal of any of them (RequestError) ends all of them before the client is
        answered. Sample 0 of each prompt starts first; its siblings start once it has its
        first token, when the prompt's full blocks are in the prefix cache: they share those
        blocks instead of computing them again (and may route locally on that hit). With
        several sequences, sequence i runs as request ``<request_id>-<i>``; with a seed,
        sample j uses seed + j (vLLM's parallel sampling).
        """
        cap = self.limits.max_sequences_per_request
        if len(inputs) * n > cap:
            raise RequestError("invalid_argument", f"n: {len(inputs)} prompt(s) x n={n} = {len(inputs) * n} "
                               f"sequences, over this worker's limit of {cap} "
                               "(limits.max_sequences_per_request); send fewer prompts or a smaller n", "n")
        if len(inputs) == 1 and n == 1:
            async for chunk in self.generate(inputs[0]):
                yield 0, chunk
            return
        with self._key_share(inputs[0].caller, len(inputs) * n):
            async for item in self._generate_many(inputs, n):
                yield item

    async def _generate_many(self, inputs: list[GenerateInput], n: int) -> AsyncIterator[tuple[int, Chunk]]:
        base = inputs[0].request_id or uuid.uuid4().hex
        seqs: dict[int, AsyncIterator[Chunk]] = {}
        firsts: dict[int, Chunk] = {}
        pending: dict[asyncio.Future, int] = {}
        try:
            for wave in (range(1), range(1, n)):
                started = [p * n + j for p in range(len(inputs)) for j in wave]
                for i in started:
                    seqs[i] = self._generate(sample_input(inputs[i // n], i % n, f"{base}-{i}"))
                got = await asyncio.gather(*(seqs[i].__anext__() for i in started), return_exceptions=True)
                for item in got:
                    if isinstance(item, BaseException):
                        raise item
                firsts.update(zip(started, got))
            for i in sorted(firsts):
                yield i, firsts[i]
                if firsts[i].finish_reason is None:
                    pending[asyncio.ensure_future(seqs[i].__anext__())] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=pending.__getitem__):
                    i = pending.pop(fut)
                    try:
                        chunk = fut.result()
                    except StopAsyncIteration:
                        continue
                    yield i, chunk
                    if chunk.finish_reason is None:
                        pending[asyncio.ensure_future(seqs[i].__anext__())] = i
        finally:  # a refusal, an error or the client gone: end every sequence (frees its blocks)
            for fut in pending:
                fut.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for gen in seqs.values():
                await gen.aclose()

    async def detokenize(self, token_ids: list[int]) -> str:
        """Text of token ids (special tokens skipped), in the tokenizer pool."""
        tok = self.tokenizer
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, tok.decode, token_ids)

