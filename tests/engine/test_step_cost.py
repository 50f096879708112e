"""The step-cost model learns what steps cost from (shape, seconds) pairs alone."""

from __future__ import annotations

import itertools
import random

import pytest

from localpaged.engine.step_cost import StepCostModel, StepShape


def true_cost(s: StepShape) -> float:
    """A machine where decode-only steps take a native path and prefill steps torch's."""
    if s.prefill_tokens == 0:
        return 0.010 + 0.002 * s.decodes + 0.001 * s.decode_context / 1e3
    return (0.030 + 0.001 * s.decodes + 0.0004 * s.prefill_tokens
            + 0.002 * s.prefill_attention / 1e6)


def random_shape(rng: random.Random, prefill: bool) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(0 if prefill else 1, 6)):
        shape = shape.with_decode(rng.randint(10, 3000))
    if prefill:
        shape = shape.with_chunk(rng.randint(0, 3000), rng.randint(1, 512))
    return shape


def trained(rng: random.Random, steps: int = 200, noise: float = 0.0) -> StepCostModel:
    model = StepCostModel()
    for _ in range(steps):
        shape = random_shape(rng, prefill=rng.random() < 0.5)
        model.observe(shape, true_cost(shape) * (1 + rng.uniform(-noise, noise)))
    return model


def test_nothing_is_predicted_before_a_step_of_its_kind() -> None:
    model = StepCostModel()
    assert model.predict(StepShape(decodes=1, decode_context=10)) is None
    assert model.predict(StepShape().with_chunk(0, 16)) is None
    # The first steps of a kind pay one-time costs; they are not learned from.
    model.observe(StepShape().with_chunk(0, 100), 3.0)
    model.observe(StepShape().with_chunk(0, 100), 0.5)
    assert model.predict(StepShape().with_chunk(0, 100)) is None
    model.observe(StepShape().with_chunk(0, 100), 0.07)
    assert model.predict(StepShape().with_chunk(0, 100)) == pytest.approx(0.07, rel=1e-3)
    # No decode-only step yet: a decode step is estimated from the prefill fit.
    assert model.decode_step(StepShape(decodes=1, decode_context=10)) is not None


def test_learns_both_kinds_of_step_from_timings() -> None:
    rng = random.Random(0)
    model = trained(rng, noise=0.05)
    for prefill in (False, True):
        for _ in range(50):
            shape = random_shape(rng, prefill)
            assert model.predict(shape) == pytest.approx(true_cost(shape), rel=0.1)


def split_cost(s: StepShape) -> float:
    """A machine that runs a step's decode rows apart from its prompt chunks (the native
    decode plan): a step with both costs a decode-only step of its rows + its chunks alone."""
    prompt = 0.030 + 0.0004 * s.prefill_tokens + 0.002 * s.prefill_attention / 1e6
    decodes = 0.010 + 0.002 * s.decodes + 0.001 * s.decode_context / 1e3
    return (decodes if s.decodes else 0.0) + (prompt if s.prefill_tokens else 0.0)


def test_learns_steps_whose_decode_rows_run_apart() -> None:
    rng = random.Random(5)
    model = StepCostModel()
    for _ in range(200):
        shape = random_shape(rng, prefill=rng.random() < 0.5)
        model.observe(shape, split_cost(shape) * (1 + rng.uniform(-0.05, 0.05)))
    for _ in range(100):
        shape = random_shape(rng, prefill=True)
        assert model.predict(shape) == pytest.approx(split_cost(shape), rel=0.12)
    # The decode rows' fixed part is paid once, not once a row.
    one, four = (StepShape(decodes=n, decode_context=1000 * n).with_chunk(0, 64) for n in (1, 4))
    extra = model.predict(four) - model.predict(one)  # type: ignore[operator]
    assert extra == pytest.approx(split_cost(four) - split_cost(one), rel=0.3)


def test_decode_step_ignores_the_prefill_part() -> None:
    model = trained(random.Random(1))
    mixed = StepShape(decodes=2, decode_context=500).with_chunk(0, 256)
    assert model.decode_step(mixed) == pytest.approx(true_cost(StepShape(2, 500)), rel=0.02)


def test_follows_a_machine_that_gets_slower() -> None:
    rng = random.Random(2)
    model = trained(rng)
    shape = StepShape(decodes=1, decode_context=100).with_chunk(0, 64)
    for _ in range(150):  # now everything takes 3x as long (another program on the cores)
        s = random_shape(rng, prefill=True)
        model.observe(s, 3 * true_cost(s))
    assert model.predict(shape) == pytest.approx(3 * true_cost(shape), rel=0.1)


def test_one_stalled_step_does_not_teach_that_every_step_is_slow() -> None:
    rng = random.Random(3)
    model = trained(rng)
    shape = StepShape(decodes=1, decode_context=100).with_chunk(0, 64)
    before = model.predict(shape)
    model.observe(shape, 5.0)  # a 5 s hiccup (swap, GC, a compile)
    after = model.predict(shape)
    assert before is not None and after is not None
    assert after < 1.5 * before


def test_a_longer_chunk_never_looks_cheaper() -> None:
    # Noise around a flat cost could fit a negative per-token slope; coefficients stay >= 0.
    rng = random.Random(4)
    model = StepCostModel()
    for _ in range(100):
        tokens = rng.randint(1, 512)
        model.observe(StepShape().with_chunk(0, tokens), 0.05 - 1e-5 * tokens + rng.uniform(0, 1e-3))
    costs = [model.predict(StepShape().with_chunk(100, n)) for n in range(1, 513, 16)]
    assert all(a is not None and b is not None and a <= b for a, b in itertools.pairwise(costs))


def test_a_feature_that_barely_varied_is_not_extrapolated() -> None:
    # One chat streaming: every step one row, its context a token longer each time, timings
    # noisy. Four rows at four times the context must not look like many times the cost.
    for seed in range(10):
        rng = random.Random(seed)
        model = StepCostModel()
        for i in range(60):
            model.observe(StepShape(1, 100 + i), 0.020 * rng.uniform(0.5, 1.5))
        one = model.predict(StepShape(1, 160))
        four = model.predict(StepShape(4, 4 * 160))
        assert one is not None and four is not None
        assert 0.01 < one < 0.03 and four < 2 * one


def test_no_coefficient_is_fitted_below_zero_the_fixed_part_included() -> None:
    """Steps whose cost grows faster than linearly along a feature (long prompts read alone:
    attention) fit a line with a negative fixed part; held at >= 0, a short chunk is never
    predicted to cost less than nothing (which let the step bound hand a streaming chat's step
    a whole 512-token chunk)."""
    from localpaged.engine.step_cost import DecayedLeastSquares

    fit = DecayedLeastSquares(2)
    for t in range(1, 6):
        fit.observe([1.0, float(t)], 2.0 * t - 1.0 + 0.1 * t * t)
    theta = fit.theta()
    assert all(c >= 0 for c in theta)
    assert fit.predict([1.0, 0.0]) >= 0 and fit.predict([1.0, 0.1]) > 0
