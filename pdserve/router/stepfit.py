"""`StepCurveFit`: the step cost curve, fitted over this worker's engine steps.

step ms = fixed + per_seq x decoding streams + per_token x prompt tokens +
per_kpair x attention pairs / 1000, by exponentially weighted ridge least
squares (a small Gaussian elimination, no numpy). The ``CostModel``
(router/costs.py) refits it on every step it is fed, or calibrates it at boot,
and adopts its coefficients. Also ``check_sample``: the check every timing fed
to the cost model passes.
"""

from __future__ import annotations

import math


class StepCurveFit:
    """Fits step ms = fixed + per_seq x decoding streams + per_token x prompt tokens
    + per_kpair x attention pairs / 1000 (engine/step_budget.py ``StepCost``).

    Exponentially weighted least squares over recent steps (each older step's weight decays
    by ``DECAY``), pulled toward the current coefficients with weight ``RIDGE``: a direction
    recent steps do not exercise (no prompt token for a while, or always the same batch)
    keeps its value instead of drifting. Features are scaled (per 8 streams, per 256 tokens,
    per 10^5 pairs) so that the pull weighs them alike. Coefficients are kept physical (>= 0;
    a per-token cost > 0).
    """

    DECAY = 0.98  # a step's weight halves over ~35 steps
    RIDGE = 0.5  # about half a step's worth of pull toward the current coefficients
    _SCALE = (1.0, 8.0, 256.0, 100.0)  # theta units -> per scaled feature (pairs: per kpair -> per 1e5)
    _N = 4
    _MIN_PER_TOKEN = 1e-4

    def __init__(self, theta: tuple[float, ...]):
        self._theta = [v * k for v, k in zip(theta, self._SCALE)]
        self._a = [[0.0] * self._N for _ in range(self._N)]
        self._b = [0.0] * self._N
        self.samples = 0

    @classmethod
    def fitted(cls, steps, prior: tuple[float, ...]) -> StepCurveFit:
        """A fit of ``steps`` ((ms, decodes, prompt tokens, pairs)) alone, as a calibration:
        the prior only breaks the ties the steps cannot."""
        fit = cls(prior)
        for ms, d, p, pairs in steps:
            check_sample(ms=ms, tokens=d)
            fit._add(ms, d, p, pairs, decay=1.0)
        fit._solve(ridge=1e-3)
        return fit

    def theta(self) -> tuple[float, float, float, float]:
        return tuple(v / k for v, k in zip(self._theta, self._SCALE))  # type: ignore[return-value]

    def observe(self, ms: float, decodes: int, prefill_tokens: int, pairs: int) -> tuple[float, ...]:
        self._add(ms, decodes, prefill_tokens, pairs, decay=self.DECAY)
        self._solve(ridge=self.RIDGE)
        return self.theta()

    def _add(self, ms: float, d: int, p: int, pairs: int, decay: float) -> None:
        x = (1.0, d / 8.0, p / 256.0, pairs / 1e5)
        for i in range(self._N):
            self._b[i] = self._b[i] * decay + x[i] * ms
            row = self._a[i]
            for j in range(self._N):
                row[j] = row[j] * decay + x[i] * x[j]
        self.samples += 1

    def _solve(self, ridge: float) -> None:
        m = [row[:] + [self._b[i] + ridge * self._theta[i]] for i, row in enumerate(self._a)]
        for i in range(self._N):
            m[i][i] += ridge
        sol = _solve_linear(m)
        if sol is None:
            return
        floor = (0.0, 0.0, self._MIN_PER_TOKEN * self._SCALE[2], 0.0)
        self._theta = [max(v, f) for v, f in zip(sol, floor)]


def _solve_linear(m: list[list[float]]) -> list[float] | None:
    """Solve a small system given as an augmented matrix (Gaussian elimination, partial pivoting)."""
    n = len(m)
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-12:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def check_sample(ms: float, tokens: int) -> None:
    """A timing must be a finite number of ms >= 0 and a count >= 0 (ValueError otherwise)."""
    if not (isinstance(ms, (int, float)) and math.isfinite(ms) and ms >= 0):
        raise ValueError(f"a timing must be a finite number of ms >= 0 (got {ms!r})")
    if tokens < 0:
        raise ValueError(f"a count must be >= 0 (got {tokens})")
