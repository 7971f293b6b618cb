"""Kernel link shaping (dips.emu.netns): a tbf'd veth between namespaces delivers its rate.

The shaped-link tests need root, `ip`, `tc` and working network namespaces; without them they
are skipped with the reason.  They create their own namespaces (RFC 2544 addresses
198.18.0.0/15 only) and check that none survive.

A shaped link is checked by its qdisc and by what it delivered measured so that load can only
understate it (tests/emu/shaping_bound.py): never more than its rate allows. How near the rate
a busy machine gets is a benchmark (``make bench-shaping``), not a test.
"""

from __future__ import annotations


import pytest

from dips.emu import netns
from tests.emu.shaping_bound import assert_at_most, delivered

pytestmark = pytest.mark.timeout(90)

_CAP = netns.probe()
needs_netns = pytest.mark.skipif(_CAP.shaping != "tc-tbf",
                                 reason=f"kernel shaping unavailable here: {_CAP.reason}")



def test_tbf_params_and_prefix_validation():
    burst, latency = netns.tbf_params(100e6)
    assert burst >= 32768 and latency == 0.05
    assert netns.tbf_params(10e9)[0] == int(10e9 / 8 * 0.005)
    for bad in (0, -1, 1000, float("nan"), True, "1e6"):
        with pytest.raises(ValueError, match="rate_bps"):
            netns.tbf_params(bad)
    assert netns.new_prefix().startswith("dps") and len(netns.new_prefix()) == 9
    with pytest.raises(ValueError, match="prefix"):
        netns.ShapedNetwork(["a"], prefix="eth0")
    with pytest.raises(ValueError, match="unknown clusters"):
        netns.ShapedNetwork(["a"], {"b": 1e6})
    with pytest.raises(ValueError, match="clusters"):
        netns.ShapedNetwork(["a", "a"])


def test_addresses_are_in_the_benchmarking_range():
    net = netns.ShapedNetwork([f"c{i}" for i in range(16)])
    addrs = [net.hub_addr] + [net.addr(f"c{i}") for i in range(16)]
    import ipaddress

    assert all(ipaddress.ip_address(a) in netns.BENCH_NET for a in addrs)
    assert len(set(addrs)) == 17
    assert all(len(net.iface(f"c{i}")) <= 15 for i in range(16))  # IFNAMSIZ


@needs_netns
def test_shaped_link_is_held_to_its_rate_and_changes_at_run_time():
    with netns.ShapedNetwork(["a", "b"], {"a": 80e6, "b": None}) as net:
        prefix = net.prefix
        assert "rate 80Mbit" in net.qdiscs("a")
        up = delivered(net, "a", None, 2.0)  # a's upload: the a-side veth's tbf
        net.set_rate("a", 20e6)
        assert net.rate("a") == 20e6 and "rate 20Mbit" in net.qdiscs("a")
        down = delivered(net, "b", "a", 2.0)  # a's download, across the hub's bridge
    assert_at_most(80e6, netns.tbf_burst(80e6), up, "80 Mbit link (upload)")
    assert_at_most(20e6, netns.tbf_burst(20e6), down, "20 Mbit link (download)")
    assert netns.list_namespaces(prefix) == []


@needs_netns
def test_namespaces_removed_on_exception_and_by_cleanup_stale():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.ShapedNetwork(["a"], {"a": 10e6}) as net:
            prefix = net.prefix
            assert len(netns.list_namespaces(prefix)) == 2
            raise RuntimeError("boom")
    assert netns.list_namespaces(prefix) == []
    leftover = netns.ShapedNetwork(["a", "b"])
    leftover.create()  # as if a run had died before cleaning up
    assert len(netns.list_namespaces(leftover.prefix)) == 3
    assert sorted(netns.cleanup_stale(leftover.prefix)) == sorted(
        [leftover.hub_ns, leftover.ns("a"), leftover.ns("b")])
    assert netns.list_namespaces(leftover.prefix) == []


@needs_netns
def test_probe_reports_kernel_shaping():
    cap = netns.probe()
    assert cap.root and cap.ip and cap.tc and cap.netns and cap.tbf
    assert cap.shaping == "tc-tbf" and cap.reason == "ok"
