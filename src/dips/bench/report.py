"""``compare.md``: the human-readable report of ``dips bench compare`` (seed §14, §15, §18).

Reads only :class:`~dips.emu.result.MethodResult` figures and the derived ratios of
:func:`dips.bench.compare.derive`; §18 asks for aggregate tokens/s, outer communication time,
the share of rejected updates, effective tokens and the final loss side by side, so that "the
network was fast", "updates were discarded" and "a model of the same quality came sooner" can
be told apart.
"""

from __future__ import annotations

from typing import Any

from dips.emu.result import MethodResult

__all__ = ["render_compare", "render_weak_scaling"]

_SHAPING = {
    "virtual": "virtual time: each transfer charged bytes / bandwidth by the virtual clock",
    "tc-tbf": "kernel shaping: network namespaces + tc tbf on each cluster's link",
    "token-bucket": "application token bucket in the data plane (no root for tc)",
    "none": "no shaping (loopback speed)",
}


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _link(c: dict[str, Any]) -> str:
    """A dumped cluster's link in Gbit/s for the report (the config holds bits/s)."""
    link = c.get("link")
    if not link:
        return "unshaped"
    return (f"{link['bps'] / 1e9:g} Gbit" + "".join(f" → {ch['bps'] / 1e9:g} Gbit at {ch['at_s']:g} s"
                                                   for ch in link["schedule"]))


def _timing_lines(doc: dict[str, Any], results: list[MethodResult]) -> list[str]:
    cfg = doc["config"]
    lines = []
    if results and "transfer_over_round_10gbit" in results[0].extra:
        ex = results[0].extra
        lines.append(
            f"Model: {ex['param_count']:,} parameters; one outer transfer is emulated as "
            f"{ex['transfer_bytes'] / 1e9:.2f} GB (BF16 × model_bytes_scale "
            f"{cfg['timing']['model_bytes_scale']:g}); at 10 Gbit/s it costs "
            f"{100 * ex['transfer_over_round_10gbit']:.2f}% of a round of H = {cfg['inner']['H']} "
            f"inner steps of {cfg['timing']['step_s']:g} s (the paper's 1B model: 1.98%).")
    clusters = ", ".join(f"{c['id']} ×{c['slowdown']:.2f} @ {_link(c)}"
                         + ("".join(f" (×{tr['factor']:g} on [{tr['start_s']:g}, {tr['end_s']:g}) s)"
                                    for tr in c["transient"]))
                         for c in cfg["clusters"])
    lines.append(f"Clusters (slowdown @ link): {clusters}.")
    lines.append(f"Token budget {cfg['token_budget']:,}; H = {cfg['inner']['H']}; batch "
                 f"{cfg['inner']['batch_size']}×{cfg['inner']['seq_len']}; grace window "
                 f"{cfg['grace']['window_s']:g} s; seed {cfg['seed']}.")
    return lines


def render_compare(doc: dict[str, Any], results: list[MethodResult]) -> str:
    """Markdown report of one comparison (``doc``: the compare.json document)."""
    derived = doc["derived"]
    out = [f"# Comparison `{doc['scenario']}` ({doc['mode']} time)", ""]
    out += _timing_lines(doc, results)
    out += ["", "| method | tokens/s | time to budget (s) | speedup vs DiLoCo | comm (s) | "
                "pushed / accepted / rejected | effective tokens | final loss | loss vs DiLoCo |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        d = derived[r.method]
        out.append(
            f"| {r.method} | {r.tokens_per_s:,.1f} | {r.time_s:,.1f} | "
            f"{_f(d['speedup_vs_diloco'], '{:.2f}×')} | {r.comm_s:,.1f} | "
            f"{r.updates_pushed} / {r.updates_accepted} / {r.updates_rejected} | "
            f"{r.tokens_accepted:,} ({100 * d['effective_frac']:.0f}%) | {r.final_eval_loss:.4f} | "
            f"{_f(d['loss_diff_vs_diloco_pct'], '{:+.2f}%')} |")
    out += ["", "Speedup = DiLoCo's time to the token budget / the method's (equal budgets). "
            "Comm = outer communication seconds summed over clusters. Effective tokens = tokens "
            "behind updates that reached the global model. Loss: validation cross-entropy, "
            "nats/token, on the held-out split (Di-PS: the global model; DP: the replicated model; "
            "DiLoCo: the replicated global model; async DiLoCo: cluster 0's copy)."]
    dips = [r for r in results if r.method.startswith("di-ps")]
    if dips:
        out += ["", "| Di-PS variant | rounds | mean staleness (versions) | idle % per cluster |",
                "| --- | ---: | ---: | --- |"]
        for r in dips:
            idle = ", ".join(f"{cid} {100 * c['idle_frac']:.1f}%" for cid, c in r.extra["clusters"].items())
            out.append(f"| {r.method} | {r.extra.get('rounds', '–')} | "
                       f"{_f(r.extra.get('mean_staleness'))} | {idle} |")
    by: dict[str, list[str]] = {}  # shaping -> the methods that ran under it
    for r in results:
        by.setdefault(r.shaping, []).append(r.method)
    out += ["", "Shaping: " + "; ".join(_SHAPING.get(s, s) + (f" ({', '.join(by[s])})" if len(by) > 1 else "")
                                       for s in sorted(by)) + ".", ""]
    for name in doc.get("plots", []):
        out.append(f"![{name}]({name})")
    return "\n".join(out) + "\n"


def render_weak_scaling(doc: dict[str, Any]) -> str:
    """Markdown report of a weak-scaling run: per n, each method's tokens/s and % of the ideal."""
    points = doc["points"]
    methods = list(dict.fromkeys(p["method"] for p in points))
    counts = sorted({p["clusters"] for p in points})
    by = {(p["clusters"], p["method"]): p for p in points}
    out = [f"# Weak scaling `{doc['scenario']}` ({doc['mode']} time)", "",
           "Ideal = the same clusters training independently, no outer communication and no "
           "waiting (tokens they would consume in the method's own time to the budget).", "",
           "| clusters | ideal tokens/s | " + " | ".join(f"{m} tokens/s (% of ideal)" for m in methods)
           + " | " + " | ".join(f"{m} final loss" for m in methods) + " |",
           "| ---: | ---: | " + " | ".join("---:" for _ in methods * 2) + " |"]
    for n in counts:
        first = next(by[(n, m)] for m in methods if (n, m) in by)
        cells = []
        for m in methods:
            p = by.get((n, m))
            cells.append("–" if p is None else
                         f"{p['tokens_per_s']:,.1f} ({100 * (p['frac_of_ideal'] or 0):.1f}%)")
        losses = [f"{by[(n, m)]['final_eval_loss']:.4f}" if (n, m) in by else "–" for m in methods]
        out.append(f"| {n} | {first['ideal_tokens_per_s']:,.1f} | " + " | ".join(cells) + " | "
                   + " | ".join(losses) + " |")
    cfg = doc["config"]
    clusters = ", ".join(f"{c['id']} ×{c['slowdown']:.2f} @ {_link(c)}" for c in cfg["clusters"])
    out += ["", f"Clusters in order of joining (slowdown @ link): {clusters}.", ""]
    for name in doc.get("plots", []):
        out.append(f"![{name}]({name})")
    return "\n".join(out) + "\n"
