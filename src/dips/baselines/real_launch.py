"""Launch a real-time baseline: one OS process per cluster, optionally in shaped namespaces.

:func:`launch_baseline` prepares the data once, picks the link shaping (:func:`resolve_shaping`:
kernel ``tc tbf`` in network namespaces as root, else the application token bucket, else
none), writes ``RUN_DIR/spec.json`` and the run secret, starts the cluster processes
(:mod:`dips.baselines.real_dp`, ``real_diloco``, ``real_async``), releases them together
(``go.json``), applies link-rate schedules (``tc qdisc replace`` at run time), stops them at
the token budget or ``max_time_s``, and always kills every child it started (by pid) and
removes its namespaces, also on exceptions and Ctrl-C.  Results: :mod:`dips.baselines.real_results`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dips.baselines.real_common import DIVERGED_EXIT
from dips.emu import netns
from dips.emu.launcher import free_port
from dips.emu.result import MethodResult
from dips.spec import Endpoint, WorkerSpec

__all__ = ["MODULES", "launch_baseline", "resolve_shaping"]

MODULES = {"dp": "dips.baselines.real_dp", "diloco": "dips.baselines.real_diloco",
           "async-diloco": "dips.baselines.real_async"}
Shaping = Literal["auto", "tc-tbf", "token-bucket", "none"]
_ASYNC_PORT, _GLOO_PORT = 5555, 29500


def resolve_shaping(requested: Shaping, rated: bool) -> tuple[str, str]:
    """``(shaping that will run, why)``, for the baselines and real-time Di-PS alike.

    ``rated``: whether any cluster has a link rate (or a rate schedule).  ``auto``: ``tc-tbf``
    when :func:`dips.emu.netns.probe` succeeds, else ``token-bucket``; ``none`` when no
    cluster has a rate.  Raises RuntimeError when ``tc-tbf`` is requested but unavailable
    (the reason named), ValueError for an unknown value.
    """
    if requested not in ("auto", "tc-tbf", "token-bucket", "none"):
        raise ValueError(f"shaping must be auto, tc-tbf, token-bucket or none, got {requested!r}")
    if requested == "none" or not rated:
        return "none", "no link rate configured" if requested != "none" else "requested"
    if requested == "token-bucket":
        return "token-bucket", "requested"
    cap = netns.probe()
    if cap.shaping == "tc-tbf":
        return "tc-tbf", "root, ip, tc, network namespaces and tbf available"
    if requested == "tc-tbf":
        raise RuntimeError(f"shaping tc-tbf unavailable: {cap.reason}")
    return "token-bucket", f"kernel shaping unavailable ({cap.reason})"


@dataclass
class _Run:
    spec: WorkerSpec
    run_dir: Path
    net: netns.ShapedNetwork | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)

    def event(self, kind: str, **extra: object) -> None:
        rec = {"time": time.time(), "event": kind, **extra}
        self.events.append(rec)
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def spawn(self, rank: int) -> None:
        c = self.spec.clusters[rank]
        prefix = self.net.exec_prefix(c.id) if self.net is not None else []
        argv = [*prefix, sys.executable, "-m", MODULES[self.spec.method], "--run-dir",
                str(self.run_dir), "--rank", str(rank)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false",
                   GLOO_SOCKET_IFNAME=self.spec.endpoint(c.id).iface)
        log = self.run_dir / "logs" / f"{c.id}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            # `ip netns exec` execs the command, so the pid is the training process itself.
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self.procs[c.id] = proc
        self.event("start", cluster=c.id, pid=proc.pid)

    def signal_all(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def stop_all(self, grace_s: float) -> None:
        """SIGTERM every live child, wait up to ``grace_s``, SIGKILL the rest; reap all."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for cid, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                self.event("killed", cluster=cid, pid=proc.pid)

    def failed(self) -> dict[str, int]:
        return {cid: p.returncode for cid, p in self.procs.items()
                if p.returncode not in (None, 0)}


def _tokens(run_dir: Path, cid: str, offsets: dict[str, int], last: dict[str, int]) -> int:
    """Newest ``tokens`` of a cluster's train.jsonl, reading only what was appended."""
    path = run_dir / "clusters" / cid / "train.jsonl"
    if path.exists():
        with open(path) as f:
            f.seek(offsets.get(cid, 0))
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        offsets[cid] = offsets.get(cid, 0) + len(complete.encode())
        for line in complete.splitlines():
            rec = json.loads(line)
            if "tokens" in rec:
                last[cid] = max(last.get(cid, 0), int(rec["tokens"]))
    return last.get(cid, 0)


def _monitor(run: _Run, t0: float, shutdown_s: float) -> str:
    """Wait for the end of training; apply tc rate schedules. Returns the stop reason."""
    spec = run.spec
    pending = sorted((ch.at_s, c.id, ch.bps) for c in spec.clusters if c.link is not None
                     for ch in c.link.schedule)
    offsets: dict[str, int] = {}
    last: dict[str, int] = {}
    stopping_since: float | None = None
    reason = "finished"
    while True:
        time.sleep(0.2)
        now = time.time() - t0
        while run.net is not None and pending and pending[0][0] <= now:
            at, cid, rate = pending.pop(0)
            run.net.set_rate(cid, rate)
            run.event("rate", cluster=cid, rate_bps=rate, at_s=round(now, 3))
        if all(p.poll() is not None for p in run.procs.values()):
            return reason if not run.failed() else f"exited {run.failed()}"
        if run.failed() and stopping_since is None:
            reason = f"exited {run.failed()}"
            stopping_since = time.monotonic()
            run.signal_all(signal.SIGTERM)
        if stopping_since is None:
            budget = spec.method == "async-diloco" and sum(
                _tokens(run.run_dir, c.id, offsets, last) for c in spec.clusters) >= spec.token_budget
            if budget or now >= spec.max_time_s:
                reason = "token budget" if budget else "max time"
                run.event("stop", reason=reason, at_s=round(now, 3))
                stopping_since = time.monotonic()
                run.signal_all(signal.SIGTERM)
        elif time.monotonic() - stopping_since > shutdown_s + spec.collective_s / 10:
            run.event("stop", reason="shutdown timeout")
            return reason


def launch_baseline(spec: WorkerSpec, run_dir: Path, shaping: Shaping = "auto",
                    shutdown_s: float = 30.0) -> MethodResult:
    """Run ``spec.method`` with one process per cluster; return its :class:`MethodResult`.

    ``spec``'s addresses and ports are filled in here (loopback, or the namespaces' veths).
    ``result.shaping`` says which shaping ran; ``extra`` holds the reason, exit codes,
    pacing overruns and per-cluster figures.

    Raises:
        RuntimeError: a process failed to start or exited with an error (its log named), or
            ``tc-tbf`` was requested but is unavailable.
        TimeoutError: the processes were not ready within ``spec.startup_s``.
    """
    from dips.baselines.real_results import collect
    from dips.train.datasource import load_data

    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("go.json", "spec.json", "events.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    for sub in ("ready", "clusters", "snapshots", "logs"):
        shutil.rmtree(run_dir / sub, ignore_errors=True)
    mode, why = resolve_shaping(shaping, spec.shaped)
    load_data(spec.data)  # warm the cache once
    (run_dir / "secret").unlink(missing_ok=True)
    fd = os.open(run_dir / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never world-readable
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    with contextlib.ExitStack() as stack:
        net = None
        if mode == "tc-tbf":
            ids = [c.id for c in spec.clusters]
            net = stack.enter_context(netns.ShapedNetwork(
                ids, {c.id: c.link.bps if c.link else None for c in spec.clusters}))
            endpoints = {c: Endpoint(addr=net.addr(c), iface=net.iface(c), port=_ASYNC_PORT)
                         for c in ids}
            spec = spec.model_copy(update={"endpoints": endpoints, "master_addr": net.addr(ids[0]),
                                           "master_port": _GLOO_PORT, "shaping": mode})
        else:
            endpoints = {c.id: Endpoint(addr="127.0.0.1", iface="lo", port=0) for c in spec.clusters}
            spec = spec.model_copy(update={"endpoints": endpoints, "master_addr": "127.0.0.1",
                                           "master_port": free_port(), "shaping": mode})
        (run_dir / "spec.json").write_text(spec.model_dump_json(indent=1))
        run = _Run(spec, run_dir, net)
        run.event("shaping", shaping=mode, reason=why, prefix=net.prefix if net else None)
        stack.callback(run.stop_all, shutdown_s)
        for rank in range(len(spec.clusters)):
            run.spawn(rank)
        deadline = time.monotonic() + spec.startup_s
        ready = run_dir / "ready"
        while len(list(ready.glob("*.json")) if ready.exists() else []) < len(spec.clusters):
            if run.failed() or any(p.poll() is not None for p in run.procs.values()):
                raise RuntimeError(f"{spec.method}: a process exited during start-up {run.failed()}; "
                                   f"see {run_dir / 'logs'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.method}: processes not ready within {spec.startup_s} s")
            time.sleep(0.1)
        endpoints = {json.loads(p.read_text())["id"]: json.loads(p.read_text()).get("endpoint")
                     for p in ready.glob("*.json")}
        t0 = time.time() + 0.5
        tmp = run_dir / ".go.tmp"
        tmp.write_text(json.dumps({"t0": t0, "endpoints": endpoints}))
        tmp.replace(run_dir / "go.json")
        reason = _monitor(run, t0, shutdown_s)
        run.stop_all(shutdown_s)
        codes = {cid: p.returncode for cid, p in run.procs.items()}
    # Our own SIGTERM/SIGKILL at shutdown is not a failure; anything else is.
    errors = {cid: rc for cid, rc in codes.items()
              if rc not in (0, DIVERGED_EXIT, -signal.SIGTERM, -signal.SIGKILL)}
    if errors:
        raise RuntimeError(f"{spec.method}: processes failed {errors}; see {run_dir / 'logs'}")
    return collect(spec, run_dir, t0, mode, {"shaping_reason": why, "stop_reason": reason,
                                             "exit_codes": codes})
