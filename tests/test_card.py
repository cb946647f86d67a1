"""The model card as the Hugging Face Hub reads it, and `verify` on complete, partial and
hand-edited releases. The release is built as a user builds one: select (calibration trace) ->
prune -> ladder (libllama's quantizer) -> eval with an unpruned comparison -> card."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from clirun import ggufcarve, sha256
from hub import hub_problems

CTX, CHUNKS = 128, 2
SPEC = '[defaults]\nallow_requantize = true\n[[rungs]]\nftype = "Q6_K"\n[[rungs]]\nftype = "Q4_K_M"\n'
GATE = "max_ppl_increase_percent = 1000.0\nmax_kld_mean = 5.0\nmin_same_top_p = 0.01\n"
WORDS = "experts route tokens through layers while the calibration text exercises the router of every block".split()


@pytest.fixture(scope="module")
def built(q8_moe, make_model, tmp_path_factory):
    """A complete release of a 6-of-8-experts prune chosen by a calibration trace, its evaluation
    against the F16 model with the unpruned Q8_0 as comparison, and the card."""
    base = tmp_path_factory.mktemp("card")
    rng = random.Random(3)
    calibration = base / "calibration.txt"
    calibration.write_text(" ".join(rng.choice(WORDS) for _ in range(400)) + "\n")
    heldout = base / "heldout.txt"
    heldout.write_text(" ".join(rng.choice(WORDS) for _ in range(150)) + "\n")
    work = base / "models"
    work.mkdir()
    selection = work / "SELECTION.json"
    for argv in (
        (
            "select",
            q8_moe,
            "--method",
            "frequency",
            "--calibration",
            calibration,
            "--ctx",
            64,
            "--max-tokens",
            256,
            "--keep",
            6,
            "-t",
            2,
            "-o",
            selection,
            "--no-heatmap",
            "-q",
        ),
        ("prune", q8_moe, "--keep", selection, "-o", work / "tiny-6e-Q8_0.gguf", "-q"),
    ):
        result = ggufcarve(*argv)
        assert result.code == 0, result.stderr[-3000:]
    (base / "spec.toml").write_text(SPEC)
    (base / "gate.toml").write_text(GATE)
    release = base / "release"
    result = ggufcarve(
        "ladder",
        "run",
        base / "spec.toml",
        "--source",
        work / "tiny-6e-Q8_0.gguf",
        "-o",
        release,
        "--model-name",
        "tiny-6e",
        "--quantizer",
        "libllama",
        "-t",
        2,
        "-q",
    )
    assert result.code == 0, result.stderr[-3000:]
    assert not (
        release / ".ggufcarve-fragments"
    ).exists()  # a whole ladder, complete: its fragments are merged and gone
    assert (release / "method" / "expert-selection.json").read_bytes() == selection.read_bytes()
    result = ggufcarve(
        "eval",
        release,
        q8_moe,
        "--reference",
        make_model("qwen3moe", dtype="F16"),
        "--heldout",
        heldout,
        "--ctx",
        CTX,
        "--chunks",
        CHUNKS,
        "--gate",
        base / "gate.toml",
        "--speed-runs",
        0,
        "--cache",
        base / "cache",
        "-t",
        2,
        "-o",
        release / "evaluation",
        "-q",
    )
    assert result.code == 0, result.stderr[-3000:]
    carded = ggufcarve("card", release)
    assert carded.code == 0, carded.stderr[-3000:]
    return {
        "release": release,
        "calibration": calibration,
        "heldout": heldout,
        "unpruned": q8_moe,
        "card_stderr": carded.stderr,
    }


@pytest.fixture
def copy(built, tmp_path) -> Path:
    out = tmp_path / "release"
    shutil.copytree(built["release"], out, copy_function=shutil.copy2)
    return out


def verify_json(release: Path, *args: object) -> tuple[int, dict]:
    result = ggufcarve("verify", release, "--json", *args)
    return result.code, json.loads(result.stdout)


# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_card_without_a_known_base_model_or_license_says_so(built):
    release = built["release"]
    front, problems = hub_problems(release)
    # the tiny model's GGUF names no base model and no license: none is invented
    assert "base_model" not in front and "license" not in front and problems == ["no base_model", "license None"]
    card = (release / "README.md").read_text()
    assert "The base model is not stated" in card and "The license is not stated" in card and "--base-model" not in card
    assert (
        "# tiny-6e, pruned to 6 of 8 experts, GGUF" in card
    )  # the ladder's model name: the GGUF has no general.basename
    assert "no base_model in the card" in " ".join(
        built["card_stderr"].split()
    ) and "--base-model OWNER/NAME" in " ".join(built["card_stderr"].split())
    code, report = verify_json(release)
    assert code == 0 and report["complete"] and report["missing"] == [], report
    assert any("no base_model" in w["problem"] for w in report["warnings"]) and any(
        "no license" in w["problem"] for w in report["warnings"]
    )


@pytest.mark.slow
def test_the_card_states_texts_comparison_gate_and_context(built):
    release = built["release"]
    card = (release / "README.md").read_text()
    manifest = json.loads((release / "quant-manifest.json").read_text())
    # calibration: 256 tokens traced (4 chunks of 64) of the file's tokens; the held-out text: 2 chunks of 128
    calibration = next(line for line in card.splitlines() if line.startswith("| expert selection"))
    assert (
        f"| {built['calibration'].name} | `{sha256(built['calibration'])[:12]}` | 256 of " in calibration
        and "(4 chunks of 64)" in calibration
    )
    heldout = next(line for line in card.splitlines() if line.startswith("| evaluation (held out)"))
    assert (
        f"| {built['heldout'].name} | `{sha256(built['heldout'])[:12]}` | {CTX * CHUNKS} ({CHUNKS} chunks of {CTX};"
        in heldout
    )
    assert "[{" not in card and "{'" not in card  # no JSON or Python reprs
    # the pruned rungs beside the unpruned model, the chart embedded, the gate's thresholds
    assert "## Pruned vs unpruned" in card and f"| {built['unpruned'].name} | qwen3moe 8 experts |" in card
    for rung in manifest["rungs"]:
        assert f"| **{rung['files'][0]['name']}** | qwen3moe 6 of 8 experts |" in card
    assert "![File size vs mean KLD against the reference](evaluation/size-vs-kld.png)" in card
    assert "- mean KLD at most 5" in card and "- perplexity at most 1000% above the reference's" in card
    # sizes in MiB for these small files
    for rung in manifest["rungs"]:
        row = next(line for line in card.splitlines() if line.startswith(f"| {rung['files'][0]['name']} |"))
        size = row.split("|")[3].strip()
        assert size.endswith(" MiB") and abs(float(size.split()[0]) - rung["files"][0]["bytes"] / 2**20) < 0.01, size
    # llama-server's context: the model's own when below 8192
    import gguf

    reader = gguf.GGUFReader(release / manifest["rungs"][0]["files"][0]["name"])
    context = int(reader.fields["qwen3moe.context_length"].contents())
    assert f" -c {min(8192, context)} --port 8080" in card
    summary = (release / "evaluation" / "summary.md").read_text()
    assert " MiB |" in summary and " GiB |" not in summary


@pytest.mark.slow
def test_options_make_a_card_the_hub_accepts(copy):
    refused = ggufcarve("card", copy, "--force", "--base-model", "Hf")
    assert refused.code == 1 and "not a Hugging Face repo id" in refused.error_line
    refused = ggufcarve("card", copy, "--force", "--license", "Apache License 2.0")
    assert refused.code == 1 and "not a license identifier" in refused.error_line
    (copy / "LICENSE").write_text("the license text\n")
    assert ggufcarve("release", "record", copy / "LICENSE").code == 0
    result = ggufcarve(
        "card",
        copy,
        "--force",
        "--base-model",
        "Org/Tiny-MoE",
        "--license",
        "other",
        "--license-name",
        "tiny-license",
        "--license-link",
        "LICENSE",
        "--repo-id",
        "someone/tiny-6e-GGUF",
        "--model-name",
        "Tiny MoE 6e",
    )
    assert result.code == 0, result.stderr
    front, problems = hub_problems(copy)
    assert problems == [] and front["base_model"] == "Org/Tiny-MoE" and front["license_link"] == "LICENSE"
    card = (copy / "README.md").read_text()
    assert (
        re.search(r"^# Tiny MoE 6e, pruned to \d+ of \d+ experts, GGUF$", card, re.M)
        and "hf download someone/tiny-6e-GGUF" in card
        and re.search(
            r"llama-server -hf someone/tiny-6e-GGUF:(Q8_0|Q6_K|Q4_K_M|Q2_K|IQ2_XS|IQ1_S|Q3_K_M|Q5_K_M|IQ1_M) ", card
        )
    )
    code, report = verify_json(copy)
    assert code == 0 and report["warnings"] == [] and report["notes"] == [], report


@pytest.mark.slow
def test_a_hand_edit_is_recorded_by_card_record_or_release_record(copy):
    from ggufcarve.release.card import card_edited, card_recorded

    assert not card_edited(copy) and card_recorded(copy)
    with open(copy / "README.md", "a") as f:
        f.write("\nA note added by hand.\n")
    assert card_edited(copy) and not card_recorded(copy)
    code, report = verify_json(copy)
    assert code == 1 and any(
        f["path"] == "README.md" and f["problem"].startswith("sha256 mismatch") for f in report["failures"]
    )
    assert ggufcarve("card", copy, "--record").code == 0
    assert (
        verify_json(copy)[0] == 0 and card_edited(copy) and card_recorded(copy)
    )  # recorded as it is: still not the card ggufcarve wrote
    assert "A note added by hand." in (copy / "README.md").read_text()
    (copy / "README.md").write_text((copy / "README.md").read_text().replace("A note added by hand.", "Another note."))
    assert verify_json(copy)[0] == 1
    assert ggufcarve("release", "record", copy / "README.md").code == 0
    assert verify_json(copy)[0] == 0
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=copy).returncode == 0
    assert ggufcarve("card", copy, "--force").code == 0 and not card_edited(copy)


@pytest.mark.slow
def test_documentation_is_noted_until_recorded(copy):
    for name in ("LICENSE", "NOTICE", "USAGE.md", ".gitattributes"):
        (copy / name).write_text(f"{name}\n")
    code, report = verify_json(copy)
    assert code == 0, report  # noted, not refused
    assert {n["path"] for n in report["notes"]} == {"LICENSE", "NOTICE", "USAGE.md", ".gitattributes"}
    recorded = ggufcarve("release", "record", copy / "LICENSE", copy / ".gitattributes")
    assert recorded.code == 0, recorded.stderr
    code, report = verify_json(copy)
    assert code == 0 and {n["path"] for n in report["notes"]} == {"NOTICE", "USAGE.md"}
    listed = {line.split("  ", 1)[1] for line in (copy / "SHA256SUMS").read_text().splitlines()}
    assert {"LICENSE", ".gitattributes"} <= listed
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=copy).returncode == 0
    # not documentation: refused, nothing recorded
    (copy / "extra.gguf").write_bytes(b"GGUF")
    refused = ggufcarve("release", "record", copy / "extra.gguf")
    assert refused.code == 1 and "not a documentation file" in refused.error_line
    assert "extra.gguf" not in (copy / "SHA256SUMS").read_text()
    # a changed recorded file fails
    (copy / "LICENSE").write_text("changed\n")
    code, report = verify_json(copy)
    assert code == 1 and any(
        f["path"] == "LICENSE" and f["problem"].startswith("sha256 mismatch") for f in report["failures"]
    )


@pytest.mark.slow
def test_an_unfinished_release_fails_with_what_is_missing(built, tmp_path):
    spec = built["release"].parent / "spec.toml"
    source = built["release"].parent / "models" / "tiny-6e-Q8_0.gguf"
    out = tmp_path / "half"
    result = ggufcarve(
        "ladder", "run", spec, "--source", source, "-o", out, "--only", "Q6_K", "--quantizer", "libllama", "-t", 2, "-q"
    )
    assert result.code == 0, result.stderr[-3000:]
    (out / "LICENSE").write_text("text\n")  # a user's file does not make it fail
    code, report = verify_json(out)
    assert code == 1 and not report["complete"]
    failures = {(f["path"], f["problem"].split(":")[0]) for f in report["failures"]}
    # a ladder release promises its rungs: the missing rung fails; the evaluation and card are listed, not required
    assert failures == {("Q4_K_M", "missing")}, report["failures"]
    assert {m["path"] for m in report["missing"]} == {"rungs:Q4_K_M", "evaluation:evaluation/", "card:README.md"}
    plain = ggufcarve("verify", out)
    assert (
        plain.code == 1
        and "rung Q4_K_M of the ladder is not built" in " ".join(plain.stderr.split())
        and "--partial" in plain.stderr
    )
    code, report = verify_json(out, "--partial")
    assert code == 0 and len(report["missing"]) == 3
    assert {n["path"] for n in report["notes"]} == {"LICENSE", ".ggufcarve-fragments/"}
    # the rest of the ladder, then its evaluation and card: complete
    assert (
        ggufcarve("ladder", "run", spec, "--source", source, "-o", out, "--quantizer", "libllama", "-t", 2, "-q").code
        == 0
    )
    assert not (out / ".ggufcarve-fragments").exists()
    code, report = verify_json(out)
    assert code == 0 and not report["complete"]
    code, report = verify_json(out, "--strict")
    assert code == 1 and {f["path"] for f in report["failures"]} == {"evaluation/", "README.md"}


# ---------------------------------------------------------------------------------------------
# without llama.cpp


def test_metadata_is_read_from_the_ggufs_general_keys_and_never_invented():
    from ggufcarve.release.card_metadata import CardSettings, resolve_metadata

    keys = {
        "general.name": "Hf",
        "general.basename": "Qwen3",
        "general.size_label": "30B-A3B",
        "general.license": "Apache-2.0",
        "general.base_model.count": 1,
        "general.base_model.0.name": "Qwen3 30B A3B",
        "general.base_model.0.organization": "Qwen",
        "general.base_model.0.repo_url": "https://huggingface.co/Qwen/Qwen3-30B-A3B",
    }
    meta = resolve_metadata(keys, {})
    assert (meta.base_models, meta.license, meta.model_name, meta.warnings) == (
        ["Qwen/Qwen3-30B-A3B"],
        "apache-2.0",
        "Qwen3-30B-A3B",
        [],
    )
    # a humanised name is not a repo id, and general.name is never a base model
    bare = {
        "general.name": "Hf",
        "general.base_model.count": 1,
        "general.base_model.0.name": "Qwen3 30B A3B",
        "general.license": "other",
        "general.license.name": "qwen-research",
        "general.license.link": "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/LICENSE",
    }
    meta = resolve_metadata(bare, {"parameters": {"model_name": "qwen3-64e"}})
    assert meta.base_models == [] and any("base_model" in w for w in meta.warnings) and "Qwen3 30B A3B" in meta.notes[0]
    assert (meta.license, meta.license_name, meta.model_name) == ("other", "qwen-research", "qwen3-64e")
    meta = resolve_metadata({"general.license": "Apache License 2.0"}, {}, CardSettings(base_model="Org/Model"))
    assert (
        meta.base_models == ["Org/Model"]
        and meta.license is None
        and any("not a Hub license identifier" in w for w in meta.warnings)
    )


def test_card_settings_refuse_what_the_hub_refuses(tmp_path):
    from ggufcarve.errors import BadInput
    from ggufcarve.release.card_metadata import CardSettings

    for bad in (
        CardSettings(base_model="Hf"),
        CardSettings(base_model="a/b--c"),
        CardSettings(repo_id="a/b/c"),
        CardSettings(license="Apache 2"),
    ):
        with pytest.raises(BadInput):
            bad.check()
    assert CardSettings(base_model="Qwen/Qwen3-30B-A3B", license="llama3.1", repo_id="me/x.GGUF").check()
    from ggufcarve.pipeline.plan import parse_plan

    def planned(card: dict) -> CardSettings:
        plan = {"source": "m.gguf", "output": "r", "selection": {"method": "weights", "keep": 4}, "card": card}
        return parse_plan({**plan, "ladder": {"spec": "q8-to-iq1"}}, tmp_path).card_settings

    (tmp_path / "m.gguf").write_bytes(b"")
    table = {"base_model": "Qwen/Qwen3-30B-A3B", "license": "other", "license_name": "qwen", "license_link": "LICENSE"}
    assert planned(table).to_json() == table
    for bad, words in (
        ({"base_modle": "a/b"}, "unknown key 'base_modle'"),
        ({"license": 3}, "[card] license must be a non-empty string"),
        ({"license": "Apache 2"}, "not a license identifier"),
    ):
        with pytest.raises(BadInput, match=re.escape(words)):
            planned(bad)


def test_card_edited_tells_the_written_card_from_an_edit(tmp_path):
    from ggufcarve.release.card import card_edited, with_marker

    assert not card_edited(tmp_path)
    text = with_marker('---\nlicense: "mit"\n---\n\n# x GGUF\n')
    (tmp_path / "README.md").write_text(text)
    assert not card_edited(tmp_path)
    (tmp_path / "README.md").write_text(text.replace("# x", "# y"))
    assert card_edited(tmp_path)
    (tmp_path / "README.md").write_text("# written by hand\n")
    assert card_edited(tmp_path)
    assert hashlib.sha256(b'---\nlicense: "mit"\n---\n\n# x GGUF\n').hexdigest() in text


def test_sizes_take_the_unit_that_fits():
    from ggufcarve.fileio import format_size

    assert (
        format_size(15_213_856) == "14.5 MiB"
        and format_size(8_300_000) == "7.92 MiB"
        and format_size(512 * 2**20) == "512 MiB"
    )
    assert format_size(17.28 * 2**30) == "17.28 GiB" and format_size(2**30) == "1.00 GiB"
    assert format_size(3_200) == "3.12 KiB" and format_size(2**20) == "1.00 MiB"  # a card or a report is not "0.00 MiB"


def _card_inputs(gates: dict[str, tuple[str, float, int]], unpruned: dict[str, tuple[float, int]]):
    """CardInputs of a release of 6-of-8-expert rungs: rung -> (gate, mean KLD, bytes), and the
    unpruned models compared with them: quant -> (mean KLD, bytes)."""
    from ggufcarve.moe.keepset import KEY_KEPT_COUNT, KEY_SOURCE_EXPERT_COUNT
    from ggufcarve.release.card_inputs import CardInputs

    def doc(file, quant, kld, size, pruned, gate=None):
        return {
            "model": {
                "file": file,
                "quant": quant,
                "bytes": size,
                "pruned": pruned,
                "family": "6 of 8" if pruned else "8",
            },
            "kld_mean": kld,
            "ppl": 10.0,
            "ppl_delta_percent": 1.0,
            "same_top_p": 0.9,
            "gate": gate,
            "parameters": {"ctx": 128, "chunks": 2, "scored_tokens": 200},
            "reference": {"name": "ref.gguf"},
        }

    rungs = [
        {
            "name": q,
            "files": [{"name": f"tiny-6e-{q}.gguf", "bytes": size}],
            "sha256": "ab" * 32,
            "bits_per_weight": 4.5,
        }
        for q, (_, _, size) in gates.items()
    ]
    evaluation = {
        f"tiny-6e-{q}.gguf": doc(f"tiny-6e-{q}.gguf", q, kld, size, True, gate)
        for q, (gate, kld, size) in gates.items()
    }
    evaluation |= {f"tiny-{q}.gguf": doc(f"tiny-{q}.gguf", q, kld, size, False) for q, (kld, size) in unpruned.items()}
    imatrix_sha = hashlib.sha256(b"the imatrix").hexdigest()
    manifest = {
        "imatrix": {
            "name": "tiny-6e.imatrix.gguf",
            "sha256": imatrix_sha,
            "datasets": ["calibration.txt"],
            "chunk_count": 4,
            "chunk_size": 64,
        },
        "parameters": {"model_name": "tiny-6e"},
        "quantizer": {"backend": "libllama"},
    }
    keys = {
        "general.architecture": "qwen3moe",
        "general.basename": "Tiny",
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_count": 6,
        KEY_KEPT_COUNT: 6,
        KEY_SOURCE_EXPERT_COUNT: 8,
    }
    return CardInputs(manifest, rungs, keys, None, None, evaluation), imatrix_sha


def _usage(text: str) -> str:
    return text.split("## Use with llama.cpp", 1)[1].split("## Limitations", 1)[0]


def test_the_card_recommends_a_passing_file_titles_the_prune_and_keeps_publisher_advice_out():
    from ggufcarve.release.card import render_card

    inputs, imatrix_sha = _card_inputs(
        {"Q8_0": ("PASS", 0.01, 800), "Q4_K_M": ("FAIL", 0.30, 500), "Q2_K": ("PASS", 0.05, 300)}, {}
    )
    text = render_card(inputs)
    assert "\n# Tiny, pruned to 6 of 8 experts, GGUF\n" in text
    assert "-m tiny-6e-Q8_0.gguf" in _usage(text) and "Q4_K_M" not in _usage(text)  # Q4_K_M fails the gate
    assert (
        "ggufcarve card" not in text and "--force" not in text and "--base-model" not in text
    )  # the command is for the publisher, on the command line
    assert f"| tiny-6e.imatrix.gguf (from calibration.txt) | `{imatrix_sha[:12]}` |" in text
    assert "Measured here, the unpruned model" not in text  # nothing unpruned was compared


def test_the_card_says_when_no_file_passes_and_when_the_unpruned_model_is_better():
    from ggufcarve.release.card import render_card

    inputs, _ = _card_inputs(
        {"Q8_0": ("FAIL", 0.20, 800), "Q4_K_M": ("FAIL", 0.30, 500)}, {"Q2_K": (0.01, 500), "Q4_K_M": (0.001, 900)}
    )
    text = render_card(inputs)
    assert (
        "No file of this release passes the release gate; the example uses tiny-6e-Q8_0.gguf" in text
        and "-m tiny-6e-Q8_0.gguf" in _usage(text)
    )
    assert "the unpruned model quantized to Q2_K (tiny-Q2_K.gguf" in text and "than every file of this release" in text
    inputs, _ = _card_inputs({"Q8_0": ("PASS", 0.005, 800), "Q4_K_M": ("PASS", 0.30, 500)}, {"Q2_K": (0.01, 500)})
    assert "Measured here, the unpruned model" not in render_card(inputs)  # Q8_0 is larger and better than it


def test_the_card_shows_each_files_speed_and_where_it_was_measured():
    from ggufcarve.release.card import render_card

    inputs, _ = _card_inputs({"Q8_0": ("PASS", 0.01, 800), "Q4_K_M": ("PASS", 0.05, 500)}, {})
    assert "### Speed" not in render_card(inputs)  # nothing timed: no speed claimed
    speed = {"engine": "llama-bench", "pp_tokens": 512, "tg_tokens": 128, "tg_runs": [40.0, 41.0, 42.0]}
    for tg, (_, doc) in zip((41.0, 63.5), sorted(inputs.evaluation.items())):
        placement = {"backend": "cuda", "gpu_layers": 99, "rpc_servers": 0, "tensor_split": [3, 1], "threads": 16}
        doc.update(tg_tok_s=tg, pp_tok_s=900.0, speed=speed, speed_placement=placement)
    text = render_card(inputs)
    assert "| tiny-6e-Q4_K_M.gguf | 41.0 | 900.0 | -ngl 99 on cuda, split 3:1, 16 CPU threads |" in text
    assert "| tiny-6e-Q8_0.gguf | 63.5 |" in text
    assert "(llama-bench: prompt of 512 tokens, 128 tokens decoded, the median of 3 run(s))" in text


def test_the_card_gives_the_written_top_k_beside_the_trained_one_and_the_override_back():
    from ggufcarve.release.card import render_card

    inputs, _ = _card_inputs({"Q8_0": ("PASS", 0.01, 800)}, {})
    assert "- Experts used per token (top-k) stay 2." in render_card(inputs)
    inputs.manifest["expert_used_count"] = {"trained": 4, "written": 2}
    text = render_card(inputs)
    assert "- Experts used per token (top-k): 2, lowered from the trained 4 (`qwen3moe.expert_used_count`)" in text
    assert "`--override-kv qwen3moe.expert_used_count=int:4`" in text
    assert (
        "Top-k routing was lowered from 4 to 2 experts per token" in text and "Top-k routing is unchanged" not in text
    )
    inputs.keys["ggufcarve.expert_used_count_trained"] = 8  # the file's own record comes first
    assert "lowered from the trained 8" in render_card(inputs)


def test_timed_files_get_a_speed_chart_beside_the_size_chart(tmp_path):
    from ggufcarve.evaluate.summary import SPEED_CHART, draw_charts
    from ggufcarve.release.card_inputs import SPEED_CHART as CARD_SPEED_CHART

    def result(quant, size, kld, speed):
        return {"model": {"name": f"m-{quant}.gguf", "file": f"m-{quant}.gguf", "quant": quant, "family": "8",
                          "bytes": size}, "kld_mean": kld, "ppl": 10 + kld, "tg_tok_s": speed}  # fmt: skip

    results = [result("Q8_0", 800, 0.001, 40.0), result("Q4_K_M", 500, 0.02, 55.0)]
    names = draw_charts(results, tmp_path, lambda p: p)
    assert SPEED_CHART in names and (tmp_path / SPEED_CHART).stat().st_size > 0 and CARD_SPEED_CHART == SPEED_CHART
    assert SPEED_CHART not in draw_charts(results[:1], tmp_path / "one", lambda p: p.parent.mkdir(exist_ok=True) or p)
