"""The CPU kernels cross-built for aarch64 (gcc and clang, with and without OpenMP) and run
under qemu-user against the x86 plain-C build and torch (`scripts/check_arm.py`).

Off by default (cross-compiling takes a while): `LOCALPAGED_ARM_CHECK=1` turns it on where
`aarch64-linux-gnu-gcc`, `qemu-aarch64` and `clang` are installed. What always runs: the
driver's hand-written prototypes and calls against the library's signatures, so a changed
entry point fails here and not in the next session's cross-check."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from localpaged.kernels import native

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_arm.py"
DRIVER = SCRIPT.parent / "arm" / "kernel_check.c"


def _arity(params: str) -> int:
    return 0 if params.strip() in ("", "void") else params.count(",") + 1


def test_the_drivers_prototypes_and_calls_match_the_library() -> None:
    source = DRIVER.read_text()
    declared = {name: _arity(params) for name, params in
                re.findall(r"^(?:int|void) (\w+)\(([^)]*)\);", source, re.M)}
    called = {name: _arity(params) for name, params in
              re.findall(r'"(\w+)"\)\)\s*(?:return )?\1\(([^;]*)\);', source)}
    assert len(declared) >= 20 and set(called) <= set(declared)
    for name, count in declared.items():
        assert count == len(native.SIGNATURES[name][0]), name
    for name, count in called.items():
        assert count == declared[name], name


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LOCALPAGED_ARM_CHECK") != "1",
                    reason="set LOCALPAGED_ARM_CHECK=1 to cross-build and run under qemu")
@pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here")
def test_the_aarch64_builds_match_the_x86_plain_build() -> None:
    spec = importlib.util.spec_from_file_location("check_arm", SCRIPT)
    assert spec is not None and spec.loader is not None
    check_arm = importlib.util.module_from_spec(spec)
    sys.modules["check_arm"] = check_arm  # its dataclasses look their module up
    spec.loader.exec_module(check_arm)
    builds = [b for b in check_arm.BUILDS if not check_arm.tools([b])]
    if not builds:
        pytest.skip("no aarch64 cross compiler or qemu-aarch64 here")
    assert check_arm.check(builds, log=lambda line: None) == []
