"""The engine moves a CPU model's weights into huge pages after load (`LLMEngine.idle_work`):
while idle (AsyncEngine), between busy steps too, at
load for LLM; the real SmolLM2 answers the same greedy tokens before, during and after,
through the native decode layer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.engine import engine as engine_module
from localpaged.engine.async_engine import LocalClient
from localpaged.engine.config import EngineArgs
from localpaged.engine.engine import LLMEngine
from localpaged.model import huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.available(),
                                reason="no transparent huge pages here (not Linux, or off)")

PROMPT = [1, 9690, 28, 1035, 314, 253, 2365, 30, 2, 198]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _in_one_block(model: torch.nn.Module) -> bool:
    """Whether the model's large weights (its state dict: not derived tables such as the
    rotary one) lie in one block of their summed size (+ 2 MiB)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model.state_dict().values()
                if t.untyped_storage().nbytes() >= huge_pages.SMALLEST}
    lo, hi = min(storages), max(p + n for p, n in storages.items())
    return hi - lo <= sum(-(-n // 4096) * 4096 for n in storages.values()) + huge_pages.HUGE_PAGE


@pytest.fixture(scope="module")
def want(smollm_gguf: Path) -> list[int]:
    """LLM's tokens (it moves the weights at load)."""
    llm = LLM(str(smollm_gguf))
    assert llm.engine._mover is None and _in_one_block(llm.engine.model)
    return llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids


def test_an_idle_engine_moves_the_weights_and_answers_the_same(smollm_gguf: Path,
                                                               want: list[int]) -> None:
    client = LocalClient.from_model(str(smollm_gguf))
    try:
        assert client.async_engine.idle_work_done.wait(120)
        assert not client.engine.tokenizer.hf._started  # chats need no transformers
        model = client.engine.model
        assert _in_one_block(model)
        assert model.cpu_decode is not None  # the native layer, rebuilt on the moved weights

        async def tokens() -> list[int]:
            ids = []
            async for d in client.generate(PROMPT, GREEDY):
                ids += d.token_ids
            return ids

        assert asyncio.run(tokens()) == want
    finally:
        client.async_engine.close()


def test_the_first_steps_after_load_come_before_any_move(smollm_gguf: Path) -> None:
    """Busy right after load (a first request waiting), the engine steps before it moves a
    piece: the first token does not wait for the weights' move."""
    engine = LLMEngine.from_args(EngineArgs(model=str(smollm_gguf)))
    assert engine._mover is not None
    assert engine.idle_work(busy=True) == "blocked"
    assert not _in_one_block(engine.model) and engine._mover._memory is None  # nothing moved


def test_a_busy_engine_moves_them_between_steps(smollm_gguf: Path, want: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece between every two steps: the request's decode steps run on weights partly
    moved (the decode plan rebuilt after each piece), and give the same tokens."""
    monkeypatch.setattr(engine_module, "BUSY_MOVE_EVERY_S", 0.0)
    monkeypatch.setattr(huge_pages, "STEP_BYTES", 8 << 20)
    engine = LLMEngine.from_args(EngineArgs(model=str(smollm_gguf)))
    assert engine._mover is not None and not _in_one_block(engine.model)
    engine.add_request(PROMPT, GREEDY, request_id="r")
    states, got = [], []
    while engine.has_unfinished_requests():
        states.append(engine.idle_work(busy=True))
        for out in engine.step():
            got += out.new_token_ids
    assert "moved" in states and "done" in states  # moved over several steps, then done
    assert engine._mover is None and _in_one_block(engine.model)
    assert got == want
