"""Run a GGUF model in llama.cpp (llama-cpp-python) in a child process.

``probe(model_path, tokens)`` starts ``sys.executable tests/llama_probe.py ...`` because llama.cpp
aborts the whole process on failed ``GGML_ASSERT``s (SIGABRT, exit code 134); the child decodes
``tokens`` as one batch on the CPU with logits requested for every token and passes the results
back through a temporary ``.npz`` file.

With ``trace_routing=True`` the child installs a ggml scheduler eval callback (``cb_eval`` in
``llama_context_params``) that observes the ``ffn_moe_topk-<il>`` graph nodes built by
``build_moe_ffn`` (``src/llama-graph.cpp``). That node is a ``[k, n_tokens]`` I32 view into the
``[n_expert, n_tokens]`` argsort result, so rows are read with the view's ``nb[1]`` stride.
``<il>`` is the GGUF block index. llama.cpp's main decode graph does not run MTP/NextN blocks
(qwen35moe's last block), so ``routed`` only holds the main MoE blocks; dense blocks
(deepseek2's leading block) have no entry either.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

TOPK_PREFIX = "ffn_moe_topk-"

# ctypes callbacks handed to llama.cpp must outlive every call into it (including at exit).
_KEEPALIVE: list[object] = []


@dataclass
class ProbeResult:
    returncode: int
    stderr: str
    logits: np.ndarray | None  # [n_tokens, n_vocab] float32
    routed: dict[int, np.ndarray] = field(default_factory=dict)  # block -> [n_tokens, k] int32

    @property
    def ok(self) -> bool:
        """The child exited cleanly and returned logits (which may still be non-finite)."""
        return self.returncode == 0 and self.logits is not None


def probe(model_path, tokens: list[int], *, trace_routing: bool = False, timeout: float = 300,
          verbose: bool = False) -> ProbeResult:
    """Decode ``tokens`` with llama.cpp in a child process; see the module docstring.

    ``stderr`` holds llama.cpp's warnings and errors (all log levels with ``verbose``) plus
    anything printed by a failed ``GGML_ASSERT``.
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("tokens must not be empty")
    with tempfile.TemporaryDirectory(prefix="llama_probe_") as tmp:
        out = pathlib.Path(tmp) / "result.npz"
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()),
               "--model", str(pathlib.Path(model_path).resolve()), "--out", str(out),
               "--tokens", ",".join(map(str, tokens))]
        if trace_routing:
            cmd.append("--trace-routing")
        if verbose:
            cmd.append("--verbose")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            return ProbeResult(returncode=-9, stderr=err + f"\n[llama_probe] timed out after {timeout}s",
                               logits=None)
        if proc.returncode != 0 or not out.exists():
            return ProbeResult(proc.returncode, proc.stderr, None)
        with np.load(out) as data:
            logits = data["logits"].copy()
            routed = {int(k[len("routed_"):]): data[k].copy() for k in data.files if k.startswith("routed_")}
        return ProbeResult(proc.returncode, proc.stderr, logits, dict(sorted(routed.items())))


# ---------------------------------------------------------------------------------------------
# child process
# ---------------------------------------------------------------------------------------------

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_TYPE_I32 = 26


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` from ggml/include/ggml.h (llama.cpp bundled with 0.3.36)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def _read_topk(t: GgmlTensor, libggml, tensor_ptr: int) -> np.ndarray:
    """Copy a [k, n_tokens] I32 (possibly strided) tensor into an int32 array [n_tokens, k]."""
    if t.type != GGML_TYPE_I32:
        raise TypeError(f"{t.name!r} has ggml type {t.type}, expected I32")
    k, n_tok = int(t.ne[0]), int(t.ne[1])
    nb0, nb1 = int(t.nb[0]), int(t.nb[1])
    span = (n_tok - 1) * nb1 + k * nb0  # == ggml_nbytes of the view
    if t.buffer and libggml.ggml_backend_buffer_is_host(ctypes.c_void_p(t.buffer)):
        raw = ctypes.string_at(t.data, span)
    else:
        buf = ctypes.create_string_buffer(span)
        libggml.ggml_backend_tensor_get(ctypes.c_void_p(tensor_ptr), buf, ctypes.c_size_t(0), ctypes.c_size_t(span))
        raw = buf.raw
    view = np.ndarray((n_tok, k), dtype=np.int32, buffer=raw, strides=(nb1, nb0))
    return np.array(view, dtype=np.int32)


def _child(model: str, tokens: list[int], out: str, trace_routing: bool, verbose: bool) -> int:
    import llama_cpp
    from llama_cpp import _ggml

    libggml = _ggml.libggml
    libggml.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    libggml.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    libggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    libggml.ggml_backend_tensor_get.restype = None

    # ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous message).
    # llama-cpp-python's own callback maps these numbers stale and prints every debug line.
    last_forwarded = [False]

    def log_cb(level, text, _user_data):
        forward = verbose or level in (3, 4) or (level == 5 and last_forwarded[0])
        if level != 5:
            last_forwarded[0] = forward
        if forward and text:
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    log_callback = llama_cpp.llama_log_callback(log_cb)
    _KEEPALIVE.append(log_callback)
    llama_cpp.llama_log_set(log_callback, ctypes.c_void_p(0))

    routed: dict[int, list[np.ndarray]] = {}
    errors: list[str] = []

    def eval_cb(tensor_ptr, ask, _user_data):
        try:
            t = GgmlTensor.from_address(tensor_ptr)
            name = t.name.decode(errors="replace")
            if not name.startswith(TOPK_PREFIX):
                return False if ask else True
            if ask:
                return True
            layer = int(name[len(TOPK_PREFIX):])
            routed.setdefault(layer, []).append(_read_topk(t, libggml, tensor_ptr))
        except BaseException as exc:  # an exception escaping ctypes would read as False
            errors.append(f"{type(exc).__name__}: {exc}")
        return True

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    # Extra CPU buffer types (AMX, repacked weights) are off: on CPUs with AMX, llama.cpp 0.3.36
    # segfaults in ggml_backend_amx_mul_mat on Q8_0 weights and aborts with
    # GGML_ASSERT(*cur_backend_id != -1) on deepseek2 F16 weights placed in the AMX buffer.
    mparams.use_extra_bufts = False
    lmodel = llama_cpp.llama_model_load_from_file(model.encode(), mparams)
    if not lmodel:
        print(f"[llama_probe] failed to load model {model}", file=sys.stderr)
        return 3

    n = len(tokens)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = max(64, -(-n // 64) * 64)
    cparams.n_batch = n
    cparams.n_ubatch = n
    cparams.n_seq_max = 1
    cparams.n_threads = 2
    cparams.n_threads_batch = 2
    cb = llama_cpp.ggml_backend_sched_eval_callback(eval_cb)
    _KEEPALIVE.append(cb)
    if trace_routing:
        cparams.cb_eval = cb
        cparams.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(lmodel, cparams)
    if not ctx:
        print("[llama_probe] failed to create context", file=sys.stderr)
        return 4

    batch = llama_cpp.llama_batch_init(n, 0, 1)
    for i, tok in enumerate(tokens):
        batch.token[i] = tok
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1
    batch.n_tokens = n
    rc = llama_cpp.llama_decode(ctx, batch)
    if rc != 0:
        print(f"[llama_probe] llama_decode returned {rc}", file=sys.stderr)
        return 5

    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(lmodel))
    logits = np.empty((n, n_vocab), dtype=np.float32)
    for i in range(n):
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        if not ptr:
            print(f"[llama_probe] no logits for token {i}", file=sys.stderr)
            return 6
        logits[i] = np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(lmodel)
    sys.stderr.flush()

    if errors:
        print("[llama_probe] routing callback failed: " + "; ".join(errors[:5]), file=sys.stderr)
        return 7
    arrays = {"logits": logits}
    for layer, chunks in routed.items():
        arrays[f"routed_{layer}"] = np.concatenate(chunks, axis=0)
        if arrays[f"routed_{layer}"].shape[0] != n:
            print(f"[llama_probe] layer {layer}: traced {arrays[f'routed_{layer}'].shape[0]} tokens, "
                  f"expected {n}", file=sys.stderr)
            return 8
    tmp = out + ".part.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--out", required=True, help=".npz file to write")
    ap.add_argument("--trace-routing", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="forward llama.cpp debug/info logs too")
    a = ap.parse_args(argv)
    tokens = [int(x) for x in a.tokens.split(",") if x]
    return _child(a.model, tokens, a.out, a.trace_routing, a.verbose)


if __name__ == "__main__":
    sys.exit(main())
