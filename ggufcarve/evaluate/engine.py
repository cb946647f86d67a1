"""A model loaded in libllama for evaluation: tokenize, decode a chunk with chosen outputs, greedy decoding.

Used only inside the evaluation child process (`ggufcarve.evaluate.child`): llama.cpp aborts the
whole process on a failed assert. Models load on the CPU (`n_gpu_layers = 0`) with
`use_extra_bufts = False`: on CPUs with AMX, llama.cpp 0.3.36 crashes in
`ggml_backend_amx_mul_mat` on tiny models otherwise.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Iterator, Sequence

import numpy as np

# ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous message)
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5
_KEEPALIVE: list[object] = []  # ctypes callbacks handed to llama.cpp must outlive every call


class EngineError(Exception):
    """libllama refused the model or a decode failed."""


def _quiet_logs(llama_cpp) -> None:
    """Forward llama.cpp's warnings and errors to stderr; drop its info and debug lines."""
    last_forwarded = [False]

    def log_callback(level, text, _user_data):
        forward = level in (_LOG_WARN, _LOG_ERROR) or (level == _LOG_CONT and last_forwarded[0])
        if level != _LOG_CONT:
            last_forwarded[0] = forward
        if forward and text:
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    callback = llama_cpp.llama_log_callback(log_callback)
    _KEEPALIVE.append(callback)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


class Engine:
    """One model and one context of `n_ctx` positions (a single sequence)."""

    def __init__(self, path: str, n_ctx: int, threads: int, n_batch: int | None = None) -> None:
        import llama_cpp

        self._llama = llama_cpp
        _quiet_logs(llama_cpp)
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise EngineError(f"libllama could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))
        self.n_ctx = n_ctx
        self.n_batch = n_batch or n_ctx
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = n_ctx
        context_params.n_batch = self.n_batch
        context_params.n_ubatch = min(512, self.n_batch)
        context_params.n_seq_max = 1
        context_params.n_threads = threads
        context_params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, context_params)
        if not self.ctx:
            raise EngineError(f"libllama could not create a context of {n_ctx} tokens for {path}")
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        llama_cpp = self._llama
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def tokenize(self, text: bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Token ids of `text` as llama.cpp's common_tokenize makes them (BOS added when the vocab adds one)."""
        capacity = len(text) + 16
        while True:
            buffer = (self._llama.llama_token * capacity)()
            n = self._llama.llama_tokenize(self.vocab, text, len(text), buffer, capacity, add_special, parse_special)
            if n >= 0:
                return np.frombuffer(buffer, dtype=np.int32, count=n).copy()
            capacity = -n

    def piece(self, token: int) -> bytes:
        buffer = ctypes.create_string_buffer(256)
        n = self._llama.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, False)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self._llama.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, False)
        return buffer.raw[:n]

    def chat_template(self) -> str | None:
        raw = self._llama.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None

    def clear(self) -> None:
        self._llama.llama_memory_clear(self._llama.llama_get_memory(self.ctx), True)

    def decode(self, tokens: Sequence[int], start_pos: int, outputs_from: int | None) -> None:
        """Decode `tokens` at positions start_pos.. in batches of n_batch; request logits for positions >= outputs_from.

        The logits of the last batch stay readable through `logits`.
        """
        batch = self._batch
        tokens = np.asarray(tokens, dtype=np.int32)
        for offset in range(0, len(tokens), self.n_batch):
            part = tokens[offset:offset + self.n_batch]
            for k, token in enumerate(part.tolist()):
                pos = start_pos + offset + k
                batch.token[k] = token
                batch.pos[k] = pos
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = 0
                batch.logits[k] = 1 if outputs_from is not None and pos >= outputs_from else 0
            batch.n_tokens = len(part)
            code = self._llama.llama_decode(self.ctx, batch)
            if code != 0:
                raise EngineError(f"llama_decode returned {code} at position {start_pos + offset}")

    def logits(self, index: int) -> np.ndarray:
        """The logits of batch token `index` of the last decode, -1 the last output (a view into libllama's buffer)."""
        pointer = self._llama.llama_get_logits_ith(self.ctx, index)
        if not pointer:
            raise EngineError(f"no logits for output {index}")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def chunk_logits(self, tokens: np.ndarray, first: int) -> np.ndarray:
        """Clear the cache, decode one chunk and return the logits of positions first..len-1 as [n, n_vocab] float32.

        The whole chunk is one decode call when it fits n_batch; otherwise the outputs of each
        batch are copied out before the next one is decoded.
        """
        self.clear()
        n = len(tokens)
        rows: list[np.ndarray] = []
        for offset in range(0, n, self.n_batch):
            end = min(n, offset + self.n_batch)
            self.decode(tokens[offset:end], offset, first)
            n_outputs = max(0, end - max(first, offset))
            if n_outputs:
                pointer = self._llama.llama_get_logits(self.ctx)
                rows.append(np.ctypeslib.as_array(pointer, shape=(n_outputs, self.n_vocab)).copy())
        return np.concatenate(rows) if len(rows) > 1 else rows[0]

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Iterator[int]:
        """Greedy decoding (temperature 0, top-k 1: the arg-max token, first on ties) until EOS or max_tokens."""
        self.clear()
        if len(prompt) + max_tokens > self.n_ctx:
            raise EngineError(f"prompt of {len(prompt)} tokens + {max_tokens} new tokens exceeds the context of {self.n_ctx}")
        self.decode(prompt, 0, len(prompt) - 1)
        pos = len(prompt)
        for _ in range(max_tokens):
            token = int(np.argmax(self.logits(-1)))
            if self._llama.llama_vocab_is_eog(self.vocab, token):
                return
            yield token
            self.decode([token], pos, pos)
            pos += 1
