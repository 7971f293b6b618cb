"""The followers of a simulated run: the leader's view of them, and their modelled load.

:class:`ModelledFollower` is a :class:`dips.roles.outer_step.FollowerControl`: the leader's
update phase, :func:`dips.roles.outer_step.run_update` (the one copy of score → §8 decide →
token weights → robust scale → clip → two-phase apply), calls it exactly as it calls a real
follower over gRPC. Instead of norms of tensors it answers with its share of the modelled
‖Δ_j‖² (:func:`dips.sim.costs.push_sq_norm`) and ‖δ‖² (:func:`dips.sim.costs.mean_sq_norm`).

:class:`FollowerLoad` keeps what a follower host did over time: the seconds its CPU ran outer
steps, the seconds its NIC moved data (in or out), the union of both (busy; idle is the rest),
its peak NIC rate per direction (bits/s) and its peak memory (bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dips.sim.costs import mean_sq_norm

__all__ = ["CHECKPOINTS_KEPT", "FollowerDown", "FollowerLoad", "ModelledFollower", "NormBoard"]


@dataclass
class NormBoard:
    """The round's modelled squared norms, shared by every follower: ``sq_norms`` cluster ->
    G_j (units of Δ²) set by the simulator before the update; ``rho`` the §8 model's ρ;
    ``calls``: (RPC name, follower index) of each call a follower answered, in order, until
    the simulator counts them as the leader's messages (:mod:`dips.sim.messages`)."""

    rho: float
    sq_norms: dict[str, float] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)


class FollowerDown(TimeoutError):
    """A call to a follower that is stopped, dead or not yet restarted, as the leader sees it
    (a call past its deadline; :func:`dips.roles.outer_step.run_update` then fails the round
    or lists the commit as failed, the reconciliation is tried again later)."""


#: Complete checkpoints a follower keeps (:class:`dips.roles.checkpoint.CheckpointWriter`'s keep).
CHECKPOINTS_KEPT = 3


class ModelledFollower:
    """One follower as :func:`dips.roles.outer_step.run_update` and the leader's
    reconciliation see it; ``share``: its fraction of the model's parameters (its part of
    every squared norm).

    Its versions are modelled as the real follower's (:mod:`dips.roles.follower`): ``apply``
    prepares a version, ``commit`` makes it current and checkpoints it (the newest
    :data:`CHECKPOINTS_KEPT` are kept), ``abort`` drops the prepared one, ``restore`` commits a
    prepared version or loads a checkpoint, ``report`` gives (committed, prepared or -1,
    checkpoints). ``alive`` False: every call raises :class:`FollowerDown`; ``commits_lost``
    True: commit calls never arrive (the leader died before sending them)."""

    def __init__(self, index: int, share: float, board: NormBoard) -> None:
        self.index, self.share, self.board = index, share, board
        self.version, self.prepared = 0, -1
        self.checkpoints = [0]
        self.alive = True
        self.commits_lost = False

    def _up(self, rpc: str) -> None:
        """A call of ``rpc`` (the Follower service's name) arrives: raises FollowerDown if
        this follower cannot answer, else logs it (one message the leader receives)."""
        if not self.alive:
            raise FollowerDown(f"follower {self.index} unavailable")
        self.board.calls.append((rpc, self.index))

    def score(self, rnd: int, clusters: list[str], push_ids: list[str] | None = None,
              retired: list[str] | None = None) -> list[tuple[str, bool, float, str]]:
        """(cluster, valid, its share of G_j, error) per cluster."""
        self._up("Score")
        return [(c, True, self.share * self.board.sq_norms[c], "") for c in clusters]

    def aggregate(self, rnd: int, clusters: list[str], weights: list[float]) -> float:
        """This shard's share of ‖δ‖² for δ = Σ w_j Δ_j (units of Δ²)."""
        self._up("Aggregate")
        return self.share * mean_sq_norm(self.board.sq_norms, dict(zip(clusters, weights)),
                                         self.board.rho)

    def apply(self, rnd: int, clip: float, new_version: int, accepted: list[str],
              weights: list[float]) -> tuple[int, str]:
        """Prepare ``new_version`` (nothing to compute: the simulator times it); returns
        (version, a checksum naming follower and version)."""
        self._up("Apply")
        self.prepared = new_version
        return new_version, f"sim-{self.index}-{new_version}"

    def commit(self, new_version: int) -> tuple[int, str]:
        """Make the prepared ``new_version`` current and checkpoint it; returns (version,
        checksum). Raises ValueError if another version is prepared."""
        if self.alive and self.commits_lost:
            raise FollowerDown(f"commit of version {new_version} never sent")
        self._up("Commit")
        return self._commit(new_version)

    def _commit(self, new_version: int) -> tuple[int, str]:
        if new_version != self.version:
            if self.prepared != new_version:
                raise ValueError(f"commit field 'new_version' = {new_version}, prepared "
                                 f"{self.prepared}")
            self.version, self.prepared = new_version, -1
            self.checkpoints = [*self.checkpoints, new_version][-CHECKPOINTS_KEPT:]
        return new_version, f"sim-{self.index}-{new_version}"

    def abort(self, rnd: int | None) -> None:
        """Drop a prepared step."""
        self._up("Abort")
        self.prepared = -1

    def restore(self, version: int) -> tuple[int, str]:
        """Bring the shard to ``version`` (commit it if prepared, else load its checkpoint);
        returns (version, checksum). Raises FileNotFoundError without such a checkpoint."""
        self._up("Restore")
        if version == self.prepared:
            return self._commit(version)
        if version != self.version and version not in self.checkpoints:
            raise FileNotFoundError(f"follower {self.index}: no checkpoint of version {version}")
        self.version, self.prepared = version, -1
        self.checkpoints = [v for v in self.checkpoints if v <= version]
        return version, f"sim-{self.index}-{version}"

    def restarted(self, lag: int) -> None:
        """A new process from the newest complete checkpoint, ``lag`` versions behind the
        committed one (the prepared step and anything newer are lost)."""
        durable = [v for v in self.checkpoints if v <= self.version - lag]
        self.checkpoints = durable or [min(self.checkpoints)]
        self.version, self.prepared = self.checkpoints[-1], -1

    def discard(self, rnd: int) -> None:
        """Drop round ``rnd``'s staged pushes (nothing is held)."""
        self._up("Discard")

    def report(self) -> tuple[int, int, list[int]]:
        """(committed version, prepared version or -1, complete checkpoint versions)."""
        self._up("GetState")
        return self.version, self.prepared, list(self.checkpoints)


@dataclass
class FollowerLoad:
    """A follower host's activity (seconds, bits/s, bytes); ``window_s``: rate changes before it
    are kept in ``samples`` (t, in bits/s, out bits/s) for the plots."""

    index: int
    params: int
    window_s: float
    cpu_s: float = 0.0
    nic_s: float = 0.0
    busy_s: float = 0.0
    peak_bps: dict[str, float] = field(default_factory=lambda: {"in": 0.0, "out": 0.0})
    bytes: dict[str, float] = field(default_factory=lambda: {"in": 0.0, "out": 0.0})
    memory_peak_bytes: float = 0.0
    samples: list[tuple[float, float, float]] = field(default_factory=list)
    updates: list[tuple[float, float]] = field(default_factory=list)
    _rate: dict[str, float] = field(default_factory=lambda: {"in": 0.0, "out": 0.0})
    _active: set[str] = field(default_factory=set)
    _since: dict[str, float] = field(default_factory=dict)

    def _set(self, kind: str, on: bool, t: float) -> None:
        """Mark activity ``kind`` ("in", "out", "cpu") on or off at ``t`` seconds."""
        was_busy, was = bool(self._active), kind in self._active
        if on == was:
            return
        if on:
            self._active.add(kind)
            self._since[kind] = t
            if not was_busy:
                self._since["busy"] = t
            return
        self._active.discard(kind)
        span = t - self._since.pop(kind)
        if kind == "cpu":
            self.cpu_s += span
        if not self._active:
            self.busy_s += t - self._since.pop("busy")

    def nic(self, direction: str, bps: float, t: float) -> None:
        """The NIC's total rate in ``direction`` ("in" or "out") is ``bps`` from ``t`` on."""
        old = self._rate[direction]
        nic_was = any(self._rate.values())
        self._rate[direction] = bps
        nic_now = any(self._rate.values())
        if nic_now and not nic_was:
            self._since["nic"] = t
        elif nic_was and not nic_now:
            self.nic_s += t - self._since.pop("nic")
        self.peak_bps[direction] = max(self.peak_bps[direction], bps)
        self._set(direction, bps > 0, t)
        if t < self.window_s and bps != old:
            self.samples.append((t, self._rate["in"], self._rate["out"]))

    def moved(self, direction: str, nbytes: float) -> None:
        """``nbytes`` bytes crossed the NIC in ``direction``."""
        self.bytes[direction] += nbytes

    def cpu(self, on: bool, t: float) -> None:
        """The CPU starts (``on``) or ends an outer step at ``t`` seconds."""
        self._set("cpu", on, t)
        if on and t < self.window_s:
            self.updates.append((t, t))
        elif not on and self.updates and self.updates[-1][0] == self.updates[-1][1]:
            self.updates[-1] = (self.updates[-1][0], t)

    def memory(self, nbytes: float) -> None:
        """The host holds ``nbytes`` bytes now."""
        self.memory_peak_bytes = max(self.memory_peak_bytes, nbytes)

    def close(self, t: float) -> None:
        """End every activity at ``t`` (the end of the run)."""
        for kind in ("in", "out"):
            self.nic(kind, 0.0, t)
        self.cpu(False, t)
