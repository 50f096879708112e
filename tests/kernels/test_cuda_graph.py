"""The CUDA-graph decode helper: padding logic everywhere, capture and replay on a GPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from localpaged.kernels import AttentionMetadata, paged_attention, write_kv
from localpaged.kernels.cuda_graph import CudaGraphRunner, graphs_enabled, padded_batch_size
from localpaged.kernels.testing import make_paged_batch


def test_padded_batch_size() -> None:
    sizes = [1, 2, 4, 8]
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_switched_off_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALPAGED_CUDA_GRAPHS", "0")
    assert not graphs_enabled()
    runner = CudaGraphRunner(lambda x: x * 2)
    runner.capture({"x": torch.ones(4)})  # no-op when off (and on CPU-only machines)
    assert not runner.graphs
    assert torch.equal(runner(x=torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))


class _ReplayOnCpu(CudaGraphRunner):
    """Stands in a "graph" that re-runs fn on the static buffers, to test the padding and
    buffer logic where there is no GPU."""

    def _capture_one(self, args: dict[str, torch.Tensor], pool: object
                     ) -> tuple[object, torch.Tensor]:
        out = self.fn(**args)
        runner = self

        class Graph:
            def replay(self) -> None:
                out.copy_(runner.fn(**args))

            def pool(self) -> None:
                return None

        return Graph(), out


def test_replay_pads_inputs_and_slices_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALPAGED_CUDA_GRAPHS", raising=False)
    seen: list[dict[str, torch.Tensor]] = []

    def fn(x: torch.Tensor, slot_mapping: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        seen.append({"x": x.clone(), "slot_mapping": slot_mapping.clone(), "tables": tables.clone()})
        return x * 2 + tables.sum(-1, keepdim=True)

    runner = _ReplayOnCpu(fn, batch_sizes=[1, 2, 4, 16], pad_values={"tables": 7})
    runner.capture(dict(x=torch.zeros(4, 3), slot_mapping=torch.zeros(4, dtype=torch.long),
                        tables=torch.zeros(4, 5, dtype=torch.int32)))
    assert sorted(runner.graphs) == [1, 2, 4]  # sizes above the example's batch are dropped
    big = dict(x=torch.ones(4, 3), slot_mapping=torch.arange(4), tables=torch.ones(4, 5,
                                                                                   dtype=torch.int32))
    torch.testing.assert_close(runner(**big), torch.full((4, 3), 7.0))
    small = dict(x=torch.full((3, 3), 2.0), slot_mapping=torch.tensor([5, 6, 7]),
                 tables=torch.ones(3, 2, dtype=torch.int32))  # narrower tables
    out = runner(**small)
    assert out.shape == (3, 3)
    last = seen[-1]  # what the replayed graph saw: padded to 4 rows, nothing left from `big`
    assert last["slot_mapping"].tolist() == [5, 6, 7, -1]
    assert last["tables"].tolist() == [[1, 1, 7, 7, 7]] * 3 + [[7] * 5]
    torch.testing.assert_close(out, torch.full((3, 3), 4.0 + 23))
    assert torch.equal(runner(x=torch.ones(5, 3), slot_mapping=torch.arange(5),
                              tables=torch.zeros(5, 5, dtype=torch.int32)), torch.full((5, 3), 2.0))


def _decode_step(k_cache: torch.Tensor, v_cache: torch.Tensor, max_seq_len: int,
                 scale: float) -> Callable[..., torch.Tensor]:
    """A decode "forward" over fixed caches, as the engine's would close over its model."""
    def step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor) -> torch.Tensor:
        b = query.shape[0]
        qsl = torch.arange(b + 1, dtype=torch.int32, device=query.device)
        meta = AttentionMetadata(slot_mapping, block_tables, seq_lens, qsl, 1, max_seq_len)
        write_kv(key, value, k_cache, v_cache, slot_mapping)
        return paged_attention(query, k_cache, v_cache, meta, scale)
    return step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_capture_and_replay_match_eager() -> None:
    dev, bs, hq, hkv, d, max_blocks = "cuda", 16, 8, 2, 64, 32
    seq_lens = [1, 17, 300, 5, 16, 90, 2]
    q, kc, vc, meta = make_paged_batch([1] * 7, seq_lens, hq, hkv, d, bs, torch.float16, dev)
    key = torch.randn(7, hkv, d, dtype=torch.float16, device=dev)
    value = torch.randn_like(key)
    tables = torch.zeros(7, max_blocks, dtype=torch.int32, device=dev)
    tables[:, : meta.block_tables.shape[1]] = meta.block_tables
    kc_ref, vc_ref = kc.clone(), vc.clone()
    eager = _decode_step(kc_ref, vc_ref, max_blocks * bs, d**-0.5)
    runner = CudaGraphRunner(_decode_step(kc, vc, max_blocks * bs, d**-0.5), [1, 2, 4, 8])
    runner.capture(dict(
        query=torch.zeros(8, hq, d, dtype=q.dtype, device=dev),
        key=torch.zeros(8, hkv, d, dtype=q.dtype, device=dev),
        value=torch.zeros(8, hkv, d, dtype=q.dtype, device=dev),
        slot_mapping=torch.full((8,), -1, device=dev),  # capture writes nothing
        block_tables=torch.zeros(8, max_blocks, dtype=torch.int32, device=dev),
        seq_lens=torch.zeros(8, dtype=torch.int32, device=dev)))
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    assert torch.equal(kc, kc_ref)
    for n in (1, 3, 7):  # 3 and 7 replay the padded graphs of 4 and 8
        inputs = dict(query=q[:n], key=key[:n], value=value[:n],
                      slot_mapping=meta.slot_mapping[:n],
                      block_tables=tables[:n, : 2 + n],  # narrower tables are padded too
                      seq_lens=meta.seq_lens[:n].clamp(max=(2 + n) * bs))
        ref = eager(**inputs)
        out = runner(**inputs)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
