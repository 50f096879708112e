"""A streaming chat on the real SmolLM2 GGUF (4-bit, the native CPU decode plan) while another
chat's prompt is read in small chunks beside its tokens: its greedy tokens and their
log-probabilities are exactly those it gets alone (its rows take the same native path in a
step with prompt chunks as in a step of decodes only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.engine.engine import LLMEngine, step_shape
from localpaged.kernels import native

pytestmark = [pytest.mark.smollm,
              pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here")]

A_PROMPT = torch.randint(100, 40000, (20,), generator=torch.Generator().manual_seed(0)).tolist()
B_PROMPT = torch.randint(100, 40000, (200,), generator=torch.Generator().manual_seed(1)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)


def count_mixed_steps(engine: LLMEngine) -> list[int]:
    """A counter, filled as the engine runs, of its steps with both decodes and prompt tokens."""
    count = [0]
    execute = engine.runner.execute

    def counted(out: Any, kv: Any) -> Any:
        shape = step_shape(out)
        count[0] += bool(shape.decodes and shape.prefill_tokens)
        return execute(out, kv)

    engine.runner.execute = counted  # type: ignore[method-assign]
    return count


def stream_a(engine: LLMEngine, b_at: int | None) -> tuple[list[int], list[float]]:
    """A's greedy tokens and their logprobs; B's prompt is sent at A's token `b_at`."""
    a = engine.add_request(A_PROMPT, GREEDY)
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished_requests():
        if len(tokens) == b_at:
            engine.add_request(B_PROMPT, SamplingParams(temperature=0, max_tokens=1))
            b_at = None
        for out in engine.step():
            if out.request_id == a.request_id:
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.logprobs]
    return tokens, logprobs


def test_a_streaming_chat_gets_its_own_tokens_beside_a_prompt(smollm_gguf: Path) -> None:
    # No prefix cache: A's prompt is computed the same way in both runs. A 1 us step target:
    # B's prompt rides along one block per step, so A decodes beside it for the rest.
    engine = LLM(str(smollm_gguf), dtype="float32", max_step_ms=1e-3,
                 enable_prefix_caching=False).engine
    assert engine.model.cpu_decode is not None
    mixed = count_mixed_steps(engine)
    alone = stream_a(engine, None)
    assert mixed[0] == 0
    beside = stream_a(engine, 3)
    assert mixed[0] == 10 - 3  # every token of A after the third came from a mixed step
    assert beside == alone  # bit for bit
