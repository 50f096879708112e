"""GET /metrics: Prometheus text exposition from EngineStats (with the engine's inter-token
latency histogram, every request's, chat tabs' too) plus the server's own counters and its
time-to-first-token histogram."""

from __future__ import annotations

import bisect
import threading

from localpaged.engine.client import EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """A cumulative-bucket histogram, safe to observe from any thread."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def render(self, name: str, help_text: str, labels: str) -> list[str]:
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        return render_histogram(name, help_text, labels, self.buckets, counts, total, n)


def render_histogram(name: str, help_text: str, labels: str, buckets: tuple[float, ...],
                     counts: list[int] | tuple[int, ...], total: float, n: int) -> list[str]:
    """Prometheus lines of a histogram given per-bucket (not cumulative) counts."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    cumulative = 0
    for bound, c in zip(buckets, counts, strict=False):
        cumulative += c
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {n}')
    lines.append(f"{name}_sum{{{labels}}} {total}")
    lines.append(f"{name}_count{{{labels}}} {n}")
    return lines


class ServerMetrics:
    """Counters the HTTP layer keeps itself."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.requests_total: dict[tuple[str, str], int] = {}
        self.rejected_total = 0  # 429s from the queue cap
        self.in_flight = 0
        self._lock = threading.Lock()

    def count_request(self, api: str, finish_reason: str) -> None:
        with self._lock:
            key = (api, finish_reason)
            self.requests_total[key] = self.requests_total.get(key, 0) + 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(stats: EngineStats, server: ServerMetrics) -> str:
    """The Prometheus text format (version 0.0.4) of one engine snapshot and the server counters."""
    labels = f'model="{_escape(stats.model)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                      f"{name}{{{labels}}} {value}"])

    metric("localpaged_requests_running", "gauge", "Requests in the running batch.",
           stats.num_running)
    metric("localpaged_requests_waiting", "gauge", "Requests waiting to be scheduled.",
           stats.num_waiting)
    metric("localpaged_http_requests_in_flight", "gauge",
           "Generation requests the HTTP server is serving now.", server.in_flight)
    metric("localpaged_kv_blocks_used", "gauge", "KV cache blocks in use.", stats.kv_blocks_used)
    metric("localpaged_kv_blocks_total", "gauge", "KV cache blocks in the pool.",
           stats.kv_blocks_total)
    usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    metric("localpaged_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.", usage)
    metric("localpaged_kv_block_size", "gauge", "Tokens per KV block.", stats.block_size)
    metric("localpaged_prefix_cache_hit_rate", "gauge",
           "Prompt tokens found in the prefix cache / prompt tokens looked up.",
           stats.prefix_cache_hit_rate)
    metric("localpaged_prefix_cache_queries_total", "counter",
           "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries)
    metric("localpaged_prefix_cache_hits_total", "counter",
           "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
    metric("localpaged_prompt_tokens_total", "counter", "Prompt tokens computed (not cached).",
           stats.prompt_tokens_total)
    metric("localpaged_generation_tokens_total", "counter", "Tokens generated.",
           stats.generation_tokens_total)
    metric("localpaged_preemptions_total", "counter", "Requests preempted for lack of KV blocks.",
           stats.num_preemptions)
    metric("localpaged_engine_steps_total", "counter", "Engine steps run.", stats.steps)
    metric("localpaged_max_model_len", "gauge", "Context length cap in tokens.",
           stats.max_model_len)
    metric("localpaged_http_rejected_total", "counter",
           "Requests refused with 429 because the queue was full.", server.rejected_total)
    name = "localpaged_http_requests_total"
    lines += [f"# HELP {name} Generation requests served, by API and finish reason.",
              f"# TYPE {name} counter"]
    for (api, reason), n in sorted(server.requests_total.items()):
        lines.append(f'{name}{{{labels},api="{api}",finish_reason="{reason}"}} {n}')
    lines += server.ttft.render("localpaged_time_to_first_token_seconds",
                                "Time from request arrival to the first token.", labels)
    itl = stats.inter_token_latency
    lines += render_histogram("localpaged_inter_token_latency_seconds",
                              "Time between two tokens of one request, as the engine made them.",
                              labels, itl.buckets, itl.counts, itl.total, itl.count)
    metric("localpaged_inter_token_latency_p50_seconds", "gauge",
           "Median inter-token latency over the engine's recent tokens.", itl.p50)
    metric("localpaged_inter_token_latency_p99_seconds", "gauge",
           "99th percentile inter-token latency over the engine's recent tokens.", itl.p99)
    return "\n".join(lines) + "\n"
