"""ExpertScores: per MoE block and original expert id, statistics that add up across shards.

Each block carries the statistics of one rule (the criterion that filled it) and says how they
reduce to one score per expert:
    count        score = counts                       (routed (token, slot) pairs)
    mean         score = sums / counts                (mean over routed tokens; 0 if never routed)
    rms          score = sqrt(sums_sq / counts)       (conditional root mean square)
    mean_square  score = sums_sq / counts
    sum          score = sums                         (a sum over routed tokens: adds across shards)
    mone         score = sums_sq - ||output_sums||^2 / counts per expert, i.e. counts x E||f - mu||^2
                 with mu = output_sums / counts (the count of routed tokens times the output variance)
    value        score = sums                         (no data involved: weights, router norm, random)
    rank         score = sums                         (greedy: 1 + the elimination step that removed the
                 expert; an order over all the calibration tokens at once, which shards cannot add up to)
`counts`, `sums`, `sums_sq` and `output_sums` ([expert, n_embd]: the sum of the expert's output
vectors) add when shards of one calibration run are merged, `maxima` take the larger value; "value"
blocks do not depend on data and must agree between shards.

The JSON form holds every array as a list of numbers (float64 written with repr, so a round trip
is exact) and the model facts that keep-set checks need, so a selection can be made from the
scores file alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve import __version__
from ggufcarve.errors import BadInput
from ggufcarve.gguf.container import GGUFModel
from ggufcarve.moe.layout import MoeLayer, MoeLayout
from ggufcarve.moe.routing import UNKNOWN_ROUTING, Routing
from ggufcarve.reports import read_json

SCHEMA = "ggufcarve.expert-scores"
SCHEMA_VERSION = 1
STATISTICS = ("count", "mean", "rms", "mean_square", "sum", "mone", "value", "rank", "pairwise")
ARRAYS = ("counts", "sums", "sums_sq", "output_sums", "maxima", "pair_sums", "pair_counts")
# Parameters that may differ between shards of one calibration run.
SHARD_PARAMETERS = ("max_tokens", "chunks")


@dataclass(frozen=True)
class ModelFacts:
    """What selection needs to know about the scored model (and what tells two models apart)."""

    name: str
    bytes: int
    architecture: str
    block_count: int
    nextn_layers: int
    expert_count: int
    expert_used_count: int
    group_count: int
    group_used_count: int
    blocks: tuple[int, ...]
    routing: dict[str, Any] = field(default_factory=dict)  # the fields of moe.routing.Routing

    @classmethod
    def of(cls, model: GGUFModel, layout: MoeLayout) -> ModelFacts:
        return cls(
            name=model.path.name,
            bytes=model.total_bytes,
            architecture=layout.architecture,
            block_count=layout.block_count,
            nextn_layers=layout.nextn_layers,
            expert_count=layout.expert_count,
            expert_used_count=layout.expert_used_count,
            group_count=layout.group_count,
            group_used_count=layout.group_used_count,
            blocks=layout.blocks,
            routing=asdict(layout.routing),
        )

    def is_mtp(self, block: int) -> bool:
        return block >= self.block_count - self.nextn_layers

    def layout(self) -> MoeLayout:
        """A layout with the routing facts of the scored model (no tensors), for check_keepset."""
        return MoeLayout(
            architecture=self.architecture,
            block_count=self.block_count,
            nextn_layers=self.nextn_layers,
            expert_count=self.expert_count,
            expert_used_count=self.expert_used_count,
            group_count=self.group_count,
            group_used_count=self.group_used_count,
            shared_expert_count=0,
            leading_dense_blocks=0,
            layers=tuple(MoeLayer(b, self.is_mtp(b), ()) for b in self.blocks),
            total_bytes=0,
            expert_bytes=0,
            routing=Routing(**self.routing) if self.routing else UNKNOWN_ROUTING,
            described_by="model" if self.routing else "scores",
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: getattr(self, k) for k in self.__dataclass_fields__ if k != "blocks"},
            "blocks": list(self.blocks),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ModelFacts:
        return cls(
            **{
                **{k: doc[k] for k in cls.__dataclass_fields__ if k != "routing"},
                "blocks": tuple(doc["blocks"]),
                "routing": dict(doc.get("routing") or {}),
            }
        )


@dataclass(frozen=True, eq=False)
class BlockStats:
    """One block's statistics, one entry per original expert id."""

    rule: str  # the criterion whose statistics these are ("weights" for an MTP block scored zero-shot)
    statistic: str  # one of STATISTICS
    counts: np.ndarray | None = None  # int64: routed (token, slot) pairs
    sums: np.ndarray | None = None  # float64
    sums_sq: np.ndarray | None = None  # float64
    maxima: np.ndarray | None = None  # float64: largest value seen (REAP's max activation)
    note: str = ""
    output_sums: np.ndarray | None = None  # float64 [n_expert, n_embd]: sum of each expert's outputs (mone)
    # float64 [n_expert, n_expert] (hope): sum over tokens routing to both i and j of g_i ||f_i|| g_j ||f_j||,
    # and how many such tokens (i = j: the expert's own tokens)
    pair_sums: np.ndarray | None = None
    pair_counts: np.ndarray | None = None

    def score(self) -> np.ndarray:
        """float64 score per expert; experts never routed score 0."""
        if self.statistic == "count":
            return self._need("counts").astype(np.float64)
        if self.statistic in ("value", "sum", "rank"):
            return self._need("sums").astype(np.float64)
        if self.statistic == "pairwise":  # the diagonal: mean (g ||f||)^2 over the expert's tokens
            return np.diag(self.pair_matrix()).copy()
        counts = self._need("counts").astype(np.float64)
        safe = np.where(counts > 0, counts, 1.0)
        if self.statistic == "mean":
            return np.where(counts > 0, self._need("sums") / safe, 0.0)
        if self.statistic == "mone":
            spread = self._need("sums_sq") - np.einsum("ed,ed->e", self._need("output_sums"), self.output_sums) / safe
            return np.where(counts > 0, np.maximum(spread, 0.0), 0.0)
        mean_square = np.where(counts > 0, self._need("sums_sq") / safe, 0.0)
        return np.sqrt(mean_square) if self.statistic == "rms" else mean_square

    def pair_matrix(self) -> np.ndarray:
        """HOPE's F: the mean of g_i ||f_i|| g_j ||f_j|| over tokens routing to both i and j, 0 where none does."""
        sums, counts = self._need("pair_sums"), self._need("pair_counts")
        return np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), 0.0)

    def _need(self, name: str) -> np.ndarray:
        value = getattr(self, name)
        if value is None:
            raise BadInput(
                f"scores of rule {self.rule} ({self.statistic}) lack {name}",
                "the scores file is incomplete; score the model again",
            )
        return value

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v for k in ARRAYS if (v := getattr(self, k)) is not None}

    def merged(self, other: BlockStats, block: int) -> BlockStats:
        if (self.rule, self.statistic) != (other.rule, other.statistic) or set(self.arrays()) != set(other.arrays()):
            raise BadInput(
                f"blk.{block}: cannot merge {other.rule} ({other.statistic}) into {self.rule} ({self.statistic})",
                "merge shards of one scoring run only",
            )
        if self.statistic == "rank":
            raise BadInput(
                f"blk.{block}: {self.rule} orders do not add up across shards",
                "score the whole calibration text in one pass",
            )
        if self.statistic == "value":
            if any(not np.array_equal(a, other.arrays()[k]) for k, a in self.arrays().items()):
                raise BadInput(
                    f"blk.{block}: {self.rule} scores differ between the shards",
                    "these scores do not depend on calibration data; shards of one model must agree",
                )
            return self
        add = lambda a, b: None if a is None else a + b
        return replace(
            self,
            counts=add(self.counts, other.counts),
            sums=add(self.sums, other.sums),
            sums_sq=add(self.sums_sq, other.sums_sq),
            output_sums=add(self.output_sums, other.output_sums),
            pair_sums=add(self.pair_sums, other.pair_sums),
            pair_counts=add(self.pair_counts, other.pair_counts),
            maxima=None if self.maxima is None else np.maximum(self.maxima, other.maxima),
        )

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"rule": self.rule, "statistic": self.statistic}
        for name, values in self.arrays().items():
            doc[name] = (
                [int(v) for v in values]
                if name == "counts"
                else values.tolist()
                if values.ndim == 2
                else [float(v) for v in values]
            )
        if self.note:
            doc["note"] = self.note
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> BlockStats:
        arrays = {k: np.asarray(doc[k], dtype=np.int64 if k == "counts" else np.float64) for k in ARRAYS if k in doc}
        return cls(rule=doc["rule"], statistic=doc["statistic"], note=doc.get("note", ""), **arrays)


@dataclass(frozen=True, eq=False)
class ExpertScores:
    method: str
    model: ModelFacts
    blocks: dict[int, BlockStats]
    parameters: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[dict[str, Any], ...] = ()  # calibration files / imatrix: name, sha256, bytes, tokens
    tokens: int = 0  # calibration tokens traced (0 for methods without a forward pass)

    def scores(self) -> dict[int, np.ndarray]:
        return {b: s.score() for b, s in sorted(self.blocks.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "tool": "ggufcarve",
            "version": __version__,
            "method": self.method,
            "model": self.model.to_json(),
            "parameters": self.parameters,
            "inputs": list(self.inputs),
            "tokens": self.tokens,
            "blocks": {str(b): s.to_json() for b, s in sorted(self.blocks.items())},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, doc: Any, where: str = "scores") -> ExpertScores:
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise BadInput(
                f'{where}: not a ggufcarve scores file (no "schema": "{SCHEMA}")',
                "give a file written by `ggufcarve score`",
            )
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise BadInput(
                f"{where}: scores schema version {doc.get('schema_version')}, this ggufcarve reads {SCHEMA_VERSION}",
                "score the model again with this version",
            )
        try:
            blocks = {int(b): BlockStats.from_json(s) for b, s in doc["blocks"].items()}
            scores = cls(
                method=doc["method"],
                model=ModelFacts.from_json(doc["model"]),
                blocks=blocks,
                parameters=dict(doc.get("parameters", {})),
                inputs=tuple(doc.get("inputs", ())),
                tokens=int(doc.get("tokens", 0)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise BadInput(
                f"{where}: malformed scores file ({type(err).__name__}: {err})", "score the model again"
            ) from None
        scores.check()
        return scores

    def check(self) -> None:
        """Every MoE block present, every array one value per expert, finite."""
        n = self.model.expert_count
        if set(self.blocks) != set(self.model.blocks):
            raise BadInput(
                f"scores cover blocks {sorted(self.blocks)}, the model's MoE blocks are {list(self.model.blocks)}",
                "score every MoE block",
            )
        for b, s in self.blocks.items():
            if s.statistic not in STATISTICS:
                raise BadInput(f"blk.{b}: unknown statistic {s.statistic!r}", f"one of {', '.join(STATISTICS)}")
            for name, values in s.arrays().items():
                pairs = name in ("pair_sums", "pair_counts")
                if (
                    values.shape[:1] != (n,)
                    or values.ndim != (2 if name == "output_sums" or pairs else 1)
                    or (pairs and values.shape != (n, n))
                    or not np.isfinite(values).all()
                ):
                    shape = f"{n} x {n}" if pairs else f"{n}"
                    raise BadInput(
                        f"blk.{b}: {name} must be {shape} finite values, got shape {values.shape}",
                        "the scores file is corrupt",
                    )

    def merged(self, other: ExpertScores) -> ExpertScores:
        if self.method != other.method:
            raise BadInput(
                f"cannot merge {other.method} scores into {self.method} scores", "merge shards of one method"
            )
        if self.model != other.model:
            raise BadInput(
                f"the shards score different models ({self.model.name}, {other.model.name})",
                "merge shards of the same model file",
            )
        mine = {k: v for k, v in self.parameters.items() if k not in SHARD_PARAMETERS}
        theirs = {k: v for k, v in other.parameters.items() if k not in SHARD_PARAMETERS}
        if mine != theirs:
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise BadInput(
                f"the shards were scored with different parameters ({', '.join(differ)})",
                "score every shard with the same options",
            )
        if all(s.statistic == "value" for s in self.blocks.values()):
            raise BadInput(
                f"{self.method} scores do not depend on calibration data; there is nothing to merge",
                "merge shards of a calibration or imatrix method",
            )
        blocks = {b: s.merged(other.blocks[b], b) for b, s in self.blocks.items()}
        parameters = {
            k: v for k, v in self.parameters.items() if k not in SHARD_PARAMETERS or other.parameters.get(k) == v
        }
        return replace(
            self,
            blocks=blocks,
            parameters=parameters,
            inputs=self.inputs + other.inputs,
            tokens=self.tokens + other.tokens,
        )


def read_scores(path: str | Path) -> ExpertScores:
    path = Path(path)
    return ExpertScores.from_json(read_json(path, "scores file", "give a file written by `ggufcarve score`"), str(path))


def merge_scores(parts: Iterable[ExpertScores]) -> ExpertScores:
    parts = list(parts)
    if len(parts) < 2:
        raise BadInput("--merge needs at least two scores files", "give the shards of one scoring run")
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merged(part)
    return merged
