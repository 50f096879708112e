"""GET /metrics speaks Prometheus text and follows the engine."""

from __future__ import annotations

from typing import Any

import httpx


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_exposition(base_url: str, model_name: str, engine_client: Any) -> None:
    httpx.post(base_url + "/v1/completions", json={"model": model_name, "prompt": "Once upon",
                                                   "max_tokens": 4, "temperature": 0})
    r = httpx.get(base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("localpaged_requests_running", "localpaged_requests_waiting",
                 "localpaged_kv_blocks_used", "localpaged_kv_blocks_total",
                 "localpaged_prefix_cache_hit_rate", "localpaged_prompt_tokens_total",
                 "localpaged_generation_tokens_total"):
        assert f"# TYPE {name} " in text
    assert "# TYPE localpaged_time_to_first_token_seconds histogram" in text
    assert "# TYPE localpaged_inter_token_latency_seconds histogram" in text
    s = _samples(text)
    label = f'{{model="{model_name}"}}'
    stats = engine_client.stats()
    assert s["localpaged_kv_blocks_total" + label] == stats.kv_blocks_total
    assert s["localpaged_generation_tokens_total" + label] >= 4
    assert s["localpaged_time_to_first_token_seconds_count" + label] >= 1
    assert s[f'localpaged_time_to_first_token_seconds_bucket{{model="{model_name}",le="+Inf"}}'] \
        == s["localpaged_time_to_first_token_seconds_count" + label]
    assert 0.0 <= s["localpaged_prefix_cache_hit_rate" + label] <= 1.0
    # The engine's inter-token latencies: 4 tokens of that request make 3 gaps at least.
    itl = "localpaged_inter_token_latency_seconds"
    assert s[f"{itl}_count" + label] >= 3
    assert s[f'{itl}_bucket{{model="{model_name}",le="+Inf"}}'] == s[f"{itl}_count" + label]
    assert 0 < s["localpaged_inter_token_latency_p50_seconds" + label] \
        <= s["localpaged_inter_token_latency_p99_seconds" + label]
