"""Routing facts come from the file's keys, the architecture table only where llama.cpp fixes or defaults them."""

from __future__ import annotations

import json

import factory
import pytest
from clirun import ggufcarve

from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import read_model
from ggufcarve.gguf.types import (
    FILE_TYPES,
    QUANTIZE_TARGET_TYPES,
    file_type,
    tensor_type,
)
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.moe.routing import SIGMOID, SOFTMAX, routing_of

MOE_TENSORS = ["blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight"]


def routing(arch: str, keys: dict, tensors=MOE_TENSORS, main_blocks: int = 60, vocab: int = 102400):
    return routing_of({k.format(arch=arch): v for k, v in keys.items()}.get, arch, tensors, main_blocks, vocab)


def test_deepseek_v2_without_gating_key_is_softmax_and_not_renormalised():
    """DeepSeek-V2/V2.5 GGUFs predate expert_gating_func: llama.cpp defaults to softmax."""
    r = routing("deepseek2", {"{arch}.expert_weights_scale": 16.0, "{arch}.expert_weights_norm": False})
    assert (r.gating, r.gating_source, r.normalised, r.scale) == (SOFTMAX, "architecture default", False, 16.0)
    assert not r.keeps_outputs  # softmax over all experts, not renormalised: the denominator loses terms
    assert (
        r.describe() == "softmax (default: no expert_gating_func): top-k weights not renormalised; "
        "scaled by 16; dropping experts changes the kept experts' weights"
    )


def test_deepseek_v3_keys_give_sigmoid_with_bias_and_groups():
    keys = {
        "{arch}.expert_gating_func": 2,
        "{arch}.expert_weights_norm": True,
        "{arch}.expert_weights_scale": 2.5,
        "{arch}.expert_group_count": 8,
        "{arch}.expert_group_used_count": 4,
    }
    r = routing("deepseek2", keys, MOE_TENSORS + ["blk.3.exp_probs_b.bias"])
    assert (r.gating, r.gating_source, r.normalised, r.scale, r.selection_bias) == (SIGMOID, "key", True, 2.5, True)
    assert (r.group_count, r.group_used_count, r.keeps_outputs) == (8, 4, True)
    assert (
        r.describe() == "sigmoid (expert_gating_func=2): selection bias exp_probs_b; 8 groups, "
        "best 4 by top-2 sum; top-k weights renormalised; scaled by 2.5"
    )


def test_glm_4_7_lite_shape_defaults_to_sigmoid():
    assert routing("deepseek2", {}, main_blocks=47, vocab=154880).gating == SIGMOID
    assert routing("deepseek2", {}, main_blocks=47, vocab=151552).gating == SOFTMAX


def test_keys_an_architecture_does_not_read_are_ignored_as_llama_cpp_ignores_them():
    r = routing(
        "qwen3moe",
        {"{arch}.expert_gating_func": 2, "{arch}.expert_weights_norm": False, "{arch}.expert_weights_scale": 3.0},
    )
    assert (r.gating, r.gating_source, r.normalised, r.scale) == (SOFTMAX, "fixed by the architecture", True, 0.0)
    assert routing("qwen2moe", {}).keeps_outputs is False and routing("glm4moe", {}).gating == SIGMOID


def test_unknown_architecture_reports_its_keys_and_promises_nothing():
    r = routing("newmoe", {"{arch}.expert_gating_func": 2})
    assert (r.gating, r.known_architecture, r.keeps_outputs) == (SIGMOID, False, False)
    assert routing("dots1", {}).gating is None  # llama.cpp has no default for dots1: its graph aborts
    assert routing("newmoe", {}).describe().startswith("unknown gating (architecture not in ggufcarve's table)")


def test_inspect_describes_the_fixtures_from_their_keys(make_model):
    for arch, options, expected in (
        (
            "deepseek2",
            {},
            "sigmoid (expert_gating_func=2): selection bias exp_probs_b; 4 groups, "
            "best 2 by top-2 sum; top-k weights renormalised; scaled by 1.5",
        ),
        (
            "deepseek2",
            {"v2_routing": True},
            "softmax (default: no expert_gating_func): selection bias exp_probs_b; 4 groups, best 2 by top-2 sum; "
            "top-k weights not renormalised; scaled by 16; dropping experts changes the kept experts' weights",
        ),
        ("qwen35moe", {}, "softmax (fixed by the architecture): top-k weights renormalised"),
        ("gpt-oss", {}, "softmax_weight (fixed by the architecture): softmax over the top-k"),
    ):
        path = make_model(arch, **options)
        shown = ggufcarve("inspect", path, "--json")
        assert shown.code == 0, shown.stderr
        assert json.loads(shown.stdout)["routing"]["description"] == expected
        table = ggufcarve("inspect", path)
        row = " ".join(next(line for line in table.stdout.splitlines() if line.strip().startswith("routing")).split())
        assert row.startswith("routing " + expected[:60]), row
    assert "MTP blocks have their own experts" in ggufcarve("inspect", make_model("qwen35moe")).stdout
    layout = inspect_layout(read_model(make_model("deepseek2")))
    assert (
        layout.to_json()["routing"]["weights_scale"] == 1.5
        and layout.routing.group_count == factory.ARCH_DEFAULTS["deepseek2"]["n_group"]
    )


def test_type_tables_are_gguf_py_s():
    assert (
        FILE_TYPES["Q4_K_M"] == 15
        and FILE_TYPES["F32"] == 0
        and FILE_TYPES["MXFP4_MOE"] == 38
        and "GUESSED" not in FILE_TYPES
    )
    assert int(file_type("iq2_xs")) == 20 and int(tensor_type("q8_0")) == 8
    assert {"Q4_K", "IQ2_XS", "BF16", "MXFP4"} <= QUANTIZE_TARGET_TYPES and not {
        "Q8_K",
        "Q8_1",
        "I32",
    } & QUANTIZE_TARGET_TYPES
    with pytest.raises(BadInput, match="unknown llama.cpp file type"):
        file_type("Q4_K_XL")
