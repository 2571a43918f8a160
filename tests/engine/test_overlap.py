"""The next decode step prepared while the current one runs (engine arg overlap_steps;
engine/overlap.py): the prepared inputs equal the ones built from the plan, a plan other than
the prediction builds its own, the engine's tokens are the same with and without it, and the
staging buffers' order holds on a fake device whose copies and kernels run on a clock of
their own."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.config import ConfigError
from pdserve.engine.overlap import Lookahead, Staging, predict_next
from pdserve.engine.request import Request
from pdserve.engine.step_batch import build_step_batch

BS = 4
CPU = torch.device("cpu")


def decoding(rid: str, prompt: int, outputs: int, kv: KVCacheManager) -> Request:
    """A request after a decode step: ``outputs`` tokens, the last one's KV not yet computed...
    as the engine leaves it before appending the step's sampled token (computed == tokens)."""
    req = Request(rid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=100))
    req.output_token_ids = [50 + i for i in range(outputs)]
    req.num_computed_tokens = req.num_tokens
    assert kv.allocate(rid, req.num_tokens)
    return req


def test_the_prepared_step_is_the_step_built_from_the_plan_and_other_plans_are_refused():
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_caching=False)
    # contexts 7, 8 (the next position opens a block), 13 and 16 (likewise)
    reqs = [decoding("a", 5, 2, kv), decoding("b", 6, 2, kv), decoding("c", 9, 4, kv), decoding("d", 10, 6, kv)]
    plan = [(r, 1) for r in reqs]
    free = kv.pool.num_free
    nxt, grown = predict_next(plan, reqs, 0, set(), kv)
    assert nxt == reqs and grown == [reqs[1], reqs[3]]
    assert kv.pool.num_free == free - 2  # b's and d's next blocks, taken as the scheduler would
    ahead = Lookahead(BS, CPU)
    ahead.prepare(nxt, kv.block_ids, grown=grown)
    for i, r in enumerate(reqs):  # the step's sampled tokens are appended
        r.output_token_ids.append(900 + i)
    want = build_step_batch(plan, kv, BS, CPU)
    got = ahead.take(plan, kv.block_ids)
    assert got is not None and ahead.taken == 1
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.layout.slot_mapping, want.layout.slot_mapping)
    for name in ("query_start_loc", "context_lens", "block_tables"):
        assert np.array_equal(getattr(got.layout, name), getattr(want.layout, name)), name
    assert got.sampling == want.sampling and got.prompt_rows == [] == want.prompt_rows
    assert got.input_ids.tolist() == [900, 901, 902, 903]

    def refused(plan2, change=None):
        for r in reqs:
            r.num_computed_tokens = r.num_tokens - 1
        ahead.prepare(reqs, kv.block_ids)
        if change:
            change()
        return ahead.take(plan2, kv.block_ids) is None

    assert refused(list(reversed(plan)))  # another order
    assert refused(plan[:3])  # a request fewer (it finished)
    assert refused([(reqs[0], 2)] + plan[1:])  # a chunk, not one token
    assert refused(plan, lambda: kv.allocate("a", reqs[0].num_tokens + BS))  # another block table
    assert refused(plan, lambda: reqs[1].output_token_ids.append(7))  # another position
    assert not refused(plan)  # (the same plan is still taken)


class _Pending:
    """An event of work still running on a fake device until someone waits for it."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _PendingTransfer:
    pinned = False

    def __init__(self):
        self.events: list[_Pending] = []

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()

    def record(self) -> _Pending:
        self.events.append(_Pending())
        return self.events[-1]


def test_a_launched_step_is_waited_for_before_its_blocks_can_change_hands():
    """async_scheduling: the step launched from the drawn tokens gathers them by row; its
    requests' blocks are freed, and the pool given to an admission, only after the device has
    run it (`settle`, the scheduler's before_free and `release`); the next plan takes it less a
    request that left."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_caching=False)
    reqs = [decoding("a", 5, 2, kv), decoding("b", 6, 2, kv), decoding("c", 9, 4, kv)]
    nxt, grown = predict_next([(r, 1) for r in reqs], reqs, 0, set(), kv)
    transfer = _PendingTransfer()
    ahead = Lookahead(BS, CPU, transfer)
    ahead.prepare(nxt, kv.block_ids, grown=grown)
    drawn = torch.tensor([70, 71, 72, 73])  # rows of this step's draw: c, x (another request), a, b
    p = ahead.launch({id(reqs[2]): 0, id(reqs[0]): 2, id(reqs[1]): 3}, drawn)
    assert p is not None and p.batch.input_ids.tolist() == [72, 73, 70]  # a, b, c: the step's order
    ahead.launched_step(p, torch.arange(3.0)[:, None])
    step_event = transfer.events[-1]
    ahead.settle("x")  # not one of its requests: no wait
    assert not step_event.done and ahead.settled == 0
    ahead.settle("b")  # b is freed (it drew its stop token): its blocks wait for the step
    assert step_event.done and ahead.settled == 1
    for r in reqs:
        r.output_token_ids.append(90)
    logits, batch = ahead.take_inflight([(reqs[0], 1), (reqs[2], 1)], kv.block_ids)  # b left
    assert logits[:, 0].tolist() == [0.0, 2.0] and batch.sampling == [reqs[0], reqs[2]]
    assert ahead.launched_part == 1 and ahead.inflight is None
    # a launched step that a plan admitting someone drops: waited for first, its grown blocks back
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
    nxt, grown = predict_next([(r, 1) for r in reqs], reqs, 0, set(), kv)
    ahead.prepare(nxt, kv.block_ids, grown=grown)
    p = ahead.launch({id(r): i for i, r in enumerate(reqs)}, drawn)
    ahead.launched_step(p, None)
    free = kv.pool.num_free
    for r in reqs:
        r.output_token_ids.append(91)
    ahead.release(kv)
    assert transfer.events[-1].done and ahead.settled == 2 and ahead.inflight is None
    assert kv.pool.num_free == free + len(grown)


def test_no_prediction_when_someone_waits_a_chunk_runs_or_the_pool_is_tight():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    a, b = decoding("a", 5, 3, kv), decoding("b", 3, 1, kv)  # 8 and 4 tokens: both open a block next
    plan = [(a, 1), (b, 1)]
    assert predict_next(plan, [a, b], 1, set(), kv) is None  # a prompt waits: its chunk comes next
    assert predict_next(plan, [a, b, Request("c", [1, 2], SamplingParams())], 0, set(), kv) is None
    assert predict_next([(a, 2), (b, 1)], [a, b], 0, set(), kv) is None
    assert predict_next(plan, [a, b], 0, {"b"}, kv) is None  # b failed in this step
    # 3 blocks used of 6: two more would leave 1 < 2 running; the scheduler decides
    assert predict_next(plan, [a, b], 0, set(), kv) is None and kv.pool.num_free == 3
    b.params.max_tokens = 2  # b's token of this step is its last: only a goes on
    assert predict_next(plan, [a, b], 0, set(), kv) == ([a], [a]) and kv.pool.num_free == 2


def scheduled_decode(kv: KVCacheManager, s, reqs: list) -> list:
    """Two scheduler steps (the prompts, then a decode step), as the engine leaves them before
    the decode step's tokens are appended."""
    for r in reqs:
        s.add(r)
    for r, n in s.schedule().scheduled:
        r.num_computed_tokens += n
        r.output_token_ids.append(1)
    plan = s.schedule().scheduled
    for r, n in plan:
        r.num_computed_tokens += n
    return plan


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prediction_gives_its_blocks_back_before_admission_and_never_evicts_a_cached_prefix(overlap):
    from pdserve.engine.request import RequestStatus
    from pdserve.engine.scheduler import Scheduler

    # 1. A remote-KV prompt arrives between the steps: it gets the same reservation as without
    #    the prediction (which had taken the blocks the decoding requests move into).
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    s = Scheduler(kv, 4096, 16)
    reqs = [Request(f"d{i}", list(range(10 + 50 * i, 17 + 50 * i)), SamplingParams(max_tokens=50)) for i in range(2)]
    plan = scheduled_decode(kv, s, reqs)
    ahead = Lookahead(BS, CPU)
    if overlap:
        nxt = predict_next(plan, s.running, 0, set(), kv)
        assert nxt is not None and len(nxt[1]) == 2  # both move into a third block
        ahead.prepare(nxt[0], kv.block_ids, grown=nxt[1])
    for r in reqs:
        r.output_token_ids.append(2)
    remote = Request("remote", list(range(500, 548)), SamplingParams(max_tokens=5))
    remote.remote_kv = True
    s.add(remote)
    ahead.release(kv)  # (the engine does it when anyone awaits admission)
    assert kv.pool.num_free == 12
    out = s.schedule()
    assert s.is_awaiting_remote("remote") and remote.remote_kv and len(out.preempted) == 1

    # 2. A cached prefix block at the head of the free queue is not taken by a prediction: the
    #    request may stop with this step's token (it does here), and the prefix stays cached.
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    s = Scheduler(kv, 4096, 16)
    old = Request("old", [7, 7, 7, 7, 9], SamplingParams(max_tokens=1))
    s.add(old)
    s.schedule()
    old.num_computed_tokens = 5
    kv.cache_full_blocks("old", old.all_token_ids, 5)
    s.finish(old, RequestStatus.FINISHED_STOPPED)
    x = Request("x", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=50))
    plan = scheduled_decode(kv, s, [x])  # decoding at position 7: the next one opens a block
    while kv.pool.free.head.next.block_hash is None:  # the cached block to the LRU head
        kv.pool.free.append(kv.pool.free.popleft())
    if overlap:
        assert predict_next(plan, s.running, 0, set(), kv) is None
    x.output_token_ids.append(2)
    s.finish(x, RequestStatus.FINISHED_STOPPED)  # its EOS
    assert len(kv.pool.cached) == 1 and kv.pool.lookup(kv._hashes("probe", [7, 7, 7, 7, 1], None))


def generate(llama_dir: str, overlap: bool | str, stop: int | None = None, **engine_args) -> tuple[dict, LLMEngine]:
    """Greedy and seeded requests of different lengths, one aborted and one added mid-run;
    ``stop``: r1 stops at that token. ``overlap`` "async": engine arg async_scheduling."""
    mode = dict(async_scheduling=True) if overlap == "async" else dict(overlap_steps=overlap)
    eng = LLMEngine(EngineConfig(model=llama_dir, block_size=BS, seed=7, **mode, **engine_args))
    out: dict[str, list[int]] = {}

    def add(i: int) -> None:
        sampling = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=100 + i)
        stops = dict(stop_token_ids=[stop]) if stop is not None and i == 1 else {}
        eng.add_request([3 + (i * 37 + j * 11) % 500 for j in range(5 + 3 * i)],
                        SamplingParams(max_tokens=12 + 5 * i, ignore_eos=i != 3, **sampling, **stops),
                        request_id=f"r{i}")

    for i in range(5):
        add(i)
    steps = 0
    while eng.has_unfinished():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                eng.release(d.request_id)
        steps += 1
        if steps == 12:
            eng.abort_request("r4")  # after a step that prepared the next one
        if steps == 16:
            add(5)  # an arrival: the next plan has its prompt
        assert steps < 500
    return out, eng


@pytest.mark.parametrize("engine_args", [{}, {"num_gpu_blocks_override": 24}, {"tensor_parallel_size": 2}],
                         ids=["roomy", "tight-pool", "tp2"])
def test_the_engine_gives_the_same_tokens_with_the_next_step_prepared(llama_dir, engine_args):
    want, plain = generate(llama_dir, False, **engine_args)
    plain.close()  # (the other ranks of tp2)
    got, eng = generate(llama_dir, True, **engine_args)
    eng.close()
    assert got == want
    ahead = eng.runner.lookahead
    assert ahead is not None and plain.runner.lookahead is None
    assert 0 < ahead.taken <= ahead.prepared
    assert ahead.planned == ahead.taken  # (the CPU's attention is planned ahead too)
    assert eng.kv.pool.num_free == plain.kv.pool.num_free == eng.kv.pool.num_blocks  # nothing held
    if "num_gpu_blocks_override" in engine_args:  # the pool is tight for most of the run: no prediction while it is
        assert eng.stats.num_preemptions == plain.stats.num_preemptions > 0
    else:
        assert ahead.taken < ahead.prepared  # (the abort and the arrival each cost a prediction)


@pytest.mark.parametrize("engine_args", [{}, {"num_gpu_blocks_override": 24}, {"tensor_parallel_size": 2}],
                         ids=["roomy", "tight-pool", "tp2"])
def test_the_engine_gives_the_same_tokens_with_the_next_step_launched_ahead(llama_dir, engine_args):
    """async_scheduling: each predicted step runs from the tokens drawn before they are read.
    r1 stops at a token it draws mid-run (its row of the step launched with it is left out),
    r4 is aborted after a launched step (likewise), r5 arrives (that launched step is dropped:
    its plan admits r5)."""
    first, plain = generate(llama_dir, False)  # (r1 is greedy: its tokens are TP=1's at TP=2 too)
    r1 = first["r1"]
    # a token r1 first draws mid-run: it stops there
    stop = next(t for i, t in enumerate(r1) if i >= 6 and t not in r1[:i])
    want, plain = generate(llama_dir, False, stop=stop, **engine_args)
    plain.close()
    assert len(want["r1"]) < len(first["r1"])
    got, eng = generate(llama_dir, "async", stop=stop, **engine_args)
    eng.close()
    assert got == want
    ahead = eng.runner.lookahead
    assert ahead is not None and ahead.launched > 0 and ahead.launched_taken > 0
    assert ahead.taken == 0  # (every prepared step was launched, none taken as overlap_steps takes them)
    assert ahead.planned == ahead.launched  # (the CPU's attention is planned ahead too)
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks  # nothing held
    if "num_gpu_blocks_override" in engine_args:  # a tight pool: few predictions, preemptions as without
        assert eng.stats.num_preemptions == plain.stats.num_preemptions > 0
    else:
        assert ahead.launched_taken < ahead.launched  # (the arrival's plan dropped one)
        assert ahead.launched_part >= 2  # r1's stop and r4's abort
        # ... each waited for the launched step that wrote their blocks before freeing them,
        # and r5's admission too before the pool gave any block out
        assert ahead.settled >= 3


def test_a_sampling_fallback_after_a_launch_drops_the_launched_step(llama_dir):
    """The batched read-back fails once after the next step was launched from its draw: the
    rows are drawn again one by one (seeded generators one draw further), so the launched step
    ran on other tokens than the ones appended and must not be taken. Same tokens as the
    engine without the launch, given the same failure."""
    def run(mode: dict) -> tuple[dict, LLMEngine]:
        eng = LLMEngine(EngineConfig(model=llama_dir, block_size=BS, seed=7, **mode))
        finish, calls = eng.sampler.finish, [0]

        def failing_once(drawn, reqs):  # (a fault injected into the read-back, not the thing tested)
            calls[0] += 1
            if calls[0] == 8:
                raise RuntimeError("injected: the read-back failed")
            return finish(drawn, reqs)

        eng.sampler.finish = failing_once  # type: ignore[method-assign]
        for i in range(3):
            eng.add_request([3 + (i * 41 + j * 13) % 500 for j in range(6 + 5 * i)],
                            SamplingParams(temperature=0.9, seed=10 + i, max_tokens=16, ignore_eos=True),
                            request_id=f"r{i}")
        out: dict[str, list[int]] = {}
        for _ in range(200):
            if not eng.has_unfinished():
                break
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
                if d.finished:
                    eng.release(d.request_id)
        return out, eng

    want, _ = run(dict(overlap_steps=True))
    got, eng = run(dict(async_scheduling=True))
    assert got == want and all(len(t) == 16 for t in got.values())
    ahead = eng.runner.lookahead
    assert ahead is not None and ahead.launched > ahead.launched_taken > 0


def test_async_scheduling_refuses_what_it_does_not_run_with(llama_dir):
    for field, value in (("speculative_config", {"method": "ngram", "num_speculative_tokens": 2,
                                                 "prompt_lookup_max": 3}),
                         ("enable_lora", True), ("kv_offload_bytes", 1 << 20)):
        with pytest.raises(ConfigError, match=field):
            EngineConfig(model=llama_dir, async_scheduling=True, **{field: value}).validate()


# -- the staging buffers on a fake device -------------------------------------------------------

class Clock:
    """The host's time and the one stream's: work queued on the stream starts when both the
    host has queued it and the stream has finished what came before."""

    def __init__(self):
        self.host = 0.0
        self.stream = 0.0

    def queue(self, duration: float) -> float:
        self.stream = max(self.stream, self.host) + duration
        return self.stream


class FakeEvent:
    def __init__(self, clock: Clock, at: float):
        self.clock, self.at = clock, at

    def query(self) -> bool:
        return self.clock.host >= self.at

    def synchronize(self) -> None:
        self.clock.host = max(self.clock.host, self.at)


class FakeTransfer:
    """A copy reads its host buffer when the stream gets to it, not when it is queued."""

    pinned = False
    COPY = 0.1

    def __init__(self, clock: Clock):
        self.clock = clock
        self.pending: list[tuple[float, torch.Tensor, list]] = []
        self.last = 0.0

    def copy(self, host: torch.Tensor) -> list:
        self.last = self.clock.queue(self.COPY)
        holder: list = []
        self.pending.append((self.last, host, holder))
        return holder

    def record(self) -> FakeEvent:
        return FakeEvent(self.clock, self.last)

    def settle(self) -> None:
        """Run the copies the stream has reached by the host's time (before the host writes)."""
        keep = []
        for at, host, holder in self.pending:
            if at <= self.clock.host:
                holder.append(host.tolist())
            else:
                keep.append((at, host, holder))
        self.pending = keep

    def finish(self) -> None:
        self.clock.host = max(self.clock.host, self.clock.stream)
        self.settle()


class NoWaitStaging(Staging):
    """The same buffers written without waiting for their copies (what the events prevent)."""

    def acquire(self, n: int):
        self.events = [None] * len(self.events)
        return super().acquire(n)


def pipeline(staging_cls, slots: int, depth: int, steps: int = 12, forward=3.0, prepare=1.0, process=0.5):
    """The engine's order: step k's inputs are copied and its forward queued; the host prepares
    step k+1's inputs; then it reads the outputs of the step ``depth`` back (waiting for its
    forward) and processes them. Returns (what each step's kernels read, what was staged for
    it, the staging, the fake time)."""
    clock = Clock()
    xfer = FakeTransfer(clock)
    staging = staging_cls(xfer, slots=slots, capacity=4)
    staged: list[list[int]] = []

    def stage(k: int) -> int:
        s, host = staging.acquire(4)
        xfer.settle()  # what the stream copied before this write
        host[:] = [k, k + 1, k + 2, k + 3]
        staged.append([k, k + 1, k + 2, k + 3])
        clock.host += prepare
        return s

    read: list = []
    outputs: deque = deque()
    slot = stage(0)
    for k in range(steps):
        read.append(staging.upload(slot, 4))
        outputs.append(FakeEvent(clock, clock.queue(forward)))
        if k + 1 < steps:
            slot = stage(k + 1)
        while len(outputs) >= depth:
            outputs.popleft().synchronize()
            clock.host += process
    while outputs:
        outputs.popleft().synchronize()
    xfer.finish()
    return [r[0] for r in read], staged, staging, clock.host


def test_the_next_steps_inputs_are_written_while_the_step_runs_and_never_under_a_copy():
    read, staged, staging, t = pipeline(Staging, slots=2, depth=1)
    assert read == staged and staging.waited == 0
    # the preparation ran while the forward did: per step the forward and the processing, not
    # the preparation too (12 steps; the copies queue behind the forwards)
    serial = 12 * (3.0 + 1.0 + 0.5 + FakeTransfer.COPY)
    assert t <= serial - 11 * 1.0 + 1e-9, (t, serial)

    # Three steps in flight: the host gets back to a buffer whose copy is still queued behind a
    # forward; it waits for the copy's event and the kernels still read their own inputs.
    read, staged, staging, _ = pipeline(Staging, slots=2, depth=3)
    assert read == staged and staging.waited > 0
    read, staged, staging, _ = pipeline(Staging, slots=1, depth=1)
    assert read == staged and staging.waited > 0
    # Without the events the same order hands a forward the next step's inputs: what the wait
    # is for (the fake device can tell)
    read, staged, _, _ = pipeline(NoWaitStaging, slots=2, depth=3)
    assert read != staged


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["overlap", "async"])
@pytest.mark.parametrize("graphs", [False, True], ids=["flashinfer", "flashinfer+graphs"])
def test_on_a_gpu_the_prepared_steps_give_the_same_tokens(model_dirs, graphs, mode):
    """The pinned staging buffers, their asynchronous copies and events on a real stream: the
    same inputs reach the same kernels, so the tokens are the same (greedy and seeded); with
    async_scheduling, the next step's token ids gathered on the device from a draw not yet read."""
    from tests.engine.test_flashinfer import needs_flashinfer

    needs_flashinfer()
    from pdserve.engine import LLM

    model = model_dirs("llama_gpu")
    prompts = [[3 + (i * 31 + j * 7) % 30000 for j in range(20 + 9 * i)] for i in range(11)]
    params = [SamplingParams(max_tokens=24 + i, ignore_eos=True, **(dict(temperature=0.0) if i % 2 else
                                                                   dict(temperature=0.8, seed=i)))
              for i in range(11)]
    outs, engines = [], []
    for on in (False, True):
        llm = LLM(model, device="cuda", kv_cache_memory_bytes=1 << 30, dtype="bfloat16",
                  attention_backend="flashinfer", cuda_graphs=graphs, cuda_graph_max_batch=16,
                  overlap_steps=on and mode == "overlap", async_scheduling=on and mode == "async")
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        engines.append(llm.engine)
    assert outs[0] == outs[1]
    ahead = engines[1].runner.lookahead
    assert ahead is not None and ahead.staging.transfer.pinned
    assert (ahead.taken if mode == "overlap" else ahead.launched_taken) > 0
    assert ahead.planned > 0  # (FlashInfer's second decode wrapper, or the graphs' second set)
    if graphs:
        assert len(engines[1].runner.graphs.slots) == 2
