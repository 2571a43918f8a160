"""Speculative decoding across the prefill/decode hop (docs/speculative.md): the decode side
speculates (n-gram proposals need no draft KV; a draft model's KV of the prompt is shipped by a
prefill side running the same draft, or computed on the decode side) on requests whose prompt
KV a prefill worker wrote, and its greedy output equals the local path's with speculation and without it, token for
token, while proposals do get accepted.

First at the engines (tests/kvtransfer/handoff_pair.py): the prefill
side's real batch runner (prefill/batch.py, tensor-parallel where asked) writing KV through real
NIXL agents, the decode side's engine reading its notices and running the requests from the first
token on. Then a 1P1D cluster (the set-up of tests/e2e/test_disaggregated.py: real etcd, the
prefill worker a Ray actor, the decode worker in this process with ``speculative_config``),
requests forced remote through gRPC, their breakdowns carrying the proposals accepted.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import ray

from pdserve.api import AsyncClient
from pdserve.decode.spec_metrics import SpecDecodeCollector
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp_comm import shm_available
from pdserve.kvtransfer import PrefillDone
from pdserve.prefill.worker import PrefillWorker
from tests.e2e.test_disaggregated import UCX, etcd, ray_local  # noqa: F401  (module fixtures)
from tests.harness import WorkerThread, wait_until
from tests.kvtransfer.handoff_pair import paired

pytestmark = pytest.mark.skipif(shm_available() is not None, reason=f"TP needs shm: {shm_available()}")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 32


def repetitive(seed: int) -> list[list[int]]:
    """Phrases said again and again (proposals get accepted), and two random prompts."""
    rng = random.Random(seed)
    out = [[rng.randrange(3, 900) for _ in range(rng.randrange(3, 9))] * rng.randrange(3, 7) for _ in range(6)]
    return out + [[rng.randrange(3, 32000) for _ in range(n)] for n in (17, 40)]


@pytest.mark.parametrize("p_tp", [1, 2])
def test_remote_prompt_kv_then_speculation_equals_local_with_and_without_it(model_dirs, p_tp):
    model = model_dirs("llama")
    ps = repetitive(seed=90 + p_tp)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    with LLM(model, speculative_config=NGRAM) as local_spec:
        assert [o.token_ids for o in local_spec.generate(ps, params)] == want
    with paired(model, f"sp{p_tp}", p_tp, 1, d_args={"speculative_config": NGRAM}, kv_layout="HND") as pair:
        de = pair.de
        tasks = pair.tasks(ps, params, prefix="s")
        result, arrived = pair.prefill(tasks)
        assert result.failures == [] and result.done == len(tasks)
        assert all(isinstance(m, PrefillDone) for m in arrived) and len(arrived) == len(tasks)
        pair.hand_over(arrived)
        computed = de.stats.num_prompt_tokens_computed
        pair.decode()
        got = pair.outputs(len(ps), prefix="s")
        assert [o.token_ids for o in got] == want
        assert de.stats.num_prompt_tokens_computed == computed  # the prompts' KV came from the prefill side
        # Not vacuous: the decode side verified proposals and accepted many of them.
        assert de.stats.num_spec_accepted_tokens > 40
        accepted = [o.times.spec_tokens[1] for o in got]
        assert sum(accepted) == de.stats.num_spec_accepted_tokens and all(a > 0 for a in accepted[:6])
        pair.assert_nothing_held()


def _self_draft_over_pd(model: str, name: str, p_tp: int, ps: list[list[int]], params: SamplingParams,
                        ship: str | None = None):
    """The target as its own draft on the decode side of requests a prefill side (TP ``p_tp``)
    prefilled: the outputs and the decode engine's counters, after checking that no target
    prompt token was computed on the decode side and that nothing is left held. ``ship``: the
    draft's ``draft_prompt_kv`` on both sides, the prefill side running the same draft."""
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": 3, "disable_by_cost": False}
    p_args = None
    if ship is not None:
        draft["draft_prompt_kv"] = ship
        p_args = {"speculative_config": draft}
    with paired(model, name, p_tp, 1, d_args={"speculative_config": draft}, p_args=p_args) as pair:
        de = pair.de
        tasks = pair.tasks(ps, params, prefix="s")
        result, arrived = pair.prefill(tasks)
        assert result.failures == [] and all(isinstance(m, PrefillDone) for m in arrived)
        pair.hand_over(arrived)
        computed = de.stats.num_prompt_tokens_computed
        pair.decode()
        outs = [o.token_ids for o in pair.outputs(len(ps), prefix="s")]
        assert de.stats.num_prompt_tokens_computed == computed  # the target's prompt KV came from the prefill side
        assert de.stats.num_spec_draft_tokens > 40
        pair.assert_nothing_held()
        if ship is not None:
            by_id = {m.request_id: m for m in arrived}
            assert [by_id[f"s{i}"].draft_tokens for i in range(len(ps))] == [len(p) if ship == "prefill" else 0
                                                                             for p in ps]
            assert pair.pe.spec.draft.num_tokens == (sum(map(len, ps)) if ship == "prefill" else 0)
            shipped = len(ps) if ship == "prefill" else 0
            assert (de.stats.num_spec_prompts_shipped, de.stats.num_spec_prompts_local) == (shipped, len(ps) - shipped)
        return outs, de.stats, de.spec.draft.num_tokens


@pytest.mark.parametrize("p_tp", [1, 2])
def test_a_draft_model_speculates_on_remotely_prefilled_requests(model_dirs, p_tp):
    """The decode side's draft model computes the prompts itself (the prefill side wrote only the
    target's KV) and then proposes; the target is its own draft here, so every proposal must be
    accepted, and the output equals the local path's with no target prompt token computed on the
    decode side (prefill TP 1 and 2, decode TP 1)."""
    model = model_dirs("llama")
    ps = repetitive(seed=97)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    outs, stats, _ = _self_draft_over_pd(model, f"spdraft{p_tp}", p_tp, ps, params)
    assert outs == want
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens  # its own draft: all accepted


@pytest.mark.parametrize("p_tp", [1, 2])
def test_the_prefill_side_ships_the_drafts_prompt_kv_in_the_same_handoff(model_dirs, p_tp):
    """Both sides run the same draft (the target itself): the prefill side computes the draft's
    KV of each prompt beside the target's and writes it into the decode worker's draft pool
    (rank 0 to rank 0, before the PrefillDone, which says how many positions). The decode
    side's draft then computes exactly the prompts' positions fewer than when it computes them
    itself (``draft_prompt_kv: decode``), and every proposal is still accepted: right only if
    each prompt's draft KV landed in its own blocks, whole. The output equals the local path's."""
    model = model_dirs("llama")
    ps = repetitive(seed=96)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    shipped, s_stats, s_draft = _self_draft_over_pd(model, f"spship{p_tp}", p_tp, ps, params, ship="prefill")
    local, l_stats, l_draft = _self_draft_over_pd(model, f"splocal{p_tp}", p_tp, ps, params, ship="decode")
    assert shipped == local == want
    assert s_stats.num_spec_accepted_tokens == s_stats.num_spec_draft_tokens > 40  # its own draft: all accepted
    assert l_draft - s_draft == sum(map(len, ps))  # the prompts' draft KV came from the prefill side


def test_drawn_proposals_on_remotely_prefilled_requests_are_all_accepted_from_the_target_as_its_own_draft(
        model_dirs):
    """Unseeded sampling (temperature 1): proposals are drawn from the draft's distribution
    (draft_sampling probabilistic, the default) and verified with min(1, p/q). The target as its
    own draft, its prompt computed by the decode side's draft while the target's KV came from
    the prefill side: p equals q, so every drawn proposal is accepted (argmax proposals of this
    random model would almost never be: tests/engine/test_spec_draft.py)."""
    model = model_dirs("llama")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    outs, stats, _ = _self_draft_over_pd(model, "spdrawn", 1, repetitive(seed=98), params)
    assert all(len(o) == MAX_TOKENS for o in outs)
    assert stats.num_spec_accepted_tokens >= 0.95 * stats.num_spec_draft_tokens


@pytest.mark.parametrize("method,p_tp", [("eagle", 1), ("eagle3", 2)])
def test_an_eagle_head_speculates_on_remotely_prefilled_requests(model_dirs, tmp_path, method, p_tp):
    """An EAGLE head on the decode side of requests whose prompt KV a prefill worker wrote: the
    target never computed the prompt's hidden states here, so the head reads zeros there
    (engine/spec_eagle.py) and has real ones from the first decoded token on. "Copy" heads
    (tests/engine/test_spec_eagle.py: each proposal is the target's argmax at the last computed
    position) propose, some proposals are accepted, and the greedy output equals the local
    path's without speculation, with no target prompt token computed on the decode side."""
    from tests.engine.test_spec_eagle import eagle_cfg, make_eagle1, make_eagle3

    model = model_dirs("llama")
    if method == "eagle":
        head = make_eagle1(str(tmp_path / "head"), model, copy=True)
    else:
        with open(f"{model}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
        head = make_eagle3(str(tmp_path / "head"), model, list(range(vocab - 1, -1, -1)), copy=True)
    ps = repetitive(seed=98)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    _head_over_pd(model, f"speagle{p_tp}", p_tp, eagle_cfg(method, head, k=4), ps, want)


def _head_over_pd(model: str, name: str, p_tp: int, spec: dict, ps: list[list[int]], want: list) -> None:
    """A head (EAGLE's, MTP's) speculating on the decode side of requests a prefill side (TP
    ``p_tp``) prefilled: greedy output ``want``, no target prompt token computed on the decode
    side, proposals made and some accepted, the head's blocks and everything else given back."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with paired(model, name, p_tp, 1, d_args={"speculative_config": spec}) as pair:
        de = pair.de
        result, arrived = pair.prefill(pair.tasks(ps, params, prefix="h"))
        assert result.failures == [] and all(isinstance(m, PrefillDone) for m in arrived)
        pair.hand_over(arrived)
        computed = de.stats.num_prompt_tokens_computed
        pair.decode()
        assert [o.token_ids for o in pair.outputs(len(ps), prefix="h")] == want
        assert de.stats.num_prompt_tokens_computed == computed  # the target's prompt KV came from the prefill side
        assert de.stats.num_spec_draft_tokens > 40 and de.stats.num_spec_accepted_tokens > 0
        head_kv = de.spec.draft.kv
        wait_until(lambda: head_kv.num_free_blocks == head_kv.pool.num_blocks, 10)  # the head's blocks came back
        pair.assert_nothing_held()


def test_an_mtp_layer_speculates_on_remotely_prefilled_requests(tmp_path):
    """DeepSeek-V3 (latent attention: one latent KV head written over the hop, prefill TP 2) with
    an MTP "copy" layer on the decode side (tests/engine/test_spec_mtp.py: each proposal the
    target's argmax at the last computed position): the layer reads zeros for the prompt the
    prefill side computed and real hidden states from the first decoded token on; proposals are
    made, some accepted, and the greedy output equals the local path's without speculation."""
    from pdserve.engine.model_maker import make_model
    from tests.engine.test_model_families import SPECS
    from tests.engine.test_spec_mtp import make_mtp, mtp_cfg

    model = make_mtp(str(tmp_path / "mtp"), make_model(str(tmp_path / "ds"), SPECS["deepseek_v3"]), copy=True)
    ps = repetitive(seed=99)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    _head_over_pd(model, "spmtp", 2, mtp_cfg(k=3), ps, want)


def _proposals(engine, ps: list[list[int]]) -> dict[tuple, list]:
    """Each prompt's proposals, step by step (keyed by prompt), as its head makes them."""
    head, seen = engine.spec.draft, {}
    propose = head.propose

    def spy(wants, structured):
        found = propose(wants, structured)
        for r, _ in wants:
            seen.setdefault(tuple(r.prompt_token_ids), []).append(found.get(r.request_id, []))
        return found

    head.propose = spy
    return seen


def _head_rows_over_pd(model: str, name: str, p_tp: int, d_tp: int, spec: dict, ps: list[list[int]], ship: str):
    """A random head on both sides (``draft_prompt_kv`` ``ship``): the greedy outputs, each
    prompt's proposals on the decode side, and the notices."""
    spec = {**spec, "draft_prompt_kv": ship}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # (the prefill side in chunks of 32 tokens: the head's rows follow the target's chunk by chunk)
    with paired(model, name, p_tp, d_tp, d_args={"speculative_config": spec},
                p_args={"speculative_config": spec, "max_num_batched_tokens": 32}) as pair:
        de = pair.de
        seen = _proposals(de, ps)
        result, arrived = pair.prefill(pair.tasks(ps, params, prefix="r"))
        assert result.failures == [] and all(isinstance(m, PrefillDone) for m in arrived)
        assert not pair.pe.spec.draft.exports  # (each export's head rows went with it)
        pair.hand_over(arrived)
        computed = de.stats.num_prompt_tokens_computed
        pair.decode()
        outs = [o.token_ids for o in pair.outputs(len(ps), prefix="r")]
        assert de.stats.num_prompt_tokens_computed == computed  # the target's prompt KV came from the prefill side
        head_kv = de.spec.draft.kv
        wait_until(lambda: head_kv.num_free_blocks == head_kv.pool.num_blocks, 10)
        pair.assert_nothing_held()
        return outs, seen, arrived, de.stats


@pytest.mark.parametrize("method,p_tp,d_tp", [("eagle", 1, 1), ("eagle3", 1, 2), ("mtp", 2, 1)])
def test_a_heads_prompt_rows_shipped_from_the_prefill_side_make_the_local_paths_proposals(
        model_dirs, tmp_path, method, p_tp, d_tp):
    """A random head (its proposals depend on every row it attends to) on both sides with
    ``draft_prompt_kv: prefill``: the prefill side's target keeps each prompt's hidden states,
    its head computes the prompt's rows 0 .. n - 2 into the decode worker's reserved head
    blocks, and the hidden input of row n - 1 rides in one more block (engine/spec_eagle.py).
    The decode side's head then proposes, step by step, what the same head proposes on the
    local path (one engine, no hop), for every prompt (TP pairs (1, 1), (1, 2) and (2, 1): the head
    runs on rank 0 of each side); with ``draft_prompt_kv: decode`` (its
    rows read zeros; EAGLE-1's case) it does not. Greedy output equals the local path's either way."""
    from tests.engine.test_spec_eagle import eagle_cfg, make_eagle1, make_eagle3

    if method == "mtp":
        from pdserve.engine.model_maker import make_model
        from tests.engine.test_model_families import SPECS
        from tests.engine.test_spec_mtp import make_mtp, mtp_cfg

        model = make_mtp(str(tmp_path / "mtp"), make_model(str(tmp_path / "ds"), SPECS["deepseek_v3"]), copy=False)
        spec = mtp_cfg(k=3)
    else:
        model = model_dirs("llama")
        with open(f"{model}/config.json") as f:
            vocab = json.load(f)["vocab_size"]
        head = (make_eagle1(str(tmp_path / "head"), model) if method == "eagle"
                else make_eagle3(str(tmp_path / "head"), model, random.Random(5).sample(range(vocab), 4000)))
        spec = eagle_cfg(method, head, k=3)
    # (17 tokens: rows 0 .. 15 fill one block, the carrier is the next; 1 token: the carrier alone)
    ps = repetitive(seed=95)[2:] + [list(range(50, 67)), [77], list(range(300, 375))]
    with LLM(model, speculative_config=spec) as local:
        want_seen = _proposals(local.engine, ps)
        want = [o.token_ids for o in local.generate(ps, SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True))]
    outs, seen, arrived, stats = _head_rows_over_pd(model, f"sprows{method}", p_tp, d_tp, spec, ps, "prefill")
    assert outs == want
    assert [m.draft_tokens for m in sorted(arrived, key=lambda m: int(m.request_id[1:]))] == [len(p) for p in ps]
    assert (stats.num_spec_prompts_shipped, stats.num_spec_prompts_local) == (len(ps), 0)
    assert seen == want_seen and sum(len(x) for steps in seen.values() for x in steps) > 30
    if method == "eagle":  # (the test can tell: rows read from zeros propose otherwise)
        outs, zeros, _, stats = _head_rows_over_pd(model, "spzero", p_tp, d_tp, spec, ps, "decode")
        assert outs == want and (stats.num_spec_prompts_shipped, stats.num_spec_prompts_local) == (0, len(ps))
        assert zeros != want_seen


@pytest.fixture(scope="module")
def cluster(ray_local, etcd, llama_dir):  # noqa: F811  (the fixtures imported above)
    """1P1D: a decode worker that speculates with a draft model (the target itself) and routes
    remote, and a prefill worker (a Ray actor) running the same draft: it ships the draft's
    prompt KV beside the target's (``draft_prompt_kv: prefill``)."""
    common = dict(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="e2e-spec", lease_ttl_s=3, ucx_env=UCX)
    draft = {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 3, "disable_by_cost": False,
             "draft_prompt_kv": "prefill"}  # (auto would keep the prompts of an idle worker here)
    d = WorkerThread(DecodeWorkerConfig(**common, worker_id="decode-0", remote_prefill=True, remote_timeout_s=60,
                                        engine_args={"speculative_config": draft})).start()
    p = None
    try:
        p = ray.remote(PrefillWorker).options(num_cpus=0).remote(
            dict(**common, worker_id="prefill-0", engine_args={"speculative_config": draft}))
        ray.get(p.start.remote(), timeout=180)
        wait_until(lambda: d.worker.frontend.prefill_view.pool_size >= 1 and d.worker.remote.available(), 30)
        yield d
    finally:
        if p is not None:
            ray.get(p.stop.remote(), timeout=30)
        d.stop()


def test_a_speculating_decode_worker_serves_remote_prefills_token_exact(cluster, llama_dir):
    """Through gRPC, the queue (the task's draft blocks signed and checked), the prefill worker's
    etcd record (its draft pool) and the decode worker's arrivals: greedy output equals the
    engine's without speculation; every proposal of the target-as-draft is accepted; and the
    decode worker's draft computes exactly the prompts' positions fewer for the requests sent
    remote than for the same requests served locally (their draft KV came with the target's)."""
    d = cluster
    ps = repetitive(seed=95)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as plain:
        want = [o.token_ids for o in plain.generate(ps, params)]
    eng = d.worker.engine
    draft = eng.spec.draft

    async def go(route: str):
        async with AsyncClient(d.grpc) as c:
            return await asyncio.gather(*(c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                     route=route, priority="high", timeout_s=180) for p in ps))

    drafted = {}
    for route in ("remote", "local"):
        computed, accepted0, tokens0 = (eng.stats.num_prompt_tokens_computed, eng.stats.num_spec_accepted_tokens,
                                        draft.num_tokens)
        outs = asyncio.run(go(route))
        assert [o.token_ids for o in outs] == want
        assert all(o.breakdown["route"] == route for o in outs)
        accepted = [o.breakdown["spec_accepted_tokens"] for o in outs]
        assert sum(accepted) == eng.stats.num_spec_accepted_tokens - accepted0 > 40 and all(a > 0 for a in accepted)
        drafted[route] = draft.num_tokens - tokens0
        if route == "remote":
            assert all(o.breakdown["transfer_bytes"] > 0 for o in outs)
            assert eng.stats.num_prompt_tokens_computed == computed  # every prompt's KV came from the prefill worker
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30)
    assert eng.stats.num_spec_accepted_tokens == eng.stats.num_spec_draft_tokens  # its own draft: all accepted
    assert drafted["local"] - drafted["remote"] == sum(map(len, ps))
    assert (eng.stats.num_spec_prompts_shipped, eng.stats.num_spec_prompts_local) == (len(ps), 0)
    scraped = {s.name: s.value for m in SpecDecodeCollector(lambda: eng.stats, {}).collect() for s in m.samples}
    assert scraped["pdserve_spec_decode_draft_prompts_shipped_total"] == len(ps)
    assert draft.kv.num_free_blocks == draft.kv.pool.num_blocks
