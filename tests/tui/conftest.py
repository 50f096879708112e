"""Fixtures of the chat app tests.

`openai_stub`: a small OpenAI-compatible HTTP server (stdlib, real sockets) standing in for a
remote vLLM.

It streams a canned answer word by word. The requested model (or a last message "!error" /
"!slow") picks the behaviour: "echo" (default) answers "You said: <last message>", "slow"
streams forever (a word every 50 ms), "error" answers HTTP 500 with an OpenAI error body.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _json(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/api/version":
            self._json(200, {"version": "stub"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "echo", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)  # type: ignore[attr-defined]
        model = body.get("model", "echo")
        text = str(body["messages"][-1]["content"]) if "messages" in body else ""
        if text.startswith("!"):  # "!error", "!slow": the behaviour of that model
            model = text[1:].split()[0]
        if model == "error":
            self._json(500, {"error": {"message": "the model crashed", "type": "server_error"}})
            return
        last = body["messages"][-1]["content"] if "messages" in body else str(body.get("prompt"))
        words = [f"You said: {last}"] if model == "echo" else None
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._stream(words, body.get("max_tokens", 16))
        self.close_connection = True

    def _send(self, obj: object) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def _stream(self, words: list[str] | None, max_tokens: int) -> None:
        n = 0
        while words is None or n < len(words):
            text = words[n] if words is not None else f"word{n} "
            self._send({"choices": [{"index": 0, "delta": {"content": text}}]})
            n += 1
            if words is None:
                time.sleep(0.05)
        self._send({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        self._send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                             "prompt_tokens_details": {"cached_tokens": 3}}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class OpenAIStub:
    """Run the stub on a free localhost port in a thread; `url` is its base URL."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.requests = []  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @property
    def requests(self) -> list[dict]:
        return self.server.requests  # type: ignore[attr-defined]

    def __enter__(self) -> OpenAIStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def openai_stub() -> Iterator[OpenAIStub]:
    with OpenAIStub() as stub:
        yield stub


def _cache_dir() -> Path:
    """Where the tiny chat model is kept between runs (as tests/conftest.py's cache)."""
    root = Path(os.environ.get("LOCALPAGED_TEST_CACHE",
                               Path.home() / ".cache" / "localpaged-tests"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def tiny_chat_model(smollm_gguf: Path) -> Path:
    """A random 2-layer Llama (hidden 64) saved with SmolLM2's real tokenizer and chat template
    (49152 tokens): a chat model in every way but its weights, fast on the CPU."""
    target = _cache_dir() / "tui-tiny-smollm-vocab"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tmp = target.with_name(target.name + ".part")
    tok = AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(target)
    return target


@pytest.fixture(scope="session")
def local_client(tiny_chat_model: Path) -> Iterator[Any]:
    """The real in-process engine on the tiny chat model, shared by the app tests."""
    from localpaged.engine.async_engine import LocalClient

    client = LocalClient.from_model(str(tiny_chat_model), dtype="float32", device="cpu",
                                    num_kv_blocks=512, max_model_len=1024)
    yield client
    client.async_engine.close()
