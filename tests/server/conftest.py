"""Fixtures of the API tests: a tiny random Llama that speaks through a real tokenizer (SmolLM2's,
plus StarCoder-style FIM tokens), the real engine on it, and the real server on a free port."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>"]
MAX_MODEL_LEN = 512


def _cache_dir() -> Path:
    root = Path(os.environ.get("LOCALPAGED_TEST_CACHE", Path.home() / ".cache" / "localpaged-tests"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _tokenizer_dir(smollm_gguf: Path) -> Path:
    """SmolLM2's tokenizer (from the GGUF) with FIM tokens added, saved once and cached."""
    target = _cache_dir() / "smollm2-tokenizer-fim"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_gguf.parent, gguf_file=smollm_gguf.name)
    tok.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    tmp = target.with_name(f"{target.name}.{os.getpid()}.part")
    tok.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def tiny_chat_model(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (hidden 64) whose vocabulary is the tokenizer's, saved as an HF
    folder with tokenizer files next to the weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_dir = _tokenizer_dir(smollm_gguf)
    path = tmp_path_factory.mktemp("tiny-chat-llama")
    import json

    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    size = max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])]) + 1
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


def make_client(model_dir: Path) -> Any:
    """The real in-process engine on the tiny model (CPU, small KV pool)."""
    from localpaged.engine.async_engine import LocalClient

    return LocalClient.from_model(str(model_dir), device="cpu", dtype="float32",
                                  num_kv_blocks=1024, max_num_seqs=64)


@pytest.fixture(scope="session")
def engine_client(tiny_chat_model: Path) -> Iterator[Any]:
    client = make_client(tiny_chat_model)
    yield client
    asyncio.run(client.close())


@pytest.fixture(scope="session")
def server(engine_client: Any) -> Iterator[Any]:
    """The API served by uvicorn on an ephemeral loopback port."""
    from localpaged.server.app import serve_in_background

    handle = serve_in_background(engine_client, "127.0.0.1", 0)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def base_url(server: Any) -> str:
    return server.url


@pytest.fixture(scope="session")
def model_name(engine_client: Any) -> str:
    return engine_client.model_name
