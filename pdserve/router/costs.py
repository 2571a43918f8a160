"""Calibrated per-token costs: the router's only state.

The decode worker owns one ``CostModel``, feeds it the timings it measured
(prefill local or remote, KV transfers, decode steps) and passes
``snapshot()`` into every ``decide``/``admit`` call inside a
``ClusterSnapshot``. The model never reads a clock; it is fed numbers.
The step cost curve it refits on every engine step, ``StepCurveFit``, is in
router/stepfit.py.

Every estimate starts at its seed from the policy's ``cost_model`` block and
moves as an exponential moving average: ``new = old + alpha * (sample - old)``,
each sample after the first three clipped to ``[old / f, old * f]``
(``ema_outlier_factor``), so one pathological request cannot poison it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from pdserve.router.policy import CostModelParams
from pdserve.router.stepfit import StepCurveFit, check_sample

BYTES_PER_MS_PER_GB_PER_S = 1e6  # 1 GB/s = 10^9 B / 10^3 ms


@dataclass(frozen=True, slots=True)
class CostEstimates:
    """Per-token and per-transfer costs at one instant (immutable)."""

    prefill_local_ms_per_token: float
    prefill_remote_ms_per_token: float
    decode_ms_per_token: float  # decode step time / tokens the step emitted (batch size, unspeculated)
    # The TPOT running requests see: one decode step's wall time, over the tokens each stream
    # got from it when the worker speculates (observe_decode_step)
    decode_step_ms: float
    transfer_bytes_per_ms: float
    transfer_setup_ms: float
    kv_bytes_per_token: int  # property of the model, not learned
    # The step cost curve: step ms = step_fixed_ms + step_decode_ms_per_seq x decoding streams
    # + prefill_local_ms_per_token x prompt tokens (fitted over whole steps, ``StepCurveFit``).
    step_fixed_ms: float = 0.0
    step_decode_ms_per_seq: float = 0.0
    # attention: ms per 1000 (prompt token, earlier position) pairs; a prompt of n tokens from
    # position s has n x s + n(n+1)/2 of them (its later chunks cost more)
    prefill_attention_ms_per_kpair: float = 0.0
    # Learned per-route residual: measured TTFT - the formula's prediction (queue hops,
    # notifications, the first decode step), so predictions hold (``observe_ttft``).
    ttft_residual_local_ms: float = 0.0
    ttft_residual_remote_ms: float = 0.0
    # Loading one token's KV back from this worker's second tier (engine/kv_tier.py; measured by
    # the tier, 0 until its first load: loading is then taken as free beside computing).
    tier_load_ms_per_token: float = 0.0
    # How fast this worker's local prompt backlog drains under its current load: wall ms per
    # prompt token over recent steps that had a backlog (steps, the gaps between them, the
    # streams decoding beside), measured (``CostModel.observe_drain``); 0 until measured.
    local_drain_ms_per_token: float = 0.0
    # Loading a LoRA adapter on a prefill worker that does not hold it: the policy's seed
    # (cost_model.lora_load_ms), then measured (``CostModel.observe_lora_load``).
    lora_load_ms: float = 0.0

    @classmethod
    def seed(cls, params: CostModelParams, kv_bytes_per_token: int) -> CostEstimates:
        """The estimates before any measurement: the policy's seeds."""
        return cls(
            prefill_local_ms_per_token=params.prefill_local_ms_per_token,
            prefill_remote_ms_per_token=params.prefill_remote_ms_per_token,
            decode_ms_per_token=params.decode_ms_per_token,
            decode_step_ms=params.decode_step_ms,
            transfer_bytes_per_ms=params.transfer_bandwidth_gb_per_s * BYTES_PER_MS_PER_GB_PER_S,
            transfer_setup_ms=params.transfer_setup_ms,
            kv_bytes_per_token=kv_bytes_per_token,
            step_fixed_ms=params.step_fixed_ms,
            step_decode_ms_per_seq=params.step_decode_ms_per_seq,
            prefill_attention_ms_per_kpair=params.prefill_attention_ms_per_kpair,
            lora_load_ms=params.lora_load_ms,
        )

    def step_ms(self, decodes: int, prefill_tokens: int, pairs: int = 0) -> float:
        """Predicted time of one step running ``decodes`` streams and ``prefill_tokens`` prompt
        tokens with ``pairs`` attention pairs."""
        return (self.step_fixed_ms + self.step_decode_ms_per_seq * decodes
                + self.prefill_local_ms_per_token * prefill_tokens + self.prefill_attention_ms_per_kpair * pairs / 1e3)

    def step_left_ms(self, step: "tuple[float, int, int, int] | None", now_s: float) -> float:
        """What is left of the engine step under way, predicted: ``step`` is (its start in
        seconds on the clock of ``now_s``, decoding streams, prompt tokens, attention pairs),
        None when the engine is not stepping. A request admitted now waits for it."""
        if step is None:
            return 0.0
        started, decodes, prompt, pairs = step
        return max(0.0, self.step_ms(decodes, prompt, pairs) - (now_s - started) * 1e3)

    def prefill_compute_ms(self, tokens: int, start: int = 0, where: str = "local") -> float:
        """The prompt-token part of prefilling ``tokens`` positions from ``start`` (no step base).
        Remote: the local curve scaled by remote / local per-token cost (the prefill workers'
        measured speed relative to this worker's)."""
        pairs = tokens * start + tokens * (tokens + 1) // 2
        local = self.prefill_local_ms_per_token * tokens + self.prefill_attention_ms_per_kpair * pairs / 1e3
        return local if where == "local" else local * self.remote_ratio

    @property
    def remote_ratio(self) -> float:
        """How much slower (> 1) or faster a prefill worker computes a prompt than this worker."""
        return self.prefill_remote_ms_per_token / self.prefill_local_ms_per_token

    def transfer_ms(self, tokens: int) -> float:
        """Predicted time to move the KV of ``tokens`` positions, setup included."""
        return self.transfer_setup_ms + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_ms

    def borrow_cheaper(self, tokens: int, start: int) -> tuple[bool, float, float]:
        """Whether reading ``tokens`` positions of a prefix from another worker (from position
        ``start``, what this pool holds) is predicted cheaper than computing them here:
        (cheaper, read ms, compute ms). Both workers' borrow decisions (decode/borrow.py,
        prefill/worker.py) go through here."""
        read_ms, compute_ms = self.transfer_ms(tokens), self.prefill_compute_ms(tokens, start)
        return read_ms < compute_ms, read_ms, compute_ms


class CostModel:
    """Owns the cost EMAs of one decode worker.

    Transfer time is modelled as ``setup + bytes / bandwidth``. One sample
    cannot separate the two, so they are fitted by exponentially weighted
    least squares over recent transfers (each new sample weighs ``alpha``).
    While the recent transfer sizes are too alike to tell setup from
    bandwidth, setup keeps its current value and the sample updates the
    bandwidth EMA alone.
    """

    # Transfer sizes must spread by this much (coefficient of variation)
    # before setup and bandwidth are fitted separately.
    _MIN_SIZE_SPREAD = 0.05

    def __init__(self, params: CostModelParams, kv_bytes_per_token: int):
        if kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be > 0 (got {kv_bytes_per_token})")
        self._alpha = params.ema_alpha
        self._outlier = params.ema_outlier_factor
        self._est = CostEstimates.seed(params, kv_bytes_per_token)
        self._samples = {name: 0 for name in _ESTIMATE_NAMES}
        self._curve = StepCurveFit((params.step_fixed_ms, params.step_decode_ms_per_seq,
                                    params.prefill_local_ms_per_token, params.prefill_attention_ms_per_kpair))
        # remote / local compute time of the same prompt, once calibrated or measured (None:
        # the remote per-token cost is the policy's seed, on its own)
        self._remote_ratio: float | None = None
        # Exponentially weighted sums of (bytes, ms) for the transfer fit.
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._stale_after = params.residual_stale_after
        # TTFT samples of the other route since each route's own last one (observe_ttft)
        self._unseen = {"local": 0, "remote": 0}
        # The local backlog's drain: decayed sums of wall ms and prompt tokens of backlog steps,
        # the end of the last step (seconds) and whether it had a backlog.
        self._drain_ms = self._drain_tokens = 0.0
        self._drain_end: float | None = None
        self._drain_busy = False

    # --- observations ---------------------------------------------------------

    def observe_prefill(self, tokens: int, ms: float, where: Literal["local", "remote"]) -> None:
        """A prefill of ``tokens`` uncached positions took ``ms`` (compute only)."""
        check_sample(ms=ms, tokens=tokens)
        if tokens == 0:
            return  # nothing computed: no information about the per-token cost
        if where == "local":
            self._update("prefill_local_ms_per_token", ms / tokens)
        elif where == "remote":
            self._update("prefill_remote_ms_per_token", ms / tokens)
        else:
            raise ValueError(f"where must be 'local' or 'remote' (got {where!r})")

    def observe_remote_prefill(self, tokens: int, start: int, ms: float) -> None:
        """A prefill worker computed one prompt's ``tokens`` positions from ``start`` alone in
        ``ms`` (its step included): its speed relative to this worker's step curve, as the
        ratio the remote route's prediction scales the local curve by."""
        check_sample(ms=ms, tokens=tokens)
        if tokens == 0:
            return
        est = self._est
        local = est.step_fixed_ms + est.prefill_compute_ms(tokens, start)
        if local <= 0:
            return
        sample = ms / local
        old = self._remote_ratio if self._remote_ratio is not None else est.remote_ratio
        if self._samples["prefill_remote_ms_per_token"] >= _FREE_SAMPLES:
            sample = min(max(sample, old / self._outlier), old * self._outlier)
        self._remote_ratio = old + self._alpha * (sample - old)
        self._set("prefill_remote_ms_per_token", est.prefill_local_ms_per_token * self._remote_ratio)

    def observe_step(self, ms: float, decodes: int, prefill_tokens: int, pairs: int = 0) -> None:
        """One engine step of this worker: ``decodes`` streams and ``prefill_tokens`` prompt
        tokens took ``ms``. Refits the step cost curve (its slope is the local per-token
        prefill cost the router and the step budget use)."""
        check_sample(ms=ms, tokens=decodes)
        check_sample(ms=ms, tokens=prefill_tokens)
        if decodes == 0 and prefill_tokens == 0:
            return
        est = self._est
        if self._curve.samples >= _FREE_SAMPLES:  # one stalled step (GC, a page fault) moves it little
            pred = est.step_ms(decodes, prefill_tokens, pairs)
            if pred > 0:
                ms = min(max(ms, pred / self._outlier), pred * self._outlier)
        self._adopt_curve(self._curve.observe(ms, decodes, prefill_tokens, pairs))

    def observe_drain(self, end_s: float, step_ms: float, prompt_tokens: int, backlog_tokens: int) -> None:
        """One engine step ended at ``end_s`` (seconds, any monotonic origin) after ``step_ms``,
        with ``prompt_tokens`` prompt tokens; ``backlog_tokens`` local prompt tokens still wait.

        A step with prompt tokens or a backlog is a drain step: it adds its wall time to the drain
        sums (from the previous step's end when that one was a drain step too, so the gaps in
        which the worker streams and admits count; else its own time, the engine having maybe
        idled before it) and its prompt tokens. The sums decay over ``DRAIN_WINDOW_STEPS``, so
        the rate follows the load. Published once ``DRAIN_MIN_TOKENS`` tokens were seen."""
        check_sample(ms=step_ms, tokens=prompt_tokens)
        busy = prompt_tokens > 0 or backlog_tokens > 0
        wall = step_ms
        if busy and self._drain_busy and self._drain_end is not None:
            wall = max(step_ms, (end_s - self._drain_end) * 1e3)
        self._drain_end, self._drain_busy = end_s, busy
        if not busy:
            return
        decay = 1.0 - 1.0 / DRAIN_WINDOW_STEPS
        self._drain_ms = self._drain_ms * decay + wall
        self._drain_tokens = self._drain_tokens * decay + prompt_tokens
        if self._drain_tokens >= DRAIN_MIN_TOKENS:
            per_token = self._drain_ms / self._drain_tokens
            floor = self._est.prefill_local_ms_per_token  # never faster than computing the tokens
            self._est = replace(self._est, local_drain_ms_per_token=max(per_token, floor))

    def calibrate(self, steps: list[tuple[float, int, int, int]]) -> None:
        """Replace the seeded step curve with a fit of ``steps`` ((ms, decodes, prompt tokens,
        attention pairs) measured at boot): the first minute is then decided on this machine's
        figures, not on the policy's priors. Later steps refine it as usual. A remote per-token
        cost never measured yet is set to the local one (same engine, until a prefill worker
        reports its own)."""
        self._curve = StepCurveFit.fitted(steps, self._curve.theta())
        if self._samples["prefill_remote_ms_per_token"] == 0:
            self._remote_ratio = 1.0
        self._adopt_curve(self._curve.theta())
        decode_only = [ms for ms, d, p, _ in steps if p == 0 and d > 0]
        if decode_only:
            self._set("decode_step_ms", sorted(decode_only)[len(decode_only) // 2])

    def _adopt_curve(self, theta: tuple[float, ...]) -> None:
        fixed, per_seq, per_token, per_kpair = theta
        changes: dict[str, Any] = dict(step_fixed_ms=fixed, step_decode_ms_per_seq=per_seq,
                                       prefill_local_ms_per_token=per_token, prefill_attention_ms_per_kpair=per_kpair)
        if self._remote_ratio is not None:  # remote follows the local curve at its measured ratio
            changes["prefill_remote_ms_per_token"] = per_token * self._remote_ratio
        self._est = replace(self._est, **changes)
        self._samples["prefill_local_ms_per_token"] += 1

    def observe_ttft(self, route: Literal["local", "remote"], measured_ms: float, formula_ms: float) -> None:
        """A request's measured TTFT against what the formula (without residual) predicted for
        its route: the residual EMA absorbs what the formula leaves out. The other route's
        residual, once stale (``residual_stale_after`` samples of this route without one of
        its own), decays toward 0, so a route dropped after a bad run is tried again."""
        check_sample(ms=measured_ms, tokens=0)
        name = f"ttft_residual_{route}_ms"
        old = getattr(self._est, name)
        self._samples[name] += 1
        changes = {name: old + self._alpha * ((measured_ms - formula_ms) - old)}
        other = "remote" if route == "local" else "local"
        self._unseen[route] = 0
        self._unseen[other] += 1
        if self._stale_after and self._unseen[other] > self._stale_after:
            other_name = f"ttft_residual_{other}_ms"
            changes[other_name] = getattr(self._est, other_name) * 0.5 ** (1.0 / self._stale_after)
        self._est = replace(self._est, **changes)

    def residual_unseen(self, route: Literal["local", "remote"]) -> int:
        """TTFT samples of the other route since ``route``'s own last one."""
        return self._unseen[route]

    def observe_decode_step(self, ms: float, batch: int, tokens_per_stream: float = 1.0) -> None:
        """One decode step over ``batch`` running requests took ``ms`` and gave each
        ``tokens_per_stream`` tokens on average (above 1 when it verified speculative proposals,
        common/spec_rule.py): ``decode_step_ms`` is the TPOT the streams see, the step's time
        over the tokens each got, and ``decode_ms_per_token`` the time per token emitted."""
        check_sample(ms=ms, tokens=batch)
        if batch == 0:
            return
        if not tokens_per_stream >= 1.0:  # also NaN: every stream gets one token a step at least
            raise ValueError(f"tokens_per_stream {tokens_per_stream!r} must be >= 1")
        self._update("decode_step_ms", ms / tokens_per_stream)
        self._update("decode_ms_per_token", ms / (batch * tokens_per_stream))

    def observe_lora_load(self, ms: float) -> None:
        """A prefill worker loaded a request's LoRA adapter in ``ms`` (its PrefillDone says so)."""
        check_sample(ms=ms, tokens=1)
        self._update("lora_load_ms", ms)

    def observe_transfer(self, num_bytes: int, ms: float) -> None:
        """A KV transfer of ``num_bytes`` took ``ms`` end to end (setup included)."""
        check_sample(ms=ms, tokens=num_bytes)
        if num_bytes == 0:
            return
        decay = 1.0 - self._alpha
        x, y = float(num_bytes), ms
        self._w = self._w * decay + 1.0
        self._sx = self._sx * decay + x
        self._sy = self._sy * decay + y
        self._sxx = self._sxx * decay + x * x
        self._sxy = self._sxy * decay + x * y
        fitted = self._fit_transfer()
        if fitted is not None:
            setup_ms, bytes_per_ms = fitted
            self._set("transfer_setup_ms", setup_ms)
            self._set("transfer_bytes_per_ms", bytes_per_ms)
            return
        # Sizes too alike: attribute the time beyond setup to bandwidth.
        # The floor keeps a transfer faster than the current setup estimate
        # from producing an absurd bandwidth.
        transfer_ms = max(ms - self._est.transfer_setup_ms, ms * 0.1, 1e-6)
        self._update("transfer_bytes_per_ms", x / transfer_ms)

    def _fit_transfer(self) -> tuple[float, float] | None:
        if self._w < 2.0:
            return None
        mean_x, mean_y = self._sx / self._w, self._sy / self._w
        var_x = self._sxx / self._w - mean_x * mean_x
        if var_x <= (self._MIN_SIZE_SPREAD * mean_x) ** 2:
            return None
        slope = (self._sxy / self._w - mean_x * mean_y) / var_x  # ms per byte
        setup = mean_y - slope * mean_x
        if slope <= 0 or setup < 0:
            return None  # noise made the fit unphysical; fall back to the EMA
        return setup, 1.0 / slope

    # --- reading and reconfiguring ------------------------------------------

    def snapshot(self) -> CostEstimates:
        """The current estimates (an immutable value; safe to share)."""
        return self._est

    def samples(self, name: str) -> int:
        """How many observations have updated estimate ``name`` so far."""
        return self._samples[name]

    def update_params(self, params: CostModelParams) -> None:
        """Adopt a reloaded policy: its alpha, and its seeds for estimates
        that have never been measured (measured values are kept)."""
        self._alpha = params.ema_alpha
        self._outlier = params.ema_outlier_factor
        self._stale_after = params.residual_stale_after
        seeded = CostEstimates.seed(params, self._est.kv_bytes_per_token)
        changes: dict[str, Any] = {  # CostEstimates fields (replace's keywords)
            name: getattr(seeded, name) for name in _ESTIMATE_NAMES if self._samples[name] == 0
        }
        if self._curve.samples == 0:
            changes.update(step_fixed_ms=params.step_fixed_ms, step_decode_ms_per_seq=params.step_decode_ms_per_seq)
            self._curve = StepCurveFit((params.step_fixed_ms, params.step_decode_ms_per_seq,
                                        changes.get("prefill_local_ms_per_token", self._est.prefill_local_ms_per_token),
                                        params.prefill_attention_ms_per_kpair))
            changes["prefill_attention_ms_per_kpair"] = params.prefill_attention_ms_per_kpair
        self._est = replace(self._est, **changes)

    def _update(self, name: str, sample: float) -> None:
        old = getattr(self._est, name)
        if self._samples[name] >= _FREE_SAMPLES and old > 0:  # clip to [old / factor, old * factor]
            sample = min(max(sample, old / self._outlier), old * self._outlier)
        self._set(name, old + self._alpha * (sample - old))

    def _set(self, name: str, value: float) -> None:
        self._samples[name] += 1
        change: dict[str, Any] = {name: value}  # a CostEstimates field (replace's keyword)
        self._est = replace(self._est, **change)


# The local drain rate (observe_drain) averages over about this many recent backlog steps, and
# is published once its sums hold this many prompt tokens.
DRAIN_WINDOW_STEPS = 32
DRAIN_MIN_TOKENS = 256

# The first measurements of an estimate move it freely (a seed may be far off the
# hardware); later ones are clipped by ema_outlier_factor.
_FREE_SAMPLES = 3


class ArrivalRate:
    """Requests per second, exponentially decayed with time constant ``tau_s``.

    Each arrival adds ``1 / tau_s``; the value decays as ``exp(-dt / tau_s)``.
    Under a steady rate r it converges to r; after traffic stops it falls
    to ~37 % of its value within ``tau_s``. Fed explicit times (no clock).
    """

    def __init__(self, tau_s: float = 5.0):
        if not tau_s > 0:
            raise ValueError(f"tau_s must be > 0 (got {tau_s})")
        self.tau_s = tau_s
        self._value = 0.0
        self._at: float | None = None

    def observe(self, now_s: float) -> None:
        """One request arrived at ``now_s`` (seconds, any monotonic origin)."""
        self._value = self.rate(now_s) + 1.0 / self.tau_s
        self._at = now_s

    def rate(self, now_s: float) -> float:
        """The decayed rate at ``now_s`` (requests per second)."""
        if self._at is None:
            return 0.0
        return self._value * math.exp(-max(0.0, now_s - self._at) / self.tau_s)


_ESTIMATE_NAMES = (
    "ttft_residual_local_ms",
    "ttft_residual_remote_ms",
    "prefill_local_ms_per_token",
    "prefill_remote_ms_per_token",
    "decode_ms_per_token",
    "decode_step_ms",
    "transfer_bytes_per_ms",
    "transfer_setup_ms",
    "lora_load_ms",
)

