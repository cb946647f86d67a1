"""Candidates scored against the unpruned model by successive halving, decided by paired statistics.

    segments = prepare_segments(Path("model.gguf"), [Path("wiki.txt"), Path("code.txt")], chunk_ctx=512, chunks=None,
        compute=Compute(threads=2), work=work)
    result = measure([Candidate("reap-8", Path("model.gguf"), keep=reap_keep, group="8"), ...], segments,
        MeasureSettings(Compute(threads=2)), work)
    result.groups["8"]["winner"]

A candidate is a model file, an optional keep-set (the experts it drops masked out of routing) and
optional header values replaced at load (`overrides`: the experts used per token, so that the
mask's top-k picks N of the kept experts, as a file routed to N would); candidates on one file
with the same overrides are scored in one loaded model: one child per (file, overrides), kept
loaded from round to round (`measure.child` in a `child.Session`) while the files held stay within
`MeasureSettings.keep_loaded` bytes (the least recently scored file's child ends first).
Candidates compete within their group (tune: one group per K; best: one group).

Units: each held-out file's chunks in groups of n_seq = 2048 // chunk_ctx (the groups `eval`
decodes side by side), in a spread order per file (bit-reversed group index: the first units lie
across the whole file), the files taken in turn. Every round scores a prefix of that order, so two
candidates always share the units the shorter of them was scored on.

Rounds of a group of C candidates over U units: the first scores max(S, ceil(U / 2^(ceil(log2 C) - 1)))
units (S the number of held-out files), each next one twice as many, the last every unit. After
each round but the last: a candidate that does not fit the budget leaves; every other candidate
is compared with the round's leader (the lowest metric on the round's units among those that fit)
by the paired difference of the metric's own statistic (`measure.statistics`: the mean, or the
percentile of kld_p999; standard errors over chunks) and leaves only when worse by more than z
standard errors. The gate judges a candidate on all the units, once: the candidates left after the
last round pass it or are no finalists. A group with one candidate left goes to the last round at
once. In the last round the candidates left are scored on every unit; the leader is the lowest
metric among the finalists, `ties` the finalists within z standard errors of it, and the winner the
one of those that `prefer` names (the smaller file by default).

With `keep_faster` (a speed target), a candidate worse than the leader beyond noise stays while it
reads fewer bytes per token than every candidate that beats it beyond noise: halving then keeps the
frontier of quality against bytes read, for the speed measured after the tournament to choose on.
`expand(survivors)` (best's used-expert counts) adds candidates to a group once, after its first
round (before it, when a single round scores every unit): they are scored from the first unit up
and compete in the rounds left.

Tables are cached by content when `MeasureSettings.tables` names a directory: a candidate's table
on a unit is keyed by the sha256 of its model file, its keep-set, the reference's identity, the unit
and the scoring settings, so a re-run scores only what it has not scored before.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ggufcarve.errors import BadInput
from ggufcarve.evaluate.kld import TOKEN_COLUMNS
from ggufcarve.evaluate.tables import chunks_per_unit
from ggufcarve.events import Sink, ignore
from ggufcarve.llama.devices import Compute
from ggufcarve.measure.statistics import (
    DEFAULT_Z,
    METRICS,
    Choice,
    PairedDifference,
    check_z,
    choose_answer,
    metric_column,
    paired_difference,
)


@dataclass(frozen=True)
class Candidate:
    id: str
    model: Path
    keep: Mapping[int, Sequence[int]] | None = None  # block -> kept expert ids; None: every expert routed
    group: str = ""
    fits: bool = True
    file_bytes: int = 0
    read_bytes: int = 0  # bytes one token reads (prefer = "faster")
    required_nodes: tuple[str, ...] = ()  # "<node>:<block>" the mask must have written (llama.masking.required_nodes)
    overrides: tuple[tuple[str, int], ...] = ()  # header values replaced at load (llama.devices.Compute.kv_overrides)


@dataclass(frozen=True)
class Segment:
    """One held-out file: its reference log-probs and the chunks scored."""

    name: str
    reference: Path  # llama-perplexity base file or top-k cache
    n_chunk: int
    n_ctx: int
    identity: str  # what the reference's records depend on (the unpruned model's sha256 and the text's)


@dataclass(frozen=True)
class MeasureSettings:
    compute: Compute  # where the scoring children run, threads resolved
    z: float = DEFAULT_Z
    metric: str = "kld_mean"
    prefer: str = "smaller"
    gate: Callable[[dict[str, Any]], tuple[bool, list[str]]] | None = None  # statistics -> (passed, failed checks)
    tables: Path | None = None  # the content-keyed cache of per-unit tables
    keep_loaded: int | None = None  # model bytes kept loaded between rounds; None: `loaded_budget(compute)`
    first_units: int | None = None  # units of the first round; None: the module docstring's rule
    never_leave: tuple[str, ...] = ()  # candidates halving never stops (the search's current keep-set)
    # halving stops a candidate only when one that reads no more bytes per token beats it beyond noise (a speed
    # target: a faster, worse candidate stays for the speed check)
    keep_faster: bool = False


def loaded_budget(compute: Compute, devices: list[Any] | None = None) -> int:
    """Model bytes the scoring children may hold at once: half the host's available memory when they
    run on the CPU; with layers on devices, the free memory of the devices they offload to
    (`devices`: llama.devices.Device rows, default: llama.cpp's listing) less llama.cpp's --fit
    margin on each. 0 (one child at a time) where an RPC server is among them: ggml-rpc-server serves
    one client at a time (ggml/src/ggml-rpc/ggml-rpc.cpp, ggml_backend_rpc_start_server: the next
    connection is accepted when the current one closes), so a second child held open would wait on
    the first. A child that runs a device out of memory at load ends the others and loads again
    alone (`_Scorer._scored`)."""
    from ggufcarve.llama.devices import FIT_MARGIN, host_memory, offload_order

    if not compute.offloads:
        return host_memory().free // 2
    if compute.rpc:
        return 0
    if devices is None:
        from ggufcarve.llama.device_list import libllama_devices

        devices = libllama_devices()
    offload = offload_order(devices)
    return max(sum(d.free for d in offload) - FIT_MARGIN * len(offload), 0)


@dataclass
class Measurement:
    units: list[tuple[int, int, int]]  # (segment, first chunk, chunk count) in scoring order
    segments: list[Segment]
    records: dict[str, dict[str, Any]]
    groups: dict[str, dict[str, Any]]
    tables: dict[str, list[np.ndarray]]  # candidate -> its table per unit scored, in unit order
    seconds: float = 0.0
    decoded_chunks: int = 0  # chunks decoded by this run (cached ones not counted)
    cached_chunks: int = 0
    loads: dict[str, int] = field(default_factory=dict)  # model file name -> times a child loaded it

    def table(self, cid: str, n_units: int | None = None) -> np.ndarray:
        return joined(self.tables[cid], n_units)

    def statistics_on(self, cid: str, n_units: int) -> dict[str, Any]:
        """The candidate's statistics on the first `n_units` units (every candidate that was scored on that many
        shares them)."""
        return _statistics(self.table(cid, n_units), [], [], self.per_chunk)

    @property
    def per_chunk(self) -> int:
        """Tokens scored per chunk (every held-out file is scored at one chunk size)."""
        return _scored_per_chunk(self.segments[0].n_ctx) if self.segments else 1

    def chunks_in(self, n_units: int) -> int:
        return sum(count for _, _, count in self.units[:n_units])


def joined(parts: Sequence[np.ndarray], n_units: int | None = None) -> np.ndarray:
    """A candidate's per-token table over its first `n_units` units (all when None)."""
    parts = parts if n_units is None else parts[:n_units]
    return np.concatenate(parts) if len(parts) else np.zeros((0, TOKEN_COLUMNS))


def spread_order(n: int) -> list[int]:
    """0..n-1 ordered by their bit-reversed value: each prefix spread over the whole range (0, n/2, n/4, 3n/4, ...)."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


def spread_units(segments: Sequence[Segment], n_seq: int) -> list[tuple[int, int, int]]:
    """The units of every held-out file (module docstring), the files taken in turn."""
    per_file = []
    for number, segment in enumerate(segments):
        groups = [
            (number, g * n_seq, min(n_seq, segment.n_chunk - g * n_seq))
            for g in range(math.ceil(segment.n_chunk / n_seq))
        ]
        per_file.append([groups[i] for i in spread_order(len(groups))])
    out = []
    for position in range(max((len(p) for p in per_file), default=0)):
        out += [p[position] for p in per_file if position < len(p)]
    return out


def schedule(n_candidates: int, n_units: int, n_files: int = 1, first_units: int | None = None) -> list[int]:
    """The units scored by each round's end, for a group of `n_candidates` (module docstring); `first_units`:
    the first round's instead (the search's steps start on one unit)."""
    if n_units <= 0:
        return []
    if n_candidates <= 1:
        return [n_units]
    first = min(n_units, max(n_files, math.ceil(n_units / 2 ** max(0, math.ceil(math.log2(n_candidates)) - 1))))
    if first_units is not None:
        first = min(n_units, max(1, first_units))
    rounds = []
    n = first
    while n < n_units:
        rounds.append(n)
        n = min(n_units, 2 * n)
    rounds.append(n_units)
    return rounds


def _statistics(
    table: np.ndarray, names: list[str], per_segment: list[np.ndarray], per_chunk: int | None = None
) -> dict[str, Any]:
    """A candidate's statistics on its table; the standard errors over chunks of `per_chunk` tokens
    (`measure.statistics`; llama-perplexity's per-token kld_mean_stderr kept as kld_mean_stderr_tokens)."""
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.kld import kld_statistics, segment_statistics
    from ggufcarve.measure.statistics import chunk_stderr

    if len(table) < 2:
        return {
            "kld_mean": None,
            "kld_mean_stderr": None,
            "kld_p999": None,
            "same_top_p": None,
            "ppl": None,
            "ppl_reference": None,
            "tokens": len(table),
        }
    stats = kld_statistics(table)
    per_chunk = per_chunk or 1
    whole = len(table) - len(table) % per_chunk

    def over_chunks(column: int, per_token: float) -> float:
        # one chunk has no spread of chunk means: the per-token figure stands in (the decisions treat it as no
        # information: `paired_difference` over one chunk has an infinite standard error)
        found = chunk_stderr(table[:whole, column], per_chunk) if whole else math.inf
        return found if math.isfinite(found) else per_token

    out = {
        "kld_mean": stats.kld_mean,
        "kld_mean_stderr": over_chunks(kld.KLD, stats.kld_mean_stderr),
        "kld_mean_stderr_tokens": stats.kld_mean_stderr,
        "kld_p999": stats.kld["p999"],
        "kld_p99": stats.kld["p99"],
        "same_top_p": stats.same_top_p,
        "ppl": stats.ppl,
        "ppl_stderr": stats.ppl * over_chunks(kld.NLL, stats.ppl_stderr / stats.ppl),  # delta method
        "ppl_reference": stats.ppl_base,
        "rms_dp": stats.rms_dp,
        "tokens": stats.count,
    }
    if names:
        out["segments"] = [segment_statistics(name, t) for name, t in zip(names, per_segment)]
    return out


def metric_value(record: Mapping[str, Any], metric: str) -> float:
    value = record.get(metric)
    return math.inf if value is None else float(value)


class _Scorer:
    """Scores (candidate, unit) pairs: from the table cache, else by one child per model file."""

    def __init__(
        self,
        candidates: Mapping[str, Candidate],
        segments: Sequence[Segment],
        units: Sequence[tuple[int, int, int]],
        settings: MeasureSettings,
        work: Path,
        on_event: Sink,
        score_unit: Callable[[Candidate, tuple[int, int, int]], np.ndarray] | None = None,
    ) -> None:
        self.score_unit = score_unit
        self.candidates, self.segments, self.units, self.settings, self.work, self.on_event = (
            candidates,
            segments,
            units,
            settings,
            work,
            on_event,
        )
        self.tables: dict[str, list[np.ndarray]] = {cid: [] for cid in candidates}
        self.model_keys: dict[Path, str] = {}
        self.decoded = self.cached = 0
        # (model, overrides) -> the child.Session holding it, least recently used first
        self.sessions: dict[tuple[Path, tuple[tuple[str, int], ...]], Any] = {}
        self.loads: dict[str, int] = {}
        self.budget = settings.keep_loaded if settings.keep_loaded is not None else loaded_budget(settings.compute)

    def compute_of(self, c: Candidate) -> Compute:
        """Where and with what `c` is scored: the settings' placement, its header values replaced."""
        return self.settings.compute.with_overrides(c.overrides) if c.overrides else self.settings.compute

    def _session(self, loaded: tuple[Path, tuple[tuple[str, int], ...]]) -> Any:
        """The child that holds `loaded` (a model and its overrides), started (and others ended to stay
        within the budget) when none does."""
        from ggufcarve.llama import child
        from ggufcarve.measure.protocol import CHILD_MODULE

        session = self.sessions.pop(loaded, None)
        if session is None or not session.alive:
            size = loaded[0].stat().st_size
            while self.sessions and sum(m.stat().st_size for m, _ in self.sessions) + size > self.budget:
                self.sessions.pop(next(iter(self.sessions))).close()
            session = child.Session(CHILD_MODULE)
        self.sessions[loaded] = session
        return session

    def _scored(self, loaded: tuple[Path, tuple[tuple[str, int], ...]], request: Any, label: str) -> dict[str, Any]:
        """The measurement child's answer to `request` (measure.protocol.Request) on `loaded`. A device
        out of memory while other models are held there ends their children and loads it again alone."""
        from ggufcarve.errors import DeviceOutOfMemory
        from ggufcarve.measure.protocol import CHUNK_TASK

        def run() -> dict[str, Any]:
            return self._session(loaded).run(
                request,
                Path(request.result_out),
                lambda p: json.loads(p.read_text()),
                what=f"scoring {label} in libllama",
                hint="the last lines are llama.cpp's own; check that the model loads (ggufcarve inspect MODEL)",
                sink=self.on_event,
                stages={CHUNK_TASK: "measure"},
                idle_timeout=3600.0,
            )

        try:
            return run()
        except DeviceOutOfMemory:
            if not self.sessions:
                raise
            self.close()
            self.budget = 0  # one model at a time on the devices from here on
            return run()

    def close(self, failed: bool = False) -> None:
        """End every child (killed when the run failed)."""
        sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            if failed:
                session.kill()
            else:
                session.close()

    def _model_key(self, path: Path) -> str:
        from ggufcarve.fileio import sha256_file_cached

        if path not in self.model_keys:
            self.model_keys[path] = sha256_file_cached(path)
        return self.model_keys[path]

    def _key(self, cid: str, unit: int) -> str:
        from ggufcarve.evaluate.tables import unit_key

        c = self.candidates[cid]
        segment, first, count = self.units[unit]
        return unit_key(
            self._model_key(c.model),
            c.keep,
            self.segments[segment].identity,
            self.segments[segment].n_ctx,
            first,
            count,
            self.compute_of(c),
        )

    def score(self, upto: Mapping[str, int]) -> None:
        """Extend each named candidate's tables to its first `upto[cid]` units."""
        from ggufcarve.errors import UnsupportedModel
        from ggufcarve.measure.protocol import Job, Request

        if self.score_unit is not None:
            for cid, n in upto.items():
                for unit in range(len(self.tables[cid]), n):
                    self.tables[cid].append(self.score_unit(self.candidates[cid], self.units[unit]))
                    self.decoded += self.units[unit][2]
            return
        pending: dict[tuple[Path, tuple[tuple[str, int], ...]], list[tuple[str, list[int]]]] = {}
        for cid, n in upto.items():
            missing = []
            for unit in range(len(self.tables[cid]), n):
                cached = self._cached(cid, unit)
                if cached is not None and not missing:
                    self.tables[cid].append(cached)
                    self.cached += self.units[unit][2]
                else:
                    missing.append(unit)
            if missing:
                c = self.candidates[cid]
                pending.setdefault((c.model, c.overrides), []).append((cid, missing))
        for loaded, jobs in pending.items():
            model = loaded[0]
            request = Request(
                model=str(model),
                compute=self.compute_of(self.candidates[jobs[0][0]]),
                references=[str(s.reference) for s in self.segments],
                result_out=str(self.work / "measure.result.json"),
            )
            for number, (cid, units) in enumerate(jobs):
                keep = self.candidates[cid].keep
                request.jobs.append(
                    Job(
                        cid,
                        [list(self.units[u]) for u in units],
                        str(self.work / f"measure-{number}.f64"),
                        None if keep is None else {str(b): [int(i) for i in ids] for b, ids in sorted(keep.items())},
                    )
                )
            label = f"{len(jobs)} candidate{'s' if len(jobs) != 1 else ''} on {model.name}" + "".join(
                f", {key}={value}" for key, value in loaded[1]
            )
            result = self._scored(loaded, request, label)
            Path(request.result_out).unlink(missing_ok=True)
            if result.get("loaded", True):
                self.loads[model.name] = self.loads.get(model.name, 0) + 1
            for job, (cid, units) in zip(request.jobs, jobs):
                rows = np.fromfile(job.table_out, dtype="<f8").reshape(-1, TOKEN_COLUMNS)
                Path(job.table_out).unlink(missing_ok=True)
                masked = set(result["jobs"][cid]["masked"])
                missing_nodes = [n for n in self.candidates[cid].required_nodes if n not in masked]
                if missing_nodes:
                    raise UnsupportedModel(
                        f"{model.name}: llama.cpp's graph has no node {', '.join(missing_nodes[:4])} to mask for {cid}",
                        "score keep-sets by pruning files (ggufcarve prune --keep) and evaluating them",
                    )
                offset = 0
                for unit in units:
                    per_unit = self.units[unit][2] * _scored_per_chunk(self.segments[self.units[unit][0]].n_ctx)
                    part = rows[offset : offset + per_unit]
                    offset += per_unit
                    self.tables[cid].append(part)
                    self.decoded += self.units[unit][2]
                    self._store(cid, unit, part)
                if offset != len(rows):
                    raise BadInput(
                        f"the measurement child wrote {len(rows)} rows for {cid}, {offset} expected", "a ggufcarve bug"
                    )

    def _cached(self, cid: str, unit: int) -> np.ndarray | None:
        from ggufcarve.evaluate.tables import load

        return None if self.settings.tables is None else load(self.settings.tables, self._key(cid, unit))

    def _store(self, cid: str, unit: int, table: np.ndarray) -> None:
        from ggufcarve.evaluate.tables import store

        if self.settings.tables is not None:
            store(self.settings.tables, self._key(cid, unit), table)


def _scored_per_chunk(n_ctx: int) -> int:
    from ggufcarve.evaluate.perplexity import Chunking

    return Chunking(n_ctx, 1).scored_per_chunk


def measure(
    candidates: Sequence[Candidate],
    segments: Sequence[Segment],
    settings: MeasureSettings,
    work: Path,
    *,
    on_event: Sink = ignore,
    score_unit: Callable[[Candidate, tuple[int, int, int]], np.ndarray] | None = None,
    expand: Callable[[Sequence[str]], Sequence[Candidate]] | None = None,
) -> Measurement:
    """Run the rounds of every group (module docstring); the records, the groups' rounds and decisions, the tables.

    `score_unit(candidate, unit)`: a candidate's per-token table on a unit, instead of llama.cpp's
    (tables of known statistics that test the decision rules). `expand(survivors)`: the candidates a
    group's survivors of its first round add to it (module docstring)."""
    if settings.metric not in METRICS:
        raise BadInput(
            f"--metric {settings.metric!r} is not one of {', '.join(METRICS)}",
            "kld_mean ranks by mean KLD against the unpruned model",
        )
    check_z(settings.z)
    ids = [c.id for c in candidates]
    if len(set(ids)) != len(ids):
        raise BadInput(
            f"candidate ids repeat: {', '.join(sorted({i for i in ids if ids.count(i) > 1}))}", "a ggufcarve bug"
        )
    started = time.perf_counter()
    by_id = {c.id: c for c in candidates}
    n_ctx = segments[0].n_ctx
    units = spread_units(segments, chunks_per_unit(n_ctx))
    names = [s.name for s in segments]
    column = metric_column(settings.metric)
    per_chunk = _scored_per_chunk(n_ctx)
    scorer = _Scorer(by_id, segments, units, settings, work, on_event, score_unit)
    groups: dict[str, list[str]] = {}
    for c in candidates:
        groups.setdefault(c.group, []).append(c.id)
    plans = {
        g: schedule(len(members), len(units), len(segments), settings.first_units) for g, members in groups.items()
    }
    alive = {g: list(members) for g, members in groups.items()}

    def new_record(cid: str) -> dict[str, Any]:
        return {
            "id": cid,
            "group": by_id[cid].group,
            "fits": by_id[cid].fits,
            "stopped_early": False,
            "stopped_reason": None,
            "lost_by": None,
            "delta_vs_leader": [],
            "delta_stderr": [],
            "finalist": False,
            "leader": False,
            "winner": False,
            "tie_with": [],
        }

    records: dict[str, dict[str, Any]] = {cid: new_record(cid) for cid in ids}
    expanded: set[str] = set()

    def grow(g: str, survivors: Sequence[str]) -> None:
        """The group's candidates `expand` adds for its survivors (once per group)."""
        expanded.add(g)
        if expand is None:
            return
        for c in expand(list(survivors)):
            if c.id in by_id:
                raise BadInput(f"candidate id {c.id} repeats", "a ggufcarve bug")
            c = c if c.group == g else replace(c, group=g)
            by_id[c.id] = c
            scorer.candidates[c.id] = c
            scorer.tables[c.id] = []
            records[c.id] = new_record(c.id)
            groups[g].append(c.id)
            alive[g].append(c.id)

    rounds: dict[str, list[dict[str, Any]]] = {g: [] for g in groups}
    done = dict.fromkeys(groups, False)
    stats: dict[str, dict[str, Any]] = {}

    def table_of(cid: str, n: int | None = None) -> np.ndarray:
        return joined(scorer.tables[cid], n)

    def on_frontier(cid: str, ranked: Sequence[str], n: int) -> bool:
        """No candidate that fits and reads no more bytes per token is better than `cid` beyond noise on `n` units."""
        mine = by_id[cid]
        values = table_of(cid, n)[:, column]
        for other in ranked:
            rival = by_id[other]
            if other == cid or not rival.fits or rival.read_bytes > mine.read_bytes:
                continue
            diff = paired_difference(values, table_of(other, n)[:, column], per_chunk, settings.metric)
            if diff.worse_beyond(settings.z):
                return False
        return mine.read_bytes > 0

    def judge(cid: str) -> tuple[bool, list[str]]:
        if settings.gate is None or stats[cid].get("kld_mean") is None:
            return True, []
        return settings.gate(stats[cid])

    try:
        number = 0
        while not all(done.values()):
            wanted: dict[str, int] = {}
            current: dict[str, tuple[int, bool]] = {}
            for g, plan in list(plans.items()):
                if done[g]:
                    continue
                if number == 0 and len(plan) == 1 and g not in expanded:  # one round: expanded before it
                    grow(g, alive[g])
                    plan = plans[g] = schedule(len(alive[g]), len(units), len(segments), settings.first_units)
                last = number >= len(plan) - 1 or len(alive[g]) <= 1
                n = len(units) if last else plan[number]
                current[g] = (n, last)
                for cid in alive[g]:
                    wanted[cid] = n
            scorer.score(wanted)
            for g, (n, last) in current.items():
                for cid in alive[g]:
                    stats[cid] = _statistics(table_of(cid, n), [], [], per_chunk)
                ranked = sorted(alive[g], key=lambda c: (metric_value(stats[c], settings.metric), c))
                eligible = [cid for cid in ranked if by_id[cid].fits]
                leader = eligible[0] if eligible else ranked[0]  # the best candidate that can be the answer
                entry: dict[str, Any] = {
                    "units": n,
                    "chunks": sum(u[2] for u in units[:n]),
                    "candidates": list(ranked),
                    "leader": leader,
                    settings.metric: {c: stats[c][settings.metric] for c in ranked},
                    "delta_vs_leader": {},
                    "left": {},
                }
                leader_values = table_of(leader, n)[:, column]
                diffs: dict[str, PairedDifference] = {}
                for cid in ranked:
                    diffs[cid] = (
                        paired_difference(table_of(cid, n)[:, column], leader_values, per_chunk, settings.metric)
                        if cid != leader
                        else PairedDifference(0.0, 0.0, len(leader_values), len(leader_values) // per_chunk)
                    )
                    if cid != leader:
                        entry["delta_vs_leader"][cid] = diffs[cid].to_json()
                    records[cid]["delta_vs_leader"].append(diffs[cid].mean)
                    records[cid]["delta_stderr"].append(diffs[cid].to_json()["stderr"])
                if not last:
                    keep = []
                    for cid in ranked:
                        reason = (
                            "budget"
                            if not by_id[cid].fits
                            else "halving"
                            if diffs[cid].worse_beyond(settings.z)
                            and cid not in settings.never_leave
                            and not (settings.keep_faster and on_frontier(cid, ranked, n))
                            else None
                        )
                        if reason is None:
                            keep.append(cid)
                            continue
                        records[cid].update(
                            stopped_early=True,
                            stopped_reason=reason,
                            lost_by=diffs[cid].mean if cid != leader else None,
                        )
                        entry["left"][cid] = reason
                    if not keep:  # every candidate left for the budget: the group ends with no finalist
                        done[g] = True
                    alive[g] = keep
                    if keep and g not in expanded:
                        grow(g, keep)
                else:
                    done[g] = True
                rounds[g].append(entry)
            number += 1
    except BaseException:
        scorer.close(failed=True)
        raise
    scorer.close()

    result_groups: dict[str, dict[str, Any]] = {}
    for g, members in groups.items():
        for cid in members:
            n = len(scorer.tables[cid])
            table = table_of(cid)
            per_segment = [
                np.concatenate(
                    [t for u, t in enumerate(scorer.tables[cid]) if units[u][0] == s] or [np.zeros((0, TOKEN_COLUMNS))]
                )
                for s in range(len(segments))
            ]
            records[cid].update(
                _statistics(table, names, per_segment, per_chunk),
                units_scored=n,
                chunks_scored=sum(u[2] for u in units[:n]),
            )
            stats[cid] = records[cid]
            # the gate on every unit, for the candidates scored on all of them (a partial table is no verdict)
            judged = records[cid].get("kld_mean") is not None and n == len(units)
            passed, failed = judge(cid) if judged else (True, [])
            records[cid].update(gate_passed=passed, gate_failed=failed)
        finalists = [
            cid
            for cid in alive[g]
            if by_id[cid].fits and records[cid]["gate_passed"] and len(scorer.tables[cid]) == len(units)
        ]
        for cid in alive[g]:
            if cid not in finalists:
                records[cid].update(stopped_reason="budget" if not by_id[cid].fits else "gate")
        decision: dict[str, Any] = {
            "rounds": rounds[g],
            "finalists": finalists,
            "leader": None,
            "winner": None,
            "tie_with": [],
        }
        if finalists:
            choices = [
                Choice(cid, metric_value(records[cid], settings.metric), by_id[cid].file_bytes, by_id[cid].read_bytes)
                for cid in finalists
            ]
            leader = min(choices, key=lambda c: (c.value, c.id)).id
            leader_values = table_of(leader)[:, column]
            ties = [
                cid
                for cid in finalists
                if cid != leader
                and paired_difference(table_of(cid)[:, column], leader_values, per_chunk, settings.metric).within(
                    settings.z
                )
            ]
            winner = choose_answer(choices, ties, settings.prefer)
            tie_with = sorted({leader, *ties} - {winner})
            for cid in finalists:
                records[cid]["finalist"] = True
            records[leader]["leader"] = True
            records[winner].update(winner=True, tie_with=tie_with)
            decision.update(leader=leader, winner=winner, tie_with=tie_with)
        result_groups[g] = decision
    return Measurement(
        units,
        list(segments),
        records,
        result_groups,
        scorer.tables,
        time.perf_counter() - started,
        scorer.decoded,
        scorer.cached,
        scorer.loads,
    )


def measure_tables() -> Path:
    """The content-keyed cache of per-unit tables shared by every run (`evaluate.tables`)."""
    from ggufcarve.evaluate.tables import table_cache

    return table_cache()


def prepare_segments(
    source: Path,
    heldout: Sequence[Path],
    *,
    chunk_ctx: int,
    chunks: int | None,
    compute: Compute,
    work: Path,
    cache_dir: Path | None = None,
    on_event: Sink = ignore,
) -> list[Segment]:
    """The unpruned model's log-probs on every held-out file (`evaluate.reference.prepare_reference`:
    llama-perplexity's base file, cached by the model's and the text's sha256)."""
    from ggufcarve.evaluate import kld
    from ggufcarve.evaluate.protocol import EvalSettings
    from ggufcarve.evaluate.reference import prepare_reference
    from ggufcarve.evaluate.tables import reference_identity

    settings = EvalSettings(ctx=chunk_ctx, chunks=chunks, compute=compute, speed=None, cache_dir=cache_dir)
    names = [p.name for p in heldout]
    segments = []
    for path in heldout:
        reference = prepare_reference(source, path, settings, work, on_event)
        opened = kld.open_reference(reference.file)
        n_chunk = opened.n_chunk if chunks is None else min(opened.n_chunk, chunks)
        name = path.name if names.count(path.name) == 1 else str(path)
        segments.append(
            Segment(name, reference.file, n_chunk, opened.n_ctx, reference_identity(reference.sha256, reference.file))
        )
    return segments
