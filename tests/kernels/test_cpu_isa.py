"""The choice of CPU kernel variant from the CPU's flags (`localpaged.kernels.cpu_isa`)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from localpaged.kernels import cpu_isa

# /proc/cpuinfo flags of real CPU classes (the parts that matter here).
HASWELL = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
ZEN3 = HASWELL | {"sha_ni", "vaes"}
ALDER_LAKE = HASWELL | {"avx_vnni", "sha_ni"}
SKYLAKE_SP = HASWELL | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
ICELAKE_SERVER = SKYLAKE_SP | {"avx512_vnni", "avx512vbmi"}
ZEN4 = ICELAKE_SERVER | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
SANDY_BRIDGE = {"sse4_2", "avx"}


@pytest.mark.parametrize(("flags", "best", "bf16"), [
    (set(), "generic", False),
    (SANDY_BRIDGE, "generic", False),
    (HASWELL, "avx2", False),
    (ZEN3, "avx2", False),
    (HASWELL | {"avx512f"}, "avx2", False),  # Xeon Phi-like: AVX-512F without BW/VL
    (ALDER_LAKE, "avx2vnni", False),
    (SKYLAKE_SP, "avx512", False),
    (ICELAKE_SERVER, "avx512vnni", False),
    (ZEN4, "avx512bf16", True),
    (SAPPHIRE_RAPIDS, "amx", True),
])
def test_the_best_variant_follows_the_cpu_flags(flags: set[str], best: str, bf16: bool) -> None:
    assert cpu_isa.best(flags, x86=True) == best
    assert cpu_isa.native_bf16(best) is bf16
    can = cpu_isa.supported(flags, x86=True)
    assert can[0] == "generic" and can == [i for i in cpu_isa.ISAS if i in can]


def test_arm_runs_the_generic_build() -> None:
    assert cpu_isa.supported({"fp", "asimd", "asimddp"}, x86=False) == ["generic"]
    assert cpu_isa.compile_flags("generic") == (() if not cpu_isa.is_x86() else
                                                ("-march=x86-64", "-mtune=generic"))


def test_the_environment_picks_a_variant_but_never_above_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(HASWELL))
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.chosen() == "avx2"
    monkeypatch.setenv(cpu_isa.ENV, "auto")
    assert cpu_isa.chosen() == "avx2"
    monkeypatch.setenv(cpu_isa.ENV, "Generic")
    assert cpu_isa.chosen() == "generic"
    monkeypatch.setenv(cpu_isa.ENV, "avx512bf16")
    with pytest.raises(ValueError, match=r"lacks avx512f.*avx512_bf16.*can run: generic, avx2"):
        cpu_isa.chosen()
    monkeypatch.setenv(cpu_isa.ENV, "sse9")
    with pytest.raises(ValueError, match="unknown"):
        cpu_isa.chosen()


def test_this_machine_runs_its_best_variant_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.chosen() == cpu_isa.best() == cpu_isa.supported()[-1]


@pytest.mark.parametrize("machine", ["aarch64", "arm64"])
def test_an_arm_host_builds_the_generic_variant_without_x86_flags(
        monkeypatch: pytest.MonkeyPatch, machine: str) -> None:
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: machine)
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert not cpu_isa.is_x86()
    assert cpu_isa.chosen() == "generic"
    assert cpu_isa.compile_flags("generic") == ()
    monkeypatch.setenv(cpu_isa.ENV, "avx2")
    with pytest.raises(ValueError, match="not an x86 CPU"):
        cpu_isa.chosen()


def test_a_compiler_without_openmp_builds_without_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Apple's clang rejects -fopenmp: the library is built without it (one thread per call)."""
    from localpaged.kernels import native

    real = native._compiler()
    if real is None:
        pytest.skip("no C compiler here")
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "tiny.c").write_text("int tiny(void) { return 7; }\n")
    fake = tmp_path / "cc-no-openmp"
    fake.write_text("#!/bin/sh\n"
                    'for a in "$@"; do [ "$a" = -fopenmp ] && '
                    '{ echo "clang: error: unsupported option -fopenmp" >&2; exit 1; }; done\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(native, "SOURCES", sources)
    monkeypatch.setenv("LOCALPAGED_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    lib = ctypes.CDLL(str(native.build("tiny", "generic")))
    assert lib.tiny() == 7
