"""The own GGUF reader (`localpaged.model.gguf_reader`) reads what the `gguf` package's
`GGUFReader` reads: every metadata value type, string and numeric arrays (read on demand),
and the tensors' types, shapes, offsets and bytes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from localpaged.model.gguf_reader import FastGGUFReader, GGUFFormatError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ggml_types.gguf"


def _write(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.125)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_token_list(["<s>", "a", "ß", "", "✓✓"])
    w.add_token_scores([0.0, -1.5, 2.25, 3.0, -0.5])
    w.add_token_types([1, 1, 3, 6, 1])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same(path: Path) -> FastGGUFReader:
    want = gguf.GGUFReader(path)
    got = FastGGUFReader(path)
    assert list(got.fields) == [k for k in want.fields if not k.startswith("GGUF.")]
    for key, field in got.fields.items():
        assert field.contents() == want.fields[key].contents(), key
        assert len(field) == len(want.fields[key].data), key
    assert len(got.tensors) == len(want.tensors)
    for a, b in zip(got.tensors, want.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)
    return got


def test_every_value_type_reads_like_gguf(tmp_path: Path) -> None:
    got = _same(_write(tmp_path / "all.gguf"))
    assert got.fields["tokenizer.ggml.tokens"].strings()[2] == "ß"
    scores = got.fields["tokenizer.ggml.scores"].array()
    assert scores.dtype == np.float32 and scores.tolist() == [0.0, -1.5, 2.25, 3.0, -0.5]


def test_fixture_of_every_ggml_type_reads_like_gguf() -> None:
    _same(FIXTURE)


@pytest.mark.smollm
def test_real_model_reads_like_gguf(smollm_gguf: Path) -> None:
    got = _same(smollm_gguf)
    assert len(got.fields["tokenizer.ggml.tokens"]) == 49152


def test_cut_header_is_a_format_error(tmp_path: Path) -> None:
    data = _write(tmp_path / "all.gguf").read_bytes()
    for end in range(4, 400, 7):
        (tmp_path / "cut.gguf").write_bytes(data[:end])
        with pytest.raises(GGUFFormatError):
            FastGGUFReader(tmp_path / "cut.gguf")
