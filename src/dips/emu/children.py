"""The processes ``dips launch`` starts and how it stops them (§5, §12).

:class:`Launch` holds one launched run's children (each in its own session, so a signal
reaches only the launcher) and its event log; :class:`InterruptLatch` turns SIGINT and
SIGTERM into :class:`Interrupted` at the next wait, even when the signal's exception was
raised, and swallowed, inside a finaliser (``__del__``) the interpreter happened to run.
Only processes this launcher started are signalled, by pid.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from dips.emu.proctree import signal_job
from dips.spec import RunConfig

#: The child name (and state folder) of the periodic evaluator, ``cfg.evaluate`` (issue 15).
EVALUATOR = "evaluator"
#: The exit status of a role that could not start (``dips.node.cli``: its configuration,
#: certificate or data; ``dips.torchrun``: every failed rank's): restarting cannot help.
EXIT_CANNOT_START = 2


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the launcher (handled as Ctrl-C at every phase)."""


class InterruptLatch:
    """Remembers a SIGINT or SIGTERM until the launcher has handled it.

    Python raises a signal handler's exception in whatever frame runs when the signal is
    checked; inside a finaliser (``__del__``, e.g. a regex cache's) that exception is only
    printed, and an interrupt once left every child of a run running. The handler therefore
    both raises and latches; :meth:`check` re-raises a latched interrupt from the launcher's
    own wait loops, and :meth:`handled` clears it once the clean-up has begun."""

    def __init__(self) -> None:
        self.pending: str | None = None

    def handler(self, signum: int, frame: Any) -> None:
        """The signal handler (``signal.signal(sig, latch.handler)``). Raises Interrupted."""
        self.pending = signal.Signals(signum).name
        raise Interrupted(self.pending)

    def check(self) -> None:
        """Raise :class:`Interrupted` if a signal arrived and was not handled yet."""
        if self.pending is not None:
            raise Interrupted(self.pending)

    def handled(self) -> None:
        """The interrupt is being handled: later waits (the clean-up's) run to their end."""
        self.pending = None


@dataclass
class Child:
    """A process this launcher started."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)
    restarts: int = 0
    prefix: list[str] = field(default_factory=list)


@dataclass
class Launch:
    """State of one launched run."""

    cfg: RunConfig
    run_dir: Path
    console: Console
    children: dict[str, Child] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    net: Any = None  # dips.emu.netns.ShapedNetwork when cfg.network == "netns"
    progress: Any = None  # dips.emu.progress.Progress once training started
    metrics: Any = None  # dips.emu.metrics_targets.MetricsTargets of the roles
    interrupts: InterruptLatch = field(default_factory=InterruptLatch)
    #: monotonic seconds when training stopped (the stop decided, or Ctrl-C), None before
    t_stop: float | None = None
    #: optional children (clusters, the evaluator) that exited 2 and are not restarted
    given_up: set[str] = field(default_factory=set)

    def prefix_of(self, name: str) -> list[str]:
        """argv prefix that runs child ``name`` in its network namespace ([] on loopback)."""
        if self.net is None:
            return []
        return self.net.exec_prefix(name[len("cluster-"):] if name.startswith("cluster-") else None)

    def command_of(self, name: str, args: list[str]) -> list[str]:
        """The argv of child ``name`` for its role command ``args``: ``dips <args>``, or for a
        cluster of ``ranks > 1`` that cluster as a torchrun job on this host (a fresh
        rendezvous port each start; torchrun never restarts it, the supervisor does), under
        :mod:`dips.torchrun`: SIGTERM reaches the ranks, which stop together, and it exits 0."""
        me = next((c for c in self.cfg.clusters if f"cluster-{c.id}" == name), None)
        if me is None or me.ranks == 1:
            return [sys.executable, "-m", "dips.cli", *args]
        host = self.net.addr(me.id) if self.net is not None else "127.0.0.1"  # its namespace's
        return [sys.executable, "-m", "dips.torchrun", "--nnodes", "1",
                "--nproc-per-node", str(me.ranks), "--master-addr", host, "--master-port",
                str(free_port()), "--max-restarts", "0", "-m", "dips.cluster", *args[1:]]

    def spawn(self, name: str, args: list[str]) -> Child:
        log_path = self.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", DIPS_PROCESS=name,
                   DIPS_FAILPOINTS=str(self.run_dir / "failpoints"),
                   DIPS_TRAIN_START=str(self.run_dir / "train_start"))
        prefix = self.prefix_of(name)
        proc = subprocess.Popen([*prefix, *self.command_of(name, args)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        out.close()
        old = self.children.get(name)
        child = Child(name, proc, log_path, list(args), old.restarts + 1 if old else 0, prefix)
        self.children[name] = child
        self.event("start" if old is None else "restart", name, pid=proc.pid)
        return child

    def pid_of(self, name: str) -> int | None:
        """The pid of child ``name`` if it is running, else None."""
        c = self.children.get(name)
        return c.proc.pid if c is not None and c.proc.poll() is None else None

    def supervise(self) -> None:
        """Restart every child that exited (as an orchestrator would, §12); log each exit.
        A cluster or the evaluator that exited :data:`EXIT_CANNOT_START` (2) is not restarted
        (review 32: a configuration error restarted in a loop for the whole run): an event
        ``not_restarted`` and one console line name it and its log."""
        for name, c in list(self.children.items()):
            code = c.proc.poll()
            if code is None or name in self.given_up:
                continue
            self.event("exited", name, returncode=code, pid=c.proc.pid)
            optional = name.startswith("cluster-") or name == EVALUATOR
            if not self.cfg.supervise:
                if not optional:
                    raise RuntimeError(f"{name} exited (code {code}); see {c.log_path}")
                self.given_up.add(name)
                continue
            if optional and code == EXIT_CANNOT_START:
                self.given_up.add(name)
                self.event("not_restarted", name, returncode=code, log=str(c.log_path))
                self.console.print(f"[red]{name} could not start (exit {code}): not restarted; "
                                   f"see {c.log_path}[/]")
                continue
            self.spawn(name, c.args)

    def event(self, kind: str, name: str, **extra: Any) -> None:
        rec = {"time": time.time(), "event": kind, "process": name, **extra}
        self.events.append(rec)
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def stop(self, names: list[str], timeout_s: float) -> None:
        """SIGTERM the named children, wait up to ``timeout_s``, then SIGKILL; then refresh
        ``metrics.json`` (the launcher's loop no longer does once stopping)."""
        live = [self.children[n] for n in names if self.children[n].proc.poll() is None]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_job(c.proc.pid, signal.SIGKILL)  # a torchrun's ranks too
                c.proc.wait(10)
                self.event("killed", c.name)
            self.event("stopped", c.name, returncode=c.proc.returncode)
        if self.metrics is not None:  # a role restarted before the stop may serve only now
            self.metrics.refresh()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a process started later.

    Chosen below the kernel's ephemeral range (``ip_local_port_range``): a port from inside it
    can be taken meanwhile as the source port of any outgoing connection on the machine (a
    follower once failed to bind its data port so), a port below it only by another explicit
    bind. Falls back to a kernel-chosen port when the range leaves no room below."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200 if low > 11000 else 0):
        port = rng.randrange(10000, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for(cond: Any, timeout_s: float, what: str, launch: Launch) -> Any:
    """Poll ``cond()`` every 0.2 s until it returns a true value (returned) or ``timeout_s``
    seconds pass. Raises TimeoutError then, RuntimeError when a child of ``launch`` exited
    meanwhile, :class:`Interrupted` on a signal (also one a finaliser swallowed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        launch.interrupts.check()
        value = cond()
        if value:
            return value
        dead = [c.name for c in launch.children.values() if c.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: process {dead[0]} exited early; see "
                               f"{launch.children[dead[0]].log_path}")
        time.sleep(0.2)
    launch.interrupts.check()
    raise TimeoutError(f"{what} not reached within {timeout_s} s")


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) process ``pid`` has used, from
    ``/proc/PID/stat``; None where that cannot be read (gone, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is first
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class CpuWindow:
    """The CPU a process used over the last ``window_s`` seconds, from samples (the launcher's
    liveness probe of the leader: a silent leader that uses CPU is busy, not hung;
    :func:`dips.algo.liveness.leader_hung`)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._pid: int | None = None
        self._samples: list[tuple[float, float]] = []  # (monotonic s, CPU s), oldest first

    def sample(self, pid: int | None, now: float) -> float | None:
        """Take a sample of ``pid`` at ``now`` (monotonic seconds); returns its CPU use since
        the oldest sample within ``window_s`` (CPUs), None without two samples of it."""
        cpu = cpu_seconds(pid) if pid is not None else None
        if pid != self._pid or cpu is None:
            self._pid, self._samples = pid, []
            if cpu is None:
                return None
        self._samples = [s for s in self._samples if now - s[0] <= self.window_s]
        self._samples.append((now, cpu))
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None
