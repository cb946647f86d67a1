"""eval --cross-check when llama-perplexity exits 0 without its closing statistics (its log thread
drops the last lines at exit under load): a fake llama-perplexity in a --llama-cpp directory prints
lines of the real tool's output (llama-perplexity of llama-cpp-python 0.3.36 on the demo model,
heldout.txt, -c 128 --chunks 3) and leaves the closing block out of its first runs."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from clirun import ggufcarve

DATA = Path(__file__).resolve().parent.parent / "ggufcarve" / "demo" / "data"
MODEL = DATA / "tiny-qwen3moe-16x256-top4-4L-stdlib-Q8_0.gguf"
HELDOUT = DATA / "heldout.txt"
PPL = 58.6352  # both the per-chunk [3] and the Final estimate below; eval's own PPL of MODEL on these chunks

HEAD = """\
0.00.062.762 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 4096
0.00.074.813 I cmn          init: llama threadpool init, n_threads = 2
0.00.082.707 I
"""
PPL_BODY = (
    HEAD
    + """\
0.00.124.424 I perplexity: calculating perplexity over 3 chunks, n_ctx=128, batch_size=2048, n_seq=16
0.00.535.265 I perplexity: 0.41 seconds per pass - ETA 0.00 minutes
[1]50.9261,[2]57.9608,[3]58.6352,
"""
)
PPL_CLOSING = """\
0.00.553.423 I Final estimate: PPL = 58.6352 +/- 10.69092

"""
BASE_BODY = (
    HEAD
    + """\
0.00.124.424 I perplexity: calculating perplexity over 3 chunks, n_ctx=128, batch_size=2048, n_seq=16
0.00.535.265 I perplexity: 0.41 seconds per pass - ETA 0.00 minutes
[1]50.9261,[2]57.9608,[3]58.6352,
0.00.553.423 I Final estimate: PPL = 58.6352 +/- 10.69092
"""
)
KLD_BODY = (
    HEAD
    + """\
0.00.107.180 I kl_divergence: computing over 3 chunks, n_ctx=128, batch_size=2048, n_seq=16
0.00.596.902 I kl_divergence: 0.49 seconds per pass - ETA 0.00 minutes

chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      50.9261 ±   17.8986       0.00001 ±       -nan       0.00000 ±    0.00000     0.000 ±  0.000 %    100.000 ±  0.000 %
   2      57.9608 ±   13.5484       0.00001 ±    0.00003       0.00000 ±    0.00000     0.000 ±  0.000 %    100.000 ±  0.000 %
   3      58.6352 ±   10.6909       0.00000 ±    0.00001       0.00000 ±    0.00000     0.000 ±  0.000 %    100.000 ±  0.000 %
"""  # noqa: E501 (llama-perplexity's recorded table)
)
KLD_CLOSING = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  58.635161 ±  10.690924
Mean PPL(base)                :  58.635078 ±  10.690933
Cor(ln(PPL(Q)), ln(PPL(base))): 100.00%
Mean ln(PPL(Q)/PPL(base))     :   0.000001 ±   0.000014
Mean PPL(Q)/PPL(base)         :   1.000001 ±   0.000014
Mean PPL(Q)-PPL(base)         :   0.000083 ±   0.000817

====== KL divergence statistics ======
Mean    KLD:   0.000001 ±   0.000001
Maximum KLD:   0.000029
99.9%   KLD:   0.000028
99.0%   KLD:   0.000023
95.0%   KLD:   0.000015
90.0%   KLD:   0.000012
Median  KLD:   0.000001
10.0%   KLD:  -0.000010
 5.0%   KLD:  -0.000012
 1.0%   KLD:  -0.000022
 0.1%   KLD:  -0.000035
Minimum KLD:  -0.000035

====== Token probability statistics ======
Mean    Δp: -0.000 ± 0.000 %
Maximum Δp:  0.002%
Median  Δp:  0.000%
Minimum Δp: -0.002%
RMS Δp    :  0.000 ± 0.000 %
Same top p: 100.000 ± 0.000 %

"""

FAKE = '''#!{python}
"""llama-perplexity stand-in: the recorded output of one mode; the first DROP runs of the PPL and KLD modes lack the \
closing block."""
import json, pathlib, sys
here = pathlib.Path(__file__).resolve().parent
texts = json.loads((here / "texts.json").read_text())
argv = sys.argv[1:]
mode = "kld" if "--kl-divergence" in argv else "base" if "--kl-divergence-base" in argv else "ppl"
with open(here / "runs.txt", "a") as runs:
    runs.write(mode + "\\n")
done = (here / "runs.txt").read_text().split().count(mode)
if mode == "base":
    pathlib.Path(argv[argv.index("--kl-divergence-base") + 1]).write_bytes(b"base")
text = texts[mode + "_body"]
if mode != "base" and done > int((here / "drop").read_text()):
    text += texts[mode + "_closing"]
pathlib.Path(argv[argv.index("--log-file") + 1]).write_text(text, encoding="utf-8")
sys.stdout.write(text)
'''


def _tools(tmp_path: Path, drop: int) -> Path:
    """A --llama-cpp directory whose llama-perplexity leaves the closing block out of its first `drop` runs of each \
mode."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "llama-perplexity"
    tool.write_text(FAKE.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    (bin_dir / "texts.json").write_text(
        json.dumps(
            {
                "ppl_body": PPL_BODY,
                "ppl_closing": PPL_CLOSING,
                "base_body": BASE_BODY,
                "kld_body": KLD_BODY,
                "kld_closing": KLD_CLOSING,
            }
        )
    )
    (bin_dir / "drop").write_text(str(drop))
    return bin_dir


def _eval(tmp_path: Path, bin_dir: Path):
    return ggufcarve(
        "eval",
        MODEL,
        "--reference",
        MODEL,
        "--heldout",
        HELDOUT,
        "--ctx",
        128,
        "--chunks",
        3,
        "--speed-runs",
        0,
        "-t",
        2,
        "--cross-check",
        "--llama-cpp",
        bin_dir,
        "--cache",
        tmp_path / "cache",
        "-o",
        tmp_path / "out",
    )


def _runs(bin_dir: Path) -> list[str]:
    return (bin_dir / "runs.txt").read_text().split()


def test_a_run_without_its_closing_statistics_is_run_again_and_said_so(tmp_path):
    bin_dir = _tools(tmp_path, drop=1)
    result = _eval(tmp_path, bin_dir)
    assert result.code == 0, result.stderr[-3000:]
    assert _runs(bin_dir) == ["base", "ppl", "ppl", "kld", "kld"]
    check = json.loads((tmp_path / "out" / f"{MODEL.stem}.json").read_text())["cross_check"]
    assert check["ppl"] == PPL and check["ppl_agrees"]
    assert check["ppl_mode"] == {"ppl": PPL, "ppl_stderr": 10.69092}
    assert check["kld_mode"]["kld_mean"] == 0.000001 and check["kld_mode"]["same_top_p"] == 1.0
    notes = check["notes"]
    assert len(notes) == 2, notes
    assert "PPL of" in notes[0] and "Final estimate" in notes[0] and "ran again" in notes[0], notes
    assert "KLD of" in notes[1] and "Same top p" in notes[1] and "ran again" in notes[1], notes
    assert all(note in result.stdout + result.stderr for note in notes), result.stdout + result.stderr


def test_a_closing_block_missing_from_every_run_fails_in_one_line(tmp_path):
    from ggufcarve.evaluate.crosscheck import ATTEMPTS

    bin_dir = _tools(tmp_path, drop=99)
    result = _eval(tmp_path, bin_dir)
    assert result.code != 0
    assert _runs(bin_dir) == ["base"] + ["ppl"] * ATTEMPTS
    line = result.error_line
    assert "llama-perplexity" in line and "Final estimate" in line and f"{ATTEMPTS} runs" in line and "hint:" in line, (
        result.stderr[-3000:]
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("mode", ["ppl", "kld"])
def test_the_recorded_output_is_llama_perplexitys(mode):
    """The fake's lines parse, closing block included, to the figures eval --cross-check reports of the real tool."""
    from ggufcarve.evaluate.crosscheck import parse_kld_output, parse_ppl_output

    if mode == "ppl":
        assert parse_ppl_output((PPL_BODY + PPL_CLOSING).splitlines()) == {"ppl": PPL, "ppl_stderr": 10.69092}
        assert parse_ppl_output(PPL_BODY.splitlines()) == {}
    else:
        found = parse_kld_output((KLD_BODY + KLD_CLOSING).splitlines())
        assert (
            found["ppl"] == 58.635161
            and found["kld_mean"] == 0.000001
            and found["kld"]["p999"] == 0.000028
            and found["same_top_p"] == 1.0
        )
        assert "ppl" not in parse_kld_output(KLD_BODY.splitlines())
    assert os.path.exists(MODEL) and os.path.exists(HELDOUT)
