"""What the serving APIs (gRPC, api/grpc_service.py; HTTP, api/http_app.py) serve: a `Surface`.
A decode worker's is its `Frontend` (decode/frontend.py); a gateway's routes each request to
a decode worker (gateway/frontend.py). One implementation of both APIs serves either.

The base holds what does not depend on where a sequence runs: request validation against
the model (`PromptChecker`), the serving limits, each tenant's share (sequences:
limits.max_sequences_per_key; tokens: qos.max_tokens_per_tenant, `tenant_token_limit`),
several prompts and samples as one call (`generate_many`), detokenization, and the model card.

A tenant is an API key, or with keys off a client address (api/security.py `Client`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from pdserve.engine import SamplingParams
from pdserve.engine.prompts import PromptChecker
from pdserve.router.qos import TokenLimit, admit_tenant_tokens

from .adapters import AdapterCard, Adapters
from .ingress import Chunk, GenerateInput, RequestError, ServingLimits, sample_input
from .validate import Validator, check_privileges


# A request validated and tokenized: its prompt's token ids, its sampling, its priority.
Checked = tuple[list[int], SamplingParams, int]


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


def tenant_of(caller) -> str | None:
    """Whose share a request takes (the per-tenant caps here, the scheduler's turns): its API
    key's identity, or with keys off its client's (``addr:<address>``, api/security.py
    `Client`); None: not known (a caller without an address), no per-tenant bound then."""
    if caller is None:
        return None
    return getattr(caller, "tenant", None) or caller.identity


@dataclasses.dataclass
class _Hold:
    """What one call holds of its tenant's share: its sequences (taken before any work) and the
    tokens they claim (taken once its prompts are tokenized)."""

    tenant: str
    sequences: int
    tokens: int = 0


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
        self.sequences_per_key: Counter[str] = Counter()  # tenant -> sequences its calls hold
        self.tokens_per_tenant: Counter[str] = Counter()  # tenant -> tokens (prompt + max_tokens) its calls claim
        # id(input) -> the call's hold, until `validated` claims the sequence's tokens from it
        self._holds: dict[int, _Hold] = {}
        # id(sample input) -> its validation, done once per prompt by `generate_many`
        self._checked: dict[int, Checked] = {}
        # The LoRA adapters a request's model may name (api/adapters.py); None: none are served
        # (a decode worker started with enable_lora sets them, `serve_adapters`).
        self.adapters: Adapters | None = None
        self._adapter_loads = asyncio.Lock()
        # Awaited after an adapter is loaded or unloaded at run time (a decode worker republishes
        # its etcd record's ``lora_adapters``: decode/worker.py); None: nothing to tell.
        self.on_adapters_changed: Callable[[], Awaitable[None]] | None = None

    def serve_adapters(self, adapters: Adapters) -> None:
        """Serve LoRA adapters by name: the request's model names one, /v1/models lists them."""
        self.adapters = adapters
        self.validator.adapters = adapters

    def adapter_cards(self) -> list[AdapterCard]:
        """The adapters served now (empty without adapters)."""
        return self.adapters.cards() if self.adapters is not None else []

    async def load_adapter(self, name: object, path: object) -> None:
        """Serve one more adapter (vLLM's /v1/load_lora_adapter): its files are read and
        checked off the event loop; RequestError naming the field when refused."""
        adapters = self._adapters_or_refuse()
        async with self._adapter_loads:  # one at a time: a name is checked free, then taken
            await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, adapters.load, name, path)
        if self.on_adapters_changed is not None:
            await self.on_adapters_changed()

    async def unload_adapter(self, name: object) -> None:
        """Stop serving an adapter (vLLM's /v1/unload_lora_adapter): 404 when not served, 409
        while requests run under it."""
        self._adapters_or_refuse().unload(name)
        if self.on_adapters_changed is not None:
            await self.on_adapters_changed()

    def _adapters_or_refuse(self) -> Adapters:
        if self.adapters is None:
            raise RequestError("invalid_argument", "lora_name: this worker serves no LoRA adapters (start it with "
                               "the engine argument enable_lora)", "lora_name")
        return self.adapters

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

    def validate(self, inp: GenerateInput) -> Checked:
        """Check and tokenize one request (CPU work: call it off the event loop)."""
        return self.validator.validate(inp)

    async def validated(self, inp: GenerateInput) -> Checked:
        """`validate` in the tokenizer pool; then, for a call `generate` holds a share for, its
        tokens are claimed (RequestError when over the tenant's limit). A sample of a
        `generate_many` call comes back as that call validated its prompt (no second tokenizing)."""
        done = self._checked.pop(id(inp), None)
        if done is not None:
            return done
        ids, params, prio = await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self.validate, inp)
        hold = self._holds.pop(id(inp), None)
        if hold is not None:
            self._claim(hold, len(ids) + params.max_tokens,
                        f"{len(ids)} prompt tokens + max_tokens {params.max_tokens}")
        return ids, params, prio

    def tenant_token_limit(self) -> TokenLimit | None:
        """The tokens one tenant's calls in flight may claim here together (router/qos.py
        `tenant_token_limit`); None: no bound (a gateway: each worker bounds its own)."""
        return None

    @abc.abstractmethod
    def abort(self, request_id: str, caller=None) -> bool:
        """Abort an in-flight request by the id its client gave; False if unknown."""

    async def generate(self, inp: GenerateInput) -> AsyncGenerator[Chunk, None]:
        """One sequence, within its tenant's share (its tokens are claimed by `validated`)."""
        with self._tenant_share(inp.caller, 1) as hold:
            if hold is not None:
                self._holds[id(inp)] = hold
            try:
                async for chunk in self._generate(inp):
                    yield chunk
            finally:
                self._holds.pop(id(inp), None)  # refused before its validation: nothing was claimed

    @abc.abstractmethod
    def _generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        """One sequence, validated (`validated`), run and streamed (`generate` holds its
        tenant's share)."""

    @contextlib.contextmanager
    def _tenant_share(self, caller, sequences: int):
        """Hold `sequences` of the caller's tenant's share (limits.max_sequences_per_key) for
        one call; refused (429) before any work when its calls would hold more. Yields the
        call's `_Hold` (None: no tenant known, no bound), from which `_claim` takes its tokens;
        all of it is given back when the call ends, however it ends."""
        who = tenant_of(caller)
        if who is None:
            yield None
            return
        cap, held = self.limits.max_sequences_per_key, self.sequences_per_key[who]
        if held + sequences > cap:
            self.metrics.refused("key_sequences")
            raise RequestError("resource_exhausted", f"{_whose(caller, who)} has {held} sequence(s) in flight on "
                               f"this worker and this call adds {sequences}, over its limit of {cap} "
                               "(limits.max_sequences_per_key); wait for some to finish", None, None, 1000)
        hold = _Hold(who, sequences)
        self.sequences_per_key[who] += sequences
        try:
            yield hold
        finally:
            _give_back(self.sequences_per_key, who, sequences)
            _give_back(self.tokens_per_tenant, who, hold.tokens)

    def _claim(self, hold: _Hold, tokens: int, what: str) -> None:
        """Claim ``tokens`` for the call holding ``hold`` (``what``: how they add up, for the
        refusal), or refuse it (429, param max_tokens) when its tenant would claim more than
        `tenant_token_limit`; before any of its sequences is admitted."""
        limit = self.tenant_token_limit()
        if limit is not None:
            verdict = admit_tenant_tokens(self.tokens_per_tenant[hold.tenant], tokens, limit, what)
            if not verdict.ok:
                self.metrics.refused("tenant_tokens")
                raise RequestError("resource_exhausted", f"max_tokens: {verdict.detail} [tenant {hold.tenant}]",
                                   "max_tokens", None, verdict.retry_after_ms)
        hold.tokens += tokens
        self.tokens_per_tenant[hold.tenant] += tokens

    async def generate_many(self, inputs: list[GenerateInput], n: int = 1
                            ) -> AsyncGenerator[tuple[int, Chunk], None]:
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
        with self._tenant_share(inputs[0].caller, len(inputs) * n) as hold:
            # Every prompt is validated once, now, so that the call's tokens are known (and
            # claimed, or refused) before any of its sequences is admitted; the samples reuse it.
            check_privileges(inputs[0])  # as each sequence would, before any tokenizing
            results = await asyncio.gather(*(self.validated(inp) for inp in inputs), return_exceptions=True)
            checked: list[Checked] = []
            for item in results:  # the first bad prompt's error, as its sequence would have raised it
                if isinstance(item, BaseException):
                    raise item
                checked.append(item)
            if hold is not None:
                # A prompt's n samples share its prompt's KV blocks (the prefix cache): it counts
                # once, max_tokens once per sequence.
                prompt = sum(len(ids) for ids, _, _ in checked)
                out = [params.max_tokens for _, params, _ in checked]
                each = f"max_tokens {out[0]}" if len(set(out)) == 1 else f"max_tokens {min(out)}-{max(out)}"
                self._claim(hold, prompt + n * sum(out),
                            f"{prompt} prompt tokens + {len(inputs) * n} sequences x {each}")
            async for choice in self._generate_many(inputs, n, checked):
                yield choice

    async def _generate_many(self, inputs: list[GenerateInput], n: int, checked: list[Checked]
                             ) -> AsyncGenerator[tuple[int, Chunk], None]:
        base = inputs[0].request_id or uuid.uuid4().hex
        seqs: dict[int, AsyncIterator[Chunk]] = {}
        samples: list[GenerateInput] = []
        firsts: dict[int, Chunk] = {}
        pending: dict[asyncio.Future[Chunk], int] = {}
        try:
            for wave in (range(1), range(1, n)):
                started = [p * n + j for p in range(len(inputs)) for j in wave]
                for i in started:
                    sample = sample_input(inputs[i // n], i % n, f"{base}-{i}")
                    ids, params, prio = checked[i // n]
                    # What validating the sample would give: its prompt's, with its own seed; its
                    # own list of ids (the engine keeps each request's).
                    self._checked[id(sample)] = (list(ids), dataclasses.replace(params, seed=sample.params.seed), prio)
                    samples.append(sample)
                    seqs[i] = self._generate(sample)
                got = await asyncio.gather(*(seqs[i].__anext__() for i in started), return_exceptions=True)
                for i, item in zip(started, got):
                    if isinstance(item, BaseException):
                        raise item
                    firsts[i] = item
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
                if isinstance(gen, AsyncGenerator):  # every Surface's `_generate` is one
                    await gen.aclose()
            for sample in samples:  # one refused before its validation leaves its entry
                self._checked.pop(id(sample), None)

    async def detokenize(self, token_ids: list[int]) -> str:
        """Text of token ids (special tokens skipped), in the tokenizer pool."""
        tok = self.tokenizer
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, tok.decode, token_ids)


def _whose(caller, tenant: str) -> str:
    """The tenant as a refusal names it."""
    return "this API key" if getattr(caller, "tenant", None) is None else f"this client ({tenant})"


def _give_back(counter: Counter[str], tenant: str, amount: int) -> None:
    counter[tenant] -= amount
    if counter[tenant] <= 0:
        del counter[tenant]
