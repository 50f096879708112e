"""A thinking model in the chat app (the tiny random chat model with an R1-style template:
the prompt opens the block): the answer streams with its thinking folded apart (a click opens
it), the saved answer keeps the whole text, a copy takes the answer alone, and the next turn's
prompt is the template's own, its leading blocks from the prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Collapsible, Markdown, Static

from localpaged.model.thinking import split_thinking
from localpaged.tui.chat_view import MessageView
from tests.server.test_thinking_api import thinking_model  # noqa: F401 (fixture)
from tests.tui.test_app import SIZE, answered, screen, wait_for


@pytest.fixture(scope="module")
def thinking_client(thinking_model: Path) -> Iterator[Any]:  # noqa: F811
    from localpaged.engine.async_engine import LocalClient

    client = LocalClient.from_model(str(thinking_model), dtype="float32", device="cpu",
                                    num_kv_blocks=512, max_model_len=1024)
    yield client
    asyncio.run(client.close())


async def test_thinking_streams_folded_and_the_next_turn_drops_it(
        tmp_path: Path, thinking_client: Any) -> None:
    from localpaged.tui.app import ChatApp
    from localpaged.tui.history import History
    from localpaged.tui.session import ChatSettings

    # seeded sampling: the random model's greedy answer here is newlines only
    settings = ChatSettings(temperature=1.0, max_tokens=16, seed=7)
    app = ChatApp(History(tmp_path / "history.sqlite3"), client=thinking_client,
                  owns_client=False, default_settings=settings, home=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        view = screen(app).current
        assert view is not None
        view.send("Why is the sky blue?")
        await wait_for(pilot, answered(view))
        saved = view.session.messages[-1].content
        assert saved.startswith("<think>\n")  # the template's opening kept with the answer
        thought, answer = split_thinking(saved)
        assert thought, repr(saved)  # 16 random tokens, no </think>: all thinking
        message = view.query(MessageView).last()
        fold = message.query_one(Collapsible)
        assert fold.display and fold.collapsed and fold.title == "Thinking"
        assert str(message.query_one(".thought", Static).content) == thought
        assert message.query_one(Markdown).source == answer
        assert view.last_answer() == answer  # ctrl+y copies the answer alone
        await pilot.click(fold.query_one("CollapsibleTitle"))
        await pilot.pause()
        assert not fold.collapsed
        first_prompt = list(view.session._last_prompt_ids or [])
        view.send("And at sunset?")
        await wait_for(pilot, answered(view, 2))
        tok = thinking_client.tokenizer
        prompt2 = view.session._last_prompt_ids
        # the template's own rendering (here it keeps an unclosed block; a closed one it
        # drops: tests/model/test_tokenizer.py), its leading blocks from the prefix cache
        assert prompt2 == tok.apply_chat_template(view.session.chat_messages()[:-1])
        assert view.session.stats.cached_tokens >= len(first_prompt) // 16 * 16 > 0
