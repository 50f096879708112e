"""llama.cpp's own quantizer, for tests and the fixture script: llama-cpp-python in this
process when importable, else a peers python that has it (`PEERS_PYTHON`, default
/work/peers-venv/bin/python, as benchmarks/compare_cpu.py), running this file as a script.
The project's own venv never needs llama-cpp-python: without either, `find()` says why.

Run as a script (in the peers python):
    llamacpp_peer.py rows IN.npy GGML_TYPE_ID OUT.npy     quantize float32 rows
    llamacpp_peer.py model IN.gguf OUT.gguf FTYPE_ID      llama_model_quantize
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_PEERS_PYTHON = "/work/peers-venv/bin/python"


def _ggml_lib() -> Any:
    """llama-cpp-python's bundled ggml library holding `ggml_quantize_chunk`."""
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(folder.glob("libggml-base.*")) + sorted(folder.glob("libggml.*"))
    for path in candidates:
        lib = ctypes.CDLL(str(path))
        if hasattr(lib, "ggml_quantize_chunk"):
            return lib
    raise RuntimeError(f"no ggml_quantize_chunk in {folder}")


def _quantize_rows_here(x: Any, type_id: int) -> Any:
    """llama.cpp's quantization of float32 rows `[n, k]` as uint8 `[n, row bytes]`."""
    import numpy as np

    lib = _ggml_lib()
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x.shape
    row = lib.ggml_row_size(type_id, k)
    out = np.zeros((n, row), dtype=np.uint8)
    written = lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, n, k, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def _quantize_model_here(src: str, dst: str, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = min(os.cpu_count() or 1, 4)
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, ftype {ftype}) returned {rc}")


class LlamaCpp:
    """llama.cpp's quantizer, in this process (`python` None) or in a peers python."""

    def __init__(self, python: str | None) -> None:
        self.python = python

    def __repr__(self) -> str:
        return f"LlamaCpp({self.python or 'in process'})"

    def _run(self, *args: str) -> None:
        proc = subprocess.run([str(self.python), __file__, *args], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{self.python} {Path(__file__).name} {' '.join(args)} failed:\n"
                               f"{proc.stderr[-3000:]}")

    def quantize_rows(self, x: Any, type_id: int) -> Any:
        """float32 `[n, k]` -> the GGML type's bytes `[n, row bytes]` (uint8)."""
        if self.python is None:
            return _quantize_rows_here(x, type_id)
        import numpy as np

        with tempfile.TemporaryDirectory() as tmp:
            src, dst = Path(tmp) / "x.npy", Path(tmp) / "q.npy"
            np.save(src, np.ascontiguousarray(x, dtype=np.float32))
            self._run("rows", str(src), str(type_id), str(dst))
            return np.load(dst)

    def quantize_model(self, src: Path, dst: Path, ftype: int) -> None:
        """llama.cpp's `llama_model_quantize` (a preset such as Q4_K_M = 15) into `dst`."""
        tmp = dst.with_name(dst.name + ".part")
        if self.python is None:
            _quantize_model_here(str(src), str(tmp), ftype)
        else:
            self._run("model", str(src), str(tmp), str(ftype))
        tmp.rename(dst)


def find() -> tuple[LlamaCpp | None, str]:
    """(the quantizer, "") or (None, why there is none)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pass
    else:
        return LlamaCpp(None), ""
    python = os.environ.get("PEERS_PYTHON", DEFAULT_PEERS_PYTHON)
    if not Path(python).exists():
        return None, (f"llama-cpp-python is not importable and no peers python at {python} "
                      "(set PEERS_PYTHON)")
    probe = subprocess.run([python, "-c", "import llama_cpp, numpy"], capture_output=True)
    if probe.returncode:
        return None, f"{python} cannot import llama_cpp (llama-cpp-python) and numpy"
    return LlamaCpp(python), ""


def _main(argv: list[str]) -> None:
    import numpy as np

    if argv[0] == "rows":
        np.save(argv[3], _quantize_rows_here(np.load(argv[1]), int(argv[2])))
    elif argv[0] == "model":
        _quantize_model_here(argv[1], argv[2], int(argv[3]))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])
