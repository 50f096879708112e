"""The C decode-attention kernel (`localpaged.kernels.attention_cpu`), against plain float32
attention over each request's context read out of its blocks, and the dispatch to it."""

from __future__ import annotations

import pytest
import torch

from localpaged.kernels import attention_cpu, native
from localpaged.kernels.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(not native.has_compiler(), reason="no C compiler here to build the CPU kernels")


def _batch(g: torch.Generator, lens: list[int], heads: int, kv_heads: int, dim: int, bs: int):
    """Random bf16 caches, block tables over shuffled blocks, and a decode query per request."""
    n_blocks = sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.randn(n_blocks, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(n_blocks, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    order = torch.randperm(n_blocks, generator=g).tolist()
    width = max(-(-n // bs) for n in lens) + 1  # padded past every request's blocks
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[i, j] = order.pop()
    q = torch.randn(len(lens), heads, dim, generator=g).to(torch.bfloat16)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _reference(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    bs, rep = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = []
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, :-(-n // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(rep, 1)
        v = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(rep, 1)
        w = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        out.append(torch.einsum("hl,lhd->hd", w.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"),
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16)])
@pytest.mark.parametrize("lens", [[1], [37], [1, 16, 17, 200, 5]])
def test_decode_kernel_equals_plain_attention(heads, kv_heads, dim, bs, lens, cpu_variant) -> None:
    g = torch.Generator().manual_seed(sum(lens) + dim)
    q, k_cache, v_cache, tables, seq_lens = _batch(g, lens, heads, kv_heads, dim, bs)
    got = attention_cpu.paged_decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens,
                                                   dim**-0.5)
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, dim**-0.5)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=1e-2)  # bf16 output


def test_paged_attention_takes_the_kernel_for_16_bit_caches_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, tables, seq_lens = _batch(g, [5, 20], 6, 2, 32, 16)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(2, dtype=torch.long), block_tables=tables,
            seq_lens=seq_lens, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            max_query_len=1, max_seq_len=20)

    step = meta()
    out = paged_attention(q, k_cache, v_cache, step, 32**-0.5)
    assert step.derived["attn.cpu_kernel"] is True
    step = meta()
    as_float = paged_attention(q.float(), k_cache.float(), v_cache.float(), step, 32**-0.5)
    assert step.derived["attn.cpu_kernel"] is False  # float32 cache: the torch path
    torch.testing.assert_close(out.float(), as_float, rtol=2e-2, atol=1e-2)
    step = meta()  # a float32 model's float16 cache: the kernel's float32-over-float16 build
    over_half = paged_attention(q.float(), k_cache.half(), v_cache.half(), step, 32**-0.5)
    assert step.derived["attn.cpu_kernel"] is True and over_half.dtype == torch.float32
    torch.testing.assert_close(over_half, as_float, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("LOCALPAGED_CPU_KERNELS", "off")
    step = meta()
    paged_attention(q, k_cache, v_cache, step, 32**-0.5)
    assert step.derived["attn.cpu_kernel"] is False


# The kernel's builds: (query and output, cache) types. float32 over float16 is a float32
# model's (its cache is float16 on the CPU); float32 over float32 is kept for callers that ask.
BUILDS = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
          (torch.float32, torch.float16)]
KERNELS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32",
           torch.float16: "paged_decode_f32h"}


def _kernel(q, k_cache, v_cache, tables, seq_lens, scale, threads: int = 2) -> torch.Tensor:
    """The kernel's build for the cache's type (bf16, float32, or float16 under a float32
    query), on `threads` threads."""
    lib = native.library()
    out = torch.empty_like(q)
    kernel = getattr(lib, KERNELS[k_cache.dtype])
    assert kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                  tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1],
                  k_cache.shape[2], q.shape[2], k_cache.shape[1], scale, threads) == 0
    return out


@pytest.mark.parametrize(("dtype", "cache_dtype"), BUILDS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"),
                         [(9, 3, 64, 16), (8, 1, 128, 8), (6, 2, 96, 16), (4, 4, 40, 8)])
def test_prompt_chunk_rows_equal_plain_attention(heads, kv_heads, dim, bs, dtype, cache_dtype,
                                                 cpu_variant) -> None:
    """A prompt chunk as rows (one per token: the request's blocks, contexts growing by one,
    taken together by the kernel), between decode rows of other requests, in runs longer than
    the kernel's groups (16 to 48 rows, by the rows and threads; a run's last row never left
    alone) and shorter, starting mid-block and at position 0; head sizes that fill the vector
    loops and that leave a remainder. One thread takes the widest groups, eight the narrowest:
    the same bits."""
    g = torch.Generator().manual_seed(dim + bs)
    lens = [40, 52, 5, 200, 130]  # decode rows and the chunks' full contexts
    _, k_cache, v_cache, tables, _ = _batch(g, lens, heads, kv_heads, dim, bs)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    rows: list[tuple[int, int]] = [(0, 40)]  # (request, context)
    rows += [(1, n) for n in range(12, 53)]  # a 41-token chunk: one group, or several
    rows += [(2, n) for n in range(1, 6)]  # a whole 5-token prompt from position 0
    rows += [(3, n) for n in range(150, 183)]  # 33 tokens: groups of 16 would leave one row
    rows += [(4, n) for n in range(31, 131)]  # 100 tokens: longer than the widest group
    rows += [(3, 200), (3, 199)]  # not consecutive: one row each
    row_tables = torch.stack([tables[r] for r, _ in rows]).contiguous()
    row_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(len(rows), heads, dim, generator=g).to(torch.bfloat16)
    ref = _reference(q, k_cache, v_cache, row_tables, row_lens, dim**-0.5)
    if dtype == torch.bfloat16:
        got = attention_cpu.paged_decode_attention_cpu(q, k_cache, v_cache, row_tables, row_lens,
                                                       dim**-0.5)
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=1e-2)  # bf16 output
    else:  # float32 queries; the float16 cache's values are exact, so is the reference's
        got = _kernel(q.float(), k_cache, v_cache, row_tables, row_lens, dim**-0.5)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # The same bits however the kernel groups the rows (every build).
    wide, narrow = (_kernel(q.to(dtype), k_cache, v_cache, row_tables, row_lens, dim**-0.5,
                            threads) for threads in (1, 8))
    assert torch.equal(wide, got) and torch.equal(narrow, got)
    # A row's result does not depend on the rows around it (bits; the builds `paged_attention`
    # takes).
    alone = [attention_cpu.paged_decode_attention_cpu(q[i:i + 1].to(dtype), k_cache, v_cache,
                                                      row_tables[i:i + 1], row_lens[i:i + 1],
                                                      dim**-0.5)
             for i in (0, len(rows) - 1)] if cache_dtype != torch.float32 else []
    for i, one in zip((0, len(rows) - 1), alone):
        assert torch.equal(one, got[i:i + 1])


@pytest.mark.parametrize(("dtype", "cache_dtype"), BUILDS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [(8, 8, 64, 16), (8, 2, 128, 16)])
def test_long_decode_rows_in_stretches_equal_plain_attention(heads, kv_heads, dim, bs, dtype,
                                                             cache_dtype, cpu_variant) -> None:
    """Decode rows whose contexts the kernel cuts into stretches (64 keys or more), shared by the
    threads and joined after (lengths of one stretch, of several, and one past a whole
    stretch), equal plain attention; a row gives the same bits alone as beside the others,
    and alone on 1 to 8 threads (few stretches are cut by KV heads too, as many as the
    threads want)."""
    g = torch.Generator().manual_seed(dim + kv_heads)
    lens = [3, 700, 1, 1200, 129]
    q, k_cache, v_cache, tables, seq_lens = _batch(g, lens, heads, kv_heads, dim, bs)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    ref = _reference(q, k_cache, v_cache, tables, seq_lens, dim**-0.5)
    if dtype == torch.bfloat16:
        def run(i: slice) -> torch.Tensor:
            return attention_cpu.paged_decode_attention_cpu(
                q[i], k_cache, v_cache, tables[i], seq_lens[i], dim**-0.5)
        got = run(slice(None))
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=1e-2)
    else:
        def run(i: slice, threads: int = 2) -> torch.Tensor:
            return _kernel(q[i].float().contiguous(), k_cache, v_cache, tables[i].contiguous(),
                           seq_lens[i].contiguous(), dim**-0.5, threads)
        got = run(slice(None))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        for i in (0, 4):
            for threads in (1, 8):
                assert torch.equal(run(slice(i, i + 1), threads), got[i:i + 1])
    for i in (1, 3, 4):
        assert torch.equal(run(slice(i, i + 1)), got[i:i + 1])


def test_the_torch_path_over_a_float16_cache_computes_in_float32() -> None:
    """Prompt chunks (the torch path) of a float32 query over a float16 cache: the values
    widened exactly, the same bits as over a float32 cache holding them."""
    g = torch.Generator().manual_seed(3)
    _, k_cache, v_cache, tables, _ = _batch(g, [30, 12], 6, 2, 32, 16)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    q = torch.randn(7, 6, 32, generator=g)  # 4 new tokens of request 0, 3 of request 1
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(7, dtype=torch.long), block_tables=tables,
        seq_lens=torch.tensor([30, 12], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 4, 7], dtype=torch.int32), max_query_len=4,
        max_seq_len=30)
    over_half = paged_attention(q, k_cache, v_cache, meta, 32**-0.5)
    assert over_half.dtype == torch.float32
    meta.derived.clear()
    assert torch.equal(over_half, paged_attention(q, k_cache.float(), v_cache.float(), meta,
                                                  32**-0.5))
