"""Review 21, F4: a member's ``PushDone.error`` became a fault's detail that ``dips status``
handed to rich as markup (``[/x]``: MarkupError for the hour of the fault window) and whose
terminal escapes reached the operator's screen. The review's inputs go through the leader's
servicer (a real leader, a fake follower, the test's clock), then ``GetStatus``, the snapshot
and the screen; and straight into the renderers, as an older leader would send them."""

from __future__ import annotations

import threading
import time

import pytest
from rich.console import Console

from dips.emu.progress import Progress
from dips.node.status import snapshot
from dips.node.status_cli import render
from dips.spec import RunConfig
from dips.wire.pb import control_pb2 as pb
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import ManualClock, make_leader
from tests.servicer_context import FakeContext

pytestmark = pytest.mark.timeout(120)

MARKUP = "[/x] push failed: link reset"
ESCAPES = "\x1b]0;owned\x07\x1b[2J[link=https://evil.example]re-login[/link]"


def screen(doc: dict) -> str:
    console = Console(record=True, width=300, color_system=None)
    console.print(render(doc))
    return console.export_text()


@pytest.mark.parametrize("error", [MARKUP, ESCAPES])
def test_a_members_error_text_reaches_the_screen_as_plain_text(tmp_path, error):
    clock = ManualClock()
    leader, _ = make_leader(tmp_path, clock=clock, window_s=1.0)
    servicer = LeaderServicer(leader, None)
    me = FakeContext("cluster-c", time_left_s=30.0)
    try:
        servicer.JoinCluster(pb.JoinRequest(stages=[pb.StageLayers(layers=["l0", "l1"])]), me)
        chunk = servicer.Lease(pb.LeaseRequest(n=1), me).holdings[0]
        grant = servicer.RequestPush(pb.PushRequest(base_version=0, tokens=64, progress=[
            pb.ChunkPos(chunk=chunk.chunk, position=chunk.position + 1)]), me)
        clock.advance(1.0)  # the window closes
        verdict: list = []
        done = threading.Thread(target=lambda: verdict.append(servicer.PushDone(
            pb.PushDoneRequest(push_id=grant.push_id, ok=False, error=error), me)), daemon=True)
        done.start()
        done.join(60)
        assert verdict and not verdict[0].accepted
        reply = servicer.GetStatus(pb.StatusRequest(), FakeContext("admin"))
        detail = next(f.detail for f in reply.faults if f.member == "cluster-c")
        assert "\x1b" not in detail and "\x07" not in detail  # sanitised at the boundary
        stored = (tmp_path / "outer_steps.jsonl").read_text()
        assert "\\u001b" not in stored and "\x1b" not in stored
        text = screen(snapshot(reply, "l:1", time.time()))  # no MarkupError
        assert ("[/x] push failed" if error == MARKUP else "[link=https://evil.example]") in text
        assert "\x1b" not in text and "\x07" not in text
    finally:
        leader.stop()


def doc_with(text: str) -> dict:
    """A snapshot as an older leader (one that did not sanitise) would give it."""
    return {"leader": "l:1", "version": 1, "outer_steps": 1, "rounds": 1, "phase": text,
            "finished": False, "finished_reason": "", "followers_ready": 1,
            "followers_total": 1, "time": 100.0,
            "counts": {k: 0 for k in ("updates_pushed", "updates_accepted", "updates_rejected",
                                      "tokens_pushed", "tokens_accepted", "outer_steps_lost")},
            "ledger": {"epoch": 0}, "heldout": None,
            "clusters": [{"cluster_id": "c", "inner_step": 1, "tokens": 1, "last_loss": None,
                          "last_push": text, "pulled_version": 0, "staleness": 0,
                          "heartbeat_age_s": 0.5}],
            "followers": [{"index": 0, "up": True, "version": 1, "heartbeat_age_s": 0.5,
                           "incarnation": 1, "control_endpoint": text, "data_endpoint": text,
                           "layers": 2}],
            "fault_window_s": 3600.0,
            "faults": [{"time": 99.0, "kind": "push_rejected", "member": text, "reason": text,
                        "detail": text}],
            "fault_counts": [{"kind": "push_rejected", "reason": text, "count": 1}],
            "conditions": [{"kind": "rejected", "member": text, "detail": text, "since": 99.0,
                            "last": 99.0, "active": True}]}


@pytest.mark.parametrize("text", [MARKUP, ESCAPES])
def test_every_cell_of_the_screen_is_text_not_markup(text):
    shown = screen(doc_with(text))
    literal = "[/x]" if text == MARKUP else "[link=https://evil.example]re-login[/link]"
    assert shown.count(literal) >= 9  # every cell that held it (the phase too) shows it as written
    assert "\x1b" not in shown and "\x07" not in shown


def test_the_launchers_lines_and_table_show_member_text_plainly():
    console = Console(record=True, width=300, color_system=None)
    progress = Progress(RunConfig(), console)
    progress._say(f"[  12 s] round 3: rejected c ({ESCAPES})")
    status = pb.StatusReply(clusters=[pb.ClusterStatus(cluster_id="c", last_push=MARKUP,
                                                       last_loss=1.0)])
    console.print(progress.render(status, 1.0))  # no MarkupError
    out = console.export_text()
    assert "\x1b" not in out and "\x07" not in out and "[link=https://evil.example]" in out
    assert "[/x] push failed" in out
