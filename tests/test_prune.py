"""Pruning: byte-exact rewrites, the report, split sets, and every bad input refused cleanly."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal

import factory
import numpy as np
import pytest
from clirun import ggufcarve, sha256, tensor_bytes

from ggufcarve import fileio
from ggufcarve.errors import OutputError
from ggufcarve.gguf.container import read_model
from ggufcarve.moe.keepset import KeepSet, keep_first
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.prune.execute import execute
from ggufcarve.prune.plan import plan_prune, relabel_size


@pytest.fixture(scope="session")
def kquant_model(make_model, models_dir):
    """A K-quant written by llama.cpp's own quantizer."""
    return factory.quantize_with_llama(make_model("qwen3moe", "F16"), models_dir / "qwen3moe-Q4_K_M.gguf", "Q4_K_M")


@pytest.mark.parametrize("arch", factory.ARCHES)
@pytest.mark.parametrize("dtype", ["F32", "Q8_0"])
def test_keeping_every_expert_reproduces_the_file(make_model, tmp_path, arch, dtype):
    src = make_model(arch, dtype)
    n = inspect_layout(read_model(src)).expert_count
    r = ggufcarve("prune", src, "--keep-first", n, "-o", tmp_path / "out.gguf", "--no-provenance", "-q")
    assert r.code == 0, r.stderr
    assert (tmp_path / "out.gguf").read_bytes() == src.read_bytes()


def test_alignment_64_is_kept(make_model, tmp_path):
    src = make_model("gpt-oss", "Q8_0", alignment=64)
    assert ggufcarve("prune", src, "--keep-first", 8, "-o", tmp_path / "same.gguf", "--no-provenance", "-q").code == 0
    assert (tmp_path / "same.gguf").read_bytes() == src.read_bytes()
    assert (
        ggufcarve(
            "prune", src, "--keep-ids", "0,3,4,7", "-o", tmp_path / "p.gguf", "--report", tmp_path / "p.json", "-q"
        ).code
        == 0
    )
    pruned = read_model(tmp_path / "p.gguf")
    assert pruned.metadata.alignment == 64 and pruned.metadata.data_start % 64 == 0
    assert all(t.offset % 64 == 0 for t in pruned.tensors)


def test_keeping_every_expert_of_a_llama_cpp_kquant(kquant_model, tmp_path):
    types = {t.type_name for t in read_model(kquant_model).tensors}
    assert {"Q4_K", "Q6_K"} & types
    r = ggufcarve("prune", kquant_model, "--keep-first", 8, "-o", tmp_path / "out.gguf", "--no-provenance", "-q")
    assert r.code == 0, r.stderr
    assert (tmp_path / "out.gguf").read_bytes() == kquant_model.read_bytes()


def test_with_provenance_every_tensor_and_original_key_is_kept(make_model, tmp_path):
    src = make_model("qwen35moe", "Q8_0")
    out = tmp_path / "out.gguf"
    assert ggufcarve("prune", src, "--keep-first", 8, "-o", out, "-q").code == 0
    a, b = read_model(src), read_model(out)
    assert [kv.raw for kv in a.metadata.kvs] == [kv.raw for kv in b.metadata.kvs[: len(a.metadata.kvs)]]
    extra = {kv.key: kv.value for kv in b.metadata.kvs[len(a.metadata.kvs) :]}
    assert list(extra["ggufcarve.source.sha256"]) == [sha256(src)]
    assert extra["ggufcarve.kept_expert_count"] == 8 and extra["ggufcarve.source.expert_count"] == 8
    for t in a.tensors:
        assert tensor_bytes(out, t.name) == tensor_bytes(src, t.name)


@pytest.mark.parametrize("arch", factory.ARCHES)
def test_pruned_tensors_are_the_kept_slabs_in_keep_order(make_model, tmp_path, arch):
    src = make_model(arch, "Q8_0")
    layout = inspect_layout(read_model(src))
    n, groups = layout.expert_count, max(layout.group_count, 1)
    size = n // groups
    # half of every group, in a scrambled order inside each group
    per_group = [[g * size + i for i in range(size)][::-1][: max(size // 2, 2)] for g in range(groups)]
    ids = [i for group in per_group for i in group]
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"layers": {str(b): ids for b in layout.blocks}}))
    out = tmp_path / "out.gguf"
    r = ggufcarve("prune", src, "--keep", keep, "-o", out, "-q")
    assert r.code == 0, r.stderr
    pruned = read_model(out)
    assert pruned.get(f"{layout.architecture}.expert_count") == len(ids)
    for layer in layout.layers:
        for t in layer.tensors:
            data = tensor_bytes(src, t.name)
            slab = t.bytes_per_expert
            assert tensor_bytes(out, t.name) == b"".join(data[e * slab : (e + 1) * slab] for e in ids)
            assert pruned.tensor_index[t.name][1].shape == (*t.shape[:-1], len(ids))
    untouched = [t.name for t in read_model(src).tensors if t.name not in layout.expert_tensors]
    assert untouched and all(tensor_bytes(out, name) == tensor_bytes(src, name) for name in untouched)


def test_report_and_check_prune(make_model, tmp_path):
    src = make_model("qwen35moe", "Q8_0")
    out = tmp_path / "p.gguf"
    r = ggufcarve("prune", src, "--keep-ids", "1,3,5,7", "-o", out)
    assert r.code == 0, r.stderr
    assert "verified" in r.stdout
    report = json.loads((tmp_path / "method" / "p.pruning-report.json").read_text())
    assert (
        report["schema_version"] == 2 and report["kind"] == "pruning-report" and report["tool"]["name"] == "ggufcarve"
    )
    assert (
        report["inputs"]
        == [{"name": src.name, "sha256": sha256(src), "bytes": src.stat().st_size}]
        == report["source"]["files"]
    )
    assert report["parameters"] == {"provenance_keys": True, "split_max_size": None, "merge": False}
    assert report["source"]["mtp_blocks"] == [2]
    assert report["keep_set"]["layers"] == {"0": [1, 3, 5, 7], "1": [1, 3, 5, 7], "2": [1, 3, 5, 7]}
    assert report["verification"]["ok"] and report["verification"]["tensors_checked"] == len(report["tensors"])
    sliced = [t for t in report["tensors"] if t["pruned"]]
    assert len(sliced) == 12 and all(t["expected_xxh3_128"] == t["output_xxh3_128"] for t in report["tensors"])
    assert report["bytes_out"] == out.stat().st_size and set(report["timings"]) >= {"total_seconds", "verify_seconds"}

    ok = ggufcarve("check-prune", src, out, "-q")  # keep-set read from the output's ggufcarve.kept_* keys
    assert ok.code == 0 and "OK" in ok.stdout
    wrong = ggufcarve("check-prune", src, out, "--keep-ids", "0,3,5,7", "-q")
    assert wrong.code == 1 and "tensor data differs from the source slices" in wrong.error_line
    # a flipped byte inside a kept slab is found
    data = bytearray(out.read_bytes())
    model = read_model(out)
    _, info = model.tensor_index["blk.1.ffn_down_exps.weight"]
    data[model.metadata.data_start + info.offset + 5] ^= 0xFF
    out.write_bytes(bytes(data))
    flipped = ggufcarve("check-prune", src, out, "-q")
    assert flipped.code == 1 and "blk.1.ffn_down_exps.weight" in flipped.stderr


def test_many_outputs_share_one_folder_each_with_its_report(make_model, tmp_path):
    src = make_model("qwen3moe", "Q8_0")
    assert ggufcarve("prune", src, "--keep-first", 4, "-o", tmp_path / "a.gguf", "-q").code == 0
    first = (tmp_path / "method" / "a.pruning-report.json").read_text()
    second = ggufcarve("prune", src, "--keep-first", 2, "-o", tmp_path / "b.gguf", "-q")
    assert second.code == 0, second.stderr
    assert (tmp_path / "method" / "a.pruning-report.json").read_text() == first
    b = json.loads((tmp_path / "method" / "b.pruning-report.json").read_text())
    assert b["output"]["files"][0]["name"] == "b.gguf" and b["output"]["expert_count"] == 2
    # the same output again needs --force, as the output does; its report is then replaced
    refused(tmp_path, src, "--keep-first", 2, "-o", tmp_path / "b.gguf", message="b.gguf already exists")
    assert ggufcarve("prune", src, "--keep-first", 3, "-o", tmp_path / "b.gguf", "--force", "-q").code == 0
    assert json.loads((tmp_path / "method" / "b.pruning-report.json").read_text())["output"]["expert_count"] == 3
    assert sorted(p.name for p in (tmp_path / "method").iterdir()) == ["a.pruning-report.json", "b.pruning-report.json"]


def test_split_output_report_is_named_by_the_set(make_model, tmp_path):
    src = make_model("qwen3moe", "Q8_0")
    r = ggufcarve("prune", src, "--keep-first", 4, "-o", tmp_path / "s.gguf", "--split-max-size", "1M", "-q")
    assert r.code == 0, r.stderr
    report = json.loads((tmp_path / "method" / "s.pruning-report.json").read_text())
    names = [f["name"] for f in report["output"]["files"]]
    assert len(names) > 1 and names == sorted(p.name for p in tmp_path.glob("s-*-of-*.gguf"))
    assert report["parameters"]["split_max_size"] == 1_000_000  # M is 10**6, as llama-gguf-split reads it


def test_dry_run_writes_nothing(make_model, tmp_path):
    src = make_model("deepseek2", "Q8_0")
    r = ggufcarve("prune", src, "--keep-ids", "0,1,4,5,8,9,12,13", "-o", tmp_path / "p.gguf", "--dry-run")
    assert r.code == 0, r.stderr
    assert "16 -> 8" in r.stdout and "nothing written" in r.stdout
    assert list(tmp_path.iterdir()) == []
    plan = json.loads(
        ggufcarve(
            "prune", src, "--keep-ids", "0,1,4,5,8,9,12,13", "-o", tmp_path / "p.gguf", "--dry-run", "--json"
        ).stdout
    )
    real = ggufcarve("prune", src, "--keep-ids", "0,1,4,5,8,9,12,13", "-o", tmp_path / "p.gguf", "-q")
    assert real.code == 0 and plan["bytes_out"] == (tmp_path / "p.gguf").stat().st_size


def test_size_label():
    assert relabel_size("256x1.1B", 10**9, 128, 256) == "128x1.1B"
    assert relabel_size("35B-A3B", 17_600_000_000, 128, 256) == "18B-A3B"
    assert relabel_size("30B", 15_400_000_000, 64, 128) == "15B"
    assert relabel_size("Large", 1, 64, 128) is None
    assert relabel_size("35B-A3B", 1, 256, 256) == "35B-A3B"


def test_split_input_gives_the_same_pruned_tensors(make_model, tmp_path):
    src = make_model("qwen35moe", "Q8_0")
    d = {name: tmp_path / name for name in ("split", "single", "from-split", "merged")}
    for path in d.values():
        path.mkdir()
    assert (
        ggufcarve(
            "prune",
            src,
            "--keep-first",
            8,
            "-o",
            d["split"] / "m.gguf",
            "--split-max-size",
            "3M",
            "--no-provenance",
            "-q",
        ).code
        == 0
    )
    split_shards = sorted(d["split"].glob("m-*-of-*.gguf"))
    assert len(split_shards) >= 2 and read_model(split_shards[0]).is_split
    keep = ("--keep-ids", "0,2,4,6", "--no-provenance", "-q")
    single = ggufcarve("prune", src, "-o", d["single"] / "p.gguf", *keep)
    same_shards = ggufcarve("prune", split_shards[0], "-o", d["from-split"] / "p.gguf", *keep)
    merged = ggufcarve("prune", split_shards[0], "-o", d["merged"] / "p.gguf", "--merge", *keep)
    assert single.code == same_shards.code == merged.code == 0, same_shards.stderr + merged.stderr
    assert (d["merged"] / "p.gguf").read_bytes() == (d["single"] / "p.gguf").read_bytes()
    out_shards = sorted(d["from-split"].glob("p-*-of-*.gguf"))
    assert len(out_shards) == len(split_shards)
    pruned_split = read_model(out_shards[0])
    for t in read_model(d["single"] / "p.gguf").tensors:
        assert tensor_bytes(out_shards[0], t.name) == tensor_bytes(d["single"] / "p.gguf", t.name)
    assert [s.get("split.no") for s in pruned_split.shards] == list(range(len(out_shards)))


# ---------------------------------------------------------------------------------------------
# Bad input: one line, a hint, non-zero exit, nothing left behind, source intact


def refused(tmp_path, src, *args, message):
    before = sha256(src) if src.exists() else None
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    listing = sorted(out_dir.iterdir())
    r = ggufcarve("prune", src, *args, "-q")
    assert r.code != 0
    line = r.error_line
    assert line.startswith("error:") and message in line and "(hint:" in line, r.stderr
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1, r.stderr
    assert sorted(out_dir.iterdir()) == listing
    if before:
        assert sha256(src) == before
    return r


def test_truncated_file(make_model, tmp_path):
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(make_model("qwen3moe").read_bytes()[:-5000])
    refused(tmp_path, bad, "--keep-first", 4, "-o", tmp_path / "out" / "p.gguf", message="truncated")


def test_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(os.urandom(4096))
    refused(tmp_path, bad, "--keep-first", 4, "-o", tmp_path / "out" / "p.gguf", message="not a GGUF file")


def test_dense_model(dense_model, tmp_path):
    refused(
        tmp_path, dense_model, "--keep-first", 4, "-o", tmp_path / "out" / "p.gguf", message="has no routed experts"
    )


@pytest.mark.parametrize(
    "layers, message",
    [
        ({"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}, "MoE block(s) 2 not listed"),
        (
            {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3], "2": [0, 1, 2, 3], "3": [0, 1, 2, 3]},
            "block(s) 3 listed but have no experts",
        ),
        ({"0": [0, 1, 2, 2], "1": [0, 1, 2, 3], "2": [0, 1, 2, 3]}, "duplicate id(s) 2"),
        ({"0": [0, 1, 2, 9], "1": [0, 1, 2, 3], "2": [0, 1, 2, 3]}, "id(s) 9 out of range 0..7"),
        ({"0": [0], "1": [1], "2": [2]}, "below the 2 experts each token is routed to"),
    ],
)
def test_bad_keep_sets(make_model, tmp_path, layers, message):
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"layers": layers}))
    refused(tmp_path, make_model("qwen35moe"), "--keep", keep, "-o", tmp_path / "out" / "p.gguf", message=message)


def test_uneven_groups(make_model, tmp_path):
    refused(
        tmp_path,
        make_model("deepseek2"),
        "--keep-ids",
        "0-7",
        "-o",
        tmp_path / "out" / "p.gguf",
        message="every group must keep 2",
    )


def test_output_is_the_source(make_model, tmp_path):
    src = tmp_path / "out" / "m.gguf"
    src.parent.mkdir()
    src.write_bytes(make_model("qwen3moe").read_bytes())
    refused(tmp_path, src, "--keep-first", 4, "-o", src, "--force", message="is the source file")


def test_output_exists(make_model, tmp_path):
    out = tmp_path / "out" / "p.gguf"
    out.parent.mkdir()
    out.write_bytes(b"keep me")
    src = make_model("qwen3moe")
    refused(tmp_path, src, "--keep-first", 4, "-o", out, message="already exists")
    assert out.read_bytes() == b"keep me"
    assert ggufcarve("prune", src, "--keep-first", 4, "-o", out, "--force", "-q").code == 0
    assert read_model(out).get("qwen3moe.expert_count") == 4


def test_unwritable_directory(make_model, tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "a-file"  # root may write anywhere, but not below a regular file
        blocker.write_text("")
        target, message = blocker / "sub" / "p.gguf", "is not a directory"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        target, message = locked / "p.gguf", "is not writable"
    refused(tmp_path, make_model("qwen3moe"), "--keep-first", 4, "-o", target, message=message)


def test_missing_output_directories_are_created(make_model, tmp_path):
    src = make_model("qwen3moe")
    out = tmp_path / "new" / "nested" / "p.gguf"
    result = ggufcarve("prune", src, "--keep-first", 4, "-o", out, "-q")
    assert result.code == 0, result.stderr
    assert read_model(out).get("qwen3moe.expert_count") == 4
    dry = tmp_path / "dry" / "p.gguf"
    assert ggufcarve("prune", src, "--keep-first", 4, "-o", dry, "--dry-run").code == 0
    assert not dry.parent.exists()  # a dry run creates nothing


def test_unwritable_directory_at_open_time(make_model, tmp_path, monkeypatch):
    """The directory passes the access check but refuses the file: nothing left, one error."""
    src = make_model("qwen3moe")
    model = read_model(src)
    layout = inspect_layout(model)
    plan = plan_prune(model, layout, keep_first(layout, 4), tmp_path / "p.gguf")
    real_open = os.open

    def deny(path, flags, *args):
        if flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", deny)
    with pytest.raises(OutputError, match="Permission denied") as info:
        execute(plan, model)
    assert "choose a directory you can write to" in info.value.hint
    assert list(tmp_path.iterdir()) == []


def test_disk_full_mid_write(make_model, tmp_path, monkeypatch):
    src = make_model("qwen3moe", "Q8_0")
    before = sha256(src)
    model = read_model(src)
    layout = inspect_layout(model)
    plan = plan_prune(model, layout, keep_first(layout, 4), tmp_path / "p.gguf")
    calls = {"n": 0}
    real_pwrite = os.pwrite

    def write_then_fill(*args):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(*args)

    monkeypatch.setattr(fileio.os, "pwrite", write_then_fill)
    with pytest.raises(OutputError, match="No space left on device") as info:
        execute(plan, model)
    assert "free disk space" in info.value.hint
    assert calls["n"] == 4
    assert list(tmp_path.iterdir()) == [] and sha256(src) == before


def test_source_truncated_after_planning(make_model, tmp_path):
    """The reader thread's error reaches the caller as itself, and nothing is left behind."""
    from ggufcarve.errors import BadInput

    src = tmp_path / "src" / "m.gguf"
    src.parent.mkdir()
    src.write_bytes(make_model("qwen3moe", "Q8_0").read_bytes())
    model = read_model(src)
    layout = inspect_layout(model)
    plan = plan_prune(model, layout, keep_first(layout, 4), tmp_path / "p.gguf")
    os.truncate(src, src.stat().st_size - 5000)
    with pytest.raises(BadInput, match="ended early"):
        execute(plan, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_file_size_limit_mid_write_in_a_real_process(make_model, tmp_path):
    """The kernel refuses writes past RLIMIT_FSIZE (EFBIG), as a full disk would (ENOSPC)."""
    src = make_model("qwen3moe", "Q8_0")

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    out = tmp_path / "out"
    out.mkdir()
    before = sha256(src)
    r = ggufcarve("prune", src, "--keep-first", 4, "-o", out / "p.gguf", "-q", preexec_fn=limit)
    assert r.code == 1 and "File too large" in r.error_line and "free disk space" in r.error_line, r.stderr
    assert list(out.iterdir()) == [] and sha256(src) == before


def test_library_never_prints(make_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))  # the source's sha256 is not cached: it is hashed
    src = make_model("gpt-oss", "Q8_0")
    model = read_model(src)
    layout = inspect_layout(model)
    events = []
    result = execute(
        plan_prune(model, layout, KeepSet({b: (0, 2, 4, 6) for b in layout.blocks}), tmp_path / "p.gguf"),
        model,
        on_event=events.append,
    )
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""
    assert {e.stage for e in events} == {"copy", "hash source", "verify"}
    copied = [e.done for e in events if e.stage == "copy"]
    assert copied == sorted(copied) and copied[-1] == result.plan.bytes_out  # cumulative, ending at the output size
    assert np.all([e.total > 0 for e in events])


def test_source_hashing_paths_agree(make_model, tmp_path, monkeypatch):
    """One read of the source: cold (sha256 of the whole file), warm (cached sha256: only the kept
    ranges are read), kept slices in file order and scrambled; all give the same hashes."""
    import hashlib
    import re

    import xxhash
    from gguf import GGUFReader

    monkeypatch.setenv("GGUFCARVE_CACHE", str(tmp_path / "cache"))
    src = make_model("qwen35moe", "Q8_0")
    model = read_model(src)
    layout = inspect_layout(model)
    scrambled = KeepSet({0: (6, 1, 3, 0), 1: (0, 1, 2, 3), 2: (7, 5, 3, 1)})
    data = src.read_bytes()
    # the oracle: gguf-py's reading of the source; an expert-axis tensor (router, selection bias,
    # *_exps) keeps the slabs of its outermost axis (ne[-1], the experts) in keep-set order
    naive = {}
    for t in GGUFReader(src).tensors:
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        block = re.match(r"blk\.(\d+)\.(ffn_gate_inp|exp_probs_b|ffn_\w+_exps)\.", t.name)
        if block:
            assert int(t.shape[-1]) == 8, t.name
            slabs = raw.reshape(8, -1)
            raw = np.concatenate([slabs[e] for e in scrambled.layers[int(block.group(1))]])
        naive[t.name] = xxhash.xxh3_128(raw.tobytes()).hexdigest()
    read = []

    def prune(source, keepset, name):
        events = []
        loaded = read_model(source)
        result = execute(
            plan_prune(loaded, inspect_layout(loaded), keepset, tmp_path / name),
            loaded,
            force=True,
            on_event=events.append,
        )
        hashed = [e.done for e in events if e.stage == "hash source"]
        read.append(hashed[-1] if hashed else 0)
        return result

    cold = prune(src, scrambled, "cold.gguf")
    assert cold.source_sha256 == [hashlib.sha256(data).hexdigest()] and read[-1] == len(data)
    assert {t.name: t.expected_xxh3 for t in cold.verification.tensors} == naive
    assert {t.name: t.output_xxh3 for t in cold.verification.tensors} == naive
    warm = prune(src, scrambled, "warm.gguf")
    assert warm.source_sha256 == cold.source_sha256 and read[-1] == 0
    assert {t.name: t.expected_xxh3 for t in warm.verification.tensors} == naive
    assert tensor_bytes(tmp_path / "warm.gguf", "blk.2.ffn_up_exps.weight") == tensor_bytes(
        tmp_path / "cold.gguf", "blk.2.ffn_up_exps.weight"
    )
    in_order = prune(src, keep_first(layout, 4), "in-order.gguf")
    first = tensor_bytes(src, "blk.0.ffn_up_exps.weight")
    assert tensor_bytes(tmp_path / "in-order.gguf", "blk.0.ffn_up_exps.weight") == first[: len(first) // 2]
    assert in_order.verification.ok and read[-1] == 0
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(data)
    assert prune(copy, scrambled, "from-copy.gguf").source_sha256 == cold.source_sha256 and read[-1] == len(data)
    with open(copy, "r+b") as f:  # same path and size, other content: the cache must miss
        f.seek(len(data) - 1)
        f.write(bytes([data[-1] ^ 1]))
    changed = prune(copy, scrambled, "from-changed.gguf")
    assert changed.source_sha256 == [hashlib.sha256(copy.read_bytes()).hexdigest()] != cold.source_sha256


def test_a_write_that_differs_from_the_source_is_caught(make_model, tmp_path, monkeypatch):
    """A byte changed on its way to disk fails verification, naming the tensor and its true hash."""
    import xxhash

    from ggufcarve.errors import VerificationFailed
    from ggufcarve.prune import check

    src = make_model("qwen3moe", "Q8_0")
    model = read_model(src)
    layout = inspect_layout(model)
    keepset = KeepSet({b: (5, 0, 2, 7) for b in layout.blocks})  # scrambled: hashed piece by piece
    plan = plan_prune(model, layout, keepset, tmp_path / "p.gguf")
    target = plan.tensors["blk.1.ffn_down_exps.weight"]
    header, offsets = plan.files[0].encoded_header
    start = len(header) + offsets[list(plan.files[0].tensors).index(target)]
    real_pwrite = os.pwrite

    def corrupt(fd, data, position):
        data = bytes(data)
        if position <= start + 100 < position + len(data):
            i = start + 100 - position
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        return real_pwrite(fd, data, position)

    monkeypatch.setattr(fileio.os, "pwrite", corrupt)
    seen = {}
    real_verify = check.verify_prune

    def keep_verification(*args, **kwargs):
        seen["v"] = real_verify(*args, **kwargs)
        return seen["v"]

    monkeypatch.setattr("ggufcarve.prune.execute.verify_prune", keep_verification)
    with pytest.raises(VerificationFailed, match="blk.1.ffn_down_exps.weight"):
        execute(plan, model)
    data = src.read_bytes()
    true = xxhash.xxh3_128(b"".join(data[r.offset : r.offset + r.length] for r in target.ranges)).hexdigest()
    bad = [t for t in seen["v"].tensors if not t.ok]
    assert [t.name for t in bad] == ["blk.1.ffn_down_exps.weight"] and bad[0].expected_xxh3 == true != bad[
        0
    ].output_xxh3
    assert list(tmp_path.iterdir()) == []
