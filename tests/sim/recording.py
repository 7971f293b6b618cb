"""Recording stubs around the leader's decision functions, for the real leader and the
simulator alike, and the comparable views of what they recorded.

:func:`install` wraps (with ``monkeypatch``) every name under which the real leader
(:mod:`dips.roles.leader`, :mod:`dips.roles.leader_push`, :mod:`dips.roles.leader_members`)
and the simulator (:mod:`dips.sim.engine`, :mod:`dips.sim.rounds`, :mod:`dips.sim.faults`)
reach them: the round machine ``step`` (and its query ``next_deadline``), ``run_update``
and the §8 ``decide``, the ledger's transitions, the §10 schedule, ``lease_allowed``,
``stop_reason`` and ``reconcile_target``. Each call appends one tuple to the trace; the wrapped function runs
unchanged.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import dips.algo.round as round_machine
import dips.roles.leader as leader_mod
import dips.roles.leader_members as members_mod
import dips.roles.leader_push as push_mod
import dips.roles.outer_step as outer_step
import dips.sim.engine as engine
import dips.sim.faults as faults_mod
from dips.algo.ledger import ChunkLedger
from dips.algo.schedule import ScheduleBook

#: The ledger's transitions recorded (its queries are not decisions).
LEDGER = ("credit", "windows_in", "report", "resolve", "lease", "release", "rollback")
#: Calls whose count follows the caller's clock or polling, not the protocol: compared as
#: "called at all" only, never inside a round's word.
POLLED = ("next_deadline", "stop_reason", "lease", "lease_allowed")


class Trace(list):
    """The recorded calls, in order (appends are made under a lock: the leader has threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def add(self, *entry: Any) -> None:
        with self.lock:
            self.append(entry)


def install(monkeypatch: Any, trace: Trace) -> None:
    """Wrap every decision function, under each name the leader and the simulator use."""
    real_step, real_next = round_machine.step, round_machine.next_deadline

    def step(state, event, policy):
        try:
            new, actions = real_step(state, event, policy)
        except Exception as exc:
            trace.add("step", type(event).__name__, state.phase.value, "refused",
                      (type(exc).__name__,), False, getattr(event, "cluster_id", None))
            raise
        noop = not actions and new == state
        trace.add("step", type(event).__name__, state.phase.value, new.phase.value,
                  tuple(type(a).__name__ for a in actions), noop,
                  getattr(event, "cluster_id", None))
        return new, actions

    def next_deadline(state, policy):
        trace.add("next_deadline")
        return real_next(state, policy)

    for mod in (round_machine, leader_mod, push_mod):
        monkeypatch.setattr(mod, "step", step, raising=False)
    for mod in (round_machine, leader_mod):
        monkeypatch.setattr(mod, "next_deadline", next_deadline)

    real_run = outer_step.run_update

    def run_update(followers, number, slots, *args, **kwargs):
        report = real_run(followers, number, slots, *args, **kwargs)
        trace.add("run_update", number, tuple(sorted(s.cluster_id for s in slots)),
                  tuple(sorted(report.outcome.accepted)), report.outcome.version)
        return report

    monkeypatch.setattr(outer_step, "run_update", run_update)
    monkeypatch.setattr(leader_mod, "run_update", run_update)
    real_decide = outer_step.decide

    def decide(state, sq_norms, cfg, bound=None):
        trace.add("decide", tuple(sorted(sq_norms)))
        return real_decide(state, sq_norms, cfg, bound)

    monkeypatch.setattr(outer_step, "decide", decide)
    for name in LEDGER:
        _method(monkeypatch, trace, ChunkLedger, name)
    _method(monkeypatch, trace, ScheduleBook, "schedule")
    for mod, name in ((members_mod, "lease_allowed"), (engine, "lease_allowed"),
                      (leader_mod, "stop_reason"), (engine, "stop_reason"),
                      (leader_mod, "reconcile_target"), (faults_mod, "reconcile_target")):
        _function(monkeypatch, trace, mod, name)


def _method(monkeypatch: Any, trace: Trace, cls: type, name: str) -> None:
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if name == "resolve":
            trace.add(name, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("version"))
        else:
            trace.add(name, args[0] if args and isinstance(args[0], str) else None)
        return out

    monkeypatch.setattr(cls, name, wrapper)


def _function(monkeypatch: Any, trace: Trace, mod: Any, name: str) -> None:
    real = getattr(mod, name)

    def wrapper(*args, **kwargs):
        trace.add(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, wrapper)


# ----- views ----------------------------------------------------------------------------------
def names(trace: Trace) -> set[str]:
    """The decision functions called at all."""
    return {e[0] for e in trace}


def grammar(trace: Trace) -> set[tuple[str, str, str]]:
    """Every (phase, event kind, phase after) the round machine went through, events that
    changed nothing (a clock tick before any deadline, a pull report after its round) left
    out: how often those come follows the caller's polling."""
    return {(e[2], e[1], e[3]) for e in trace if e[0] == "step" and not e[5]}


def rounds(trace: Trace, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Each round's comparable view, from the calls after the previous round ended up to its
    own end (round-machine events of the kinds in ``skip`` left out): ``calls`` (a multiset, cluster ids dropped), ``phases`` (the phase changes in
    order), ``clusters`` (cluster -> the calls naming it, in order), ``updates`` (run_update's
    clusters, accepted, version) and ``resolved`` ((cluster, accepted, version) per resolve)."""
    out: list[dict[str, Any]] = []
    cur: list[tuple] = []
    for e in trace:
        if e[0] in POLLED or e[0] == "reconcile_target" or (e[0] == "step" and (
                e[5] or e[1] in skip)):
            continue
        cur.append(e)
        if e[0] == "step" and "RoundEnded" in e[4]:
            out.append(_view(cur))
            cur = []
    return out


def _view(entries: list[tuple]) -> dict[str, Any]:
    calls: Counter[tuple] = Counter()
    phases, clusters, updates, resolved = [], {}, [], []
    for e in entries:
        if e[0] == "step":
            calls[("step", e[1], e[2], e[3], e[4])] += 1
            if e[2] != e[3]:
                phases.append((e[1], e[2], e[3]))
            if e[6] is not None:
                clusters.setdefault(e[6], []).append(e[1])
        else:
            calls[(e[0],)] += 1
            if e[0] == "run_update":
                updates.append(e[2:])
            elif e[0] == "resolve":
                resolved.append(e[1:])
            if e[0] in LEDGER and e[1] is not None:
                clusters.setdefault(e[1], []).append(e[0])
    return {"calls": calls, "phases": phases, "clusters": clusters, "updates": updates,
            "resolved": sorted(resolved)}
