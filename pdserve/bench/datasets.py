"""Workloads for the serving benchmark, made locally (no hub), seeded.

Each dataset returns a list of `SampleRequest`: the prompt (token ids for the
synthetic sets, text for ShareGPT), its length in tokens, how many tokens to
generate, and a `kind` label that the metrics group by.

- ``random``: input and output lengths drawn uniformly from
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM's symmetric
  range ratio), random token ids: no two prompts share a prefix.
- ``shared-prefix``: ``num_groups`` long system prompts; every request is one
  of them followed by its own suffix (the prefix cache's favourite case).
- ``mixed``: bimodal, short chat turns and long documents (an exact fraction
  of long ones, shuffled): the workload where prefill of a long prompt stalls
  the decoding of short ones, which is what disaggregation is for.
- ``sharegpt``: any ShareGPT-format JSON file (a list of
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``):
  the first human turn is the prompt, the reply's length the output length.

The same arguments and seed give the same requests, so two modes of a sweep
see the same workload; a sweep moves the seed per request rate so that one
rate's prompts never hit the prefix cache that an earlier rate filled.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Token ids below this are special in the Llama/Mistral vocabularies (unk, bos, eos).
FIRST_PLAIN_TOKEN_ID = 3
DATASET_NAMES = ("random", "shared-prefix", "mixed", "sharegpt")


@dataclass
class SampleRequest:
    """One request of a workload: what to send and how long an answer to ask for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    kind: str


@dataclass
class DatasetConfig:
    """Every dataset knob in one place (the CLI fills it; defaults suit the ~34M CPU model)."""

    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    range_ratio: float = 0.0
    # random
    input_len: int = 256
    output_len: int = 64
    # shared-prefix
    prefix_len: int = 512
    suffix_len: int = 64
    num_groups: int = 4
    # mixed: short chat turns + long documents
    short_input_len: int = 64
    short_output_len: int = 64
    long_input_len: int = 1536
    long_output_len: int = 32
    long_fraction: float = 0.25
    # sharegpt
    path: str | None = None
    sharegpt_output_len: int | None = None  # fixed output length instead of the reply's
    sharegpt_max_prompt_len: int = 1024
    sharegpt_max_total_len: int = 2048


def sample_lengths(rng: random.Random, length: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform on the integers of [length*(1-r), length*(1+r)], at least 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(length * (1.0 - range_ratio)))
    hi = max(lo, math.ceil(length * (1.0 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(n)]


def random_dataset(cfg: DatasetConfig, vocab_size: int) -> list[SampleRequest]:
    rng = random.Random(cfg.seed)
    ins = sample_lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    outs = sample_lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    return [SampleRequest(random_tokens(rng, i, vocab_size), i, o, "random") for i, o in zip(ins, outs)]


def shared_prefix_dataset(cfg: DatasetConfig, vocab_size: int) -> list[SampleRequest]:
    """Requests cycle through the groups, so each group's prefix recurs at a steady pace."""
    if cfg.num_groups < 1:
        raise ValueError(f"shared-prefix groups must be >= 1, got {cfg.num_groups}")
    rng = random.Random(cfg.seed)
    prefixes = [random_tokens(rng, cfg.prefix_len, vocab_size) for _ in range(cfg.num_groups)]
    suffixes = sample_lengths(rng, cfg.suffix_len, cfg.range_ratio, cfg.num_prompts)
    outs = sample_lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    reqs = []
    for i, (s, o) in enumerate(zip(suffixes, outs)):
        g = i % cfg.num_groups
        prompt = prefixes[g] + random_tokens(rng, s, vocab_size)
        reqs.append(SampleRequest(prompt, len(prompt), o, f"group-{g}"))
    return reqs


def mixed_dataset(cfg: DatasetConfig, vocab_size: int) -> list[SampleRequest]:
    """round(num_prompts * long_fraction) long documents among short chat turns, shuffled."""
    if not 0.0 <= cfg.long_fraction <= 1.0:
        raise ValueError(f"mixed long fraction must be in [0, 1], got {cfg.long_fraction}")
    rng = random.Random(cfg.seed)
    n_long = round(cfg.num_prompts * cfg.long_fraction)
    kinds = ["long"] * n_long + ["short"] * (cfg.num_prompts - n_long)
    rng.shuffle(kinds)
    reqs = []
    for kind in kinds:
        in_len, out_len = ((cfg.long_input_len, cfg.long_output_len) if kind == "long"
                           else (cfg.short_input_len, cfg.short_output_len))
        i = sample_lengths(rng, in_len, cfg.range_ratio, 1)[0]
        o = sample_lengths(rng, out_len, cfg.range_ratio, 1)[0]
        reqs.append(SampleRequest(random_tokens(rng, i, vocab_size), i, o, kind))
    return reqs


def sharegpt_dataset(cfg: DatasetConfig, count_tokens: Callable[[str], int]) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: first human turn + first reply, too short/long pairs skipped.

    Conversations are shuffled with the seed; when the file holds fewer usable
    pairs than ``num_prompts``, they are reused in order (prefix-cache hits then).
    """
    if not cfg.path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")
    path = Path(cfg.path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path}: no such file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            continue
        pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(cfg.seed).shuffle(pairs)
    reqs = []
    for prompt, reply in pairs:
        p_len = count_tokens(prompt)
        o_len = cfg.sharegpt_output_len or count_tokens(reply)
        if p_len < 4 or (cfg.sharegpt_output_len is None and o_len < 4):
            continue  # vLLM's filter: too short to mean anything
        if p_len > cfg.sharegpt_max_prompt_len or p_len + o_len > cfg.sharegpt_max_total_len:
            continue
        reqs.append(SampleRequest(prompt, p_len, o_len, "sharegpt"))
    if not reqs:
        raise ValueError(f"{path}: no conversation has a usable first human turn and reply "
                         f"(prompt 4..{cfg.sharegpt_max_prompt_len} tokens, "
                         f"prompt + reply <= {cfg.sharegpt_max_total_len})")
    return [reqs[i % len(reqs)] for i in range(cfg.num_prompts)]


def token_counter(tokenizer_dir: str | None) -> tuple[Callable[[str], int], bool]:
    """A text -> token count function: the model's tokenizer.json, else ~4 characters a token.

    Returns (counter, exact).
    """
    if tokenizer_dir:
        tok_file = Path(tokenizer_dir) / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
        return (lambda text: len(tok.encode(text, add_special_tokens=False).ids)), True
    return (lambda text: max(1, round(len(text) / 4))), False


def load_dataset(cfg: DatasetConfig, vocab_size: int = 32000, tokenizer_dir: str | None = None) -> list[SampleRequest]:
    """The requests of one run; `vocab_size` bounds the random token ids."""
    if cfg.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {cfg.num_prompts}")
    if cfg.name == "random":
        return random_dataset(cfg, vocab_size)
    if cfg.name == "shared-prefix":
        return shared_prefix_dataset(cfg, vocab_size)
    if cfg.name == "mixed":
        return mixed_dataset(cfg, vocab_size)
    if cfg.name == "sharegpt":
        return sharegpt_dataset(cfg, token_counter(tokenizer_dir)[0])
    raise ValueError(f"--dataset-name {cfg.name!r}; use one of {', '.join(DATASET_NAMES)}")
