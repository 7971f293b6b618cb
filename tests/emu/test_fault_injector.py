"""The fault injector's dispatch (the kernel link cut itself is tests/integration/
test_multihost.py's): a cut_link in network namespaces takes the cluster's veth down and up
again after its duration; without namespaces it writes the failpoint the cluster reads."""

from __future__ import annotations

from dips.emu.faults import Fault, FaultInjector, FaultPlan


class FakeNet:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def set_link(self, cluster: str, up: bool) -> None:
        self.calls.append((cluster, up))


def _run(tmp_path, net):
    events = []
    plan = FaultPlan(faults=[Fault(at_s=2.0, action="cut_link", target="cluster-a", duration_s=3.0)])
    inj = FaultInjector(plan, lambda name: None, tmp_path / "fp",
                        lambda kind, proc, **kw: events.append((kind, proc, kw)), net)
    for t in (1.0, 2.0, 4.9):
        inj.tick(t)
    marker = (tmp_path / "fp" / "cluster-a.link_down").exists()
    inj.tick(5.0)
    return events, marker, (tmp_path / "fp" / "cluster-a.link_down").exists()


def test_a_cut_link_in_namespaces_takes_the_veth_down_then_up(tmp_path):
    net = FakeNet()
    events, marker, after = _run(tmp_path, net)
    assert net.calls == [("a", False), ("a", True)]
    assert not marker and not after
    assert [(k, kw.get("how")) for k, _, kw in events] == [("fault", "netns"), ("fault_cleared", None)]


def test_a_cut_link_on_loopback_is_a_failpoint(tmp_path):
    events, marker, after = _run(tmp_path, None)
    assert marker and not after
    assert events[0][2]["how"] == "failpoint"


def test_a_phase_fault_is_recorded_with_the_time_the_process_wrote(tmp_path):
    """The marker is read only once whole: an empty one (seen between its creation and its
    write) once made the launcher record its own later time, after the restart it caused,
    and a test waiting for "a restart after the fault" never saw one (fresh-clone check,
    2026-12-04)."""
    events = []
    plan = FaultPlan(faults=[Fault(after_s=1.0, phase="pull", action="kill", target="follower-1")])
    inj = FaultInjector(plan, lambda name: 123, tmp_path / "fp",
                        lambda kind, proc, **kw: events.append((kind, proc, kw)))
    inj.tick(1.0)
    assert (tmp_path / "fp" / "follower-1.pull").exists()
    marker = tmp_path / "fp" / "follower-1.pull.fired"
    marker.write_text("")
    inj.tick(2.0)
    assert [k for k, _, _ in events] == ["fault_armed"]
    marker.write_text("1234.5")
    inj.tick(3.0)
    assert events[-1] == ("fault", "follower-1", {"action": "kill", "phase": "pull",
                                                  "fired_at": 1234.5})


def test_a_failpoint_writes_its_marker_whole(tmp_path, monkeypatch):
    from dips.roles import failpoints

    kills = []
    monkeypatch.setattr(failpoints, "_DIR", str(tmp_path))
    monkeypatch.setattr(failpoints, "_NAME", "follower-1")
    monkeypatch.setattr(failpoints.os, "kill", lambda pid, sig: kills.append(sig))
    (tmp_path / "follower-1.push").write_text("armed")
    failpoints.hit("push")
    assert float((tmp_path / "follower-1.push.fired").read_text()) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["follower-1.push.fired"]
    assert len(kills) == 1
