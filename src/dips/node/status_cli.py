"""The ``dips status`` command: asks the leader for its status (:mod:`dips.node.status`) and
shows it as one rich screen, redrawn in place with ``--watch``, or as JSON with ``--json``.

Exit codes: 0 shown (or ``--watch`` stopped with Ctrl-C), 1 the leader did not answer or
refused this identity, 2 bad options or credentials (the message names the option).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dips.node.status import QUIET_AFTER_S, Faults, snapshot, unreachable
from dips.wire.ratelog import printable

_PUSH_STYLE = {"accepted": "green", "rejected": "red"}


class NoStatus(RuntimeError):
    """The leader did not answer ``GetStatus`` or refused it; the message says which and why.
    ``wrong_option``: no retry can help, ``--leader`` or ``--tls`` is wrong (exit 2): the
    address is not the leader's (another role's port) or its certificate is not of this
    bundle's CA (:func:`dips.wire.not_leader.wrong_leader`)."""

    def __init__(self, message: str, wrong_option: bool = False) -> None:
        super().__init__(message)
        self.wrong_option = wrong_option


def _ago(now: float, then: float) -> str:
    s = max(0.0, now - then)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago"


def _t(v: Any, style: str = "") -> Text:
    """``v`` as a table cell or line part: printable text, never markup (the leader's answer
    holds members' text: ``[/x]`` crashed rich's markup parser; review 21, F4)."""
    return Text(printable(str(v)), style=style)


def _num(v: Any, fmt: str = "{:,}") -> str:
    return "-" if v is None else fmt.format(v)


def _hb(age: float | None) -> str:
    """A heartbeat age (seconds) as shown: "-" unknown (an older leader)."""
    if age is None:
        return "-"
    return f"{age:.1f} s" if age < 120 else f"{age / 60:.0f} min"


def render(doc: dict[str, Any], error: str = "") -> Group:
    """One screen of ``doc`` (a :func:`dips.node.status.snapshot` with its faults); ``error``:
    why the latest look failed (the screen then shows the last answer under it)."""
    n = doc["counts"]
    state = (_t(f"finished: {doc['finished_reason']}", "bold yellow") if doc["finished"]
             else Text("running", style="bold green"))
    head = Text.assemble(
        ("leader ", "bold"), f"{printable(doc['leader'])}  version {doc['version']}  outer steps "
        f"{doc['outer_steps']}  rounds {doc['rounds']}  phase {printable(str(doc['phase']))}  ", state)
    counts = Text.assemble(
        f"pushed {n['updates_pushed']}  ", ("accepted ", "green"), f"{n['updates_accepted']}  ",
        ("rejected ", "red"), f"{n['updates_rejected']}  tokens accepted "
        f"{n['tokens_accepted']:,} of {n['tokens_pushed']:,} pushed  outer steps lost "
        f"{n['outer_steps_lost']}  ledger epoch {doc['ledger']['epoch']}")
    clusters = Table(title=f"clusters ({len(doc['clusters'])})", show_edge=False, pad_edge=False)
    for col in ("cluster", "inner step", "tokens trained", "tokens accepted", "tokens pushed",
                "last loss", "last push", "pulled version", "staleness", "heartbeat"):
        clusters.add_column(col, justify="left" if col == "cluster" else "right")
    for c in doc["clusters"]:
        push = _t(c["last_push"], _PUSH_STYLE.get(c["last_push"], ""))
        clusters.add_row(_t(c["cluster_id"]), _num(c["inner_step"]),
                         _num(c.get("tokens_trained", c["tokens"])),
                         _num(c.get("tokens_accepted")), _num(c.get("tokens_pushed")),
                         _num(c["last_loss"], "{:.3f}"), push, _num(c["pulled_version"], "{}"),
                         _num(c["staleness"], "{}"), _hb(c.get("heartbeat_age_s")))
    followers = Table(title=f"followers ({doc['followers_ready']} of {doc['followers_total']} "
                            "ready)", show_edge=False, pad_edge=False)
    for col in ("follower", "up", "version", "heartbeat", "incarnation", "control", "data",
                "layers"):
        followers.add_column(col, justify="right" if col in (
            "version", "heartbeat", "incarnation", "layers") else "left")
    up = {True: Text("yes", style="green"), False: Text("no", style="red"), None: Text("?")}
    for f in doc["followers"]:
        if not f.get("registered", True):  # the run's, not registered (yet, or again)
            followers.add_row(str(f["index"]), up[False], "-", "-", "-",
                              Text("not registered", style="red"), "-", "-")
            continue
        followers.add_row(str(f["index"]), up[f["up"]], _num(f["version"], "{}"),
                          _hb(f.get("heartbeat_age_s")), str(f["incarnation"]),
                          _t(f["control_endpoint"]), _t(f["data_endpoint"]), str(f["layers"]))
    parts: list[Any] = [head, counts, _heldout(doc), clusters, followers, _faults(doc),
                        _conditions(doc)]
    if error:
        parts.insert(0, _t(f"no answer: {error} (showing the answer of "
                           f"{_ago(time.time(), doc['time'])})", "bold red"))
    return Group(*parts)


def _heldout(doc: dict[str, Any]) -> Text:
    """The last held-out evaluation (``dips evaluate``), or a dim line saying there is none."""
    h = doc.get("heldout")
    if h is None:
        return Text("held-out loss: none reported (dips evaluate)", style="dim")
    ppl = "-" if h["perplexity"] is None else f"{h['perplexity']:,.1f}"
    return Text.assemble(("held-out loss ", "bold"), f"{h['eval_loss']:.4f} nats/token "
                         f"(perplexity {ppl}) at version {h['version']}, "
                         f"{_num(h['tokens_accepted'])} tokens accepted, "
                         f"{_ago(doc['time'], h['time'])}")


#: Faults listed on the screen (the newest; ``--json`` has all the leader sent).
FAULTS_SHOWN = 12


def _fault_summary(doc: dict[str, Any]) -> str:
    """``3 push_rejected (penalty 2, not_delivered 1), 1 rollback``: the leader's counts."""
    kinds: dict[str, list[tuple[str, int]]] = {}
    for c in doc.get("fault_counts") or []:
        kinds.setdefault(c["kind"], []).append((c["reason"], c["count"]))
    parts = []
    for kind, reasons in kinds.items():
        total = sum(n for _, n in reasons)
        why = ", ".join(f"{r} {n}" for r, n in reasons if r)
        parts.append(f"{total} {kind}" + (f" ({why})" if why else ""))
    return ", ".join(parts)


def _faults(doc: dict[str, Any]) -> Group | Text:
    """The faults the leader recorded in the last hour: the counts, then the newest."""
    if doc.get("fault_window_s") is None:
        return Text("faults: this leader does not report them (an older version)", style="dim")
    window = f"{doc['fault_window_s'] / 60:.0f} min"
    if not doc["faults"]:
        return Text(f"faults in the last {window}: none recorded by the leader", style="dim")
    head = Text.assemble((f"faults in the last {window}: ", "bold red"),
                         printable(_fault_summary(doc)))
    table = Table(show_edge=False, pad_edge=False)
    for col in ("when", "kind", "member", "reason", "detail"):
        table.add_column(col)
    for f in doc["faults"][:FAULTS_SHOWN]:
        table.add_row(_ago(doc["time"], f["time"]), _t(f["kind"], "red"), _t(f["member"]),
                      _t(f["reason"] or "-"), _t(f["detail"]))
    more = len(doc["faults"]) - FAULTS_SHOWN
    return Group(head, table, *([Text(f"... and {more} more (--json)", style="dim")]
                                if more > 0 else []))


def _conditions(doc: dict[str, Any]) -> Table | Text:
    """What successive answers show now (:class:`dips.node.status.Faults`)."""
    if not doc["conditions"]:
        return Text("conditions: none seen", style="dim")
    table = Table(title="conditions (derived from the leader's answers)",
                  show_edge=False, pad_edge=False)
    for col in ("kind", "member", "detail", "since", "now"):
        table.add_column(col)
    for f in doc["conditions"]:
        now = (Text("yes", style="red") if f["active"]
               else Text(f"ended, seen {_ago(doc['time'], f['last'])}", style="dim"))
        table.add_row(_t(f["kind"]), _t(f["member"]), _t(f["detail"]),
                      _ago(doc['time'], f["since"]), now)
    return table


def looker(leader: str, creds: Any, timeout_s: float,
           faults: Faults) -> tuple[Callable[[], dict[str, Any]], Callable[[], None]]:
    """(look, close): ``look()`` calls ``GetStatus`` on ``leader`` (deadline ``timeout_s``
    seconds) and returns its snapshot with ``faults`` updated; raises :class:`NoStatus`."""
    import grpc

    from dips.wire.control import describe
    from dips.wire.not_leader import wrong_leader
    from dips.wire.pb import control_pb2 as pb
    from dips.wire.services import leader_client

    client = leader_client(leader, creds, timeout_s=timeout_s)

    def look() -> dict[str, Any]:
        try:
            reply = client.GetStatus(pb.StatusRequest())
        except grpc.RpcError as exc:
            wrong = wrong_leader(leader, creds, exc, timeout_s)
            if wrong is not None:
                raise NoStatus(wrong.message, wrong_option=True) from None
            hint = ("" if exc.code() == grpc.StatusCode.PERMISSION_DENIED else
                    " (is it running, at this address, with the same --tls/--insecure choice?)")
            raise NoStatus(f"leader {leader} as {creds.identity.name!r}: {describe(exc)}"
                           f"{hint}") from None
        doc = snapshot(reply, leader, time.time())
        faults.update(doc)
        return doc

    return look, client.close


def watch(look: Callable[[], dict[str, Any]], show: Callable[[dict[str, Any] | None, str], None],
          every_s: float, stop: threading.Event) -> None:
    """Call ``look`` every ``every_s`` seconds until ``stop`` is set, handing ``show`` each
    answer (or the last one, None before any, with the error of a failed look)."""
    last: dict[str, Any] | None = None
    while not stop.is_set():
        try:
            last, error = look(), ""
        except NoStatus as exc:
            error = str(exc)
        show(last, error)
        stop.wait(every_s)


def _credentials(tls: Path | None, insecure: bool) -> Any:
    """The operator's credentials: any bundle from ``dips init`` (the leader lets every
    member and ``admin`` read its status), or ``--insecure`` as ``admin``."""
    from dips.node.common import RoleError, credentials
    from dips.wire.pki import Identity
    from dips.wire.security import Credentials

    if tls is not None and not insecure:
        try:
            return Credentials.tls(tls)
        except ValueError as exc:
            raise RoleError(f"--tls {tls}: {exc}") from None
    return credentials(tls, insecure, Identity.admin())


def status(leader: Annotated[str, typer.Option(
               "--leader", help="HOST:PORT of the leader, or unix:PATH of its --status-socket")],
           tls: Annotated[Path | None, typer.Option(
               "--tls", help="a bundle from `dips init`: the operator's is pki/admin")] = None,
           insecure: Annotated[bool, typer.Option(
               "--insecure", help="no TLS (a leader started with --insecure)")] = False,
           keep: Annotated[bool, typer.Option(
               "--watch", help="look again every --every seconds until Ctrl-C: redrawn in "
                          "place on a terminal, each look printed as it comes off one")] = False,
           every: Annotated[float, typer.Option(
               "--every", min=0.2, help="seconds between looks with --watch")] = 2.0,
           as_json: Annotated[bool, typer.Option(
               "--json", help="print one JSON object (one per line with --watch); keys in "
                              "README 'dips status'")] = False,
           timeout: Annotated[float, typer.Option(
               "--timeout", min=0.1, help="seconds one call to the leader may take")] = 5.0,
           quiet_after: Annotated[float, typer.Option(
               "--quiet-after", min=1.0, help="list a cluster as no_progress after this many "
                                              "seconds without a new inner step (--watch)")
           ] = QUIET_AFTER_S,
           ) -> None:
    """The run as the leader sees it: members, versions, staleness, verdicts, phase, faults."""
    from dips.node.common import RoleError, split_address

    try:
        if not leader.startswith("unix:"):
            split_address(leader, "--leader")
        creds = _credentials(tls, insecure)
    except RoleError as exc:
        print(f"dips status: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(2)
    look, close = looker(leader, creds, timeout, Faults(quiet_after))
    console = screen_console()
    try:
        if not keep:
            doc = look()
            if as_json:
                print(json.dumps(doc), flush=True)
            else:
                console.print(render(doc))
        elif as_json:
            watch(look, lambda doc, err: _json_line(leader, doc, err), every, threading.Event())
        elif not console.is_terminal:  # a pipe or a file: each look as it comes, one after another
            watch(look, lambda doc, err: _snapshot(console, doc, err), every, threading.Event())
        else:
            with Live(Text("asking the leader..."), console=console, auto_refresh=False) as live:
                watch(look, lambda doc, err: live.update(
                    render(doc, err) if doc else _t(f"no answer: {err}", "bold red"),
                    refresh=True), every, threading.Event())
    except NoStatus as exc:
        if as_json and not exc.wrong_option:  # a script reads stdout (review 26, M10)
            _json_line(leader, None, str(exc))
        else:
            print(f"dips status: {exc}", file=sys.stderr, flush=True)
        raise typer.Exit(2 if exc.wrong_option else 1)
    except KeyboardInterrupt:
        pass
    finally:
        close()


#: Columns of the screen off a terminal: wide enough for any row of its tables (rich's default
#: of 80 columns there cut them; review 15, #11).
OFF_TERMINAL_WIDTH = 1000


def screen_console() -> Console:
    """The console the screen is drawn on: a terminal's own width; off a terminal (a pipe, a
    file) :data:`OFF_TERMINAL_WIDTH` columns, so each line is printed whole (a table as wide
    as its content, a text line unwrapped), unless ``COLUMNS`` sets the width."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=OFF_TERMINAL_WIDTH)
    return console


def _snapshot(console: Console, doc: dict[str, Any] | None, error: str) -> None:
    """One look of ``--watch`` off a terminal: a line with the local time, then the screen
    (or why there is none yet), flushed at once (review 15, #11: rich's Live printed only at
    the end there)."""
    console.print(Text(f"--- dips status at {time.strftime('%Y-%m-%d %H:%M:%S')} ---",
                       style="dim"))
    console.print(render(doc, error) if doc else Text(f"no answer: {error}", style="bold red"))
    console.file.flush()


def _json_line(leader: str, doc: dict[str, Any] | None, error: str) -> None:
    """One look of ``--watch --json``: the answer's object, or, when the leader did not
    answer, an object saying so (:func:`dips.node.status.unreachable`; review of issue 15,
    #8: nothing was printed while the leader was down), its error on stderr too."""
    if error:
        print(json.dumps(unreachable(leader, error, time.time(), doc)), flush=True)
        print(f"dips status: {error}", file=sys.stderr, flush=True)
    else:
        print(json.dumps(doc), flush=True)
