"""The GGML type and file-type tables the header reader uses in place of the `gguf` package's
equal the package's own (the independent reference), and reading a file does not import it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
from ggufmaker import write_tiny_gguf

from localpaged.model.ggml_type_ids import FILE_TYPES, TYPE_SIZES, GGMLType
from localpaged.model.gguf_reader import FastGGUFReader


def test_type_numbers_and_sizes_equal_the_gguf_packages() -> None:
    ours = {t.name: (t.value, TYPE_SIZES[t]) for t in GGMLType}
    theirs = {t.name: (t.value, gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert ours == theirs


def test_file_type_names_equal_the_gguf_packages() -> None:
    assert {t.value: t.name for t in gguf.LlamaFileType} == FILE_TYPES


def test_reader_tensors_compare_equal_to_the_gguf_packages_types(tmp_path: Path) -> None:
    """A tensor's type is an int enum equal to gguf's, so gguf's own tables take it too."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    kinds = {t.tensor_type for t in FastGGUFReader(path).tensors}
    assert GGMLType.Q8_0 in kinds
    for kind in kinds:
        assert kind == gguf.GGMLQuantizationType[kind.name]
        assert gguf.GGML_QUANT_SIZES[kind] == TYPE_SIZES[kind]


def test_opening_a_gguf_does_not_import_the_gguf_package(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    code = ("import sys\nfrom localpaged.model.gguf_loader import open_gguf\n"
            f"g = open_gguf({str(path)!r})\nprint(g.quantization, len(g.reader.tensors))\n"
            "print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert out[-1] == "False"
