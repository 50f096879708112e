"""Inter-token latency: the time between two tokens of one request, as the engine makes them.

A cumulative histogram (exported in /metrics as vLLM exports `inter_token_latency_seconds`)
and the most recent gaps, whose p50 / p99 the engine screen shows.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

# Seconds; a step of a small model on a GPU is a few ms, a stall behind a long prompt seconds.
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0)
RECENT = 1024


def percentile(values: tuple[float, ...] | list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class LatencySummary:
    """A snapshot: per-bucket counts (the last one past the largest bound), the sum and count
    of all gaps, and the most recent gaps."""

    buckets: tuple[float, ...] = ITL_BUCKETS
    counts: tuple[int, ...] = (0,) * (len(ITL_BUCKETS) + 1)
    total: float = 0.0
    count: int = 0
    recent: tuple[float, ...] = ()

    @property
    def p50(self) -> float:
        return percentile(self.recent, 50)

    @property
    def p99(self) -> float:
        return percentile(self.recent, 99)


class InterTokenLatency:
    """Records, per request, the gap since its previous token."""

    def __init__(self, buckets: tuple[float, ...] = ITL_BUCKETS, recent: int = RECENT) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0
        self.recent: deque[float] = deque(maxlen=recent)
        self._last: dict[str, float] = {}

    def token(self, request_id: str, now: float) -> None:
        """A token of `request_id` came out at `now` (seconds); its first one only starts."""
        last = self._last.get(request_id)
        self._last[request_id] = now
        if last is None:
            return
        gap = now - last
        self.counts[bisect.bisect_left(self.buckets, gap)] += 1
        self.total += gap
        self.count += 1
        self.recent.append(gap)

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def summary(self) -> LatencySummary:
        return LatencySummary(self.buckets, tuple(self.counts), self.total, self.count,
                              tuple(self.recent))
