"""The package's C kernel for 4-bit weights on the CPU (`localpaged.quant.cpu_w4`), against
a float32 matmul of the dequantized weight, for every instruction set it builds for here, and
the build machinery around it (`localpaged.kernels.native`)."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import cpu_isa, native
from localpaged.quant import cpu_w4
from localpaged.quant.layout import from_codes

pytestmark = pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here to build the CPU kernels")


def _weight(k: int, n: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 0.005
    zeros = torch.rand(k // group, n, generator=g) * 15  # GGUF Q4_1: float offsets
    return from_codes(codes, scales, zeros, group)


def test_pack_then_dequantize_gives_back_the_weight() -> None:
    w = _weight(96, 48, 32, 0)
    packed, sb = cpu_w4.pack(w)
    assert packed.shape == (3, 48, 16) and sb.shape == (3, 3, 2, 16)
    assert sb.dtype == torch.float16  # the files' own precision: nothing lost on the way
    ref = w.dequantize(torch.float32)
    got = cpu_w4.dequantize(packed, sb)
    # exact up to the float16 rounding of the scales and offsets (2^-11 of each)
    assert (got - ref).abs().max() <= 2**-10 * ref.abs().max()
    q = from_codes(w.codes(), w.scales.half().float(), (w.zeros * w.scales).half().float()
                   / w.scales.half().float(), 32)  # float16 scales and offsets: kept exactly
    torch.testing.assert_close(cpu_w4.dequantize(*cpu_w4.pack(q)), q.dequantize(torch.float32),
                               rtol=0, atol=1e-6)


# What each activation dtype allows against a float32 matmul: bf16 output (and, with AMX, the
# weight rounded to bf16 as a dense copy would be); in float32 only the order of summation.
TOLERANCE = {torch.bfloat16: 2**-6, torch.float32: 2**-18}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize(("k", "n", "group"), [(64, 32, 32), (256, 80, 64), (128, 48, 128)])
def test_matmul_equals_the_dequantized_weight(cpu_variant: str, dtype: torch.dtype, rows: int,
                                              k: int, n: int, group: int) -> None:
    w = _weight(k, n, group, rows)
    packed, sb = cpu_w4.pack(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows)).to(dtype)
    got = cpu_w4.matmul(x, packed, sb)
    assert got.dtype == dtype
    ref = x.double() @ cpu_w4.dequantize(packed, sb).double().t()
    if dtype == torch.float32 and cpu_w4.int8_activations():
        # int8 activations per group: exactly the int8 scheme's sums, up to float32 rounding,
        # and within the scheme's rounding of a float32 matmul
        exact = _int8_reference(x, packed, sb)
        assert (got.double() - exact).abs().max() <= TOLERANCE[dtype] * exact.abs().max()
        assert (got.double() - ref).abs().max() <= INT8_ACTIVATIONS * ref.abs().max()
    else:
        assert (got.double() - ref).abs().max() <= TOLERANCE[dtype] * ref.abs().max()


# int8 activations (max|x| / 127 steps per group) against float32: measured up to 1.1e-2 of
# the largest output on these random shapes, as llama.cpp's own int8 activations.
INT8_ACTIVATIONS = 2**-5


def _int8_reference(x: torch.Tensor, packed: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """x @ W.T as the int8-activation kernels define it, in float64: W times x rounded to
    int8 per group (max|x| / 127 steps)."""
    w = cpu_w4.dequantize(packed, sb).double()
    group = w.shape[1] // sb.shape[1]
    xq, dx = cpu_w4.quantize_activations(x.float(), group)
    rounded = (xq.double().reshape(*dx.shape, group) * dx.double()[..., None]).reshape(x.shape)
    return rounded @ w.t()


def test_quads_layout_holds_the_same_weight() -> None:
    """The quads layout (C and torch conversions alike) reorders the pairs layout's bytes
    and converts back; both dequantize to the weight."""
    w = _weight(256, 48, 32, 0)
    packed, sb = cpu_w4.pack(w)
    quads = cpu_w4.quads_in_torch(packed)
    assert cpu_w4.is_quads(quads) and not cpu_w4.is_quads(packed)
    assert quads.shape == (3, 64, 32) and cpu_w4.fits_quads(packed, sb)
    if cpu_w4.available():
        assert torch.equal(cpu_w4.to_quads(packed), quads)
    assert torch.equal(cpu_w4.to_pairs(quads), packed)
    assert torch.equal(cpu_w4.dequantize(quads, sb), cpu_w4.dequantize(packed, sb))
    # byte 4j + i of chunk c: row 4c+i of column j (low nibble) and of column 8+j (high)
    codes = w.codes()  # [K, N]
    assert int(quads[1, 5, 4 * 3 + 2]) == int(codes[22, 16 + 3]) | int(codes[22, 16 + 11]) << 4


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 13])
@pytest.mark.parametrize(("k", "n", "group"), [(64, 32, 32), (1536, 576, 64), (256, 80, 128),
                                              (96, 48, 12)])  # odd chunks per group
@pytest.mark.parametrize("layout", ["pairs", "quads"])
def test_int8_activation_loops_equal_the_plain_ones(cpu_variant: str, rows: int, k: int, n: int,
                                                    group: int, layout: str) -> None:
    """The vector loops of each build against its plain-C loops and the torch reference, for
    both 4-bit layouts."""
    w = _weight(k, n, group, rows)
    packed, sb = cpu_w4.pack(w)
    if layout == "quads":
        packed = cpu_w4.to_quads(packed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    fast = cpu_w4.matmul_int8_activations(x, packed, sb)
    plain = cpu_w4.matmul_int8_activations(x, packed, sb, plain=True)
    exact = _int8_reference(x, packed, sb)
    for got in (fast, plain):
        assert (got.double() - exact).abs().max() <= 2**-18 * exact.abs().max()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 17, 33])
@pytest.mark.parametrize(("block", "offsets", "half"), [(32, False, True), (32, False, False),
                                                   (16, False, False), (32, True, False),
                                                   (64, True, True)],
                         ids=["q8_0", "b32-f32", "b16", "b32-offsets", "b64-offsets-f16"])
def test_q8_blocks_equal_the_int8_product(cpu_variant: str, rows: int, block: int,
                                          offsets: bool, half: bool) -> None:
    """8-bit blocks (GGUF Q8_0, and the types converted to them) against the int8 scheme in
    float64, on the vector and the plain loops, and within int8 rounding of float32; a row's
    product the same bits however many rows share its pass over a tile (on AMX, 16-row passes
    through `tdpbssd` from 16 rows on: 17 and 33 rows take one and two of them, the rest the
    vector tiles). float16 scales (Q8_0's own) stay float16 in the tiles and give the float32
    scales' product of the same values, bit for bit."""
    assert (native.library().q8_amx_rows() == 16) == (cpu_variant == "amx")
    g = torch.Generator().manual_seed(rows)
    n, k = 48, 128
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // block, generator=g) * 0.01
    if half:
        scales = scales.half()
    offs = torch.randn(n, k // block, generator=g) * 0.01 if offsets else None
    tiles, tile_scales, tile_offsets = cpu_w4.pack_q8(codes, scales, offs)
    assert tile_scales.dtype == (torch.float16 if half else torch.float32)
    if half:
        wide = cpu_w4.pack_q8(codes, scales.float(), offs)[1]
        for plain in (False, True):
            x1 = torch.randn(rows, k, generator=g)
            assert torch.equal(cpu_w4.matmul_q8(x1, tiles, tile_scales, tile_offsets, plain=plain),
                               cpu_w4.matmul_q8(x1, tiles, wide, tile_offsets, plain=plain))
    w = codes.double() * scales.double().repeat_interleave(block, dim=1)
    if offs is not None:
        w += offs.double().repeat_interleave(block, dim=1)
    torch.testing.assert_close(cpu_w4.dequantize_q8(tiles, tile_scales, tile_offsets).double(), w)
    x = torch.randn(rows, k, generator=g)
    xq, dx = cpu_w4.quantize_activations(x, block)
    rounded = (xq.double().reshape(rows, k // block, block) * dx.double()[..., None]).reshape(rows, k)
    exact = rounded @ w.t()
    for plain in (False, True):
        got = cpu_w4.matmul_q8(x, tiles, tile_scales, tile_offsets, plain=plain)
        assert (got.double() - exact).abs().max() <= 2**-18 * exact.abs().max()
    ref = x.double() @ w.t()
    assert (got.double() - ref).abs().max() <= INT8_ACTIVATIONS * ref.abs().max()
    fast = cpu_w4.matmul_q8(x, tiles, tile_scales, tile_offsets)
    for r in range(rows):
        assert torch.equal(fast[r:r + 1], cpu_w4.matmul_q8(x[r:r + 1], tiles, tile_scales, tile_offsets))
    # bf16 rows (the native decode plan of a bf16 model): read as they are, the product
    # rounded to bf16, the float32 path's numbers exactly
    xb = x.bfloat16()
    yb = torch.empty(rows, n, dtype=torch.bfloat16)
    assert native.library().q8_gemm_bf16(
        xb.data_ptr(), tiles.data_ptr(), tile_scales.data_ptr(), int(half),
        tile_offsets.data_ptr() if tile_offsets is not None else None, yb.data_ptr(), rows, k,
        n, block, torch.get_num_threads()) == 0
    assert torch.equal(yb, cpu_w4.matmul_q8(xb, tiles, tile_scales, tile_offsets).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_w8_matmul_equals_the_int8_product(cpu_variant: str, dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (96, 64), generator=g, dtype=torch.int8)
    scales = torch.rand(96, generator=g) * 0.01
    x = torch.randn(rows, 64, generator=g).to(dtype)
    got = cpu_w4.matmul_w8(x, cpu_w4.pack_w8(codes), scales)
    assert got.dtype == dtype
    ref = (x.double() @ codes.double().t()) * scales.double()
    assert (got.double() - ref).abs().max() <= TOLERANCE[dtype] / 2 * ref.abs().max()


@pytest.mark.parametrize("isa", cpu_isa.ISAS)
def test_sources_compile_without_warnings(tmp_path, isa: str) -> None:
    """Every variant compiles warning-free on any machine (compiling needs no such CPU):
    warnings of one compiler are errors of the next (implicit declarations in GCC 14)."""
    import subprocess

    cc = native._compiler()
    flags = [*native.FLAGS, *cpu_isa.compile_flags(isa), "-Wall", "-Wextra", "-Werror"]
    done = subprocess.run([cc, *flags, str(native.SOURCES / "all.c"), "-o", str(tmp_path / "x.so")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_each_build_takes_the_path_it_names(cpu_variant: str) -> None:
    """2 = AMX, 1 = AVX512-BF16, 0 = plain C: each variant really runs its own path."""
    want = {"amx": 2, "avx512bf16": 1}.get(cpu_variant, 0)
    assert native.library().w4_gemm_isa() == want
    assert cpu_w4.int8_activations() == (cpu_variant != "generic")


def test_float32_layers_take_the_kernel_where_it_holds_the_weight(cpu_variant: str) -> None:
    """Float32 layers: on the kernel where its float16 scales hold the weight exactly, or
    where its activations are int8 anyway (then the scales' rounding is far below that);
    elsewhere the exact path."""
    from localpaged.quant.linear import QuantLinear

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 32), generator=g, dtype=torch.int32)
    s = (torch.rand(2, 32, generator=g) * 0.01 + 0.001).half().float()
    gguf_like = from_codes(codes, s, torch.full_like(s, 8.0), 32)  # Q4_0: offset -8 * d
    awq_like = from_codes(codes, s, torch.randint(1, 16, s.shape, generator=g).float(), 32)
    assert cpu_w4.holds_exactly(gguf_like) and not cpu_w4.holds_exactly(awq_like)
    own = QuantLinear.from_int4(gguf_like, None, torch.float32, "cpu")
    other = QuantLinear.from_int4(awq_like, None, torch.float32, "cpu")
    int8 = cpu_w4.int8_activations()
    assert own.w4_packed is not None
    assert cpu_w4.is_quads(own.w4_packed) == cpu_w4.quads_wanted()  # the int8 kernel's own
    assert cpu_w4.quads_wanted() == (cpu_variant != "generic")  # x86 builds: from AVX2 up
    assert (other.w4_packed is not None) == int8 and (other.qweight is not None) != int8
    x = torch.randn(3, 64, generator=g)
    for layer, w in ((own, gguf_like), (other, awq_like)):
        want = x.double() @ w.dequantize(torch.float32).double().t()
        if layer.w4_packed is not None and int8:
            want = _int8_reference(x, layer.w4_packed, layer.w4_sb)
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    assert QuantLinear.from_int4(awq_like, None, torch.bfloat16, "cpu").w4_packed is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_matmul_from_a_background_thread(cpu_variant: str, dtype: torch.dtype) -> None:
    """The engine calls the kernels from its own thread, whose heap ends where the main
    thread's does not: a read past x crashed there (and only there) once."""
    import threading

    w = _weight(1536, 576, 32, 11)  # SmolLM2's down_proj
    packed, sb = cpu_w4.pack(w)
    ref = cpu_w4.dequantize(packed, sb).double().t()
    codes = torch.randint(-127, 128, (8192, 576), generator=torch.Generator().manual_seed(5),
                          dtype=torch.int8)  # an int8 head
    tiles, scales = cpu_w4.pack_w8(codes), torch.rand(8192) * 0.01
    q8_tiles, q8_scales, _ = cpu_w4.pack_q8(codes, scales[:, None].expand(8192, 18))
    q8_ref = cpu_w4.dequantize_q8(q8_tiles, q8_scales).double().t()
    int8 = dtype == torch.float32 and cpu_w4.int8_activations()
    errors: dict[str, list[float]] = {"w4": [], "w8": [], "q8": []}

    def error(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    def work() -> None:
        for i in range(200):
            x = torch.randn((10, 17, 18, 88)[i % 4], 1536).to(dtype)
            got = cpu_w4.matmul(x, packed, sb)
            head = cpu_w4.matmul_w8(x[:, :576].contiguous(), tiles, scales)
            q8 = cpu_w4.matmul_q8(x[:, :576].contiguous(), q8_tiles, q8_scales)
            if i % 20 == 0:
                errors["w4"].append(error(got, x.double() @ ref))
                want = (x[:, :576].double() @ codes.double().t()) * scales.double()
                errors["w8"].append(error(head, want))
                errors["q8"].append(error(q8, x[:, :576].double() @ q8_ref))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert all(len(e) == 10 for e in errors.values())
    assert max(errors["w4"]) <= (INT8_ACTIVATIONS if int8 else TOLERANCE[dtype])
    assert max(errors["w8"]) <= TOLERANCE[dtype]
    assert max(errors["q8"]) <= INT8_ACTIVATIONS


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 40])
@pytest.mark.parametrize(("k", "n", "group"), [(64, 32, 32), (1536, 576, 64), (96, 48, 12)])
def test_bf16_takes_the_quads_layout_on_avx512_bf16(cpu_variant: str, rows: int, k: int, n: int,
                                                    group: int) -> None:
    """On the builds with AVX512-BF16 (with AMX or without) bf16 layers keep the quads layout,
    as float32 ones do: its rows go through int8 activations, giving the pairs layout's int8
    product bit for bit where that one is int8 too (groups of a multiple of 8; on AMX up to 2
    rows), and on AMX the products of many rows go to AMX tiles unpacked from the quads layout
    (the weight rounded to bf16, the activations as they are). Elsewhere the quads layout
    refuses bf16."""
    from localpaged.quant.linear import QuantLinear

    lib = native.library()
    keeps = bool(lib.w4_bf16_quads())
    assert keeps == (cpu_variant in ("avx512bf16", "amx"))
    assert cpu_w4.quads_wanted(torch.bfloat16) == keeps
    w = _weight(k, n, group, rows)
    packed, sb = cpu_w4.pack(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    quads = cpu_w4.to_quads(packed)
    if not keeps:
        with pytest.raises(ValueError, match="quads layout takes float32"):
            cpu_w4.matmul(x, quads, sb)
        return
    got = cpu_w4.matmul(x, quads, sb)
    assert got.dtype == torch.bfloat16
    amx_from = lib.w4_bf16_quads_amx_rows()
    assert bool(amx_from) == (lib.w4_gemm_isa() == 2)
    on_amx = bool(amx_from) and rows >= amx_from and k % 32 == 0
    if on_amx:  # bf16 weights, float32 sums
        exact = x.double() @ cpu_w4.dequantize(packed, sb).bfloat16().double().t()
    else:
        exact = _int8_reference(x, packed, sb)
        if group % 8 == 0 and (lib.w4_gemm_isa() != 2 or rows <= 2):
            assert torch.equal(got, cpu_w4.matmul(x, packed, sb))
    assert (got.double() - exact).abs().max() <= 2**-7 * exact.abs().max()  # bf16 output
    layer = QuantLinear.from_int4(w, None, torch.bfloat16, "cpu")
    assert cpu_w4.is_quads(layer.w4_packed) and torch.equal(layer(x), got)
