"""Real-time runners of ``dips bench compare`` (``mode: real``; seed §4, §13–§15).

Real processes, real gloo/ZeroMQ/gRPC traffic.  The baselines (``dp``, ``diloco``,
``async-diloco``) run through :func:`dips.baselines.real_launch.launch_baseline`, one process
per cluster, with the scenario's compute heterogeneity (calibrated inner steps, transients)
and links (kernel ``tc tbf`` in network namespaces as root, else the token bucket).  Di-PS and
its ablations run the real system of ``dips launch`` (:func:`dips.emu.launcher.launch`) with
the same shaping choice (:func:`dips.baselines.real_launch.resolve_shaping`): ``network: netns``
(clusters in namespaces, tc tbf) or the clusters' token buckets, and the scenario's rate
schedules as ``clusters[].link.schedule``.

Mapping emulated → real (:class:`dips.spec.RealTime`): with ``ts = real.time_scale``, an inner
step at slowdown 1 lasts ``timing.step_s × ts`` s; a transfer carries ``payload_bytes``
(default: the model's BF16 size) and a link of ``b`` bits/s runs at
``b × payload_bytes / (transfer_bytes × ts)`` bit/s, so that transfer time / step time is the
scenario's (and so the paper's, §13).  Each real cluster is the scenario's
:class:`dips.spec.ClusterConfig` rescaled (:meth:`dips.spec.ClusterConfig.rescaled`: times × ts,
rates mapped).  ``timing.latency_s`` is not emulated in real time (``netem`` is unavailable);
``timing.server_bps`` and ``update_s`` neither (real followers).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from dips.emu.result import CurvePoint, MethodResult
from dips.spec import TBF_MIN_BPS, ClusterConfig, RunConfig, Scenario, WorkerSpec
from dips.spec.scenario import variant_settings

__all__ = ["dips_link_bps", "dips_run_config", "link_rate_bps", "worker_spec"]


def _params(s: Scenario) -> int:
    from dips.train.model import build_model, param_count

    return param_count(build_model(s.model, s.seed))


def link_rate_bps(s: Scenario, bps: float, n_params: int) -> float:
    """Real link rate (bits/s) standing for an emulated ``bps`` bits/s link (module docstring)."""
    payload = s.real.payload_bytes or 2 * n_params
    return bps * payload / (s.transfer_bytes(n_params) * s.real.time_scale)


def _real_clusters(s: Scenario, rate: Any, who: str, hint: str) -> list[ClusterConfig]:
    """The scenario's clusters in real time (times × time_scale, rates mapped by ``rate``; None:
    unshaped).  Raises ValueError naming the cluster and field of a rate below tc's 8 kbit/s."""
    out = []
    for c in s.clusters:
        real = c.rescaled(s.real.time_scale, rate)
        if real.link is not None:
            fields = [("link.bps", real.link.bps)] + [("link.schedule", ch.bps)
                                                      for ch in real.link.schedule]
            for field, bps in fields:
                if bps < TBF_MIN_BPS:
                    raise ValueError(f"cluster {c.id!r}: {field} scales to {bps:.0f} bit/s{who} "
                                     f"(< 8 kbit/s); {hint}")
        out.append(real)
    return out


def _budget(s: Scenario) -> int:
    if s.token_budget is None:
        raise ValueError(f"scenario {s.name!r}: token_budget is None; real-time runs need one")
    return s.token_budget


def worker_spec(s: Scenario, method: str) -> WorkerSpec:
    """The :class:`WorkerSpec` of baseline ``method`` on scenario ``s`` (real time).

    Raises ValueError: no token budget, or a link slower than 8 kbit/s once scaled.
    """
    ts, n = s.real.time_scale, _params(s)
    clusters = _real_clusters(s, lambda bps: link_rate_bps(s, bps, n), "",
                              "raise real.payload_bytes or time_scale")
    data = s.data.model_copy(update={"cache_dir": Path(s.data.cache_dir).resolve()})
    return WorkerSpec(
        method=method, seed=s.seed, model=s.model, data=data, inner=s.inner, outer=s.outer,
        token_budget=_budget(s), max_time_s=s.real.max_time_s,
        step_s=None if s.real.measured_step else s.timing.step_s * ts,
        payload_bytes=s.real.payload_bytes or 2 * n, clusters=clusters,
        eval_every_tokens=s.eval_every_tokens, eval_batches=s.eval_batches,
        eval_batch_size=s.eval_batch_size)


def _baseline(method: str):
    def runner(scenario: Scenario, out_dir: Path) -> MethodResult:
        from dips.baselines.real_launch import launch_baseline

        out_dir.mkdir(parents=True, exist_ok=True)
        res = launch_baseline(worker_spec(scenario, method), out_dir, shaping=scenario.real.shaping)
        res.extra["time_scale"] = scenario.real.time_scale
        res.extra["emulated_time_s"] = res.time_s / scenario.real.time_scale
        return res

    runner.__name__ = f"run_{method.replace('-', '_')}_real"
    runner.__doc__ = f"Real-time ``{method}`` on a scenario (module docstring)."
    return runner


run_dp_real = _baseline("dp")
run_diloco_real = _baseline("diloco")
run_async_diloco_real = _baseline("async-diloco")



def dips_link_bps(s: Scenario, bps: float, n_params: int) -> float:
    """Real link rate (bits/s) of Di-PS for an emulated ``bps`` bits/s link: Di-PS moves the
    real BF16 model (2 bytes/parameter, no padding) per push and per pull, so its link runs at
    the rate that makes those bytes take the emulated transfer time × ``real.time_scale``."""
    return bps * 2 * n_params / (s.transfer_bytes(n_params) * s.real.time_scale)


def dips_run_config(s: Scenario, method: str, shaping: str | None = None) -> RunConfig:
    """The :class:`dips.spec.RunConfig` of Di-PS (or an ablation) on scenario ``s``.

    Ablations (issue 3): ``di-ps-no-penalty`` disables the §8 penalty, ``di-ps-uniform`` uses
    uniform instead of token weights, ``di-ps-no-clip`` removes the clip (max_norm None),
    ``di-ps-no-grace`` sets the grace window to 0, ``di-ps-pull-barrier`` keeps the seed's §6
    round (no new window until every pull of the round is done).  The grace window (and its
    dynamic clamp), transients and rate schedules (``clusters[].link.schedule``) are scaled by
    ``real.time_scale`` like every emulated duration; link rates by :func:`dips_link_bps`.

    ``shaping``: the shaping that will run (``tc-tbf``: ``network: netns``; ``token-bucket``:
    loopback with the clusters' token buckets; ``none``: no link rates); None resolves
    ``s.real.shaping`` with :func:`dips.baselines.real_launch.resolve_shaping` (``auto``
    probes for namespaces).

    Raises:
        ValueError: no token budget, an unknown shaping, or (shaped) a link slower than
            8 kbit/s once scaled (cluster and field named).
        RuntimeError: ``tc-tbf`` requested but unavailable.
    """
    from dips.baselines.real_launch import resolve_shaping

    if shaping is None:
        shaping = resolve_shaping(s.real.shaping, True)[0]
    if shaping not in ("tc-tbf", "token-bucket", "none"):
        raise ValueError(f"shaping must be tc-tbf, token-bucket or none, got {shaping!r}")
    grace, penalty, outer = variant_settings(s, method)
    data = s.data.model_copy(update={"cache_dir": Path(s.data.cache_dir).resolve()})
    ts, n = s.real.time_scale, _params(s)
    rate = (lambda bps: dips_link_bps(s, bps, n)) if shaping != "none" else None
    clusters = _real_clusters(s, rate, " for Di-PS",
                              "lower timing.model_bytes_scale or real.time_scale")
    grace = grace.model_copy(update={"window_s": grace.window_s * ts, "max_s": grace.max_s * ts})
    return RunConfig(
        name=f"{s.name}-{method}", seed=s.seed, model=s.model, data=data, inner=s.inner,
        outer=outer, penalty=penalty, followers=s.followers, grace=grace,
        step_s=None if s.real.measured_step else s.timing.step_s * ts,
        clusters=clusters, network="netns" if shaping == "tc-tbf" else "loopback",
        token_budget=_budget(s), max_time_s=s.real.max_time_s, eval_batches=s.eval_batches,
        eval_batch_size=s.eval_batch_size)


def _dips_time_to_budget(logs: list[list[dict[str, Any]]], budget: int) -> float | None:
    """Seconds from the first cluster's join to the inner step at which the clusters' summed
    tokens reached ``budget`` (the last step if never), from ``train.jsonl`` epoch times; the
    same clock as the baselines' (process start-up excluded).  None without records."""
    joins = [r["time"] for recs in logs for r in recs if r.get("event") == "join"]
    events = []
    for recs in logs:
        prev = 0
        for r in recs:
            if "step" in r and "tokens" in r:
                events.append((r["time"], r["tokens"] - prev))
                prev = r["tokens"]
    if not joins or not events:
        return None
    total, end = 0, None
    for t, dt in sorted(events):
        total += dt
        end = t
        if total >= budget:
            break
    return round(end - min(joins), 4)


def _dips_clusters(cfg: Any, logs: list[list[dict[str, Any]]], time_s: float) -> dict[str, Any]:
    """Per cluster: tokens, pushes, push+pull seconds, waiting seconds, idle fraction of time_s."""
    out = {}
    for c, recs in zip(cfg.clusters, logs):
        push = [r["push"] for r in recs if "push" in r]
        comm = sum(p["push_s"] + p["pull_s"] for p in push)
        wait = sum(p["wait_s"] for p in push)
        out[c.id] = {"tokens": max((r.get("tokens", 0) for r in recs), default=0), "pushes": len(push),
                     "accepted": sum(1 for p in push if p.get("accepted")), "comm_s": round(comm, 4),
                     "wait_s": round(wait, 4), "idle_frac": (comm + wait) / time_s if time_s > 0 else 0.0}
    return out


def run_dips_real(scenario: Scenario, out_dir: Path, method: str = "di-ps") -> MethodResult:
    """Real-time Di-PS (or an ablation, :func:`dips.spec.scenario.variant_settings`): the real
    processes of ``dips launch`` with the scenario's pacing and link shaping.

    Raises RuntimeError if the run produced no final model, ValueError for a method that is
    not a Di-PS variant.
    """
    from rich.console import Console

    from dips.baselines.real_launch import resolve_shaping
    from dips.baselines.real_results import read_jsonl
    from dips.emu.launcher import launch

    out_dir.mkdir(parents=True, exist_ok=True)
    shaping, why = resolve_shaping(scenario.real.shaping, True)
    cfg = dips_run_config(scenario, method, shaping)
    summary = launch(cfg, out_dir, scenario.real.max_time_s, console=Console(file=io.StringIO()))
    if not summary or summary.get("eval_loss_final") is None:
        raise RuntimeError(f"{method}: the Di-PS run produced no final model; see {out_dir}")
    logs = [read_jsonl(out_dir / "clusters" / c.id / "train.jsonl") for c in cfg.clusters]
    push = [r["push"] for recs in logs for r in recs if "push" in r]
    time_s = _dips_time_to_budget(logs, cfg.token_budget) or float(summary["train_time_s"])
    return MethodResult(
        method=method, mode="real", time_s=time_s, tokens=summary["tokens_consumed"],
        tokens_accepted=summary["tokens_accepted"],
        comm_s=round(sum(p["push_s"] + p["pull_s"] for p in push), 4),
        updates_pushed=summary["updates_pushed"], updates_accepted=summary["updates_accepted"],
        updates_rejected=summary["updates_rejected"], final_eval_loss=summary["eval_loss_final"],
        tokens_per_s=round(summary["tokens_consumed"] / time_s, 2) if time_s > 0 else 0.0,
        curve=[CurvePoint(0.0, 0, summary["eval_loss_initial"]),
               CurvePoint(time_s, summary["tokens_consumed"], summary["eval_loss_final"])],
        shaping=shaping,
        extra={"wait_s": round(sum(p["wait_s"] for p in push), 4), "outer_steps": summary["outer_steps"],
               "rounds": summary.get("rounds"), "clusters": _dips_clusters(cfg, logs, time_s),
               "time_scale": scenario.real.time_scale, "emulated_time_s": time_s / scenario.real.time_scale,
               "shaping_reason": why, "network": cfg.network,
               "link_bps": {c.id: c.link.bps if c.link else None for c in cfg.clusters},
               "link_changes": [{k: e[k] for k in ("process", "link_bps", "at_s", "applied_s", "how")}
                                for e in read_jsonl(out_dir / "events.jsonl")
                                if e.get("event") == "link_rate"]})
