"""Small pure parts: status line text, code block extraction, settings validation."""

from __future__ import annotations

import pytest

from localpaged.engine.client import EngineStats
from localpaged.tui.chat_view import last_code_block
from localpaged.tui.session import ChatSettings, TurnStats
from localpaged.tui.status import format_status


def test_format_status() -> None:
    stats = EngineStats("m", "cuda:0", num_waiting=2, kv_blocks_used=5, kv_blocks_total=100,
                        prefix_cache_queries=200, prefix_cache_hits=150)
    turn = TurnStats(ttft_s=0.0421, tokens_per_s=31.25, prompt_tokens=80, cached_tokens=64)
    assert format_status("smollm2:135m", stats, turn) == (
        "smollm2:135m · cuda:0 │ KV 5/100 │ prefix hits 75% │ queued 2 │ reused 64/80 tok"
        " │ TTFT 42 ms │ 31.2 tok/s")
    assert format_status("m", stats, TurnStats()) == "m · cuda:0 │ KV 5/100 │ prefix hits 75% │ queued 2"
    assert format_status("m", None, None) == "m │ not loaded"
    assert format_status("m", stats, turn, loading="pulling m: 40%") == "⏳ pulling m: 40%"


def test_last_code_block() -> None:
    text = "a\n```python\nx = 1\n```\nb\n```sh\necho hi\n```\n"
    assert last_code_block(text) == "echo hi"
    assert last_code_block("```js\nopen(") == "open("  # still streaming
    assert last_code_block("no code") is None


def test_settings_roundtrip_and_validation() -> None:
    s = ChatSettings(temperature=0.2, top_p=0.9, top_k=40, max_tokens=64, seed=1)
    assert ChatSettings.from_dict({**s.to_dict(), "unknown": 1}) == s
    params = s.params()
    assert (params.temperature, params.top_k, params.seed) == (0.2, 40, 1)
    with pytest.raises(ValueError, match="max_tokens"):
        ChatSettings(max_tokens=0).params()
