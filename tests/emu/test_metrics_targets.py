"""``RUN_DIR/metrics.json`` from the addresses the roles bound themselves (a port the launcher
chose beforehand was once taken by another process before a follower bound it: the
follower exited, the launch failed): dips.emu.metrics_targets, dips.node.metrics."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from dips.emu.metrics_targets import MetricsTargets
from dips.node.metrics import serve_metrics
from dips.roles.durable import METRICS_ADDR

pytestmark = pytest.mark.timeout(30)


def test_a_role_writes_the_port_it_bound_and_the_launcher_lists_it(tmp_path):
    states = {"leader": tmp_path / "leader", "follower-0": tmp_path / "f0"}
    for d in states.values():
        d.mkdir()
    targets = MetricsTargets(tmp_path, states)
    assert targets.refresh() == {} and json.loads((tmp_path / "metrics.json").read_text()) == {}
    server = serve_metrics(CollectorRegistry(), 0, "127.0.0.1", states["leader"])
    try:
        assert (states["leader"] / METRICS_ADDR).read_text() == f"127.0.0.1:{server.port}\n"
        assert targets.refresh() == {"leader": f"127.0.0.1:{server.port}"}
        (states["follower-0"] / METRICS_ADDR).write_text("127.0.0.1:1234\n")  # a restart's
        assert json.loads((tmp_path / "metrics.json").read_text()) == {
            "leader": f"127.0.0.1:{server.port}"}  # until the next look
        targets.refresh()
        assert json.loads((tmp_path / "metrics.json").read_text()) == {
            "leader": f"127.0.0.1:{server.port}", "follower-0": "127.0.0.1:1234"}
    finally:
        server.close()
