"""Calibration input: text and JSONL files, tokenized by the model's own vocabulary and cut into
chunks the way llama-imatrix does.

Files:
    *.jsonl / *.ndjson   one JSON object per line, each one document:
                         {"text": ...}; or {"prompt": ..., "response": ...} (prompt, a newline,
                         response); or {"messages": [{"role": ..., "content": ...}, ...]} rendered
                         with the model's chat template (llama_chat_apply_template)
    anything else        UTF-8 text, the whole file one document
A text file loses one trailing newline, as llama.cpp's `-f FILE` reads a prompt. Every document is
tokenized with special tokens added and not parsed (BOS where the vocabulary adds one, as
llama-imatrix's common_tokenize(ctx, prompt, true, false)), the documents' tokens are concatenated
in file order, cut into chunks of `ctx` tokens (a last partial chunk is dropped, as llama-imatrix
does), and the first token of each chunk is replaced by BOS when the vocabulary adds one.
`max_tokens` keeps the first whole chunks within it. One text file therefore gives exactly the
chunks llama-imatrix cuts from it.

The chunks are decoded as llama-imatrix decodes them (`tools/imatrix/imatrix.cpp`,
compute_imatrix, with its defaults -b 2048 -ub 512): `Batching.of(ctx)` runs
n_seq = max(1, 2048 // ctx) chunks side by side as sequences 0..n_seq-1 of one batch (the KV cache
holds n_seq * ctx cells, one stream per sequence, cleared before every group of chunks), a chunk
longer than 2048 tokens goes in batches of 2048 at positions j*2048 + k, every token's logits are
requested (the last block otherwise computes only the tokens whose logits are requested), and
llama.cpp cuts each batch into micro-batches of at most 512 tokens itself (with several
sequences, an equal number of tokens of every sequence). An eval callback therefore sees the very
micro-batches llama-imatrix's collector sees.

Token ids given as such (`cut`) are cut into chunks of `ctx` tokens with the last one kept whole or
partial and no BOS put in; `Batching.single(ctx, batch)` decodes them one sequence at a time, in
batches of `batch` tokens that are also the micro-batches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggufcarve.errors import BadInput
from ggufcarve.fileio import sha256_file_cached

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Document:
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text} if self.messages is None else {"messages": [list(m) for m in self.messages]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Document:
        return cls(text=doc["text"]) if "text" in doc else cls(messages=tuple((r, c) for r, c in doc["messages"]))


@dataclass(frozen=True)
class CalibrationFile:
    path: Path
    documents: tuple[Document, ...]
    sha256: str
    bytes: int

    def record(self, tokens: int) -> dict[str, Any]:
        return {
            "kind": "calibration",
            "name": self.path.name,
            "sha256": self.sha256,
            "bytes": self.bytes,
            "documents": len(self.documents),
            "tokens": tokens,
        }


def _document(record: Any, where: str) -> Document:
    if not isinstance(record, dict):
        raise BadInput(
            f"{where}: not a JSON object",
            'each line is {"text": ...}, {"prompt": ..., "response": ...} or {"messages": [...]}',
        )
    if isinstance(record.get("text"), str):
        return Document(text=record["text"])
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return Document(text=record["prompt"] + "\n" + record["response"])
    messages = record.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return Document(messages=tuple((m["role"], m["content"]) for m in messages))
    raise BadInput(
        f'{where}: no "text", "prompt" + "response" or "messages" (role/content) field', "give one of these per line"
    )


def read_calibration(paths: Sequence[Path]) -> list[CalibrationFile]:
    """The documents of every file, in order; refuses missing, unreadable or empty input."""
    if not paths:
        raise BadInput("no calibration input", "give --calibration FILE (text or JSONL), repeatable")
    files = []
    for path in paths:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise BadInput(f"{path}: no such calibration file", "check the --calibration path") from None
        except UnicodeDecodeError as err:
            raise BadInput(f"{path}: not UTF-8 text (byte {err.start})", "give a UTF-8 text or JSONL file") from None
        except IsADirectoryError:
            raise BadInput(f"{path}: is a directory", "give the calibration files themselves") from None
        if path.suffix.lower() in JSONL_SUFFIXES:
            documents = []
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise BadInput(f"{path}:{number}: not valid JSON ({err.msg})", "one JSON object per line") from None
                documents.append(_document(record, f"{path}:{number}"))
        else:
            documents = [Document(text=text[:-1] if text.endswith("\n") else text)] if text.strip() else []
        if not any((d.text or "").strip() or d.messages for d in documents):
            raise BadInput(f"{path}: empty calibration file (no text)", "give a file with calibration text")
        files.append(CalibrationFile(path, tuple(documents), sha256_file_cached(path), path.stat().st_size))
    return files


# ---------------------------------------------------------------------------------------------
# In the llama.cpp child: rendering, tokenizing, chunking


def render_chat(llama_cpp: Any, template: bytes, messages: Sequence[tuple[str, str]]) -> str:
    """`messages` through llama.cpp's llama_chat_apply_template with the model's template."""
    import ctypes

    array = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, (role, content) in enumerate(messages):
        r, c = role.encode(), content.encode()
        keep += [r, c]
        array[i].role, array[i].content = r, c
    size = 4 * sum(len(r) + len(c) for r, c in messages) + 1024
    while True:
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(template, array, len(messages), False, buffer, size)
        if n < 0:
            raise BadInput(
                "llama.cpp does not recognise the model's chat template",
                'give JSONL with "text" fields instead of "messages"',
            )
        if n <= size:
            return buffer.raw[:n].decode("utf-8", errors="replace")
        size = n + 1


def tokenize(llama_cpp: Any, vocab: Any, text: str) -> list[int]:
    """llama_tokenize with special tokens added and not parsed (llama-imatrix's settings)."""
    raw = text.encode("utf-8")
    size = len(raw) + 16
    while True:
        tokens = (llama_cpp.llama_token * size)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), tokens, size, True, False)
        if n >= 0:
            return list(tokens[:n])
        size = -n


def tokenize_files(
    llama_cpp: Any, model: Any, model_name: str, files: Sequence[Sequence[Document]]
) -> tuple[list[int], list[int]]:
    """Every document of every file tokenized and concatenated; also the token count of each
    file. "messages" go through the model's chat template."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    template = None
    tokens: list[int] = []
    file_tokens = []
    for documents in files:
        count = 0
        for doc in documents:
            if doc.messages is not None:
                template = template or llama_cpp.llama_model_chat_template(model, None)
                if not template:
                    raise BadInput(
                        f'{model_name} has no chat template (tokenizer.chat_template) to render "messages"',
                        'give JSONL with "text" or "prompt" + "response" fields',
                    )
                text = render_chat(llama_cpp, template, doc.messages)
            else:
                text = doc.text or ""
            ids = tokenize(llama_cpp, vocab, text)
            count += len(ids)
            tokens.extend(ids)
        file_tokens.append(count)
    return tokens, file_tokens


def check_chunking(ctx: int, max_tokens: int | None) -> None:
    """Refuse a --ctx llama-imatrix could not use, or a --max-tokens shorter than one chunk."""
    if ctx < 2:
        raise BadInput(f"--ctx {ctx} is too small", "give a context of at least 2 tokens (llama-imatrix uses 512)")
    if max_tokens is not None and max_tokens < ctx:
        raise BadInput(
            f"--max-tokens {max_tokens} is less than one --ctx chunk of {ctx}", "raise --max-tokens or lower --ctx"
        )


def cut(tokens: Sequence[int], ctx: int) -> list[list[int]]:
    """Token ids in chunks of `ctx`, the last one possibly shorter, unchanged otherwise."""
    return [list(tokens[start : start + ctx]) for start in range(0, len(tokens), ctx)]


def chunks(tokens: list[int], ctx: int, bos: int | None, max_tokens: int | None) -> list[list[int]]:
    """Whole chunks of `ctx` tokens, the first of each set to `bos` (None: the vocabulary adds none)."""
    limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    out = []
    for start in range(0, limit - ctx + 1, ctx):
        chunk = tokens[start : start + ctx]
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


BATCH = 2048  # llama-imatrix's default -b (common_params.n_batch)
MICRO_BATCH = 512  # its default -ub (common_params.n_ubatch)


@dataclass(frozen=True)
class Batching:
    """How chunks of at most `ctx` tokens are laid into batches and the context that decodes them:
    llama-imatrix's layout (`of`, see the module docstring) or one sequence at a time (`single`)."""

    ctx: int
    sequences: int  # chunks decoded side by side (llama-imatrix's n_seq / n_parallel)
    batch: int  # tokens per llama_decode call
    micro_batch: int
    cells: int = 0  # KV cells of the context; 0: sequences * ctx
    swa_full: bool = (
        False  # llama.cpp's common tools' setting (common_params.swa_full); True: llama_context_default_params'
    )

    @classmethod
    def of(cls, ctx: int) -> Batching:
        sequences = max(1, BATCH // ctx)
        batch = min(BATCH, sequences * ctx)
        return cls(ctx, sequences, batch, min(MICRO_BATCH, batch))

    @classmethod
    def single(cls, ctx: int, batch: int) -> Batching:
        """One chunk at a time in batches of `batch` tokens (also the micro-batch), with a context
        of `ctx` rounded up to 64 cells (at least 64) and llama_context_default_params' SWA cache."""
        return cls(ctx, 1, batch, batch, max(64, -(-ctx // 64) * 64), True)

    @property
    def kv_cells(self) -> int:
        return self.cells or self.sequences * self.ctx

    def batches(self, work: Sequence[Sequence[int]]) -> Iterator[tuple[bool, list[tuple[int, int, int]]]]:
        """(clear the KV cache first, [(token, position, sequence), ...]) per llama_decode call."""
        for first in range(0, len(work), self.sequences):
            group = work[first : first + self.sequences]
            for j, start in enumerate(range(0, max(len(chunk) for chunk in group), self.batch)):
                yield (
                    j == 0,
                    [
                        (int(chunk[start + k]), start + k, seq)
                        for seq, chunk in enumerate(group)
                        for k in range(min(len(chunk) - start, self.batch))
                    ],
                )

    def to_json(self) -> dict[str, Any]:
        return {
            "ctx": self.ctx,
            "sequences": self.sequences,
            "batch": self.batch,
            "micro_batch": self.micro_batch,
            "cells": self.cells,
            "swa_full": self.swa_full,
        }
