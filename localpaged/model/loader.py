"""Load HF checkpoints (config.json + safetensors, single file or sharded) into our model.

`build_model` is source-agnostic: any iterable of HF-named tensors (safetensors here, the
GGUF reader elsewhere) fills the module, tensor by tensor.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from localpaged.model.config import ModelConfig
from localpaged.model.llama import LlamaForCausalLM

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# Checkpoint tensors that carry nothing we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """torch dtype from a name like "bf16" / "float16" / "torch.float32"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.").lower()
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def cpu_compute_dtype() -> tuple[torch.dtype, str]:
    """The CPU's compute dtype for 16-bit and quantized models, and why: bfloat16 where the
    CPU multiplies bf16 natively (AVX512-BF16, AMX), float32 elsewhere (emulated bf16 math is
    many times slower there)."""
    from localpaged.kernels import cpu_isa

    isa = cpu_isa.chosen()
    if cpu_isa.native_bf16(isa):
        return torch.bfloat16, f"this CPU multiplies bf16 natively ({isa} kernels)"
    return torch.float32, f"this CPU has no native bf16 dot products ({isa} kernels)"


def resolve_dtype(
    dtype: str | torch.dtype, config: ModelConfig | None, device: torch.device | str
) -> torch.dtype:
    """ "auto": the checkpoint's dtype on CUDA (float16 for a GGUF); on the CPU float32 for
    fp32 checkpoints, else `cpu_compute_dtype()`. Anything else: that dtype."""
    if dtype != "auto":
        return parse_dtype(dtype)
    known = config is not None and config.torch_dtype in _DTYPES
    ckpt = parse_dtype(config.torch_dtype) if known else None
    if torch.device(device).type == "cuda":
        return ckpt or torch.float16
    if ckpt == torch.float32 or (config is not None and not known):
        return torch.float32
    return cpu_compute_dtype()[0]


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The module class of `config`'s architecture (the Llama one unless a family differs)."""
    if config.architecture == "Phi3ForCausalLM":
        from localpaged.model.phi3 import Phi3ForCausalLM

        return Phi3ForCausalLM
    if config.architecture == "Gemma3ForCausalLM":
        from localpaged.model.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    return LlamaForCausalLM


def create_model(config: ModelConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    """The module tree for `config`, on the meta device (no storage yet).

    The one place that decides dense vs quantized layers: the quant room replaces the
    branch below.
    """
    model = model_class(config)(config, dtype, device="meta")
    if config.quantization_config is not None:
        from localpaged.quant.loader import quantize_modules

        quantize_modules(model, config.quantization_config)  # nn.Linear -> QuantLinear
    return model


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """A model whose parameters are filled from HF-named tensors, each checked for shape."""
    dtype = parse_dtype(dtype)
    model = create_model(config, dtype).materialize(device)
    if config.quantization_config is not None:
        from localpaged.quant.loader import load_quantized_weights

        return load_quantized_weights(model, config.quantization_config, weights).eval()
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if not isinstance(tensor, torch.Tensor):  # GGUF Q4 (Int4Weight) or int8 blocks
            from localpaged.quant.ggml_int8 import GgmlInt8Weight, Int8Blocks
            from localpaged.quant.loader import install_int4, install_int8

            if isinstance(tensor, (Int8Blocks, GgmlInt8Weight)):
                install_int8(model, name, tensor, config.tie_word_embeddings)
            else:
                install_int4(model, name, tensor, config.tie_word_embeddings)
            loaded.add(name)
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} (shape {tuple(tensor.shape)}) "
                             f"for {config.architecture}")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r}: expected shape {tuple(param.shape)}, "
                             f"found {tuple(tensor.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        n = missing[0]
        raise ValueError(f"tensor {n!r} is missing: expected shape {tuple(params[n].shape)}, "
                         f"found none ({len(missing)} missing in all)")
    return model.eval()


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return found


def iter_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, read one tensor at a time."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def gguf_kept_types(dtype: torch.dtype, device: torch.device | str) -> frozenset[str]:
    """The GGUF types kept 4-bit for a model computing in `dtype` on `device`."""
    from localpaged.model.gguf_loader import kept_4bit

    float32_kernel = int8 = False
    if torch.device(device).type == "cpu":
        from localpaged.quant import cpu_w4

        float32_kernel = cpu_w4.available()
        int8 = float32_kernel and cpu_w4.int8_activations()
    return kept_4bit(dtype, float32_kernel, int8)


def gguf_int8(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a GGUF's matrices of the other block types (Q8_0, Q5_0, Q6_K ...) stay int8
    blocks: on a CPU whose kernels take the activations as int8 (float32, and bf16 where
    those kernels are there: every CPU with native bf16 has them), not dequantized to a
    16-bit copy of twice the file's bytes."""
    if dtype not in (torch.float32, torch.bfloat16) or torch.device(device).type != "cpu":
        return False
    from localpaged.quant import cpu_w4

    return cpu_w4.available() and cpu_w4.int8_activations()


def load_model(
    path: str | Path, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load an HF folder (config.json + model.safetensors or sharded safetensors) or a
    .gguf file (through localpaged.model.gguf_loader)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from localpaged.model.gguf_loader import open_gguf

        gguf = open_gguf(path)
        config = ModelConfig.from_dict(gguf.hf_config())
        # A GGUF's own precision says nothing of the compute dtype: by default 16-bit on
        # CUDA, on the CPU what the CPU computes fastest. Its Q4_0/Q4_1/Q4_K matrices stay
        # 4-bit (the own CPU kernel in bf16 or float32, torch's int4 op, Triton on CUDA); the
        # other types are dequantized once here. `hf_config()` refused unknown types already.
        torch_dtype = resolve_dtype(dtype, None, device)
        kept = gguf_kept_types(torch_dtype, device)
        int8 = gguf_int8(torch_dtype, device)
        return build_model(config, gguf.tensors_for(torch_dtype, kept, int8), torch_dtype,
                           device), config
    config = ModelConfig.from_pretrained(path)
    weights = iter_safetensors(safetensors_files(path))  # lazy: read inside build_model
    torch_dtype = resolve_dtype(dtype, config, device)
    return build_model(config, weights, torch_dtype, device), config


def load_inference_model(
    path: str | Path, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`load_model`, its projections joined for inference. On the CPU a GGUF, or an AWQ /
    GPTQ folder, comes from the packed-weights cache when this build loaded it before (see
    localpaged.model.packed_cache), else is packed now and kept there for the next load."""
    path = Path(path)
    source = _packed_source(path, dtype, device)
    if source is None:
        model, config = load_model(path, dtype, device)
        model.fuse_projections()
        return model, config
    from localpaged.model import packed_cache

    config, fingerprint, torch_dtype = source
    key = packed_cache.entry_key(fingerprint, torch_dtype)
    stem = path.stem if path.is_file() else path.name
    cached = packed_cache.load(stem, key)
    if cached is not None:
        print(f"localpaged: packed weights mapped from {packed_cache.entry_path(stem, key)}",
              file=sys.stderr, flush=True)
        cached.weights_file_mapped = True  # the engine moves them (huge_pages.WeightMover)
        return cached, config
    model, config = load_model(path, dtype, device)
    model.fuse_projections()
    size = packed_cache.tensor_bytes(model)
    if packed_cache.save_in_background(model, stem, key, size) is not None:
        print(f"localpaged: keeping the packed weights for the next load ({size / 2**30:.2f} "
              f"GiB, written to {packed_cache.cache_dir()} in the background)",
              file=sys.stderr, flush=True)
    return model, config


def _packed_source(path: Path, dtype: str | torch.dtype, device: torch.device | str
                   ) -> tuple[ModelConfig, str, torch.dtype] | None:
    """(config, the files' fingerprint, compute dtype) of a model whose CPU load repacks its
    weights (a GGUF, an AWQ / GPTQ folder), or None for one loaded as it is stored."""
    if torch.device(device).type != "cpu":
        return None
    from localpaged.model.gguf_loader import _fingerprint, open_gguf

    if path.suffix == ".gguf":
        gguf = open_gguf(path)
        return (ModelConfig.from_dict(gguf.hf_config()), gguf.fingerprint,
                resolve_dtype(dtype, None, device))
    if not (path / "config.json").is_file():
        return None
    config = ModelConfig.from_pretrained(path)
    if config.quantization_config is None:
        return None  # 16-bit weights: copied as they are, nothing to keep
    files = [path / "config.json", *safetensors_files(path)]
    fingerprint = "|".join(_fingerprint(f.resolve()) for f in files)
    return config, fingerprint, resolve_dtype(dtype, config, device)
