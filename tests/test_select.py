"""Expert selection: scores, keep-set construction, zero-shot and imatrix criteria, the CLI."""

from __future__ import annotations

import json
import math
import struct
import threading

import factory
import gguf
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.select import zero_shot
from ggufcarve.select.keep import choose, compare, super_experts
from ggufcarve.select.methods import score_model
from ggufcarve.select.scores import BlockStats, ExpertScores, ModelFacts, merge_scores
from ggufcarve.select.zero_shot import RMS_RULE, SCALE_RULES


def facts(n=8, k=2, blocks=(0, 1), groups=0, group_used=0, nextn=0):
    return ModelFacts("m.gguf", 1, "qwen3moe", max(blocks) + 1, nextn, n, k, groups, group_used, tuple(blocks))


def value_scores(per_block, **kw):
    f = facts(n=len(next(iter(per_block.values()))), blocks=tuple(per_block), **kw)
    return ExpertScores(
        "weights", f, {b: BlockStats("weights", "value", sums=np.asarray(v, float)) for b, v in per_block.items()}
    )


def test_top_k_ties_go_to_the_lower_id_and_ids_are_ascending():
    s = value_scores({0: [1, 5, 5, 0, 5, 2, 2, 9], 1: [0] * 8})
    sel = choose(s, 4)
    assert sel.keepset.layers == {0: (1, 2, 4, 7), 1: (0, 1, 2, 3)}
    rec = sel.record()
    assert rec["layers"] == {"0": [1, 2, 4, 7], "1": [0, 1, 2, 3]}
    assert rec["per_block"]["0"]["pruned"] == [0, 3, 5, 6] and rec["per_block"]["0"]["score"][7] == 9.0
    assert "lower original expert id" in rec["tie_break"]


def test_groups_keep_the_same_quota_each_and_protected_ids_stay():
    # 16 experts, 4 groups of 4, top-4 with 2 groups used: K=8 keeps 2 per group.
    score = np.arange(16, dtype=float)[::-1].copy()  # expert 0 best
    s = value_scores({1: score, 2: score}, k=4, groups=4, group_used=2)
    sel = choose(s, 8, protect={1: {3}})
    assert sel.keepset.layers[2] == (0, 1, 4, 5, 8, 9, 12, 13)
    assert sel.keepset.layers[1] == (0, 3, 4, 5, 8, 9, 12, 13)
    with pytest.raises(BadInput, match="multiple of the 4 expert groups"):
        choose(s, 6)
    with pytest.raises(BadInput, match="protected experts in group 0"):
        choose(s, 8, protect={1: {0, 1, 2}})
    with pytest.raises(BadInput, match="below the 4 experts"):
        choose(value_scores({0: score}, k=4), 3)


def test_super_experts_follow_reaps_rule():
    maxima = {b: np.ones(128) for b in range(4)}
    maxima[0][5] = 50.0  # an outlier in the first 75% of the blocks: protected
    maxima[3][2] = 60.0  # an outlier in the last quarter: not protected
    f = facts(n=128, blocks=(0, 1, 2, 3))
    blocks = {
        b: BlockStats("reap", "mean", counts=np.ones(128, np.int64), sums=np.ones(128), maxima=m)
        for b, m in maxima.items()
    }
    s = ExpertScores("reap", f, blocks)
    assert super_experts(s) == {0: {5}, 1: set(), 2: set()}
    sel = choose(s, 2, protect_super_experts=True)
    assert 5 in sel.keepset.layers[0] and sel.record()["per_block"]["0"]["super_experts"] == [5]
    with pytest.raises(BadInput, match="maximum outputs"):
        choose(value_scores({0: np.ones(8)}), 2, protect_super_experts=True)


def test_scores_merge_and_round_trip():
    f = facts(blocks=(0,))
    part = lambda c, s, m: ExpertScores(
        "reap",
        f,
        {
            0: BlockStats(
                "reap", "mean", counts=np.array(c, np.int64), sums=np.array(s, float), maxima=np.array(m, float)
            )
        },
        {"ctx": 512, "max_tokens": 10},
        ({"kind": "calibration", "name": "a.txt"},),
        10,
    )
    a = part([1, 0, 2, 0, 0, 0, 0, 1], [2.0, 0, 1, 0, 0, 0, 0, 4], [1, 0, 3, 0, 0, 0, 0, 1])
    b = part([1, 1, 0, 0, 0, 0, 0, 1], [4.0, 1, 0, 0, 0, 0, 0, 2], [5, 1, 0, 0, 0, 0, 0, 2])
    merged = merge_scores([a, b])
    assert merged.tokens == 20 and len(merged.inputs) == 2
    np.testing.assert_array_equal(merged.blocks[0].counts, [2, 1, 2, 0, 0, 0, 0, 2])
    np.testing.assert_array_equal(merged.blocks[0].maxima, [5, 1, 3, 0, 0, 0, 0, 2])
    np.testing.assert_allclose(merged.scores()[0], [3.0, 1.0, 0.5, 0, 0, 0, 0, 3.0])
    again = ExpertScores.from_json(json.loads(merged.dumps()))
    assert again.dumps() == merged.dumps()
    with pytest.raises(BadInput, match="nothing to merge"):
        merge_scores([value_scores({0: np.ones(8)}), value_scores({0: np.ones(8)})])
    with pytest.raises(BadInput, match="different parameters"):
        merge_scores([a, ExpertScores("reap", f, a.blocks, {"ctx": 256})])


def test_compare_reports_overlap_and_disagreement():
    rows = compare({0: (0, 1, 2, 3)}, {0: (0, 1, 2, 5)})
    assert rows == [{"block": 0, "kept": 4, "overlap": 0.75, "only_a": [3], "only_b": [5]}]


# --- weights: brute force against gguf-py's reader --------------------------------------------
#
# The brute force decodes every block's scales in plain Python with struct, transcribing the block
# structs of ggml-common.h and the scale decoding of ggml-quants.c / ggml-impl.h (llama.cpp as
# vendored by llama-cpp-python 0.3.36): it shares no code with ggufcarve.select.zero_shot and does
# not use gguf-py's decoders (gguf-py only reads the file and converts F16/BF16 to floats).

#: Bytes per block (the static_asserts of ggml-common.h).
BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "IQ4_NL": 18,
    "Q2_K": 84,
    "Q3_K": 110,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
    "MXFP4": 17,
    "NVFP4": 36,
}
#: Types whose block starts with `ggml_half d` (block_q4_0 ... block_iq4_nl); Q4_1/Q5_1's m
#: follows it and is not a scale.
D_FIRST = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")


def _f16(b: bytes, offset: int) -> float:
    return struct.unpack_from("<e", b, offset)[0]


def _get_scale_min_k4(j, q):
    """ggml-quants.c get_scale_min_k4: 6-bit scale j of a Q4_K/Q5_K super-block."""
    if j < 4:
        return q[j] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)


def _q3_k_scales(packed: bytes) -> list[int]:
    """dequantize_row_q3_K: the 16 sub-block scales (6-bit, minus 32) of scales[12], via kmask1/kmask2."""
    kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
    aux = [*struct.unpack("<3I", packed), 0]
    tmp = aux[2]
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
    return [s - 32 for s in struct.unpack("<16b", struct.pack("<4I", *aux))]


def _e8m0(e: int) -> float:
    """ggml_e8m0_to_fp32: 2^(e - 127) built from its bit pattern (e == 0: the denormal 2^-127)."""
    return struct.unpack("<f", struct.pack("<I", 0x00400000 if e == 0 else e << 23))[0]


def _ue4m3(x: int) -> float:
    """ggml_ue4m3_to_fp32 without its 0.5 (which pairs with the doubled E2M1 kvalues): unsigned,
    4 exponent bits (bias 7), 3 mantissa bits, exponent 0 subnormal; 0x00 and 0x7F read as 0."""
    if x in (0x00, 0x7F):
        return 0.0
    exp, man = (x >> 3) & 0xF, x & 0x7
    return math.ldexp(man, -9) if exp == 0 else math.ldexp(1 + man / 8, exp - 7)


def brute_force_block_scales(b: bytes, type_name: str) -> list[float]:
    """|scale| of each (sub-)block of one block `b`, as zero_shot's docstring defines it."""
    if type_name in D_FIRST:  # d | (m) | (qh) | qs
        return [abs(_f16(b, 0))]
    if type_name == "Q2_K":  # scales[16] | qs[64] | d | dmin; dequantize_row_q2_K: dl = d * (sc & 0xF)
        d = _f16(b, 80)
        return [abs(d * (sc & 0xF)) for sc in b[0:16]]
    if type_name == "Q3_K":  # hmask[32] | qs[64] | scales[12] | d; dl = d_all * (scales[is] - 32)
        d = _f16(b, 108)
        return [abs(d * sc) for sc in _q3_k_scales(b[96:108])]
    if type_name in ("Q4_K", "Q5_K"):  # d | dmin | scales[12] | (qh) | qs
        d = _f16(b, 0)
        return [abs(d * _get_scale_min_k4(j, b[4:16])) for j in range(8)]
    if type_name == "Q6_K":  # ql[128] | qh[64] | scales[16] (int8) | d
        d = _f16(b, 208)
        return [abs(d * s) for s in struct.unpack("<16b", b[192:208])]
    if type_name == "MXFP4":  # e (E8M0) | qs[16]
        return [_e8m0(b[0])]
    if type_name == "NVFP4":  # d[4] (UE4M3, one per 16 values) | qs[32]
        return [_ue4m3(x) for x in b[0:4]]
    raise AssertionError(f"no brute force for {type_name}")


def brute_force_energy(raw: bytes, type_name: str, values: np.ndarray | None) -> float:
    """One expert's scale energy, block by block in plain Python (F16/F32: RMS of gguf-py's values)."""
    if type_name in ("F16", "F32", "BF16"):
        return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))
    size = BLOCK_BYTES[type_name]
    assert len(raw) % size == 0, (type_name, len(raw))
    return float(
        np.mean([s for i in range(0, len(raw), size) for s in brute_force_block_scales(raw[i : i + size], type_name)])
    )


def brute_force_weights(path) -> dict[int, np.ndarray]:
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layout = inspect_layout(read_model(path))
    n = layout.expert_count
    result = {}
    for block in layout.blocks:
        router = gguf_dequantize(
            np.asarray(tensors[f"blk.{block}.ffn_gate_inp.weight"].data),
            tensors[f"blk.{block}.ffn_gate_inp.weight"].tensor_type,
        )
        norms = np.linalg.norm(router.reshape(n, -1).astype(np.float64), axis=1)
        energies = []
        for suffix in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"):
            t = tensors.get(f"blk.{block}.{suffix}.weight")
            if t is None:
                continue
            raw = np.asarray(t.data).view(np.uint8).tobytes()
            values = None
            if t.tensor_type.name in ("F16", "F32", "BF16"):
                values = gguf_dequantize(np.asarray(t.data), t.tensor_type).reshape(n, -1)
            slab = len(raw) // n
            energy = np.array(
                [
                    brute_force_energy(
                        raw[e * slab : (e + 1) * slab], t.tensor_type.name, None if values is None else values[e]
                    )
                    for e in range(n)
                ]
            )
            scale = tensors.get(f"blk.{block}.{suffix}.scale")  # a per-expert scale (NVFP4's scale2)
            if scale is not None:
                energy = energy * np.abs(np.asarray(scale.data, dtype=np.float64).reshape(n))
            energies.append(energy)
        result[block] = norms * np.mean(energies, axis=0)
    return result


def assert_weights_match(path):
    model = read_model(path)
    scores = score_model(model, inspect_layout(model), "weights")
    expected = brute_force_weights(path)
    for block, score in scores.scores().items():
        np.testing.assert_allclose(score, expected[block], rtol=1e-6)
    return scores


def expert_weight_types(path) -> set[str]:
    """The types of the file's routed expert weight tensors (ffn_*_exps.weight), as gguf-py reads them."""
    return {t.tensor_type.name for t in GGUFReader(path).tensors if "_exps.weight" in t.name}


@pytest.mark.parametrize(
    "arch,dtype", [("qwen3moe", "F16"), ("qwen3moe", "Q8_0"), ("fused", "Q8_0"), ("gpt-oss", "F16")]
)
def test_weights_equals_brute_force(make_model, arch, dtype):
    scores = assert_weights_match(make_model(arch, dtype))
    assert set(scores.parameters["scale_rules"]) == {dtype}


@pytest.mark.parametrize("dtype", ["Q8_0", "F16"])
@pytest.mark.parametrize(
    "read_bytes,rms_values,threads",
    [(1000, 300, 3), (1 << 30, 1 << 30, 1)],
    ids=["slabs-cut", "all-slabs-in-one-piece"],
)
def test_weights_do_not_depend_on_how_the_file_is_read(make_model, monkeypatch, dtype, read_bytes, rms_values, threads):
    """Every slab cut between blocks into uneven pieces (per-expert sums added up across pieces,
    on 3 threads), and every tensor read as one piece on the calling thread alone."""
    path = make_model("qwen3moe", dtype)
    monkeypatch.setattr(zero_shot, "READ_BYTES", read_bytes)
    monkeypatch.setattr(zero_shot, "RMS_VALUES", rms_values)
    monkeypatch.setattr(zero_shot, "READ_THREADS", threads)
    layout = inspect_layout(read_model(path))
    t = next(t for layer in layout.layers for t in layer.tensors if t.name.endswith("_exps.weight"))
    pieces = zero_shot._pieces(t.bytes_per_expert, gguf.GGMLQuantizationType[dtype], layout.expert_count)
    sizes = {size for *_, size in pieces}
    if read_bytes < t.bytes_per_expert:
        assert len(pieces) > 2 * layout.expert_count and len(sizes) == 2  # several pieces per slab, of two sizes
    else:
        assert len(pieces) == 1
    assert_weights_match(path)


def test_weights_raise_what_a_helper_thread_raised(make_model, monkeypatch):
    path = make_model("qwen3moe", "Q8_0")
    model = read_model(path)
    layout = inspect_layout(model)
    monkeypatch.setattr(zero_shot, "READ_BYTES", 4096)  # hundreds of pieces: the helper takes some
    real = zero_shot.part_sums

    def failing(data, qtype, parts):
        if threading.current_thread() is not threading.main_thread():
            raise BadInput("a bad piece", "none")
        return real(data, qtype, parts)

    monkeypatch.setattr(zero_shot, "part_sums", failing)
    before = threading.active_count()
    with pytest.raises(BadInput, match="a bad piece"):
        zero_shot.weight_energies(model, layout, layout.blocks)
    assert threading.active_count() == before  # the helper has ended


#: (llama.cpp file type, --tensor-type overrides, the expert types the case is there for). Every
#: file is written by llama.cpp's llama_model_quantize from the F16 qwen3moe fixture (256-value rows,
#: 8 experts). llama.cpp 0.3.36 has LLAMA_FTYPE_MOSTLY_NVFP4 but no default tensor type for it
#: (llama_ftype_get_default_type), so NVFP4 experts come from a Q8_0 file with an ffn_*_exps override;
#: the blocks are still llama.cpp's own (quantize_row_nvfp4_ref).
LLAMA_QUANTS = [
    ("Q8_0", (), {"Q8_0"}),
    ("Q4_K_M", (), {"Q4_K", "Q6_K"}),
    ("Q2_K", (), {"Q2_K", "Q3_K"}),  # ffn_down_exps get Q3_K
    ("Q3_K_M", (), {"Q3_K"}),
    ("Q5_K_M", (), {"Q5_K"}),
    ("Q4_0", (), {"Q4_0"}),
    ("Q4_1", (), {"Q4_1"}),
    ("Q5_0", (), {"Q5_0"}),
    ("Q5_1", (), {"Q5_1"}),
    ("IQ4_NL", (), {"IQ4_NL"}),  # needs no imatrix (tensor_requires_imatrix: IQ1/IQ2/IQ3_XXS only)
    ("MXFP4_MOE", (), {"MXFP4"}),
    ("Q8_0", (("ffn_.*_exps", "NVFP4"),), {"NVFP4"}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "ftype,overrides,wanted", LLAMA_QUANTS, ids=[c[0] if not c[1] else "NVFP4" for c in LLAMA_QUANTS]
)
def test_weights_equals_brute_force_on_llama_quants(make_model, tmp_path, ftype, overrides, wanted):
    path = factory.quantize_with_llama(
        make_model("qwen3moe", "F16"), tmp_path / f"{ftype}.gguf", ftype, tensor_types=overrides
    )
    types = expert_weight_types(path)
    assert wanted <= types, f"llama.cpp's {ftype} gave the experts {sorted(types)}"
    scores = assert_weights_match(path)
    assert scores.parameters["scale_rules"] == {t: SCALE_RULES[t] for t in types}  # no RMS fallback


def test_every_scale_rule_is_brute_forced():
    assert set(SCALE_RULES) == set().union(*(wanted for _, _, wanted in LLAMA_QUANTS)) == set(BLOCK_BYTES)
    assert "Q8_1" not in SCALE_RULES  # ggml's block_q8_1 is 36 bytes, gguf-py 0.19's GGML_QUANT_SIZES says 40


#: E8M0 codes and their values, by hand: 2^(e - 127).
E8M0 = {0: 2.0**-127, 1: 2.0**-126, 120: 2.0**-7, 127: 1.0, 130: 8.0}
#: UE4M3 codes and their values, by hand from the format (unsigned, bias 7, 3 mantissa bits,
#: exponent 0 subnormal: man * 2^-9; 0x7F, the NaN code, reads as 0 in ggml).
UE4M3 = {
    0x00: 0.0,
    0x01: 2.0**-9,  # the smallest subnormal
    0x07: 7 * 2.0**-9,  # the largest subnormal
    0x08: 2.0**-6,  # exponent 1, the smallest normal
    0x38: 1.0,  # exponent 7 = the bias
    0x3C: 1.5,  # 1 + 4/8
    0x41: 2.25,  # 2^1 * (1 + 1/8)
    0x7E: 448.0,  # 2^8 * (1 + 6/8), the largest
    0x7F: 0.0,
}


def _with_tensors(src, dst, replaced: dict[str, tuple[np.ndarray, object]], added: dict[str, np.ndarray]):
    """A copy of GGUF `src` (KV and tensors through gguf-py's reader and GGUFWriter) with tensors
    `replaced` by (raw block bytes [..., row bytes], ggml type) and F32 tensors `added` after them."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        if t.name in replaced:
            raw, qtype = replaced[t.name]
            writer.add_tensor(t.name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data))
    for name, values in added.items():
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_weights_on_hand_made_blocks(make_model, tmp_path):
    """MXFP4 and NVFP4 scale codes llama.cpp's quantizer rarely writes (E8M0 0, ggml's denormal
    special case; UE4M3 subnormals, 0x7F, 448) and a per-expert .scale. Maker: blocks packed here
    with struct, written with gguf-py's GGUFWriter into a copy of the F16 qwen3moe fixture (blk.0
    gate: MXFP4, blk.0 up: NVFP4 with ffn_up_exps.scale; the rest stays F16). Expected values by hand."""
    n, rows, width = 8, 256, 256  # experts; rows and values per row of blk.0.ffn_{gate,up}_exps
    rng = np.random.default_rng(0)
    assert {c: _e8m0(c) for c in E8M0} == E8M0 and {
        c: _ue4m3(c) for c in UE4M3
    } == UE4M3  # the brute force agrees with the tables
    e8m0, ue4m3 = list(E8M0), list(UE4M3)
    mxfp4 = bytearray()  # expert e: its blocks alternate between the codes e8m0[e] and e8m0[e + 1] (cyclic)
    nvfp4 = bytearray()  # expert e: every block has the sub-block scale codes ue4m3[e .. e + 3]
    for e in range(n):
        for i in range(rows * width // 32):
            mxfp4 += bytes([e8m0[(e + i % 2) % len(e8m0)]]) + rng.integers(0, 256, 16).astype(np.uint8).tobytes()
        sub = bytes(ue4m3[(e + k) % len(ue4m3)] for k in range(4))
        for _ in range(rows * width // 64):
            nvfp4 += sub + rng.integers(0, 256, 32).astype(np.uint8).tobytes()
    scale2 = np.array([(-1) ** e * (e + 1) / 4 for e in range(n)])
    src = make_model("qwen3moe", "F16")
    path = _with_tensors(
        src,
        tmp_path / "hand.gguf",
        {
            "blk.0.ffn_gate_exps.weight": (
                np.frombuffer(bytes(mxfp4), np.uint8).reshape(n, rows, -1),
                gguf.GGMLQuantizationType.MXFP4,
            ),
            "blk.0.ffn_up_exps.weight": (
                np.frombuffer(bytes(nvfp4), np.uint8).reshape(n, rows, -1),
                gguf.GGMLQuantizationType.NVFP4,
            ),
        },
        {"blk.0.ffn_up_exps.scale": scale2},
    )

    mxfp4_energy = np.array([(E8M0[e8m0[e % len(e8m0)]] + E8M0[e8m0[(e + 1) % len(e8m0)]]) / 2 for e in range(n)])
    nvfp4_energy = np.array([sum(UE4M3[ue4m3[(e + k) % len(ue4m3)]] for k in range(4)) / 4 for e in range(n)])
    tensors = {t.name: t for t in GGUFReader(src).tensors}
    down = np.asarray(tensors["blk.0.ffn_down_exps.weight"].data, dtype=np.float64).reshape(n, -1)
    norms = np.linalg.norm(
        np.asarray(tensors["blk.0.ffn_gate_inp.weight"].data, dtype=np.float64).reshape(n, -1), axis=1
    )
    expected = norms * (mxfp4_energy + nvfp4_energy * np.abs(scale2) + np.sqrt(np.mean(down**2, axis=1))) / 3

    scores = assert_weights_match(path)  # the brute force agrees on both blocks ...
    np.testing.assert_allclose(scores.scores()[0], expected, rtol=1e-6)  # ... and so do the values by hand
    assert scores.parameters["scale_rules"] == {
        "MXFP4": SCALE_RULES["MXFP4"],
        "NVFP4": SCALE_RULES["NVFP4"],
        "F16": RMS_RULE,
    }


# --- aimer: plain numpy over gguf-py's reader ----------------------------------------------------


def aimer_by_hand(path) -> dict[int, np.ndarray]:
    """AIMER's score per block and expert, mean |w| / RMS(w) over the expert's gate, up and down
    values together, from gguf-py's reader and dequantizer (no ggufcarve code)."""
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    blocks = sorted({int(name.split(".")[1]) for name in tensors if name.endswith("_exps.weight")})
    result = {}
    for block in blocks:
        per_expert = []
        for suffix in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"):
            t = tensors.get(f"blk.{block}.{suffix}.weight")
            if t is not None:
                values = gguf_dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
                per_expert.append(values.reshape(values.shape[0], -1))
        pooled = np.concatenate(per_expert, axis=1)
        result[block] = np.mean(np.abs(pooled), axis=1) / np.sqrt(np.mean(pooled**2, axis=1))
    return result


@pytest.mark.parametrize("arch,dtype", [("qwen3moe", "Q8_0"), ("fused", "F16"), ("gpt-oss", "F16")])
def test_aimer_is_the_reciprocal_of_the_score_by_hand(make_model, arch, dtype):
    path = make_model(arch, dtype)
    model = read_model(path)
    scores = score_model(model, inspect_layout(model), "aimer")
    by_hand = aimer_by_hand(path)
    assert set(scores.blocks) == set(by_hand)
    for block, score in scores.scores().items():
        np.testing.assert_allclose(1 / score, by_hand[block], rtol=1e-6)


def test_aimer_keeps_the_experts_of_the_lowest_score_by_construction(make_model, tmp_path, monkeypatch):
    """blk.0's experts made sparse: expert e's gate, up and down values are +-1 at a share q_e of
    the places and 0 elsewhere, so mean |w| = q_e, RMS(w) = sqrt(q_e) and AIMER's score is
    sqrt(q_e): the sparsest experts are the ones AIMER keeps. Read in pieces smaller than a slab."""
    n, n_embd, n_ff = 8, 256, 256
    share = (
        np.array([128, 26, 205, 77, 13, 230, 51, 154]) / 256
    )  # expert e's nonzero share (whole places of every matrix)
    rng = np.random.default_rng(7)
    replaced = {}
    for suffix, shape in (
        ("ffn_gate_exps", (n_ff, n_embd)),
        ("ffn_up_exps", (n_ff, n_embd)),
        ("ffn_down_exps", (n_embd, n_ff)),
    ):
        values = np.zeros((n, *shape), dtype=np.float32)
        for e in range(n):
            places = rng.permutation(values[e].size)[: round(share[e] * values[e].size)]
            values[e].reshape(-1)[places] = rng.choice([-1.0, 1.0], size=places.size)
        replaced[f"blk.0.{suffix}.weight"] = (values, gguf.GGMLQuantizationType.F32)
    path = _with_tensors(make_model("qwen3moe", "F16"), tmp_path / "sparse.gguf", replaced, {})
    monkeypatch.setattr(zero_shot, "RMS_VALUES", 10_000)

    model = read_model(path)
    scores = score_model(model, inspect_layout(model), "aimer")
    by_hand = aimer_by_hand(path)
    np.testing.assert_allclose(by_hand[0], np.sqrt(share), rtol=1e-6)
    for block, score in scores.scores().items():
        np.testing.assert_allclose(1 / score, by_hand[block], rtol=1e-6)
    kept = choose(scores, 3).keepset.layers[0]
    assert sorted(kept) == sorted(np.argsort(share)[:3].tolist()) == [1, 4, 6]


def test_imatrix_counts_equal_what_llama_imatrix_wrote(q8_moe, q8_moe_imatrix):
    model = read_model(q8_moe)
    scores = score_model(model, inspect_layout(model), "imatrix-counts", imatrix=q8_moe_imatrix)
    tensors = {t.name: t for t in GGUFReader(q8_moe_imatrix).tensors}
    for block, stats in scores.blocks.items():
        written = np.asarray(tensors[f"blk.{block}.ffn_down_exps.weight.counts"].data).reshape(-1)
        np.testing.assert_array_equal(stats.counts, np.rint(written).astype(np.int64))
        assert stats.counts.sum() == 2 * 4 * 128  # top-2 x 4 chunks of 128 tokens
    energy = score_model(model, inspect_layout(model), "imatrix-energy", imatrix=q8_moe_imatrix)
    sums = np.asarray(tensors["blk.0.ffn_down_exps.weight.in_sum2"].data).reshape(8, -1).sum(axis=1)
    np.testing.assert_allclose(energy.scores()[0], sums / scores.blocks[0].counts, rtol=1e-6)


def test_hope_keeps_the_set_whose_dropped_pairs_lose_least_within_3_percent_of_exhaustive_search():
    """b^T F b of the dropped experts, F a co-selection matrix of random routed contributions: HOPE's rounded
    relaxation against every subset of the block (the oracle); a protected expert is kept; the diagonal alone
    (a REAP-like ranking) does worse on instances where experts serve the same tokens."""
    import itertools

    from ggufcarve.select.hope import dropped_loss, hope_keep

    rng = np.random.default_rng(11)
    ratios, diagonal_ratios = [], []
    for _ in range(20):
        n, kept = 10, 5
        contributions = rng.gamma(1.0, 1.0, (300, n)) * (rng.random((300, n)) < 0.4)
        contributions[:, 1] = contributions[:, 0] * 1.1  # 0 and 1 serve the same tokens
        pairs = contributions.T @ contributions / 300
        best = min(dropped_loss(pairs, range(n), c) for c in itertools.combinations(range(n), kept))
        ratios.append(dropped_loss(pairs, range(n), hope_keep(pairs, range(n), kept)) / best)
        by_diagonal = sorted(range(n), key=lambda e: -pairs[e, e])[:kept]
        diagonal_ratios.append(dropped_loss(pairs, range(n), by_diagonal) / best)
    assert max(ratios) <= 1.03 and np.mean(ratios) < np.mean(diagonal_ratios)
    protected = hope_keep(pairs, range(n), kept, {9})
    assert 9 in protected and len(protected) == kept
    assert hope_keep(pairs, range(4), 4) == sorted(range(4), key=lambda e: -pairs[e, e])
