"""Decode steps through the native CPU layer (`localpaged.kernels.decode_layer`) against the
same model's torch layers: a 4-bit tiny Qwen2 (q/k/v biases, GQA) and the real SmolLM2, with
requests of different lengths in scattered blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from localpaged.kernels import AttentionMetadata, native
from localpaged.kernels.decode_layer import CpuDecodePlan
from localpaged.model.loader import load_model
from localpaged.model.optimize import optimize_for_inference

pytestmark = pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here to build the CPU kernels")

BS = 16


def _decode_step_both_ways(model, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill each prompt (torch layers), then one decode step for all of them at once, run
    by the torch layers and by the native plan. Returns both steps' log-probabilities."""
    plan = model.cpu_decode
    model.cpu_decode = None
    order = [7, 2, 11, 0, 5, 9, 3, 12, 1, 8, 4, 10, 6, 13]  # scattered, non-consecutive
    caches = model.allocate_kv_caches(num_blocks=len(order), block_size=BS)
    tables, next_ids = [], []
    for ids in prompts:
        n = len(ids)
        blocks = [order.pop() for _ in range(n // BS + 1)]  # room for the decoded token
        tables.append(blocks)
        slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(n)])
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=torch.tensor([blocks], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n,
            max_seq_len=n)
        hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
        next_ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    width = max(len(t) for t in tables)
    lens = [len(ids) + 1 for ids in prompts]

    def step() -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS
                                       for t, n in zip(tables, lens)]),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.arange(len(prompts) + 1, dtype=torch.int32), max_query_len=1,
            max_seq_len=max(lens))
        hidden = model(torch.tensor(next_ids), torch.tensor([n - 1 for n in lens]), caches, meta)
        return torch.log_softmax(model.compute_logits(hidden), -1)

    reference = step()
    model.cpu_decode = plan
    return reference, step()


# Largest log-prob gap of the top token between the two paths: bf16 rounding in a different
# order; in float32 only the order of summation, unless the activations are rounded to int8
# (then a last-bit difference before a matmul can move a code by one step: measured 0.056 on
# SmolLM2, AVX2; such differences swing the largest gap up to 0.27, see test_optimize).
GAP = {torch.bfloat16: 0.15, torch.float32: 1e-3, "int8": 0.4}


def _assert_close(reference: torch.Tensor, native: torch.Tensor, dtype: torch.dtype) -> None:
    from localpaged.quant import cpu_w4

    top = reference.argmax(-1)
    assert torch.equal(native.argmax(-1), top)
    gap = (native.gather(1, top[:, None]) - reference.gather(1, top[:, None])).abs().max()
    int8 = dtype == torch.float32 and cpu_w4.int8_activations()
    assert gap < GAP["int8" if int8 else dtype], gap
    probs = reference.exp()  # expected log-prob difference (0.107 measured with int8 on SmolLM2)
    assert (probs * (native - reference)).abs().sum(-1).max() < (0.3 if int8 else 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_matches_the_torch_layers_on_a_4bit_qwen2(tiny_qwen2: Path,
                                                                 cpu_variant: str,
                                                                 dtype: torch.dtype,
                                                                to_4bit: Callable) -> None:
    model, _ = load_model(tiny_qwen2, dtype=dtype)
    to_4bit(model)
    optimize_for_inference(model, torch.device("cpu"))
    assert isinstance(model.cpu_decode, CpuDecodePlan)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # biases on the path
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 16, 33)]
    _assert_close(*_decode_step_both_ways(model, prompts), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_matches_the_torch_layers_on_a_4bit_qwen3(tiny_qwen3: Path,
                                                                cpu_variant: str,
                                                                dtype: torch.dtype,
                                                                to_4bit: Callable) -> None:
    """Qwen3's per-head q/k RMSNorm in the native layer: the same step as the torch layers
    (and a plan whose layers skipped the norms would not be: checked by dropping them)."""
    model, _ = load_model(tiny_qwen3, dtype=dtype)
    to_4bit(model)
    optimize_for_inference(model, torch.device("cpu"))
    assert isinstance(model.cpu_decode, CpuDecodePlan)
    assert all(layer.q_norm for layer in model.cpu_decode.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 16, 33)]
    reference, native = _decode_step_both_ways(model, prompts)
    _assert_close(reference, native, dtype)
    for layer in model.cpu_decode.layers:
        layer.q_norm = layer.k_norm = None
    without = _decode_step_both_ways(model, prompts)[1]
    assert (without - reference).abs().max() > 10 * (native - reference).abs().max()


def test_plan_is_not_built_for_a_dense_checkpoint_or_without_the_kernel(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch, to_4bit: Callable) -> None:
    model, _ = load_model(tiny_qwen2, dtype="float32")
    optimize_for_inference(model, torch.device("cpu"))
    assert model.cpu_decode is None
    monkeypatch.setenv("LOCALPAGED_CPU_KERNELS", "off")
    model, _ = load_model(tiny_qwen2, dtype="bfloat16")
    to_4bit(model)
    optimize_for_inference(model, torch.device("cpu"))
    assert model.cpu_decode is None


@pytest.mark.smollm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_matches_the_torch_layers_on_smollm(smollm_gguf: Path, cpu_variant: str,
                                                           dtype: torch.dtype) -> None:
    model, _ = load_model(smollm_gguf, dtype=dtype)
    done = optimize_for_inference(model, torch.device("cpu"))
    assert done["native_decode"] == 1
    chat = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 1780,
            314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # SmolLM2 chat prompt
    _assert_close(*_decode_step_both_ways(model, [chat, chat[:9], chat[:20]]), dtype)


def test_native_decode_takes_int8_blocks_of_a_mixed_gguf_in_float32(
        tmp_path: Path, cpu_variant: str) -> None:
    """A file mixing Q4_1, Q4_0, Q5_0, Q5_1 and Q8_0 (as llama.cpp's presets do for small
    models): in float32 with int8 activations the layers of other types are int8 blocks or
    6-bit (Q5_1), a q/k/v of mixed types with a Q8_0 part is joined with each part in its own
    form (the Q8_0 one int8 blocks), and decode steps still take the native layer, agreeing
    with the torch layers."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
    from ggufmaker import write_tiny_gguf

    from localpaged.quant import cpu_w4, cpu_w6
    from localpaged.quant.joined_linear import JoinedLinear
    from localpaged.quant.q8_linear import Q8Linear
    from localpaged.quant.w6_linear import W6Linear

    p = "model.layers.0."
    types = {p + "self_attn.k_proj.weight": "Q5_0", p + "self_attn.v_proj.weight": "Q8_0",
             p + "mlp.down_proj.weight": "Q5_1", p + "mlp.up_proj.weight": "Q4_0"}
    model, _ = load_model(write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_1", types=types),
                          dtype="float32")
    done = optimize_for_inference(model, torch.device("cpu"))
    if not cpu_w4.int8_activations():
        assert done["native_decode"] == 0  # dense Q5/Q8 layers: the torch layers decode
        return
    assert done["native_decode"] == 1
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, JoinedLinear) and isinstance(qkv.parts[2], Q8Linear)  # v: Q8_0
    assert isinstance(layer.mlp.down_proj, W6Linear if cpu_w6.available() else Q8Linear)  # Q5_1
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 17, 9)]
    _assert_close(*_decode_step_both_ways(model, prompts), torch.float32)


def test_native_decode_takes_a_fused_6_bit_layer(tmp_path: Path, cpu_variant: str) -> None:
    """k and v in Q5_1 fuse into one 6-bit layer (their own form), which the native decode
    layer takes, agreeing with the torch layers; its weight is the two side by side."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
    from ggufmaker import write_tiny_gguf

    from localpaged.model.gguf_loader import open_gguf
    from localpaged.quant import cpu_w6
    from localpaged.quant.w6_linear import W6Linear

    p = "model.layers.0."
    types = {p + f"self_attn.{x}_proj.weight": "Q5_1" for x in "qkv"}
    path = write_tiny_gguf(tmp_path / "six.gguf", "Q4_1", types=types)
    model, _ = load_model(path, dtype="float32")
    done = optimize_for_inference(model, torch.device("cpu"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    if not cpu_w6.available():
        assert not isinstance(qkv, W6Linear)
        return
    assert isinstance(qkv, W6Linear) and qkv.high is not None and done["native_decode"] == 1
    dense = dict(open_gguf(path).weights())
    want = torch.cat([dense[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
    torch.testing.assert_close(qkv.blocks().dequantize(), want, rtol=0, atol=1e-6)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 12)]
    _assert_close(*_decode_step_both_ways(model, prompts), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_parts_of_different_forms_are_joined_in_their_own_bytes(
        tmp_path: Path, cpu_variant: str, dtype: torch.dtype) -> None:
    """A Q4_K_M-like mix (q and k 4-bit, v 6-bit; gate and up of two 4-bit types): the fused
    layers keep each part in its own form, so they hold exactly the parts' bytes (one 6-bit
    matrix would hold q and k at 6-bit and per-16 scales), their outputs are the parts' side by
    side, and native decode steps through them (several rows: each part's columns in place)
    agree with the torch layers."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
    from ggufmaker import write_tiny_gguf

    from localpaged.model.gguf_loader import open_gguf
    from localpaged.model.llama import fuse_linears
    from localpaged.quant import cpu_w6
    from localpaged.quant.joined_linear import JoinedLinear
    from localpaged.quant.w6_linear import W6Linear

    p = "model.layers.0."
    types = {p + "self_attn.q_proj.weight": "Q4_0", p + "self_attn.k_proj.weight": "Q4_0",
             p + "self_attn.v_proj.weight": "Q5_0", p + "mlp.up_proj.weight": "Q4_1"}
    path = write_tiny_gguf(tmp_path / "mix.gguf", "Q4_0", types=types)
    model, _ = load_model(path, dtype=dtype)
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    part_bytes = sum(b.numel() * b.element_size() for m in parts for b in m.buffers())
    done = optimize_for_inference(model, torch.device("cpu"))
    qkv = attn.qkv_proj
    if not cpu_w6.available():
        return
    assert isinstance(qkv, JoinedLinear) and list(qkv.parts) == parts
    assert sum(b.numel() * b.element_size() for b in qkv.buffers()) == part_bytes
    one_matrix = W6Linear.concat(parts)  # what fusing them into one layer used to make
    assert part_bytes < 0.9 * sum(b.numel() * b.element_size() for b in one_matrix.buffers())
    assert fuse_linears(parts) is not one_matrix and isinstance(fuse_linears(parts), JoinedLinear)
    dense = dict(open_gguf(path).weights())
    x = torch.randn(3, qkv.in_features).to(dtype)
    want = torch.cat([m(x) for m in parts], dim=-1)
    torch.testing.assert_close(qkv(x), want, rtol=0, atol=0)
    assert qkv(x).shape[-1] == sum(dense[f"{p}self_attn.{n}_proj.weight"].shape[0] for n in "qkv")
    assert done["native_decode"] == 1
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 15, 3)]
    _assert_close(*_decode_step_both_ways(model, prompts), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_takes_iq4_nl_layers(tmp_path: Path, cpu_variant: str,
                                           dtype: torch.dtype) -> None:
    """An IQ4_NL file (tied embedding): its layers keep the code book (fused q/k/v and
    gate/up too) and decode steps take the native layer, agreeing with the torch layers."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
    from ggufmaker import write_tiny_gguf

    from localpaged.quant import cpu_w6
    from localpaged.quant.w6_linear import W6Linear

    path = write_tiny_gguf(tmp_path / "iq4nl.gguf", "IQ4_NL", tie=True)
    model, _ = load_model(path, dtype=dtype)
    done = optimize_for_inference(model, torch.device("cpu"))
    layer = model.model.layers[0]
    if not cpu_w6.available() or not isinstance(layer.mlp.down_proj, W6Linear):
        assert not any(isinstance(m, W6Linear) for m in model.modules())
        return
    for fused in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, model.lm_head):
        assert isinstance(fused, W6Linear) and fused.zero_point == cpu_w6.NL
    assert done["native_decode"] == 1
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 19, 2)]
    _assert_close(*_decode_step_both_ways(model, prompts), dtype)


@pytest.fixture(scope="module")
def act_order_gptq(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 quantized by the project's GPTQ with act-order (g_idx not monotone)."""
    from transformers import AutoModelForCausalLM

    from localpaged.quant.calibrate import calibration_ids, quantize_model
    from localpaged.quant.writer import save_quantized

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = calibration_ids(torch.randint(3, 512, (256,), generator=g).tolist(), 64)
    layers = quantize_model(model, ids, "gptq", 32, sym=False, act_order=True,
                            progress=lambda _m: None)
    return save_quantized(model, layers, tmp_path_factory.mktemp("gptq-act-order"), "gptq", 32,
                          sym=False, act_order=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_takes_act_order_gptq(act_order_gptq: Path, cpu_variant: str,
                                            dtype: torch.dtype) -> None:
    """Act-order GPTQ layers (their input channels permuted) stay on the native decode layer,
    which gathers x in the weight's column order, agreeing with the torch layers."""
    from localpaged.quant.linear import QuantLinear

    model, _ = load_model(act_order_gptq, dtype=dtype)
    optimize_for_inference(model, torch.device("cpu"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    if not isinstance(qkv, QuantLinear) or qkv.w4_packed is None:
        pytest.skip("the layers are not on the own 4-bit kernel here")
    assert qkv.perm is not None and not torch.equal(qkv.perm, torch.arange(qkv.in_features))
    assert isinstance(model.cpu_decode, CpuDecodePlan)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 16, 33)]
    _assert_close(*_decode_step_both_ways(model, prompts), dtype)


@pytest.fixture(scope="module")
def act_order_apart(act_order_gptq: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The act-order checkpoint with every k_proj's and up_proj's channels grouped in another
    order (g_idx shuffled): q/k/v and gate/up that no one matrix can hold."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("gptq-act-order-apart")
    for f in act_order_gptq.iterdir():
        shutil.copy(f, out / f.name)
    tensors = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if name.endswith(("k_proj.g_idx", "up_proj.g_idx")):
            tensors[name] = t[torch.randperm(t.numel(), generator=g)].contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_native_decode_takes_act_order_layers_ordered_apart(act_order_apart: Path,
                                                            cpu_variant: str,
                                                            dtype: torch.dtype) -> None:
    """q/k/v (gate/up) whose input channels are ordered differently are joined side by side,
    each part gathering x in its own order, and stay on the native decode layer."""
    from localpaged.quant.joined_linear import JoinedLinear
    from localpaged.quant.linear import QuantLinear

    model, _ = load_model(act_order_apart, dtype=dtype)
    optimize_for_inference(model, torch.device("cpu"))
    layer = model.model.layers[0]
    for joined in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert isinstance(joined, JoinedLinear)
        first, second = joined.parts[0], joined.parts[1]
        if not isinstance(first, QuantLinear) or first.w4_packed is None:
            pytest.skip("the layers are not on the own 4-bit kernel here")
        assert not torch.equal(first.perm, second.perm)
    assert isinstance(model.cpu_decode, CpuDecodePlan)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 16, 33)]
    _assert_close(*_decode_step_both_ways(model, prompts), dtype)
