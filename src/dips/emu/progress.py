"""Live progress of a launched run (rich): per cluster and for the global model."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dips.spec import RunConfig


class Progress:
    """Renders the leader's status: per cluster its inner step, tokens, last loss and last
    push result; the global version, outer steps and accepted/rejected counts."""

    def __init__(self, cfg: RunConfig, console: Console) -> None:
        self.cfg = cfg
        self.console = console
        self._slow = {c.id: c.slowdown for c in cfg.clusters}
        self._stages = {c.id: c.stages for c in cfg.clusters}

    def live(self) -> "Live | _Lines":
        """A rich Live context on a terminal; otherwise (logs, CI) a context that prints the
        global line and the table every ``interval_s`` = 10 s instead of redrawing."""
        if self.console.is_terminal:
            return Live(Text("starting clusters..."), console=self.console, refresh_per_second=2,
                        transient=False, redirect_stdout=False)
        return _Lines(self.console, 10.0)

    def render(self, status: Any, elapsed_s: float) -> Group:
        head = Text.assemble(
            ("global ", "bold"), f"version {status.version}  outer steps {status.outer_steps}  ",
            f"rounds {status.rounds}  pushed {status.updates_pushed}  ",
            ("accepted ", "green"), f"{status.updates_accepted}  ",
            ("rejected ", "red"), f"{status.updates_rejected}  phase {status.phase}  ",
            f"tokens accepted {status.tokens_accepted:,}/{self.cfg.token_budget:,}  "
            f"{elapsed_s:.0f} s")
        table = Table(show_edge=False, pad_edge=False)
        for col in ("cluster", "slowdown", "stages", "inner step", "tokens", "last loss",
                    "last push", "pulled version"):
            table.add_column(col, justify="right")
        for c in sorted(status.clusters, key=lambda c: c.cluster_id):
            loss = "-" if math.isnan(c.last_loss) else f"{c.last_loss:.3f}"
            push = {"accepted": "[green]accepted[/]", "rejected": "[red]rejected[/]"}.get(
                c.last_push, c.last_push)
            table.add_row(c.cluster_id, f"{self._slow.get(c.cluster_id, 1.0):.2f}",
                          str(self._stages.get(c.cluster_id, 1)), str(c.inner_step),
                          f"{c.tokens:,}", loss, push, str(c.pulled_version))
        return Group(head, table)


class _Lines:
    """Non-terminal stand-in for rich Live: print the latest renderable every interval_s."""

    def __init__(self, console: Console, interval_s: float) -> None:
        self.console = console
        self.interval_s = interval_s
        self._last = -interval_s
        self._latest: Any = None

    def __enter__(self) -> "_Lines":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._latest is not None:
            self.console.print(self._latest)

    def update(self, renderable: Any) -> None:
        import time

        self._latest = renderable
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self.console.print(renderable)
            self._latest = None
