"""Speculative decoding with EAGLE heads (engine/spec_eagle.py, engine/spec_eagle_model.py;
docs/speculative.md, "EAGLE heads").

The heads are written in the published checkpoints' layout (vLLM's ``llama_eagle.py`` and
``llama_eagle3.py`` read the same names) for the test Llama (pdserve/bench/spec_heads.py). Random heads propose tokens the
target rarely agrees with, so with them the tests check exactness (greedy and seeded output
equal to the engine without speculation, batches, finish and abort give every block back) and
that proposals were made and verified (the counters move); acceptance cannot be shown with
them. "Copy" heads are built so that the head's output is the target's own hidden state (its
attention and MLP outputs zero, ``fc`` selecting the target's final hidden state): each
proposal is then the target's argmax at the request's last computed position, i.e. the last
token again; that is right only if the head reads the right target hidden state at the right
row (and, for EAGLE-3, maps draft ids through ``d2t``), and the target's greedy output repeats
tokens, so proposals are accepted and rejected: the KV of both models is rolled back.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.bench.spec_heads import make_eagle1, make_eagle3, target_config
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ConfigError
from pdserve.engine.spec_config import parse_speculative_config

from .test_hf_parity import hf_greedy
from .test_spec_decode import prompts, run

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def eagle_cfg(method: str, path: str, k: int = 3, **extra) -> dict:
    """A head's config for these tests of the proposer's mechanics: every step speculates (no
    acceptance floor, no measured-cost rule: tests/engine/test_spec_cost.py tests that)."""
    return {"method": method, "model": path, "num_speculative_tokens": k, "acceptance_floor": 0.0,
            "disable_by_cost": False, **extra}


def pools_full(llm: LLM) -> bool:
    head = llm.engine.spec.draft
    return (head.kv.num_free_blocks == head.kv.pool.num_blocks and not head.seqs and not head.states
            and llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks)


COPY_PROMPTS = prompts(8, seed=6)


@contextlib.contextmanager
def proposals_seen(llm: LLM):
    """While inside: each proposal the head returns, as (the request's last token, its
    proposals), appended to the yielded list (the head's own `propose` runs unchanged)."""
    head = llm.engine.spec.draft
    seen: list[tuple[int, list[int]]] = []
    propose = head.propose

    def spy(wants, structured):
        found = propose(wants, structured)
        seen.extend((r.all_token_ids[-1], found[r.request_id]) for r, _ in wants if r.request_id in found)
        return found

    head.propose = spy
    try:
        yield seen
    finally:
        del head.propose


@pytest.fixture(scope="module")
def plain(llama_dir):
    with LLM(llama_dir, seed=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def heads(llama_dir, plain, tmp_path_factory) -> dict[str, str]:
    """Random heads (EAGLE-3's over 4000 draft ids in a random order) and copy heads (EAGLE-3's
    over all ids but 1000 that neither the copy test's prompts nor their greedy output hold, in
    reverse order)."""
    root = tmp_path_factory.mktemp("eagle")
    vocab = target_config(llama_dir)["vocab_size"]
    used = {t for p in COPY_PROMPTS for t in p} | {t for toks, _, _ in run(plain, COPY_PROMPTS, GREEDY) for t in toks}
    unused = [t for t in range(vocab) if t not in used][:1000]
    copy_ids = sorted(set(range(vocab)) - set(unused), reverse=True)
    rng = torch.Generator().manual_seed(3)
    return {
        "eagle": make_eagle1(str(root / "eagle1"), llama_dir),
        "eagle3": make_eagle3(str(root / "eagle3"), llama_dir, torch.randperm(vocab, generator=rng)[:4000].tolist()),
        "eagle-copy": make_eagle1(str(root / "eagle1-copy"), llama_dir, copy=True),
        "eagle3-copy": make_eagle3(str(root / "eagle3-copy"), llama_dir, copy_ids, copy=True),
    }


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def random_head(request, llama_dir, heads):
    with LLM(llama_dir, seed=0, speculative_config=eagle_cfg(request.param, heads[request.param])) as llm:
        yield llm


@pytest.fixture(scope="module", params=["eagle-copy", "eagle3-copy"])
def copy_head(request, llama_dir, heads):
    method = request.param.removesuffix("-copy")
    with LLM(llama_dir, seed=0, speculative_config=eagle_cfg(method, heads[request.param], k=4)) as llm:
        yield llm


def test_a_random_head_proposes_and_greedy_output_is_exact(plain, random_head):
    ps = prompts(6, seed=4)  # a batch of six
    stats = random_head.engine.stats
    before = (stats.num_spec_drafts, stats.num_spec_draft_tokens, random_head.engine.spec.draft.num_forwards)
    assert run(random_head, ps, GREEDY) == run(plain, ps, GREEDY)
    assert stats.num_spec_drafts - before[0] > 20  # proposals were made and verified
    assert stats.num_spec_draft_tokens - before[1] > 60
    assert random_head.engine.spec.draft.num_forwards > before[2]
    assert pools_full(random_head)


def test_a_random_head_keeps_seeded_sampling_exact(plain, random_head):
    ps = prompts(3, seed=5) * 2
    params = [SamplingParams(max_tokens=16, temperature=t, top_p=0.9 if i % 2 else 1.0, seed=50 + i,
                             ignore_eos=True) for i, t in enumerate([0.05, 0.7, 1.0] * 2)]
    before = random_head.engine.stats.num_spec_draft_tokens
    assert run(random_head, ps, params) == run(plain, ps, params)
    assert random_head.engine.stats.num_spec_draft_tokens > before
    assert pools_full(random_head)


def test_the_copy_head_reads_the_right_hidden_states(llama_dir, plain, copy_head):
    """Each proposal of a copy head is the target's argmax at the request's last computed
    position, which greedy is the request's last token: every proposal made is the last token
    repeated (checked on the proposer's own answers), and so is right only when the head read
    the target's hidden state of the right position (through ``d2t`` for EAGLE-3). The target's
    greedy output repeats tokens, so proposals are accepted (some) and rejected (others), and the
    output equals the engine without speculation and HF."""
    ps = COPY_PROMPTS
    want = run(plain, ps, GREEDY)
    stats = copy_head.engine.stats
    before = (stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens)
    with proposals_seen(copy_head) as seen:
        assert run(copy_head, ps, GREEDY) == want
    proposed, accepted = stats.num_spec_draft_tokens - before[0], stats.num_spec_accepted_tokens - before[1]
    assert len(seen) > 50 and all(props == [last] * len(props) for last, props in seen), seen[:5]
    assert 0.1 * proposed < accepted < proposed, (accepted, proposed)
    assert [o[0] for o in want[:2]] == hf_greedy(llama_dir, ps[:2], GREEDY.max_tokens)
    assert pools_full(copy_head)


def test_a_whole_vocabulary_head_in_its_own_order_maps_through_d2t(llama_dir, plain, tmp_path):
    """An EAGLE-3 head over the whole vocabulary whose draft ids are the target's in reverse
    (d2t a permutation): its proposals are mapped through d2t as vLLM maps them (a head that
    skipped d2t at full size would propose id 31999 - t for t, never accepted)."""
    vocab = target_config(llama_dir)["vocab_size"]
    head_dir = make_eagle3(str(tmp_path / "rev"), llama_dir, list(range(vocab - 1, -1, -1)), copy=True)
    ps = COPY_PROMPTS[:4]
    want = run(plain, ps, GREEDY)
    with LLM(llama_dir, seed=0, speculative_config=eagle_cfg("eagle3", head_dir, k=4)) as llm:
        with proposals_seen(llm) as seen:
            assert run(llm, ps, GREEDY) == want
        assert seen and all(props == [last] * len(props) for last, props in seen), seen[:5]
        assert llm.engine.stats.num_spec_accepted_tokens > 0


def test_a_random_head_draws_unseeded_proposals_from_its_distribution(random_head):
    """Unseeded sampling: the head's proposals are drawn from its distribution (EAGLE-3's only
    over its draft vocabulary, mapped through d2t: the rows outside it are 0), each sent with
    its row; they are accepted more often than the head's argmax on this random target."""
    eng, head = random_head.engine, random_head.engine.spec.draft
    ps = prompts(6, seed=9)
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    rows: list[tuple[list[int], torch.Tensor]] = []
    propose = head.propose

    def spy(wants, structured):
        found = propose(wants, structured)
        rows.extend((found[r], head.draft_probs[r]) for r in found if r in head.draft_probs)
        return found

    rates = {}
    head.propose = spy
    try:
        for drawn in (False, True):
            head.sample_drafts = drawn
            before = (eng.stats.num_spec_draft_tokens, eng.stats.num_spec_accepted_tokens)
            outs = random_head.generate(ps, params)
            assert all(len(o.token_ids) == 32 for o in outs)
            proposed = eng.stats.num_spec_draft_tokens - before[0]
            rates[drawn] = (eng.stats.num_spec_accepted_tokens - before[1]) / proposed, proposed
    finally:
        del head.propose
        head.sample_drafts = True
    assert len(rows) > 10, "no proposal was drawn"
    support = head.head.to_target.tolist()
    for proposals, q in rows:
        assert q.shape == (len(proposals), eng.model_config.vocab_size)
        torch.testing.assert_close(q.sum(dim=-1), torch.ones(len(proposals)), atol=1e-4, rtol=0)
        assert all(float(q[j, t]) > 0 for j, t in enumerate(proposals))
        if len(support) < q.shape[1]:  # EAGLE-3: no mass outside the draft vocabulary
            outside = torch.ones(q.shape[1], dtype=torch.bool)
            outside[support] = False
            assert float(q[:, outside].sum()) == 0.0
    print("acceptance (argmax, drawn):", rates)
    assert rates[True][0] > rates[False][0], rates
    assert pools_full(random_head)


def test_blocks_come_back_after_finish_and_abort(random_head):
    eng = random_head.engine
    head = eng.spec.draft
    assert pools_full(random_head)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=6 + 20 * i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts(3, seed=8))]
    for _ in range(200):  # (bounded: each step decodes every request)
        if reqs[0].finish_reason and all(len(r.output_token_ids) > 8 for r in reqs[1:]):
            break
        eng.step()
    rid = [r.request_id for r in reqs]
    assert rid[0] not in head.seqs and rid[0] not in head.states and head.kv.tables.get(rid[0]) is None  # finished
    assert set(rid[1:]) <= set(head.seqs) and head.kv.num_free_blocks < head.kv.pool.num_blocks
    held, free = len(head.kv.tables[rid[1]]), head.kv.num_free_blocks
    assert held > 0 and eng.abort_request(rid[1])  # aborted
    assert rid[1] not in head.seqs and rid[1] not in head.states and head.kv.num_free_blocks == free + held
    assert eng.abort_request(rid[2])
    eng.release(rid[0])
    assert pools_full(random_head) and not eng.has_unfinished()


def test_structured_outputs_equal_no_speculation(plain, random_head):
    """EAGLE-3's rows outside its draft vocabulary are -inf: under a grammar the head proposes the
    best token it has that the grammar allows, or stops."""
    grammars = [{"regex": r"(ab|cd)( (ab|cd)){10,30}"}, {"choice": ["alpha beta alpha beta", "gamma"]},
                {"json": {"type": "array", "items": {"enum": ["x", "yz"]}, "minItems": 6, "maxItems": 12},
                 "disable_any_whitespace": True}]
    ps = prompts(3, seed=9)
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=g) for g in grammars]
    assert run(random_head, ps, params) == run(plain, ps, params)
    assert pools_full(random_head)


def test_preemption_chunks_and_the_prefix_cache_stay_exact(llama_dir, plain, heads):
    """A small pool (preemptions: the head's KV and hidden states released, computed again),
    chunked prompts (the hidden states of several steps), prompts sharing a cached prefix (no
    hidden states there: the head reads zeros) and a half-size head pool: output equal to the
    engine without speculation, the copy head still accepted, every block back."""
    ps = prompts(8, seed=5)
    ps = ps + [p + [5, 6, 7] for p in ps[:2]]
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
    want = run(plain, ps, params)
    for method in ("eagle", "eagle3"):
        cfg = eagle_cfg(method, heads[f"{method}-copy"], draft_kv_cache_fraction=0.5)
        with LLM(llama_dir, seed=0, speculative_config=cfg, max_num_batched_tokens=24, block_size=4,
                 num_gpu_blocks_override=48) as llm:
            assert run(llm, ps[:8], params) == want[:8]
            s = llm.engine.stats
            assert s.num_preemptions > 0 and s.num_spec_accepted_tokens > 0
            assert run(llm, ps[:1], params) == want[:1]
            computed = s.num_prompt_tokens_computed
            assert run(llm, ps[8:9], params) == want[8:9]  # (its prompt begins with the one just run)
            assert s.num_prompt_tokens_computed - computed < len(ps[8])  # (a prefix cache hit)
            assert pools_full(llm)


def test_a_head_of_another_hidden_size_is_refused_naming_the_field(llama_dir, tmp_path):
    path = make_eagle1(str(tmp_path / "wide"), llama_dir, hidden=256)
    parse_speculative_config(eagle_cfg("eagle", path))  # (the target is not known here)
    with pytest.raises(ConfigError, match=r"speculative_config\.model=.*hidden size 256 is not the target"):
        LLM(llama_dir, speculative_config=eagle_cfg("eagle", path))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_missing_or_malformed_heads_are_refused_naming_the_field(llama_dir, heads, tmp_path, method):
    field = r"speculative_config\.model"
    with pytest.raises(ConfigError, match=field):
        parse_speculative_config({"method": method, "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=field):
        parse_speculative_config(eagle_cfg(method, str(tmp_path / "nowhere")))
    broken = tmp_path / f"{method}-broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=field + r".*config\.json"):
        parse_speculative_config(eagle_cfg(method, str(broken)))
    # A weight missing or of the wrong shape: refused when the engine loads the head.
    short = tmp_path / f"{method}-short"
    short.mkdir()
    src = heads[method]
    (short / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, :-1].contiguous()
    save_file(weights, str(short / "model.safetensors"))
    with pytest.raises(ConfigError, match=field + r".*fc\.weight has shape"):
        LLM(llama_dir, speculative_config=eagle_cfg(method, str(short)))


def test_unsupported_methods_are_refused_naming_the_field(heads):
    with pytest.raises(ConfigError, match=r"speculative_config\.method='medusa' \(not supported yet\)"):
        parse_speculative_config({"method": "medusa", "model": heads["eagle"], "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative_config\.prompt_lookup_max"):
        parse_speculative_config({**eagle_cfg("eagle", heads["eagle"]), "prompt_lookup_max": 3})


def test_a_heads_reservation_holds_its_prompt_rows_and_one_carrier_block(llama_dir, heads):
    """``draft_prompt_kv: auto`` with a head reserves head blocks for every remote prompt, idle or
    not (the decode side has no hidden states of a remote prompt to compute its rows from): for
    rows 0 .. n - 2 and one block more, the carrier of row n - 1's hidden input. Adopting takes
    the carrier's row out and gives its block back; a notice without head KV gives every block
    back; the prefill side keeps an export's hidden states until its export is released."""
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig

    eng = LLMEngine(EngineConfig.from_kwargs(llama_dir, speculative_config=eagle_cfg(
        "eagle", heads["eagle"], draft_prompt_kv="auto")))
    try:
        conn, head = eng.connector, eng.spec.draft
        full = head.kv.pool.num_blocks
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for n, blocks in ((33, 3), (32, 3), (17, 2), (1, 1)):  # block size 16: ceil((n - 1) / 16) + 1
            res = conn.reserve(eng.make_request(list(range(5, 5 + n)), params, request_id=f"r{n}"))
            assert res is not None and len(res.draft_block_ids) == blocks == head.prompt_blocks(n), n
        row = torch.arange(head.model_config.hidden_size, dtype=head.runner.dtype).reshape(1, -1)
        head._put_carrier(head.kv.block_ids("r33")[-1], row)
        conn.remote_ready("r33", 7, draft_tokens=33)
        assert head.seqs["r33"].valid == 32 and len(head.kv.tables["r33"]) == 2  # (the carrier went back)
        assert torch.equal(head.states["r33"].take(32, 33, row.shape[1], row.dtype, row.device), row)
        head._put_carrier(head.kv.block_ids("r1")[0], row)  # (1 token: no row of KV, the carrier alone)
        conn.remote_ready("r1", 7, draft_tokens=1)
        assert head.seqs["r1"].valid == 0 and "r1" not in head.kv.tables or not head.kv.tables["r1"]
        assert torch.equal(head.states["r1"].take(0, 1, row.shape[1], row.dtype, row.device), row)
        conn.remote_ready("r17", 7, draft_tokens=0)  # none written: the head computes it from zeros
        assert "r17" not in head.kv.tables and "r17" not in head.seqs
        assert (eng.stats.num_spec_prompts_shipped, eng.stats.num_spec_prompts_local) == (2, 1)
        for rid in ("r33", "r32", "r17", "r1"):
            conn.abort(rid)
            eng.release(rid)
        assert head.kv.num_free_blocks == full and not head.seqs and not head.states
        # The prefill side: an export whose decode worker asked for the head's rows has them
        # computed as its prompt is, its blocks kept past its finish until it is released.
        conn.add_export(list(range(5, 45)), SamplingParams(max_tokens=1, temperature=0.0), "x", draft=True)
        conn.add_export(list(range(6, 46)), SamplingParams(max_tokens=1, temperature=0.0), "y")
        while eng.has_work():
            eng.step()
        assert not head.states and list(head.exports) == ["x"]  # (its rows computed step by step)
        assert head.exports["x"].num_computed_tokens == 39 and len(head.kv.tables["x"]) == head.prompt_blocks(40)
        assert list(conn.export_draft([("x", list(range(5, 45))), ("y", list(range(6, 46)))])) == ["x"]
        for rid in ("x", "y"):
            conn.release_export(rid)
        assert not head.exports and head.kv.num_free_blocks == full
    finally:
        eng.close()
