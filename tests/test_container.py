"""The GGUF container layer: exact header re-encoding, unknown tensor types, damaged files."""

from __future__ import annotations

import struct

import factory
import pytest
from gguf.constants import GGUFValueType

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import (
    GGUFModel,
    encode_header,
    make_kv,
    read_file,
    read_model,
    replace_kvs,
)


def reencode(path):
    f = read_file(path)
    header, offsets = encode_header(f.version, f.kvs, [_header(t) for t in f.tensors], f.alignment)
    return f, header, offsets


def _header(t):
    from ggufcarve.gguf.container import TensorHeader

    return TensorHeader(t.name, t.shape, t.type_id, t.nbytes)


@pytest.mark.parametrize("arch", factory.ARCHES)
def test_header_reencodes_byte_for_byte(make_model, arch):
    path = make_model(arch, "Q8_0")
    f, header, offsets = reencode(path)
    assert header == f.header_bytes
    assert offsets == [t.offset for t in f.tensors]


def test_alignment_is_taken_from_the_file(make_model):
    path = make_model("qwen3moe", "F16", alignment=64)
    f, header, offsets = reencode(path)
    assert f.alignment == 64 and f.data_start % 64 == 0
    assert header == f.header_bytes and all(o % 64 == 0 for o in offsets)


def test_values_decode(make_model):
    f = read_file(make_model("deepseek2"))
    assert f.get("general.architecture") == "deepseek2"
    assert f.get("deepseek2.expert_count") == 16
    assert len(f.get("tokenizer.ggml.tokens")) == factory.N_VOCAB
    assert list(f.get("tokenizer.ggml.token_type")[:3]) == [2, 3, 3]


def test_unknown_tensor_type_is_sized_from_offsets(make_model, tmp_path):
    """A type id gguf-py does not know: its size comes from the cumulative offsets."""
    path = make_model("qwen3moe", "Q8_0")
    f = read_file(path)
    target = next(t for t in f.tensors if t.name == "blk.0.ffn_up_exps.weight")
    data = bytearray(path.read_bytes())
    # the tensor info record ends with u32 type, u64 offset; find it by name
    name = target.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == target.type_id
    struct.pack_into("<I", data, type_at, 250)
    patched = tmp_path / "unknown-type.gguf"
    patched.write_bytes(bytes(data))
    g = read_file(patched)
    t = next(t for t in g.tensors if t.name == target.name)
    assert t.type_name == "type250" and t.nbytes == target.nbytes
    # the pruner passes such a tensor through as raw bytes, expert slabs included
    from clirun import ggufcarve, tensor_bytes

    r = ggufcarve("prune", patched, "--keep-ids", "6,7", "-o", tmp_path / "p.gguf", "-q")
    assert r.code == 0, r.stderr
    slab = target.nbytes // 8
    original = tensor_bytes(path, target.name)
    assert tensor_bytes(tmp_path / "p.gguf", target.name) == original[6 * slab :]
    assert read_file(tmp_path / "p.gguf").tensors[[x.name for x in g.tensors].index(target.name)].type_id == 250


def test_replace_kvs_keeps_order_and_appends():
    kvs = [make_kv(k, GGUFValueType.UINT32, i) for i, k in enumerate("abc")]
    out = replace_kvs(
        kvs, {"b": make_kv("b", GGUFValueType.UINT32, 9), "c": None, "d": make_kv("d", GGUFValueType.STRING, "x")}
    )
    assert [kv.key for kv in out] == ["a", "b", "d"] and out[1].value == 9 and out[2].value == "x"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:100], "truncated or corrupt GGUF header"),
        (lambda b: b"GGML" + b[4:], "not a GGUF file"),
        (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "GGUF version 7 is not supported"),
        (lambda b: b[:10], "too short to be a GGUF file"),
    ],
)
def test_damaged_files_are_refused_with_their_defect(make_model, tmp_path, damage, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(make_model("qwen3moe").read_bytes()))
    with pytest.raises(BadInput, match=message):
        read_model(bad)


def test_split_set_needs_every_shard(make_model, tmp_path):
    from clirun import ggufcarve

    src = make_model("qwen3moe")
    r = ggufcarve(
        "prune", src, "--keep-first", 8, "-o", tmp_path / "s.gguf", "--split-max-size", "2M", "--no-provenance", "-q"
    )
    assert r.code == 0, r.stderr
    shards = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(shards) >= 3
    model = read_model(shards[0])
    assert isinstance(model, GGUFModel) and model.is_split and len(model.shards) == len(shards)
    with pytest.raises(BadInput, match="give the first shard"):
        read_model(shards[1])
    shards[-1].unlink()
    with pytest.raises(BadInput, match=f"shard {len(shards)} of {len(shards)} is missing"):
        read_model(shards[0])


def test_a_directory_is_refused_naming_the_models_it_holds(make_model, tmp_path):
    from clirun import ggufcarve

    (tmp_path / "empty").mkdir()
    refused = ggufcarve("inspect", tmp_path / "empty")
    assert refused.code == 1
    assert "is a directory and holds no .gguf file" in refused.error_line
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "m-Q8_0.gguf").write_bytes(make_model("qwen3moe").read_bytes())
    refused = ggufcarve("inspect", tmp_path / "release")
    assert refused.code == 1
    assert "is a directory, not a GGUF file (it holds 1 .gguf file)" in refused.error_line
    assert "m-Q8_0.gguf" in refused.error_line
    assert "Traceback" not in refused.stderr


def test_inspect_gives_a_small_model_its_size_in_mib():
    import re

    from clirun import ggufcarve

    from ggufcarve.demo import DEMO_MODEL

    result = ggufcarve("inspect", DEMO_MODEL)
    assert result.code == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("size"))
    shown = re.search(r"size\s+([\d.]+) MiB; experts ([\d.]+) MiB", row)
    assert shown is not None, row
    assert (
        abs(float(shown[1]) - DEMO_MODEL.stat().st_size / 2**20) <= 0.05
        and float(shown[2]) > 0.1
        and "GiB" not in result.stdout
    )
