"""``dips bench``: comparisons against the baselines (seed §4, §13–§15, §18).

* ``dips bench compare --scenario FILE --out DIR``: runs every method of the scenario (Di-PS,
  its ablations, data parallel, synchronous DiLoCo, naive async DiLoCo) on the same model, data
  and token budget, in virtual or real time, and writes ``compare.json``, ``compare.md`` and
  PNG plots into DIR.  A ``kind: weak-scaling`` scenario runs them on 1 … n clusters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Benchmarks: Di-PS against data parallel, DiLoCo and async DiLoCo.")


@app.command()
def compare(scenario: Path = typer.Option(..., "--scenario", exists=True, dir_okay=False,
                                          help="YAML scenario, e.g. configs/compare/eta100.yaml"),
            out: Path = typer.Option(..., "--out", help="Output directory (created)."),
            methods: str = typer.Option("", "--methods",
                                        help="Comma-separated subset of the scenario's methods.")
            ) -> None:
    """Run each method of SCENARIO; write compare.json, compare.md and plots into OUT."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from dips.bench.compare import run_compare, run_weak_scaling
    from dips.emu.result import MethodResult
    from dips.emu import vworld
    from dips.spec import SpecError, load_scenario, validate

    console = Console(stderr=True)
    try:
        sc = load_scenario(scenario)
        if methods:
            data = {**sc.model_dump(), "methods": [m.strip() for m in methods.split(",")]}
            sc = validate(type(sc), data, f"{scenario} (--methods {methods})")
    except (SpecError, OSError) as exc:  # one message naming file, line or field; no traceback
        typer.echo(f"invalid scenario: {exc}", err=True)
        raise typer.Exit(2)
    with Progress(TextColumn("{task.description:<28}"), BarColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                  console=console) as progress:
        task = {"id": None}

        def report(label: str, event: str, payload: Any) -> None:
            if event == "start":
                task["id"] = progress.add_task(label, total=1.0, status="")
            elif event == "done":
                r: MethodResult = payload
                progress.update(task["id"], completed=1.0,
                                status=f"{r.tokens_per_s:,.0f} tok/s  loss {r.final_eval_loss:.4f}")

        def on_eval(tokens: int, budget: int, loss: float) -> None:
            if task["id"] is not None:
                progress.update(task["id"], completed=min(1.0, tokens / budget),
                                status=f"{tokens:,} tokens  loss {loss:.4f}")

        vworld.PROGRESS = on_eval
        try:
            run = run_weak_scaling if sc.kind == "weak-scaling" else run_compare
            doc = run(sc, out, report)
        except (RuntimeError, ValueError) as exc:
            console.print(f"[red]compare failed:[/red] {exc}")
            raise typer.Exit(1)
        finally:
            vworld.PROGRESS = None
    console.print(f"wrote {out / 'compare.json'}, {out / 'compare.md'} and "
                  f"{', '.join(doc.get('plots', []))}")
    typer.echo((out / "compare.md").read_text())
