"""The collector pauses of start-up (`localpaged.gc_pause`): torch imported with the collector
paused and its objects frozen, the collector as it was afterwards, and nothing else changed."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from localpaged.gc_pause import collector_paused

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout.split()


def test_torch_imported_after_localpaged_is_frozen_and_looks_as_usual() -> None:
    out = _run("import gc, importlib.machinery as m\n"
               "import localpaged\n"
               "before = gc.get_freeze_count()\n"
               "import torch\n"
               "print(before, gc.get_freeze_count(), gc.isenabled(),\n"
               "      type(torch.__loader__) is m.SourceFileLoader,\n"
               "      torch.__spec__.loader is torch.__loader__, torch.ones(2).sum().item())")
    assert out[0] == "0" and int(out[1]) > 10_000  # torch's own objects, out of collections
    assert out[2:] == ["True", "True", "True", "2.0"]


def test_a_collector_disabled_by_the_program_stays_disabled() -> None:
    out = _run("import gc\ngc.disable()\nimport localpaged, torch\nprint(gc.isenabled())")
    assert out == ["False"]


def test_other_imports_still_go_through_every_finder() -> None:
    """The finder answers only for torch, and the finders after it are all still asked."""
    out = _run("import sys\nimport localpaged\n"
               "asked = []\n"
               "class Spy:\n"
               "    @staticmethod\n"
               "    def find_spec(name, path=None, target=None):\n"
               "        asked.append(name)\n"
               "sys.meta_path.insert(1, Spy)\n"
               "import torch, colorsys\n"
               "print('colorsys' in asked, 'torch' in asked)")
    assert out == ["True", "False"]  # torch answered by the pausing finder, the rest not


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_restores_the_collector_even_on_error(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(RuntimeError), collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("load failed")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
