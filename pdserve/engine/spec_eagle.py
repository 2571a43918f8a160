"""Speculative decoding's EAGLE proposer (``method: eagle`` / ``eagle3``; docs/speculative.md,
"EAGLE heads"; the head itself: engine/spec_eagle_model.py).

An EAGLE head is a one-layer model that reads, beside each token, the target's hidden state
at the position before it: its row i holds token i + 1 with the target's hidden state at
position i, at position i (vLLM's layout), and its logits there propose token i + 2. So the
target's forward keeps the hidden states the head needs (engine/model.py, ``capture_layers`` /
``capture_final``: the final norm's output for EAGLE-1, the residual stream after three layers
for EAGLE-3), and after each forward `EagleProposer.record` keeps each request's rows by
position (EAGLE-3's already through the head's ``fc``), until the head has read them.

It is the draft-model proposer (engine/spec_draft.py) with another runner and another rollback:
the same `KVCacheManager` pool of its own, views, catch-up in forwards of at most
``max_num_batched_tokens`` rows, greedy proposals under the request's grammar, release on
finish, abort and preemption. Rows computed from the target's hidden states stay (the
request's computed positions); the rows of a step's proposals, computed from the head's own
hidden output (each proposal's row reads the previous row's output, as in vLLM), are given up
before the next proposals whatever the target accepted: their positions are computed again
from the target's hidden states. A position whose hidden state the target never computed here
(its KV came from the prefix cache, or a step run by a CUDA graph) reads zeros: the proposals
there are weaker, the verification as exact as for any proposal.

Across P/D (``draft_prompt_kv`` auto or prefill on both roles; docs/speculative.md, "In the
cluster"): the prefill worker runs the same head. After each prefill step its head computes
the rows of every export's chunk the step computed (`record`, `_export_rows`: rows 0 .. n - 2
of an n-token prompt, tokens 1 .. n - 1, for the first token, n's, is not sampled yet) into
blocks of its pool laid out as the decode worker reserved them (`prompt_slots`), and after the
last chunk it writes one more block that carries row n - 1's hidden input, the target's hidden
state at the last prompt position (`_put_carrier`: its bytes, as float32, laid over that
block's pages, layer by layer); `compute_prompts` hands the finished ones to the write. No
hidden state is kept past its step. The decode worker takes that row back out
(`adopt`), gives the block back, and its first proposal computes row n - 1 as the local path
does: a remote prompt reads the same rows as a local one (zeros where the prefill worker's
prefix cache held a position, as a local prefix-cache hit reads). Without it (``decode``, or a prefill
worker without the head) the prompt's rows read zeros.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from .block_manager import KVCacheManager
from .config import ConfigError, EngineConfig, ModelConfig
from .model import CausalLM
from .request import Request, SamplingParams
from .runner import ModelRunner
from .spec_config import SpeculativeConfig
from .spec_draft import DraftProposer, _Seq, draft_engine_config
from .spec_eagle_model import EagleHead, HeadConfig, load_eagle_head
from .spec_mtp_model import METHOD as MTP
from .spec_mtp_model import MTPHead, load_mtp_head, proposer_head_config
from .step_batch import StepBatch, build_step_batch
from .structured_state import StructuredOutputs

log = logging.getLogger(__name__)

# The carrier block holds its hidden row as float32 whatever the two workers' model dtypes (the
# pool's layout, checked when written, is the KV's: under FP8 KV it says nothing of them).
CARRIER_DTYPE = torch.float32


class EagleRunner(ModelRunner):
    """A `ModelRunner` whose model is an EAGLE head: `execute` reads each row's hidden input
    from ``hidden`` (set before each call) and keeps the rows' hidden output in ``out``."""

    calibrates_kv_scales = False  # an FP8 head pool keeps scales of 1.0 (its forward takes hidden states)

    def __init__(self, cfg: EngineConfig, hc: HeadConfig, target: ModelConfig):
        self.hc, self.target_cfg = hc, target
        self.hidden: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.last_qsl: list[int] = []
        super().__init__(cfg, hc.model)

    def _make_model(self, model_cfg: ModelConfig) -> torch.nn.Module:
        if self.hc.method == MTP:
            return load_mtp_head(self.hc, self.target_cfg, self.dtype, self.device)
        return load_eagle_head(self.hc, self.target_cfg, self.dtype, self.device)

    def execute(self, scheduled: list[tuple[Request, int]], kv: KVCacheManager,
                layer_hook=None) -> tuple[torch.Tensor, StepBatch]:
        batch = build_step_batch(scheduled, kv, self.block_size, self.device)
        meta = self.backend.plan(batch.layout, self.device)
        assert self.hidden is not None and self.hidden.shape[0] == batch.input_ids.shape[0]
        logits, self.out = self.model(batch.input_ids, batch.positions, self.hidden, self.kv_cache, self.backend,
                                      meta, batch.logits_indices)
        self.hidden, self.last_qsl = None, batch.layout.query_start_loc.tolist()
        return logits, batch


@dataclass
class _States:
    """A request's hidden rows for the head, by position: ``(first position, rows)`` chunks."""

    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def put(self, pos: int, rows: torch.Tensor) -> None:
        """Rows from ``pos`` on; the rows kept at or past ``pos`` (a step's rejected proposals) go."""
        kept = []
        for p, t in self.chunks:
            if p < pos:
                kept.append((p, t[:pos - p]))
        kept.append((pos, rows))
        self.chunks = kept

    def take(self, a: int, b: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Rows ``[a, b)`` (zeros where none was kept); the rows before ``b`` are dropped."""
        out = torch.zeros(b - a, width, dtype=dtype, device=device)
        kept = []
        for p, t in self.chunks:
            lo, hi = max(a, p), min(b, p + t.shape[0])
            if lo < hi:
                out[lo - a:hi - a] = t[lo - p:hi - p]
            if p + t.shape[0] > b:
                kept.append((max(p, b), t[max(0, b - p):]))
        self.chunks = kept
        return out


class EagleProposer(DraftProposer):
    """An EAGLE head, its KV pool, each request's place in it and the target hidden states it
    has yet to read."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig, target_blocks: int,
                 target_model: torch.nn.Module):
        if not isinstance(target_model, CausalLM):
            raise ConfigError(f"speculative_config.method={spec.method!r}: the target model does not expose its "
                              "hidden states")
        self.target = target_model
        self.hc = proposer_head_config(spec.model, spec.method, target)
        spec = replace(spec, model=self.hc.model.path)  # (MTP's: the target's own directory when not given)
        self.model_config = self.hc.model
        blocks = max(1, int(target_blocks * spec.draft_kv_cache_fraction))
        dcfg = draft_engine_config(config, spec, blocks)
        try:
            self.head_runner = EagleRunner(dcfg, self.hc, target)
        except torch.cuda.OutOfMemoryError as exc:
            raise ConfigError(
                f"speculative_config.draft_kv_cache_fraction={spec.draft_kv_cache_fraction}: the EAGLE head and "
                f"its pool of {blocks} blocks do not fit beside the target ({exc}); lower it") from None
        self.runner = self.head_runner
        self._setup(spec, config, self.model_config.max_position_embeddings)
        self.states: dict[str, _States] = {}
        self.last: dict[str, torch.Tensor] = {}  # each proposing request's last row's hidden output
        # The prefill side: each export's view in the head's pool (None: it gets no head rows).
        self.exports: dict[str, Request | None] = {}
        kv = self.runner.kv_cache
        self.carries = kv.shape[0] * kv[0, 0].numel() * kv.element_size() >= (
            self.model_config.hidden_size * CARRIER_DTYPE.itemsize)  # (a block holds a hidden row)
        self.target = target_model
        if self.hc.method in ("eagle", MTP):
            target_model.capture_final = True
        else:
            target_model.capture_layers = self.hc.aux_layers

    @property
    def head(self) -> EagleHead | MTPHead:
        model = self.runner.model
        assert isinstance(model, (EagleHead, MTPHead))
        return model

    # -- the target's hidden states ------------------------------------------------
    def record(self, scheduled: list[tuple[Request, int]]) -> None:
        """Keep the hidden states the target's forward just computed, each request's rows by
        position (called after the forward, before the computed counts move); an export's (a
        prompt prefilled for another worker that asked for the head's rows: ``export_draft``)
        go through the head at once (`_export_rows`)."""
        captured, self.target.captured = self.target.captured, None
        if captured is None or captured.shape[0] != sum(n for _, n in scheduled):
            return  # (a step run by a CUDA graph keeps none: the head reads zeros there)
        # Whose rows are wanted (an export whose decode worker asked for no head rows: nobody's).
        wanted = [not req.keep_kv or req.export_draft for req, _ in scheduled]
        if not any(wanted):
            return  # (a prefill step of exports that asked for none: no head work)
        exports: list[tuple[Request, torch.Tensor]] = []
        try:
            with torch.inference_mode():
                rows = self.head.combine(captured.to(self.runner.device, self.runner.dtype))
                off = 0
                for (req, n), want in zip(scheduled, wanted):
                    if want and req.keep_kv:
                        exports.append((req, rows[off:off + n]))
                    elif want:
                        self.states.setdefault(req.request_id, _States()).put(req.num_computed_tokens,
                                                                              rows[off:off + n].clone())
                    off += n
        except Exception:  # noqa: BLE001  (the head's failure costs proposals, never the requests)
            log.exception("the EAGLE head could not keep the target's hidden states; it reads zeros there")
        if exports:
            self._export_rows(exports)

    def forget(self, request_id: str) -> None:
        """An export is done with (written or not): its view goes (its blocks: the caller's)."""
        self.exports.pop(request_id, None)

    def release(self, request_id: str) -> None:
        if request_id in self.exports:  # (finished or preempted: its head blocks wait for `forget`'s caller)
            self.seqs.pop(request_id, None)
        else:
            super().release(request_id)
        self.states.pop(request_id, None)
        self.last.pop(request_id, None)

    def retain(self, live: set[str]) -> None:
        super().retain(live)
        for rid in [r for r in self.states if r not in live]:
            self.states.pop(rid, None)

    # -- proposing -------------------------------------------------------------------
    def _sync(self, req: Request) -> _Seq:
        """The request's view: tokens shifted by one (row i holds token i + 1), its pool rolled
        back to the rows computed from the target's hidden states (at least the last row runs)."""
        rid = req.request_id
        seq = self.seqs.get(rid)
        if seq is None:
            seq = self.seqs[rid] = _Seq(Request(rid, [], SamplingParams(temperature=0.0, max_tokens=1)))
        tokens = req.all_token_ids
        valid = min(seq.valid, len(tokens) - 2)
        self.kv.trim(rid, valid)
        view = seq.view
        view.prompt_token_ids, view.output_token_ids, view.num_computed_tokens = tokens[1:], [], valid
        seq.valid, seq.extra = valid, []
        return seq

    def _forward(self, plan: list[tuple[_Seq, int]], structured: StructuredOutputs) -> None:
        if not plan:
            return
        width = self.model_config.hidden_size
        parts = []
        for s, n in plan:
            rid, c = s.view.request_id, s.view.num_computed_tokens
            if c >= s.view.num_prompt_tokens:  # a proposal's row: the head's own last output
                parts.append(self.last[rid])
            else:  # rows from the target's hidden states at positions [c, c + n)
                parts.append(self.states.setdefault(rid, _States()).take(c, c + n, width, self.runner.dtype,
                                                                                  self.runner.device))
        self.head_runner.hidden = torch.cat(parts)
        super()._forward(plan, structured)
        out, qsl = self.head_runner.out, self.head_runner.last_qsl
        assert out is not None
        for i, (s, _) in enumerate(plan):
            self.last[s.view.request_id] = out[qsl[i + 1] - 1:qsl[i + 1]]

    # -- a prompt's rows from a prefill worker ------------------------------------------
    def ships(self, decoding: int) -> bool:
        """``auto`` always ships: this worker's target never computed a remote prompt's hidden
        states, so the head could compute its prompt rows only from zeros."""
        return self.prompt_kv != "decode" and self.carries and self.asks.asking(self.prompt_kv)

    def prompt_slots(self, num_tokens: int) -> int:
        """Rows 0 .. n - 2, then one block more: the carrier of row n - 1's hidden input."""
        return -(-(num_tokens - 1) // self.block_size) * self.block_size + 1

    def adopt(self, request_id: str, num_tokens: int) -> None:
        n = num_tokens
        carrier = self.kv.block_ids(request_id)[-(-(n - 1) // self.block_size)]
        self.states.setdefault(request_id, _States()).put(n - 1, self._take_carrier(carrier))
        self.kv.trim(request_id, n - 1)  # (the carrier block goes back)
        super().adopt(request_id, n - 1)

    def _export_rows(self, chunks: list[tuple[Request, torch.Tensor]]) -> None:
        """The prefill side, after a step: the head's rows of each export's chunk (``hidden``:
        the chunk's hidden inputs, from its first computed position on), one forward for them
        all; the carrier written after a prompt's last chunk. An export the pool cannot hold, or
        whose chunks do not follow each other (recomputed), gets none."""
        width, plan, parts = self.model_config.hidden_size, [], []
        try:
            with torch.inference_mode():
                for req, hidden in chunks:
                    key, c, n = req.request_id, req.num_computed_tokens, req.num_prompt_tokens
                    if key not in self.exports:  # its first chunk: its blocks, and zeros for a cached prefix
                        ok = key not in self.kv.tables and self.kv.allocate(key, self.prompt_slots(n))
                        self.exports[key] = (Request(key, list(req.prompt_token_ids[1:]),
                                                     SamplingParams(temperature=0.0, max_tokens=1)) if ok else None)
                        if ok and c:
                            hidden = torch.cat([hidden.new_zeros(c, width), hidden])
                            c = 0
                    view = self.exports[key]
                    if view is None or c > view.num_computed_tokens:
                        self._drop_export(key)
                        continue
                    hidden = hidden[view.num_computed_tokens - c:]  # (what it computed before: not again)
                    c = view.num_computed_tokens
                    m = min(c + hidden.shape[0], n - 1) - c  # (row n - 1 is the decode side's)
                    if m > 0:
                        plan.append((view, m))
                        parts.append(hidden[:m])
                    if c + hidden.shape[0] == n:
                        self._put_carrier(self.kv.block_ids(key)[-1], hidden[n - 1 - c])
                if plan:
                    self.head_runner.hidden = torch.cat(parts)
                    self.head_runner.execute(plan, self.kv)
                    self.num_forwards += 1
                    for view, m in plan:
                        view.num_computed_tokens += m
                        self.num_tokens += m
        except Exception:  # noqa: BLE001  (the head's failure costs proposals, never the requests)
            log.exception("the EAGLE head could not compute %d exports' rows; they get none", len(chunks))
            for req, _ in chunks:
                self._drop_export(req.request_id)

    def _drop_export(self, key: str) -> None:
        self.kv.free(key)
        self.exports[key] = None

    def compute_prompts(self, prompts: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """The exports whose head rows and carrier are in place (`_export_rows`), by key: their
        blocks. One left out gets none (its decode worker's head computes the rows itself)."""
        out = {}
        for key, tokens in prompts:
            view = self.exports.get(key)
            if view is not None and len(tokens) == view.num_prompt_tokens + 1 == view.num_computed_tokens + 1:
                out[key] = list(self.kv.block_ids(key))
        if out and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # (NIXL reads the pool once this returns)
        return out

    def _carrier_pages(self, block: int) -> list[torch.Tensor]:
        """The bytes of ``block``'s pages, layer by layer."""
        kv = self.runner.kv_cache
        return [kv[layer, block].reshape(-1).view(torch.uint8) for layer in range(kv.shape[0])]

    def _put_carrier(self, block: int, row: torch.Tensor) -> None:
        data, off = row.to(CARRIER_DTYPE).contiguous().reshape(-1).view(torch.uint8), 0
        for page in self._carrier_pages(block):
            m = min(page.numel(), data.numel() - off)
            page[:m].copy_(data[off:off + m])
            off += m

    def _take_carrier(self, block: int) -> torch.Tensor:
        size = self.model_config.hidden_size * CARRIER_DTYPE.itemsize
        data = torch.cat(self._carrier_pages(block))[:size].clone()
        return data.view(CARRIER_DTYPE).reshape(1, -1).to(self.runner.dtype)
