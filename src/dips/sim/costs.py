"""The modelled costs of a simulated run: model size, compute time, ‖Δ‖² draws, memory.

Nothing here decides anything: the decisions are :mod:`dips.algo`'s. These functions turn a
:class:`dips.spec.simulate.SimScenario` into numbers (parameters, bytes, seconds) and random
draws, each from its own seeded stream (:func:`streams`), so a run is reproducible bit for bit
and adding a cluster never changes another cluster's draws.
"""

from __future__ import annotations

import math

import numpy as np

from dips.emu.vclock import step_duration
from dips.spec import ClusterConfig
from dips.spec.simulate import NormModel, SimCluster, SimMemory
from dips.spec.training import ModelConfig

__all__ = ["compute_s", "layer_params", "mean_sq_norm", "memory_bytes", "push_sq_norm",
           "streams", "wire_bytes_per_param"]


def layer_params(model: ModelConfig) -> list[tuple[str, int]]:
    """Parameters per layer, in model order ``embed, layers.0 … layers.{L-1}, head``, as
    :func:`dips.roles.layers.layer_table` groups an HF LLaMA / Qwen3 model (no biases; Qwen3
    adds per-head q/k RMSNorms; tied embeddings counted once, in ``embed``).

    The defaults of :class:`ModelConfig` give 1,250,432 (llama) and 1,250,688 (qwen3)
    parameters, as its docstring states.
    """
    h, hd = model.hidden_size, model.resolved_head_dim
    attention = h * model.num_heads * hd * 2 + h * model.num_kv_heads * hd * 2
    norms = 2 * h + (2 * hd if model.arch == "qwen3" else 0)
    layer = attention + 3 * h * model.intermediate_size + norms
    head = h + (0 if model.tie_embeddings else model.vocab_size * h)
    return [("embed", model.vocab_size * h), *((f"layers.{i}", layer)
                                              for i in range(model.num_layers)), ("head", head)]


#: Bytes of one parameter per ``OuterConfig.wire_dtype`` (§12); :data:`dips.wire.frames.DTYPES`
#: holds the same sizes as torch dtypes, but importing it would load torch.
_WIRE_BYTES = {"bf16": 2, "fp32": 4}


def wire_bytes_per_param(dtype: str) -> int:
    """Bytes of one parameter on the wire (§12: BF16 = 2, FP32 = 4). Raises KeyError otherwise."""
    return _WIRE_BYTES[dtype]


def streams(seed: int, index: int) -> dict[str, np.random.Generator]:
    """Independent generators of cluster ``index`` (compute, norms, faults), from ``seed``."""
    children = np.random.SeedSequence([seed, index]).spawn(3)
    return {k: np.random.Generator(np.random.PCG64(s))
            for k, s in zip(("compute", "norms", "faults"), children)}


def _lognormal(rng: np.random.Generator, cv: float, size: int | None = None):
    """Lognormal factors of mean 1 and coefficient of variation ``cv``."""
    s = math.sqrt(math.log1p(cv * cv))
    return rng.lognormal(-s * s / 2, s, size)


def compute_s(cluster: SimCluster, spec: ClusterConfig, start_s: float, steps: int,
              rng: np.random.Generator) -> float:
    """Seconds of ``steps`` inner steps of ``cluster`` started at ``start_s`` (seconds): each
    step :func:`dips.emu.vclock.step_duration` (``step_s`` × the §13 slowdown at its start)
    times a lognormal factor of mean 1 (``step_cv``). ``spec``: the cluster as a
    :class:`dips.spec.ClusterConfig` (its slowdown and transients)."""
    noise = _lognormal(rng, cluster.step_cv, steps) if cluster.step_cv > 0 else None
    if not cluster.transient:
        base = step_duration(spec, start_s, cluster.step_s)
        return float(base * (noise.sum() if noise is not None else steps))
    t = start_s
    for k in range(steps):
        t += step_duration(spec, t, cluster.step_s) * (1.0 if noise is None else float(noise[k]))
    return t - start_s


def push_sq_norm(norms: NormModel, steps: int, H: int, staleness: int,
                 rng: np.random.Generator) -> float:
    """One push's G_j = ‖Δ_j‖² (units of Δ²) under :class:`NormModel` (see its docstring):
    ``steps`` inner steps since the last pull, ``staleness`` versions applied since its base."""
    g = norms.g0 * steps / H * (1.0 + norms.staleness_gain * staleness)
    if norms.sigma:
        g *= float(rng.lognormal(-norms.sigma ** 2 / 2, norms.sigma))
    if norms.anomaly_prob and rng.random() < norms.anomaly_prob:
        g *= norms.anomaly_factor
    return g


def mean_sq_norm(sq_norms: dict[str, float], weights: dict[str, float], rho: float) -> float:
    """‖δ‖² of δ = Σ w_j Δ_j when any two Δ have cosine ``rho``: Σ_j Σ_k w_j w_k ρ_jk √(G_j G_k),
    ρ_jj = 1 (units of Δ²)."""
    a = [(weights[c], math.sqrt(sq_norms[c])) for c in weights]
    diagonal = sum((w * g) ** 2 for w, g in a)
    total = sum(w * g for w, g in a)
    return diagonal + rho * (total * total - diagonal)


def memory_bytes(mem: SimMemory, params: int, pushes_held: int) -> float:
    """A follower's memory (bytes) for a shard of ``params`` parameters holding
    ``pushes_held`` staged pushes at once (θ, momentum, staging, round sum, snapshots)."""
    per_param = (mem.state_bytes_per_param + pushes_held * mem.staging_bytes_per_param
                 + (mem.sum_bytes_per_param if pushes_held else 0.0)
                 + mem.snapshots * mem.snapshot_bytes_per_param)
    return per_param * params
