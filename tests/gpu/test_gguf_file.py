"""Our GGUF reader and dequantizer against the ``gguf`` package they replace for speed.

Same metadata (values and Python types), same tensor table and bytes, and bit-identical float32
weights, on the default model and on files written by ``gguf.GGUFWriter`` with every value type.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.needs import require

gguf = require("gguf")
from gguf.constants import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as library_dequantize  # noqa: E402
from gguf.quants import quantize as library_quantize  # noqa: E402

from pagedserve.contracts.errors import ModelLoadError  # noqa: E402
from pagedserve.contracts.gguf_file import GGUFFormatError, array_length, read_gguf  # noqa: E402
from pagedserve.gpu.models.gguf_quants import CHUNK_BLOCKS, dequantize  # noqa: E402


def assert_same_file(path) -> None:
    ours = read_gguf(str(path))
    lib = gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(lib.fields)
    for key, field in lib.fields.items():
        want, got = field.contents(), ours.fields[key].contents()
        assert got == want, key
        assert type(got) is type(want), key
        if isinstance(want, list):
            assert [type(x) for x in got] == [type(x) for x in want], key
            assert array_length(ours.fields[key]) == array_length(field) == len(want), key
        else:
            assert array_length(ours.fields[key]) is None and array_length(field) is None, key
    assert ours.tensor_names == [t.name for t in lib.tensors]
    assert len(ours.tensors) == len(lib.tensors)
    for a, b in zip(ours.tensors, lib.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


def test_reader_matches_library_on_default_model(default_model_path):
    assert_same_file(default_model_path)


def _write_every_type(path, rng) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    V = gguf.GGUFValueType
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ✓ 日本")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü", "Ġthe", "\n"] * 30)  # > 64: skipped by the config reader
    w.add_key_value("t.u16s", [1, 2, 65535], V.ARRAY, sub_type=V.UINT16)
    w.add_key_value("t.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0, T.BF16):
        w.add_tensor(f"q.{qtype.name}", library_quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_reader_matches_library_on_every_value_type(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_type(path, np.random.default_rng(0))
    assert_same_file(path)
    f = read_gguf(str(path))
    assert f.fields["t.str"].contents() == "héllo ✓ 日本"
    assert f.fields["t.u64"].contents() == 2**63 + 5
    for t in f.tensors:  # quantized tensors dequantize like the library's
        want = library_dequantize(t.data, t.tensor_type)
        assert np.array_equal(dequantize(t.data, t.tensor_type), want), t.name


def test_reader_refuses_truncated_file(tmp_path):
    path = tmp_path / "every.gguf"
    _write_every_type(path, np.random.default_rng(1))
    data = path.read_bytes()
    for cut in (30, 200, len(data) - 10):  # in the metadata, in the string array, in the tensors
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match=f"cut{cut}.gguf.*truncated"):
            f = read_gguf(str(bad))
            f.fields["t.strs"].contents()
            f.tensors


def test_reader_refuses_non_gguf(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ModelLoadError, match="junk.gguf.*not a GGUF"):
        read_gguf(str(bad))


@pytest.mark.parametrize("qtype, block_bytes", [(T.Q4_0, 18), (T.Q4_1, 20), (T.Q8_0, 34)])
def test_dequantize_bit_identical_on_random_blocks(qtype, block_bytes):
    """Random bytes everywhere, scales too (inf, NaN, subnormal halves included), over more
    than one chunk and a ragged last chunk."""
    rng = np.random.default_rng(int(qtype))
    rows = 3
    blocks_per_row = (2 * CHUNK_BLOCKS + 17) // rows + 1
    data = rng.integers(0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and inf - inf, in both
        want = library_dequantize(data, qtype)
        got = dequantize(data, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape == (rows, blocks_per_row * 32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_dequantize_bit_identical_on_default_model(default_model_path):
    f = read_gguf(default_model_path)
    kinds = {t.tensor_type for t in f.tensors}
    assert {T.Q4_1, T.Q8_0} <= kinds
    for t in f.tensors:
        if t.tensor_type == T.F32:
            continue
        want = library_dequantize(t.data, t.tensor_type)
        got = dequantize(t.data, t.tensor_type)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name


def test_dequantize_other_types_use_the_library():
    x = np.linspace(-3, 3, 256, dtype=np.float32).reshape(2, 128)
    q = library_quantize(x, T.BF16)
    assert np.array_equal(dequantize(q, T.BF16), library_dequantize(q, T.BF16))
