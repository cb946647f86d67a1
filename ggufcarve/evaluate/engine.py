"""A model loaded in libllama for evaluation: tokenize, decode chunks side by side with chosen outputs, greedy decoding.

Used only inside the evaluation child process (`ggufcarve.evaluate.child`): llama.cpp aborts the
whole process on a failed assert. Models load placed by a `Compute` (llama.devices: offloaded
layers, RPC devices, split; 0 layers, the default, is the CPU) and `use_extra_bufts = False`: on
CPUs with AMX, llama.cpp 0.3.36 crashes in `ggml_backend_amx_mul_mat` on tiny models otherwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ggufcarve.llama.devices import Compute
from ggufcarve.llama.libllama import forward_warnings, load_model
from ggufcarve.llama.tools import physical_cores

# ggml_log_level: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the previous message)


class EngineError(Exception):
    """libllama refused the model or a decode failed."""


class Engine:
    """One model loaded in libllama; contexts are made from it for scoring, timing and generation."""

    def __init__(self, path: str, compute: Compute, task: str = "") -> None:
        import llama_cpp

        self._llama = llama_cpp
        self.threads = compute.threads or physical_cores()
        forward_warnings(llama_cpp)
        self.model = load_model(llama_cpp, path, compute, task)
        if not self.model:
            raise EngineError(f"libllama could not load {path}")
        self.path = path
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self.eos = int(llama_cpp.llama_vocab_eos(self.vocab))

    def close(self) -> None:
        self._llama.llama_model_free(self.model)

    def context(
        self,
        n_ctx: int,
        n_seq: int = 1,
        n_batch: int | None = None,
        eval_callback: Callable[[int, bool, object], bool] | None = None,
    ) -> Context:
        return Context(self, n_ctx, n_seq, n_batch, eval_callback)

    def tokenize(self, text: bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Token ids of `text` as llama.cpp's common_tokenize makes them (BOS added when the vocab adds one)."""
        capacity = len(text) + 16
        while True:
            buffer = (self._llama.llama_token * capacity)()
            n = self._llama.llama_tokenize(self.vocab, text, len(text), buffer, capacity, add_special, parse_special)
            if n >= 0:
                return np.frombuffer(buffer, dtype=np.int32, count=n).copy()
            capacity = -n

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of a token; control tokens (BOS, EOS) render as their text only with `special`."""
        buffer = ctypes.create_string_buffer(256)
        n = self._llama.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, special)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self._llama.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, special)
        return buffer.raw[:n]

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._llama.llama_vocab_is_eog(self.vocab, token))

    def chat_template(self) -> str | None:
        raw = self._llama.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None


class Context:
    """`n_seq` sequences of `n_ctx` positions each (separate KV streams), decoded `n_batch` tokens at a time.

    `eval_callback`: the graph scheduler's ggml_backend_sched_eval_callback (tensor, ask, user
    data) -> bool, e.g. a `ggufcarve.llama.masking.RoutingMask`; kept alive with the context."""

    def __init__(
        self,
        engine: Engine,
        n_ctx: int,
        n_seq: int = 1,
        n_batch: int | None = None,
        eval_callback: Callable[[int, bool, object], bool] | None = None,
    ) -> None:
        llama_cpp = engine._llama
        self._llama = llama_cpp
        self.engine = engine
        self.n_ctx, self.n_seq = n_ctx, n_seq
        self.n_batch = n_batch or n_ctx * n_seq
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq
        params.n_batch = self.n_batch
        params.n_ubatch = min(512, self.n_batch)
        params.n_seq_max = n_seq
        params.n_threads = engine.threads
        params.n_threads_batch = engine.threads
        self._callback = None
        if eval_callback is not None:
            self._callback = llama_cpp.ggml_backend_sched_eval_callback(eval_callback)
            params.cb_eval = self._callback
            params.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(engine.model, params)
        if not self.ctx:
            raise EngineError(f"libllama could not create a context of {n_seq} x {n_ctx} tokens for {engine.path}")
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        self._llama.llama_batch_free(self._batch)
        self._llama.llama_free(self.ctx)

    def clear(self) -> None:
        self._llama.llama_memory_clear(self._llama.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode one batch of (token, position, sequence, wants logits) entries."""
        batch = self._batch
        for k, (token, pos, seq, wants) in enumerate(entries):
            batch.token[k] = token
            batch.pos[k] = pos
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = seq
            batch.logits[k] = 1 if wants else 0
        batch.n_tokens = len(entries)
        code = self._llama.llama_decode(self.ctx, batch)
        if code != 0:
            raise EngineError(f"llama_decode returned {code}")

    def decode(self, tokens: Sequence[int], start_pos: int, outputs_from: int | None) -> None:
        """Decode `tokens` of sequence 0 at positions start_pos..; logits for positions >= outputs_from."""
        tokens = [int(t) for t in tokens]
        for offset in range(0, len(tokens), self.n_batch):
            part = tokens[offset : offset + self.n_batch]
            self._decode(
                [
                    (t, start_pos + offset + k, 0, outputs_from is not None and start_pos + offset + k >= outputs_from)
                    for k, t in enumerate(part)
                ]
            )

    def logits(self, index: int) -> np.ndarray:
        """The logits of batch token `index` of the last decode, -1 the last output (a view into libllama's buffer)."""
        pointer = self._llama.llama_get_logits_ith(self.ctx, index)
        if not pointer:
            raise EngineError(f"no logits for output {index}")
        return np.ctypeslib.as_array(pointer, shape=(self.engine.n_vocab,))

    def chunk_logits(self, chunks: Sequence[np.ndarray], first: int) -> list[np.ndarray]:
        """Clear the cache and decode up to n_seq chunks of n_ctx tokens side by side, as llama-perplexity does.

        Returns per chunk the logits of positions first..n_ctx-1 as [n_ctx - first, n_vocab] float32.
        A chunk longer than n_batch (then n_seq is 1) is decoded batch by batch, its outputs
        copied out before the next batch.
        """
        self.clear()
        n_vocab = self.engine.n_vocab
        if len(chunks) > self.n_seq:
            raise EngineError(f"{len(chunks)} chunks for a context of {self.n_seq} sequences")
        n = len(chunks[0])
        per_batch = max(1, self.n_batch // n) if n <= self.n_batch else 1
        rows: list[list[np.ndarray]] = [[] for _ in chunks]
        step = self.n_batch if n > self.n_batch else n
        for offset in range(0, n, step):
            end = min(n, offset + step)
            for group in range(0, len(chunks), per_batch):
                members = list(range(group, min(len(chunks), group + per_batch)))
                self._decode(
                    [(int(chunks[s][pos]), pos, s, pos >= first) for s in members for pos in range(offset, end)]
                )
                n_outputs = max(0, end - max(first, offset))
                if n_outputs:
                    block = np.ctypeslib.as_array(
                        self._llama.llama_get_logits(self.ctx), shape=(len(members) * n_outputs, n_vocab)
                    )
                    for j, s in enumerate(members):
                        rows[s].append(block[j * n_outputs : (j + 1) * n_outputs].copy())
        return [np.concatenate(r) if len(r) > 1 else r[0] for r in rows]

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Iterator[int]:
        """Greedy decoding (temperature 0, top-k 1: the arg-max token, first on ties) until end of generation or
        max_tokens."""
        self.clear()
        if len(prompt) + max_tokens > self.n_ctx:
            raise EngineError(
                f"prompt of {len(prompt)} tokens + {max_tokens} new tokens exceeds the context of {self.n_ctx}"
            )
        self.decode(prompt, 0, len(prompt) - 1)
        pos = len(prompt)
        for _ in range(max_tokens):
            token = int(np.argmax(self.logits(-1)))
            if self.engine.is_end_of_generation(token):
                return
            yield token
            self.decode([token], pos, pos)
            pos += 1
