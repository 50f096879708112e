"""Weights moved into one huge-page block (`localpaged.model.huge_pages`): the same values,
the same sharing, 2 MiB pages where Linux gives them, a save/load round trip, and a
file-mapped source dropped from the process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from localpaged.model import huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.available(),
                                reason="no transparent huge pages here (not Linux, or off)")


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(512, 512, bias=False)  # 1 MiB float32 parameter
        self.b = nn.Linear(512, 512, bias=False)
        self.b.weight = self.a.weight  # tied: one tensor, two holders
        whole = torch.arange(2 * 65536, dtype=torch.int32)
        self.register_buffer("first", whole[:65536])  # two views of one storage
        self.register_buffer("second", whole[65536:])
        self.register_buffer("codes", torch.randint(0, 255, (3, 40000), dtype=torch.uint8))
        self.register_buffer("wide", torch.randn(1 << 20))  # 4 MiB: whole huge pages
        self.register_buffer("small", torch.ones(8))  # stays where it is
        # a derived table (as the rotary one): not a weight, stays where it is
        self.register_buffer("table", torch.randn(1 << 18), persistent=False)


def _smaps_kib(address: int, field: str) -> int:
    """`field` (e.g. "Rss", "AnonHugePages") of the mapping holding `address`, in KiB (this
    process's smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == field + ":":
            return int(line.split()[1])
    return 0


def _move(model: nn.Module, drop_sources: bool = False) -> int:
    """The engine's move, all at once; the bytes moved."""
    mover = huge_pages.WeightMover(model, drop_sources)
    while not mover.done:
        mover.step()
    return mover.total


def test_values_and_sharing_are_kept() -> None:
    model = _Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small, table = model.small, model.table
    moved = _move(model)
    assert moved >= (1 << 20) + 2 * 65536 * 4 + 120000 + (4 << 20)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.small is small  # below the size limit: untouched
    assert model.table is table  # a derived table: untouched
    assert model.b.weight is model.a.weight and isinstance(model.a.weight, nn.Parameter)
    assert not model.a.weight.requires_grad
    assert model.first.untyped_storage().data_ptr() == model.second.untyped_storage().data_ptr()
    assert model.second.data_ptr() - model.first.data_ptr() == 65536 * 4
    x = torch.randn(2, 512)
    torch.testing.assert_close(model.b(x), x @ before["a.weight"].T)
    model.codes[0, 0] = 7  # writable, and the views still alias one copy
    model.first[3] = -1
    assert int(model.codes[0, 0]) == 7 and int(model.first[3]) == -1


def test_the_block_starts_on_a_huge_page_boundary_and_gets_huge_pages() -> None:
    model = _Tiny()
    _move(model)
    starts = sorted(t.untyped_storage().data_ptr()
                    for t in (model.a.weight, model.first, model.codes, model.wide))
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    assert _smaps_kib(starts[0], "AnonHugePages") >= 2048  # the first 2 MiB at least (khugepaged aside)


def test_a_moved_model_saves_and_loads(tmp_path: Path) -> None:
    """Each storage is one of its own (torch.save refuses views of one storage as several
    types: what the packed-weights cache writes)."""
    model = _Tiny()
    _move(model)
    torch.save(model, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", mmap=True, weights_only=False)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert _move(back, drop_sources=True) > 0
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert back.b.weight is back.a.weight


def test_a_file_mapped_source_leaves_the_process(tmp_path: Path) -> None:
    """drop_sources: the mapped file's pages go from this process as each storage is copied
    (the peak stays about one model, not two)."""
    big = nn.Module()
    big.register_buffer("w", torch.randint(0, 255, (64 << 20,), dtype=torch.uint8))
    torch.save(big, tmp_path / "big.pt")
    mapped = torch.load(tmp_path / "big.pt", mmap=True, weights_only=False)
    source = mapped.w
    assert int(source.sum()) == int(big.w.sum())  # every page of the file mapped in
    address = source.data_ptr()

    assert _smaps_kib(address, "Rss") >= 60 << 10
    _move(mapped, drop_sources=True)
    assert _smaps_kib(address, "Rss") < 1 << 10
    assert torch.equal(mapped.w, big.w)


def test_a_large_mapped_storage_leaves_the_process_a_piece_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage larger than a piece (a model's embedding table) is not resident twice: its
    mapped pages go after each piece is copied, while the rest of it is still to copy."""
    big = nn.Module()
    big.register_buffer("w", torch.randint(0, 255, (32 << 20,), dtype=torch.uint8))
    torch.save(big, tmp_path / "big.pt")
    mapped = torch.load(tmp_path / "big.pt", mmap=True, weights_only=False)
    address = mapped.w.data_ptr()
    assert int(mapped.w.sum()) == int(big.w.sum())  # every page mapped in
    resident: list[int] = []
    drop = huge_pages._drop_pages

    def spy(start: int, end: int) -> None:
        drop(start, end)
        resident.append(_smaps_kib(address, "Rss"))

    monkeypatch.setattr(huge_pages, "_drop_pages", spy)
    _move(mapped, drop_sources=True)
    assert len(resident) == (32 << 20) // huge_pages.COPY_PIECE
    assert resident == sorted(resident, reverse=True) and resident[0] <= (32 << 10) - (3 << 10)
    assert resident[-1] < 1 << 10
    assert torch.equal(mapped.w, big.w)
