"""The remote-KV seam: everything a disaggregated worker may do with an engine's KV.

Modelled on the two sides of vLLM v1's KV connector, narrowed to what pdserve's
workers need. Call it from the thread that drives the engine (like the engine).

Decode side, the prompt's KV arrives from a prefill worker:

    (the scheduler reserves blocks for a request added with ``remote_kv`` in the step that
    admits it: engine/remote_kv.py, its side of the seam; `take_reservations` reports them)
    reserve(req)            the same at once, outside a step (the simulator, tests)
    then exactly one of
    remote_ready(rid, tok)  the pages are written: the request runs from its first token
    fall_back(rid, q)       prefill locally; the reservation is released, or kept under
                            the quarantine key ``q`` while a late write may still land
    abort(rid, q)           the client is gone; same choice for the reservation
    replace(rid, q)         a new attempt: the reservation moves under ``q`` and fresh blocks
                            are reserved (or None: no room, queued for a local prefill)
    free(key)               release a quarantined reservation

Prefill side, the prompt's KV leaves for a decode worker:

    add_export(...)         queue a prompt whose blocks outlive the request
    finishing(scheduled)    the exports whose prompt completes in this step (their
                            pages can stream layer by layer during its forward pass)
    export_blocks(...)      the blocks holding positions [cached_len, n)
    release_export(rid)     free those blocks once written, and forget the request

Lending a cached prefix to another worker's read (kvtransfer/lend.py), either role:

    lend_chain(tail, n)     pin the n cached blocks whose chain ends at hash ``tail``
                            (from a prompt's first block); their ids, or None
    load_chain(tail, n, k)  part of that chain sits in the second tier: load it back first
    finish_tier_loads()     register finished tier loads now (an idle engine takes no step)
    unlend(ids)             unpin them (the read is over, or the lease ended)
    begin_borrow(...)       pin this pool's own hits of a prompt, take blocks for the
                            lent ones it lacks: where a read lands
    end_borrow(b, ok)       register what was read as cached prefix (ok) or not, and let go
    abandon_borrow(b, q)    a read that may still land: keep its blocks under ``q``
    block_checksums(ids)    a 64-bit checksum of each block's bytes (kv_transport.verify)

Both sides: ``kv_tensor`` / ``layout_info()`` (what NIXL registers and peers check),
``kv_bytes(n)``, ``kv_bytes_per_token`` and ``cached_prefix_len``.

Workers use only this seam and the engine's public request API
(tests/cluster/test_layering.py checks it); the scheduler, the block manager and
request internals stay the engine's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common import Priority

from .block_manager import Block, block_hashes
from .lora_request import LoRARequest
from .remote_kv import Reservation
from .request import Request, SamplingParams
from .spec_draft import DraftProposer
from .sampler import SampleResult

if TYPE_CHECKING:
    import torch

    from .engine_types import RequestDelta
    from .llm_engine import LLMEngine


log = logging.getLogger(__name__)


@dataclass
class Borrow:
    """Blocks taken for a lent prefix: ``block_ids`` receive the lent blocks ``first..`` of
    the prompt's chain (``hashes[first:]``); ``held``: everything pinned meanwhile."""

    hashes: list[bytes]
    parents: list[bytes | None]
    tokens: list[tuple[int, ...]]
    first: int  # this pool's own hit: blocks [0, first) need no read
    block_ids: list[int]
    held: list  # Block objects: the own hits, then the targets


# Weights of `kv_block_checksums`, per (words in a block, device): made once.
_CHECKSUM_WEIGHTS: dict = {}
_U64_MASK = (1 << 64) - 1


def kv_block_checksums(kv: "torch.Tensor", block_ids: list[int]) -> list[int]:
    """Checksums of blocks of a pool laid out [layers, blocks, ...]: of block ``b``, the
    bytes of ``kv[:, b]`` read as int16 words ``x_i``, ``sum(x_i * w_i)`` with fixed weights
    ``w_i`` in [1, 2**20) (a multiplicative hash of ``i``), as an unsigned 64-bit int.
    Integer arithmetic, so the same on a CPU and a GPU, and computed on the pool's device
    (one small copy back for all blocks). Every change of one word changes the sum; the sum
    stays below 2**63 in magnitude for blocks up to 2**28 words (512 MiB), so it is exact."""
    import torch

    if not block_ids:
        return []
    sums = []
    for b in block_ids:
        words = kv[:, int(b)].contiguous().view(-1).view(torch.uint8)
        if words.numel() % 2:  # (an odd byte count: a 1-byte dtype) pad to whole words
            words = torch.cat([words, words.new_zeros(1)])
        words = words.view(torch.int16)
        key = (words.numel(), words.device)
        w = _CHECKSUM_WEIGHTS.get(key)
        if w is None:
            i = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
            w = _CHECKSUM_WEIGHTS[key] = (i * 2654435761 + 40503) % 1048573 + 1
        sums.append((words.to(torch.int64) * w).sum())
    return [int(x) & _U64_MASK for x in torch.stack(sums).cpu().tolist()]


class KVConnector:
    """The remote-KV calls of one engine (see the module docstring)."""

    def __init__(self, engine: "LLMEngine"):
        self._eng = engine

    # -- facts ---------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._eng.config.block_size

    @property
    def kv_tensor(self) -> "torch.Tensor":
        """The whole KV pool, one tensor (docs/architecture.md, "KV pool"): what NIXL registers."""
        return self._eng.runner.kv_cache

    def layout_info(self) -> dict:
        """The pool's layout facts that peers compare before exchanging pages."""
        return self._eng.runner.layout_info()

    @property
    def kv_bytes_per_token(self) -> int:
        m = self._eng.model_config
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * self._eng.runner.kv_dtype.itemsize

    def kv_bytes(self, num_blocks: int) -> int:
        """Bytes of KV that ``num_blocks`` blocks hold across all layers."""
        return num_blocks * self._eng.runner.block_bytes * self._eng.model_config.num_layers

    def cached_prefix_len(self, token_ids: list[int], salt: bytes | None = None) -> int:
        """Prompt tokens the prefix cache holds now (read-only: nothing is pinned). The last
        token is always recomputed, as when the request is scheduled."""
        kv = self._eng.kv
        if not kv.pool.enable_caching:
            return 0
        bs = kv.block_size
        hashes = block_hashes(token_ids[: ((len(token_ids) - 1) // bs) * bs], bs, salt)
        return len(kv.pool.lookup(hashes)) * bs

    def tier_prefix_len(self, token_ids: list[int], cached_len: int, salt: bytes | None = None) -> int:
        """Prompt tokens the second KV tier (engine/kv_tier.py) holds right after the pool's
        ``cached_len`` (read-only; 0 without a tier). The last token is always recomputed."""
        tier = self._eng.tier
        if tier is None:
            return 0
        bs = self._eng.kv.block_size
        hashes = block_hashes(token_ids[: ((len(token_ids) - 1) // bs) * bs], bs, salt)
        return tier.leading(hashes[cached_len // bs:]) * bs

    def tier_load_ms_per_token(self) -> float:
        """Measured cost of loading one token's KV back from the tier (0 before its first load)."""
        tier = self._eng.tier
        if tier is None or not tier.load_bytes_per_s:
            return 0.0
        return tier.block_bytes / self._eng.kv.block_size / tier.load_bytes_per_s * 1e3

    # -- tensor parallelism (engine/tp_group.py) -------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return self._eng.runner.tensor_parallel_size

    @property
    def kv_layout(self) -> str:
        """"NHD" or "HND": the order inside a block of ``kv_tensor`` (rank 0's pool)."""
        return self._eng.runner.kv_layout

    @property
    def tp_group(self):
        """The TP group (its ``call``/``attach`` reach the other ranks' transport), None at TP=1."""
        return self._eng.runner.group

    def tp_broken(self) -> str | None:
        """Why the TP group is broken (a rank exited: the engine cannot step again), else None."""
        group = self._eng.runner.group
        return group.broken if group is not None else None

    def tp_rank_pids(self) -> list[int]:
        """Pids of ranks 1..N-1 (none at TP=1)."""
        group = self._eng.runner.group
        return [p.pid for p in group.procs] if group is not None else []

    # -- decode side -----------------------------------------------------------------------
    def reserve(self, req: Request) -> Reservation | None:
        """Reserve blocks now for ``req`` (from `LLMEngine.make_request`), whose prompt KV
        another worker writes, outside a step (the simulator, tests). None: the pool cannot
        hold it now, and the request was queued for a local prefill instead. A decode worker
        adds its requests with ``remote_kv`` instead: the scheduler reserves them in the step
        that admits them, and `take_reservations` reports it."""
        return self._eng.scheduler.reserve_now(req)

    def take_reservations(self) -> list[tuple[str, Reservation | None]]:
        """Requests added with ``remote_kv`` whose blocks the scheduler reserved since the last
        call (their `Reservation`), or queued for a local prefill for want of room (None)."""
        return self._eng.scheduler.remote_kv.take()

    @property
    def reservations_pending(self) -> bool:
        return self._eng.scheduler.remote_kv.pending

    def is_awaiting(self, request_id: str) -> bool:
        """True while the request's reservation waits for its remote KV."""
        return self._eng.scheduler.is_awaiting_remote(request_id)

    def remote_ready(self, request_id: str, first_token_id: int, first_logprob: float | None = None,
                     first_top_logprobs: dict[int, float] | None = None, draft_tokens: int = 0) -> "RequestDelta":
        """The pages are written and the other worker sampled the first token: the request
        joins the running batch from it (a first token the detokenizer refuses fails it).
        ``draft_tokens``: prompt positions of the draft model's KV the other worker wrote into
        the draft's reservation (the whole prompt, or 0: the draft computes it here)."""
        eng = self._eng
        req = eng.scheduler.remote_ready(request_id)
        draft = eng.spec.draft if eng.spec is not None else None
        if isinstance(draft, DraftProposer):  # (whatever its draft_prompt_kv: the counters say which way)
            shipped = request_id in draft.kv.tables and draft_tokens == req.num_prompt_tokens
            if request_id in draft.kv.tables:  # (it asked: `auto` learns whether asking is answered)
                draft.asks.answered(draft.prompt_kv, shipped)
            if shipped:
                try:
                    draft.adopt(request_id, draft_tokens)
                except Exception:  # noqa: BLE001  (the draft's failure costs proposals, never the request)
                    log.exception("request %s: the draft's shipped KV could not be taken; computed here", request_id)
                    draft.release(request_id)
                    shipped = False
            else:
                draft.kv.free(request_id)  # (none reserved, or none written: the draft computes it here)
            eng.stats.num_spec_prompts_shipped += shipped
            eng.stats.num_spec_prompts_local += not shipped
        eng.stats.num_prompt_tokens_cached += req.num_cached_tokens
        if req.generator is not None and not req.params.greedy:
            # The remote worker drew the first token from a generator with the same
            # seed; draw once here too so later tokens match the local path.
            eng.sampler.skip_draw(req)
        try:
            return eng.append_token(req, SampleResult(first_token_id, first_logprob, first_top_logprobs or None))
        except Exception as exc:  # noqa: BLE001
            return eng.fail_request(req, exc)

    def fall_back(self, request_id: str, quarantine_as: str | None = None) -> None:
        """Prefill locally; the reservation is released, or kept under ``quarantine_as``
        (release it later with `free`)."""
        self._eng.scheduler.remote_failed(request_id, quarantine_as)

    def abort(self, request_id: str, quarantine_as: str | None = None) -> bool:
        """Drop a request; an awaited reservation moves under ``quarantine_as`` first (when
        given) so that a late remote write cannot land in blocks someone else owns.
        False if the request is unknown or done."""
        if quarantine_as is not None and self.is_awaiting(request_id):
            self._eng.kv.rename(request_id, quarantine_as)
            self._eng.scheduler.quarantine_followers(request_id, quarantine_as)
        return self._eng.abort_request(request_id)

    def replace(self, request_id: str, quarantine_as: str) -> Reservation | None:
        """A new remote attempt of an awaited request: its reservation moves under
        ``quarantine_as`` (a late write of the old attempt lands there; release it with `free`)
        and fresh blocks are reserved for the uncached positions, as `reserve` does (its cached
        prefix is pinned again, shared with the quarantine). None: the pool cannot hold it now,
        and the request was queued for a local prefill instead."""
        return self._eng.scheduler.remote_replaced(request_id, quarantine_as)

    def free(self, key: str) -> None:
        """Release the blocks held under ``key`` (a quarantine, or a finished export), in the
        draft's pool too."""
        self._eng.kv.free(key)
        for pool in self._eng.scheduler.followers:
            pool.free(key)

    # -- a draft model's prompt KV beside the target's (engine/spec_draft.py) ---------------
    @property
    def draft(self) -> "DraftProposer | None":
        """The draft model or head whose prompt KV crosses with the target's
        (``speculative_config`` draft_prompt_kv "auto" or "prefill"), else None."""
        spec = self._eng.spec
        d = spec.draft if spec is not None else None
        if isinstance(d, DraftProposer) and spec is not None and spec.cfg.draft_prompt_kv != "decode":
            return d
        return None

    def draft_pool(self) -> "tuple[torch.Tensor, dict] | None":
        """The draft's pool and its layout facts (what NIXL registers beside the target's as
        ``"draft"``, kvtransfer/nixl/pools.py), or None."""
        d = self.draft
        return None if d is None else (d.runner.kv_cache, d.runner.layout_info())

    def export_draft(self, prompts: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """The prefill side: the draft's KV of each ``(request id, prompt)``, computed into blocks
        of its pool (by request id; one the pool cannot hold now is left out; a head's, computed
        along with the prompt, engine/spec_eagle.py). Written, then given back with
        `release_export`."""
        d = self.draft
        return d.compute_prompts(prompts) if d is not None else {}

    # -- lending a prefix (kvtransfer/lend.py) -------------------------------------------------------
    def lend_chain(self, tail_hash: bytes, num_blocks: int) -> list[int] | None:
        """Pin the ``num_blocks`` cached blocks whose hash chain ends at ``tail_hash`` and starts
        at a prompt's first block; their ids, first block first (at TP the same ids on every
        rank, each holding its heads). None when the chain is not (wholly) cached."""
        pool = self._eng.kv.pool
        if not pool.enable_caching:
            return None
        chain: list[Block] = []
        h: bytes | None = tail_hash
        while h is not None and len(chain) < num_blocks:
            block = pool.cached.get(h)
            if block is None:
                return None
            chain.append(block)
            h = block.parent_hash
        if len(chain) != num_blocks or h is not None:  # the chain must start at a prompt's first block
            return None
        chain.reverse()
        pool.touch(chain)
        if not self._flush_tier():  # a block loaded back from the tier is whole on every rank before it is read
            pool.release(list(reversed(chain)))
            return None
        return [b.block_id for b in chain]

    def _flush_tier(self) -> bool:
        """With a second tier: the tier copies out of (and into) blocks are made on every rank,
        and on a GPU have landed, before block ids leave the engine (another worker reads or
        writes them with NIXL; engine/kv_tier.py `flush`). False when that failed (a rank
        refused its copies): the caller gives back what it took and lends or borrows nothing."""
        if self._eng.tier is None:
            return True
        try:
            self._eng.tier.flush()
        except Exception as exc:  # noqa: BLE001  (TPControlError, TPGroupBroken: the steps will say so too)
            log.warning("second KV tier: the copies before block ids leave the engine failed: %r", exc)
            return False
        return True

    def load_chain(self, tail_hash: bytes, num_blocks: int, key: str):
        """The chain `lend_chain` wants, when part of it has left the pool for the second tier
        (engine/kv_tier.py): load that part back, as a prefix hit's load does, so that once the
        load is ``finished`` (`finish_tier_loads`) `lend_chain` finds the whole chain in the pool.
        The `TierLoad`, or None: no tier, the chain is not whole across pool and tier, or the
        pool has no room for it now."""
        kv, tier = self._eng.kv, self._eng.tier
        pool = kv.pool
        if tier is None or not pool.enable_caching:
            return None
        chain: list[bytes] = []
        h: bytes | None = tail_hash
        while h is not None and len(chain) < num_blocks:
            block = pool.cached.get(h)
            meta = (block.parent_hash, None) if block is not None else tier.chain_meta(h)
            if meta is None:
                return None
            chain.append(h)
            h = meta[0]
        if len(chain) != num_blocks or h is not None:
            return None
        chain.reverse()
        kept = [pool.cached[h] for h in chain if h in pool.cached]
        missing = [h for h in chain if h not in pool.cached]
        if not missing or len(missing) > pool.num_free - sum(1 for b in kept if b.ref_cnt == 0):
            return None
        pool.touch(kept)  # the chain's pool blocks are not evicted to make room for the rest
        blocks = pool.allocate(len(missing))
        load = tier.start_load(key, missing, blocks, kept + blocks)
        if load is None:
            pool.release(list(reversed(kept + blocks)))
            return None
        if len(load.blocks) < len(missing):  # part of it left the tier meanwhile: the lend will find it gone
            pool.release(list(reversed(blocks[len(load.blocks):])))
            load.held = kept + load.blocks
        return load

    def finish_tier_loads(self) -> None:
        """Register the finished loads of the second tier (`load_chain`'s too) in the prefix
        cache now, as the engine's next step would."""
        if self._eng.tier is not None:
            self._eng.scheduler.finish_loads()

    def unlend(self, block_ids: list[int]) -> None:
        """Unpin blocks `lend_chain` pinned."""
        pool = self._eng.kv.pool
        self._eng.kv.pool.release([pool.blocks[i] for i in reversed(block_ids)])

    def begin_borrow(self, token_ids: list[int], num_blocks: int, salt: bytes | None = None) -> Borrow | None:
        """Take blocks for the first ``num_blocks`` prompt blocks that another worker lends and
        this pool lacks (its own hits stay pinned meanwhile). None: nothing to borrow (this pool
        holds as much), or no room."""
        kv, bs = self._eng.kv, self.block_size
        if not kv.pool.enable_caching:
            return None
        num_blocks = min(num_blocks, (len(token_ids) - 1) // bs)  # the last token is always computed
        hashes = block_hashes(token_ids[:num_blocks * bs], bs, salt)
        hits = kv.pool.lookup(hashes)
        need = num_blocks - len(hits)
        if need <= 0 or need > kv.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0):
            return None
        kv.pool.touch(hits)
        targets = kv.pool.allocate(need)
        if not self._flush_tier():  # what taking the targets evicted is copied on every rank before a read lands
            kv.pool.release(list(reversed(list(hits) + targets)))
            return None
        parents = [None] + hashes[:-1]
        tokens = [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(num_blocks)]
        return Borrow(hashes, parents, tokens, len(hits), [b.block_id for b in targets], list(hits) + targets)

    def end_borrow(self, borrow: Borrow, ok: bool) -> int:
        """The read is over: with ``ok`` its blocks join the prefix cache under their hashes;
        either way the borrow's pins are let go. Returns the prompt tokens now cached here."""
        pool = self._eng.kv.pool
        if ok:
            targets = borrow.held[borrow.first:]
            for i, block in enumerate(targets, start=borrow.first):
                pool.cache(block, borrow.hashes[i], borrow.parents[i], borrow.tokens[i])
        pool.release(list(reversed(borrow.held)))
        return len(pool.lookup(borrow.hashes)) * self.block_size

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        """A 64-bit checksum of each block's bytes in this pool (rank 0's at TP: its heads only),
        computed where the pool lives and copied back once: what a holder sends with a verified
        grant and its borrower recomputes over what it read (kvtransfer/lend.py)."""
        return kv_block_checksums(self.kv_tensor, block_ids)

    def abandon_borrow(self, borrow: Borrow, quarantine_as: str) -> None:
        """A read that may still land (it timed out): its target blocks stay taken under
        ``quarantine_as`` until `free`; the own hits are let go."""
        kv = self._eng.kv
        kv.pool.release(list(reversed(borrow.held[:borrow.first])))
        if quarantine_as in kv.tables:
            raise ValueError(f"{quarantine_as!r} already holds blocks")
        kv.tables[quarantine_as] = borrow.held[borrow.first:]

    # -- prefill side ------------------------------------------------------------------------
    def add_export(self, token_ids: list[int], params: SamplingParams, request_id: str,
                   priority: Priority | str | int = Priority.NORMAL, lora_request: LoRARequest | None = None,
                   draft: bool = False) -> Request:
        """Queue a prompt to prefill for another worker: its blocks stay after it finishes
        (until `release_export`), for the transfer to read. ``lora_request``: the LoRA adapter
        it runs under (read and checked here, engine/lora.py; None: the base model). ``draft``:
        the other worker asked for its speculative draft's KV of the prompt too (`export_draft`)."""
        req = self._eng.make_request(token_ids, params, request_id=request_id, priority=priority,
                                     lora_request=lora_request)
        req.keep_kv, req.export_draft = True, draft
        self._eng.scheduler.add(req)
        return req

    def lora_adapters(self) -> list[str]:
        """The LoRA adapters this engine holds read and checked (engine/lora.py), by name,
        sorted; [] without ``enable_lora``. The engine's thread only (a prefill worker's record)."""
        lora = self._eng.runner.lora
        return sorted(lora.cache.adapters) if lora is not None else []

    def finishing(self, scheduled: list[tuple[Request, int]]) -> list[str]:
        """Ids of the exports in a step plan whose whole prompt is computed by that step."""
        return [r.request_id for r, n in scheduled if r.keep_kv and r.num_computed_tokens + n == r.num_tokens]

    def export_blocks(self, request_id: str, cached_len: int, num_blocks: int) -> list[int]:
        """This worker's blocks holding the prompt from position ``cached_len`` on (the
        decode worker already has ``[0, cached_len)``), ``num_blocks`` of them."""
        table = self._eng.kv.block_ids(request_id)
        return table[cached_len // self.block_size:][:num_blocks]

    def release_export(self, request_id: str) -> None:
        """Free an export's blocks and forget it (finished, failed or abandoned)."""
        self._eng.abort_request(request_id)  # a request still running is stopped first
        self._eng.kv.free(request_id)
        spec = self._eng.spec
        draft = spec.draft if spec is not None else None
        if draft is not None:  # (whatever its draft_prompt_kv: nothing of the export stays)
            draft.kv.free(request_id)
            draft.forget(request_id)
        self._eng.release(request_id)
