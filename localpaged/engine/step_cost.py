"""What a step costs, learned from the steps the engine runs. No torch here.

The engine times every step and feeds (shape, seconds) to a `StepCostModel`; the scheduler
asks it what a batch would cost before it picks a prefill chunk (see `StepTimeBound`). Two
fits, because the two kinds of step take different code paths (on the CPU a decode-only step
runs one native call per layer, a step with prefill tokens runs the torch layers for its
chunks, and its decode rows either beside them or, with the native decode plan, apart):

    decode-only step   ~ fixed + per row + per 10k tokens of context read
    step with prefill  ~ fixed + (if it has decode rows) their path's fixed part
                         + per decode row + per prefill token
                         + per prefill token x context it attends to (attention grows with it)

The decode rows' fixed part is what a step of decodes and chunks costs over a step of the
same chunks alone, beyond the rows' own cost: on the CPU with the native decode plan a
decode-only step's fixed part, which a slope per row alone would spread over the rows
(learned from steps of one decode row, it made four rows look four fixed parts dear);
elsewhere about 0.

Each fit is least squares over the recent steps (older ones fade by `FORGET` per step, so a
machine that gets busier is followed), with coefficients kept >= 0 so a chunk never looks
cheaper for being longer. The prefill fit leaves out the decode rows' context: beside a
prompt chunk it costs little, and a feature that only grows step after step would soak up
any drift in the timings (a busier machine) and make every chunk look dearer.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the previous fit per new observation: the last ~50 steps of a kind count.
FORGET = 0.98
# A step slower than this many times its prediction counts as this many times (a GC pause or
# another process on the core must not teach the model that every step is slow).
OUTLIER = 4.0
# Pull of the slopes (not the fixed part) towards 0, in units of the features squared: a
# slope is learned once the steps seen differ along its feature, and until then the cost
# does not depend on it. Without it a feature that barely varied (every chunk one block, a
# context growing a token a step) took any noise in the timings and, extrapolated, made
# other shapes look absurdly cheap or dear (a 32 s target for four decode rows).
RIDGE = 1e-3
# The first steps of each kind are not learned from: they pay one-time costs (lazy set-up,
# first touches of the weights' pages) that would make the next steps look dear for long.
WARMUP = 2


@dataclass(frozen=True)
class StepShape:
    """The work in one step's batch, as the cost model's features see it."""

    decodes: int = 0  # rows adding one token to a request that is generating
    decode_context: int = 0  # tokens those rows attend to, in all
    prefill_tokens: int = 0  # prompt tokens computed in chunks
    prefill_attention: int = 0  # sum over those tokens of the context each attends to

    def with_decode(self, context: int) -> StepShape:
        return StepShape(self.decodes + 1, self.decode_context + context,
                         self.prefill_tokens, self.prefill_attention)

    def with_chunk(self, start: int, tokens: int) -> StepShape:
        """Add a chunk of `tokens` prompt tokens at positions start .. start + tokens - 1."""
        attention = tokens * start + tokens * (tokens + 1) // 2
        return StepShape(self.decodes, self.decode_context, self.prefill_tokens + tokens,
                         self.prefill_attention + attention)


def _decode_features(s: StepShape) -> list[float]:
    return [1.0, float(s.decodes), s.decode_context / 1e4]


def _prefill_features(s: StepShape) -> list[float]:
    return [1.0, float(s.decodes > 0), float(s.decodes), s.prefill_tokens / 1e2,
            s.prefill_attention / 1e6]


class DecayedLeastSquares:
    """y ~ x . theta over exponentially weighted observations, theta >= 0 (the fixed part
    too: fitted below 0 it let the per-token slopes, and so a whole prompt, look cheap)."""

    def __init__(self, num_features: int) -> None:
        self.n = num_features
        self.xtx = [[0.0] * num_features for _ in range(num_features)]
        self.xty = [0.0] * num_features
        self.count = 0
        self._theta: list[float] | None = None

    def observe(self, x: list[float], y: float) -> None:
        for i in range(self.n):
            row = self.xtx[i]
            for j in range(self.n):
                row[j] = FORGET * row[j] + x[i] * x[j]
            self.xty[i] = FORGET * self.xty[i] + x[i] * y
        self.count += 1
        self._theta = None

    def predict(self, x: list[float]) -> float | None:
        """None until something was observed."""
        if not self.count:
            return None
        return sum(a * b for a, b in zip(self.theta(), x))

    def theta(self) -> list[float]:
        if self._theta is None:
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> list[float]:
        # Drop the most negative coefficient and solve again, until none is negative (a
        # small active-set NNLS; five features at most).
        active = list(range(self.n))
        while True:
            sub = _solve_linear([[self.xtx[i][j] + (RIDGE if i == j and i else 0.0)
                                  for j in active] for i in active],
                                [self.xty[i] for i in active])
            theta = [0.0] * self.n
            for i, v in zip(active, sub):
                theta[i] = v
            worst = min(active, key=lambda i: theta[i], default=None)
            if worst is None or theta[worst] >= 0:
                return theta
            active.remove(worst)


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular direction gets 0."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if abs(m[c][c]) < 1e-12:
            continue
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for c in reversed(range(n)):
        if abs(m[c][c]) >= 1e-12:
            x[c] = (m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))) / m[c][c]
    return x


class StepCostModel:
    """Seconds per step, learned online from the engine's measured steps."""

    def __init__(self) -> None:
        self.decode_fit = DecayedLeastSquares(3)
        self.prefill_fit = DecayedLeastSquares(5)
        self.mixed_prefill_seen = 0  # the most prompt tokens measured in a step with decodes
        self._skipped = {"decode": 0, "prefill": 0}

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one measured step."""
        kind = "prefill" if shape.prefill_tokens else "decode"
        if self._skipped[kind] < WARMUP:
            self._skipped[kind] += 1
            return
        if shape.decodes and shape.prefill_tokens:
            self.mixed_prefill_seen = max(self.mixed_prefill_seen, shape.prefill_tokens)
        if shape.prefill_tokens:
            fit, x = self.prefill_fit, _prefill_features(shape)
        else:
            fit, x = self.decode_fit, _decode_features(shape)
        guess = fit.predict(x)
        if guess is not None and fit.count >= 3 and seconds > OUTLIER * guess:
            seconds = OUTLIER * guess
        fit.observe(x, seconds)

    def predict(self, shape: StepShape) -> float | None:
        """Seconds the step would take; None while no step of its kind was seen."""
        if shape.prefill_tokens:
            return self.prefill_fit.predict(_prefill_features(shape))
        return self.decode_step(shape)

    def prefill_base(self, shape: StepShape) -> float | None:
        """Seconds `shape`'s decodes take in a step that reads a prompt, before its first
        prompt token: the prefill path's fixed part (its prompt tokens ignored)."""
        return self.prefill_fit.predict(_prefill_features(StepShape(shape.decodes,
                                                                    shape.decode_context)))

    def decode_step(self, shape: StepShape) -> float | None:
        """Seconds a step of just `shape`'s decodes takes (its prefill tokens ignored)."""
        decodes = StepShape(shape.decodes, shape.decode_context)
        cost = self.decode_fit.predict(_decode_features(decodes))
        if cost is None:  # no decode-only step yet: the same rows in a prefill step
            cost = self.prefill_fit.predict(_prefill_features(decodes))
        return cost
