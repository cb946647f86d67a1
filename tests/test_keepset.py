"""Keep-set formats (ours and the published manifests) and llama.cpp's load rules."""

from __future__ import annotations

import json

import pytest

from ggufcarve.errors import BadInput, UnsupportedModel
from ggufcarve.gguf.container import read_model
from ggufcarve.moe.keepset import (
    KeepSet,
    check_keepset,
    keep_first,
    load_keepset,
    parse_id_list,
)
from ggufcarve.moe.layout import expert_role, inspect_layout


@pytest.fixture(scope="module")
def qwen35(make_model):
    return inspect_layout(read_model(make_model("qwen35moe")))  # blocks 0, 1 main; 2 MTP; 8 experts, top-2


@pytest.fixture(scope="module")
def deepseek(make_model):
    return inspect_layout(read_model(make_model("deepseek2")))  # MoE blocks 1, 2; 16 experts in 4 groups, top-4


def write(tmp_path, doc, name="keep.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_layout_of_every_fixture(qwen35, deepseek):
    assert qwen35.blocks == (0, 1, 2) and qwen35.nextn_layers == 1 and qwen35.is_mtp(2) and not qwen35.is_mtp(1)
    assert qwen35.expert_count == 8 and qwen35.expert_used_count == 2
    assert (
        deepseek.blocks == (1, 2)
        and deepseek.group_count == 4
        and deepseek.group_used_count == 2
        and deepseek.leading_dense_blocks == 1
    )
    roles = {t.name.split(".", 2)[2]: t.role for t in deepseek.layers[0].tensors}
    assert roles["exp_probs_b.bias"] == "selection bias" and roles["ffn_gate_inp.weight"] == "router"
    assert all("shexp" not in name for name in roles)


def test_our_format_keeps_given_order_and_metadata(tmp_path, qwen35):
    path = write(tmp_path, {"layers": {"0": [7, 1, 3], "1": [0, 1, 2], "2": [5, 6, 4]}, "criterion": "reap"})
    ks = load_keepset(path, qwen35)
    assert ks.layers == {0: (7, 1, 3), 1: (0, 1, 2), 2: (5, 6, 4)} and ks.metadata["criterion"] == "reap"
    again = tmp_path / "again.json"
    ks.save(again)
    assert load_keepset(again, qwen35).layers == ks.layers


def test_kept_expert_indices_main_and_mtp_keys(tmp_path, qwen35):
    path = write(
        tmp_path,
        {"main_0": [0, 2, 4, 6], "main_1": {"keep": [1, 3, 5, 7]}, "mtp_0": [0, 1, 2, 3]},
        "kept_expert_indices.json",
    )
    assert load_keepset(path, qwen35).layers == {0: (0, 2, 4, 6), 1: (1, 3, 5, 7), 2: (0, 1, 2, 3)}


def test_expert_selection_records(tmp_path, qwen35):
    doc = {
        "method": "frequency",
        "layers": [
            {"layer": i, "retained": [0, 1, 2, 3], "pruned": [4, 5, 6, 7], "route_counts": [1] * 8} for i in range(2)
        ],
    }
    doc["layers"].append({"layer": 0, "mtp": True, "retained": [4, 5, 6, 7]})
    assert load_keepset(write(tmp_path, doc, "expert-selection.json"), qwen35).layers == {
        0: (0, 1, 2, 3),
        1: (0, 1, 2, 3),
        2: (4, 5, 6, 7),
    }


def test_carve_manifest_nested_mapping(tmp_path, qwen35):
    doc = {
        "model": "x",
        "kept_experts": {"layer_0": {"kept": [0, 1]}, "layer_1": {"kept": [2, 3]}, "mtp_0": {"kept": [4, 5]}},
    }
    assert load_keepset(write(tmp_path, doc, "carve_manifest.json"), qwen35).layers == {0: (0, 1), 1: (2, 3), 2: (4, 5)}


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"layers": {"0": "all"}}, r"layers\['0'\] is not a list of integer expert ids"),
        ({"layers": {"0": {"weights": [1]}}}, r"layers\['0'\] has no kept-id field"),
        ({"something": 1}, "no per-layer expert lists found"),
        ([{"retained": [1]}], r"top level\[0\] has no layer number"),
    ],
)
def test_manifest_that_does_not_fit_names_file_and_field(tmp_path, qwen35, doc, message):
    path = write(tmp_path, doc, "carve_manifest.json")
    with pytest.raises(BadInput, match=message) as info:
        load_keepset(path, qwen35)
    assert "carve_manifest.json" in info.value.message


def test_not_json(tmp_path, qwen35):
    path = tmp_path / "k.json"
    path.write_text("{layers")
    with pytest.raises(BadInput, match="not valid JSON"):
        load_keepset(path, qwen35)


@pytest.mark.parametrize(
    "layers, message",
    [
        ({0: (0, 1), 1: (0, 1)}, r"MoE block\(s\) 2 not listed"),
        ({0: (0, 1), 1: (0, 1), 2: (0, 1), 5: (0, 1)}, r"block\(s\) 5 listed but have no experts"),
        ({0: (0, 1, 1), 1: (0, 1, 2), 2: (0, 1, 2)}, r"blk.0: duplicate id\(s\) 1"),
        ({0: (0, 8), 1: (0, 1), 2: (0, 1)}, r"blk.0: id\(s\) 8 out of range 0..7"),
        ({0: (0, 1), 1: (0, 1, 2), 2: (0, 1)}, "blocks keep different expert counts"),
        ({0: (0,), 1: (0,), 2: (0,)}, "below the 2 experts each token is routed to"),
    ],
)
def test_load_rules(qwen35, layers, message):
    with pytest.raises(BadInput, match=message):
        check_keepset(KeepSet(layers), qwen35)


def test_grouped_routing_rules(deepseek):
    ok = {1: (0, 1, 4, 5, 8, 9, 12, 13), 2: (2, 3, 6, 7, 10, 11, 14, 15)}
    assert check_keepset(KeepSet(ok), deepseek) == []
    cases = [
        (
            {1: tuple(range(8)), 2: tuple(range(8))},
            r"keeps \[4, 4, 0, 0\] experts from the 4 groups; every group must keep 2",
        ),
        ({1: (0, 1, 4, 5, 8, 9, 12, 13), 2: (4, 5, 0, 1, 8, 9, 12, 13)}, "must be ordered group by group"),
        ({1: (0, 4, 8, 12), 2: (0, 4, 8, 12)}, "at least 2 are needed"),
        ({1: tuple(range(10)), 2: tuple(range(10))}, "not a multiple of the 4 expert groups"),
    ]
    for layers, message in cases:
        with pytest.raises(BadInput, match=message):
            check_keepset(KeepSet(layers), deepseek)


def test_power_of_two_is_a_warning(qwen35):
    warnings = check_keepset(KeepSet({b: (0, 1, 2) for b in (0, 1, 2)}), qwen35)
    assert any("not a power of two" in w for w in warnings)
    assert check_keepset(keep_first(qwen35, 4), qwen35) == []


def test_id_lists():
    assert parse_id_list("0,1,4-7") == [0, 1, 4, 5, 6, 7]
    with pytest.raises(BadInput, match="not an id or a range"):
        parse_id_list("1,x")


@pytest.mark.parametrize(
    "suffix, refused",
    [
        ("ffn_gate_tid2eid.weight", "stores expert ids as values"),
        ("ffn_up_chexps.weight", "chunk-expert"),
        ("ffn_mystery_exps.weight", "role is unknown"),
    ],
)
def test_unsafe_expert_tensors_are_refused(suffix, refused):
    with pytest.raises(UnsupportedModel, match=refused):
        expert_role(suffix)


def test_not_expert_axis():
    assert expert_role("ffn_gate_inp_shexp.weight") is None
    assert expert_role("ffn_up_shexp.weight") is None
    assert expert_role("ffn_norm_exps.weight") is None
    assert expert_role("ffn_gate_up_exps.weight") == "expert weight"
    assert expert_role("ffn_down_exps.input_scale") == "expert scale"
