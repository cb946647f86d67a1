"""imatrix files: read/write round trips, gguf <-> dat, remap for pruned models, and bad input.

llama.cpp is the judge: the imatrix files come from llama-imatrix itself (both formats), the
conversions are compared with llama-imatrix's own, and a remapped imatrix must let llama-quantize
make an IQ2_XS model of the pruned fixture that llama.cpp loads and runs. Fast tests use small
hand-packed imatrix files (an independent writer below) so the bad-input checks run without tools.
"""

from __future__ import annotations

import json
import os
import random
import struct

import factory
import numpy as np
import pytest
from clirun import ggufcarve, sha256
from llama_probe import probe

from ggufcarve.gguf.container import read_file, read_model
from ggufcarve.imatrix.convert import to_dat
from ggufcarve.imatrix_format import read_imatrix, write_to_fd
from ggufcarve.llama import launch
from ggufcarve.moe.keepset import keepset_from_provenance, load_keepset
from ggufcarve.moe.layout import inspect_layout
from ggufcarve.prune.execute import execute
from ggufcarve.prune.plan import plan_prune

N_EXPERT = 8
# Non-ascending on purpose: rows must come out in keep-set order.
KEEP = {"0": [6, 1, 4, 3], "1": [0, 7, 3, 5]}
TOKENS = [factory.BOS_ID] + [int(t) for t in np.random.default_rng(7).integers(3, factory.N_VOCAB, 23)]
WORDS = (
    "the quick brown fox jumps over a lazy dog while experts route tokens through layers of matrices "
    "that quantize and prune weights"
).split()


# ---------------------------------------------------------------------------------------------
# an independent, minimal writer for GGUF and .dat imatrix files (test input only)

STRING, ARRAY, U32 = 8, 9, 4


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def pack_gguf(
    path,
    tensors,
    *,
    datasets=("calibration.txt",),
    chunk_count=4,
    chunk_size=128,
    skip_keys=(),
    extra_kvs=b"",
    n_extra_kvs=0,
):
    """tensors: list of (name, ne, float32 values). Layout as gguf_write_to_file: alignment 32."""
    kvs = [(b"general.type", _str("general.type") + struct.pack("<I", STRING) + _str("imatrix"))]
    kvs.append(
        (
            b"imatrix.datasets",
            _str("imatrix.datasets")
            + struct.pack("<IIQ", ARRAY, STRING, len(datasets))
            + b"".join(_str(d) for d in datasets),
        )
    )
    kvs.append((b"imatrix.chunk_count", _str("imatrix.chunk_count") + struct.pack("<II", U32, chunk_count)))
    kvs.append((b"imatrix.chunk_size", _str("imatrix.chunk_size") + struct.pack("<II", U32, chunk_size)))
    kvs = [raw for key, raw in kvs if key.decode() not in skip_keys]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs) + n_extra_kvs) + b"".join(kvs) + extra_kvs
    infos, data, offset = b"", b"", 0
    for name, ne, values in tensors:
        raw = np.asarray(values, dtype="<f4").tobytes()
        infos += _str(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, 0, offset)
        raw += bytes(-len(raw) % 32)
        data += raw
        offset += len(raw)
    header = head + infos
    header += bytes(-len(header) % 32)
    path.write_bytes(header + data)
    return path


def pack_dat(path, entries, trailer=(4, "calibration.txt")):
    """entries: list of (name, ncall, float32 values)."""
    out = struct.pack("<i", len(entries))
    for name, ncall, values in entries:
        raw = name.encode()
        out += (
            struct.pack("<i", len(raw))
            + raw
            + struct.pack("<ii", ncall, len(values))
            + np.asarray(values, dtype="<f4").tobytes()
        )
    if trailer is not None:
        out += struct.pack("<i", trailer[0]) + struct.pack("<i", len(trailer[1].encode())) + trailer[1].encode()
    path.write_bytes(out)
    return path


def synthetic_entries(model_path, *, n_expert=N_EXPERT, seed=0, zero=(), blocks=None):
    """(name, in_sum2 ne, in_sum2, counts ne, counts) for every weight matrix llama-imatrix would see."""
    rng = np.random.default_rng(seed)
    result = []
    tokens = 512
    for t in read_model(model_path).tensors:
        if not t.name.startswith("blk.") or len(t.shape) < 2 or not t.name.endswith(".weight"):
            continue
        block = int(t.name.split(".")[1])
        if blocks is not None and block not in blocks:
            continue
        ne0 = t.shape[0]
        if "_exps." in t.name:
            counts = rng.integers(1, 300, n_expert).astype(np.float32)
            counts[list(zero)] = 0
            sums = rng.random((n_expert, ne0), dtype=np.float32) * counts[:, None]
            result.append((t.name, (ne0, n_expert), sums, (1, n_expert), counts))
        elif "ssm_conv1d" not in t.name:
            result.append(
                (t.name, (ne0,), rng.random(ne0, dtype=np.float32) * tokens, (1,), np.array([tokens], np.float32))
            )
    return result


def synthetic_gguf(path, model_path, **kwargs):
    tensors = []
    for name, sne, sums, cne, counts in synthetic_entries(model_path, **kwargs):
        tensors += [(name + ".in_sum2", sne, sums), (name + ".counts", cne, counts)]
    return pack_gguf(path, tensors)


# ---------------------------------------------------------------------------------------------
# fixtures


def run_llama_imatrix(bin_dir, model, text, out, *extra):
    args = [bin_dir / "llama-imatrix", "-m", model, "-o", out, "-c", "128", "-t", "2", "--no-repack", *map(str, extra)]
    if text is not None:
        args += ["-f", text, "--chunks", "4", "--no-ppl"]
    finished = launch.run(args, timeout=300, tail_lines=60)
    assert finished.ok and out.exists(), "\n".join(finished.tail)
    return out


def run_quantize(bin_dir, imatrix, model, out, ftype="IQ2_XS", *extra) -> launch.Finished:
    """llama-quantize through the one launcher; the result's `tail` is its whole log."""
    finished = launch.run(
        [bin_dir / "llama-quantize", *map(str, extra), "--imatrix", imatrix, model, out, ftype, "2"],
        timeout=300,
        tail_lines=100_000,
    )
    if not finished.ok:
        out.unlink(missing_ok=True)  # llama-quantize leaves a truncated output behind on failure
    return finished


@pytest.fixture(scope="module")
def q3(make_model):
    """qwen3moe F16, n_embd = n_ff_exp = 256 (IQ types apply), 8 experts, top-2, 2 blocks."""
    return make_model("qwen3moe", "F16")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("imatrix")


@pytest.fixture(scope="module")
def calibration(work):
    text = work / "calibration.txt"
    rng = random.Random(3)
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(1500)) + "\n")
    return text


@pytest.fixture(scope="module")
def llama_imatrix(llama_tools, q3, calibration, work):
    """{"gguf": path, "dat": path}: the same collection written by llama-imatrix in both formats."""
    return {
        "gguf": run_llama_imatrix(llama_tools, q3, calibration, work / "q3.imatrix.gguf"),
        "dat": run_llama_imatrix(llama_tools, q3, calibration, work / "q3.imatrix.dat", "--output-format", "dat"),
    }


@pytest.fixture(scope="module")
def pruned(q3, work):
    """q3 pruned to 4 experts with KEEP (provenance keys on), and the keep-set file."""
    keep = work / "keep.json"
    keep.write_text(json.dumps({"layers": KEEP}))
    model = read_model(q3)
    layout = inspect_layout(model)
    out = work / "q3-k4.gguf"
    execute(plan_prune(model, layout, load_keepset(keep, layout), out), model, report_path=work / "prune-report.json")
    return out, keep


@pytest.fixture(scope="module")
def pruned_bare(q3, work):
    """The same prune without provenance keys."""
    model = read_model(q3)
    layout = inspect_layout(model)
    keep = work / "keep.json"
    keep.write_text(json.dumps({"layers": KEEP}))
    out = work / "q3-k4-bare.gguf"
    execute(
        plan_prune(model, layout, load_keepset(keep, layout), out, provenance=False),
        model,
        report_path=work / "prune-report-bare.json",
    )
    return out


@pytest.fixture()
def synthetic(q3, tmp_path):
    return synthetic_gguf(tmp_path / "synthetic.imatrix.gguf", q3)


def tensor_data(path):
    f = read_file(path)
    raw = path.read_bytes()
    return {t.name: raw[f.data_start + t.offset : f.data_start + t.offset + t.nbytes] for t in f.tensors}


def rewrite(imatrix, path):
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        write_to_fd(imatrix, fd)
    finally:
        os.close(fd)
    return path


# ---------------------------------------------------------------------------------------------
# read / write / convert


def test_synthetic_round_trips_byte_for_byte(synthetic, q3, tmp_path):
    assert rewrite(read_imatrix(synthetic), tmp_path / "again.gguf").read_bytes() == synthetic.read_bytes()
    dat = pack_dat(
        tmp_path / "s.dat",
        [("blk.0.attn_q.weight", 3, np.arange(256)), ("blk.0.ffn_up_exps.weight", 7, np.arange(2048) / 7)],
    )
    assert rewrite(read_imatrix(dat), tmp_path / "again.dat").read_bytes() == dat.read_bytes()
    no_trailer = pack_dat(tmp_path / "t.dat", [("blk.0.attn_q.weight", 3, np.arange(256))], trailer=None)
    assert rewrite(read_imatrix(no_trailer), tmp_path / "again2.dat").read_bytes() == no_trailer.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_llama_imatrix_files_round_trip_byte_for_byte(llama_imatrix, tmp_path, fmt):
    src = llama_imatrix[fmt]
    imatrix = read_imatrix(src)
    assert imatrix.format == fmt and len(imatrix.entries) == 16
    assert rewrite(imatrix, tmp_path / f"again.{fmt}").read_bytes() == src.read_bytes()


@pytest.mark.slow
def test_conversions_match_llama_imatrix_byte_for_byte(llama_imatrix, llama_tools, q3, tmp_path):
    """Our gguf -> dat equals the .dat llama-imatrix wrote from the same run, and both our
    conversions equal llama-imatrix's own (`--in-file X -o Y`, combine mode)."""
    ours_dat, ours_gguf = tmp_path / "ours.dat", tmp_path / "ours.gguf"
    r = ggufcarve("imatrix", "convert", llama_imatrix["gguf"], "-o", ours_dat)
    assert r.code == 0, r.stderr
    assert "per-expert counts" in r.stderr  # what a .dat cannot hold is said
    assert ours_dat.read_bytes() == llama_imatrix["dat"].read_bytes()
    theirs_dat = run_llama_imatrix(
        llama_tools, q3, None, tmp_path / "theirs.dat", "--in-file", llama_imatrix["gguf"], "--output-format", "dat"
    )
    assert ours_dat.read_bytes() == theirs_dat.read_bytes()

    r = ggufcarve("imatrix", "convert", llama_imatrix["dat"], "-o", ours_gguf, "--chunk-size", 128)
    assert r.code == 0, r.stderr
    theirs_gguf = run_llama_imatrix(llama_tools, q3, None, tmp_path / "theirs.gguf", "--in-file", llama_imatrix["dat"])
    assert ours_gguf.read_bytes() == theirs_gguf.read_bytes()


@pytest.mark.slow
def test_gguf_to_dat_to_gguf_keeps_every_value(llama_imatrix, tmp_path):
    src = llama_imatrix["gguf"]
    dat, back = tmp_path / "x.dat", tmp_path / "back.gguf"
    assert ggufcarve("imatrix", "convert", src, "-o", dat).code == 0
    assert ggufcarve("imatrix", "convert", dat, "-o", back, "--format", "gguf", "--chunk-size", 128).code == 0
    a, b = read_imatrix(src), read_imatrix(back)
    assert [e.name for e in a.entries] == [e.name for e in b.entries]
    assert (a.datasets, a.chunk_count, a.chunk_size) == (b.datasets, b.chunk_count, b.chunk_size)
    for ea, eb in zip(a.entries, b.entries):
        assert ea.nval == eb.nval
        # the values llama-quantize uses: sum/count vs ((sum/count)*ncall)/ncall, float32
        np.testing.assert_array_max_ulp(ea.normalized(), eb.normalized(), maxulp=1)
    # and a .dat survives dat -> gguf -> dat value for value
    again = tmp_path / "again.dat"
    assert ggufcarve("imatrix", "convert", back, "-o", again).code == 0
    for ea, eb in zip(read_imatrix(dat).entries, read_imatrix(again).entries):
        assert ea.ncall == eb.ncall
        np.testing.assert_array_max_ulp(ea.sums(), eb.sums(), maxulp=1)


def test_zero_count_experts_inspect_and_dat(q3, tmp_path):
    src = synthetic_gguf(tmp_path / "z.gguf", q3, zero=(2, 5))
    r = ggufcarve("imatrix", "inspect", src, "--json")
    assert r.code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["per_expert_counts"] and doc["chunk_size"] == 128 and doc["datasets"] == ["calibration.txt"]
    assert [b["zero_count_experts"] for b in doc["moe_blocks"]] == [[2, 5], [2, 5]]
    text = ggufcarve("imatrix", "inspect", src)
    assert text.code == 0 and "2: 2,5" in text.stdout
    # a never-routed expert is stored as 1 * ncall, as llama-imatrix's legacy writer does
    conversion = to_dat(read_imatrix(src))
    entry = next(e for e in conversion.imatrix.entries if e.name == "blk.0.ffn_up_exps.weight")
    rows = entry.sums().reshape(N_EXPERT, -1)
    assert (rows[2] == entry.ncall).all() and (rows[5] == entry.ncall).all()


# ---------------------------------------------------------------------------------------------
# remap


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_remapped_imatrix_quantizes_the_pruned_model(llama_imatrix, llama_tools, pruned, tmp_path, fmt):
    model, _ = pruned
    remapped = tmp_path / f"k4.imatrix.{fmt}"
    r = ggufcarve("imatrix", "remap", llama_imatrix[fmt], "--model", model, "-o", remapped)
    assert r.code == 0, r.stderr
    out = tmp_path / "k4-IQ2_XS.gguf"
    proc = run_quantize(llama_tools, remapped, model, out)
    assert proc.returncode == 0, "\n".join(proc.tail[-40:])
    types = {t.type_name for t in read_model(out).tensors}
    assert "IQ2_XS" in types
    result = probe(out, TOKENS)
    assert result.ok, result.stderr[-2000:]
    assert np.isfinite(result.logits).all()


@pytest.mark.slow
def test_unremapped_imatrix_fails_as_llama_reports(llama_imatrix, llama_tools, pruned, tmp_path):
    """The test above can fail: llama-quantize rejects the 8-expert imatrix for the 4-expert model,
    and `imatrix inspect --model` reports the same line before anything runs."""
    model, _ = pruned
    out = tmp_path / "bad.gguf"
    proc = run_quantize(llama_tools, llama_imatrix["gguf"], model, out)
    expected = "imatrix size 2048 is different from tensor size 1024 for blk.0.ffn_down_exps.weight"
    assert proc.returncode != 0
    assert f"failed to quantize: {expected}" in "\n".join(proc.tail)
    r = ggufcarve("imatrix", "inspect", llama_imatrix["gguf"], "--model", model)
    assert r.code == 1 and expected in r.error_line and "6 problems" in r.error_line, r.stderr


@pytest.mark.slow
def test_remap_takes_kept_rows_in_keep_order(llama_imatrix, pruned, tmp_path):
    model, keep = pruned
    out = tmp_path / "k4.gguf"
    r = ggufcarve("imatrix", "remap", llama_imatrix["gguf"], "--keep", keep, "--model", model, "-o", out)
    assert r.code == 0, r.stderr
    src, dst = read_imatrix(llama_imatrix["gguf"]), read_imatrix(out)
    before, after = tensor_data(llama_imatrix["gguf"]), tensor_data(out)
    for e in src.entries:
        new = dst.entry_index[e.name]
        if "_exps." in e.name:
            ids = KEEP[e.name.split(".")[1]]
            assert np.array_equal(new.sums(), e.sums()[ids]) and np.array_equal(new.counts, e.counts[ids])
            assert read_file(out).tensors and new.sums_ne == (256, 4) and new.counts_ne == (1, 4)
        else:
            assert after[e.name + ".in_sum2"] == before[e.name + ".in_sum2"]
            assert after[e.name + ".counts"] == before[e.name + ".counts"]
    # every original key byte for byte, plus the note of the remap
    src_kvs = {kv.key: kv.raw for kv in read_file(llama_imatrix["gguf"]).kvs}
    out_file = read_file(out)
    assert {k: v for k, v in ((kv.key, kv.raw) for kv in out_file.kvs) if k in src_kvs} == src_kvs
    assert out_file.get("ggufcarve.kept_expert_count") == 4 and out_file.get("ggufcarve.source.expert_count") == 8
    assert out_file.get("ggufcarve.imatrix.source_sha256") == sha256(llama_imatrix["gguf"])
    assert keepset_from_provenance(read_model(out).get, out.name).layers == {int(b): tuple(v) for b, v in KEEP.items()}

    # .dat: expert-major rows of the flat values
    out_dat = tmp_path / "k4.dat"
    assert (
        ggufcarve(
            "imatrix",
            "remap",
            llama_imatrix["dat"],
            "--model",
            model,
            "-o",
            out_dat,
            "--report",
            tmp_path / "dat-report.json",
        ).code
        == 0
    )
    src_dat, dst_dat = read_imatrix(llama_imatrix["dat"]), read_imatrix(out_dat)
    for e in src_dat.entries:
        new = dst_dat.entry_index[e.name]
        assert new.ncall == e.ncall
        if "_exps." in e.name:
            rows = e.sums().reshape(N_EXPERT, -1)[KEEP[e.name.split(".")[1]]]
            assert np.array_equal(new.sums().reshape(4, -1), rows)
        else:
            assert np.array_equal(new.sums(), e.sums())
    # remapping commutes with conversion: the GGUF remapped into a .dat equals the remapped llama .dat
    via_gguf = tmp_path / "via.dat"
    r = ggufcarve(
        "imatrix",
        "remap",
        llama_imatrix["gguf"],
        "--model",
        model,
        "-o",
        via_gguf,
        "--report",
        tmp_path / "via-report.json",
    )
    assert r.code == 0 and "gguf -> dat drops: per-expert counts" in r.stderr, r.stderr
    assert via_gguf.read_bytes() == out_dat.read_bytes()


@pytest.mark.slow
def test_remap_report(llama_imatrix, pruned, tmp_path):
    model, _ = pruned
    out = tmp_path / "k4.gguf"
    assert ggufcarve("imatrix", "remap", llama_imatrix["gguf"], "--model", model, "-o", out).code == 0
    report = json.loads((tmp_path / "method" / "k4.imatrix-remap-report.json").read_text())
    assert (
        report["schema_version"] == 2
        and report["kind"] == "imatrix-remap-report"
        and report["expert_count"] == {"before": 8, "after": 4}
    )
    source = llama_imatrix["gguf"]
    assert report["inputs"] == [{"name": source.name, "sha256": sha256(source), "bytes": source.stat().st_size}]
    assert (
        report["input"]["sha256"] == sha256(source)
        and report["output"]["sha256"] == sha256(out)
        and report["output"]["name"] == "k4.gguf"
    )
    counts = {e.name: e.counts for e in read_imatrix(llama_imatrix["gguf"]).entries}
    assert len(report["tensors"]) == 6
    for t in report["tensors"]:
        assert t["kept"] == KEEP[str(t["block"])] and sorted(t["kept"] + t["dropped"]) == list(range(8))
        assert t["routed_kept"] == int(counts[t["name"]][t["kept"]].sum())
        assert t["routed_kept"] + t["routed_dropped"] == int(counts[t["name"]].sum())
    routing = report["routing"]
    assert routing["available"] and 0 < routing["share_kept"] < 1
    assert routing["routed_total"] == sum(int(counts[f"blk.{b}.ffn_up_exps.weight"].sum()) for b in (0, 1))
    assert len(report["entries_unchanged"]) == 10 and report["models"]["pruned"]["expert_count"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_identity_keepset_keeps_every_value(llama_imatrix, q3, tmp_path, fmt):
    src = llama_imatrix[fmt]
    out = tmp_path / f"same.{fmt}"
    r = ggufcarve("imatrix", "remap", src, "--source-model", q3, "--keep-first", 8, "-o", out)
    assert r.code == 0, r.stderr
    if fmt == "dat":
        assert out.read_bytes() == src.read_bytes()
    else:
        assert tensor_data(out) == tensor_data(src)
        assert read_file(out).get("ggufcarve.kept_expert_count") == 8


@pytest.mark.slow
def test_source_model_and_pruned_model_give_the_same_file(llama_imatrix, q3, pruned, tmp_path):
    model, _ = pruned
    published = tmp_path / "kept_expert_indices.json"
    published.write_text(json.dumps({f"main_{b}": {"keep": ids} for b, ids in KEEP.items()}))
    a, b = tmp_path / "a" / "x.gguf", tmp_path / "b" / "x.gguf"
    a.parent.mkdir(), b.parent.mkdir()
    assert (
        ggufcarve("imatrix", "remap", llama_imatrix["gguf"], "--source-model", q3, "--keep", published, "-o", a).code
        == 0
    )
    r = ggufcarve("imatrix", "remap", llama_imatrix["gguf"], "--model", model, "-o", b)  # keep-set from provenance
    assert r.code == 0, r.stderr
    assert a.read_bytes() == b.read_bytes()
    c = tmp_path / "c" / "x.gguf"
    c.parent.mkdir()
    assert (
        ggufcarve("imatrix", "remap", llama_imatrix["gguf"], "--model", model, "--source-model", q3, "-o", c).code == 0
    )
    assert c.read_bytes() == a.read_bytes()


@pytest.mark.slow
def test_qwen35moe_with_an_mtp_block(make_model, llama_tools, calibration, tmp_path):
    """llama-imatrix never runs the MTP block: remap warns, and IQ2_XS works with an override for it."""
    src = make_model("qwen35moe", "F16")
    imatrix = run_llama_imatrix(llama_tools, src, calibration, tmp_path / "q35.imatrix.gguf")
    keep = tmp_path / "kept_expert_indices.json"
    keep.write_text(json.dumps({"main_0": [7, 2, 4, 0], "main_1": {"keep": [1, 3, 5, 6]}, "mtp_0": [0, 1, 2, 3]}))
    model = read_model(src)
    layout = inspect_layout(model)
    pruned_path = tmp_path / "q35-k4.gguf"
    execute(plan_prune(model, layout, load_keepset(keep, layout), pruned_path), model)
    out = tmp_path / "q35-k4.imatrix.gguf"
    r = ggufcarve("imatrix", "remap", imatrix, "--model", pruned_path, "-o", out)
    assert r.code == 0, r.stderr
    assert "MTP block(s) 2 have no imatrix entries" in r.stderr
    quantized = tmp_path / "q35-IQ2_XS.gguf"
    failed = run_quantize(llama_tools, out, pruned_path, quantized)
    assert failed.returncode != 0 and "Missing importance matrix for tensor blk.2." in "\n".join(failed.tail)
    proc = run_quantize(llama_tools, out, pruned_path, quantized, "IQ2_XS", "--tensor-type", r"blk\.2\.=q4_K")
    assert proc.returncode == 0, "\n".join(proc.tail[-40:])
    result = probe(quantized, TOKENS)
    assert result.ok and np.isfinite(result.logits).all(), result.stderr[-2000:]


def test_mtp_expert_entries_are_remapped_with_mtp_keys(make_model, tmp_path):
    """Entries for an MTP block's experts (llama-imatrix writes none, other collectors may) follow mtp_<j>."""
    src = make_model("qwen35moe", "F16")
    imatrix = synthetic_gguf(tmp_path / "mtp.gguf", src)
    keep = tmp_path / "kept_expert_indices.json"
    keep.write_text(json.dumps({"main_0": [0, 1, 2, 3], "main_1": [0, 1, 2, 3], "mtp_0": [7, 5, 3, 1]}))
    out = tmp_path / "out.gguf"
    r = ggufcarve("imatrix", "remap", imatrix, "--source-model", src, "--keep", keep, "-o", out)
    assert r.code == 0, r.stderr
    before, after = read_imatrix(imatrix).entry_index, read_imatrix(out).entry_index
    name = "blk.2.ffn_down_exps.weight"
    assert np.array_equal(after[name].sums(), before[name].sums()[[7, 5, 3, 1]])
    report = json.loads((tmp_path / "method" / "out.imatrix-remap-report.json").read_text())
    assert any(t["name"] == name and t["mtp"] for t in report["tensors"])


def test_many_remaps_share_one_folder_each_with_its_report(synthetic, q3, tmp_path):
    for name, k in (("k4.gguf", 4), ("k2.dat", 2)):
        r = ggufcarve(
            "imatrix", "remap", synthetic, "--source-model", q3, "--keep-first", k, "-o", tmp_path / name, "-q"
        )
        assert r.code == 0, r.stderr
    reports = {p.name: json.loads(p.read_text()) for p in (tmp_path / "method").iterdir()}
    assert sorted(reports) == ["k2.imatrix-remap-report.json", "k4.imatrix-remap-report.json"]
    assert reports["k4.imatrix-remap-report.json"]["output"]["sha256"] == sha256(tmp_path / "k4.gguf")
    assert reports["k2.imatrix-remap-report.json"]["expert_count"]["after"] == 2
    assert all(
        str(tmp_path) not in json.dumps(doc) and str(synthetic.parent) not in json.dumps(doc)
        for doc in reports.values()
    )
    again = ggufcarve(
        "imatrix", "remap", synthetic, "--source-model", q3, "--keep-first", 3, "-o", tmp_path / "k4.gguf"
    )
    assert again.code == 1 and "already exists" in again.error_line and "--force" in again.error_line


def test_dry_run_writes_nothing(synthetic, q3, tmp_path):
    r = ggufcarve(
        "imatrix",
        "remap",
        synthetic,
        "--source-model",
        q3,
        "--keep-first",
        4,
        "-o",
        tmp_path / "o.gguf",
        "--dry-run",
        "--json",
    )
    assert r.code == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["expert_count"] == {"before": 8, "after": 4} and len(plan["tensors_remapped"]) == 6
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "method").exists()


# ---------------------------------------------------------------------------------------------
# bad input: one line, non-zero exit, no output


def refused(tmp_path, *args, message):
    out_dir = tmp_path / "out"
    out_dir.mkdir(exist_ok=True)
    r = ggufcarve("imatrix", *args)
    assert r.code != 0
    line = r.error_line
    assert line.startswith("error:") and message in line and "(hint:" in line, r.stderr
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1, r.stderr
    assert list(out_dir.iterdir()) == []
    return r


def remap_refused(tmp_path, imatrix, *args, message):
    before = sha256(imatrix)
    r = refused(tmp_path, "remap", imatrix, *args, "-o", tmp_path / "out" / "x.gguf", message=message)
    assert sha256(imatrix) == before
    return r


def test_truncated_gguf(synthetic, q3, tmp_path):
    bad = tmp_path / "t.gguf"
    bad.write_bytes(synthetic.read_bytes()[:-3000])
    remap_refused(tmp_path, bad, "--source-model", q3, "--keep-first", 4, message="truncated")
    refused(tmp_path, "inspect", bad, message="truncated")


def test_truncated_dat(tmp_path, q3):
    dat = pack_dat(
        tmp_path / "ok.dat",
        [("blk.0.attn_q.weight", 3, np.ones(256)), ("blk.0.attn_k.weight", 3, np.ones(256))],
        trailer=None,
    )
    bad = tmp_path / "t.dat"
    bad.write_bytes(dat.read_bytes()[:-100])
    remap_refused(tmp_path, bad, "--source-model", q3, "--keep-first", 4, message="truncated or corrupt .dat imatrix")
    refused(tmp_path, "convert", bad, "-o", tmp_path / "out" / "x.gguf", message="truncated")


def test_garbage_and_trailing_bytes(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello, this is not an imatrix file at all" * 10)
    refused(tmp_path, "inspect", junk, message="neither a GGUF imatrix nor a legacy .dat imatrix")
    dat = pack_dat(tmp_path / "x.dat", [("blk.0.attn_q.weight", 3, np.ones(256))])
    extra = tmp_path / "extra.dat"
    extra.write_bytes(dat.read_bytes() + b"\x00" * 7)
    refused(tmp_path, "inspect", extra, message="unexpected bytes after the trailer")


def test_a_model_is_not_an_imatrix(q3, tmp_path):
    refused(tmp_path, "inspect", q3, message="not an imatrix")


def test_non_finite_values(q3, tmp_path):
    entries = synthetic_entries(q3)
    tensors = []
    for name, sne, sums, cne, counts in entries:
        if name == "blk.1.ffn_up_exps.weight":
            sums = sums.copy()
            sums[3, 17] = np.nan
        tensors += [(name + ".in_sum2", sne, sums), (name + ".counts", cne, counts)]
    bad = pack_gguf(tmp_path / "nan.gguf", tensors)
    r = remap_refused(tmp_path, bad, "--source-model", q3, "--keep-first", 4, message="non-finite")
    assert "blk.1.ffn_up_exps.weight" in r.error_line and "index" in r.error_line
    dat = pack_dat(tmp_path / "inf.dat", [("blk.0.attn_q.weight", 3, np.r_[np.ones(255), np.inf])])
    refused(tmp_path, "convert", dat, "-o", tmp_path / "out" / "x.gguf", message="non-finite")


def test_missing_imatrix_keys_and_unpaired_tensors(q3, tmp_path):
    name, sne, sums, cne, counts = synthetic_entries(q3)[0]
    no_size = pack_gguf(
        tmp_path / "nokey.gguf",
        [(name + ".in_sum2", sne, sums), (name + ".counts", cne, counts)],
        skip_keys=("imatrix.chunk_size",),
    )
    refused(tmp_path, "inspect", no_size, message="lacks imatrix.chunk_size")
    unpaired = pack_gguf(tmp_path / "unpaired.gguf", [(name + ".in_sum2", sne, sums)])
    refused(tmp_path, "inspect", unpaired, message=f"{name}.in_sum2 but no {name}.counts")


def test_imatrix_expert_count_differs_from_the_keepset_model(make_model, q3, tmp_path):
    """An imatrix of the 8-expert model with a keep-set for a 16-expert one."""
    imatrix = synthetic_gguf(tmp_path / "i.gguf", q3)
    sixteen = make_model("qwen3moe", "F16", n_expert=16)
    r = remap_refused(
        tmp_path,
        imatrix,
        "--source-model",
        sixteen,
        "--keep-first",
        4,
        message="holds 8 experts but the keep-set selects from 16",
    )
    assert "(and 5 more expert entries)" in r.error_line


def test_entry_size_fits_neither_layout(q3, tmp_path):
    tensors = []
    for name, sne, sums, cne, counts in synthetic_entries(q3):
        if name == "blk.0.ffn_gate_exps.weight":
            sne, sums = (255, 8), sums[:, :255]
        if name == "blk.1.attn_v.weight":
            sne, sums = (128,), sums[:128]
        tensors += [(name + ".in_sum2", sne, sums), (name + ".counts", cne, counts)]
    bad = pack_gguf(tmp_path / "bad.gguf", tensors)
    r = remap_refused(
        tmp_path,
        bad,
        "--source-model",
        q3,
        "--keep-first",
        4,
        message="fits neither the dense (256) nor the expert (8 x 256) layout",
    )
    assert "blk.1.attn_v.weight has 128 values" in r.error_line and "2 problems" in r.error_line


def test_entries_the_model_does_not_have_reported_at_once(q3, pruned, tmp_path):
    model, _ = pruned
    tensors = []
    for name, sne, sums, cne, counts in synthetic_entries(q3):
        if name == "blk.1.attn_q.weight":
            sne, sums = (200,), sums[:200]
        tensors += [(name + ".in_sum2", sne, sums), (name + ".counts", cne, counts)]
    tensors += [("blk.9.attn_q.weight.in_sum2", (256,), np.ones(256)), ("blk.9.attn_q.weight.counts", (1,), np.ones(1))]
    tensors += [
        ("blk.0.ffn_gate.weight.in_sum2", (256,), np.ones(256)),
        ("blk.0.ffn_gate.weight.counts", (1,), np.ones(1)),
    ]
    bad = pack_gguf(tmp_path / "extra.gguf", tensors)
    r = remap_refused(tmp_path, bad, "--model", model, message="3 problems")
    assert "blk.9.attn_q.weight is not a tensor of q3-k4.gguf" in r.error_line
    assert (
        "blk.1.attn_q.weight has 200 values" in r.error_line and "blk.0.ffn_gate.weight is not a tensor" in r.error_line
    )
    r = refused(
        tmp_path,
        "inspect",
        bad,
        "--model",
        q3,
        message="imatrix size 200 is different from tensor size 256 for blk.1.attn_q.weight",
    )
    assert "blk.9.attn_q.weight is not a tensor" in r.error_line


def test_already_remapped_input(synthetic, q3, pruned, tmp_path):
    model, _ = pruned
    once = tmp_path / "once.gguf"
    assert ggufcarve("imatrix", "remap", synthetic, "--model", model, "-o", once).code == 0
    remap_refused(tmp_path, once, "--model", model, message="already remapped by ggufcarve to 4 experts")
    dat = tmp_path / "once.dat"
    assert ggufcarve("imatrix", "convert", once, "-o", dat).code == 0
    remap_refused(tmp_path, dat, "--model", model, message="already holds 4 experts (the pruned count)")


def test_inspect_catches_an_imatrix_remapped_with_another_keepset(synthetic, q3, pruned, tmp_path):
    model, _ = pruned
    other = tmp_path / "other.gguf"
    assert ggufcarve("imatrix", "remap", synthetic, "--source-model", q3, "--keep-first", 4, "-o", other).code == 0
    refused(
        tmp_path,
        "inspect",
        other,
        "--model",
        model,
        message="remapped with another keep-set than q3-k4.gguf was pruned with",
    )


def test_remap_without_a_model(synthetic, q3, pruned, tmp_path):
    """A GGUF imatrix and a keep-set by block index suffice; the output equals the model-checked one."""
    _, keep = pruned
    with_model = tmp_path / "with-model.gguf"
    assert (
        ggufcarve("imatrix", "remap", synthetic, "--source-model", q3, "--keep", keep, "-o", with_model, "-q").code == 0
    )
    alone = tmp_path / "alone" / "x.gguf"
    r = ggufcarve("imatrix", "remap", synthetic, "--keep", keep, "-o", alone, "-q")
    assert r.code == 0, r.stderr
    assert alone.read_bytes() == with_model.read_bytes()
    notes = [line for line in r.stderr.splitlines() if line.strip()]
    assert (
        len(notes) == 1
        and notes[0].startswith("note: no model given: 8 experts and MoE blocks 0-1 read from the imatrix")
        and "size check" in notes[0]
    )


def test_remap_without_a_model_refuses_what_needs_one(synthetic, llama_imatrix, tmp_path):
    mtp_keys = tmp_path / "kept_expert_indices.json"
    mtp_keys.write_text(json.dumps({"main_0": KEEP["0"], "main_1": KEEP["1"], "mtp_0": KEEP["0"]}))
    remap_refused(tmp_path, synthetic, "--keep", mtp_keys, message="'mtp_0' counts MTP blocks after the main layers")
    remap_refused(tmp_path, llama_imatrix["dat"], "--keep-first", 4, message="the expert count cannot be read from it")
    remap_refused(tmp_path, synthetic, "--keep-first", 1, "--keep-ids", "0", message="give exactly one of")


def test_keepset_problems(synthetic, q3, pruned, pruned_bare, tmp_path):
    model, _ = pruned
    remap_refused(tmp_path, synthetic, "--model", pruned_bare, message="no keep-set")
    remap_refused(tmp_path, synthetic, "--model", model, "--keep-first", 4, message="differs from the one")
    remap_refused(
        tmp_path, synthetic, "--model", pruned_bare, "--keep-first", 2, message="keeps 2 experts per block but"
    )
    remap_refused(tmp_path, synthetic, "--source-model", q3, "--keep-ids", "0,1,9,3", message="out of range")


def test_outputs_are_never_overwritten(synthetic, q3, tmp_path):
    (tmp_path / "out").mkdir()
    exists = tmp_path / "exists.gguf"
    exists.write_bytes(b"keep me")
    r = ggufcarve("imatrix", "remap", synthetic, "--source-model", q3, "--keep-first", 4, "-o", exists)
    assert r.code != 0 and "already exists" in r.error_line and exists.read_bytes() == b"keep me"
    before = sha256(synthetic)
    r = ggufcarve("imatrix", "remap", synthetic, "--source-model", q3, "--keep-first", 4, "-o", synthetic, "--force")
    assert r.code != 0 and "is the source file" in r.error_line and sha256(synthetic) == before
    r = ggufcarve("imatrix", "convert", synthetic, "-o", tmp_path / "c.gguf")
    assert r.code != 0 and "already a gguf imatrix" in r.error_line and not (tmp_path / "c.gguf").exists()
    r = ggufcarve("imatrix", "convert", synthetic, "-o", synthetic, "--format", "dat", "--force")
    assert r.code != 0 and "is the source file" in r.error_line and sha256(synthetic) == before
    assert (
        ggufcarve("imatrix", "remap", synthetic, "--source-model", q3, "--keep-first", 4, "-o", exists, "--force").code
        == 0
    )
    assert read_imatrix(exists).get("ggufcarve.kept_expert_count") == 4
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_library_never_prints(synthetic, q3, tmp_path, capsys):
    from ggufcarve.imatrix.check import summarize
    from ggufcarve.imatrix.remap import execute_remap, plan_remap
    from ggufcarve.moe.keepset import keep_first

    model = read_model(q3)
    layout = inspect_layout(model)
    imatrix = read_imatrix(synthetic)
    plan = plan_remap(imatrix, keep_first(layout, 4), layout, tmp_path / "o.dat", source=model)
    execute_remap(plan)
    summarize(read_imatrix(tmp_path / "o.dat"), model)
    assert capsys.readouterr() == ("", "")


def test_in_sum_tensors_are_kept_and_remapped(q3, tmp_path):
    """Some builds also write <W>.in_sum (llama.cpp ignores it): carried over, and remapped like in_sum2."""
    tensors = []
    for name, sne, sums, cne, counts in synthetic_entries(q3):
        tensors += [
            (name + ".in_sum2", sne, sums),
            (name + ".in_sum", sne, np.sqrt(sums)),
            (name + ".counts", cne, counts),
        ]
    src = pack_gguf(tmp_path / "in_sum.gguf", tensors)
    imatrix = read_imatrix(src)
    assert all(e.has_in_sum for e in imatrix.entries)
    assert rewrite(imatrix, tmp_path / "again.gguf").read_bytes() == src.read_bytes()
    out = tmp_path / "k4.gguf"
    assert ggufcarve("imatrix", "remap", src, "--source-model", q3, "--keep-ids", "5,0,2,7", "-o", out).code == 0
    data_in, data_out = tensor_data(src), tensor_data(out)
    name = "blk.1.ffn_down_exps.weight.in_sum"
    rows_in = np.frombuffer(data_in[name], dtype="<f4").reshape(N_EXPERT, -1)
    assert np.array_equal(np.frombuffer(data_out[name], dtype="<f4").reshape(4, -1), rows_in[[5, 0, 2, 7]])
    r = ggufcarve("imatrix", "convert", src, "-o", tmp_path / "x.dat")
    assert r.code == 0 and "the <weight>.in_sum tensors" in r.stderr


def test_bad_format_options(synthetic, q3, tmp_path):
    remap_refused(
        tmp_path,
        synthetic,
        "--source-model",
        q3,
        "--keep-first",
        4,
        "--format",
        "bin",
        message="--format must be one of gguf, dat (got 'bin')",
    )
    refused(
        tmp_path,
        "convert",
        synthetic,
        "-o",
        tmp_path / "out" / "x.imatrix",
        message="cannot tell the output format from x.imatrix",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,keep_ids", [("deepseek2", "0,1,4,5,8,9,12,13"), ("gpt-oss", "6,1,4,3"), ("fused", "7,0,5,2")]
)
def test_other_fixture_architectures(make_model, llama_tools, calibration, tmp_path, arch, keep_ids):
    """Grouped routing with a dense lead block and shared experts, router/expert biases, fused
    gate_up experts (plus an MTP block): the remapped imatrix quantizes the pruned model to IQ2_XS."""
    src = make_model(arch, "F16")
    imatrix = run_llama_imatrix(llama_tools, src, calibration, tmp_path / f"{arch}.imatrix.gguf")
    pruned_path = tmp_path / f"{arch}-pruned.gguf"
    assert ggufcarve("prune", src, "--keep-ids", keep_ids, "-o", pruned_path, "-q").code == 0
    out = tmp_path / f"{arch}-pruned.imatrix.dat"
    r = ggufcarve("imatrix", "remap", imatrix, "--model", pruned_path, "-o", out, "--report", tmp_path / "remap.json")
    assert r.code == 0, r.stderr
    report = json.loads((tmp_path / "remap.json").read_text())
    assert report["tensors"] and all(t["kept"] == [int(i) for i in keep_ids.split(",")] for t in report["tensors"])
    overrides = ("--tensor-type", r"blk\.2\.=q4_K") if arch == "fused" else ()
    proc = run_quantize(llama_tools, out, pruned_path, tmp_path / "iq2.gguf", "IQ2_XS", *overrides)
    assert proc.returncode == 0, "\n".join(proc.tail[-40:])
