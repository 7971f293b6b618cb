"""The real-time baselines' run spec: ``RUN_DIR/spec.json`` (§4, §13; :mod:`dips.baselines`).

A baseline run (``dp``, ``diloco``, ``async-diloco`` in real time) starts one OS process per
cluster; each reads :class:`WorkerSpec`.  Its clusters are the same
:class:`dips.spec.cluster.ClusterConfig` as everywhere else, already in real time: times are
real seconds since the common release (``go.json``'s ``t0``) and link rates real bits/s
(:func:`dips.bench.real.worker_spec` rescales an emulated scenario's clusters).  Where each
cluster's sockets live is not a property of the cluster but of this run's network, so it is
kept apart, as an :class:`Endpoint` per cluster id, filled in by the launcher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from dips.spec.base import Strict
from dips.spec.cluster import ClusterConfig
from dips.spec.training import DataConfig, InnerConfig, ModelConfig, OuterConfig

__all__ = ["Endpoint", "WorkerSpec"]

#: ``eval_every_tokens`` that never comes: only the final snapshot is evaluated.
NEVER_TOKENS = 10**12


class Endpoint(Strict):
    """Where one cluster's process binds: 127.0.0.1/lo on loopback, its namespace's veth when
    the links are shaped by tc (:mod:`dips.emu.netns`)."""

    addr: str = Field("127.0.0.1", description="IP address the cluster's sockets bind")
    iface: str = Field("lo", description="network interface of that address (GLOO_SOCKET_IFNAME)")
    port: int = Field(0, ge=0, le=65535, description="async-diloco inbox port; 0: a free one")


class WorkerSpec(Strict):
    """Everything a baseline process needs (``RUN_DIR/spec.json``); validated, no extra keys.

    Units: seconds, bytes, tokens, bits/s.  ``token_budget`` counts the tokens of every inner
    step of every cluster; ``payload_bytes`` the bytes of one model-sized transfer on the wire
    (at least the model's BF16 size); ``step_s`` the real seconds of one inner step at slowdown
    1 (None: measured, :class:`dips.emu.pacing.Pacer`).
    """

    method: Literal["dp", "diloco", "async-diloco"] = Field(description="the baseline")
    seed: int = Field(0, ge=0, description="seed of the model and the batch samplers")
    model: ModelConfig = Field(description="the trained model")
    data: DataConfig = Field(description="tokenizer and chunks (cache_dir absolute)")
    inner: InnerConfig = Field(description="the inner AdamW loop")
    outer: OuterConfig = Field(default_factory=OuterConfig,
                               description="the replicated Nesterov step (lr, momentum)")
    token_budget: int = Field(ge=1, description="tokens of every inner step of every cluster")
    max_time_s: float = Field(gt=0, description="wall-clock limit, seconds")
    step_s: float | None = Field(None, gt=0, description="real seconds of an inner step at "
                                                         "slowdown 1; None: measured")
    payload_bytes: int = Field(0, ge=0, description="bytes of one model transfer on the wire")
    shaping: Literal["tc-tbf", "token-bucket", "none"] = Field(
        "none", description="how the links are shaped (the launcher's resolved choice)")
    clusters: list[ClusterConfig] = Field(min_length=1, description="the clusters, in real time")
    endpoints: dict[str, Endpoint] = Field(default_factory=dict,
                                           description="per cluster id: where it binds "
                                                       "(absent: 127.0.0.1, lo, a free port)")
    master_addr: str = Field("127.0.0.1", description="gloo rendezvous address")
    master_port: int = Field(0, ge=0, le=65535, description="gloo rendezvous port")
    eval_every_tokens: int = Field(NEVER_TOKENS, ge=1, description="snapshot every this many "
                                                                   "tokens (tokens)")
    eval_batches: int = Field(8, ge=1, description="validation batches per evaluation")
    eval_batch_size: int = Field(16, ge=1, description="sequences per validation batch")
    startup_s: float = Field(300.0, gt=0, description="wait for the start barrier, seconds")
    collective_s: float = Field(300.0, gt=0, description="timeout of one collective, seconds")

    @model_validator(mode="after")
    def _consistent(self) -> "WorkerSpec":
        ids = [c.id for c in self.clusters]
        if len(set(ids)) != len(ids):
            raise ValueError(f"clusters: ids {ids} must be unique")
        if self.data.num_chunks < len(ids):
            raise ValueError(f"data.num_chunks = {self.data.num_chunks} < {len(ids)} clusters")
        unknown = sorted(set(self.endpoints) - set(ids))
        if unknown:
            raise ValueError(f"endpoints: {unknown} are not cluster ids {ids}")
        return self

    def endpoint(self, cluster_id: str) -> Endpoint:
        """Where cluster ``cluster_id`` binds (the default loopback endpoint if unset)."""
        return self.endpoints.get(cluster_id, Endpoint())

    @property
    def shaped(self) -> bool:
        """Whether any cluster has a link rate to enforce."""
        return any(c.link is not None for c in self.clusters)

    @classmethod
    def read(cls, path: Path) -> "WorkerSpec":
        """Load and validate ``spec.json``.  Raises FileNotFoundError, pydantic.ValidationError."""
        return cls.model_validate_json(Path(path).read_text())
