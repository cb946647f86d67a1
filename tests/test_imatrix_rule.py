"""The needs-imatrix rule is llama.cpp's: llama-quantize's own decisions on the fixtures judge it.

Two decisions of llama-quantize are compared with `tensor_requires_imatrix` applied to its dry-run
target types: the warning of a dry run without an imatrix ("... will require an imatrix!"), and a
real quantization with an imatrix that holds only the entries the rule calls needed (it succeeds)
or lacks one of them (it fails with llama.cpp's "Missing importance matrix" message).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ggufcarve.gguf.container import read_model
from ggufcarve.imatrix_format import read_imatrix, write_imatrix
from ggufcarve.quant.quantizer import (
    BinaryQuantizer,
    QuantizeJob,
    tensor_requires_imatrix,
)

pytestmark = pytest.mark.slow


def test_rule_by_name_type_and_file_type():
    assert tensor_requires_imatrix("blk.0.ffn_up_exps.weight", "iq2_xs", "IQ2_M")
    assert not tensor_requires_imatrix("token_embd.weight", "IQ1_S", "IQ1_S") and not tensor_requires_imatrix(
        "output.weight", "IQ2_XXS", "IQ2_XXS"
    )
    assert tensor_requires_imatrix("blk.0.attn_q.weight", "Q2_K", "Q2_K_S") and not tensor_requires_imatrix(
        "blk.0.attn_q.weight", "Q2_K", "Q2_K"
    )
    assert not any(
        tensor_requires_imatrix("blk.0.attn_q.weight", t, "IQ3_XS") for t in ("IQ3_S", "IQ4_XS", "Q3_K", "IQ4_NL")
    )


@pytest.fixture(scope="module")
def quantizer(llama_tools):
    return BinaryQuantizer(llama_tools / "llama-quantize")


@pytest.mark.parametrize(
    "ftype", ["Q4_K_M", "Q2_K", "Q2_K_S", "IQ4_XS", "IQ3_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_XS", "IQ1_M"]
)
def test_dry_run_verdict_without_imatrix(quantizer, q8_moe, ftype):
    dry = quantizer.dry_run(QuantizeJob(q8_moe, None, ftype))
    assert dry.quantized
    assert dry.warned_imatrix_required == bool(dry.refused_without_imatrix()), dry.targets
    assert dry.warned_imatrix_required == (ftype in {"Q2_K_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_XS", "IQ1_M"})


def subset(imatrix, names, path):
    """The imatrix with only the entries called `names`, written to `path`."""
    kept = tuple(e for e in imatrix.entries if e.name in names)
    order = tuple(item for item in imatrix.tensor_order if item[0] in names or item[1] == "raw")
    return write_imatrix(replace(imatrix, entries=kept, tensor_order=order, path=None), path)


@pytest.mark.parametrize("ftype", ["IQ2_XS", "IQ3_XXS", "Q2_K_S", "IQ3_XS"])
def test_llama_quantize_needs_exactly_the_entries_the_rule_names(quantizer, q8_moe, q8_moe_imatrix, tmp_path, ftype):
    imatrix = read_imatrix(q8_moe_imatrix)
    dry = quantizer.dry_run(QuantizeJob(q8_moe, None, ftype, imatrix=q8_moe_imatrix))
    needed = dry.needs_imatrix_entries()
    not_needed = [e.name for e in imatrix.entries if e.name not in needed]
    assert needed and not_needed, (needed, not_needed)  # both halves of the rule are exercised
    assert set(needed) <= imatrix.entry_index.keys()

    only_needed = subset(imatrix, set(needed), tmp_path / "needed.imatrix.gguf")
    out = tmp_path / f"ok-{ftype}.gguf"
    result = quantizer.run(QuantizeJob(q8_moe, out, ftype, imatrix=only_needed, nthreads=2))
    assert result.returncode == 0, result.error
    written = {t.name: t.type_name for t in read_model(out).tensors}
    assert {n: written[n] for n in dry.quantized} == {
        n: dry.targets[n] for n in dry.quantized
    }  # the dry run's types are the real ones

    missing = needed[len(needed) // 2]
    lacking_one = subset(imatrix, set(needed) - {missing}, tmp_path / "lacking.imatrix.gguf")
    failed = tmp_path / f"fail-{ftype}.gguf"
    result = quantizer.run(QuantizeJob(q8_moe, failed, ftype, imatrix=lacking_one, nthreads=2))
    assert result.returncode != 0
    assert result.error == f"Missing importance matrix for tensor {missing} in a very low-bit quantization"
    failed.unlink(missing_ok=True)
