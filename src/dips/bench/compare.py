"""Run a comparison scenario method by method and write its report (seed §13–§15, §18).

:func:`run_compare` runs each listed method through the runner registry
(:mod:`dips.bench.runners`) and writes ``compare.json``, ``compare.md`` and the PNG plots;
:func:`run_weak_scaling` does the same for growing prefixes of the cluster list and compares
each method's aggregate throughput with the ideal of independent clusters without outer
communication (:func:`dips.emu.vclock.ideal_tokens`, the §14 denominator of 98.3–98.8%).
Figures derived here: speedup = DiLoCo's time to the budget / the method's; loss difference =
(final loss − DiLoCo's) / DiLoCo's, in percent.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from dips.emu.result import MethodResult
from dips.bench.runners import get_runner
from dips.spec import Scenario

__all__ = ["derive", "run_compare", "run_weak_scaling"]

# Called with (label, event, payload): "start"/"done" per method run (payload: MethodResult).
Reporter = Callable[[str, str, Any], None]


def _quiet(label: str, event: str, payload: Any) -> None:
    pass


def derive(results: list[MethodResult], reference: str = "diloco") -> dict[str, dict[str, Any]]:
    """Per method: speedup (time) and throughput ratio against ``reference``, loss difference %.

    Missing reference: the ratios are None.
    """
    ref = next((r for r in results if r.method == reference), None)
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        d: dict[str, Any] = {"speedup_vs_diloco": None, "throughput_vs_diloco": None,
                             "loss_diff_vs_diloco_pct": None,
                             "effective_frac": r.tokens_accepted / r.tokens if r.tokens else 0.0}
        if ref is not None:
            d["speedup_vs_diloco"] = ref.time_s / r.time_s if r.time_s > 0 else None
            d["throughput_vs_diloco"] = (r.tokens_per_s / ref.tokens_per_s
                                         if ref.tokens_per_s > 0 else None)
            d["loss_diff_vs_diloco_pct"] = 100.0 * (r.final_eval_loss - ref.final_eval_loss) / ref.final_eval_loss
        out[r.method] = d
    return out


def _run_methods(scenario: Scenario, out_dir: Path, report: Reporter, label: str = "") -> list[MethodResult]:
    results = []
    for method in scenario.methods:
        runner = get_runner(scenario.mode, method)
        report(f"{label}{method}", "start", None)
        t0 = time.monotonic()
        res = runner(scenario, out_dir / "methods" / method)
        res.extra.setdefault("wall_s", round(time.monotonic() - t0, 2))
        report(f"{label}{method}", "done", res)
        results.append(res)
    return results


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def run_compare(scenario: Scenario, out_dir: Path, report: Reporter = _quiet) -> dict[str, Any]:
    """Run every method of ``scenario``; write compare.json, compare.md and plots in ``out_dir``.

    Returns the JSON document. Raises what a runner raises (ValueError / RuntimeError for an
    unavailable mode or method).
    """
    from dips.bench import plots, report as md

    out_dir.mkdir(parents=True, exist_ok=True)
    results = _run_methods(scenario, out_dir, report)
    doc = {"scenario": scenario.name, "kind": "compare", "mode": scenario.mode,
           "config": scenario.model_dump(mode="json"),
           "shaping": sorted({r.shaping for r in results}),
           "derived": derive(results), "results": [r.to_dict() for r in results]}
    _write_json(out_dir / "compare.json", doc)
    doc["plots"] = plots.plot_compare(results, out_dir, scenario.name)
    (out_dir / "compare.md").write_text(md.render_compare(doc, results))
    _write_json(out_dir / "compare.json", doc)
    return doc


def run_weak_scaling(scenario: Scenario, out_dir: Path, report: Reporter = _quiet) -> dict[str, Any]:
    """Weak scaling: for each n of ``weak_scaling.counts`` run the methods on the first n clusters
    with ``n × weak_scaling.tokens_per_cluster`` tokens; compare throughput with the ideal.

    Writes compare.json (one point per (n, method): tokens/s, ideal tokens/s, fraction of the
    ideal, final loss), compare.md and the plots. Returns the JSON document.
    """
    from dips.bench import plots, report as md
    from dips.emu.vclock import ideal_tokens

    assert scenario.weak_scaling is not None  # guaranteed by Scenario validation
    out_dir.mkdir(parents=True, exist_ok=True)
    points: list[dict[str, Any]] = []
    runs: dict[int, list[MethodResult]] = {}
    tokens_per_step = scenario.inner.batch_size * scenario.inner.seq_len
    for n in scenario.weak_scaling.counts:
        sub = scenario.with_clusters(n)
        results = _run_methods(sub, out_dir / f"n{n:02d}", report, label=f"n={n} ")
        runs[n] = results
        for r in results:
            ideal = ideal_tokens(sub.clusters, sub.timing.step_s, tokens_per_step, r.time_s)
            ideal_tps = ideal / r.time_s if r.time_s > 0 else 0.0
            points.append({"clusters": n, "method": r.method, "tokens_per_s": r.tokens_per_s,
                           "ideal_tokens_per_s": ideal_tps,
                           "frac_of_ideal": r.tokens_per_s / ideal_tps if ideal_tps else None,
                           "time_s": r.time_s, "tokens": r.tokens,
                           "tokens_accepted": r.tokens_accepted,
                           "final_eval_loss": r.final_eval_loss, "comm_s": r.comm_s,
                           "updates_pushed": r.updates_pushed,
                           "updates_rejected": r.updates_rejected, "shaping": r.shaping})
    doc = {"scenario": scenario.name, "kind": "weak-scaling", "mode": scenario.mode,
           "config": scenario.model_dump(mode="json"), "points": points,
           "runs": {str(n): [r.to_dict() for r in rs] for n, rs in runs.items()}}
    _write_json(out_dir / "compare.json", doc)
    doc["plots"] = plots.plot_weak_scaling(points, out_dir, scenario.name)
    (out_dir / "compare.md").write_text(md.render_weak_scaling(doc))
    _write_json(out_dir / "compare.json", doc)
    return doc
