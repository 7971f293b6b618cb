"""Finding and reading a run's output files, wherever they lie under the run directory.

A run directory of ``dips launch`` keeps every role's files in one tree (``outer_steps.jsonl``
at the top, ``clusters/<id>/train.jsonl``, ``followers/<i>/applied.jsonl``); a run deployed by
hand leaves them on several hosts, and a copy of it puts each host's state directory in a
subfolder of its own.  So nothing here assumes a layout: files are found by name, recursively.
Whose file it is comes first from the file itself (a ``train.jsonl`` join record's
``cluster``, an ``applied.jsonl`` record's ``follower``), else from the folders above it (the
nearest folder named like a cluster id the leader knows), else from its own folder — as many
of its folders as tell it apart from another host's copy (``host-a/state``,
``host-b/state``): files from different hosts never merge because their folders share a name
(review 15, #4).

Reading never raises on bad content: a line that is not a JSON object is skipped and reported
as ``path:line: reason`` in :attr:`RunFiles.problems`; a missing file is simply absent.
Times in the files are epoch seconds (``dips launch``) or seconds since the start (the
real-time baselines); :meth:`RunFiles.origin` is the epoch second every plot counts from: the
run's training start, as ``dips launch`` defines it (its ``train_start`` file, else the
leader's first ``cluster_joined``), not the earliest record of any process.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunFiles", "SeveralRuns", "by_time", "distinct", "find", "load_run", "read_json",
           "read_jsonl"]

_EPOCH_MIN = 1e8  # a time above this is epoch seconds (1973); below: seconds since the start
_EVAL_NAMES = ("eval.jsonl", "evals.jsonl", "evaluator.jsonl", "evaluations.jsonl")


class SeveralRuns(ValueError):
    """The directory holds the leader's files of more than one run (or of more than one
    leader state directory): they would be merged into one report. ``paths``: the files."""

    def __init__(self, name: str, paths: list[Path]) -> None:
        self.paths = paths
        super().__init__(f"several runs: {len(paths)} different {name} files "
                         f"({', '.join(map(str, paths))}); give the directory of one run")


#: Files only the leader (or the launcher) writes, once per run: two different ones under
#: a directory are two runs, which ``dips report`` refuses to merge.
ONE_PER_RUN = ("summary.json", "outer_steps.jsonl", "train_start")


def distinct(paths: list[Path], notes: list[str]) -> list[Path]:
    """``paths`` without the duplicate copies: a file whose bytes equal another's, or are a
    beginning of another's (a copy taken earlier), is left out (the longest copy is kept),
    and each left out gets a line in ``notes`` naming both paths (of equal copies the one
    nearest the top is kept)."""
    datas: dict[Path, bytes] = {}
    for p in paths:
        try:
            datas[p] = p.read_bytes()
        except OSError:
            datas[p] = b""  # the reader reports it
    kept: list[Path] = []
    for p in sorted(paths, key=lambda q: (-len(datas[q]), len(q.parts), str(q))):
        same = next((k for k in kept if datas[k].startswith(datas[p])), None)
        if same is not None and datas[p]:
            how = "the same as" if datas[same] == datas[p] else "an earlier copy of"
            notes.append(f"{p} is {how} {same}: read once")
            continue
        kept.append(p)
    return sorted(kept)


def by_time(files: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The records of several files of one member (each file in its own order) merged into
    one list ordered by their ``time`` field (epoch or relative seconds): a cluster restarted
    on another host of its site leaves its lifetimes in two files whose paths may sort
    either way (review 28 #1). A record without a time takes the last time before it in its
    file (the file's start: before everything); equal times keep file order, then the
    order of ``files``. One file comes back as it is."""
    if len(files) == 1:
        return list(files[0])
    keyed: list[tuple[float, int, int, dict[str, Any]]] = []
    for k, recs in enumerate(files):
        last = -math.inf
        for i, rec in enumerate(recs):
            if (t := num(rec, "time")) is not None:
                last = t
            keyed.append((last, k, i, rec))
    keyed.sort(key=lambda e: e[:3])
    return [e[3] for e in keyed]


def find(root: Path, name: str) -> list[Path]:
    """Every file called ``name`` under ``root`` (recursively, sorted; symlinks not followed)."""
    return sorted(p for p in Path(root).rglob(name) if p.is_file())


def read_jsonl(path: Path, problems: list[str],
               shape: dict[str, type] | None = None) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one per line; blank lines ignored.

    A line that does not parse, is not an object, or (with ``shape``) has a field of another
    type (:func:`misshapen`) is skipped and reported in ``problems`` as ``path:line: reason``;
    an unreadable file adds one entry and gives ``[]``.
    """
    out: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        problems.append(f"{path}: cannot read: {exc.strerror or exc}")
        return out
    for no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{no}: not JSON ({exc.msg}); line skipped")
            continue
        if not isinstance(rec, dict):
            problems.append(f"{path}:{no}: a JSON {type(rec).__name__}, not an object; line skipped")
            continue
        if shape is not None and (why := misshapen(rec, shape)) is not None:
            problems.append(f"{path}:{no}: {why}; line skipped")
            continue
        out.append(rec)
    return out


#: The containers an ``outer_steps.jsonl`` decision record's fields hold (the leader's
#: ``dips.roles.leader_records``); a record with another type in one of them is skipped.
DECISION_SHAPE: dict[str, type] = {
    "clusters": list, "accepted": list, "ahead": list, "scored": list, "rejected": dict,
    "scores": dict, "thresholds": dict, "sq_norms": dict, "tokens": dict, "base_versions": dict,
    "weights": dict, "push_scales": dict, "checksums": dict, "invalid": dict}


def misshapen(rec: dict[str, Any], shape: dict[str, type]) -> str | None:
    """Why ``rec`` does not have ``shape`` (its first field of another type, or a number
    field ``round``/``version``/``time`` that is not a number), or None if it does."""
    for key, kind in shape.items():
        if key in rec and rec[key] is not None and not isinstance(rec[key], kind):
            return f"field {key!r} is a {type(rec[key]).__name__}, not a {kind.__name__}"
    for key in ("round", "version", "time"):
        v = rec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"field {key!r} = {v!r} is not a number"
    return None


def read_json(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """The JSON object in ``path`` (None, with a ``problems`` entry, if it is not one)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: not a readable JSON file ({exc}); ignored")
        return None
    if not isinstance(doc, dict):
        problems.append(f"{path}: a JSON {type(doc).__name__}, not an object; ignored")
        return None
    return doc


def num(rec: dict[str, Any], key: str) -> float | None:
    """``rec[key]`` as a float if it is a finite number (bools are not), else None."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


@dataclass
class RunFiles:
    """Everything read from one run directory (missing pieces are empty or None).

    Attributes:
        root: the run directory.
        summary: ``summary.json`` (the launcher's), or None.
        leader_state / run_spec: the leader's ``leader.json`` (its counts) and ``run.json``
            (the run spec: ``config``, ``eval_loss_initial``), or None (none, or several).
        outer_steps: the leader's decision lines of ``outer_steps.jsonl`` (``round_end`` and
            ``rollback`` lines are in ``round_ends`` / ``rollbacks``), in file order.
        outer_log: its decision and ``rollback`` lines together, in file order (what
            :func:`dips.algo.pushcounts.push_counts` counts).
        clusters: cluster id → its ``train.jsonl`` records (several files of one id merged
            by their ``time``: :func:`by_time`).
        followers: follower id → its ``applied.jsonl`` records (merged as ``clusters``).
        leader_events / events: ``leader_events.jsonl`` / ``events.jsonl`` records (several
            files merged by time, as ``clusters``).
        evals: held-out evaluations (records with ``eval_loss``: evaluator files and the
            leader's ``eval`` events), in time order.
        train_start: epoch seconds of the training start (the ``train_start`` file), or None.
        sources: what was read, as paths relative to ``root``.
        problems: ``path:line: reason`` for every line or file skipped.
        notes: what was merged or left out: duplicate copies read once, a member's records
            taken from several files.
    """

    root: Path
    summary: dict[str, Any] | None = None
    leader_state: dict[str, Any] | None = None
    run_spec: dict[str, Any] | None = None
    outer_steps: list[dict[str, Any]] = field(default_factory=list)
    round_ends: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    outer_log: list[dict[str, Any]] = field(default_factory=list)
    clusters: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    followers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    leader_events: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    train_start: float | None = None
    sources: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _found: dict[str, list[Path]] = field(default_factory=dict, repr=False, compare=False)
    _origin: float | None = field(default=None, repr=False, compare=False)

    def origin(self) -> float:
        """Epoch second that relative times count from, the training start: ``train_start``
        (the launcher's: when the first cluster had joined), else the time of the first
        ``cluster_joined`` of ``leader_events.jsonl`` (the same moment, for a run without the
        launcher's files: deployed by hand, or copied from its hosts), else the earliest epoch
        time of any record, else 0 (the files hold relative times already). Not the earliest
        record of all: the leader's and followers' start-up comes before the training.
        Computed once (call it after the files are read)."""
        if self._origin is None:
            self._origin = self._find_origin()
        return self._origin

    def _find_origin(self) -> float:
        if self.train_start is not None:
            return self.train_start
        joined = [t for r in self.leader_events if r.get("event") == "cluster_joined"
                  and (t := num(r, "time")) is not None and t > _EPOCH_MIN]
        if joined:
            return min(joined)
        times = [t for recs in (self.outer_steps, self.leader_events, *self.clusters.values(),
                                *self.followers.values())
                 for r in recs if (t := num(r, "time")) is not None and t > _EPOCH_MIN]
        return min(times, default=0.0)

    def rel(self, t: float) -> float:
        """Seconds since :meth:`origin` of a record's ``time`` (relative times pass through);
        a record from before the training start (a process's start-up: a follower's version
        0, a cluster's join) is at 0, never at a negative time."""
        return max(0.0, t - self.origin()) if t > _EPOCH_MIN else t

    def cluster_ids(self) -> list[str]:
        """Cluster ids known to the leader's files (summary, outer steps), then any others."""
        ids = list((self.summary or {}).get("cluster_ids") or [])
        for rec in self.outer_steps:
            ids += [c for c in rec.get("clusters") or [] if isinstance(c, str)]
        ids += list(self.clusters)
        return list(dict.fromkeys(str(i) for i in ids))


def _known_folder(path: Path, root: Path, known: set[str]) -> str | None:
    """The nearest folder above ``path`` named like a known id (also ``<anything>-<id>`` or
    ``<anything>_<id>``, e.g. ``cluster-c0``), or None."""
    for part in reversed(path.relative_to(root).parts[:-1]):
        for cid in sorted(known, key=len, reverse=True):
            if part == cid or (part.endswith(cid) and part[-len(cid) - 1] in "-_"):
                return cid
    return None


def _named(records: list[dict[str, Any]], key: str) -> str | None:
    """The id the file's own records give (the first ``key`` that is a string or an int)."""
    for rec in records:
        v = rec.get(key)
        if isinstance(v, str) and v or isinstance(v, int) and not isinstance(v, bool):
            return str(v)
    return None


def owners(files: dict[Path, list[dict[str, Any]]], root: Path, key: str,
           known: set[str]) -> dict[Path, str]:
    """Whose each of ``files`` (path -> its records) is (module docstring): the id its records
    name in ``key``, else a known id from its folders, else its folders — the last one, or as
    many of the last ones as it takes to tell the files apart from one another and from the
    ids found so far (``host-a/state`` and ``host-b/state``; ``followers/0`` stays ``0``)."""
    out: dict[Path, str] = {}
    for path, recs in files.items():
        if (who := _named(recs, key) or _known_folder(path, root, known)) is not None:
            out[path] = who
    rest = [p for p in files if p not in out]
    taken = set(out.values())
    folders = {p: p.relative_to(root).parts[:-1] or (root.name,) for p in rest}
    for n in range(1, max((len(f) for f in folders.values()), default=0) + 1):
        names = {p: "/".join(f[-n:]) for p, f in folders.items()}
        clash = [p for p in rest if list(names.values()).count(names[p]) > 1
                 or names[p] in taken]
        if not clash or n == max(len(f) for f in folders.values()):
            out.update(names)
            break
    return out


def _rel(path: Path, root: Path) -> str:
    return str(path.relative_to(root))


def _files(root: Path, name: str, run: RunFiles) -> list[Path]:
    """Every ``name`` under ``root``, duplicate copies left out (:func:`distinct`; looked
    for once per name, so each duplicate is noted once)."""
    if name not in run._found:
        run._found[name] = distinct(find(root, name), run.notes)
    return run._found[name]


def load_run(root: Path) -> RunFiles:
    """Read every known file under ``root`` (module docstring); never raises on content.

    Raises SeveralRuns when ``root`` holds two different copies of a file a run has once
    (:data:`ONE_PER_RUN`): two runs (or two leaders' state directories) would be merged.
    Duplicate copies of a file are read once, and a member whose records come from several
    files is named, both in :attr:`RunFiles.notes`."""
    root = Path(root)
    run = RunFiles(root=root)
    for name in ONE_PER_RUN:
        if len(paths := _files(root, name, run)) > 1:
            raise SeveralRuns(name, paths)
    for p in _files(root, "summary.json", run):
        run.summary = read_json(p, run.problems)
        run.sources.append(_rel(p, root))
    for name, attr in (("leader.json", "leader_state"), ("run.json", "run_spec")):
        if len(paths := _files(root, name, run)) == 1:
            setattr(run, attr, read_json(paths[0], run.problems))
            run.sources.append(_rel(paths[0], root))
        elif paths:
            run.notes.append(f"{len(paths)} different {name} files: none read")
    for p in _files(root, "outer_steps.jsonl", run):
        run.sources.append(_rel(p, root))
        for rec in read_jsonl(p, run.problems, DECISION_SHAPE):
            kind = rec.get("event")
            if kind == "round_end":
                run.round_ends.append(rec)
            elif kind == "rollback":
                run.rollbacks.append(rec)
                run.outer_log.append(rec)
            elif kind is None and "round" in rec:
                run.outer_steps.append(rec)
                run.outer_log.append(rec)
    for name, target in (("leader_events.jsonl", run.leader_events), ("events.jsonl", run.events)):
        parts = []
        for p in _files(root, name, run):
            if p.parent.parent.name == "methods":  # a comparison's per-method events
                continue
            run.sources.append(_rel(p, root))
            parts.append(read_jsonl(p, run.problems))
        if parts:
            target += by_time(parts)
        if len(parts) > 1:
            run.notes.append(f"{name}: the records of {len(parts)} files merged by time")
    for name, key, known, target in (("train.jsonl", "cluster", set(run.cluster_ids()),
                                      run.clusters),
                                     ("applied.jsonl", "follower", set(), run.followers)):
        files = {p: read_jsonl(p, run.problems) for p in find(root, name)}
        who = owners(files, root, key, known)
        kept: set[Path] = set()  # a member's duplicate copies read once; two members' files
        for owner in set(who.values()):  # alike (older files naming no one) both read
            kept.update(distinct([p for p in files if who[p] == owner], run.notes))
        parts: dict[str, list[list[dict[str, Any]]]] = {}
        for p, recs in files.items():
            if p in kept:
                run.sources.append(_rel(p, root))
                parts.setdefault(who[p], []).append(recs)
        for owner, lists in parts.items():
            target[owner] = by_time(lists)
        for owner in sorted(set(who.values())):
            if len(paths := [str(p) for p in files if who[p] == owner and p in kept]) > 1:
                run.notes.append(f"{name} of {owner}: the records of {len(paths)} files "
                                 f"merged by time ({', '.join(paths)})")
    for name in _EVAL_NAMES:
        for p in _files(root, name, run):
            run.sources.append(_rel(p, root))
            run.evals += [r for r in read_jsonl(p, run.problems) if num(r, "eval_loss") is not None]
    run.evals += [r for r in run.leader_events
                  if r.get("event") == "eval" and num(r, "eval_loss") is not None]
    run.evals.sort(key=lambda r: num(r, "time") or 0.0)
    for p in _files(root, "train_start", run):
        try:
            run.train_start = float(p.read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            run.problems.append(f"{p}: not a number of epoch seconds; ignored")
    return run
