"""Property and corruption tests: the GGUF reader/writer round trip (judged by gguf-py's own reader),
keep-set validation over random layouts, and the GGUF and imatrix readers under corrupted input.

A reader given corrupt bytes must end in one clean error (CarveError), never another exception, a
crash or a hang.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggufcarve.errors import BadInput, CarveError
from ggufcarve.gguf.container import (
    TensorHeader,
    encode_header,
    make_kv,
    read_file,
    read_model,
)
from ggufcarve.imatrix_format import read_imatrix
from ggufcarve.moe.keepset import KeepSet, check_keepset, keep_first, load_keepset
from ggufcarve.moe.kept import kept_count_problems
from ggufcarve.moe.layout import MoeLayout, inspect_layout

SCALARS = {
    GGUFValueType.UINT8: st.integers(0, 2**8 - 1),
    GGUFValueType.INT8: st.integers(-(2**7), 2**7 - 1),
    GGUFValueType.UINT16: st.integers(0, 2**16 - 1),
    GGUFValueType.INT16: st.integers(-(2**15), 2**15 - 1),
    GGUFValueType.UINT32: st.integers(0, 2**32 - 1),
    GGUFValueType.INT32: st.integers(-(2**31), 2**31 - 1),
    GGUFValueType.UINT64: st.integers(0, 2**64 - 1),
    GGUFValueType.INT64: st.integers(-(2**63), 2**63 - 1),
    GGUFValueType.FLOAT32: st.floats(width=32, allow_nan=False),
    GGUFValueType.FLOAT64: st.floats(allow_nan=False),
    GGUFValueType.BOOL: st.booleans(),
}
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
TENSOR_TYPES = [
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
]


@st.composite
def key_values(draw):
    """(key, value_type, value, item_type) records with unique keys."""
    keys = draw(st.lists(st.text("abcdefghij._", min_size=1, max_size=12), min_size=0, max_size=8, unique=True))
    records = []
    for key in keys:
        kind = draw(st.sampled_from(["scalar", "string", "array", "string array"]))
        if kind == "scalar":
            vt = draw(st.sampled_from(list(SCALARS)))
            records.append((key, vt, draw(SCALARS[vt]), None))
        elif kind == "string":
            records.append((key, GGUFValueType.STRING, draw(TEXT), None))
        elif kind == "array":
            vt = draw(st.sampled_from([GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.UINT8]))
            records.append((key, GGUFValueType.ARRAY, draw(st.lists(SCALARS[vt], max_size=6)), vt))
        else:
            records.append((key, GGUFValueType.ARRAY, draw(st.lists(TEXT, max_size=4)), GGUFValueType.STRING))
    return records


@st.composite
def tensor_headers(draw):
    names = draw(st.lists(st.text("abcdefgh.", min_size=1, max_size=10), min_size=1, max_size=5, unique=True))
    headers = []
    for name in names:
        qtype = draw(st.sampled_from(TENSOR_TYPES))
        block, type_size = GGML_QUANT_SIZES[qtype]
        ne0 = block * draw(st.integers(1, 3))
        dims = (ne0, *draw(st.lists(st.integers(1, 3), max_size=3)))
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        headers.append(TensorHeader(name, tuple(dims), int(qtype), ne0 // block * type_size * rows))
    return headers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    records=key_values(), tensors=tensor_headers(), alignment=st.sampled_from([32, 64, 256]), seed=st.integers(0, 2**16)
)
def test_header_round_trip_matches_gguf_py(tmp_path, records, tensors, alignment, seed):
    kvs = [make_kv("general.alignment", GGUFValueType.UINT32, alignment)] + [
        make_kv(k, vt, v, it) for k, vt, v, it in records if k != "general.alignment"
    ]
    header, offsets = encode_header(3, kvs, tensors, alignment)
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes() for t in tensors]
    path = tmp_path / f"m{seed}.gguf"
    with open(path, "wb") as f:
        f.write(header)
        for t, blob in zip(tensors, data):
            f.write(blob + bytes(-t.nbytes % alignment))
    ours = read_file(path)
    assert [kv.raw for kv in ours.kvs] == [kv.raw for kv in kvs]
    assert [(t.name, t.shape, t.type_id, t.nbytes) for t in ours.tensors] == [
        (t.name, t.shape, t.type_id, t.nbytes) for t in tensors
    ]
    raw = path.read_bytes()
    theirs = GGUFReader(path)
    for t, blob, info in zip(tensors, data, ours.tensors):
        start, end = ours.data_range(info)
        assert raw[start:end] == blob
        ref = next(r for r in theirs.tensors if r.name == t.name)
        assert ref.data_offset == start and [int(x) for x in ref.shape] == list(t.shape)
    for k, vt, v, it in records:
        if k == "general.alignment":
            continue
        field = theirs.fields[k]
        got = ours.get(k)
        if vt == GGUFValueType.STRING:
            assert got == v == bytes(field.parts[field.data[0]]).decode()
        elif vt == GGUFValueType.ARRAY and it == GGUFValueType.STRING:
            assert list(got) == v == [bytes(field.parts[i]).decode() for i in field.data]
        elif vt == GGUFValueType.ARRAY:
            assert list(got) == pytest.approx(v) and [field.parts[i][0] for i in field.data] == pytest.approx(v)
        else:
            assert got == pytest.approx(v) and field.parts[field.data[0]][0] == pytest.approx(v)


def synthetic_layout(n_expert: int, top_k: int, groups: int, group_used: int, blocks: int) -> MoeLayout:
    from ggufcarve.moe.routing import UNKNOWN_ROUTING

    return MoeLayout(
        architecture="test",
        block_count=blocks,
        nextn_layers=0,
        expert_count=n_expert,
        expert_used_count=top_k,
        group_count=groups,
        group_used_count=group_used,
        shared_expert_count=0,
        leading_dense_blocks=0,
        layers=(),
        total_bytes=0,
        expert_bytes=0,
        routing=UNKNOWN_ROUTING,
    )


@st.composite
def layouts_and_keepsets(draw):
    groups = draw(st.sampled_from([0, 1, 2, 4, 8]))
    n_expert = draw(st.sampled_from([4, 8, 16, 32, 64])) if groups <= 1 else groups * draw(st.sampled_from([2, 4, 8]))
    group_used = draw(st.integers(1, groups - 1)) if groups > 1 else 0
    top_k = draw(st.integers(1, min(8, n_expert)))
    blocks = draw(st.integers(1, 4))
    layout = synthetic_layout(n_expert, top_k, groups, group_used, blocks)
    object.__setattr__(layout, "layers", tuple(_layer(b) for b in range(blocks)))
    k = draw(st.integers(1, n_expert))
    layers = {b: tuple(draw(st.permutations(range(n_expert)))[:k]) for b in range(blocks)}
    return layout, KeepSet(layers)


def _layer(block: int):
    from ggufcarve.moe.layout import MoeLayer

    return MoeLayer(block, False, ())


def obeys_load_rules(layout, keepset) -> bool:
    """llama.cpp's rules for a pruned file, stated independently of check_keepset: every MoE block
    listed, one expert count K for all, unique ids in range, top-k <= K <= n; with grouped routing
    K/groups >= 2 experts from every contiguous group, in group order, enough for the top-k in
    the used groups."""
    n, used, groups = layout.expert_count, layout.expert_used_count, max(layout.group_count, 1)
    if set(keepset.layers) != set(layout.blocks):
        return False
    counts = {len(ids) for ids in keepset.layers.values()}
    if len(counts) != 1:
        return False
    k = counts.pop()
    if not used <= k <= n or any(
        len(set(ids)) != len(ids) or not all(0 <= i < n for i in ids) for ids in keepset.layers.values()
    ):
        return False
    if groups > 1:
        size, per = n // groups, k // groups
        if k % groups or per < 2 or layout.group_used_count * per < used:
            return False
        for ids in keepset.layers.values():
            group_of = [i // size for i in ids]
            if group_of != sorted(group_of) or any(group_of.count(g) != per for g in range(groups)):
                return False
    return True


def test_the_load_rules_oracle_accepts_what_llama_cpp_loads():
    """A keep-set of K experts per block built group by group is accepted by both."""
    from ggufcarve.moe.keepset import keep_per_block

    # K = n/2 and n; without groups also K = top-k (with 4 of 8 groups used, K=16 is the least: 4 x 2 = 8 = top-k)
    for n_expert, top_k, groups, group_used, ks in (
        (16, 4, 1, 1, (4, 8, 16)),
        (32, 8, 4, 2, (16, 32)),
        (256, 8, 8, 4, (16, 128, 256)),
    ):
        layout = synthetic_layout(n_expert, top_k, groups, group_used, 3)
        object.__setattr__(layout, "layers", tuple(_layer(b) for b in range(3)))
        for k in ks:
            keepset = keep_per_block(layout, k)
            assert obeys_load_rules(layout, keepset), (n_expert, k)
            check_keepset(keepset, layout)


@settings(max_examples=300, deadline=None)
@given(case=layouts_and_keepsets())
def test_accepted_keepsets_satisfy_llama_load_rules(case):
    """Whatever check_keepset accepts loads in llama.cpp (src/llama-model.cpp asserts) and routes
    within groups the way llama.cpp's grouped top-k needs: same count per contiguous group, >= 2."""
    layout, keepset = case
    try:
        check_keepset(keepset, layout)
    except BadInput:
        assert not obeys_load_rules(layout, keepset), keepset.layers  # refused only when a rule is broken
        return
    assert obeys_load_rules(layout, keepset)
    k = keepset.kept_count
    assert layout.expert_used_count <= k <= layout.expert_count <= 1024
    if layout.group_count > 1:
        size = layout.expert_count // layout.group_count
        new_size = k // layout.group_count
        assert (
            k % layout.group_count == 0
            and new_size >= 2
            and layout.group_used_count * new_size >= layout.expert_used_count
        )
        for ids in keepset.layers.values():
            assert [i // size for i in ids] == sorted(i // size for i in ids)  # group order kept
            assert all(sum(1 for i in ids if i // size == g) == new_size for g in range(layout.group_count))


@settings(max_examples=100, deadline=None)
@given(case=layouts_and_keepsets())
def test_keep_first_of_a_valid_count_is_accepted(case):
    """For every K the one check of K accepts (grouped routing included), keep_first builds a
    keep-set that check_keepset accepts and that satisfies the load rules stated independently
    above; every K it refuses, keep_first refuses too."""
    layout, _ = case
    accepted = 0
    for k in range(1, layout.expert_count + 1):
        if kept_count_problems(layout, k):
            with pytest.raises(BadInput):
                keep_first(layout, k)
            continue
        keepset = keep_first(layout, k)
        check_keepset(keepset, layout)
        assert keepset.kept_count == k and set(keepset.layers) == set(layout.blocks)
        assert layout.expert_used_count <= k <= layout.expert_count
        if layout.group_count > 1:
            size, per_group = layout.expert_count // layout.group_count, k // layout.group_count
            assert (
                k % layout.group_count == 0
                and per_group >= 2
                and layout.group_used_count * per_group >= layout.expert_used_count
            )
            for ids in keepset.layers.values():
                assert list(ids) == sorted(ids) and all(
                    sum(1 for i in ids if i // size == g) == per_group for g in range(layout.group_count)
                )
        accepted += 1
    grouped_possible = layout.group_count <= 1 or any(
        k % layout.group_count == 0
        and k // layout.group_count >= 2
        and layout.group_used_count * (k // layout.group_count) >= layout.expert_used_count
        for k in range(max(layout.expert_used_count, 1), layout.expert_count + 1)
    )
    assert accepted > 0 or not grouped_possible or layout.expert_used_count > layout.expert_count


# ---------------------------------------------------------------------------------------------
# corruption


def _corruptions(data: bytes, rng: np.random.Generator, header_end: int) -> list[tuple[str, bytes]]:
    """Bit flips in the header, truncations, and absurd counts, offsets and string lengths."""
    out = []
    for i in range(40):
        buf = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, header_end))
            buf[pos] ^= 1 << int(rng.integers(0, 8))
        out.append((f"bit flips #{i}", bytes(buf)))
    for cut in sorted(
        {int(x) for x in rng.integers(0, len(data), 20)} | {0, 3, 23, 24, header_end - 1, header_end, len(data) - 1}
    ):
        out.append((f"truncated at {cut}", data[:cut]))
    for pos in [8, 16]:  # n_tensors, n_kv
        for value in (0, 1, 2**31, 2**63, 2**64 - 1):
            buf = bytearray(data)
            struct.pack_into("<Q", buf, pos, value)
            out.append((f"count at {pos} = {value}", bytes(buf)))
    for pos in range(24, min(header_end, 24 + 600), 8):  # 8-byte lengths, counts and offsets anywhere
        buf = bytearray(data)
        struct.pack_into("<Q", buf, pos, [2**40, 2**63 - 1, 2**64 - 1, 7][int(rng.integers(0, 4))])
        out.append((f"u64 at {pos}", bytes(buf)))
    return out


def _assert_clean(read, path: Path, what: str) -> None:
    start = time.monotonic()
    try:
        read(path)
    except CarveError:
        pass
    except Exception as err:
        raise AssertionError(f"{what}: {type(err).__name__}: {err}") from err
    assert time.monotonic() - start < 60, f"{what}: took {time.monotonic() - start:.1f} s"


def _read_model_and_layout(path: Path) -> None:
    inspect_layout(read_model(path))


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe", "deepseek2"])
def test_corrupt_gguf_models_end_in_a_clean_error(make_model, tmp_path, arch):
    source = make_model(arch, "Q8_0")
    data = source.read_bytes()
    header_end = read_file(source).data_start
    rng = np.random.default_rng(len(arch))
    for what, blob in _corruptions(data, rng, header_end):
        path = tmp_path / "corrupt.gguf"
        path.write_bytes(blob)
        _assert_clean(_read_model_and_layout, path, what)


def test_nested_arrays_deeper_than_any_model_are_refused(tmp_path):
    """An array of arrays nested thousands deep (12 bytes a level) must not exhaust the stack."""
    depth = 5000
    value = struct.pack("<IQ", GGUFValueType.ARRAY, 1) * depth + struct.pack("<IQ", GGUFValueType.UINT8, 0)
    kv = struct.pack("<Q", 3) + b"key" + struct.pack("<I", GGUFValueType.ARRAY) + value
    path = tmp_path / "deep.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv + bytes(64))
    _assert_clean(read_file, path, "nested arrays")
    with pytest.raises(BadInput, match="array of arrays"):  # as ggml/src/gguf.cpp refuses them
        read_file(path)


def test_corrupt_imatrices_end_in_a_clean_error(tmp_path):
    import factory
    from test_imatrix import (
        synthetic_gguf,  # a GGUF imatrix of the right layout for a model
    )

    model = factory.write_model(tmp_path / "m.gguf", "qwen3moe")
    source = synthetic_gguf(tmp_path / "s.imatrix.gguf", model)
    from ggufcarve.imatrix.convert import convert
    from ggufcarve.imatrix_format import write_imatrix

    dat = write_imatrix(convert(read_imatrix(source), "dat").imatrix, tmp_path / "s.imatrix.dat")
    rng = np.random.default_rng(1)
    for original in (source, dat):
        data = original.read_bytes()
        header_end = read_file(original).data_start if original.suffix == ".gguf" else min(len(data), 4096)
        for what, blob in _corruptions(data, rng, header_end):
            path = tmp_path / f"corrupt{original.suffix}"
            path.write_bytes(blob)
            _assert_clean(read_imatrix, path, f"{original.name}: {what}")


def test_corrupt_keepset_files_end_in_a_clean_error(make_model, tmp_path):
    layout = inspect_layout(read_model(make_model("qwen3moe")))
    docs = [
        b"",
        b"{",
        b"[]",
        b"null",
        b'{"layers": 5}',
        b'{"layers": {"0": "x"}}',
        b'{"layers": {"0": [1.5, 2]}}',
        b'{"layers": {"zz": [1]}}',
        b'{"layers": {"0": [0, 1], "1": [2, -1]}}',
        json.dumps({"layers": {"0": list(range(10**4))}}).encode(),
        b"\xff\xfe",
        os.urandom(64),
    ]
    for i, doc in enumerate(docs):
        path = tmp_path / f"k{i}.json"
        path.write_bytes(doc)
        _assert_clean(lambda p: check_keepset(load_keepset(p, layout), layout), path, f"keep-set {doc[:30]!r}")
