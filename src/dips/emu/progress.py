"""Progress of a launched run: a live rich table on a terminal, one line per event in a log.

On a terminal (``console.is_terminal``) the launcher redraws a table (per cluster and for the
global model) in place. Anywhere else (stdout redirected to a file, CI) it never prints a
table: it writes one line per outer step and one per fault event, read from the run
directory's own records (``outer_steps.jsonl``, ``leader_events.jsonl``, ``events.jsonl``), so
a weeks-long run's log grows with what happened, not with the time it ran. Fault events are
printed on a terminal too, above the table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Self

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dips.algo.faultlog import reason_class
from dips.spec import RunConfig
from dips.wire.ratelog import printable

# Leader events (leader_events.jsonl) that are faults or recoveries (also: a cluster's re-join,
# a follower's restart, a reconciliation that changed or lost versions; not a graceful leave).
LEADER_FAULTS = {"cluster_removed", "follower_down", "reconcile_failed", "leader_resumed",
                 "leader_stepped_down"}
# Launcher events (events.jsonl) that are not faults: starts, the final stops, the stop itself.
LAUNCHER_QUIET = {"start", "stop", "stopped", "network", "interrupt"}


class Progress:
    """Shows the leader's status: per cluster its inner step, tokens, last loss and last push
    result; the global version, outer steps and accepted/rejected counts.

    ``run_dir``: the run directory whose records :meth:`log` reads (None: no lines);
    ``t0``: wall-clock time (``time.time()``, seconds) training started, the origin of every
    line's elapsed seconds."""

    def __init__(self, cfg: RunConfig, console: Console, run_dir: Path | None = None,
                 t0: float = 0.0) -> None:
        self.cfg = cfg
        self.console = console
        self._slow = {c.id: c.slowdown for c in cfg.clusters}
        self._stages = {c.id: c.stages for c in cfg.clusters}
        self.run_dir = run_dir
        self.t0 = t0
        names = ("outer_steps.jsonl", "leader_events.jsonl", "events.jsonl", "eval.jsonl")
        self._tails = {n: _Tail(run_dir / n) for n in names} if run_dir is not None else {}
        self._tokens: dict[int, int] = {}  # version -> tokens accepted into it (the ledger's)
        self._loss: dict[str, float] = {}  # cluster -> its last training loss (nats/token)
        self._alike: str | None = None  # what the last printed round that applied nothing said
        self._alike_rounds: list[tuple[float, Any]] = []  # (time, round) left out since
        self._down: dict[Any, float] = {}  # follower -> when it went down (epoch s)

    def live(self) -> Live | _Quiet:
        """A rich Live context on a terminal; otherwise a context that draws nothing (the
        lines of :meth:`log` tell the run) and announces the run in one line."""
        if self.console.is_terminal:
            return Live(Text("starting clusters..."), console=self.console, refresh_per_second=2,
                        transient=False, redirect_stdout=False)
        clusters = ", ".join(
            f"{c.id} (x{c.slowdown:.2f}{f', {c.stages} stages' if c.stages > 1 else ''})"
            for c in self.cfg.clusters)
        self._say(f"training: clusters {clusters}; {self.cfg.followers} followers; token "
                  f"budget {self.cfg.token_budget:,}; one line per outer step and per fault")
        return _Quiet()

    def log(self, status: Any = None, final: bool = False) -> None:
        """Print what the run recorded since the last call, in time order: off a terminal one
        line per decided round (:func:`step_line`; rounds alike that applied nothing counted
        in one line), on both one line per fault event (:func:`event_line`) and per held-out
        evaluation (:func:`heldout_line`). ``status``: the leader's latest ``StatusReply``, or
        None (its clusters' last training losses go into the step lines). ``final``: the run's last call,
        which also counts the rounds left out as alike since the last line."""
        for c in status.clusters if status is not None else []:
            if not math.isnan(c.last_loss):
                self._loss[c.cluster_id] = c.last_loss
        if not self._tails:
            return
        steps = not self.console.is_terminal
        lines: list[tuple[float, str]] = []
        for rec in self._tails["outer_steps.jsonl"].new():
            for t, line in self._outer(rec):
                if steps or "event" in rec:
                    lines.append((t, line))
        for rec in self._tails["leader_events.jsonl"].new():
            if (line := self._leader_line(rec)) is not None:
                lines.append((rec.get("time", 0.0), line))
        for rec in self._tails["events.jsonl"].new():
            if rec.get("event") not in LAUNCHER_QUIET:
                lines.append((rec.get("time", 0.0), event_line(rec, self.t0)))
        for rec in self._tails["eval.jsonl"].new():  # the evaluator's reports (issue 15)
            lines.append((rec.get("time", 0.0), heldout_line(rec, self.t0)))
        if final and steps:
            lines += self._alike_line()
        for _, line in sorted(lines, key=lambda tl: tl[0]):  # stable: in time order
            self._say(line)

    def _outer(self, rec: dict[str, Any]) -> list[tuple[float, str]]:
        """The lines of one ``outer_steps.jsonl`` record, (time, line) each, keeping the
        tokens accepted per version (a rollback takes its versions' tokens back). A round
        that applied nothing, alike the one before it (the same error, the same rejections
        by reason: a follower down fails round after round), is not printed; the next line
        that differs comes after one line counting them (:meth:`_alike_line`)."""
        kind = rec.get("event")
        t = rec.get("time", 0.0)
        if kind is None:
            accepted = rec.get("accepted") or []
            if accepted:
                self._tokens[rec["version"]] = sum(rec.get("tokens", {}).get(c, 0)
                                                   for c in accepted)
            losses = [self._loss[c] for c in accepted if c in self._loss]
            line = step_line(rec, sum(self._tokens.values()), self.cfg.token_budget,
                             sum(losses) / len(losses) if losses else None, self.t0)
            alike = None if accepted else _nothing_applied(rec)
            if alike is not None and alike == self._alike:
                self._alike_rounds.append((t, rec.get("round")))
                return []
            out = self._alike_line()
            self._alike = alike
            return [*out, (t, line)]
        if kind == "rollback":
            for v in [v for v in self._tokens if v > rec.get("version", 0)]:
                del self._tokens[v]
            return [(t, event_line(rec, self.t0, "leader"))]
        if kind == "round_end" and rec.get("commit_failed"):
            return [(t, event_line({"time": rec.get("time", self.t0), "event": "commit_failed",
                                    "round": rec.get("round"), "version": rec.get("version"),
                                    "followers": rec["commit_failed"]}, self.t0, "leader"))]
        return []

    def _alike_line(self) -> list[tuple[float, str]]:
        """The line counting the rounds left out as alike since the last printed (none if
        none were), at the last one's time."""
        rounds, self._alike_rounds = self._alike_rounds, []
        if not rounds:
            return []
        t = rounds[-1][0]
        return [(t, f"{_stamp({'time': t}, self.t0)} rounds {rounds[0][1]}-{rounds[-1][1]}: "
                    f"{len(rounds)} more alike ({self._alike})")]

    def _leader_line(self, rec: dict[str, Any]) -> str | None:
        """The line of a ``leader_events.jsonl`` record, or None: faults and recoveries
        (:func:`_leader_fault`); a follower's ``follower_down`` once while it stays down, and
        one ``follower_up`` line when it serves again, with how long it was down."""
        kind, who = rec.get("event"), rec.get("follower")
        if kind == "follower_down":
            if who in self._down:
                return None
            self._down[who] = float(rec.get("time", self.t0))
        elif kind == "follower_up" and who in self._down:
            down_s = float(rec.get("time", self.t0)) - self._down.pop(who)
            return (f"{_stamp(rec, self.t0)} follower_up: leader follower={who} serving again "
                    f"after {down_s:.0f} s down")
        return event_line(rec, self.t0, "leader") if _leader_fault(rec) else None

    def _say(self, line: str) -> None:
        # Lines quote members' text (a rejected push's reason): printable, never markup.
        self.console.print(printable(line), soft_wrap=True, markup=False, highlight=False)

    def render(self, status: Any, elapsed_s: float) -> Group:
        """The live table of ``status`` (the leader's ``StatusReply``) after ``elapsed_s``
        seconds of training."""
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
            push = Text(printable(c.last_push), style={"accepted": "green",
                                                       "rejected": "red"}.get(c.last_push, ""))
            table.add_row(Text(printable(c.cluster_id)), f"{self._slow.get(c.cluster_id, 1.0):.2f}",
                          str(self._stages.get(c.cluster_id, 1)), str(c.inner_step),
                          f"{c.tokens:,}", loss, push, str(c.pulled_version))
        return Group(head, table)


def _leader_fault(rec: dict[str, Any]) -> bool:
    """Whether a ``leader_events.jsonl`` record is a fault or a recovery worth a line."""
    kind = rec.get("event")
    return (kind in LEADER_FAULTS or (kind == "cluster_joined" and bool(rec.get("rejoin")))
            or (kind == "follower_up" and bool(rec.get("restarted")))
            or (kind == "reconciled" and bool(rec.get("lost") or rec.get("changed"))))


def _nothing_applied(rec: dict[str, Any]) -> str:
    """What a round that applied nothing said, without its round number and time: its error
    and its rejections by reason (two rounds alike say the same)."""
    error = f" ({_clip(str(rec['error']))})" if rec.get("error") else ""
    rejected = f"; rejected {rejected_text(rec['rejected'])}" if rec.get("rejected") else ""
    return f"nothing applied{error}{rejected}"


def _stamp(rec: dict[str, Any], t0: float) -> str:
    return f"[{max(0.0, rec.get('time', t0) - t0):6.0f} s]"


def rejected_text(rejected: dict[str, Any]) -> str:
    """A round's rejected pushes grouped by their typed reason (the record's ``code``,
    :func:`dips.algo.faultlog.reason_class`): ``b (penalty)``, ``a, c (followers_not_ready:
    follower 1 down)``. A group's free text is shown once, and only when every push of the
    group has the same one (the same gRPC error of every cluster is one text, not one each)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for c, why in rejected.items():
        text = str(why.get("reason", "") if isinstance(why, dict) else why)
        groups.setdefault(reason_class(why), []).append((str(c), text))
    parts = []
    for code, items in groups.items():
        texts = {t for _, t in items}
        detail = texts.pop() if len(texts) == 1 else ""
        shown = f"{code}: {_clip(detail)}" if detail and detail != code else code
        parts.append(f"{', '.join(c for c, _ in items)} ({shown})")
    return "; ".join(parts)


def _clip(text: str, n: int = 120) -> str:
    return text if len(text) <= n else text[:n] + "…"


def step_line(rec: dict[str, Any], tokens: int, budget: int, loss: float | None,
              t0: float) -> str:
    """One decided round of ``outer_steps.jsonl`` as a line: seconds since ``t0`` (wall
    clock), the version it made (or that nothing was applied), the accepted clusters, the
    rejected ones by reason (:func:`rejected_text`), the accepted clusters' mean last
    training ``loss`` (nats/token; omitted when None), and ``tokens`` accepted so far of the
    ``budget``; the pushes withdrawn by clusters that left the run."""
    rejected = f"; rejected {rejected_text(rec['rejected'])}" if rec.get("rejected") else ""
    if rec.get("withdrawn"):  # they left the run: not rejected (dips.roles.outer_log)
        rejected += f"; withdrawn {', '.join(map(str, rec['withdrawn']))} (left the run)"
    if rec.get("accepted"):
        what = f"outer step v{rec['version']} (round {rec['round']}): accepted " + \
            ", ".join(rec["accepted"])
    else:
        what = f"round {rec['round']}: nothing applied" + (
            f" ({_clip(str(rec['error']))})" if rec.get("error") else "")
    loss_s = f"; train loss {loss:.3f}" if loss is not None else ""
    return f"{_stamp(rec, t0)} {what}{rejected}{loss_s}; tokens {tokens:,}/{_short(budget)}"


def _short(n: int) -> str:
    """A token budget as few characters say it exactly (20M, 2.5M, 300k, 1,234): one line per
    outer step repeats it, and a weeks-long run's log grows with those lines."""
    for div, unit in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= div and n % (div // 100) == 0:
            return f"{n / div:g}{unit}"
    return f"{n:,}"


def heldout_line(rec: dict[str, Any], t0: float) -> str:
    """One held-out evaluation of the leader's ``eval.jsonl`` as a line: seconds since ``t0``,
    the version, its loss (nats/token) and perplexity, the tokens accepted into it."""
    ppl = rec.get("perplexity")
    tokens = rec.get("tokens_accepted")
    return (f"{_stamp(rec, t0)} held-out loss v{rec.get('version')}: "
            f"{rec.get('eval_loss', math.nan):.3f} (perplexity "
            f"{'-' if ppl is None else f'{ppl:,.1f}'})"
            f"{'' if tokens is None else f'; tokens {tokens:,}'}")


#: Fields an event line leaves out: its stamp says the time; a pid or an epoch second says
#: nothing an operator reads (they stay in events.jsonl).
_UNSAID = ("time", "event", "process", "pid", "fired_at")


def event_line(rec: dict[str, Any], t0: float, source: str | None = None) -> str:
    """One fault event as a line: seconds since ``t0`` (wall clock), its kind, the process
    (or ``source``), then its other fields as ``key=value``."""
    who = rec.get("process", source or "")
    rest = " ".join(f"{k}={_clip(str(v))}" for k, v in rec.items()
                    if k not in _UNSAID and v not in (None, ""))
    return f"{_stamp(rec, t0)} {rec.get('event')}: {who} {rest}".rstrip()


class _Tail:
    """The complete lines a JSONL file gained since the last :meth:`new` (another process may
    be appending; a half-written last line waits for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


class _Quiet:
    """Non-terminal stand-in for rich Live: draws nothing (the log gets lines instead)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, renderable: Any) -> None:
        """Ignore ``renderable``: off a terminal no table is drawn."""


def summary_table(summary: dict[str, Any]) -> str:
    """The launcher's last lines: the key figures of ``summary.json``. Numbers are rounded
    here, for display only (losses to 4 decimals, seconds to 0.1 s); the file keeps them
    whole (review of issue 15, #9)."""
    keys = ["outer_steps", "updates_pushed", "updates_rejected", "tokens_consumed",
            "tokens_accepted", "eval_loss_initial", "eval_loss_final", "train_time_s",
            "shutdown_s", "final_eval_s", "wall_time_s", "tokens_per_s"]
    lines = [f"  {k:<18} {_shown(k, summary.get(k))}" for k in keys if k in summary]
    return "summary (" + str(summary.get("run_dir")) + "/summary.json):\n" + "\n".join(lines)


def _shown(key: str, v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.4f}" if key.startswith("eval_loss") else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
