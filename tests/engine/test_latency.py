"""Inter-token latency bookkeeping: gaps per request, histogram counts, recent percentiles."""

from __future__ import annotations

from localpaged.engine.latency import InterTokenLatency, percentile


def test_gaps_are_per_request_and_the_first_token_makes_none() -> None:
    itl = InterTokenLatency(buckets=(0.01, 0.1, 1.0))
    itl.token("a", 0.0)
    itl.token("b", 0.005)
    itl.token("a", 0.02)  # a: 20 ms
    itl.token("b", 0.505)  # b: 500 ms
    itl.token("a", 2.02)  # a: 2 s, past the last bound
    s = itl.summary()
    assert s.count == 3 and s.total == 0.02 + 0.5 + 2.0
    assert s.counts == (0, 1, 1, 1)
    assert sorted(s.recent) == [0.02, 0.5, 2.0]
    itl.forget("a")
    itl.token("a", 10.0)  # a new request reusing the id starts over
    assert itl.summary().count == 3


def test_percentiles_by_nearest_rank_over_recent_gaps() -> None:
    assert percentile([], 50) == 0.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    itl = InterTokenLatency(recent=4)
    for t in range(10):
        itl.token("a", float(t * t))  # gaps 1, 3, 5, ..., 17
    s = itl.summary()
    assert s.recent == (11.0, 13.0, 15.0, 17.0)  # only the last four
    assert s.p50 == 13.0 and s.p99 == 17.0
