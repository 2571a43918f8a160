"""Simulated traffic: requests with arrival times, prompt and output lengths, shared prefixes.

Either a trace file (JSON lines, one request each: ``t`` seconds from the start,
``prompt_len``, ``output_len``, optionally ``rid`` (the id its prompt is made from),
``prefix_group`` and ``prefix_len``, ``priority``, ``ttft_slo_ms``) or a synthetic mix (`WorkloadSpec`): Poisson or bursty (gamma inter-arrival
times with a coefficient of variation > 1) arrivals, uniform / lognormal / fixed lengths,
and a share of the requests that begin with one of a few common prefixes (system prompts).
Three mixes named after the real benchmarks (`MIXES`) are what the validation runs.

Token ids are made up per request (`token_ids`): a prefix group's tokens are the same in every
request of the group, the rest unique, so the engine's prefix cache (real block hashes) sees
exactly the sharing the trace describes.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.common import Priority


class WorkloadError(ValueError):
    """A trace or workload spec that cannot be used; the message names the field."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    t: float  # arrival, seconds from the start
    prompt_len: int
    output_len: int
    prefix_group: int | None = None
    prefix_len: int = 0
    priority: str = "normal"
    ttft_slo_ms: float | None = None

    def token_ids(self, vocab: int = 32000) -> list[int]:
        """Its prompt: the group's prefix, then tokens no other request has."""
        head = group_prefix(self.prefix_group, self.prefix_len, vocab) if self.prefix_group is not None else []
        n = self.prompt_len - len(head)
        h = (self.rid * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
        start, stride = h % vocab, 1 + 2 * ((h >> 24) % 4093)  # one arithmetic sequence per id
        return head + [(start + i * stride) % vocab for i in range(n)] if n > 0 else head[:self.prompt_len]


_PREFIXES: dict[tuple[int, int, int], list[int]] = {}


def group_prefix(group: int, length: int, vocab: int) -> list[int]:
    key = (group, length, vocab)
    got = _PREFIXES.get(key)
    if got is None:
        rng = random.Random(1_000_003 * (group + 1))
        got = _PREFIXES[key] = [rng.randrange(3, vocab) for _ in range(length)]
    return got


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``uniform`` [low, high], ``lognormal`` (median, sigma), ``fixed``."""

    dist: str = "uniform"
    low: int = 1
    high: int = 1
    median: float = 0.0
    sigma: float = 0.0
    value: int = 0

    def draw(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            return rng.randint(self.low, self.high)
        return max(1, min(self.high or 1 << 30, int(round(rng.lognormvariate(math.log(self.median), self.sigma)))))

    def check(self, name: str) -> None:
        if self.dist not in ("uniform", "lognormal", "fixed"):
            raise WorkloadError(f"{name}.dist must be uniform, lognormal or fixed (got {self.dist!r})")
        if self.dist == "uniform" and not 1 <= self.low <= self.high:
            raise WorkloadError(f"{name}: uniform needs 1 <= low <= high (got {self.low}, {self.high})")
        if self.dist == "lognormal" and not (self.median >= 1 and self.sigma >= 0):
            raise WorkloadError(f"{name}: lognormal needs median >= 1 and sigma >= 0")
        if self.dist == "fixed" and self.value < 1:
            raise WorkloadError(f"{name}: fixed needs value >= 1 (got {self.value})")


@dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic mix; `generate` turns it into requests."""

    rate: float = 1.0  # requests per second
    num_requests: int = 100
    arrival: str = "poisson"  # poisson | gamma
    burstiness_cv: float = 1.0  # gamma: coefficient of variation of the gaps (> 1: bursts)
    prompt: Lengths = Lengths("uniform", 51, 971)
    output: Lengths = Lengths("fixed", value=64)
    prefix_share: float = 0.0  # fraction of requests that begin with a group's prefix
    prefix_groups: int = 1
    prefix_len: int = 0
    high_priority_share: float = 0.0
    low_priority_share: float = 0.0

    def check(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise WorkloadError(f"rate must be > 0 requests/s (got {self.rate!r})")
        if self.num_requests < 1:
            raise WorkloadError(f"num_requests must be >= 1 (got {self.num_requests})")
        if self.arrival not in ("poisson", "gamma"):
            raise WorkloadError(f"arrival must be poisson or gamma (got {self.arrival!r})")
        if not self.burstiness_cv > 0:
            raise WorkloadError(f"burstiness_cv must be > 0 (got {self.burstiness_cv!r})")
        self.prompt.check("prompt")
        self.output.check("output")
        for name in ("prefix_share", "high_priority_share", "low_priority_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise WorkloadError(f"{name} must be in [0, 1] (got {getattr(self, name)!r})")
        if self.prefix_share and (self.prefix_groups < 1 or self.prefix_len < 1):
            raise WorkloadError("prefix_share > 0 needs prefix_groups >= 1 and prefix_len >= 1")


def generate(spec: WorkloadSpec, seed: int = 0, first_rid: int = 0) -> list[SimRequest]:
    """The requests of ``spec``; the same seed gives the same requests. Their prompts are made
    from their ids (`SimRequest.token_ids`): traces that must not share prompts (several runs
    against one server, whose prefix cache would hit) start at different ``first_rid``."""
    spec.check()
    rng = random.Random(seed)
    out, t = [], 0.0
    for rid in range(first_rid, first_rid + spec.num_requests):
        if spec.arrival == "poisson":
            t += rng.expovariate(spec.rate)
        else:  # gamma gaps with mean 1/rate and the given coefficient of variation
            shape = 1.0 / spec.burstiness_cv ** 2
            t += rng.gammavariate(shape, 1.0 / (spec.rate * shape))
        prompt = spec.prompt.draw(rng)
        output = spec.output.draw(rng)
        group, plen = None, 0
        if spec.prefix_share and rng.random() < spec.prefix_share:
            group, plen = rng.randrange(spec.prefix_groups), spec.prefix_len
            prompt = max(prompt, plen + 1)
        u = rng.random()
        prio = "high" if u < spec.high_priority_share else \
            "low" if u < spec.high_priority_share + spec.low_priority_share else "normal"
        out.append(SimRequest(rid, round(t, 6), prompt, output, group, plen, prio))
    return out


# The validation mixes (docs/PERFORMANCE.md "The simulator"), after the real benchmarks:
MIXES = {
    # bench/peer_serve.py's long-prompt mix: vllm bench serve --dataset-name random, 51-971 in, 64 out
    "long-prompt": WorkloadSpec(prompt=Lengths("uniform", 51, 971), output=Lengths("fixed", value=64)),
    # decode-heavy: short prompts, long outputs
    "decode-heavy": WorkloadSpec(prompt=Lengths("uniform", 32, 128), output=Lengths("uniform", 128, 256)),
    # shared system prompts (prefix_repetition-like): 4 prefixes of 512 tokens, 64-256 more
    "prefix": WorkloadSpec(prompt=Lengths("uniform", 576, 768), output=Lengths("fixed", value=32),
                           prefix_share=1.0, prefix_groups=4, prefix_len=512),
    # For GPU-sized models (the scale study): retrieval-augmented prompts (long in, medium out),
    # and chat (lognormal lengths around 800 in and 200 out, long tails), 70 % of it behind one
    # of 8 system prompts of 1,024 tokens.
    "rag": WorkloadSpec(prompt=Lengths("uniform", 2048, 6144), output=Lengths("uniform", 128, 384)),
    "chat": WorkloadSpec(prompt=Lengths("lognormal", median=800, sigma=0.8, high=8192),
                         output=Lengths("lognormal", median=200, sigma=0.6, high=1024),
                         prefix_share=0.7, prefix_groups=8, prefix_len=1024),
}


def mix(name: str, rate: float, num_requests: int) -> WorkloadSpec:
    try:
        base = MIXES[name]
    except KeyError:
        raise WorkloadError(f"unknown mix {name!r} (known: {', '.join(MIXES)})") from None
    return WorkloadSpec(**{**base.__dict__, "rate": rate, "num_requests": num_requests})


def save_trace(requests: list[SimRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            body = {k: v for k, v in asdict(r).items() if v is not None}
            f.write(json.dumps(body, separators=(",", ":")) + "\n")


def load_trace(path: str | Path) -> list[SimRequest]:
    """Requests from a JSON-lines trace (sorted by arrival); WorkloadError names the line and field."""
    out, seen = [], set()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the trace: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            body = json.loads(line)
        except ValueError as exc:
            raise WorkloadError(f"{where}: not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise WorkloadError(f"{where}: a line is one JSON object")
        for k in ("t", "prompt_len", "output_len"):
            if k not in body:
                raise WorkloadError(f"{where}: missing field {k!r}")
        t, p, o = body["t"], body["prompt_len"], body["output_len"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 0 and math.isfinite(t)):
            raise WorkloadError(f"{where}: t must be seconds >= 0 (got {t!r})")
        for k, v in (("prompt_len", p), ("output_len", o)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise WorkloadError(f"{where}: {k} must be an integer >= 1 (got {v!r})")
        group, plen = body.get("prefix_group"), body.get("prefix_len", 0)
        if group is not None and (not isinstance(group, int) or group < 0 or not isinstance(plen, int)
                                  or not 1 <= plen <= p):
            raise WorkloadError(f"{where}: prefix_group needs an integer >= 0 and 1 <= prefix_len <= prompt_len")
        prio = body.get("priority", "normal")
        try:
            Priority.parse(prio)
        except ValueError as exc:
            raise WorkloadError(f"{where}: priority: {exc}") from None
        slo = body.get("ttft_slo_ms")
        rid = body.get("rid", n - 1)  # its prompt is made from its id (SimRequest.token_ids)
        if isinstance(rid, bool) or not isinstance(rid, int) or rid < 0 or rid in seen:
            raise WorkloadError(f"{where}: rid must be an integer >= 0 that no other line has (got {rid!r})")
        seen.add(rid)
        out.append(SimRequest(rid, float(t), p, o, group, plen if group is not None else 0, prio, slo))
    out.sort(key=lambda r: (r.t, r.rid))
    return out
