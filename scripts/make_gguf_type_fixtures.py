#!/usr/bin/env python3
"""Regenerate tests/fixtures/ggml_types.gguf: one small matrix per GGML type the common
llama.cpp presets write, each quantized by llama.cpp's own quantizer (`ggml_quantize_chunk`
through llama-cpp-python, here or in PEERS_PYTHON), plus the float32 source they were made
from. CI reads it with no llama.cpp installed (tests/quant/test_ggml_fixtures.py).

    .venv/bin/python scripts/make_gguf_type_fixtures.py [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from llamacpp_peer import find  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS")
SHAPE = (16, 512)  # two 256-value super-blocks per row; 16 rows fit the 4-bit CPU kernel
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "ggml_types.gguf"


def source_matrix(seed: int = 0) -> np.ndarray:
    """Weight-like float32 values: rows of different scales, a few outliers, some zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE) * rng.uniform(0.005, 0.05, size=(SHAPE[0], 1))
    x[rng.random(SHAPE) < 0.002] *= 12  # outliers
    x[3, 32:64] = 0.0  # a constant block
    x[5, :256] = np.abs(x[5, :256])  # an all-positive super-block
    return x.astype(np.float32)


def main() -> None:
    import gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    quantizer, why = find()
    if quantizer is None:
        raise SystemExit(f"cannot make the fixture: {why}")
    x = source_matrix()
    writer = gguf.GGUFWriter(str(args.out), "ggml-types-fixture")
    writer.add_string("fixture.made_by", "scripts/make_gguf_type_fixtures.py, llama.cpp "
                      "ggml_quantize_chunk (llama-cpp-python)")
    writer.add_tensor("source", x)
    for name in TYPES:
        kind = gguf.GGMLQuantizationType[name]
        writer.add_tensor(name, quantizer.quantize_rows(x, kind.value), raw_dtype=kind)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) with {quantizer}")


if __name__ == "__main__":
    main()
