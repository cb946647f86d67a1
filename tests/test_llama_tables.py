"""ggufcarve's per-architecture tables that gguf-py cannot give, checked against the llama.cpp
sources in the llama-cpp-python sdist (tests/llama_sources.py): routing (moe/routing.py), cache
kinds (placement/kvcache.py) and the expert tensor names gguf-py 0.19 lacks (moe/layout.py).
The activation table (select/experts.py) is checked in test_select_trace.py."""

from __future__ import annotations

import re

from llama_sources import architectures, sources

from ggufcarve.moe.routing import (
    ARCHITECTURES,
    DEEPSEEK2_SIGMOID_SHAPES,
    SIGMOID,
    SOFTMAX,
    SOFTMAX_WEIGHT,
    SQRT_SOFTPLUS,
)

GATING = {"SOFTMAX": SOFTMAX, "SIGMOID": SIGMOID, "SOFTMAX_WEIGHT": SOFTMAX_WEIGHT, "SQRT_SOFTPLUS": SQRT_SOFTPLUS}
FROM_KEY = re.compile(
    r"\(llama_expert_gating_func_type\) "
    r"hparams\.expert_gating_func|static_cast<llama_expert_gating_func_type>\(hparams\.expert_gating_func\)"
)


def _one(values: set[str], what: str, arch: str) -> str:
    assert len(values) == 1, f"{arch}: its build_moe_ffn calls pass different {what}: {values}"
    return values.pop()


def test_gating_enum_matches_llama_hparams():
    enum = dict(re.findall(r"LLAMA_EXPERT_GATING_FUNC_TYPE_(\w+)\s*=\s*(\d+)", sources()["llama-hparams.h"]))
    assert {name: int(value) for name, value in enum.items() if name != "NONE"} == GATING


def test_routing_table_matches_each_architectures_graph_and_hparams():
    archs = architectures()
    for name, table in ARCHITECTURES.items():
        assert name in archs, f"{name}: not an architecture of llama.cpp"
        arch = archs[name]
        assert arch.calls, f"{name}: no build_moe_ffn call in its graph"
        load = arch.load
        gating = _one({c.gating_op for c in arch.calls}, "gating", name)
        if table.gating is None:
            assert FROM_KEY.fullmatch(gating) and "LLM_KV_EXPERT_GATING_FUNC" in load, (name, gating)
            defaults = [
                GATING[g]
                for g in re.findall(r"hparams\.expert_gating_func\s*=\s*LLAMA_EXPERT_GATING_FUNC_TYPE_(\w+)", load)
            ]
            # the last assignment is the unconditional one (deepseek2's GLM-4.7-Lite case comes first)
            assert (defaults[-1] if defaults else None) == table.gating_default, (name, defaults)
        else:
            assert (
                gating.startswith("LLAMA_EXPERT_GATING_FUNC_TYPE_")
                and GATING[gating.removeprefix("LLAMA_EXPERT_GATING_FUNC_TYPE_")] == table.gating
            ), (name, gating)
        norm = _one({c.norm_w for c in arch.calls}, "norm_w", name)
        if table.normalises is None:
            assert norm == "hparams.expert_weights_norm" and "LLM_KV_EXPERT_WEIGHTS_NORM" in load, (name, norm)
            assert (
                re.search(r"hparams\.expert_weights_norm\s*=\s*true", load) is not None
            ) == table.normalises_default, name
        else:
            assert norm == ("true" if table.normalises else "false"), (name, norm)
        scale = _one({c.w_scale for c in arch.calls}, "w_scale", name)
        if table.reads_scale:
            assert scale == "hparams.expert_weights_scale" and "LLM_KV_EXPERT_WEIGHTS_SCALE" in load, (name, scale)
        else:  # the hparam keeps its 0.0f default (llama-hparams.h), or a literal 0/1: no scaling
            assert (scale == "hparams.expert_weights_scale" and "LLM_KV_EXPERT_WEIGHTS_SCALE" not in load) or scale in (
                "0.0f",
                "1.0f",
            ), (name, scale)
    assert re.search(r"float\s+expert_weights_scale\s*=\s*0\.0f;", sources()["llama-hparams.h"])
    assert re.search(r"bool\s+expert_weights_norm\s*=\s*false;", sources()["llama-hparams.h"])


def test_deepseek2_sigmoid_shapes_match_its_loader():
    condition = re.search(
        r"if \((\(.*?\)) && n_vocab == (\d+)\)\s*\{[^}]*?TYPE_SIGMOID", architectures()["deepseek2"].load, re.S
    )
    assert condition, "deepseek2's load_arch_hparams has no n_layer/n_vocab condition for a sigmoid default"
    layers = {int(n) for n in re.findall(r"n_layer\(\) == (\d+)", condition.group(1))}
    assert (layers, int(condition.group(2))) == DEEPSEEK2_SIGMOID_SHAPES


def test_cache_kinds_match_each_architectures_hparams():
    from ggufcarve.placement.kvcache import ARCHITECTURE_CACHES

    archs = architectures()
    for name, rules in ARCHITECTURE_CACHES.items():
        assert name in archs, f"{name}: not an architecture of llama.cpp"
        load = archs[name].load
        assert load, f"{name}: no load_arch_hparams"
        recurrent = "LLM_KV_ATTENTION_RECURRENT_LAYERS" in load
        assert recurrent == (rules.recurrent == "full_attention_interval"), name
        if recurrent:
            interval = re.search(r"full_attn_interval = (\d+);", load)
            assert interval and int(interval.group(1)) == rules.default_full_attention_interval, name
            assert "LLM_KV_FULL_ATTENTION_INTERVAL" in load, name
        else:
            assert "LLM_KV_SSM_" not in load, (
                f"{name}: reads recurrent-state keys but the table has no recurrent layers"
            )
        pattern = re.search(r"load_swa_pattern\(ml, (\d+)", load)
        assert (int(pattern.group(1)) if pattern else 0) == rules.swa_pattern, name
        assert ("LLM_KV_ATTENTION_SLIDING_WINDOW" in load) == bool(rules.swa_pattern), name
        assert ("LLM_KV_ATTENTION_KEY_LENGTH_MLA" in load) == rules.mla, name


def test_expert_tensor_names_are_llama_cpps():
    from ggufcarve.moe.layout import EXPERT_AXIS_ROLES, REFUSED_SUFFIXES

    names = set(re.findall(r'"blk\.%d\.(\w+)"', sources()["llama-arch.cpp"]))
    for suffix in [*EXPERT_AXIS_ROLES, *REFUSED_SUFFIXES]:
        assert suffix.split(".")[0] in names, f"{suffix}: no such block tensor in src/llama-arch.cpp"
