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
