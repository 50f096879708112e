"""Write docs/screenshot.svg: the app on SmolLM2-135M-Instruct with two tabs mid-answer.

    python tests/tui/make_screenshot.py [GGUF] [OUT]

GGUF defaults to the test cache's SmolLM2-135M-Instruct.Q4_1.gguf (the `smollm_gguf` fixture).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

from textual.widgets import Input, TextArea

from localpaged.engine.async_engine import LocalClient
from localpaged.tui.app import ChatApp
from localpaged.tui.history import History
from localpaged.tui.session import ChatSettings

CACHE = Path(os.environ.get("LOCALPAGED_TEST_CACHE", Path.home() / ".cache" / "localpaged-tests"))
QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a short story about a robot who learns to paint.",
]


async def main(gguf: Path, out: Path) -> None:
    client = LocalClient.from_model(str(gguf), device="cpu", max_model_len=2048)
    with tempfile.TemporaryDirectory() as home:
        history = History(Path(home) / "history.sqlite3")
        app = ChatApp(history, client=client, owns_client=False,
                      default_settings=ChatSettings(temperature=0, max_tokens=400))
        async with app.run_test(size=(132, 36)) as pilot:
            screen = app._chat_screen()
            assert screen is not None
            for n, question in enumerate(QUESTIONS):
                if n:
                    await screen.action_new_tab()
                    await pilot.pause()
                view = screen.current
                assert view is not None
                view.send(question)
            views = screen.views
            # both tabs answering, with enough text on screen to show the Markdown
            while any(v.session.busy and v.session.stats.output_tokens < 60 for v in views):
                await pilot.pause(0.05)
            print([(v.session.busy, v.session.stats.output_tokens) for v in views])
            screen.action_go_tab(1)
            for w in app.screen.query("TextArea, Input"):
                assert isinstance(w, (TextArea, Input))
                w.cursor_blink = False
            await pilot.pause(0.2)
            await pilot.wait_for_scheduled_animations()
            await pilot.pause(0.5)
            screen.refresh_status()
            out.write_text(app.export_screenshot(title="localpaged chat"))
            for v in views:
                await v.stop()
        history.close()
    await client.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    gguf = Path(sys.argv[1]) if len(sys.argv) > 1 else CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("docs/screenshot.svg")
    asyncio.run(main(gguf, out))
