"""Workloads of the serving benchmark: lengths, range ratio, shared prefixes, the mixed split, ShareGPT files."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.datasets import DatasetConfig, load_dataset, sharegpt_dataset, token_counter

VOCAB = 1000


def test_random_lengths_are_exact_with_range_ratio_zero():
    reqs = load_dataset(DatasetConfig("random", num_prompts=20, input_len=37, output_len=9), VOCAB)
    assert [len(r.prompt) for r in reqs] == [37] * 20
    assert [r.prompt_len for r in reqs] == [37] * 20
    assert [r.output_len for r in reqs] == [9] * 20


def test_random_lengths_stay_in_the_symmetric_range_and_cover_it():
    cfg = DatasetConfig("random", num_prompts=400, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    reqs = load_dataset(cfg, VOCAB)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150
    assert min(outs) >= 10 and max(outs) <= 30
    assert min(ins) < 60 and max(ins) > 140  # uniform over the range, not stuck at the centre
    assert all(len(r.prompt) == r.prompt_len for r in reqs)


def test_random_token_ids_avoid_special_ids_and_fit_the_vocabulary():
    reqs = load_dataset(DatasetConfig("random", num_prompts=10, input_len=200), VOCAB)
    ids = [t for r in reqs for t in r.prompt]
    assert min(ids) >= 3 and max(ids) < VOCAB


def test_same_seed_same_requests_other_seed_other_requests():
    cfg = DatasetConfig("mixed", num_prompts=12, seed=5, range_ratio=0.3)
    a, b = load_dataset(cfg, VOCAB), load_dataset(cfg, VOCAB)
    c = load_dataset(DatasetConfig("mixed", num_prompts=12, seed=6, range_ratio=0.3), VOCAB)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]


@pytest.mark.parametrize("ratio", [1.0, -0.1])
def test_range_ratio_outside_zero_one_is_an_error(ratio):
    with pytest.raises(ValueError, match="range ratio"):
        load_dataset(DatasetConfig("random", num_prompts=2, range_ratio=ratio), VOCAB)


def test_shared_prefix_requests_really_share_their_group_prefix():
    cfg = DatasetConfig("shared-prefix", num_prompts=12, prefix_len=48, suffix_len=10, num_groups=3, output_len=5)
    reqs = load_dataset(cfg, VOCAB)
    groups: dict[str, list] = {}
    for r in reqs:
        groups.setdefault(r.kind, []).append(r.prompt)
        assert r.prompt_len == len(r.prompt) == 58 and r.output_len == 5
    assert sorted(groups) == ["group-0", "group-1", "group-2"]
    prefixes = []
    for prompts in groups.values():
        assert len(prompts) == 4
        assert len({tuple(p[:48]) for p in prompts}) == 1, "one prefix per group"
        assert len({tuple(p[48:]) for p in prompts}) == 4, "each request has its own suffix"
        prefixes.append(tuple(prompts[0][:48]))
    assert len(set(prefixes)) == 3, "groups differ"


def test_mixed_has_the_exact_long_fraction_with_the_two_length_modes():
    cfg = DatasetConfig("mixed", num_prompts=40, long_fraction=0.25, short_input_len=30, short_output_len=12,
                        long_input_len=400, long_output_len=6)
    reqs = load_dataset(cfg, VOCAB)
    longs = [r for r in reqs if r.kind == "long"]
    shorts = [r for r in reqs if r.kind == "short"]
    assert len(longs) == 10 and len(shorts) == 30
    assert {(r.prompt_len, r.output_len) for r in longs} == {(400, 6)}
    assert {(r.prompt_len, r.output_len) for r in shorts} == {(30, 12)}
    kinds = [r.kind for r in reqs]
    assert kinds != sorted(kinds) and kinds != sorted(kinds, reverse=True), "long ones are spread, not bunched"


def write_sharegpt(path, convs):
    path.write_text(json.dumps(convs))
    return str(path)


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "word " * 20},
                                  {"from": "gpt", "value": "reply " * 10}, {"from": "human", "value": "more"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "only one turn here, no reply"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short prompt"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "tell me " * 30},
                                  {"from": "gpt", "value": "answer " * 8}]},
    {"id": "e", "conversations": [{"from": "human", "value": "long " * 2000}, {"from": "gpt", "value": "x " * 9}]},
    {"id": "f"},
]


def words(text: str) -> int:
    return len(text.split())


def test_sharegpt_takes_the_first_turn_and_reply_and_skips_unusable_conversations(tmp_path):
    path = write_sharegpt(tmp_path / "sg.json", SHAREGPT)
    reqs = sharegpt_dataset(DatasetConfig("sharegpt", num_prompts=2, path=path), words)
    got = sorted((r.prompt_len, r.output_len) for r in reqs)
    assert got == [(20, 10), (60, 8)]  # a and d; b: one turn, c: prompt < 4, e: prompt > 1024, f: no turns
    assert all(r.kind == "sharegpt" and isinstance(r.prompt, str) for r in reqs)


def test_sharegpt_fixed_output_length_and_reuse_when_the_file_is_short(tmp_path):
    path = write_sharegpt(tmp_path / "sg.json", SHAREGPT)
    reqs = sharegpt_dataset(DatasetConfig("sharegpt", num_prompts=5, path=path, sharegpt_output_len=7), words)
    assert len(reqs) == 5 and {r.output_len for r in reqs} == {7}
    assert reqs[0].prompt == reqs[2].prompt == reqs[4].prompt


def test_sharegpt_without_a_tokenizer_estimates_four_characters_a_token(tmp_path):
    path = write_sharegpt(tmp_path / "sg.json", SHAREGPT[:1])
    count, exact = token_counter(None)
    assert not exact and count("abcdefgh") == 2
    reqs = load_dataset(DatasetConfig("sharegpt", num_prompts=1, path=path))
    assert reqs[0].prompt_len == 25 and reqs[0].output_len == 15  # 100 and 60 characters


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON"),
    ('{"a": 1}', "JSON list"),
    ('[{"conversations": [{"from": "human", "value": "hi"}]}]', "no conversation"),
])
def test_bad_sharegpt_files_are_errors_that_say_why(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_dataset(DatasetConfig("sharegpt", num_prompts=1, path=str(path)))


def test_sharegpt_needs_a_file():
    with pytest.raises(ValueError, match="--dataset-path"):
        load_dataset(DatasetConfig("sharegpt", num_prompts=1))
    with pytest.raises(FileNotFoundError):
        load_dataset(DatasetConfig("sharegpt", num_prompts=1, path="/nonexistent/sg.json"))
