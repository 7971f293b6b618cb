"""Scenarios of ``dips simulate``: modelled costs in place of training (issue 16; seed §5–§8,
§12, §13, §16).

A :class:`SimScenario` describes a run at a size this machine cannot hold: the model (only its
shape: the parameter count per layer), the clusters (inner-step time with the §13 slowdown, PP
depth = stage workers, per-stage WAN links, faults), the followers (NIC, update cost per
parameter, memory per parameter), the leader (grace window, timeouts, heartbeats, RPC costs)
and the stochastic model of the pseudo-gradients' squared norms that feeds the real §8 penalty.
The simulator (:mod:`dips.sim`) drives the real decision code of :mod:`dips.algo` with it.

Units: seconds (``_s``), bits per second (``_bps``), bytes (``_bytes``), tokens; every field
says its unit. Unknown keys are refused and a bad value names its field
(:func:`dips.spec.base.load_yaml`). The concepts the rest of dips already has are reused, not
copied: :class:`~dips.spec.training.ModelConfig`, :class:`~dips.spec.training.OuterConfig`,
:class:`~dips.spec.training.PenaltyConfig`, :class:`~dips.spec.protocol.GraceConfig`,
:class:`~dips.spec.protocol.Timeouts`, :class:`~dips.spec.protocol.MembershipConfig`,
:class:`~dips.spec.cluster.LinkConfig` and :class:`~dips.spec.cluster.Transient`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from dips.spec.base import Strict, load_yaml
from dips.spec.cluster import LinkConfig, Transient
from dips.spec.protocol import GraceConfig, MembershipConfig, Timeouts
from dips.spec.training import ModelConfig, OuterConfig, PenaltyConfig

__all__ = ["NormModel", "SimCluster", "SimData", "SimFault", "SimFollowerFault", "SimFollowers",
           "SimLeader", "SimLeaderFault", "SimMemory", "SimReference", "SimScenario",
           "load_sim_scenario"]

_ID = r"^[A-Za-z0-9_.-]+$"


class SimFault(Strict):
    """One cluster's fault at a given push and phase, as ``dips launch --faults``'s phase faults
    kill a cluster process at a failpoint (:mod:`dips.roles.failpoints`): ``window`` admitted,
    nothing sent yet; ``push`` in the middle of its push (after its first layer); ``update``
    pushed, waiting for the verdict; ``pull`` the verdict in hand, nothing pulled yet. The
    cluster is then lost as a modelled fault is (removed after the missed heartbeats, back
    after ``recovery_s``)."""

    push: int = Field(ge=1, description="the cluster's n-th push request (1: its first)")
    phase: Literal["window", "push", "update", "pull"] = Field(
        description="where the cluster is lost: window, push, update or pull")


#: The leader's phases a follower or leader fault can be scheduled in (:class:`dips.algo.round.Phase`).
_PHASE = Literal["window", "push", "update", "pull"]


class SimFollowerFault(Strict):
    """One follower's fault in the leader's ``round``-th round, as ``dips launch --faults``
    stops or kills a follower process (§12; :mod:`dips.sim.faults`). ``phase``: where the
    round is when it hits: ``window`` as it opens, ``push`` as its window closes (transfers to
    the follower stall), ``update`` inside the follower's Apply (the step is not prepared
    everywhere: the round fails), ``pull`` once its verdicts are out (pulls stall).

    ``stop``: the process is frozen for ``down_s`` seconds (SIGSTOP): the leader marks it down
    after its missed heartbeats (not at all if it resumes sooner) and reconciles once it beats
    again. ``kill``: the process dies and the launcher's restart registers after ``down_s``
    seconds as a new incarnation, from its newest complete checkpoint, ``checkpoint_lag``
    versions behind its committed one (0: the asynchronous checkpoint was durable)."""

    follower: int = Field(ge=0, description="follower index")
    round: int = Field(ge=1, description="the leader's round number (1: its first; a restarted "
                                         "leader numbers from 65, above its reserved block)")
    phase: _PHASE = Field(description="the round's phase: window, push, update or pull")
    action: Literal["stop", "kill"] = Field(description="stop (frozen) or kill (restarted)")
    down_s: float = Field(gt=0, allow_inf_nan=False,
                          description="seconds until it beats (stop) or registers (kill) again")
    checkpoint_lag: int = Field(0, ge=0, description="kill: versions its newest checkpoint "
                                                     "lags its committed version")


class SimLeaderFault(Strict):
    """The leader killed in its ``round``-th round and restarted ``restart_s`` seconds later
    from its persisted state (``leader.json``: version, verdicts, ledger, penalty, grace and
    push-time estimates; :mod:`dips.sim.faults`). ``phase``: as the round opens (``window``),
    as its window closes (``push``), after the step was decided and recorded but before any
    follower committed it (``update``, the failpoint of
    :func:`dips.roles.outer_step.run_update`), or once its verdicts are out (``pull``)."""

    round: int = Field(ge=1, description="the leader's round number (1: its first; a restarted "
                                         "leader numbers from 65, above its reserved block)")
    phase: _PHASE = Field(description="the round's phase: window, push, update or pull")
    restart_s: float = Field(gt=0, allow_inf_nan=False,
                             description="seconds until the restarted leader serves again")


class SimCluster(Strict):
    """One cluster type (``count`` identical clusters, ids ``<id>1`` … ``<id>N`` when N > 1).

    An inner step started at t lasts ``step_s × slowdown × Π transients(t) × ε`` seconds, ε a
    lognormal factor of mean 1 and coefficient of variation ``step_cv`` (§13's slowdown model,
    :meth:`dips.spec.ClusterConfig.slowdown_at`). Each of its ``stages`` stage workers (one per
    PP stage, §10) holds a contiguous share of the layers and sends / receives them over its
    own WAN link.
    """

    id: str = Field(min_length=1, pattern=_ID, description="cluster (type) name")
    count: int = Field(1, ge=1, description="identical clusters of this type")
    stages: int = Field(1, ge=1, description="PP depth = stage workers talking to the followers")
    step_s: float = Field(gt=0, allow_inf_nan=False,
                          description="mean seconds of one inner step at slowdown 1")
    step_cv: float = Field(0.0, ge=0, allow_inf_nan=False,
                           description="coefficient of variation of one step's duration "
                                       "(lognormal, dimensionless)")
    slowdown: float = Field(1.0, ge=1.0, allow_inf_nan=False,
                            description="constant compute slowdown s >= 1 (§13)")
    transient: list[Transient] = Field(default_factory=list,
                                       description="extra slowdowns on a schedule (seconds)")
    windows_per_step: int = Field(ge=1, description="training sequences (windows) per inner step")
    H: int | None = Field(None, ge=1, description="inner steps per push (None: the scenario's H)")
    uplink: LinkConfig = Field(description="each stage worker's upload to the followers, bits/s")
    downlink: LinkConfig | None = Field(None, description="each stage worker's download from the "
                                                          "followers, bits/s (None: uplink)")
    latency_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                             description="setup seconds of one transfer (a layer pushed, one "
                                         "follower's layers pulled)")
    shared_links: bool = Field(False, description="True: the stage workers run in one process "
                                                  "(dips' cluster command) and never send to one "
                                                  "follower at once; False: separate hosts")
    mtbf_s: float | None = Field(None, gt=0, description="mean seconds between faults "
                                                         "(exponential; None: never fails)")
    recovery_s: float = Field(1800.0, ge=0, allow_inf_nan=False,
                              description="mean seconds from a fault until the cluster rejoins "
                                          "(exponential; never before it was removed)")
    faults: list[SimFault] = Field(default_factory=list,
                                   description="scheduled faults (each id of the type), on top "
                                               "of mtbf_s")
    join_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                          description="when the cluster first joins, seconds")
    initial_pull: bool = Field(True, description="pull the whole model on the first join "
                                                 "(False: start from the shared initial model, "
                                                 "as the virtual-time engine's clusters do; a "
                                                 "rejoin always pulls)")

    def ids(self) -> list[str]:
        """The cluster ids of this type: ``[id]``, or ``id1 … idN`` when ``count`` > 1."""
        return [self.id] if self.count == 1 else [f"{self.id}{k}" for k in range(1, self.count + 1)]


class SimMemory(Strict):
    """Follower memory per parameter of its shard (bytes/param)."""

    state_bytes_per_param: float = Field(8.0, ge=0, description="θ and Nesterov momentum, FP32 "
                                                                "(§12), bytes/param")
    staging_bytes_per_param: float = Field(4.0, ge=0, description="one staged push (its Δ, FP32), "
                                                                  "bytes/param per push held")
    sum_bytes_per_param: float = Field(4.0, ge=0, description="the round's token-weighted sum S "
                                                              "(FP32), bytes/param")
    snapshot_bytes_per_param: float = Field(8.0, ge=0, description="one snapshot (θ + momentum) "
                                                                   "kept, bytes/param")
    snapshots: int = Field(1, ge=0, description="snapshots held at once (asynchronous checkpoint)")
    capacity_bytes: float | None = Field(None, gt=0, description="a follower host's memory, bytes "
                                                                 "(None: not checked)")


class SimFollowers(Strict):
    """The followers (§5, §12): one CPU host each, the model's layers split contiguously."""

    count: int = Field(ge=1, description="followers (hosts)")
    nic_bps: float = Field(gt=0, allow_inf_nan=False,
                           description="NIC rate per direction (full duplex), bits/s")
    update_s_per_param: float = Field(0.0, ge=0, allow_inf_nan=False,
                                      description="CPU seconds of one outer step per parameter of "
                                                  "the shard (aggregate + Nesterov)")
    update_s_per_push_param: float = Field(0.0, ge=0, allow_inf_nan=False,
                                           description="extra CPU seconds per parameter for each "
                                                       "accepted push of the step")
    apply: Literal["parallel", "sequential"] = Field(
        "parallel", description="parallel: followers update at once (the paper); sequential: "
                                "one after another, as the leader calls them in turn")
    memory: SimMemory = Field(default_factory=SimMemory, description="memory per parameter")
    faults: list[SimFollowerFault] = Field(default_factory=list,
                                           description="scheduled follower faults")
    mtbf_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="mean seconds between random faults of each "
                                             "follower (exponential, from when it is back; "
                                             "None: only the scheduled ones)")
    fault_action: Literal["stop", "kill"] = Field(
        "kill", description="what a random follower fault does: stop (frozen) or kill "
                            "(restarted), as SimFollowerFault.action")
    fault_down_s: float = Field(300.0, gt=0, allow_inf_nan=False,
                                description="seconds a randomly faulted follower stays down "
                                            "(until it beats or registers again)")
    fault_checkpoint_lag: int = Field(0, ge=0, description="versions a randomly killed "
                                                           "follower's newest checkpoint lags "
                                                           "its committed version")


class SimLeader(Strict):
    """The leader's settings (the real ones) and the costs of its control plane."""

    grace: GraceConfig = Field(default_factory=GraceConfig, description="the §7 grace window")
    timeouts: Timeouts = Field(default_factory=Timeouts,
                               description="push_s, pull_s, push_slack, push_floor_s (seconds)")
    membership: MembershipConfig = Field(default_factory=MembershipConfig,
                                         description="heartbeat interval (s), missed heartbeats")
    rpc_cpu_s: float = Field(5e-5, ge=0, allow_inf_nan=False,
                             description="leader CPU seconds per control message")
    rpc_latency_s: float = Field(1e-3, ge=0, allow_inf_nan=False,
                                 description="seconds of one leader -> follower call in the "
                                             "update phase (round trip)")
    faults: list[SimLeaderFault] = Field(default_factory=list,
                                         description="scheduled leader restarts")
    mtbf_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                 description="mean seconds between random leader crashes "
                                             "(exponential, from when it serves again; None: "
                                             "only the scheduled ones)")
    restart_s: float = Field(60.0, gt=0, allow_inf_nan=False,
                             description="seconds until a randomly crashed leader serves again")


class NormModel(Strict):
    """The stochastic model of ‖Δ_j‖² fed to the real §8 penalty (no tensors).

    G_j = g0 · (steps_j / H) · (1 + staleness_gain · s_j) · exp(sigma·z − sigma²/2), z ~ N(0, 1):
    a random walk of the local model grows ‖θ_local − θ_base‖² with the steps taken, and Δ is
    formed against the server's *current* θ (§6), so every version applied since the push's
    base adds its own step; with probability ``anomaly_prob`` the push is corrupted and G is
    multiplied by ``anomaly_factor``. ‖δ‖² of the weighted mean with weights w_j is
    Σ w_j² G_j + ρ Σ_{j≠k} w_j w_k √(G_j G_k), ρ = ``correlation``.
    """

    g0: float = Field(1.0, gt=0, allow_inf_nan=False, description="‖Δ‖² of a fresh H-step push "
                                                                 "(units of Δ²)")
    sigma: float = Field(0.25, ge=0, allow_inf_nan=False,
                         description="lognormal spread of G (dimensionless)")
    staleness_gain: float = Field(0.1, ge=0, allow_inf_nan=False,
                                  description="relative growth of G per version of staleness")
    anomaly_prob: float = Field(0.0, ge=0, le=1, description="probability of a corrupted push")
    anomaly_factor: float = Field(100.0, ge=1, allow_inf_nan=False,
                                  description="G multiplier of a corrupted push")
    correlation: float = Field(0.5, ge=0, le=1, description="ρ between two clusters' Δ directions")


class SimData(Strict):
    """The data-chunk ledger (§12, §16: chunks pre-cut, many more than clusters)."""

    tokens_per_window: int = Field(ge=1, description="tokens of one window (sequence), tokens")
    num_chunks: int = Field(ge=1, description="chunks of the training stream")
    windows_per_chunk: int = Field(ge=1, description="windows per chunk")
    lease_ahead: int = Field(2, ge=1, description="unfinished chunks a cluster holds at a time")
    lease_timeout_s: float | None = Field(None, gt=0, description="seconds without accepted "
                                                                  "progress before a holder's "
                                                                  "chunks may be reassigned")


class SimReference(Strict):
    """Figures a scenario should reproduce (a paper's), compared in ``simulate.json``."""

    source: str = Field(description="where the figures come from (e.g. 'seed §16')")
    added_time_frac: float | None = Field(None, gt=0, description="largest per-cluster time added "
                                                                  "by the PS / compute time")
    follower_idle_frac: float | None = Field(None, gt=0, le=1, description="smallest follower idle "
                                                                           "fraction")
    follower_link_peak_bps: float | None = Field(None, gt=0, description="peak follower NIC rate, "
                                                                         "bits/s")
    leader_msg_rate_avg: float | None = Field(None, gt=0, description="control messages/s, mean")
    leader_msg_rate_peak: float | None = Field(None, gt=0, description="control messages/s, peak "
                                                                       "1-s bin")
    tolerance: float = Field(0.2, gt=0, description="relative tolerance of the comparison")


class SimScenario(Strict):
    """One simulated run (``dips simulate --scenario FILE``)."""

    name: str = Field(min_length=1, description="scenario name")
    seed: int = Field(0, ge=0, description="seed of every random draw")
    model: ModelConfig = Field(description="the model's shape (only its parameter counts are used)")
    H: int = Field(64, ge=1, description="inner steps per push (§13 default 64)")
    wire_bytes_scale: float = Field(1.0, gt=0, allow_inf_nan=False,
                                    description="bytes moved per wire byte of the model "
                                                "(dimensionless; the virtual-time engine's "
                                                "timing.model_bytes_scale, 1 for a real model)")
    outer: OuterConfig = Field(default_factory=OuterConfig,
                               description="the outer step's settings (clip, staleness, wire_dtype)")
    penalty: PenaltyConfig = Field(default_factory=PenaltyConfig, description="the §8 penalty")
    leader: SimLeader = Field(default_factory=SimLeader, description="the leader")
    followers: SimFollowers = Field(description="the followers")
    clusters: list[SimCluster] = Field(min_length=1, description="the cluster types")
    norms: NormModel = Field(default_factory=NormModel, description="the ‖Δ‖² model")
    data: SimData = Field(description="the data-chunk ledger")
    horizon_s: float = Field(gt=0, allow_inf_nan=False, description="simulated seconds at most")
    token_budget: int | None = Field(None, ge=1, description="stop once the accepted tokens reach "
                                                             "it (tokens; None: the horizon only)")
    timeline_s: float = Field(43200.0, gt=0, allow_inf_nan=False,
                              description="seconds from the start kept for the timeline plots")
    reference: SimReference | None = Field(None, description="figures to compare with")

    @model_validator(mode="after")
    def _check(self) -> "SimScenario":
        ids = [i for c in self.clusters for i in c.ids()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"clusters: ids {ids} must be unique (count expands id to id1..idN)")
        layers = self.model.num_layers + 2
        if self.followers.count > layers:
            raise ValueError(f"followers.count = {self.followers.count} exceeds the {layers} "
                             "layers to shard")
        for f in self.followers.faults:
            if f.follower >= self.followers.count:
                raise ValueError(f"followers.faults: follower = {f.follower} is not below "
                                 f"followers.count = {self.followers.count}")
        for c in self.clusters:
            if c.stages > layers:
                raise ValueError(f"cluster {c.id}: stages = {c.stages} exceeds the {layers} layers")
        return self


def load_sim_scenario(path: Path | str) -> SimScenario:
    """Read and validate a simulation scenario.

    Raises:
        OSError: the file cannot be read.
        SpecError (a ValueError): YAML syntax (file:line:column) or the failing fields.
    """
    return load_yaml(path, SimScenario)
