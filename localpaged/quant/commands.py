"""`localpaged quantize NAME --method gptq|awq --group-size N [--calib FILE] [--output DIR]`."""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from localpaged.quant.calibrate import calibration_ids

GROUP_SIZES = (32, 64, 128)
DEFAULT_CALIB = "calibration-gpl-3.0.txt"
SEQLEN = 512
MAX_SAMPLES = 32


def default_calibration_text() -> str:
    """The calibration text shipped with localpaged (the GPL-3.0 text; evaluation uses the
    Apache-2.0 text, so the two never overlap)."""
    return resources.files("localpaged").joinpath("data", DEFAULT_CALIB).read_text(encoding="utf-8")


def check_group_size(method: str, group_size: int, in_features: dict[str, int]) -> None:
    """Refuse group sizes the formats or the model's layer widths do not allow."""
    allowed = (*GROUP_SIZES, -1) if method == "gptq" else GROUP_SIZES
    if group_size not in allowed:
        raise ValueError(f"--group-size {group_size}: supported for {method} are "
                         f"{', '.join(map(str, allowed))}")
    if method == "awq":
        for name, k in in_features.items():
            if k % group_size:
                ok = [g for g in GROUP_SIZES if k % g == 0]
                raise ValueError(f"--group-size {group_size}: {name} has in_features {k}, not a "
                                 f"multiple of it (AWQ); try {', '.join(map(str, ok)) or 'gptq'}")


def _source(name: str) -> tuple[Path, dict[str, Any]]:
    """The HF folder (or GGUF file) of a model name or path, and from_pretrained kwargs."""
    path = Path(name).expanduser()
    if not path.exists():
        from localpaged.store.lookup import resolve

        resolved = resolve(name)
        path = resolved.path
        if resolved.gguf_file is not None:
            return resolved.gguf_file.parent, {"gguf_file": resolved.gguf_file.name}
    if path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}
    return path, {}


def run_quantize(
    name: str,
    method: str,
    group_size: int,
    output: str | Path,
    calib_text: str | None = None,
    *,
    sym: bool = False,
    act_order: bool = True,
    mse: bool = True,
    max_samples: int = MAX_SAMPLES,
    progress: Any = print,
) -> Path:
    """Load `name` with transformers (float32), quantize on the calibration text, write the
    checkpoint to `output`. GPTQ defaults (asymmetric, act-order, MSE range search) are the
    ones that measured best on SmolLM2-135M g64 (NLL 2.934 vs 3.061 symmetric)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from localpaged.quant.calibrate import quantize_model
    from localpaged.quant.writer import save_quantized

    folder, kw = _source(name)
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    text = calib_text if calib_text is not None else default_calibration_text()
    ids = tok(text).input_ids
    bos = tok.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    widths = {n: m.in_features for n, m in model.model.layers.named_modules()
              if isinstance(m, torch.nn.Linear)}
    check_group_size(method, group_size, widths)
    seqlen = min(SEQLEN, int(getattr(model.config, "max_position_embeddings", SEQLEN)))
    samples = calibration_ids(ids, seqlen - (bos is not None))[:max_samples]
    if bos is not None:
        samples = torch.cat((torch.full((samples.shape[0], 1), bos), samples), dim=1)
    progress(f"{method}: {samples.shape[0]} calibration samples of {seqlen} tokens, "
             f"group size {group_size}")
    layers = quantize_model(model, samples, method, group_size, sym=sym, act_order=act_order,
                            mse=mse, progress=progress)
    return save_quantized(model, layers, output, method, group_size, sym=sym, act_order=act_order,
                          source=None if kw else folder)


def quantize(args: argparse.Namespace) -> int:
    """The `localpaged quantize` command."""
    calib = None
    if args.calib:
        calib = Path(args.calib).read_text(encoding="utf-8")
    output = args.output
    if output is None:
        from localpaged.store.paths import models_dir

        safe = args.model.rstrip("/").replace("/", "--").replace(":", "-").lstrip(".~")
        output = models_dir() / f"{Path(safe).name}-{args.method}-g{args.group_size}"
    start = time.perf_counter()

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        out = run_quantize(args.model, args.method, args.group_size, output, calib, progress=progress)
    except ValueError as exc:
        print(f"localpaged quantize: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s); run it with `localpaged run {out}`")
    return 0
