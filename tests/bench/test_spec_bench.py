"""bench/spec.py's draft-model setup: the early-exit draft made from the target's first layers,
the damped target it agrees with, and short runs of the bench on them (greedy, and sampling
with drawn against argmax proposals)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pdserve.bench import spec


@pytest.fixture()
def target(llama_dir, tmp_path) -> str:
    out = str(tmp_path / "target")
    shutil.copytree(llama_dir, out)
    return out


def layer_of(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def test_the_draft_keeps_the_first_layers_and_the_rest_of_the_model(target):
    with open(os.path.join(target, "config.json")) as f:
        total = json.load(f)["num_hidden_layers"]
    full = load_file(os.path.join(target, "model.safetensors"))
    draft = spec.first_layers_draft(target, 1)
    assert draft == target + "-first1" and spec.first_layers_draft(target, 1) == draft  # made once
    with open(os.path.join(draft, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1
    weights = load_file(os.path.join(draft, "model.safetensors"))
    assert {layer_of(k) for k in weights} == {0, None}
    assert set(weights) == {k for k in full if layer_of(k) in (0, None)}
    assert all(torch.equal(weights[k], full[k]) for k in weights)
    assert os.path.isfile(os.path.join(draft, "tokenizer.json"))
    for bad in (0, total):
        with pytest.raises(SystemExit, match="--draft-layers"):
            spec.first_layers_draft(target, bad)


def test_the_damped_target_scales_only_the_later_layers_outputs(target):
    full = load_file(os.path.join(target, "model.safetensors"))
    damped = load_file(os.path.join(spec.damped_target(target, 1, 0.01), "model.safetensors"))
    assert set(damped) == set(full)
    scaled = {k for k in full if not torch.equal(damped[k], full[k])}
    assert scaled and all(layer_of(k) >= 1 and k.split(".")[-2] in ("o_proj", "down_proj") for k in scaled)
    assert all(layer_of(k) == 0 or k.split(".")[-2] not in ("o_proj", "down_proj") or k in scaled for k in full
               if layer_of(k) is not None)
    k = next(iter(scaled))
    torch.testing.assert_close(damped[k], full[k] * 0.01)


def test_a_short_draft_model_run_reports_acceptance_beside_speed(target, tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert spec.main(["--model", target, "--method", "draft_model", "--draft-layers", "1", "--damp-after", "0.01",
                      "--batches", "1,2", "--rounds", "1", "--output-len", "8", "--disable-by-cost", "off",
                      "--json", str(out)]) == 0  # (every step speculates, whatever it costs on this machine)
    res = json.loads(out.read_text())
    assert res["config"]["model"].endswith("-damped1x0.01")
    for b in ("1", "2"):
        side = res["results"][b]["draft_model"]
        assert side["proposed"]["median"] > 0 and 0.0 <= side["acceptance"]["median"] <= 1.0
        assert res["results"][b]["off"]["tok_s"]["median"] > 0
    assert "draft_model / off tokens/s" in capsys.readouterr().out


def test_sampling_requests_compare_drawn_and_argmax_proposals_in_one_run(target, tmp_path, capsys):
    """--temperature 1 --draft-sampling both: two speculating sides against one plain side; the
    drawn proposals of a draft close to its target are accepted, its argmax on this random
    model's flat distributions almost never."""
    out = tmp_path / "spec.json"
    assert spec.main(["--model", target, "--method", "draft_model", "--draft-layers", "1", "--damp-after", "0.01",
                      "--batches", "1", "--rounds", "1", "--output-len", "8", "--disable-by-cost", "off",
                      "--temperature", "1", "--draft-sampling", "both", "--json", str(out)]) == 0
    sides = json.loads(out.read_text())["results"]["1"]
    assert set(sides) == {"off", "draft_model:drawn", "draft_model:argmax"}
    drawn, argmax = (sides[f"draft_model:{m}"]["acceptance"]["median"] for m in ("drawn", "argmax"))
    assert drawn > 0.5 > argmax, (drawn, argmax)
    printed = capsys.readouterr().out
    assert "draft_model:drawn / off tokens/s" in printed and "draft_model:argmax / off tokens/s" in printed
