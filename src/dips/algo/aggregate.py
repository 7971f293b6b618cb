"""Aggregation of accepted pseudo-gradients and the global clip factor (§8 of the seed).

After the penalty has fixed the accepted set c, every follower i forms

    δ^i = Σ_{j∈c} T_j · Δ^(i,j) / Σ_{j∈c} T_j          (token-weighted mean)

and the leader sums ‖δ^i‖² over all followers to get one clip factor

    min(1, c / ‖δ‖₂)    with c = max_norm = 1 by default,

which every follower applies to its own shard (so the whole model is clipped, not each shard).
Weighting by tokens T_j (not 1/n) lets a fast cluster that consumed more data count more.
"""

from __future__ import annotations

import math
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Elements per block of :func:`squared_norm` (a block is summed in one pass, blocks in order), so
#: a consumer that norms each block as soon as it is complete (``DeltaSink``) sums the same bits.
NORM_CHUNK = 1 << 20
# Elements per FP32 row dot inside a block: short enough to keep FP32 rounding ~1e-7.
_NORM_ROW = 512


def token_weights(
    tokens: dict[str, int], accepted: list[str], uniform: bool = False,
    cap: int | None = None,
) -> dict[str, float]:
    """Return aggregation weights w_j = T_j / Σ_{k∈accepted} T_k for the accepted clusters (§8).

    Args:
        tokens: cluster id -> T_j, tokens consumed since its last accepted push (int > 0 for
            every accepted id; other entries are ignored).
        accepted: accepted cluster ids (non-empty, no duplicates). The result keeps this order.
        uniform: ablation: w_j = 1/n regardless of tokens (tokens are still validated).
        cap: weigh min(T_j, cap) instead of T_j (tokens; None: no cap). The leader passes the
            most one push can train (``LeaderConfig.max_push_tokens``): T_j is the data
            ledger's count of the windows a member *reports* trained, so a member that lies
            about its positions weighs at most a full push (issue 13); the ledger still
            accounts every window it reported.

    Returns:
        dict cluster id -> float weight; the weights sum to 1 (up to float rounding).

    Raises:
        ValueError: empty ``accepted``, a duplicate or unknown id, or T_j that is not an
            int > 0 (naming the cluster and value).
    """
    if not isinstance(accepted, (list, tuple)) or not accepted:
        raise ValueError(f"accepted must be a non-empty list of cluster ids, got {accepted!r}")
    if len(set(accepted)) != len(accepted):
        raise ValueError(f"accepted has duplicate cluster ids: {accepted!r}")
    for cid in accepted:
        if cid not in tokens:
            raise ValueError(f"accepted cluster {cid!r} has no entry in tokens")
        t = tokens[cid]
        if isinstance(t, bool) or not isinstance(t, int) or t <= 0:
            raise ValueError(f"tokens[{cid!r}] must be an int > 0, got {t!r}")
    if uniform:
        return {cid: 1.0 / len(accepted) for cid in accepted}
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
        raise ValueError(f"cap must be an int > 0 or None, got {cap!r}")
    weighed = {cid: tokens[cid] if cap is None else min(tokens[cid], cap) for cid in accepted}
    # Python ints are exact, so the total cannot overflow or lose precision.
    total = sum(weighed.values())
    return {cid: weighed[cid] / total for cid in accepted}


def _check_fp32(name: str, t: Any) -> None:
    import torch  # lazily: the leader uses this module's scalar functions without torch

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be torch.float32, got {t.dtype}")


def weighted_mean(deltas: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    """Return the weighted sum δ_k = Σ_j w_j · deltas[j][k] for every tensor k (§8).

    Args:
        deltas: deltas[j][k] is cluster j's pseudo-gradient for tensor k; FP32, any shape, all
            clusters with the same number of tensors and matching shapes / devices.
        weights: one finite float per cluster (usually from :func:`token_weights`; they are not
            renormalized here).

    Returns:
        New FP32 tensors (one per k), on the inputs' device. Inputs are not modified.

    Raises:
        ValueError: empty input, len(weights) != len(deltas), a non-finite weight, a cluster
            with a different tensor count, or a tensor whose dtype is not FP32 / whose shape or
            device differs from cluster 0's (naming cluster, tensor index and shapes).
    """
    import torch

    if not deltas:
        raise ValueError("deltas must be non-empty")
    if len(weights) != len(deltas):
        raise ValueError(f"len(weights)={len(weights)} != len(deltas)={len(deltas)}")
    for j, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"weights[{j}] must be a finite number, got {w!r}")
    ref = deltas[0]
    for j, tensors in enumerate(deltas):
        if len(tensors) != len(ref):
            raise ValueError(f"deltas[{j}] has {len(tensors)} tensors, deltas[0] has {len(ref)}")
        for k, t in enumerate(tensors):
            _check_fp32(f"deltas[{j}][{k}]", t)
            if t.shape != ref[k].shape:
                raise ValueError(
                    f"tensor {k}: deltas[{j}] shape {tuple(t.shape)} != "
                    f"deltas[0] shape {tuple(ref[k].shape)}"
                )
            if t.device != ref[k].device:
                raise ValueError(
                    f"tensor {k}: deltas[{j}] on {t.device}, deltas[0] on {ref[k].device}"
                )
    if not ref:
        return []
    with torch.no_grad():
        # Fixed accumulation order (cluster 0, 1, ...) keeps every follower bit-identical.
        out = torch._foreach_mul(list(ref), float(weights[0]))
        for tensors, w in zip(deltas[1:], weights[1:]):
            torch._foreach_add_(out, list(tensors), alpha=float(w))
    return out


def squared_norm(tensors: list[torch.Tensor]) -> float:
    """Return Σ_k ‖tensors[k]‖² (§8: G_j and ‖δ‖² per shard), blocked for speed and accuracy.

    Each tensor is cut into blocks of ``NORM_CHUNK`` elements from its start; inside a block,
    rows of ``_NORM_ROW`` elements are dotted in FP32 by one batched matrix product and the
    row sums are added in float64; a tail shorter than a row is summed in float64. Relative
    error ≤ ~1e-6 (measured 3e-7 for 3M equal values, 6e-10 for Gaussian data), at ~2x the
    speed of widening every element to float64. Equal inputs and block boundaries give equal
    sums bit for bit, which :class:`dips.roles.staging.DeltaSink` relies on.

    Args:
        tensors: floating-point tensors (FP32, BF16, ...), any shapes and devices. An empty list
            gives 0.0. Shard sums add up to the full-model value.

    Returns:
        Python float (units of the tensors' values squared). NaN / inf in the input propagate;
        callers filter them before :func:`dips.algo.penalty.decide`.

    Raises:
        ValueError: an element that is not a floating-point tensor (naming its index and dtype).
    """
    import torch

    total = 0.0
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(
                f"tensors[{k}] must be a floating-point tensor, got "
                f"{getattr(t, 'dtype', type(t).__name__)}"
            )
        flat = t.detach().reshape(-1)
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()  # BF16/FP16 squares are exact in FP32
        for start in range(0, flat.numel(), NORM_CHUNK):
            block = flat[start : start + NORM_CHUNK]
            rows = block.numel() // _NORM_ROW * _NORM_ROW
            if rows:
                r = block[:rows].view(-1, 1, _NORM_ROW)
                total += float(torch.bmm(r, r.transpose(1, 2)).sum(dtype=torch.float64))
            if rows < block.numel():
                tail = block[rows:].to(torch.float64)
                total += float(torch.dot(tail, tail))
    return total


def clip_factor(total_sq_norm: float, max_norm: float | None = 1.0) -> float:
    """Return the global clip factor min(1, max_norm / ‖δ‖₂) (§8, g_n = factor · δ).

    Args:
        total_sq_norm: ‖δ‖² summed over all shards (float >= 0, finite).
        max_norm: c (> 0); ``None`` or ``math.inf`` disables clipping (ablation).

    Returns:
        A float in (0, 1]; 1.0 when the norm is 0 or already <= max_norm.

    Raises:
        ValueError: total_sq_norm negative, NaN or inf (an inf norm would turn the factor into
            0 and the update into NaN); max_norm <= 0 or NaN.
    """
    if (
        isinstance(total_sq_norm, bool)
        or not isinstance(total_sq_norm, (int, float))
        or not math.isfinite(total_sq_norm)
        or total_sq_norm < 0
    ):
        raise ValueError(f"total_sq_norm must be a finite number >= 0, got {total_sq_norm!r}")
    if max_norm is None:
        return 1.0
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, None or math.inf, got {max_norm!r}")
    if math.isinf(max_norm) or total_sq_norm == 0.0:
        return 1.0
    return min(1.0, float(max_norm) / math.sqrt(total_sq_norm))


def clip_threshold(mode: str, max_norm: float | None, ratio: float,
                   mu_sq_norm: float | None) -> float | None:
    """The global clip threshold c of §8 for one outer step (the argument of :func:`clip_factor`).

    ``mode`` ``"seed"``: c = ``max_norm`` (the seed's fixed norm, 1 by default; None: no clip).
    ``"relative"``: c = ``ratio`` × √μ, μ the §8 penalty's EMA of the pushes' squared norms
    ‖Δ_j‖² (updated with this step's pushes), so the threshold follows the scale of the
    pseudo-gradients whatever the model's size, as AutoClip (Seetharaman et al., 2020) clips
    to a statistic of the observed gradient norms; None (no clip) before any norm was seen.
    Averaging n clusters' Δ shrinks ‖δ‖ below the typical ‖Δ_j‖, so the clip binds less when
    more clusters share a step, as synchronous DiLoCo's mean does.

    Raises ValueError: an unknown mode, ratio <= 0, a negative or non-finite μ.
    """
    if mode == "seed":
        return max_norm
    if mode != "relative":
        raise ValueError(f"clip mode = {mode!r} must be 'seed' or 'relative'")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0 \
            or not math.isfinite(ratio):
        raise ValueError(f"clip_ratio must be a finite number > 0, got {ratio!r}")
    if mu_sq_norm is None:
        return None
    if not math.isfinite(mu_sq_norm) or mu_sq_norm < 0:
        raise ValueError(f"mu_sq_norm must be a finite number >= 0, got {mu_sq_norm!r}")
    return ratio * math.sqrt(mu_sq_norm) if mu_sq_norm > 0 else None


def staleness_scale(mode: str, weights: dict[str, float], staleness: dict[str, int]) -> float:
    """The factor an outer step is scaled by for its pushes' staleness (multiplies the clip
    factor; 1.0 for fresh pushes).

    ``mode`` ``"none"``: 1.0 (the seed: a stale Δ at full weight). ``"inverse"``:
    1 / (1 + s̄), s̄ = Σ_j w_j · s_j the token-weighted mean staleness of the accepted pushes,
    s_j = versions applied since cluster j's base version (Zhang et al., 2016,
    "Staleness-aware Async-SGD": the learning rate divided by the staleness).

    Args: weights: accepted cluster -> w_j (summing to 1); staleness: cluster -> s_j >= 0.
    Raises ValueError: an unknown mode, a negative staleness or a cluster without one.
    """
    if mode == "none":
        return 1.0
    if mode != "inverse":
        raise ValueError(f"staleness mode = {mode!r} must be 'none' or 'inverse'")
    mean = 0.0
    for c, w in weights.items():
        s = staleness.get(c)
        if s is None or s < 0:
            raise ValueError(f"staleness of cluster {c!r} = {s!r} must be an integer >= 0")
        mean += w * s
    return 1.0 / (1.0 + mean)


def push_bound(mu_robust: float | None, ratio: float | None) -> float | None:
    """The largest ‖Δ_j‖² an accepted push enters the mean with, ``ratio``² × ``mu_robust``
    (units of Δ²; :func:`robust_scale`), and the largest G that enters the §8 statistics
    (:func:`dips.algo.penalty.decide`'s ``bound``); None when either is None (no bound).

    Raises ValueError: ``ratio`` not a finite number > 1, ``mu_robust`` negative or not finite.
    """
    if ratio is None or mu_robust is None:
        return None
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) \
            or not math.isfinite(ratio) or not ratio > 1:
        raise ValueError(f"push_norm_ratio must be a finite number > 1 or None, got {ratio!r}")
    if not math.isfinite(mu_robust) or mu_robust < 0:
        raise ValueError(f"mu_robust must be a finite number >= 0 or None, got {mu_robust!r}")
    return ratio * ratio * mu_robust


def robust_scale(sq_norms: dict[str, float], mu: float | None, mu_robust: float | None,
                 ratio: float | None) -> tuple[dict[str, float], float | None]:
    """Bound what one member can do to an outer step (issue 13: hostile members), given the
    accepted pushes' ‖Δ_j‖² ``sq_norms`` (units of Δ²), the §8 pooled μ ``mu`` and the robust
    scale ``mu_robust`` (:func:`dips.algo.penalty.robust_mu`, which fewer than half of the
    members cannot lift):

    * each push is scaled by s_j = min(1, ``ratio`` · √(μ_robust / ‖Δ_j‖²)), so it enters the
      mean (§8) with norm at most ``ratio`` · √μ_robust: per-member clipping, the centred
      clipping of Byzantine-robust aggregation (Karimireddy, He & Jaggi, 2021) with the
      clusters' median scale as its radius;
    * the μ of the relative clip (:func:`clip_threshold`) is min(μ, ratio² · μ_robust), so a
      member that drags §8's pooled μ upward (pushing just under the penalty's threshold,
      round after round) cannot widen the clip beyond ratio × an honest one.

    The same bound, :func:`push_bound`, caps each G that enters §8's statistics
    (:func:`dips.algo.penalty.decide`), so the pooled μ a minority can drag is at most its share
    of the EMA times that bound: a member growing its push 1.6× per accepted one (review 30)
    left the honest steps within 1.07× (2.2× for 190 rounds before), one that pushes the bound
    every round within 1.49× (RELIABILITY.md, "Hostile input"). With the sweeps' honest
    clusters ‖Δ_j‖² stays within ratio² of the median scale and no bound binds (the figures of
    CONVERGENCE.md are bit-identical); a cluster at 5× the median scale is scaled down. Until
    half of the run's members have pushed, ``mu_robust`` is the caller's absolute prior (the
    seed's clip norm squared; :func:`robust_mu`). ``ratio`` None: s_j = 1, μ unchanged.

    Returns:
        ({cluster: s_j in [0, 1]} (0 when μ_robust is 0), the clip's μ or None when ``mu`` is
        None).

    Raises:
        ValueError: a negative or non-finite norm or scale, ratio <= 1.
    """
    for name, v in (("mu", mu), ("mu_robust", mu_robust)):
        if v is not None and (not math.isfinite(v) or v < 0):
            raise ValueError(f"{name} must be a finite number >= 0 or None, got {v!r}")
    for cid, g in sq_norms.items():
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ValueError(f"sq_norms[{cid!r}] must be a finite number >= 0, got {g!r}")
    bound = push_bound(mu_robust, ratio)
    if bound is None:
        return {cid: 1.0 for cid in sq_norms}, mu
    scales = {cid: 1.0 if g <= bound else math.sqrt(bound / g) for cid, g in sq_norms.items()}
    return scales, None if mu is None else min(mu, bound)
