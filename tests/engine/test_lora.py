"""LoRA adapters in the engine (docs/lora.md): greedy output equals HF transformers + PEFT on the
same base and adapter (float32, TP=1 and TP=2), a batch mixing adapters and the base equals each
request alone, the prefix cache and KV events keep adapters apart, bad adapters are refused at
load naming the field, and more adapters than slots are served in turn (LRU)."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from pdserve.engine import LLM, ConfigError, InvalidRequestError, LoRAError, LoRARequest, SamplingParams
from pdserve.engine import native
from pdserve.engine.lora_layers import LoRAState

MAX_TOKENS = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, use_rslora)
SPECS = {
    "a1": (8, 16, ALL, False),
    "a2": (4, 8, ["q_proj", "v_proj"], True),
    "a3": (16, 16, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "a4": (2, 4, ["k_proj", "up_proj"], False),
}


def make_adapter(base_dir: str, out_dir: str, r: int, alpha: int, targets, rslora: bool = False, seed: int = 0) -> str:
    """A random PEFT adapter (B non-zero: init_lora_weights=False), saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                     init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(hf, cfg)
    with torch.no_grad():  # keep the delta the size of a fine-tune's, not of a random init's
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    peft_model.save_pretrained(out_dir)
    return out_dir


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 40, 70)]


def hf_peft_greedy(base_dir: str, adapter_dir: str | None, ids_list, max_tokens: int = MAX_TOKENS):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    for ids in ids_list:
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    """name -> LoRARequest; llama adapters a1..a4, a qwen2 adapter q1."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(SPECS.items(), start=1):
        path = make_adapter(model_dirs("llama"), str(root / name), r, alpha, targets, rslora, seed=i)
        out[name] = LoRARequest(name, i, path)
    out["q1"] = LoRARequest("q1", 9, make_adapter(model_dirs("qwen2"), str(root / "q1"), 8, 16, ALL, seed=9))
    return out


@pytest.fixture(scope="module")
def llama_llm(model_dirs):
    llm = LLM(model_dirs("llama"), enable_lora=True, max_loras=4, max_lora_rank=16, max_num_batched_tokens=32)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def references(model_dirs, adapters):
    """HF + PEFT greedy outputs of the llama prompts, per adapter (None: the base)."""
    ids = prompts(256)
    base = model_dirs("llama")
    refs = {name: hf_peft_greedy(base, adapters[name].lora_path, ids) for name in SPECS}
    refs[None] = hf_peft_greedy(base, None, ids)
    return ids, refs


def test_llama_matches_hf_peft_with_chunked_prefill(llama_llm, adapters, references):
    ids, refs = references
    for name in SPECS:
        outs = llama_llm.generate(ids, GREEDY, lora_request=adapters[name])
        assert [o.token_ids for o in outs] == refs[name], name
    assert any(refs[name] != refs[None] for name in SPECS)  # the adapters change the output


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_matches_hf_peft(model_dirs, adapters, tp):
    ids = prompts(256, seed=1)
    ref = hf_peft_greedy(model_dirs("qwen2"), adapters["q1"].lora_path, ids)
    assert ref != hf_peft_greedy(model_dirs("qwen2"), None, ids)
    with LLM(model_dirs("qwen2"), enable_lora=True, max_lora_rank=8, tensor_parallel_size=tp) as llm:
        outs = llm.generate(ids, GREEDY, lora_request=adapters["q1"])
    assert [o.token_ids for o in outs] == ref


def test_llama_tp2_mixed_batch_matches_hf_peft(model_dirs, adapters, references):
    ids, refs = references
    names = [None, "a1", "a2", "a3", "a4"]
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=4, tensor_parallel_size=2) as llm:
        outs = llm.generate([ids[i % len(ids)] for i in range(len(names))], GREEDY,
                            lora_request=[adapters[n] if n else None for n in names])
    for i, (n, o) in enumerate(zip(names, outs)):
        assert o.token_ids == refs[n][i % len(ids)], n


def test_mixed_batch_equals_each_alone_in_one_forward(llama_llm, adapters, references, monkeypatch):
    ids, refs = references
    names = [None, "a1", "a2", "a3", "a4", None, "a1", "a3"]
    batch = [ids[i % len(ids)] for i in range(len(names))]
    groups: list[int] = []
    begin = LoRAState.begin

    def spy(self, slots, device):
        begin(self, slots, device)
        groups.append(0 if slots is None else len(set(slots[slots >= 0].tolist())))

    monkeypatch.setattr(LoRAState, "begin", spy)
    outs = llama_llm.generate(batch, GREEDY, lora_request=[adapters[n] if n else None for n in names])
    assert max(groups) == 4  # the four adapters (and the base rows) ran in the same forward
    for i, (n, o) in enumerate(zip(names, outs)):
        alone = llama_llm.generate([batch[i]], GREEDY, lora_request=adapters[n] if n else None)[0]
        assert o.token_ids == alone.token_ids == refs[n][i % len(ids)], (i, n)


def test_the_native_kernel_serves_float32_cpu_steps(llama_llm):
    """The tests above ran the gathered kernel (engine/lora_native.py), not the torch forms."""
    state = llama_llm.engine.runner.lora.model.state
    assert state.lib is not None, native.why_unavailable("lora_bgmv.c")


def test_the_gathered_kernel_computes_each_rows_own_delta():
    """csrc/lora_bgmv.c against the formula, row by row: two parts of one projection in one
    call (one absent from an adapter), rows of three slots and of the base in any order, more
    rows of a slot than a chunk holds, ranks below the stacks' padded rank, column offsets, and
    bad shapes refused."""
    from pdserve.engine import lora_native

    lib = lora_native.load(torch.device("cpu"), torch.float32, 16)
    assert lib is not None, native.why_unavailable("lora_bgmv.c")
    gen = torch.Generator().manual_seed(0)
    width, slots_n, rank, outs, cols = 40, 3, 8, [24, 12], [3, 30]
    stacks = lora_native.Stacks(outs, cols, width, slots_n, rank, torch.device("cpu"))
    a = [torch.randn(slots_n, rank, width, generator=gen) for _ in outs]
    bt = [torch.randn(slots_n, rank, o, generator=gen) for o in outs]
    present = np.array([[1, 1], [1, 0], [1, 1]], dtype=np.uint8)  # slot 1's adapter lacks the second part
    for p in range(len(outs)):
        stacks.a_part(p).copy_(a[p])
        stacks.bt[p].copy_(bt[p])
    stacks.present[:] = present
    slots = np.array([0, -1, 2, 1, 2, 0, -1, 1, 1] + [0] * 10, dtype=np.int32)  # 12 rows of slot 0: two chunks
    rows = len(slots)
    ranks, scalings = [8, 4, 6], [0.5, 2.0, 1.5]
    x = torch.randn(rows, width, generator=gen)
    y = torch.randn(rows, 50, generator=gen)
    want = y.clone()
    for t, s in enumerate(slots.tolist()):
        for p, (o, c0) in enumerate(zip(outs, cols)):
            if s >= 0 and present[s, p]:
                r = ranks[s]
                want[t, c0:c0 + o] += scalings[s] * ((a[p][s, :r] @ x[t]) @ bt[p][s, :r])
    step = lora_native.step_args(slots, ranks, scalings, slots_n, rank)
    assert step.num_chunks >= 4  # slots 1 and 2, and slot 0's twelve rows cut in at least two
    stacks.apply(lib, x, step, y)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[1], want[1]) and torch.equal(y[:, :3], want[:, :3])  # the base row and other columns untouched
    assert torch.equal(y[3, 30:42], want[3, 30:42])  # slot 1's absent part left alone
    with pytest.raises(ValueError, match="out of the stacks"):
        lora_native.step_args(np.array([3], dtype=np.int32), ranks, scalings, slots_n, rank)
    with pytest.raises(ValueError, match="unexpected shape"):
        stacks.apply(lib, x[:5], step, y)
    with pytest.raises(ValueError, match="unexpected shape"):
        stacks.apply(lib, x, step, y[:, :40])  # the second part's columns end at 42


def test_the_torch_forms_match_hf_peft_too(model_dirs, adapters, references, monkeypatch):
    """Without the kernel (PDSERVE_LORA_KERNEL=torch, or where it does not build) the masked form
    (several adapters in a step) and the gathered one (one adapter beside the base) give the
    same tokens."""
    ids, refs = references
    monkeypatch.setenv("PDSERVE_LORA_KERNEL", "torch")
    forms: set[str] = set()
    begin = LoRAState.begin

    def spy(self, slots, device):
        begin(self, slots, device)
        if self.mask is not None:
            forms.add("masked")
        elif self.groups:
            forms.add("gathered")

    monkeypatch.setattr(LoRAState, "begin", spy)
    names = [None, "a1", "a2", "a3", "a4", "a1"]
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=4, max_lora_rank=16) as llm:
        assert llm.engine.runner.lora.model.state.lib is None
        mixed = llm.generate([ids[i % len(ids)] for i in range(len(names))], GREEDY,
                             lora_request=[adapters[n] if n else None for n in names])
        pair = llm.generate(ids[:2], GREEDY, lora_request=[adapters["a2"], None])
    assert forms == {"masked", "gathered"}
    for i, (n, o) in enumerate(zip(names, mixed)):
        assert o.token_ids == refs[n][i % len(ids)], (i, n)
    assert [o.token_ids for o in pair] == [refs["a2"][0], refs[None][1]]


def test_prefix_cache_never_shares_kv_between_adapters(model_dirs, adapters, references):
    ids, refs = references
    prompt = ids[3]  # 70 tokens: four full blocks
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=2, kv_events=True) as llm:
        first = llm.generate([prompt], GREEDY, lora_request=adapters["a1"])[0]
        other = llm.generate([prompt], GREEDY, lora_request=adapters["a2"])[0]
        base = llm.generate([prompt], GREEDY)[0]
        again = llm.generate([prompt], GREEDY, lora_request=adapters["a1"])[0]
        batch = llm.engine.kv_events.take_batch()
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.num_cached_tokens == 64  # its own adapter's blocks are reused
    assert (first.token_ids, other.token_ids, base.token_ids, again.token_ids) == (
        refs["a1"][3], refs["a2"][3], refs[None][3], refs["a1"][3])
    assert batch is not None
    stored = [e for e in batch[1].events if type(e).__name__ == "BlockStored"]
    by_name: dict = {}
    for e in stored:
        by_name.setdefault(e.lora_name, set()).update(e.block_hashes)
        assert e.lora_id == (None if e.lora_name is None else adapters[e.lora_name].lora_int_id)
    assert set(by_name) == {"a1", "a2", None}
    assert not (by_name["a1"] & by_name["a2"]) and not (by_name["a1"] & by_name[None])


def test_eviction_serves_more_adapters_than_slots(model_dirs, adapters, references):
    ids, refs = references
    order = ["a1", "a2", "a3", "a4", "a1", "a3", "a2"]
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=2, max_cpu_loras=2) as llm:
        for n in order:
            assert llm.generate([ids[1]], GREEDY, lora_request=adapters[n])[0].token_ids == refs[n][1], n
        lora = llm.engine.runner.lora
        assert lora is not None
        assert lora.slot_loads == len(order) and lora.cache.loads == len(order)  # reloaded from disk
        # two adapters at once fit the two slots; a third waits for a slot (LRU), all correct
        outs = llm.generate([ids[0]] * 4, GREEDY, lora_request=[adapters[n] for n in ("a1", "a2", "a3", "a4")])
        assert [o.token_ids for o in outs] == [refs[n][0] for n in ("a1", "a2", "a3", "a4")]


def test_preemption_keeps_the_adapter(model_dirs, adapters, references):
    ids, refs = references
    names = ["a1", "a2", None, "a3"]
    longer = SamplingParams(max_tokens=40, temperature=0.0)
    loras = [adapters[n] if n else None for n in names]
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=4, num_gpu_blocks_override=8) as llm:
        outs = llm.generate([ids[1]] * 4, longer, lora_request=loras)
        assert llm.engine.stats.num_preemptions > 0
        alone = [llm.generate([ids[1]], longer, lora_request=lora)[0] for lora in loras]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert [o.token_ids[:MAX_TOKENS] for o in outs] == [refs[n][1] for n in names]


def _broken(adapters, tmp_path, name: str, edit) -> LoRARequest:
    path = str(tmp_path / name)
    shutil.copytree(adapters["a2"].lora_path, path)
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        text = f.read()
    with open(cfg_path, "w") as f:
        f.write(edit(text))
    return LoRARequest(name, 50 + len(name), path)


def _with(key, value):
    return lambda text: json.dumps({**json.loads(text), key: value})


@pytest.mark.parametrize("case,edit,field", [
    ("malformed", lambda text: text[:-5], "adapter_config.json"),
    ("rank", _with("r", 32), "r"),
    ("dora", _with("use_dora", True), "use_dora"),
    ("bias", _with("bias", "all"), "bias"),
    ("save", _with("modules_to_save", ["lm_head"]), "modules_to_save"),
    ("target", _with("target_modules", ["q_proj", "embed_tokens"]), "target_modules"),
    ("alpha", _with("lora_alpha", "big"), "lora_alpha"),
])
def test_bad_adapters_are_refused_naming_the_field(llama_llm, adapters, references, tmp_path, case, edit, field):
    ids, refs = references
    bad = _broken(adapters, tmp_path, case, edit)
    with pytest.raises(LoRAError) as err:
        llama_llm.generate(ids[:2], GREEDY, lora_request=[adapters["a1"], bad])
    assert err.value.field == field and case in str(err.value)
    assert not llama_llm.engine.requests  # nothing was queued
    outs = llama_llm.generate(ids[:2], GREEDY, lora_request=[adapters["a1"], None])
    assert [o.token_ids for o in outs] == [refs["a1"][0], refs[None][1]]


def test_adapter_for_another_base_is_refused(llama_llm, adapters):
    with pytest.raises(LoRAError) as err:
        llama_llm.generate([[5, 6, 7]], GREEDY, lora_request=adapters["q1"])
    assert err.value.field.startswith("base_model.model.model.layers.") and "another base" in str(err.value)


def test_request_and_config_checks(model_dirs, llama_llm, adapters):
    with pytest.raises(InvalidRequestError) as err:
        llama_llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("x", 3, "/no/such/dir"))
    assert err.value.field == "lora_request.lora_path"
    with pytest.raises(InvalidRequestError) as err:  # one name is one adapter
        llama_llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("a1", 1, adapters["a2"].lora_path))
    assert err.value.field == "lora_request.lora_name"
    with pytest.raises(InvalidRequestError) as err:
        llama_llm.generate([[5, 6]], GREEDY, lora_request=[adapters["a1"]] * 2)
    assert err.value.field == "lora_request"
    for bad, name in (({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
                      ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras")):
        with pytest.raises(ConfigError, match=name):
            LLM(model_dirs("llama"), enable_lora=True, **bad)


def test_engine_without_lora_refuses_adapters(model_dirs, adapters):
    with LLM(model_dirs("llama")) as llm:
        with pytest.raises(InvalidRequestError) as err:
            llm.generate([[5, 6]], GREEDY, lora_request=adapters["a1"])
        assert err.value.field == "lora_request" and "enable_lora" in str(err.value)


def test_adapters_with_speculation_and_grammars(model_dirs, adapters):
    """Where LoRA meets the other features in one engine: n-gram speculation verifying several
    tokens per row under each row's own adapter, and grammars constraining an adapted row. A
    batch mixing adapters, the base and grammars gives the same tokens with speculation as
    without, and speculation did run on adapter rows."""
    rng = random.Random(3)
    ps = []
    for i in range(6):
        phrase = [rng.randrange(3, 250) for _ in range(rng.randrange(3, 8))]
        ps.append(phrase * rng.randrange(3, 6))  # repetitive: n-gram proposals get accepted
    names = ["a1", "a3", None, "a1", "a4", "a2"]
    grammar = {"regex": r"(ab|cd)( (ab|cd)){2,5}"}
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) if i % 3 != 2
              else SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=grammar) for i in range(len(ps))]
    loras = [adapters[n] if n else None for n in names]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=4, seed=0) as llm:
        want = [(o.token_ids, o.finish_reason) for o in llm.generate(ps, params, lora_request=loras)]
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=4, seed=0, speculative_config=ngram) as llm:
        got = [(o.token_ids, o.finish_reason) for o in llm.generate(ps, params, lora_request=loras)]
        assert llm.engine.stats.num_spec_accepted_tokens > 0
    assert got == want
    assert [reason for _, reason in want][2::3] == ["stop", "stop"]  # the grammar rows ended by their grammar


def test_adapters_over_an_fp8_kv_cache(model_dirs, adapters, references):
    """LoRA with an FP8 KV pool (computed scales, on the native kernel where it builds): one
    prompt under the base and four adapters in one batch gives each row what it gives alone, and
    the adapters still change the output. (Against HF+PEFT's float32 reference FP8 is not exact:
    docs/kv_cache.md measures FP8's agreement.)"""
    ids, _ = references
    names = [None, "a1", "a2", "a3", "a4"]
    batch = [ids[0]] * len(names)
    loras = [adapters[n] if n else None for n in names]
    with LLM(model_dirs("llama"), enable_lora=True, max_loras=4, kv_cache_dtype="fp8_e4m3",
             calculate_kv_scales=True) as llm:
        got = [o.token_ids for o in llm.generate(batch, GREEDY, lora_request=loras)]
        alone = [llm.generate([p], GREEDY, lora_request=lr)[0].token_ids for p, lr in zip(batch, loras)]
    assert got == alone
    assert len(set(map(tuple, got))) > 1  # the adapters change what the base would say
