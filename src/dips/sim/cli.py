"""``dips simulate --scenario FILE --out DIR``: a simulated run with modelled costs (issue 16).

Light at import (typer only): the simulator is imported when the command runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

__all__ = ["simulate"]


def simulate(scenario: Path = typer.Option(..., "--scenario", exists=True, dir_okay=False,
                                           help="YAML scenario, e.g. "
                                                "configs/simulate/production-100b.yaml"),
             out: Path = typer.Option(..., "--out", help="Output directory (created)."),
             plots: bool = typer.Option(True, "--plots/--no-plots",
                                        help="Write timeline.png and followers.png.")) -> None:
    """Simulate SCENARIO with the leader's real decision code and modelled costs; write
    simulate.json (and plots) into OUT."""
    from dips.sim import simulate as run
    from dips.spec import SpecError
    from dips.spec.simulate import load_sim_scenario

    try:
        sc = load_sim_scenario(scenario)
    except (SpecError, OSError) as exc:  # one message naming file, line or field
        typer.echo(f"invalid scenario: {exc}", err=True)
        raise typer.Exit(2)
    started = time.perf_counter()
    try:
        doc = run(sc, out, plots=plots)
    except ValueError as exc:
        typer.echo(f"simulate failed: {exc}", err=True)
        raise typer.Exit(1)
    wall = time.perf_counter() - started
    f, lead, ov = doc["followers_summary"], doc["leader"], doc["overhead"]
    typer.echo(f"{doc['scenario']}: {doc['simulated_s'] / 86400:.2f} simulated days in "
               f"{wall:.1f} s ({doc['finished']}); {doc['rounds']['outer_steps']} outer steps")
    typer.echo(f"  added time per cluster: max {_pct(ov['added_time_frac_max'], 2)}  "
               f"follower idle: min {_pct(f['idle_frac_min'], 1)}  "
               f"follower link peak: {f['link_peak_bps'] / 1e9:.4g} of "
               f"{f['nic_bps'] / 1e9:g} Gbit/s")
    if ov["clusters_without_push"]:
        idle = ov["clusters_without_push"]
        typer.echo(f"  {len(idle)} of {len(doc['clusters'])} clusters never pushed (down, "
                   f"joining or starved: no added time to count): {', '.join(idle[:8])}"
                   f"{' ...' if len(idle) > 8 else ''}")
    if not doc["rounds"]["outer_steps"]:
        typer.echo("  no outer step kept: the global model did not move (the figures above "
                   "are about time, not progress)")
    if not doc["horizon"]["answers"]:
        typer.echo(f"  NOT ANSWERED: {doc['horizon']['why']}; the overhead, staleness and "
                   "leader figures are of the start only: give a longer horizon_s")
    stale = doc["staleness"]["mean"]
    typer.echo(f"  leader: {lead['msg_rate_avg']:.2f} msg/s average, {lead['msg_rate_peak']} "
               f"peak; staleness mean {'n/a (no push)' if stale is None else stale}; rejected "
               f"{doc['pushes']['rejected']} of {doc['pushes']['decided']} pushes")
    ref = doc.get("reference")
    if ref:
        typer.echo(f"  against {ref['source']}:")
    for name, fig in (ref or {}).get("figures", {}).items():
        if fig["simulated"] is None or fig["ratio"] is None:
            typer.echo(f"    {name}: n/a (nothing to measure) / {fig['paper']:.4g}")
            continue
        typer.echo(f"    {name}: {fig['simulated']:.4g} / {fig['paper']:.4g} = {fig['ratio']:.3f} "
                   f"({'within' if fig['within'] else 'outside'} ±{100 * ref['tolerance']:.0f}%)")
    typer.echo(f"wrote {out / 'simulate.json'}" + (f" and {', '.join(doc['plots'])}"
                                                    if doc.get("plots") else ""))


def _pct(frac: float | None, digits: int) -> str:
    """A fraction as a percentage; "n/a (no push)" where nothing was measured (a horizon
    shorter than the first pull: review 29 of issue 16)."""
    return "n/a (no push)" if frac is None else f"{100 * frac:.{digits}f}%"
