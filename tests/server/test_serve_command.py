"""`localpaged serve` as users run it: a subprocess on a free port, with the key from the env."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command(tiny_chat_model: Path) -> None:
    port = _free_port()
    env = {**os.environ, "LOCALPAGED_API_KEY": "k1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "localpaged.cli", "serve", str(tiny_chat_model), "--port",
         str(port), "--device", "cpu", "--max-model-len", "256", "--allowed-host", "box.lan"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/api/version", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        model = client.models.list().data[0].id
        assert model == tiny_chat_model.name
        r = client.chat.completions.create(model=model, max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens >= 1
        ok = httpx.get(url + "/v1/models", headers={"Host": "box.lan", "Authorization": "Bearer k1"})
        assert ok.status_code == 200
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k1"}).text
        assert "localpaged_max_model_len" in metrics and " 256" in metrics
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_refuses_bad_pool_options_before_loading(capsys) -> None:
    from localpaged.cli import build_parser
    from localpaged.server.app import main

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert (args.max_loaded_models, args.memory_budget, args.keep_alive) == (3, None, "5m")
    for bad in (["--keep-alive", "forever"], ["--max-loaded-models", "0"],
                ["--memory-budget", "-2"]):
        assert main(parser.parse_args(["serve", "/no/such/model.gguf", *bad])) == 2
    err = capsys.readouterr().err
    assert "keep_alive='forever'" in err and "must be positive" in err
