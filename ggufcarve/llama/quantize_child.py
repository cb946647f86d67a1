"""The libllama quantizer backend's child process: llama-quantize's command line on `llama_model_quantize`.

Run as `python -m ggufcarve.llama.quantize_child [flags] IN [OUT] FTYPE [nthreads]` with the subset of
llama-quantize flags ggufcarve renders (--allow-requantize, --leave-output-tensor, --pure, --dry-run,
--imatrix F, --output-tensor-type T, --token-embedding-type T, --tensor-type REGEX=T). It mirrors
tools/quantize/quantize.cpp of the vendored llama.cpp: the imatrix is normalised the same way
(GGUF: sum / round(count) per expert, 1.0 where the count is 0; legacy .dat: value / ncall), the
same quantize.imatrix.* keys are written, and llama.cpp logs to stderr unfiltered, so its output
can be parsed like the binary's. A child process because llama.cpp aborts on failed asserts.

The imatrix is read by ggufcarve.imatrix_format (`ImatrixEntry.normalized` is llama-quantize's
load_imatrix normalisation).
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from ggufcarve.errors import CarveError

KV_IMATRIX_FILE = "quantize.imatrix.file"
KV_IMATRIX_DATASET = "quantize.imatrix.dataset"
KV_IMATRIX_N_ENTRIES = "quantize.imatrix.entries_count"
KV_IMATRIX_N_CHUNKS = "quantize.imatrix.chunks_count"


# ---------------------------------------------------------------------------------------------
# child main


def _ggml_type(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    try:
        return int(GGMLQuantizationType[name.upper()])
    except KeyError:
        raise SystemExit(f"invalid ggml_type '{name}'") from None


def _ftype(llama_cpp, name: str) -> int:
    key = "LLAMA_FTYPE_ALL_F32" if name.upper() == "F32" else f"LLAMA_FTYPE_MOSTLY_{name.upper()}"
    if not hasattr(llama_cpp, key):
        raise SystemExit(f"invalid ftype '{name}'")
    return int(getattr(llama_cpp, key))


def main(argv: list[str]) -> int:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    imatrix_file = ""
    overrides: list[tuple[str, int]] = []
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        flag = argv[i]
        if flag == "--allow-requantize":
            params.allow_requantize = True
        elif flag == "--leave-output-tensor":
            params.quantize_output_tensor = False
        elif flag == "--pure":
            params.pure = True
        elif flag == "--dry-run":
            params.dry_run = True
        elif flag in ("--imatrix", "--output-tensor-type", "--token-embedding-type", "--tensor-type") and i + 1 < len(
            argv
        ):
            i += 1
            value = argv[i]
            if flag == "--imatrix":
                imatrix_file = value
            elif flag == "--output-tensor-type":
                params.output_tensor_type = _ggml_type(value)
            elif flag == "--token-embedding-type":
                params.token_embedding_type = _ggml_type(value)
            else:
                pattern, sep, type_name = value.partition("=")
                if not sep or not pattern or not type_name:
                    print(f"malformed tensor type '{value}'", file=sys.stderr)
                    return 1
                overrides.append((pattern.lower(), _ggml_type(type_name)))  # llama-quantize lower-cases the pattern
        else:
            print(f"usage: quantize_child: unsupported flag {flag}", file=sys.stderr)
            return 1
        i += 1
    rest = argv[i:]
    if params.dry_run:
        if len(rest) < 2:
            print("usage: quantize_child [flags] --dry-run IN FTYPE [nthreads]", file=sys.stderr)
            return 1
        source, ftype_name, extra = rest[0], rest[1], rest[2:]
        output = ""
    else:
        if len(rest) < 3:
            print("usage: quantize_child [flags] IN OUT FTYPE [nthreads]", file=sys.stderr)
            return 1
        source, output, ftype_name, extra = rest[0], rest[1], rest[2], rest[3:]
    params.ftype = _ftype(llama_cpp, ftype_name)
    if extra:
        params.nthread = int(extra[0])

    keep_alive: list[object] = []
    kv_overrides: list[tuple[str, int, object]] = []
    if imatrix_file:
        from ggufcarve.imatrix_format import read_imatrix

        try:
            imatrix = read_imatrix(imatrix_file)
        except CarveError as err:
            print(f"load_imatrix: {err}", file=sys.stderr)
            return 1
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix.entries) + 1))()
        for k, entry in enumerate(imatrix.entries):
            name = entry.name
            array = np.ascontiguousarray(entry.normalized(), dtype=np.float32)
            keep_alive.append(array)
            entries[k].name = name.encode()
            entries[k].data = array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[k].size = array.size
        keep_alive.append(entries)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        kv_overrides.append((KV_IMATRIX_FILE, llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, imatrix_file))
        if imatrix.datasets:
            kv_overrides.append((KV_IMATRIX_DATASET, llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR, imatrix.datasets[0]))
        kv_overrides.append((KV_IMATRIX_N_ENTRIES, llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, len(imatrix.entries)))
        if (imatrix.chunk_count or 0) > 0:
            kv_overrides.append((KV_IMATRIX_N_CHUNKS, llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, imatrix.chunk_count))
    if kv_overrides:
        kvs = (llama_cpp.llama_model_kv_override * (len(kv_overrides) + 1))()
        for k, (key, tag, value) in enumerate(kv_overrides):
            kvs[k].tag = tag
            kvs[k].key = key.encode()
            if tag == llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR:
                kvs[k].value.val_str = str(value).encode()[:127]
            else:
                kvs[k].value.val_i64 = int(value)  # type: ignore[arg-type]
        keep_alive.append(kvs)
        params.kv_overrides = ctypes.cast(kvs, ctypes.POINTER(llama_cpp.llama_model_kv_override))
    if overrides:
        tts = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for k, (pattern, type_id) in enumerate(overrides):
            tts[k].pattern = pattern.encode()
            tts[k].type = type_id
        tts[len(overrides)].pattern = None  # the terminator
        keep_alive.append(tts)
        params.tt_overrides = ctypes.cast(tts, ctypes.POINTER(llama_cpp.llama_model_tensor_override))

    llama_cpp.llama_log_set(
        llama_cpp.llama_log_callback(), ctypes.c_void_p(0)
    )  # a NULL callback: llama.cpp logs to stderr
    llama_cpp.llama_backend_init()
    print(
        f"ggufcarve libllama backend: llama-cpp-python {llama_cpp.__version__}, "
        f"{'dry run of' if params.dry_run else 'quantizing'} '{source}' as {ftype_name.upper()}",
        file=sys.stderr,
        flush=True,
    )
    rc = llama_cpp.llama_model_quantize(source.encode(), output.encode(), ctypes.byref(params))
    if rc != 0:
        print(
            f"main: failed to quantize model from '{source}' (llama_model_quantize returned {rc})",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
