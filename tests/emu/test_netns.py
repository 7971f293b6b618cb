"""Kernel link shaping (dips.emu.netns): a tbf'd veth between namespaces delivers its rate.

The shaped-link tests need root, `ip`, `tc` and working network namespaces; without them they
are skipped with the reason.  They create their own namespaces (RFC 2544 addresses
198.18.0.0/15 only) and check that none survive.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dips.emu import netns

pytestmark = pytest.mark.timeout(90)

_CAP = netns.probe()
needs_netns = pytest.mark.skipif(_CAP.shaping != "tc-tbf",
                                 reason=f"kernel shaping unavailable here: {_CAP.reason}")

# Receiver: accept one connection, count bytes from the first to the last one received.
_SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5201)); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n = 0; t0 = t1 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t1 = time.monotonic(); t0 = t0 or t1; n += len(b)
print(n, t1 - t0)
"""
_CLIENT = r"""
import socket, sys, time
for _ in range(50):
    try:
        c = socket.create_connection((sys.argv[1], 5201), timeout=10); break
    except OSError:
        time.sleep(0.1)
buf = b"x" * 65536; end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    c.sendall(buf)
c.close()
"""


def _measure_bps(net: netns.ShapedNetwork, sender: str, receiver: str | None, seconds: float) -> float:
    """TCP payload rate (bits/s) from ``sender``'s namespace to ``receiver``'s (None: the hub)."""
    addr = net.hub_addr if receiver is None else net.addr(receiver)
    srv = subprocess.Popen([*net.exec_prefix(receiver), sys.executable, "-c", _SERVER, addr],
                           stdout=subprocess.PIPE, text=True)
    try:
        subprocess.run([*net.exec_prefix(sender), sys.executable, "-c", _CLIENT, addr, str(seconds)],
                       check=True, timeout=seconds + 30)
        out, _ = srv.communicate(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    nbytes, dt = out.split()
    return int(nbytes) * 8 / float(dt)


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
def test_shaped_link_delivers_its_rate_and_changes_at_run_time():
    with netns.ShapedNetwork(["a", "b"], {"a": 80e6, "b": None}) as net:
        prefix = net.prefix
        assert "rate 80Mbit" in net.qdiscs("a")
        up = _measure_bps(net, "a", None, 2.0)  # a's upload: the a-side veth's tbf
        net.set_rate("a", 20e6)
        down = _measure_bps(net, "b", "a", 2.0)  # a's download, across the hub's bridge
        assert net.rate("a") == 20e6
    assert 0.8 * 80e6 <= up <= 1.2 * 80e6, f"80 Mbit link delivered {up / 1e6:.1f} Mbit/s"
    assert 0.8 * 20e6 <= down <= 1.2 * 20e6, f"20 Mbit link delivered {down / 1e6:.1f} Mbit/s"
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
