"""check_supported, the backend switch, every supported shape, and the ops composed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from localpaged.kernels import (
    AttentionMetadata,
    apply_rotary,
    check_supported,
    paged_attention,
    rms_norm,
    silu_and_mul,
    write_kv,
)
from localpaged.kernels.attention import paged_attention_torch, paged_attention_triton
from localpaged.kernels.backend import use_triton_on
from localpaged.kernels.supports import TRITON_BLOCK_SIZES, TRITON_HEAD_DIMS
from localpaged.kernels.testing import make_paged_batch, tolerance


def test_check_supported_names_value_and_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_supported(64, 16, torch.float16, "cpu", num_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"head_dim 72 .*supported: 16, 32, 64, 80, 96, 128"):
        check_supported(72, 16, torch.float16, "cpu")
    with pytest.raises(ValueError, match=r"block_size 12 .*supported: 4, 8, 16, 32"):
        check_supported(64, 12, torch.float16, "cpu")
    with pytest.raises(ValueError, match=r"dtype torch.float64 .*supported: float16, bfloat16"):
        check_supported(64, 16, torch.float64, "cpu")
    with pytest.raises(ValueError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        check_supported(64, 16, torch.float32, "cpu", num_heads=6, num_kv_heads=4)


def test_torch_path_accepts_any_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_KERNELS", "torch")
    check_supported(72, 12, torch.float32, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        check_supported(64, 16, torch.int8, "cpu")


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_KERNELS", "auto")
    assert not use_triton_on("cpu") and use_triton_on("cuda")
    monkeypatch.setenv("LOCALPAGED_KERNELS", "torch")
    assert not use_triton_on("cuda")
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton_on("cpu")
    monkeypatch.setenv("LOCALPAGED_KERNELS", "fast")
    with pytest.raises(ValueError, match="LOCALPAGED_KERNELS='fast'"):
        use_triton_on("cpu")


@pytest.mark.parametrize("head_dim", TRITON_HEAD_DIMS)
def test_every_supported_head_dim(device: str, head_dim: int) -> None:
    for q_lens, seq_lens in (([1, 1], [1, 19]), ([3, 1, 9], [3, 20, 25])):
        q, kc, vc, meta = make_paged_batch(q_lens, seq_lens, 2, 1, head_dim, 8,
                                           torch.float16, device, seed=head_dim)
        ref = paged_attention_torch(q, kc, vc, meta, head_dim**-0.5)
        out = paged_attention_triton(q, kc, vc, meta, head_dim**-0.5)
        torch.testing.assert_close(out, ref, **tolerance(torch.float16))


@pytest.mark.parametrize("block_size", TRITON_BLOCK_SIZES)
def test_every_supported_block_size(device: str, block_size: int) -> None:
    for q_lens, seq_lens in (([1, 1, 1], [1, block_size, block_size + 1]),
                             ([2, block_size], [block_size + 2, block_size + 3])):
        q, kc, vc, meta = make_paged_batch(q_lens, seq_lens, 3, 1, 64, block_size,
                                           torch.float32, device, seed=block_size)
        ref = paged_attention_torch(q, kc, vc, meta, 0.125)
        out = paged_attention_triton(q, kc, vc, meta, 0.125)
        torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def _layer_steps(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """A Llama-style layer through the dispatching ops over two engine steps sharing a cache:
    a prefill step (one fresh prompt and one prompt chunk) then a decode step."""
    gen = torch.Generator().manual_seed(0)
    hidden, hq, hkv, d, bs, inter = 64, 4, 2, 16, 4, 96

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.3).to(dtype=dtype, device=device)

    w_qkv, w_o = rnd(hidden, (hq + 2 * hkv) * d), rnd(hq * d, hidden)
    w_gu, w_down = rnd(hidden, 2 * inter), rnd(inter, hidden)
    norm_w = rnd(hidden) + 1
    freqs = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(device)
    k_cache = torch.zeros(12, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[7, 2, 9, 0], [4, 11, 1, 5]], dtype=torch.int32, device=device)

    def slots(seq: int, positions: list[int]) -> list[int]:
        return [int(tables[seq, p // bs]) * bs + p % bs for p in positions]

    # Step 1: request 0 prompt of 6; request 1 first chunk of 9 tokens.  Step 2: both decode.
    steps = [([0] * 6 + [1] * 9, list(range(6)) + list(range(9)), [6, 9]),
             ([0, 1], [6, 9], [7, 10])]
    outs = []
    for seq_ids, positions, seq_lens in steps:
        t = len(seq_ids)
        x = rnd(t, hidden)
        pos = torch.tensor(positions, device=device)
        q_lens = [seq_ids.count(0), seq_ids.count(1)]
        slot = [s for i in (0, 1) for s in slots(i, [p for j, p in zip(seq_ids, positions)
                                                        if j == i])]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot, device=device),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, q_lens[0], t], dtype=torch.int32, device=device),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens))
        h, residual = rms_norm(x, norm_w, 1e-6)
        qkv = h @ w_qkv
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        q, k = apply_rotary(q, k, pos, cos_sin)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = paged_attention(q, k_cache, v_cache, meta, d**-0.5)
        h, residual = rms_norm(attn.reshape(t, hq * d) @ w_o, norm_w, 1e-6, residual)
        outs.append(silu_and_mul(h @ w_gu) @ w_down + residual)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ops_compose_like_the_model(device: str, dtype: torch.dtype,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_KERNELS", "torch")
    ref = _layer_steps(device, dtype)
    monkeypatch.setenv("LOCALPAGED_KERNELS", "triton")
    assert use_triton_on(device)
    out = _layer_steps(device, dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **tol)


def test_package_imports_and_runs_without_triton() -> None:
    """Where triton is missing (macOS) the kernels package imports and the torch path runs."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, localpaged.kernels as k\n"
        "from localpaged.kernels._triton import HAS_TRITON\n"
        "assert not HAS_TRITON\n"
        "out, res = k.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "assert torch.allclose(out, torch.ones(2, 8), atol=1e-3)\n"
        "k.check_supported(72, 12, torch.float32, 'cpu')\n"
    )
    env = {**os.environ, "LOCALPAGED_KERNELS": "auto"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only process")
def test_a_cpu_process_imports_triton_only_when_asked() -> None:
    """Without CUDA, localpaged's engine and kernels import without Triton (its 71 MiB and
    150 ms go unspent: no CPU path launches a Triton kernel), and asking for the Triton kernels
    before start (`LOCALPAGED_KERNELS=triton`) imports it in interpreter mode; asked for after
    start, they are refused with what to do."""
    code = ("import sys, os, torch\n"
            "from localpaged.engine.engine import LLMEngine\n"
            "from localpaged.kernels import _triton, check_supported\n"
            "print('triton' in sys.modules, _triton.HAS_TRITON, os.environ.get('TRITON_INTERPRET'))\n"
            "if not _triton.HAS_TRITON:\n"
            "    os.environ['LOCALPAGED_KERNELS'] = 'triton'\n"
            "    os.environ['TRITON_INTERPRET'] = '1'\n"
            "    try:\n"
            "        check_supported(64, 16, torch.float32, 'cpu')\n"
            "    except ValueError as e:\n"
            "        print(e)\n"
            "else:\n"
            "    print(_triton.interpreter_active())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALPAGED_KERNELS")}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr
    first, refusal = plain.stdout.splitlines()[:2]
    assert first == "False False None"
    assert "Triton is not loaded" in refusal and "LOCALPAGED_KERNELS=triton" in refusal
    asked = subprocess.run([sys.executable, "-c", code], env={**env, "LOCALPAGED_KERNELS": "triton"},
                           capture_output=True, text=True, timeout=300)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.splitlines()[:2] == ["True True 1", "True"]
