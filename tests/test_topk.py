"""`ggufcarve topk` and `prune --topk`: a copy routed to N experts per token.

Oracles: gguf-py's reader (every other key and every tensor unchanged), gguf-py's own metadata
tool for a source without the expert width, and llama.cpp: the copy loads, and its KLD against the
source equals llama-perplexity's KLD of the source loaded with
`--override-kv {arch}.expert_used_count=int:N`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from clirun import ggufcarve
from gguf import GGUFReader

from ggufcarve.demo import DEMO_MODEL, HELDOUT

USED = "qwen3moe.expert_used_count"
WIDTH = "qwen3moe.expert_feed_forward_length"


def _fields(path) -> dict[str, object]:
    """Every key's value as gguf-py reads it (arrays as lists)."""
    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _tensors(path) -> dict[str, tuple[tuple[int, ...], int, bytes]]:
    reader = GGUFReader(path)
    return {
        t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type), np.asarray(t.data).tobytes())
        for t in reader.tensors
    }


def test_the_copy_differs_from_its_source_in_the_used_count_alone(tmp_path):
    out = tmp_path / "top2.gguf"
    result = ggufcarve("topk", DEMO_MODEL, "2", "-o", out, "-q")
    assert result.code == 0, result.stderr[-2000:]
    source, copy = _fields(DEMO_MODEL), _fields(out)
    assert source[USED] == 4 and copy[USED] == 2
    assert {k: v for k, v in copy.items() if k != USED} == {k: v for k, v in source.items() if k != USED}
    assert GGUFReader(out).fields[USED].types == GGUFReader(DEMO_MODEL).fields[USED].types  # a uint32 stays one
    assert _tensors(out) == _tensors(DEMO_MODEL)
    assert out.stat().st_size == DEMO_MODEL.stat().st_size  # a uint32 for a uint32: the header keeps its length
    checked = ggufcarve("check-prune", DEMO_MODEL, out, "-q")
    assert checked.code == 0 and "OK: 50 tensors" in checked.stdout, checked.stderr


def _without_width(model, tmp_path):
    """`model` (qwen3moe, feed_forward_length = expert width x expert_used_count) without its expert width,
    written by gguf-py's gguf_new_metadata: llama.cpp then derives the width from the used count."""
    path = tmp_path / "no-width.gguf"
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(model), str(path), "--remove-metadata", WIDTH,
         "--force"],
        check=True, capture_output=True,
    )  # fmt: skip
    fields, before = _fields(path), _fields(model)
    assert WIDTH not in fields and fields["qwen3moe.feed_forward_length"] == fields[USED] * before[WIDTH]
    return path


def test_a_source_without_the_expert_width_gets_the_width_its_tensors_have(q8_moe, tmp_path):
    source = _without_width(q8_moe, tmp_path)
    out = tmp_path / "top1.gguf"
    result = ggufcarve("topk", source, "1", "-o", out, "-q", "--json")
    assert result.code == 0, result.stderr[-2000:]
    copy, before = _fields(out), _fields(source)
    assert copy[USED] == 1 and copy[WIDTH] == _fields(q8_moe)[WIDTH]
    assert {k: v for k, v in copy.items() if k not in (USED, WIDTH)} == {k: v for k, v in before.items() if k != USED}
    assert _tensors(out) == _tensors(source)
    changed = json.loads(result.stdout)["changed_keys"]
    assert changed == {USED: {"before": 2, "after": 1}, WIDTH: {"before": None, "after": copy[WIDTH]}}


def _header_only_with(tmp_path, name, changes):
    """A copy of the demo model's header (tensor data a hole) with `changes` applied: enough for what is refused
    before a byte is written."""
    from ggufcarve.gguf.container import encode_header, read_file, replace_kvs

    source = read_file(DEMO_MODEL)
    header, _ = encode_header(source.version, replace_kvs(source.kvs, changes), source.tensors, source.alignment)
    path = tmp_path / name
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + source.size - source.data_start)
    return path


@pytest.mark.parametrize(
    "case, n, message",
    [
        ("zero", "0", "N=0 is below 1"),
        ("above the expert count", "17", "N=17 is above qwen3moe.expert_count=16"),
        ("above grouped routing", "9", "N=9 is above what grouped routing can choose: 2 used groups x 4 experts"),
        ("a per-layer array", "2", "qwen3moe.expert_used_count is a per-layer array, of which qwen3moe reads only"),
        ("prune below N", "5", "K=4 is below the 5 experts each token is routed to"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(case, n, message, make_model, tmp_path):
    from gguf.constants import GGUFValueType

    from ggufcarve.gguf.container import make_kv

    model = DEMO_MODEL
    command = ["topk"]
    if case == "above grouped routing":
        model = make_model("deepseek2", dtype="Q8_0")  # 16 experts in 4 groups, 2 groups used
    elif case == "a per-layer array":
        model = _header_only_with(
            tmp_path, "array.gguf", {USED: make_kv(USED, GGUFValueType.ARRAY, [4] * 4, GGUFValueType.UINT32)}
        )
    elif case == "prune below N":
        command = ["prune", "--keep-first", "4"]
    out_dir = tmp_path / "out"
    result = ggufcarve(
        *command[:1], model, *([n] if command == ["topk"] else [*command[1:], "--topk", n]), "-o", out_dir / "x.gguf"
    )
    assert result.code == 1, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line and "(hint: " in line, line
    assert not out_dir.exists() or not any(out_dir.rglob("*")), list(out_dir.rglob("*"))


def test_prune_with_topk_records_the_trained_value(tmp_path):
    out = tmp_path / "k8-top2.gguf"
    result = ggufcarve("prune", DEMO_MODEL, "--keep-first", "8", "--topk", "2", "-o", out, "-q")
    assert result.code == 0, result.stderr[-2000:]
    fields = _fields(out)
    assert (fields["qwen3moe.expert_count"], fields[USED], fields["ggufcarve.expert_used_count_trained"]) == (8, 2, 4)
    report = json.loads((tmp_path / "method" / "k8-top2.pruning-report.json").read_text())
    assert report["changed_keys"][USED] == {"before": 4, "after": 2}
    assert (report["source"]["expert_used_count"], report["output"]["expert_used_count"]) == (4, 2)
    checked = ggufcarve("check-prune", DEMO_MODEL, out, "-q")
    assert checked.code == 0, checked.stderr


def _llama_kld(bin_dir, model, base, ctx, *extra) -> float:
    """llama-perplexity's Mean KLD of `model` against the base file, run until it prints it (its log thread
    can drop the last lines at exit)."""
    from ggufcarve.llama.launch import child_env

    for _ in range(6):
        proc = subprocess.run(
            [str(bin_dir / "llama-perplexity"), "-m", str(model), "-c", str(ctx), "--kl-divergence-base", str(base),
             "--kl-divergence", "-t", "2", *extra],
            capture_output=True, text=True, timeout=600, env=child_env(),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = re.search(r"^Mean    KLD:\s*(-?[\d.]+)", proc.stdout + proc.stderr, re.M)
        if found:
            return float(found[1])
    raise AssertionError("llama-perplexity printed no Mean KLD in 6 runs: " + (proc.stdout + proc.stderr)[-2000:])


def _llama_base(bin_dir, model, base, ctx, chunks) -> None:
    from ggufcarve.llama.launch import child_env

    made = subprocess.run(
        [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(HELDOUT), "-c", str(ctx),
         "--chunks", str(chunks), "--kl-divergence-base", str(base), "-t", "2"],
        capture_output=True, text=True, timeout=600, env=child_env(),
    )  # fmt: skip
    assert made.returncode == 0 and base.exists(), made.stderr[-3000:]


@pytest.mark.slow
def test_the_copy_scores_as_llama_cpp_with_the_override(llama_tools, tmp_path):
    """The demo at top-2 (of its trained top-4) loads in llama.cpp, and its KLD against the demo, by
    llama-perplexity and by `ggufcarve eval`, equals llama-perplexity's on the demo loaded with
    --override-kv qwen3moe.expert_used_count=int:2."""
    base = tmp_path / "demo.kld"
    _llama_base(llama_tools, DEMO_MODEL, base, 256, 12)
    overridden = _llama_kld(llama_tools, DEMO_MODEL, base, 256, "--override-kv", f"{USED}=int:2")
    assert overridden > 1e-3  # top-2 routes differently from top-4
    copy = tmp_path / "demo-top2.gguf"
    result = ggufcarve("topk", DEMO_MODEL, "2", "-o", copy, "-q")
    assert result.code == 0, result.stderr[-2000:]
    assert _llama_kld(llama_tools, copy, base, 256) == pytest.approx(overridden, rel=1e-3)
    evaluated = ggufcarve(
        "eval", copy, "--reference", DEMO_MODEL, "--heldout", HELDOUT, "--ctx", "256", "--chunks", "12",
        "--speed-runs", "0", "--gpu-layers", "0", "-t", "2", "--cache", tmp_path / "cache", "-o", tmp_path / "eval",
    )  # fmt: skip
    assert evaluated.code == 0, evaluated.stderr[-3000:]
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "eval").glob("demo-top2*.json")]
    assert doc["kld_mean"] == pytest.approx(overridden, rel=1e-3, abs=2e-6)


@pytest.mark.slow
def test_a_copy_without_the_expert_width_loads_once_it_is_written(q8_moe, llama_tools, tmp_path):
    """A qwen3moe without expert_feed_forward_length at top-1: llama.cpp loads the copy (the width written)
    and scores it as the source with the override."""
    source = _without_width(q8_moe, tmp_path)
    base = tmp_path / "source.kld"
    _llama_base(llama_tools, source, base, 128, 4)
    copy = tmp_path / "top1.gguf"
    assert ggufcarve("topk", source, "1", "-o", copy, "-q").code == 0
    overridden = _llama_kld(
        llama_tools, q8_moe, base, 128, "--override-kv", f"{USED}=int:1"
    )  # the source with its width: the override alone would break the derived width of the one without
    assert _llama_kld(llama_tools, copy, base, 128) == pytest.approx(overridden, rel=1e-3)


def test_overrides_route_the_loaded_file_as_the_copy_is_written(q8_moe, tmp_path):
    """The load-time form of a copy routed to N: the used count, and the width where the file lacks it;
    nothing at the file's own N; refused as the copy is."""
    from ggufcarve.errors import BadInput
    from ggufcarve.gguf.container import read_model
    from ggufcarve.moe.experts_used import experts_used_overrides
    from ggufcarve.moe.layout import inspect_layout

    demo = read_model(DEMO_MODEL)
    assert experts_used_overrides(demo, inspect_layout(demo), 2) == ((USED, 2),)
    assert experts_used_overrides(demo, inspect_layout(demo), 4) == ()
    with pytest.raises(BadInput, match="N=17 is above"):
        experts_used_overrides(demo, inspect_layout(demo), 17)
    bare = read_model(_without_width(q8_moe, tmp_path))
    assert experts_used_overrides(bare, inspect_layout(bare), 1) == ((USED, 1), (WIDTH, _fields(q8_moe)[WIDTH]))


def test_a_compute_with_overrides_passes_them_to_tools_and_keys():
    from ggufcarve.llama.devices import Compute

    plain = Compute(threads=2)
    routed = plain.with_overrides(((USED, 2),))
    assert Compute.from_json(json.loads(json.dumps(routed.to_json()))) == routed
    assert routed.tool_args()[-2:] == ["--override-kv", f"{USED}=int:2"]
    assert routed.key() != plain.key() and routed.key()["kv_overrides"] == [[USED, 2]]
    assert plain.to_json() == Compute.from_json(plain.to_json()).to_json() and "kv_overrides" not in plain.to_json()
    with pytest.raises(ValueError, match="llama-bench takes no --override-kv"):
        routed.tool_args(bench=True)


@pytest.mark.slow
def test_masked_scoring_at_n_used_equals_the_pruned_rewritten_file(llama_tools, tmp_path):
    """One load of the demo with the used count overridden scores (K, N) by masking: its KLD equals the
    KLD of the file pruned to K and rewritten to N, and without a mask llama-perplexity's on the demo
    loaded with --override-kv."""
    from ggufcarve.gguf.container import read_model
    from ggufcarve.llama.devices import Compute
    from ggufcarve.llama.masking import required_nodes
    from ggufcarve.measure.tournament import Candidate, MeasureSettings, measure, prepare_segments
    from ggufcarve.moe.experts_used import experts_used_overrides
    from ggufcarve.moe.keepset import KeepSet
    from ggufcarve.moe.layout import inspect_layout

    model = read_model(DEMO_MODEL)
    layout = inspect_layout(model)
    keepset = KeepSet({b: tuple(range(3, 15)) for b in layout.blocks})
    keep_file = tmp_path / "keep.json"
    keep_file.write_text(json.dumps(keepset.to_json()))
    pruned = tmp_path / "k12-top3.gguf"
    made = ggufcarve("prune", DEMO_MODEL, "--keep", keep_file, "--topk", "3", "-o", pruned, "-q")
    assert made.code == 0, made.stderr[-2000:]
    top3 = experts_used_overrides(model, layout, 3)
    nodes = tuple(f"{node}:{block}" for node, block in required_nodes(layout, keepset))
    segments = prepare_segments(
        DEMO_MODEL, [HELDOUT], chunk_ctx=256, chunks=8, compute=Compute(threads=2), work=tmp_path
    )
    got = measure(
        [
            Candidate("top3", DEMO_MODEL, overrides=top3),
            Candidate("K12-top3", DEMO_MODEL, keep=keepset.layers, required_nodes=nodes, overrides=top3),
            Candidate("K12-top4", DEMO_MODEL, keep=keepset.layers, required_nodes=nodes),
            Candidate("K12-top3@file", pruned),
        ],
        segments,
        MeasureSettings(Compute(threads=2), first_units=99),
        tmp_path,
    )
    r = got.records
    assert all(r[c]["chunks_scored"] == 8 for c in r)
    assert r["K12-top3"]["kld_mean"] == pytest.approx(r["K12-top3@file"]["kld_mean"], rel=1e-3)
    assert not np.allclose(got.table("K12-top3"), got.table("K12-top4"))  # one load each: the override is applied
    assert got.loads == {DEMO_MODEL.name: 2, pruned.name: 1}
    base = tmp_path / "demo.kld"
    _llama_base(llama_tools, DEMO_MODEL, base, 256, 8)
    overridden = _llama_kld(llama_tools, DEMO_MODEL, base, 256, "--override-kv", f"{USED}=int:3")
    assert r["top3"]["kld_mean"] == pytest.approx(overridden, rel=1e-3, abs=2e-6)
