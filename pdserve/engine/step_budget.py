"""How many prompt tokens one engine step takes: the chunk that serves both SLOs.

A step runs every decoding stream's next token and some prompt tokens. Its time follows the
measured cost curve (``StepCost``)::

    step_ms = fixed_ms + decode_ms x decoding streams + prefill_ms x prompt tokens
              + attention_ms_per_kpair x (prompt token, context token) pairs / 1000

(the last term is attention: a chunk of n prompt tokens from position s attends to
``n x s + n(n+1)/2`` earlier positions, so a long prompt's later chunks cost more).

A long step stalls the running streams; a short one stretches a waiting prompt's prefill
over many steps, each paying ``fixed_ms`` again (on the 2-core CI box the fixed part is about
as much as 40 prompt tokens, so 40-token chunks double a prompt's prefill time). The budget
weighs the two SLOs with what each side can afford (``plan_budget``):

* **Streams keep their TPOT.** TPOT is judged per request as the mean time per output token
  (``(e2e - ttft) / (tokens - 1)``: vLLM's benchmark and its goodput use it), not per gap. A
  stream ``k`` tokens and ``age`` ms past its first token, with ``r`` more to come (its
  ``max_tokens`` left, credited up to ``HORIZON``), ends within the target when its next
  ``r`` steps carry at most ``W = target x (k + r) - age - r x pace`` ms of prompt compute.
  ``pace`` is the streams' recent time per token (steps and the gaps between them, measured
  by the scheduler; at least the bare step): under a steady load the steps to come carry new
  prompts too, so crediting them at the bare step would overdraw (measured: TPOT p50 87 ms
  at 3 req/s when it did). Without a count of future tokens ``r = 1``: ``target + slack -
  base_step``, with ``slack = target x k - age``.

  When ``W`` covers the whole backlog's compute, chunking does not change the stream's TPOT
  (the backlog costs it the same time in big chunks or small ones; big ones just finish the
  prompts sooner), so it sets no limit but the gap bound: a step never lasts more than
  ``MAX_STALL`` x the target (ITL). When every stream absorbs the backlog, the step takes as
  much of it as that bound allows (vLLM takes whole prompts; TTFT is what a small chunk
  costs). Otherwise the stream affords ``W / r`` ms of prompt compute per step. The plan is
  recomputed every step, so a stream whose future steps turn out longer affords less from
  then on.

  A stream that misses its target even if every token it may still generate came from a
  bare step is lost whatever the chunk, and sets no limit. A stream behind its target
  otherwise (``W / r`` less than a step of the target leaves for prompts) with at most
  ``ENDING_TOKENS`` tokens left gets steps of the target while the prompts can meet their
  TTFT target in such steps: it has too few tokens to come to spread a longer step over (a
  3-token answer's TPOT is its two gaps), and the hold lasts at most that many steps
  (holding the step to the ``W`` such a stream could give it at once instead lost more of
  them: 3 of 320 requests against none). Any other stream behind its target sets no limit:
  the streams with slack set the step, and ``MAX_STALL`` bounds its gaps. Holding every
  prompt to steps of the target for any stream behind (``PDSERVE_STEP_PLAN_BEHIND=all``, the
  ablation) stretched a burst of long prompts over many short steps, each paying the step's
  base again, so the backlog drained later for everyone while the stream's TPOT moved by
  little (its ``pace`` is the burst's own long steps): docs/PERFORMANCE.md, "Prompts no
  longer wait for a stream behind its target". Shorter steps still (16-token chunks) had
  starved the waiting prompts into multi-second TTFTs.
* **Waiting prompts keep their TTFT.** For the waiting prompts in service order, with ``L``
  their cumulative remaining prompt tokens and ``D`` the time left to the TTFT target of the
  last of them, the chunk ``n`` must satisfy ``ceil(L / n) x base_step + prefill_ms x L <= D``.
  The largest such need is the chunk the prompts require.
* **The choice.** A step of the target allows ``n_free = (target - base_step) / prefill_ms``
  tokens: the budget is at least that. When the prompts need more it takes what they need,
  up to what the streams afford; beyond that the streams win (a prompt that misses its TTFT
  is one lost request; a step too long for every stream may be many). A prompt that cannot
  make its TTFT target whatever the chunk gets what the streams afford: it is late anyway,
  and draining it sooner lets the prompts queued behind it in sooner. Nobody decoding: there
  is no stream to protect, only arrivals, which wait at most one step, so a step may last
  ``IDLE_WAIT x ttft target`` or what the prompts need, whichever is more.

Targets are ``FRACTION`` of each SLO, for noise. The result is clamped to ``[MIN_TOKENS,
max_tokens]`` so that a prefill always progresses. The scheduler applies it. A step in
which short waiting prompts finish (they get their first token when it ends) is kept to
``Budget.short_step``: a step of the TPOT target, or what the prompts' TTFT targets need
when that is more. The short prompts go first in it (engine/scheduler.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

FRACTION = 0.8  # of each SLO: room for step-to-step noise
MAX_STALL = 4.0  # a step never lasts more than this x the TPOT target (bounds ITL)
# What chose a step's prompt tokens (`Budget.rule`; pdserve_step_plan_steps_total{rule}): nobody
# decoding; a stream behind its target near its end; no stream holds the backlog back; a late
# prompt drained with the streams' slack; a step of the TPOT target; what the prompts' TTFT
# needs, which the streams afford; what the streams afford, less than the prompts need.
RULES = ("idle", "ending_hold", "absorbed", "late_drain", "target_step", "prompts_need", "streams_win")
IDLE_WAIT = 0.25  # nobody decoding: a step lasts at most this x the TTFT target
MIN_TOKENS = 16  # a prefill chunk never goes below this (progress; one block of the default size)
HORIZON = 16  # a stream's future tokens credited, at most (it may stop early: an EOS, a stop string)
ENDING_TOKENS = 8  # a stream behind its target with at most this many tokens left holds prompts to target steps
# The ablation (docs/PERFORMANCE.md): PDSERVE_STEP_PLAN_BEHIND=all, any stream behind its target holds them
HOLD_ALL_BEHIND = os.environ.get("PDSERVE_STEP_PLAN_BEHIND", "") == "all"


@dataclass(frozen=True, slots=True)
class StepCost:
    """The cost curve of one engine step (ms): fixed + per decoding stream + per prompt token."""

    fixed_ms: float
    decode_ms: float
    prefill_ms: float
    attention_ms_per_kpair: float = 0.0

    def step_ms(self, decodes: int, prefill_tokens: int, start: int = 0) -> float:
        return self.fixed_ms + self.decode_ms * decodes + self.compute_ms(prefill_tokens, start)

    def compute_ms(self, tokens: int, start: int = 0) -> float:
        """The prompt-token part of prefilling ``tokens`` positions from ``start`` (no step base)."""
        return self.prefill_ms * tokens + self.attention_ms_per_kpair * attention_pairs(tokens, start) / 1e3

    def prefill_time_ms(self, tokens: int, chunk: int, decodes: int, start: int = 0) -> float:
        """Time to prefill ``tokens`` from ``start`` in chunks of ``chunk`` beside ``decodes`` streams."""
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / max(1, chunk))
        return steps * (self.fixed_ms + self.decode_ms * decodes) + self.compute_ms(tokens, start)

    def tokens_within(self, room_ms: float, start: int) -> int:
        """The most prompt tokens from ``start`` whose compute fits in ``room_ms``."""
        if room_ms <= 0:
            return 0
        a = self.attention_ms_per_kpair / 2e3  # n^2 coefficient (n(n+1)/2 pairs, per 1000)
        b = max(self.prefill_ms, 1e-6) + self.attention_ms_per_kpair * (start + 0.5) / 1e3
        if a <= 0:
            return int(room_ms / b)
        return int((-b + math.sqrt(b * b + 4 * a * room_ms)) / (2 * a))


def attention_pairs(tokens: int, start: int) -> int:
    """(token, earlier position) pairs of ``tokens`` prompt tokens from position ``start``."""
    return tokens * start + tokens * (tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepTargets:
    """The SLOs the step budget serves (ms)."""

    tpot_ms: float
    ttft_ms: float


@dataclass(frozen=True, slots=True)
class Budget:
    tokens: int
    reason: str  # what it was derived from, for logs and `explain`
    # A step of the TPOT target (at least MIN_TOKENS) and what the prompts' TTFT targets need
    # (0: nothing they can meet): a step that gives short prompts their first token keeps the
    # other prompts' chunks within the larger of the two (``short_step``, the scheduler).
    target_tokens: int = MIN_TOKENS
    need: int = 0
    rule: str = ""  # which of RULES chose it (the metric's label)

    def short_step(self) -> int:
        """The prompt tokens of a step that short prompts finish in: a step of the TPOT target,
        or what the waiting prompts' TTFT targets need when that is more; never over ``tokens``."""
        return min(self.tokens, max(self.target_tokens, self.need))


def plan_budget(cost: StepCost, targets: StepTargets, decoding: Sequence[tuple],
                prompts: Sequence[tuple[int, float, int]], max_tokens: int,
                period_ms: float | None = None) -> Budget:
    """The prompt tokens of the next step (module docstring).

    ``decoding``: per decoding stream, (tokens since its first token, seconds since its first
    token[, tokens it may still generate]); without the third, no credit is taken for its
    future tokens. ``prompts``: per waiting or prefilling request in service order, (prompt
    tokens left, seconds since it arrived, position its prefill has reached). ``period_ms``:
    the streams' recent time per token (steps and the gaps between them, measured); their
    future tokens are credited at that pace, or at the bare step if it is shorter.
    """
    tpot = targets.tpot_ms * FRACTION
    ttft = targets.ttft_ms * FRACTION
    d = len(decoding)
    base = cost.fixed_ms + cost.decode_ms * d
    start = prompts[0][2] if prompts else 0  # the chunk goes to the first prompt first
    need, need_why, late = _prompts_need(cost, base, ttft, prompts)
    free = cost.tokens_within(tpot - base, start)
    budget = _budget(free, need, max_tokens)
    if d == 0:
        idle = cost.tokens_within(IDLE_WAIT * ttft - base, start)
        tokens, why = (need, need_why) if need > idle else (
            idle, f"nobody decoding: a step of <= {IDLE_WAIT:g} x TTFT target {ttft:.0f} ms = {idle} tokens")
        return budget(tokens, why, "idle")
    backlog_ms = sum(cost.compute_ms(left, at) for left, _, at in prompts)
    pace = max(base, period_ms or 0.0)
    affords = [_affordable_ms(s, tpot, base, backlog_ms, pace) for s in decoding]
    behind = [a for a in affords if a < tpot - base]
    ending = [a for s, a in zip(decoding, affords)
              if a < tpot - base and (HOLD_ALL_BEHIND or (len(s) > 2 and s[2] <= ENDING_TOKENS))]
    if ending and not late and need <= free:  # it cannot spread a long step over tokens to come
        near = "" if HOLD_ALL_BEHIND else f" with <= {ENDING_TOKENS} tokens left"
        return budget(free, f"{len(ending)} stream(s) behind their TPOT target{near}: steps of the target "
                      f"{tpot:.0f} ms = {free} prompt tokens", "ending_hold")
    # Any other stream behind its target does not hold the prompts back (module docstring); the
    # others give what they afford.
    afford = min((a for a in affords if a >= tpot - base), default=math.inf)
    room = min(afford, MAX_STALL * tpot - base)
    most = cost.tokens_within(room, start)
    if math.isinf(afford):  # chunking cannot change the streams' TPOT: finish the prompts soonest
        why = f", or is behind it ({len(behind)})" if behind else ""
        return budget(most, f"no stream holds the backlog ({backlog_ms:.0f} ms of prompt compute) back: each "
                      f"absorbs it within its TPOT target or misses the target whatever the chunk{why}: steps of "
                      f"<= {base + room:.0f} ms = {most} tokens", "absorbed")
    spare = f"the streams afford {afford:.0f} ms a step"
    if late and most > max(need, free):  # draining it sooner lets the prompts behind it in sooner
        return budget(most, f"{late}: {spare}; drained in steps of <= {base + room:.0f} ms = {most} tokens",
                      "late_drain")
    if need <= free:
        return budget(free, f"TPOT target {tpot:.0f} ms - step base {base:.1f} ms ({d} streams) "
                      f"= {free} prompt tokens", "target_step")
    if need <= most:
        return budget(need, f"{need_why}; {spare}: it fits", "prompts_need")
    return budget(most, f"{need_why}, but {spare}, {most} tokens (a step <= {base + room:.0f} ms): "
                  "the streams win", "streams_win")


def _affordable_ms(stream: tuple, tpot: float, base: float, backlog_ms: float, pace: float) -> float:
    """Prompt compute (ms) one stream lets the next step carry and still end within its TPOT
    target (inf: the whole backlog fits what it can absorb).

    Over its next ``r`` tokens (its remaining tokens, at most ``HORIZON``; 1 without a count)
    the stream's mean TPOT stays within the target when those steps' prompt compute is at most
    ``W = tpot x (k + r) - age - r x pace``, the tokens after the backlog taken at ``pace``
    (the recent time per token, at least the bare step: under a steady load the steps to come
    carry new prompts too).
    If ``W`` covers the whole backlog, how it is chunked does not change the stream's TPOT
    (only its gaps, which ``MAX_STALL`` bounds); else the stream can give ``W / r`` per step.
    A stream that misses its target even if all the tokens it may still generate came from
    bare steps is lost whatever the chunk: it sets no limit either (starving the prompts for
    it would lose them too)."""
    k, age = stream[0], stream[1]
    left = stream[2] if len(stream) > 2 else None
    if left is not None and tpot * (k + max(1, left)) - age * 1e3 - max(1, left) * base < 0:
        return math.inf  # it misses its target even if every step it has left is a bare one: no limit
    r = max(1, min(left, HORIZON)) if left is not None else 1
    w = tpot * (k + r) - age * 1e3 - r * (pace if left is not None else base)
    if w >= backlog_ms and w > 0:
        return math.inf
    return w / r


def _prompts_need(cost: StepCost, base: float, ttft: float,
                  prompts: Sequence[tuple[int, float, int]]) -> tuple[int, str, str]:
    """The chunk the waiting prompts need to meet their TTFT target (0: none they can meet),
    why, and (non-empty) which prompt cannot make its target whatever the chunk."""
    need, why, late, cum, compute = 0, "", "", 0, 0.0
    for left, age, start in prompts:
        cum += left
        compute += cost.compute_ms(left, start)
        room = ttft - age * 1e3 - compute
        steps = int(room // base) if base > 0 else cum
        if steps < 1:  # cannot make it whatever the chunk
            late = late or f"{cum} prompt tokens cannot make their TTFT target whatever the chunk"
            continue
        n = -(-cum // steps)
        if n > need:
            need = n
            why = (f"{cum} prompt tokens due within {ttft - age * 1e3:.0f} ms need chunks of {n} "
                   f"({steps} steps of {base:.1f} ms + {compute:.0f} ms of prompt compute)")
    return need, why, late


def _budget(free: int, need: int, max_tokens: int):
    """``budget(tokens, why, rule)``: the clamped Budget carrying this plan's target-step tokens and need."""
    target = min(max(free, MIN_TOKENS), max_tokens)

    def make(tokens: int, why: str, rule: str) -> Budget:
        b = _clamp(tokens, why, max_tokens)
        return Budget(b.tokens, b.reason, target, min(need, max_tokens), rule)
    return make


def _clamp(tokens: int, why: str, max_tokens: int) -> Budget:
    if tokens < MIN_TOKENS:
        return Budget(MIN_TOKENS, f"{why}; raised to the minimum chunk {MIN_TOKENS}")
    if tokens > max_tokens:
        return Budget(max_tokens, f"{why}; capped at max_num_batched_tokens {max_tokens}")
    return Budget(tokens, why)
