"""llama.cpp is the judge: pruned files load, and dropping never-routed experts keeps the logits."""

from __future__ import annotations

import json

import factory
import numpy as np
import pytest
from clirun import ggufcarve, tensor_bytes
from llama_probe import probe

from ggufcarve.gguf.container import read_file, read_model
from ggufcarve.llama import launch
from ggufcarve.moe.layout import inspect_layout

pytestmark = pytest.mark.slow

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111]  # <s> + byte tokens


def half_of_each_group(layout):
    groups = max(layout.group_count, 1)
    size = layout.expert_count // groups
    keep = max(size // 2, 2)
    return [g * size + i for g in range(groups) for i in range(size - keep, size)]


@pytest.mark.parametrize("arch", factory.ARCHES)
@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_pruned_model_loads(make_model, tmp_path, arch, dtype):
    src = make_model(arch, dtype)
    layout = inspect_layout(read_model(src))
    ids = half_of_each_group(layout)
    out = tmp_path / "p.gguf"
    r = ggufcarve("prune", src, "--keep-ids", ",".join(map(str, ids)), "-o", out, "-q")
    assert r.code == 0, r.stderr
    result = probe(out, PROMPT)
    assert result.ok, result.stderr[-2000:]
    assert result.logits.shape == (len(PROMPT), factory.N_VOCAB) and np.isfinite(result.logits).all()


def test_pruned_llama_cpp_kquant_loads(make_model, models_dir, tmp_path):
    kquant = factory.quantize_with_llama(
        make_model("qwen3moe", "F16"), models_dir / "qwen3moe-Q4_K_M-load.gguf", "Q4_K_M"
    )
    out = tmp_path / "p.gguf"
    assert ggufcarve("prune", kquant, "--keep-ids", "1,2,5,6", "-o", out, "-q").code == 0
    result = probe(out, PROMPT)
    assert result.ok and np.isfinite(result.logits).all(), result.stderr[-2000:]


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_dropping_never_routed_experts_keeps_the_logits(make_model, tmp_path, arch):
    src = make_model(arch, "F32")
    layout = inspect_layout(read_model(src))
    prompt = PROMPT[:4]
    base = probe(src, prompt, trace_routing=True)
    assert base.ok, base.stderr[-2000:]
    used = {block: sorted(set(ids.ravel().tolist())) for block, ids in base.routed.items()}
    assert set(used) == {b for b in layout.blocks if not layout.is_mtp(b)}  # llama.cpp does not run the MTP block
    k = max(len(ids) for ids in used.values())
    assert k < layout.expert_count, f"prompt routes to every expert: {used}"
    layers = {}
    for block in layout.blocks:
        ids = list(used.get(block, []))
        ids += [e for e in range(layout.expert_count) if e not in ids][: k - len(ids)]
        layers[str(block)] = sorted(ids)
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"layers": layers}))
    out = tmp_path / "p.gguf"
    assert ggufcarve("prune", src, "--keep", keep, "-o", out, "-q").code == 0
    pruned = probe(out, prompt, trace_routing=True)
    assert pruned.ok, pruned.stderr[-2000:]
    np.testing.assert_allclose(pruned.logits, base.logits, rtol=1e-5, atol=1e-5)
    # the same experts, renumbered to their position in the keep-set
    for block, ids in base.routed.items():
        renumber = {e: i for i, e in enumerate(layers[str(block)])}
        expected = np.vectorize(renumber.get)(ids)
        assert (np.sort(pruned.routed[block], axis=1) == np.sort(expected, axis=1)).all()
    # and a prune that drops a routed expert does change them (the comparison can fail)
    routed_expert = used[0][0]
    others = [e for e in range(layout.expert_count) if e != routed_expert][:k]
    assert (
        ggufcarve(
            "prune",
            src,
            "--keep-ids",
            ",".join(map(str, others)),
            "-o",
            tmp_path / "q.gguf",
            "--report",
            tmp_path / "q.json",
            "-q",
        ).code
        == 0
    )
    changed = probe(tmp_path / "q.gguf", prompt)
    assert changed.ok and not np.allclose(changed.logits, base.logits, rtol=1e-5, atol=1e-5)


def test_split_output_loads_and_matches_the_single_file(make_model, tmp_path):
    src = make_model("qwen35moe", "Q8_0")
    single, split = tmp_path / "single.gguf", tmp_path / "split.gguf"
    assert ggufcarve("prune", src, "--keep-ids", "0,2,4,6", "-o", single, "-q").code == 0
    assert (
        ggufcarve(
            "prune",
            src,
            "--keep-ids",
            "0,2,4,6",
            "-o",
            split,
            "--split-max-size",
            "2M",
            "--report",
            tmp_path / "split.json",
            "-q",
        ).code
        == 0
    )
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) >= 2
    a, b = probe(single, PROMPT), probe(shards[0], PROMPT)
    assert a.ok and b.ok, b.stderr[-2000:]
    np.testing.assert_array_equal(a.logits, b.logits)


def test_split_set_written_by_llama_gguf_split(make_model, llama_tools, tmp_path):
    """A split set made by llama.cpp's own splitter prunes to the same tensors as the single file."""
    src = make_model("qwen35moe", "Q8_0")
    (tmp_path / "split").mkdir()
    finished = launch.run(
        [llama_tools / "llama-gguf-split", "--split", "--split-max-size", "3M", src, tmp_path / "split" / "m"],
        timeout=120,
    )
    assert finished.ok, "\n".join(finished.tail)
    shards = sorted((tmp_path / "split").glob("m-*-of-*.gguf"))
    assert len(shards) >= 2
    for name in ("single", "from-split", "merged"):
        (tmp_path / name).mkdir()
    keep = ("--keep-ids", "1,3,5,7", "--no-provenance", "-q")
    assert ggufcarve("prune", src, "-o", tmp_path / "single" / "p.gguf", *keep).code == 0
    r = ggufcarve("prune", shards[0], "-o", tmp_path / "from-split" / "p.gguf", *keep)
    assert r.code == 0, r.stderr
    assert ggufcarve("prune", shards[0], "-o", tmp_path / "merged" / "p.gguf", "--merge", *keep).code == 0
    single = tmp_path / "single" / "p.gguf"
    pruned_shards = sorted((tmp_path / "from-split").glob("p-*-of-*.gguf"))
    assert len(pruned_shards) == len(shards)
    for t in read_model(single).tensors:
        expected = tensor_bytes(single, t.name)
        assert (
            tensor_bytes(pruned_shards[0], t.name) == expected == tensor_bytes(tmp_path / "merged" / "p.gguf", t.name)
        )
    a, b = probe(single, PROMPT), probe(pruned_shards[0], PROMPT)
    assert a.ok and b.ok, b.stderr[-2000:]
    np.testing.assert_array_equal(a.logits, b.logits)


@pytest.mark.parametrize("max_size", ["1M", "2M"])
def test_split_max_size_shards_like_llama_gguf_split(make_model, llama_tools, tmp_path, max_size):
    """`prune --split-max-size` puts the same tensors in each shard as `llama-gguf-split --split
    --split-max-size` of the single-file prune: same shard names and sizes, same tensors in the same
    order with the same bytes, the same metadata records with the same values.

    Intended differences: the split.* records are written in the order split.no, split.count,
    split.tensors.count (as llama-quantize --keep-split writes them; llama-gguf-split moves
    split.count last when it fills in its placeholder); tensor sizes are padded to the file's
    general.alignment where llama-gguf-split uses GGUF's default 32 (the same for these files);
    sizes may also be given in K, T or bytes, where llama-gguf-split takes only M and G.
    """
    src = make_model("qwen35moe", "Q8_0")
    for name in ("ours", "theirs"):
        (tmp_path / name).mkdir()
    keep = ("--keep-ids", "0,2,4,6", "-q")
    assert ggufcarve("prune", src, "-o", tmp_path / "single.gguf", *keep).code == 0
    r = ggufcarve(
        "prune",
        src,
        "-o",
        tmp_path / "ours" / "p.gguf",
        "--split-max-size",
        max_size,
        "--report",
        tmp_path / "r.json",
        *keep,
    )
    assert r.code == 0, r.stderr
    finished = launch.run(
        [
            llama_tools / "llama-gguf-split",
            "--split",
            "--split-max-size",
            max_size,
            tmp_path / "single.gguf",
            tmp_path / "theirs" / "p",
        ],
        timeout=120,
    )
    assert finished.ok, "\n".join(finished.tail)
    ours, theirs = sorted((tmp_path / "ours").glob("*.gguf")), sorted((tmp_path / "theirs").glob("*.gguf"))
    assert [p.name for p in ours] == [p.name for p in theirs] and len(ours) >= 2
    for a, b in zip(ours, theirs):
        fa, fb = read_file(a), read_file(b)
        assert [t.name for t in fa.tensors] == [t.name for t in fb.tensors], a.name
        assert {kv.key: kv.raw for kv in fa.kvs} == {kv.key: kv.raw for kv in fb.kvs}, a.name
        assert a.stat().st_size == b.stat().st_size, a.name
    for t in read_model(ours[0]).tensors:  # the split set as a whole, read through its first shard
        assert tensor_bytes(ours[0], t.name) == tensor_bytes(theirs[0], t.name), t.name
