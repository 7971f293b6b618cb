"""One training cluster: its compute speed and its link (§13 heterogeneity, §15 slow links).

A cluster is described once, by :class:`ClusterConfig`, whoever runs it: ``dips launch``
(real processes), the virtual-time comparisons (:mod:`dips.emu.vclock` charges its steps and
transfers) and the real-time baselines.  Times are seconds from the run's training start (in
virtual time, emulated seconds; in real time, the launcher's ``train_start`` or the
baselines' common release); rates are bits per second (a 10 Gbit/s link is ``bps: 1.0e+10``).

* Compute: an inner step started at ``t`` lasts ``step_s × slowdown_at(t)``, where
  :meth:`ClusterConfig.slowdown_at` multiplies the constant ``slowdown`` with every active
  :class:`Transient` factor.
* Link: :meth:`LinkConfig.rate_at` is THE rate lookup: ``bps`` until the first
  :class:`RateChange` of ``schedule`` is due, then that change's ``bps``, and so on.
  ``link: null`` (real time only) leaves the cluster unshaped.
"""

from __future__ import annotations

from collections.abc import Callable

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dips.spec.base import Strict

__all__ = ["ClusterConfig", "LinkConfig", "RateChange", "Transient"]


class Transient(Strict):
    """An extra compute slowdown ``factor`` (>= 1) on ``[start_s, end_s)`` seconds."""

    start_s: float = Field(ge=0, allow_inf_nan=False, description="start, seconds")
    end_s: float = Field(gt=0, description="end (exclusive), seconds; > start_s")
    factor: float = Field(ge=1.0, allow_inf_nan=False,
                          description="multiplies the cluster's slowdown while active")

    @model_validator(mode="after")
    def _ordered(self) -> "Transient":
        if self.end_s <= self.start_s:
            raise ValueError(f"transient: end_s = {self.end_s} must exceed start_s = {self.start_s}")
        return self


class RateChange(Strict):
    """From ``at_s`` seconds on, the link runs at ``bps`` bits/s."""

    at_s: float = Field(ge=0, allow_inf_nan=False, description="when the change applies, seconds")
    bps: float = Field(gt=0, allow_inf_nan=False, description="the new rate, bits/s")


class LinkConfig(Strict):
    """A cluster's cross-cluster link: a rate and its changes over time (§13, §15).

    In virtual time the clock charges each transfer its bytes over this rate; in real time it
    is the kernel's ``tc tbf`` rate of the cluster's veth (``network: netns``) or the token
    bucket on its upload (loopback).  ``schedule`` is kept sorted by ``at_s``.
    """

    bps: float = Field(gt=0, allow_inf_nan=False,
                       description="rate before the first change, bits/s (10 Gbit/s: 1.0e+10)")
    schedule: list[RateChange] = Field(default_factory=list,
                                       description="rate changes, applied in at_s order")

    @field_validator("schedule")
    @classmethod
    def _sorted(cls, v: list[RateChange]) -> list[RateChange]:
        return sorted(v, key=lambda c: c.at_s)

    def rate_at(self, t: float) -> float:
        """The link rate (bits/s) at ``t`` seconds: the last change due at or before ``t``."""
        rate = self.bps
        for change in self.schedule:
            if change.at_s <= t:
                rate = change.bps
        return rate

    def rates(self) -> list[float]:
        """Every rate this link takes (bits/s): ``bps`` then each change's."""
        return [self.bps, *(c.bps for c in self.schedule)]

    def rescaled(self, time_scale: float, rate: Callable[[float], float]) -> "LinkConfig":
        """The same link with every time × ``time_scale`` and every rate mapped by ``rate``
        (e.g. emulated bits/s → the real rate that keeps the emulated transfer time)."""
        return LinkConfig(bps=rate(self.bps), schedule=[
            RateChange(at_s=c.at_s * time_scale, bps=rate(c.bps)) for c in self.schedule])


class ClusterConfig(Strict):
    """One cluster: identity, compute slowdown, stage workers, transients, link, in-cluster
    parallelism and its stall bound, device, and whether its inner optimizer state is
    checkpointed."""

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                    description="cluster name (letters, digits, _ . -)")
    slowdown: float = Field(1.0, ge=1.0, allow_inf_nan=False,
                            description="constant compute slowdown s >= 1 (§13)")
    stages: int = Field(1, ge=1, description="stage workers pushing and pulling in parallel (one "
                                             "per pipeline stage; virtual time: one transfer)")
    transient: list[Transient] = Field(default_factory=list,
                                       description="extra slowdowns on a schedule, multiplied "
                                                   "with slowdown")
    link: LinkConfig | None = Field(None, description="the cross-cluster link; None: unshaped "
                                                      "(real time)")
    parallel: Literal["ddp", "fsdp2", "pipeline"] = Field(
        "ddp", description="how the ranks of a multi-rank cluster (launched by torchrun, "
                           "WORLD_SIZE > 1) train, each rank a stage worker: ddp = one "
                           "replica per rank, gradients all-reduced each inner step; fsdp2 = "
                           "parameters sharded over the ranks (fully_shard per decoder block), "
                           "a block's owner materialises it one layer at a time to push "
                           "and after a pull; "
                           "pipeline = rank r is pipeline stage r (torch.distributed."
                           "pipelining, GPipe over `microbatches`) and pushes and pulls its "
                           "own layers (issue 14; one process when WORLD_SIZE is 1 or unset)")
    ranks: int = Field(
        1, ge=1, le=64,
        description="dips launch only (emulation on one host): start this cluster as one "
                    "torchrun job of `ranks` processes (`python -m torch.distributed.run "
                    "--nproc-per-node ranks -m dips.cluster`, each rank trained as `parallel` "
                    "says); 1: one process. At a real site the operator runs torchrun")
    microbatches: int | None = Field(
        None, ge=1, description="parallel: pipeline: GPipe microbatches per inner step (at "
                                "most inner.batch_size); None: one per stage (WORLD_SIZE)")
    collective_timeout_s: float = Field(
        1800.0, gt=0, allow_inf_nan=False,
        description="longest wait of one in-cluster collective (torch.distributed), seconds: "
                    "ranks wait this long for rank 0's talk with the leader (raised to at "
                    "least timeouts.startup_s + 60 and 2 × timeouts.push_s + 60 at start)")
    stall_factor: float = Field(
        20.0, ge=1.0, allow_inf_nan=False,
        description="a multi-rank cluster's rank 0 exits (the cluster restarts) when an inner "
                    "step runs longer than stall_factor × the median of the recent steps, "
                    "at least stall_floor_s (dips.node.stepwatch: a hung or stopped rank)")
    stall_floor_s: float = Field(
        60.0, ge=1.0, allow_inf_nan=False,
        description="the least an inner step may run before a multi-rank cluster counts it "
                    "as stalled, seconds (see stall_factor; the first 3 steps may take "
                    "collective_timeout_s). Lower it only where steps are steady (tests)")

    device: str | None = Field(
        None, pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="where the model and the inner step run: cpu, cuda or cuda:N (under "
                    "torchrun every cuda rank uses cuda:LOCAL_RANK); None: cuda when "
                    "available, else cpu. `--device` of the cluster command overrides it")
    inner_checkpoint: bool = Field(
        True, description="after every pull, save the inner AdamW state and the data "
                          "position in the cluster's --state-dir (inner/), and resume them "
                          "when the cluster restarts (issue 14)")

    def slowdown_at(self, t: float) -> float:
        """Compute slowdown (>= 1) at ``t`` seconds: ``slowdown`` × every active transient."""
        f = self.slowdown
        for tr in self.transient:
            if tr.start_s <= t < tr.end_s:
                f *= tr.factor
        return f

    def transient_tuples(self) -> list[tuple[float, float, float]]:
        """``(start_s, end_s, factor)`` of every transient (for :class:`dips.emu.pacing.Pacer`)."""
        return [(tr.start_s, tr.end_s, tr.factor) for tr in self.transient]

    def rescaled(self, time_scale: float, rate: Callable[[float], float] | None) -> "ClusterConfig":
        """The real-time form of an emulated cluster: transient and link-change times ×
        ``time_scale``, link rates mapped by ``rate`` (None: no link, unshaped)."""
        link = None if rate is None or self.link is None else self.link.rescaled(time_scale, rate)
        return self.model_copy(update=dict(
            link=link,
            transient=[Transient(start_s=tr.start_s * time_scale, end_s=tr.end_s * time_scale,
                                 factor=tr.factor) for tr in self.transient]))
