"""The choice of CPU kernel variant from the CPU's flags (`localpaged.kernels.cpu_isa`)."""

from __future__ import annotations

import pytest

from localpaged.kernels import cpu_isa

# /proc/cpuinfo flags of real CPU classes (the parts that matter here).
HASWELL = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}
ZEN3 = HASWELL | {"sha_ni", "vaes"}
ICELAKE_SERVER = HASWELL | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                            "avx512_vnni", "avx512vbmi"}
ZEN4 = ICELAKE_SERVER | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
SANDY_BRIDGE = {"sse4_2", "avx"}


@pytest.mark.parametrize(("flags", "best", "bf16"), [
    (set(), "generic", False),
    (SANDY_BRIDGE, "generic", False),
    (HASWELL, "avx2", False),
    (ZEN3, "avx2", False),
    (HASWELL | {"avx512f"}, "avx2", False),  # Xeon Phi-like: AVX-512F without BW/VL
    (ICELAKE_SERVER, "avx512", False),
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
