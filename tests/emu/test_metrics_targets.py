"""``RUN_DIR/metrics.json`` from the addresses the roles bound themselves (a port the launcher
chose beforehand was once taken by another process before a follower bound it: the
follower exited, the launch failed): dips.emu.metrics_targets, dips.node.metrics. The same
targets as a Prometheus file_sd file, and both still refreshed while the launcher stops
(review 33 m2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

from dips.emu.children import Child, Launch
from dips.emu.metrics_targets import FILE_SD, MetricsTargets
from dips.node.metrics import serve_metrics
from dips.roles.durable import METRICS_ADDR
from dips.spec import ClusterConfig, RunConfig

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


def test_the_targets_are_a_prometheus_file_sd_file_labelled_by_member(tmp_path):
    """A restarted role binds another port: the file_sd file follows, and its ``member``
    label (not the address) names the series across the restart."""
    states = {n: tmp_path / n for n in ("leader", "follower-0", "cluster-a", "evaluator")}
    for name, d in states.items():
        d.mkdir()
        (d / METRICS_ADDR).write_text(f"127.0.0.1:{1000 + len(name)}\n")
    targets = MetricsTargets(tmp_path, states)
    targets.refresh()
    groups = json.loads((tmp_path / FILE_SD).read_text())
    assert groups == [{"targets": [f"127.0.0.1:{1000 + len(n)}"],
                       "labels": {"member": n, "role": role}}
                      for n, role in (("cluster-a", "cluster"), ("evaluator", "evaluator"),
                                      ("follower-0", "follower"), ("leader", "leader"))]
    (states["cluster-a"] / METRICS_ADDR).write_text("127.0.0.1:2222\n")  # its next process
    targets.refresh()
    groups = json.loads((tmp_path / FILE_SD).read_text())
    assert groups[0] == {"targets": ["127.0.0.1:2222"],
                         "labels": {"member": "cluster-a", "role": "cluster"}}


def test_stopping_the_run_refreshes_the_targets(tmp_path):
    """A role restarted shortly before the stop served its new port only during the
    shutdown, when the launcher's loop no longer refreshed metrics.json: the file kept the
    dead process's port to the end."""
    state = tmp_path / "clusters" / "a"
    state.mkdir(parents=True)
    (state / METRICS_ADDR).write_text("127.0.0.1:1111\n")
    launch = Launch(RunConfig(clusters=[ClusterConfig(id="a")]), tmp_path, Console(quiet=True))
    launch.metrics = MetricsTargets(tmp_path, {"cluster-a": state})
    launch.metrics.refresh()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        launch.children["cluster-a"] = Child("cluster-a", proc, tmp_path / "a.log")
        (state / METRICS_ADDR).write_text("127.0.0.1:2222\n")  # the new process serves now
        launch.stop(["cluster-a"], 10.0)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"cluster-a": "127.0.0.1:2222"}
    assert json.loads((tmp_path / FILE_SD).read_text())[0]["targets"] == ["127.0.0.1:2222"]
