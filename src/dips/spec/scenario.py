"""Comparison scenarios for ``dips bench compare`` (seed §4, §13–§15: heterogeneous clusters).

A scenario fixes everything the compared methods share — model, tokenizer/data chunks, inner
AdamW, outer Nesterov, penalty, grace window, token budget — and the emulated heterogeneity:
each cluster's compute slowdown (constant, plus transient factors on a schedule) and its
cross-cluster link (:class:`dips.spec.cluster.ClusterConfig`, rates in bits/s, possibly
changing over time).

Emulated time (§12, §13).  ``timing.step_s`` is the emulated duration of one inner step at
slowdown 1; a cluster with slowdown s and transient factor f needs ``step_s * s * f`` seconds per
step.  One outer transfer (push or pull) moves the model in BF16, ``2 * param_count *
timing.model_bytes_scale`` emulated bytes, over the cluster's link.  The paper's ratio: a 1B
model (LLaMA3.2-1B, 1.24e9 parameters) in BF16 is 2.47 GB = 19.8 Gbit, 1.98 s one way at
10 Gbit/s; H = 64 inner steps of 32K tokens take ≈ 100 s on one H800 (Emu-S; §11's example: a
cluster finishes 64 steps in 100 s, i.e. 1.56 s per step: 6·N·tokens = 2.4e14 FLOP per step at
≈ 16% of the H800's 989 TFLOPS dense BF16 peak, plausible for a 1B model).  So one transfer at
10 Gbit costs ≈ 2% of a round's compute (push + pull ≈ 4%), 4% at 5 Gbit and 20% at 1 Gbit.
On the Real platform of the weak-scaling experiment the base cluster is 4×RTX 3090 (4 × 71 =
284 TFLOPS dense BF16, 3.5× less than one H800), so a round lasts ≈ 3.5× longer and the same
transfer costs 3.5× less of it.  :func:`paper_bytes_scale` returns the ``model_bytes_scale``
that reproduces the Emu-S ratio for a small model, a given H and step_s.

Scenarios are YAML files validated here (unknown keys refused, errors name the field).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from dips.spec.base import Strict, load_yaml
from dips.spec.cluster import ClusterConfig, LinkConfig
from dips.spec.protocol import GraceConfig
from dips.spec.training import (DataConfig, InnerConfig, ModelConfig, OuterConfig, PenaltyConfig,
                                check_training)

__all__ = [
    "DEFAULT_LINK_BPS", "METHODS", "PAPER_TRANSFER_OVER_ROUND", "RealTime", "Scenario", "Timing",
    "WeakScaling", "load_scenario", "paper_bytes_scale", "spread", "variant_settings",
]

Method = Literal["dp", "diloco", "async-diloco", "di-ps", "di-ps-no-penalty", "di-ps-uniform",
                 "di-ps-no-clip", "di-ps-no-grace", "di-ps-pull-barrier", "di-ps-dynamic-grace"]
METHODS: tuple[str, ...] = get_args(Method)

#: The link of a scenario cluster that names none: 10 Gbit/s (§13's fast network), bits/s.
DEFAULT_LINK_BPS = 1.0e10

# §12/§13: one BF16 transfer of a 1.24e9-parameter model at 10 Gbit/s (1.98 s) over one round
# of H = 64 inner steps (≈ 100 s on one H800).
PAPER_PARAMS = 1.24e9
PAPER_ROUND_S = 100.0
PAPER_TRANSFER_OVER_ROUND = (2 * PAPER_PARAMS * 8 / 10e9) / PAPER_ROUND_S


def spread(eta_percent: float, n: int) -> list[float]:
    """Slowdown factors of n clusters spread evenly over [1, 1 + η/100] (§13).

    Raises ValueError for n < 1 or η < 0.
    """
    if n < 1 or eta_percent < 0:
        raise ValueError(f"spread(eta_percent={eta_percent}, n={n}): need n >= 1, eta >= 0")
    if n == 1:
        return [1.0]
    return [1.0 + eta_percent / 100.0 * i / (n - 1) for i in range(n)]


class Timing(Strict):
    """Emulated durations (see the module docstring for the paper's ratio)."""

    step_s: float = Field(1.5, gt=0, description="emulated seconds of one inner step at slowdown 1")
    model_bytes_scale: float = Field(1.0, gt=0, description="emulated transfer bytes = 2 (BF16) × "
                                                            "param_count × this factor")
    latency_s: float = Field(0.0, ge=0, description="fixed per-transfer latency, seconds "
                                                    "(0: bandwidth only)")
    server_bps: float | None = Field(None, gt=0, description="per-follower link of the parameter "
                                                             "server, bits/s (None: the clusters' "
                                                             "links are the bottleneck, as in §13)")
    update_s: float = Field(0.0, ge=0, description="emulated seconds of the followers' outer step "
                                                   "(aggregate + Nesterov)")


class RealTime(Strict):
    """Real-time mode (:mod:`dips.bench.real`): how emulated seconds and bytes become real ones."""

    time_scale: float = Field(0.05, gt=0, description="real seconds per emulated second (step, "
                                                      "transient, grace and link-change times)")
    payload_bytes: int | None = Field(None, ge=1, description="real bytes of one model transfer on "
                                                              "the wire (BF16 tensors padded with "
                                                              "zeros); None: the model's BF16 size")
    measured_step: bool = Field(False, description="True: delay proportional to the measured step "
                                                   "instead of the calibrated one")
    shaping: Literal["auto", "tc-tbf", "token-bucket", "none"] = Field(
        "auto", description="auto: kernel tbf in namespaces as root, else a token bucket")
    max_time_s: float = Field(600.0, gt=0, description="wall-clock limit of one method's run, "
                                                       "seconds")


class WeakScaling(Strict):
    """Weak scaling (§13, §14): run the methods on the first n clusters for each n in ``counts``,
    each with a token budget of ``n × tokens_per_cluster`` (evaluations every
    ``n × eval_every_tokens``)."""

    counts: list[int] = Field(min_length=1, description="increasing cluster counts")
    tokens_per_cluster: int = Field(ge=1, description="token budget per cluster (tokens)")

    @field_validator("counts")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v) or sorted(set(v)) != v:
            raise ValueError(f"weak_scaling.counts = {v} must be increasing positive integers")
        return v


class Scenario(Strict):
    """One comparison: shared training setup, methods, emulated clusters and links.

    ``clusters`` lists the clusters explicitly (a cluster without ``link`` gets a 10 Gbit/s
    one, :data:`DEFAULT_LINK_BPS`); alternatively ``eta`` and ``n_clusters`` generate them
    (slowdowns spread over [1, 1 + eta/100] by :func:`spread`, link rates taken in turn from
    ``link_pattern_bps``).  ``kind: weak-scaling`` with ``weak_scaling.counts`` runs the
    methods on growing prefixes of the cluster list.
    """

    name: str = Field(min_length=1, description="scenario name (reports)")
    kind: Literal["compare", "weak-scaling"] = Field("compare", description="one comparison, or "
                                                                            "weak scaling")
    mode: Literal["virtual", "real"] = Field("virtual", description="virtual clock or real "
                                                                    "processes")
    seed: int = Field(0, ge=0, description="seed of the model and the batch samplers")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the trained model")
    data: DataConfig = Field(default_factory=DataConfig, description="tokenizer and chunks")
    inner: InnerConfig = Field(default_factory=InnerConfig, description="the inner AdamW loop")
    outer: OuterConfig = Field(default_factory=OuterConfig, description="the outer Nesterov step")
    penalty: PenaltyConfig = Field(default_factory=PenaltyConfig, description="the §8 penalty")
    grace: GraceConfig = Field(default_factory=GraceConfig, description="the §7 grace window "
                                                                        "(emulated seconds)")
    followers: int = Field(1, ge=1, description="followers the model is sharded over")
    methods: list[Method] = Field(min_length=1, description="the methods to compare, in order")
    token_budget: int | None = Field(None, ge=1, description="tokens consumed by all clusters "
                                                             "(tokens)")
    eval_every_tokens: int = Field(ge=1, description="evaluate every this many tokens (tokens)")
    eval_batches: int = Field(8, ge=1, description="validation batches per evaluation")
    eval_batch_size: int = Field(16, ge=1, description="sequences per validation batch")
    clusters: list[ClusterConfig] = Field(default_factory=list, description="the clusters, or "
                                                                            "eta + n_clusters")
    eta: float | None = Field(None, ge=0, description="slowdown spread η in percent (§13)")
    n_clusters: int | None = Field(None, ge=1, description="clusters to generate with eta")
    link_pattern_bps: list[float] = Field(default_factory=lambda: [DEFAULT_LINK_BPS],
                                          description="link rates of generated clusters, in "
                                                      "turn, bits/s")
    timing: Timing = Field(default_factory=Timing, description="emulated durations")
    real: RealTime = Field(default_factory=RealTime, description="real-time mode")
    weak_scaling: WeakScaling | None = Field(None, description="kind: weak-scaling")

    @field_validator("methods")
    @classmethod
    def _unique_methods(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"methods = {v} lists a method twice")
        return v

    @field_validator("link_pattern_bps")
    @classmethod
    def _positive_rates(cls, v: list[float]) -> list[float]:
        if not v or any(not 0 < b < float("inf") for b in v):
            raise ValueError(f"link_pattern_bps = {v} must be non-empty, finite and > 0")
        return v

    @field_validator("clusters")
    @classmethod
    def _default_links(cls, v: list[ClusterConfig]) -> list[ClusterConfig]:
        return [c if c.link is not None else
                c.model_copy(update={"link": LinkConfig(bps=DEFAULT_LINK_BPS)}) for c in v]

    @model_validator(mode="after")
    def _resolve(self) -> "Scenario":
        if self.eta is not None or self.n_clusters is not None:
            if self.eta is None or self.n_clusters is None:
                raise ValueError(f"eta = {self.eta} and n_clusters = {self.n_clusters}: give both")
            pattern = self.link_pattern_bps
            generated = [
                ClusterConfig(id=f"c{i}", slowdown=s, link=LinkConfig(bps=pattern[i % len(pattern)]))
                for i, s in enumerate(spread(self.eta, self.n_clusters))]
            # A dumped scenario holds both; anything else listed besides eta is a conflict.
            if self.clusters and self.clusters != generated:
                raise ValueError("give either clusters or eta + n_clusters, not both")
            self.clusters = generated
        if not self.clusters:
            raise ValueError("clusters: empty; list clusters or give eta + n_clusters")
        ids = [c.id for c in self.clusters]
        if len(set(ids)) != len(ids):
            raise ValueError(f"clusters: ids {ids} must be unique")
        check_training(self.model, self.data, self.inner, self.followers)
        if self.data.num_chunks < len(self.clusters):
            raise ValueError(f"data.num_chunks = {self.data.num_chunks} is fewer than the "
                             f"{len(self.clusters)} clusters")
        if self.kind == "weak-scaling":
            if self.weak_scaling is None:
                raise ValueError("kind = weak-scaling needs weak_scaling.counts")
            if self.weak_scaling.counts[-1] > len(self.clusters):
                raise ValueError(f"weak_scaling.counts = {self.weak_scaling.counts} exceeds the "
                                 f"{len(self.clusters)} clusters")
            if self.token_budget is None:  # the largest run's budget; each n gets its own
                self.token_budget = self.weak_scaling.counts[-1] * self.weak_scaling.tokens_per_cluster
        elif self.weak_scaling is not None:
            raise ValueError("weak_scaling is set but kind is not weak-scaling")
        if self.token_budget is None:
            raise ValueError("token_budget: field required (tokens consumed by all clusters)")
        return self

    def with_clusters(self, n: int) -> "Scenario":
        """A copy restricted to the first ``n`` clusters, as a plain comparison (weak scaling)."""
        data = self.model_dump(exclude={"eta", "n_clusters", "weak_scaling", "kind"})
        data["clusters"] = data["clusters"][:n]
        data["name"] = f"{self.name}-n{n}"
        if self.weak_scaling is not None:
            data["token_budget"] = n * self.weak_scaling.tokens_per_cluster
            data["eval_every_tokens"] = n * self.eval_every_tokens
        return Scenario.model_validate(data)

    def transfer_bytes(self, param_count: int) -> float:
        """Emulated bytes of one model transfer (push or pull): 2 × params × model_bytes_scale."""
        return 2.0 * param_count * self.timing.model_bytes_scale

    def transfer_over_round(self, param_count: int, bps: float = DEFAULT_LINK_BPS) -> float:
        """One transfer's seconds at ``bps`` bits/s over one round's compute (H × step_s): cf.
        §13's 0.02 at 10 Gbit/s."""
        return self.transfer_bytes(param_count) * 8 / bps / (self.inner.H * self.timing.step_s)


def variant_settings(s: Scenario, method: str) -> tuple[GraceConfig, PenaltyConfig, OuterConfig]:
    """The grace, penalty and outer settings of a Di-PS ``method`` on ``s`` (§15 ablations):
    ``di-ps-no-penalty`` turns the §8 penalty off, ``di-ps-uniform`` weights 1/n instead of
    T_j, ``di-ps-no-clip`` removes the clip (max_norm None), ``di-ps-no-grace`` closes the
    window at once, ``di-ps-pull-barrier`` keeps the seed's §6 round (no new window until
    every pull is done), ``di-ps-dynamic-grace`` uses §7's τ*. The one place both time modes
    take them from. Raises ValueError for a method that is not a Di-PS variant."""
    if not method.startswith("di-ps") or method not in METHODS:
        raise ValueError(f"method = {method!r} is not a Di-PS variant of {METHODS}")
    grace, penalty, outer = s.grace, s.penalty, s.outer
    if method == "di-ps-no-penalty":
        penalty = penalty.model_copy(update={"enabled": False})
    elif method == "di-ps-uniform":
        outer = outer.model_copy(update={"uniform_weights": True})
    elif method == "di-ps-no-clip":
        outer = outer.model_copy(update={"clip": "seed", "max_norm": None})
    elif method == "di-ps-no-grace":
        grace = grace.model_copy(update={"mode": "fixed", "window_s": 0.0})
    elif method == "di-ps-pull-barrier":
        grace = grace.model_copy(update={"pull_barrier": True})
    elif method == "di-ps-dynamic-grace":
        grace = grace.model_copy(update={"mode": "dynamic"})
    return grace, penalty, outer


def paper_bytes_scale(param_count: int, H: int, step_s: float) -> float:
    """``timing.model_bytes_scale`` giving the paper's transfer/compute ratio (module docstring).

    Solves ``2·P·scale·8 / 10e9 = PAPER_TRANSFER_OVER_ROUND · H · step_s`` for ``scale``.
    """
    return PAPER_TRANSFER_OVER_ROUND * H * step_s * 10e9 / 8 / (2.0 * param_count)


def load_scenario(path: Path | str) -> Scenario:
    """Read and validate a YAML scenario.

    Raises:
        OSError: the file cannot be read.
        SpecError (a ValueError): a YAML syntax error (file:line:column), a document that is not
            a mapping, or the failing fields with their values (:func:`dips.spec.base.load_yaml`).
    """
    return load_yaml(path, Scenario)
