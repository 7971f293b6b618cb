"""Fault injection for ``dips launch --faults FILE`` (§12, §16 of the seed).

The YAML file holds ``faults:``, a list of entries::

    - {at_s: 20, action: kill, target: leader}            # kill -9 at t = 20 s of training
    - {at_s: 30, action: stop, target: follower-1, duration_s: 4}   # SIGSTOP, SIGCONT 4 s later
    - {phase: update, after_s: 15, action: kill, target: follower-0}  # crash inside an update
    - {phase: push, after_s: 10, action: kill, target: cluster-c2}    # crash while pushing
    - {at_s: 40, action: cut_link, target: cluster-c3, duration_s: 6} # link down, then restored

With ``network: netns`` (root) a cut link is the cluster's veth set down in its namespace, so
the kernel drops all of its traffic; on loopback it is emulated in the cluster process.

``target`` is a process name of the run (``leader``, ``follower-<i>``, ``cluster-<id>``).
``phase`` faults (``kill`` only: a process cannot SIGSTOP itself at a failpoint and be resumed
by its own timer) arm a failpoint (:mod:`dips.roles.failpoints`) that the target trips at that
protocol phase (``idle``, ``window``, ``push``, ``update`` or ``pull``; the leader also
``decided``: a round recorded in ``leader.json``, its ``outer_steps.jsonl`` line not yet written)
after ``after_s``. Every injected fault and
every recovery is an event in ``events.jsonl`` with its timestamp.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field, model_validator

from dips.emu.proctree import job_pids, signal_job
from dips.spec import Strict, load_yaml


class Fault(Strict):
    """One fault. Times in seconds since training started."""

    action: Literal["kill", "stop", "cut_link"] = Field(
        description="kill: kill -9; stop: SIGSTOP then SIGCONT; cut_link: the cluster offline")
    target: str = Field(pattern=r"^(leader|follower-\d+|cluster-[A-Za-z0-9_.-]+)$",
                        description="process name: leader, follower-<i> or cluster-<id>")
    at_s: float | None = Field(None, ge=0, description="when, seconds of training")
    phase: Literal["idle", "window", "push", "update", "pull", "decided"] | None = Field(
        None, description="or: kill the target inside this protocol phase (a failpoint): "
                          "idle (between rounds / transfers), window (a round just opened, its "
                          "first push starting), push (mid-push), update, pull; decided (the "
                          "leader only: a round in leader.json, its outer_steps.jsonl line not "
                          "yet written)")
    after_s: float = Field(0.0, ge=0, description="phase faults: armed after this many seconds")
    duration_s: float = Field(5.0, gt=0, description="stop / cut_link: how long, seconds")

    @model_validator(mode="after")
    def _when(self) -> "Fault":
        if (self.at_s is None) == (self.phase is None):
            raise ValueError(f"fault {self.action} {self.target}: give exactly one of at_s, phase")
        if self.phase is not None and self.action != "kill":
            raise ValueError(f"fault {self.action} {self.target}: phase faults must be kill")
        return self


class FaultPlan(Strict):
    """A fault plan (``dips launch --faults FILE``)."""

    faults: list[Fault] = Field(default_factory=list, description="the faults, in any order")


def load_faults(path: Path) -> FaultPlan:
    """Read a fault plan.  Raises OSError, or :class:`dips.spec.SpecError` naming the file and
    line of a YAML error or each failing field."""
    return load_yaml(path, FaultPlan)


class FaultInjector:
    """Fires the plan's faults as training time passes.

    Args:
        plan: the faults.
        pid_of: process name -> pid of the live child (None if not running).
        failpoints: the failpoint directory given to the children.
        event: ``(kind, process, **extra)`` recorder (the launcher's events.jsonl).
    """

    def __init__(self, plan: FaultPlan, pid_of: Callable[[str], int | None], failpoints: Path,
                 event: Callable[..., None], net: Any = None) -> None:
        self.pending = sorted(plan.faults, key=lambda f: f.at_s if f.at_s is not None else f.after_s)
        self._pid_of = pid_of
        self._dir = failpoints
        self._event = event
        self._net = net  # ShapedNetwork: cut links in the kernel instead of by failpoint
        self._undo: list[tuple[float, str, str, int | None]] = []
        self._stopped: dict[int, list[int]] = {}  # pid stopped -> its job's pids then
        self._armed: list[tuple[Fault, Path]] = []
        failpoints.mkdir(parents=True, exist_ok=True)

    def tick(self, t: float) -> None:
        """Fire everything due at training time ``t`` (seconds)."""
        for f in [f for f in self.pending if (f.at_s if f.at_s is not None else f.after_s) <= t]:
            self.pending.remove(f)
            self._fire(f, t)
        for item in [u for u in self._undo if u[0] <= t]:
            self._undo.remove(item)
            _, kind, target, pid = item
            if kind == "cont" and pid is not None:
                pids = self._stopped.pop(pid, [])
                if self._pid_of(target) != pid:  # gone meanwhile: its ranks may not be
                    signal_job(pid, signal.SIGCONT, pids)
                    continue
                signal_job(pid, signal.SIGCONT, pids + [p for p in job_pids(pid) if p not in pids])
                self._event("fault_cleared", target, action="stop", pid=pid, pids=pids)
            elif kind == "link_up":
                if self._net is not None:
                    self._net.set_link(target[len("cluster-"):], True)
                (self._dir / f"{target}.link_down").unlink(missing_ok=True)
                self._event("fault_cleared", target, action="cut_link")
        for f, marker in list(self._armed):
            try:
                text = marker.read_text()
            except FileNotFoundError:
                continue
            if not text:
                continue  # not yet whole (hit() renames it into place; be safe anyway)
            self._armed.remove((f, marker))
            self._event("fault", f.target, action="kill", phase=f.phase, fired_at=float(text))

    def _fire(self, f: Fault, t: float) -> None:
        if f.phase is not None:
            (self._dir / f"{f.target}.{f.phase}").write_text("armed")
            self._armed.append((f, self._dir / f"{f.target}.{f.phase}.fired"))
            self._event("fault_armed", f.target, action="kill", phase=f.phase)
            return
        pid = self._pid_of(f.target)
        if f.action == "cut_link":
            if self._net is not None and f.target.startswith("cluster-"):
                self._net.set_link(f.target[len("cluster-"):], False)  # veth down: kernel cut
                how = "netns"
            else:
                (self._dir / f"{f.target}.link_down").write_text("down")
                how = "failpoint"
            self._undo.append((t + f.duration_s, "link_up", f.target, None))
            self._event("fault", f.target, action="cut_link", duration_s=f.duration_s, how=how)
            return
        if pid is None:
            self._event("fault_skipped", f.target, action=f.action, reason="not running")
            return
        # Every process of the job, a torchrun cluster's ranks too (each in its own session).
        if f.action == "kill":
            pids = signal_job(pid, signal.SIGKILL)
            self._event("fault", f.target, action="kill", pid=pid, pids=pids)
        else:
            pids = self._stopped[pid] = signal_job(pid, signal.SIGSTOP)
            self._undo.append((t + f.duration_s, "cont", f.target, pid))
            self._event("fault", f.target, action="stop", pid=pid, pids=pids,
                        duration_s=f.duration_s)

    def summary(self) -> dict[str, Any]:
        return {"pending": len(self.pending), "armed": len(self._armed)}
