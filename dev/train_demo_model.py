"""Train the demo model shipped in ggufcarve/demo/data/: a tiny Qwen3-MoE trained on CPython's
standard library, converted to a Q8_0 GGUF by llama.cpp's own converter.

Not part of the package and never run by CI; the produced files are committed once. Needs the
`train` extra (torch, transformers, tokenizers, safetensors), e.g. in a separate venv:

    python -m venv --system-site-packages /work/trainenv
    /work/trainenv/bin/pip install -e '.[train]'
    PYTHONPATH=$PWD /work/trainenv/bin/python dev/train_demo_model.py all --work-dir /tmp/demo-train

Stages (each can be run alone; `all` runs them in order):
    texts      training files list, ggufcarve/demo/data/{heldout,calibration}.txt, LICENSE-PSF.txt
    tokenizer  byte-level BPE trained with `tokenizers`, Qwen2's pre-tokenizer regex exactly
    train      Qwen3MoeForCausalLM from scratch, fixed steps, a wall-time cap
    convert    convert_hf_to_gguf.py from the llama-cpp-python sdist, --outtype q8_0
    notes      MODEL.md (config, data, loss, wall time, converter command, sha256)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "ggufcarve" / "demo" / "data"
LLAMA_CPP_PYTHON = "0.3.36"

# Qwen2's pre-tokenizer split regex, as in Qwen2's tokenizer.json and in llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_QWEN2 (src/llama-vocab.cpp, "original regex from tokenizer.json").
QWEN2_PRE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Modules kept out of training: one set is the held-out evaluation text, the other the
# calibration text for expert selection.
HELDOUT_MODULES = ("textwrap.py", "fractions.py")
CALIBRATION_MODULES = ("heapq.py", "shlex.py", "queue.py", "graphlib.py")
# Not representative Python text (test suites, generated codec tables, build config).
EXCLUDED_DIRS = (
    "test",
    "tests",
    "idle_test",
    "encodings",
    "site-packages",
    "config-3.11-x86_64-linux-gnu",
    "__pycache__",
    "lib2to3/tests",
)

CONFIG = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    intermediate_size=768,  # dense FFN width; unused, every layer is sparse (decoder_sparse_step=1)
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    router_aux_loss_coef=0.005,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
)
VOCAB_SIZE = 3072
SEQ_LEN = 256


def stdlib_dir() -> Path:
    return Path(sysconfig.get_path("stdlib"))


def training_files(root: Path) -> list[Path]:
    held = set(HELDOUT_MODULES) | set(CALIBRATION_MODULES)
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in held or any(rel.startswith(d + "/") or f"/{d}/" in f"/{rel}" for d in EXCLUDED_DIRS):
            continue
        files.append(path)
    return files


def read_module(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def stage_texts(work: Path) -> None:
    root = stdlib_dir()
    files = training_files(root)
    (work / "train-files.txt").write_text("".join(p.relative_to(root).as_posix() + "\n" for p in files))
    DATA.mkdir(parents=True, exist_ok=True)
    for name, modules in (("heldout.txt", HELDOUT_MODULES), ("calibration.txt", CALIBRATION_MODULES)):
        text = "".join(read_module(root / m) for m in modules)
        (DATA / name).write_text(text, encoding="utf-8")
    shutil.copyfile(root / "LICENSE.txt", DATA / "LICENSE-PSF.txt")
    total = sum(p.stat().st_size for p in files)
    print(f"texts: {len(files)} training modules, {total} bytes, from Python {sys.version.split()[0]} at {root}")


def stage_tokenizer(work: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    root = stdlib_dir()
    files = [root / line for line in (work / "train-files.txt").read_text().split()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((read_module(p) for p in files), trainer=trainer)
    out = work / "hf"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "additional_special_tokens")}, indent=2
        )
        + "\n"
    )
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens")


def _encode_corpus(work: Path):
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(work / "hf" / "tokenizer.json"))
    eot = tokenizer.token_to_id(ENDOFTEXT)
    root = stdlib_dir()
    files = [root / line for line in (work / "train-files.txt").read_text().split()]
    ids: list[int] = []
    for enc in tokenizer.encode_batch([read_module(p) for p in files]):
        ids.append(eot)
        ids.extend(enc.ids)
    held = tokenizer.encode((DATA / "heldout.txt").read_text(encoding="utf-8")).ids
    return np.asarray(ids, dtype=np.int64), np.asarray(held, dtype=np.int64), eot


def stage_train(work: Path, steps: int, batch: int, lr: float, max_minutes: float, seed: int, threads: int) -> None:
    # Idle OpenMP workers sleep instead of spinning: on a CPU shared with other work, spinning
    # workers of a 2-thread step measured 2x slower than sleeping ones.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import numpy as np
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train_ids, held_ids, eot = _encode_corpus(work)
    config = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, **CONFIG)
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = Qwen3MoeForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 25)

    def window(ids: np.ndarray, start: int) -> np.ndarray:
        # llama.cpp's perplexity and calibration chunks begin with BOS in place of the first token.
        w = ids[start : start + SEQ_LEN].copy()
        w[0] = eot
        return w

    held_starts = list(range(0, len(held_ids) - SEQ_LEN, SEQ_LEN))[:16]
    held_batch = torch.from_numpy(np.stack([window(held_ids, s) for s in held_starts]))

    def held_loss() -> float:
        # mean token cross-entropy over the second half of each chunk, as llama-perplexity scores
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=held_batch).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), held_batch[:, 1:].reshape(-1), reduction="none"
            ).view(len(held_starts), -1)
        model.train()
        return float(nll[:, SEQ_LEN // 2 - 1 :].mean())

    log_path = work / "train-log.jsonl"
    log = log_path.open("w")
    started = time.monotonic()
    ema = None
    budget = max_minutes * 60
    progress = 0.0
    step = 0
    while progress < 1.0:
        step += 1
        # The schedule runs on the larger of step and wall-time progress, so a slower (shared)
        # CPU still anneals fully within the time cap.
        progress = min(1.0, max(step / steps, (time.monotonic() - started) / budget))
        scale = step / warmup if step <= warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        starts = rng.integers(0, len(train_ids) - SEQ_LEN, size=batch)
        x = torch.from_numpy(np.stack([window(train_ids, int(s)) for s in starts]))
        out = model(input_ids=x, labels=x, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lm = float(out.loss.detach() - config.router_aux_loss_coef * out.aux_loss.detach())
        ema = lm if ema is None else 0.98 * ema + 0.02 * lm
        elapsed = time.monotonic() - started
        record = {
            "step": step,
            "elapsed_s": round(elapsed, 1),
            "lr": lr * scale,
            "loss": round(lm, 4),
            "loss_ema": round(ema, 4),
            "aux_loss": round(float(out.aux_loss.detach()), 4),
        }
        if step % 50 == 0 or progress >= 1.0:
            record["heldout_loss"] = round(held_loss(), 4)
            print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
        log.flush()
    wall = time.monotonic() - started
    model.save_pretrained(work / "hf", safe_serialization=True)
    summary = {
        "steps": step,
        "planned_steps": steps,
        "batch": batch,
        "seq_len": SEQ_LEN,
        "lr": lr,
        "seed": seed,
        "tokens_seen": step * batch * SEQ_LEN,
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(held_ids)),
        "parameters": n_params,
        "wall_s": round(wall, 1),
        "final_train_loss_ema": round(ema, 4),
        "final_heldout_loss": round(held_loss(), 4),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
    }
    (work / "train-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)


def llama_cpp_source(work: Path, given: Path | None) -> Path:
    """The llama.cpp folder with convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    if given is not None:
        return given
    dest = work / "llama.cpp"
    if (dest / "convert_hf_to_gguf.py").exists():
        return dest
    from ggufcarve.llama.build import fetch_sdist

    sdist = fetch_sdist(LLAMA_CPP_PYTHON)
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 3)
            if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3].startswith(wanted):
                m.name = parts[3]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    return dest


def stage_convert(work: Path, llama_cpp: Path | None, outfile: Path) -> list[str]:
    source = llama_cpp_source(work, llama_cpp)
    argv = [str(work / "hf"), "--outtype", "q8_0", "--outfile", str(outfile)]
    # recorded without local paths: the HF folder and the output as the repository names them
    recorded = [
        "convert_hf_to_gguf.py",
        "HF_MODEL_DIR",
        "--outtype",
        "q8_0",
        "--outfile",
        outfile.relative_to(REPO).as_posix(),
    ]
    code = (
        "import sys, runpy\n"
        f"sys.path[:0] = [{str(source)!r}, {str(source / 'gguf-py')!r}]\n"
        "import conversion.base\n"
        # The converter names a BPE pre-tokenizer by hashing how it encodes a fixed string and
        # refuses hashes it does not list. This vocabulary is new, so its hash is unlisted, but it
        # was trained with Qwen2's pre-tokenizer regex exactly: the truthful label is "qwen2".
        "conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        f"sys.argv = ['convert_hf_to_gguf.py'] + {argv!r}\n"
        f"runpy.run_path({str(source / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)
    print(f"convert: {outfile} ({outfile.stat().st_size} bytes)")
    return recorded


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_filename() -> str:
    c = CONFIG
    return (
        f"tiny-qwen3moe-{c['num_experts']}x{c['moe_intermediate_size']}-top{c['num_experts_per_tok']}"
        f"-{c['num_hidden_layers']}L-stdlib-Q8_0.gguf"
    )


def _llama_perplexity(model: Path, text: Path, n_ctx: int) -> tuple[float, float, str]:
    """llama-perplexity's final estimate (PPL, error) and the tool's version line."""
    import re

    from ggufcarve.llama.launch import run_checked
    from ggufcarve.llama.tools import probe_tool, require_tool

    tool = require_tool("llama-perplexity")
    lines: list[str] = []
    run_checked(
        [tool, "-m", model, "-f", text, "-c", str(n_ctx), "-t", "2"],
        "llama-perplexity",
        "check the model file",
        on_line=lines.append,
    )
    output = "\n".join(lines)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    if found is None:
        raise RuntimeError("llama-perplexity printed no final estimate")
    info = probe_tool(tool)
    return float(found.group(1)), float(found.group(2)), f"{info.version}, commit {info.commit}"


def _loss_curve(work: Path) -> list[dict]:
    records = [json.loads(line) for line in (work / "train-log.jsonl").read_text().splitlines()]
    return [r for r in records if "heldout_loss" in r]


def stage_notes(work: Path) -> None:
    import gguf

    model = DATA / model_filename()
    summary = json.loads((work / "train-summary.json").read_text())
    command = json.loads((work / "convert-command.json").read_text())
    reader = gguf.GGUFReader(model)
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    ppl, ppl_err, build = _llama_perplexity(model, DATA / "heldout.txt", SEQ_LEN)
    ppl_cal, ppl_cal_err, _ = _llama_perplexity(model, DATA / "calibration.txt", SEQ_LEN)
    c = CONFIG
    curve = "\n".join(
        f"| {r['step']} | {r['elapsed_s']:.0f} | {r['loss_ema']:.3f} | {r['heldout_loss']:.3f} |"
        for r in _loss_curve(work)
        if r["step"] % 100 == 0 or r["step"] == summary["steps"]
    )
    files = (work / "train-files.txt").read_text().split()
    text = f"""# {model.name}

A tiny Mixture-of-Experts model that was really trained, so that its routing means something and
expert-selection criteria disagree. Made by `dev/train_demo_model.py`; for demonstrations and
tests only, not a useful language model.

## Architecture (HF `Qwen3MoeForCausalLM`, GGUF arch `qwen3moe`)
| | |
|---|---|
| layers | {c["num_hidden_layers"]}, every one a sparse MoE block (no dense, no shared expert) |
| hidden size | {c["hidden_size"]} |
| attention | GQA, {c["num_attention_heads"]} query heads, {c["num_key_value_heads"]} KV heads, head dim \
{c["head_dim"]}, QK RMSNorm, RoPE base {c["rope_theta"]:g} |
| routed experts | {c["num_experts"]} per layer, top-{c["num_experts_per_tok"]}, softmax, top-k weights renormalised \
(`norm_topk_prob`) |
| expert FFN width | {c["moe_intermediate_size"]} (SwiGLU) |
| vocabulary | {VOCAB_SIZE}, embeddings tied to the output |
| context length | {c["max_position_embeddings"]} (trained on {SEQ_LEN}-token windows) |
| parameters | {n_params:,} |
| file | Q8_0 (norms and routers F32), {model.stat().st_size:,} bytes |
| sha256 | `{sha256(model)}` |

## Tokenizer
Byte-level BPE with {VOCAB_SIZE} tokens (256 byte tokens, {VOCAB_SIZE - 256 - 3} merges, 3 special tokens), trained
with `tokenizers` on the training text below. Its pre-tokenizer is Qwen2's split regex exactly
followed by the byte-level mapping, so `tokenizer.ggml.pre = "qwen2"` is the truthful label:
llama.cpp tokenizes like the HF tokenizer (checked on the held-out and calibration texts).
Special tokens: `<|endoftext|>` (id 0: BOS, EOS and padding; `add_bos_token` true),
`<|im_start|>`, `<|im_end|>`; a ChatML chat template (Qwen style). The model never saw chat
turns: the template is there so that chat-template rendering works.

## Training data
The Python {sys.version.split()[0]} standard library sources (`.py` files; license: `LICENSE-PSF.txt`),
{len(files)} modules, {summary["train_tokens"]:,} tokens: code, docstrings and comments. Left out: the test
suites (`test/`, `tests/`, `idle_test/`), the generated codec tables (`encodings/`),
`site-packages/`, and the modules of the two texts shipped here:
* `heldout.txt` (held-out evaluation): {", ".join(HELDOUT_MODULES)} concatenated
* `calibration.txt` (calibration for expert selection): {", ".join(CALIBRATION_MODULES)} concatenated

Every training window is {SEQ_LEN} tokens from a random offset of the concatenated modules (each
module preceded by `<|endoftext|>`), its first token replaced by BOS as llama.cpp's perplexity
and calibration chunks are.

## Training
From scratch, {summary["steps"]} steps of {summary["batch"]} x {SEQ_LEN} tokens ({summary["tokens_seen"]:,} tokens, \
about
{summary["tokens_seen"] / summary["train_tokens"]:.1f} epochs), AdamW (betas 0.9/0.95, weight decay 0.1), peak \
learning rate {summary["lr"]:g}, linear warm-up
then cosine decay to a tenth, gradient clipping 1.0, router load-balancing loss coefficient
{c["router_aux_loss_coef"]} (small, so that routing stays specialised), float32, seed {summary["seed"]}, torch
{summary["torch"]} on {summary["threads"]} CPU threads. Wall time {summary["wall_s"] / 60:.1f} min.

| step | seconds | train loss (EMA) | held-out loss (16 chunks, scored halves) |
|---|---|---|---|
{curve}

Final: train loss {summary["final_train_loss_ema"]:.3f} (EMA), held-out loss {summary["final_heldout_loss"]:.3f} (PPL \
{math.exp(summary["final_heldout_loss"]):.2f}).

The step count was set by the wall-time cap (`--max-minutes`): the model is small and briefly
trained, not a useful language model, but its routing is learned, so selection criteria disagree
on it, which is what the demo needs.

## Conversion
llama.cpp's own converter from the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (`vendor/llama.cpp`):

    python {" ".join(command)}

(HF_MODEL_DIR: the trained model and tokenizer), run in-process with one change: `TextModel.get_vocab_base_pre` \
answers `"qwen2"`. The converter
names a BPE pre-tokenizer by hashing how it encodes a fixed string and refuses hashes it does not
list; this new vocabulary's hash is unlisted, but its pre-tokenizer is Qwen2's.

## Measured with llama.cpp
`llama-perplexity -m {model.name} -f heldout.txt -c {SEQ_LEN}` (llama.cpp {build}):
PPL = {ppl:.4f} +/- {ppl_err:.4f}; on `calibration.txt`: {ppl_cal:.4f} +/- {ppl_cal_err:.4f}.
"""
    (DATA / "MODEL.md").write_text(text)
    print(f"notes: {DATA / 'MODEL.md'}; held-out PPL {ppl:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["texts", "tokenizer", "train", "convert", "notes", "all"])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-minutes", type=float, default=22.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        help="llama.cpp source folder with convert_hf_to_gguf.py (default: extracted from the llama-cpp-python sdist)",
    )
    args = parser.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    if args.stage in ("texts", "all"):
        stage_texts(work)
    if args.stage in ("tokenizer", "all"):
        stage_tokenizer(work)
    if args.stage in ("train", "all"):
        stage_train(work, args.steps, args.batch, args.lr, args.max_minutes, args.seed, args.threads)
    if args.stage in ("convert", "all"):
        command = stage_convert(work, args.llama_cpp, DATA / model_filename())
        (work / "convert-command.json").write_text(json.dumps(command) + "\n")
    if args.stage in ("notes", "all"):
        stage_notes(work)


if __name__ == "__main__":
    main()
