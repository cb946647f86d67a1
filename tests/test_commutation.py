"""Pruning commutes with llama.cpp's quantization on every expert tensor, judged by llama.cpp alone.

quantize (llama-quantize, with llama-imatrix's imatrix) then prune
    == prune, remap the imatrix, then quantize the pruned model with the remapped imatrix
byte for byte on every expert-axis tensor: llama-quantize quantizes an expert tensor slice by slice
with the expert's own imatrix row, and its type choice for expert tensors does not depend on the
expert count. (Other tensors may differ: attention types depend on the expert count, e.g. at
exactly 8 experts, which the deepseek2 case prunes to.) Q8_0 sources with n_embd = n_ff_exp = 256,
so the K and IQ types apply instead of their legacy fallbacks.
"""

from __future__ import annotations

import pytest
from clirun import ggufcarve, tensor_bytes
from conftest import make_imatrix

from ggufcarve.gguf.container import read_model
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.quant.quantizer import BinaryQuantizer, QuantizeJob

pytestmark = pytest.mark.slow

# arch -> kept ids (the same in every MoE block): half of each group for grouped deepseek2
KEPT = {"qwen3moe": "1,2,5,6", "qwen35moe": "0,3,4,7", "deepseek2": "1,2,5,6,9,10,13,14"}
# llama-imatrix never runs qwen35moe's MTP block (blk.2): no imatrix entries there, so its tensors
# get a type that needs none
MTP_OVERRIDE = {"qwen35moe": ((r"blk\.2\.", "Q4_K"),)}


@pytest.fixture(scope="module")
def sources(make_model, llama_tools, tmp_path_factory):
    """arch -> (Q8_0 source, its llama-imatrix imatrix), made once."""
    made = {}
    for arch in KEPT:
        model = make_model(arch, "Q8_0", n_embd=256, n_ff_exp=256)
        made[arch] = (model, make_imatrix(llama_tools, model, tmp_path_factory.mktemp(f"imatrix-{arch}")))
    return made


def quantize(quantizer, source, out, ftype, imatrix, arch):
    result = quantizer.run(
        QuantizeJob(source, out, ftype, imatrix=imatrix, tensor_types=MTP_OVERRIDE.get(arch, ()), nthreads=2)
    )
    assert result.returncode == 0, result.error
    return out


@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ2_XS"])
@pytest.mark.parametrize("arch", list(KEPT))
def test_quantize_then_prune_equals_prune_then_quantize(sources, llama_tools, tmp_path, arch, ftype):
    source, imatrix = sources[arch]
    quantizer = BinaryQuantizer(llama_tools / "llama-quantize")
    use_imatrix = ftype == "IQ2_XS"
    keep = ("--keep-ids", KEPT[arch], "-q")
    for name in ("qp", "p"):
        (tmp_path / name).mkdir()

    quantized = quantize(quantizer, source, tmp_path / "q.gguf", ftype, imatrix if use_imatrix else None, arch)
    quantized_then_pruned = tmp_path / "qp" / "m.gguf"
    r = ggufcarve("prune", quantized, "-o", quantized_then_pruned, *keep)
    assert r.code == 0, r.stderr

    pruned = tmp_path / "p" / "m.gguf"
    r = ggufcarve("prune", source, "-o", pruned, *keep)
    assert r.code == 0, r.stderr
    remapped = None
    if use_imatrix:
        remapped = tmp_path / "p" / "m.imatrix.gguf"
        r = ggufcarve("imatrix", "remap", imatrix, "--model", pruned, "-o", remapped, *keep[:2])
        assert r.code == 0, r.stderr
    pruned_then_quantized = quantize(quantizer, pruned, tmp_path / "pq.gguf", ftype, remapped, arch)

    layout = inspect_layout(read_model(pruned_then_quantized))
    assert layout.expert_count == len(KEPT[arch].split(","))
    a, b = read_model(quantized_then_pruned), read_model(pruned_then_quantized)
    a_types = {t.name: t.type_name for t in a.tensors}
    expert_types = set()
    for name, tensor in layout.expert_tensors.items():
        assert a_types[name] == tensor.type_name, name
        assert tensor_bytes(quantized_then_pruned, name) == tensor_bytes(pruned_then_quantized, name), name
        if tensor.role == "expert weight":
            expert_types.add(tensor.type_name)
    assert ("IQ2_XS" if use_imatrix else "Q4_K") in expert_types  # the K / IQ path, not a legacy fallback
    assert expert_types <= ({"IQ2_XS", "Q2_K", "Q4_K"} if use_imatrix else {"Q4_K", "Q6_K"})
    assert {t.name for t in a.tensors} == {t.name for t in b.tensors}
