"""Across hosts (issue 11): the leader, 2 followers and 3 clusters each in its own network
namespace with its own address and its own state directory — no path shared between them —
started only through the public commands (`dips init`, `dips leader`, `dips follower`,
`dips cluster`) with their own certificates. A follower and then the leader are killed
(SIGKILL) and restarted with the same command, then cluster a's link is cut in the kernel (its
veth down) for 6 s — four times the 1.5 s after which the leader removes a silent cluster —
and healed: a is removed, re-joins and has a push accepted again. The run goes on to at least
3 outer steps after the leader's restart, the training loss falls, and the invariants hold on
what each host wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from tests.integration.invariants import check_run, jsonl
from tests.integration.runner import ROOT, jsonl_so_far

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

HOSTS = ["leader", "f0", "f1", "a", "b", "c"]


def _netns_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    from dips.emu.netns import probe

    cap = probe()
    return None if cap.shaping == "tc-tbf" else f"network namespaces unavailable: {cap}"


class Hosts:
    """Six 'hosts' (namespaces), each with its own directory; processes by role."""

    def __init__(self, tmp: Path, net) -> None:
        self.tmp, self.net = tmp, net
        self.procs: dict[str, subprocess.Popen] = {}
        self.all: list[subprocess.Popen] = []
        self.leader_addr = f"{net.addr('leader')}:7000"

    def dir(self, host: str) -> Path:
        return self.tmp / "hosts" / host

    def command(self, host: str) -> list[str]:
        d, tls = self.dir(host), str(self.dir(host) / "tls")
        if host == "leader":
            return ["leader", "--config", str(d / "run.yaml"), "--listen", self.leader_addr,
                    "--state-dir", str(d / "state"), "--tls", tls, "--cache-dir",
                    str(d / "cache"), "--status-socket", str(d / "leader.sock")]
        if host.startswith("f"):
            addr = self.net.addr(host)
            return ["follower", "--leader", self.leader_addr, "--index", host[1:],
                    "--listen", f"{addr}:7100", "--data-listen", f"{addr}:7200",
                    "--state-dir", str(d / "state"), "--tls", tls]
        return ["cluster", "--leader", self.leader_addr, "--cluster-id", host,
                "--state-dir", str(d / "state"), "--tls", tls, "--cache-dir", str(d / "cache")]

    def start(self, host: str) -> None:
        log = open(self.dir(host) / "process.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        proc = subprocess.Popen([*self.net.exec_prefix(host), sys.executable, "-m", "dips.cli",
                                 *self.command(host)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
                                start_new_session=True)
        log.close()
        self.procs[host] = proc
        self.all.append(proc)

    def kill(self, host: str) -> None:
        self.procs[host].send_signal(signal.SIGKILL)
        self.procs[host].wait(30)

    def stop(self, hosts: list[str]) -> None:
        for h in hosts:
            if self.procs[h].poll() is None:
                self.procs[h].send_signal(signal.SIGTERM)
        for h in hosts:
            try:
                self.procs[h].wait(30)
            except subprocess.TimeoutExpired:
                self.procs[h].kill()
                self.procs[h].wait(10)

    def close(self) -> None:
        for p in self.all:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    def applied(self) -> int:
        """Outer steps the leader has decided (accepted, not rolled back) so far."""
        return sum(1 for r in jsonl_so_far(self.dir("leader") / "state" / "outer_steps.jsonl")
                   if r.get("accepted") and not r.get("error"))

    def wait(self, cond, what: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            dead = [h for h, p in self.procs.items() if p.poll() is not None]
            if dead:
                log = self.dir(dead[0]) / "process.log"
                tail = log.read_text(errors="replace").splitlines()[-8:]
                raise AssertionError(f"{what}: {dead[0]} exited (rc "
                                     f"{self.procs[dead[0]].returncode}); {log} ends:\n"
                                     + "\n".join(tail))
            time.sleep(0.2)
        raise AssertionError(f"{what} not within {timeout_s} s")


def _after(hosts: Hosts, kind: str, t: float) -> bool:
    """Whether the leader logged ``kind`` for cluster a after wall time ``t``."""
    return any(e.get("event") == kind and e.get("cluster") == "a" and e["time"] > t
               for e in jsonl_so_far(hosts.dir("leader") / "state" / "leader_events.jsonl"))


def _status(sock: Path):
    from dips.wire.pb import control_pb2 as pb
    from dips.wire.security import Credentials
    from dips.wire.services import leader_client

    client = leader_client(f"unix:{sock}", Credentials.tls(sock.parent / "admin"), timeout_s=5)
    try:
        return client.GetStatus(pb.StatusRequest())
    except grpc.RpcError:
        return None
    finally:
        client.close()


def test_a_run_across_namespaced_hosts_survives_a_follower_and_a_leader_restart(tmp_path):
    why = _netns_ok()
    if why:
        pytest.skip(why)
    from dips.emu.netns import ShapedNetwork, list_namespaces

    pki = tmp_path / "operator" / "pki"
    init = subprocess.run([sys.executable, "-m", "dips.cli", "init", "--config",
                           str(ROOT / "configs/tiny.yaml"), "--out", str(pki)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert init.returncode == 0, init.stderr
    bundles = {"leader": "leader", "f0": "follower-0", "f1": "follower-1", "a": "cluster-a",
               "b": "cluster-b", "c": "cluster-c"}
    cache = ROOT / ".cache" / "dips"
    for host, bundle in bundles.items():  # what the operator copies to each host
        d = tmp_path / "hosts" / host
        shutil.copytree(pki / bundle, d / "tls")
        if (host == "leader" or host in "abc") and cache.is_dir():
            shutil.copytree(cache, d / "cache")  # a host's own cache (copied, not shared)
    # The test ends the run itself, on events: tiny.yaml's 40 s limit would end it early on a
    # loaded machine (the clusters exit 0 once the run finished).
    cfg = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    cfg.update(max_time_s=None)
    (tmp_path / "hosts" / "leader" / "run.yaml").write_text(yaml.safe_dump(cfg))
    admin = tmp_path / "hosts" / "leader" / "admin"  # the operator's status client, local
    shutil.copytree(pki / "admin", admin)
    with ShapedNetwork(HOSTS) as net:
        prefix = net.prefix
        hosts = Hosts(tmp_path, net)
        try:
            for h in HOSTS:
                hosts.start(h)
            hosts.wait(lambda: hosts.applied() >= 1, "a first outer step")
            hosts.kill("f1")
            hosts.start("f1")
            after_follower = hosts.applied()
            hosts.wait(lambda: hosts.applied() >= after_follower + 1,
                       "an outer step after the follower's restart")
            hosts.kill("leader")
            hosts.start("leader")
            after_leader = hosts.applied()
            hosts.wait(lambda: hosts.applied() >= after_leader + 1,
                       "an outer step after the leader's restart")
            cut = time.time()
            net.set_link("a", False)  # the kernel cuts cluster a's link
            hosts.wait(lambda: _after(hosts, "cluster_removed", cut), "cluster a removed")
            net.set_link("a", True)
            healed = time.time()
            hosts.wait(lambda: _after(hosts, "cluster_joined", healed), "cluster a re-joined")
            hosts.wait(lambda: [r for r in jsonl_so_far(hosts.dir("leader") / "state" /
                                                        "outer_steps.jsonl")
                                if "a" in (r.get("accepted") or []) and r["time"] > healed],
                       "a push of cluster a accepted after the heal")
            hosts.wait(lambda: hosts.applied() >= after_leader + 3,
                       "3 outer steps after the leader's restart")
            hosts.stop(["a", "b", "c"])
            sock = hosts.dir("leader") / "leader.sock"
            hosts.wait(lambda: (s := _status(sock)) is not None and s.phase == "idle",
                       "the last round to end", 60)
            status = _status(sock)
            hosts.stop(["f0", "f1", "leader"])
        finally:
            hosts.close()
    assert list_namespaces(prefix) == []
    # No path shared: every path a host's command names lies in that host's own directory.
    for h in HOSTS:
        paths = [a for a in hosts.command(h) if a.startswith("/")]
        assert paths and all(Path(a).is_relative_to(hosts.dir(h)) for a in paths), (h, paths)
    assert int((hosts.dir("leader") / "state" / "term").read_text()) == 2
    from dips.algo.fencing import starts_of

    for f in ("f0", "f1"):  # both follow the restarted leader
        assert starts_of(int((hosts.dir(f) / "state" / "leader_term").read_text())) == 2
    # The invariants, on a view assembled from what each host wrote.
    view = tmp_path / "view"
    (view / "followers").mkdir(parents=True)
    for name in ("outer_steps.jsonl", "leader.json"):
        (view / name).symlink_to(hosts.dir("leader") / "state" / name)
    for i in (0, 1):
        (view / "followers" / str(i)).symlink_to(hosts.dir(f"f{i}") / "state")
    (view / "summary.json").write_text(json.dumps({"final_version": status.version}))
    check_run(view, evaluated=False)
    assert status.outer_steps >= 3
    steps = sorted((r["time"], r["loss"]) for c in "abc"
                   for r in jsonl(hosts.dir(c) / "state" / "train.jsonl") if "loss" in r)
    losses = [loss for _, loss in steps]  # every cluster's inner steps, in time order
    assert len(losses) >= 32 and sum(losses[-16:]) / 16 < sum(losses[:16]) / 16 - 0.2, losses
