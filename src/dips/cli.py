"""The ``dips`` command (typer).

* ``dips launch --config FILE --run-dir DIR [--max-time SECONDS] [--max-outer-steps N]``: a
  whole Di-PS run on this machine (leader, followers, clusters as separate processes on
  127.0.0.1); see README.
* ``dips place --bandwidth B.csv --throughput p.csv``: where to put the PS (§10).
* ``dips init --config FILE --out DIR``: the run's certificates (mutual TLS).
* ``dips report RUN_DIR [--out DIR]``: report.html and PNG plots of a run or a comparison.
* ``dips status --leader HOST:PORT [--watch [--every S]] [--json]``: the run as the leader sees it.
* ``dips evaluate --leader HOST:PORT --every N``: held-out loss of every N-th version, reported
  to the leader (its ``eval.jsonl``).
* ``dips leader`` / ``follower`` / ``cluster``: one role on one host (``launch`` starts
  exactly these); see README "Deploy across hosts".
"""

from __future__ import annotations

import inspect
import os

# gRPC's C core logs at INFO to stderr (e.g. "I1202 ... ssl_transport_security.cc] Handshake
# failed") unless told otherwise, and it reads this once, when grpc is first imported: so before
# any import below. Every command says itself what failed; a user's own setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import typer  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Di-PS: asynchronous two-level training across heterogeneous clusters.")

from dips.bench.cli import app as _bench_app  # noqa: E402  (light: typer only)

app.add_typer(_bench_app, name="bench")

from dips.placement_cli import place as _place  # noqa: E402  (light: csv + typer)

app.command("place")(_place)

from dips.pki_cli import init as _init  # noqa: E402

app.command("init")(_init)

from dips.node import cli as _node  # noqa: E402  (light: typer only; roles import lazily)

app.command("leader")(_node.leader)
app.command("follower")(_node.follower)
app.command("cluster")(_node.cluster)
app.command("export")(_node.export)
app.command("evaluate")(_node.evaluate)

from dips.bench.runreport.cli import report as _report  # noqa: E402  (light: matplotlib lazily)

app.command("report")(_report)

from dips.node.status_cli import status as _status  # noqa: E402  (light: typer + rich)

app.command("status")(_status)

from dips.sim.cli import simulate as _simulate  # noqa: E402  (light: typer; the simulator lazily)

app.command("simulate")(_simulate)


@app.command()
def launch(config: Path = typer.Option(..., "--config", exists=True, dir_okay=False,
                                       help="YAML run config, e.g. configs/quickstart.yaml"),
           run_dir: Path = typer.Option(..., "--run-dir", help="Where every output goes."),
           max_time: Optional[float] = typer.Option(None, "--max-time", min=1.0,
                                                    help="Stop after this many seconds of training."),
           max_outer_steps: Optional[int] = typer.Option(
               None, "--max-outer-steps", min=1,
               help="Stop once the leader reports this many outer steps (overrides the "
                    "config's max_outer_steps)."),
           faults: Optional[Path] = typer.Option(None, "--faults", exists=True, dir_okay=False,
                                                 help="YAML fault plan (kill, stop, cut_link).")
           ) -> None:
    """Train with a leader, M followers and N clusters as separate processes on this machine
    (127.0.0.1, or one network namespace per cluster with `network: netns`)."""
    from dips.emu.faults import load_faults
    from dips.emu.launcher import launch as run_launch
    from dips.spec import SpecError, load_config

    try:
        cfg = load_config(config)
        plan = load_faults(faults) if faults else None
    except (SpecError, OSError) as exc:  # one message naming file, line or field; no traceback
        typer.echo(f"invalid config or fault plan: {exc}", err=True)
        raise typer.Exit(2)
    try:
        summary = run_launch(cfg, run_dir.resolve(), max_time, faults=plan,
                             max_outer_steps=max_outer_steps)
    except SpecError as exc:  # the data or model of the config, checked while preparing
        typer.echo(f"dips launch: {exc}", err=True)
        raise typer.Exit(2)
    except (RuntimeError, TimeoutError) as exc:  # a process died or never came up
        typer.echo(f"dips launch: {exc} (summary: {run_dir / 'summary.json'})", err=True)
        raise typer.Exit(1)
    if summary.get("eval_loss_final") is None:
        raise typer.Exit(1)


def _plain_help(typer_app: typer.Typer) -> None:
    """Make every command's help of ``typer_app`` (and of its groups) read as written in its
    docstring (review 15, #12): typer's rich help parses it as rich markup, so ``B[i,·]·p``
    lost its ``[i,·]``, and keeps a docstring's single line breaks in the command list, so a
    summary broke mid-sentence there. The docstring is escaped for markup, and the list
    gets its first paragraph as one line (``short_help``)."""
    from rich.markup import escape

    for info in typer_app.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback is not None else None)
        if doc:
            info.help = escape(inspect.cleandoc(doc))
            info.short_help = escape(" ".join(doc.strip().split("\n\n")[0].split()))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _plain_help(group.typer_instance)


_plain_help(app)


def main() -> None:
    """Entry point of ``dips`` and ``python -m dips.cli``: the process exits within
    :data:`dips.node.common.EXIT_BOUND_S` seconds of its command's end."""
    from dips.node.common import run_bounded

    run_bounded(app)


if __name__ == "__main__":
    main()
