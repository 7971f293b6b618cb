"""``dips launch``: a whole Di-PS run on one machine, every role a separate OS process (§5).

Steps: prepare the data (tokenizer, token stream, chunks) and the initial model once; start
the leader, M followers and N clusters on 127.0.0.1 (``network: netns``: each cluster in its
own network namespace, links shaped by tc tbf); show live progress; change link rates on
``clusters[].link.schedule``; stop at the token budget, ``--max-outer-steps`` (the leader
reports that many outer steps), ``--max-time`` or Ctrl-C; pull the final global model from
the followers, evaluate it on the held-out split, save it in HF format, and write
``summary.json``.

Children run in their own sessions, so Ctrl-C reaches only the launcher, which then stops
them in order (clusters first, then followers and leader) with SIGTERM, and SIGKILL after
``timeouts.shutdown_s``. Only processes this launcher started are signalled, by pid.
"""

from __future__ import annotations

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
from typing import Any

import grpc
from rich.console import Console

from dips.algo import partition_contiguous
from dips.algo.round import Phase
from dips.emu.faults import FaultInjector, FaultPlan
from dips.emu.link_schedule import LinkSchedule
from dips.emu.progress import Progress
from dips.spec import RunConfig, RunSpec
from dips.wire.pb import control_pb2 as pb
from dips.wire.services import leader_client


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

    def prefix_of(self, name: str) -> list[str]:
        """argv prefix that runs child ``name`` in its network namespace ([] on loopback)."""
        if self.net is None:
            return []
        return self.net.exec_prefix(name[len("cluster-"):] if name.startswith("cluster-") else None)

    def spawn(self, name: str, args: list[str]) -> Child:
        log_path = self.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", DIPS_PROCESS=name,
                   DIPS_FAILPOINTS=str(self.run_dir / "failpoints"))
        prefix = self.prefix_of(name)
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "dips.cli", *args], stdout=out,
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
        """Restart every child that exited (as an orchestrator would, §12); log each exit."""
        for name, c in list(self.children.items()):
            code = c.proc.poll()
            if code is None:
                continue
            self.event("exited", name, returncode=code, pid=c.proc.pid)
            if not self.cfg.supervise:
                if not name.startswith("cluster-"):
                    raise RuntimeError(f"{name} exited (code {code}); see {c.log_path}")
                continue
            self.spawn(name, c.args)

    def event(self, kind: str, name: str, **extra: Any) -> None:
        rec = {"time": time.time(), "event": kind, "process": name, **extra}
        self.events.append(rec)
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def stop(self, names: list[str], timeout_s: float) -> None:
        """SIGTERM the named children, wait up to ``timeout_s``, then SIGKILL."""
        live = [self.children[n] for n in names if self.children[n].proc.poll() is None]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in live:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(10)
                self.event("killed", c.name)
            self.event("stopped", c.name, returncode=c.proc.returncode)


def prepare(cfg: RunConfig, run_dir: Path, bind_host: str = "127.0.0.1") -> RunSpec:
    """Tokenizer, token stream, initial model and layer ownership; returns the run spec.

    Writes ``init/model.safetensors`` (version 0 of θ), ``run.json`` (the :class:`RunSpec` as
    JSON), ``secret`` (0600).
    """
    import torch
    from safetensors.torch import save_file

    from dips.train.corpus import load_tokenizer, load_tokens
    from dips.train.loop import eval_loss
    from dips.train.model import build_model, layer_table
    from dips.train.sampler import make_chunks

    cache = cfg.data.cache_dir.resolve()
    load_tokenizer(cache, cfg.data.vocab_size)
    data = load_tokens(cache, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.max_train_tokens)
    model = build_model(cfg.model, cfg.seed)
    table = layer_table(model)
    parts = partition_contiguous([nbytes for _, _, nbytes in table], cfg.followers)
    (run_dir / "init").mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
              str(run_dir / "init" / "model.safetensors"))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    initial = eval_loss(model, data.val, cfg.inner.seq_len, cfg.eval_batch_size, cfg.eval_batches)
    spec = RunSpec(
        config=cfg, cache_dir=cache,
        layers=[(l, list(names), int(nbytes)) for l, names, nbytes in table],
        follower_layers=[[table[i][0] for i in r] for r in parts],
        init="init/model.safetensors", eval_loss_initial=initial,
        train_tokens=int(len(data.train)), val_tokens=int(len(data.val)),
        params=int(sum(p.numel() for p in model.parameters())),
        windows_per_chunk=min(e - s for s, e in make_chunks(len(data.train), cfg.data.num_chunks))
        // (cfg.inner.seq_len + 1),
        leader_addr=f"{bind_host}:{free_port()}", bind_host=bind_host,
        follower_ports=[(free_port(), free_port()) for _ in range(cfg.followers)])
    spec.write(run_dir / "run.json")
    secret_path = run_dir / "secret"
    secret_path.write_text(secrets.token_hex(32))
    secret_path.chmod(0o600)
    return spec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, for a process started later.

    Chosen below the kernel's ephemeral range (``ip_local_port_range``): a port from inside it
    can be taken meanwhile as the source port of any outgoing connection on the machine (a
    follower once failed to bind its data port so), a port below it only by another explicit
    bind. Falls back to a kernel-chosen port when the range leaves no room below."""
    import random
    import socket

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


def _wait_for(cond: Any, timeout_s: float, what: str, launch: Launch) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        dead = [c.name for c in launch.children.values() if c.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: process {dead[0]} exited early; see "
                               f"{launch.children[dead[0]].log_path}")
        time.sleep(0.2)
    raise TimeoutError(f"{what} not reached within {timeout_s} s")


def _status(client: Any) -> pb.StatusReply | None:
    try:
        return client.GetStatus(pb.StatusRequest(), timeout=1.0)
    except grpc.RpcError:
        return None


def launch(cfg: RunConfig, run_dir: Path, max_time_s: float | None = None,
           console: Console | None = None, faults: FaultPlan | None = None,
           max_outer_steps: int | None = None) -> dict[str, Any]:
    """Run Di-PS end to end; returns (and writes) the summary. See the module docstring.

    ``max_time_s`` and ``max_outer_steps`` (None: ``cfg.max_time_s``, ``cfg.max_outer_steps``)
    stop the run after that many seconds of training, or once the leader's status reports
    that many outer steps, whichever comes first (the token budget too).

    Raises RuntimeError if a leader or follower process dies, TimeoutError on startup.
    """
    console = console or Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    # A re-used run directory starts empty of the previous run's outputs (they are appended to).
    for stale in ("leader.addr", "events.jsonl", "outer_steps.jsonl", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    for stale in ("leader.json", "leader_events.jsonl", "train_start", "leader.sock"):
        (run_dir / stale).unlink(missing_ok=True)
    for stale_ipc in run_dir.glob("follower-*.ipc"):
        stale_ipc.unlink(missing_ok=True)
    for stale in ("followers", "clusters", "logs", "final", "init", "failpoints"):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    max_time_s = max_time_s if max_time_s is not None else cfg.max_time_s
    if max_outer_steps is not None:
        if max_outer_steps < 1:
            raise ValueError(f"max_outer_steps = {max_outer_steps} must be >= 1")
        cfg = cfg.model_copy(update={"max_outer_steps": max_outer_steps})
    t_start = time.time()
    run = Launch(cfg, run_dir, console)
    spec: RunSpec | None = None
    summary: dict[str, Any] = {}
    client = None
    t_train = None
    try:
        console.print(f"[bold]dips[/] preparing data and model for run {cfg.name!r} in {run_dir}")
        bind_host = "127.0.0.1"
        if cfg.network == "netns":
            from dips.emu.netns import ShapedNetwork

            rates = {c.id: c.link.bps if c.link is not None else None for c in cfg.clusters}
            net = ShapedNetwork([c.id for c in cfg.clusters], rates)
            net.__enter__()
            run.net, bind_host = net, net.hub_addr
            run.event("network", "launcher", mode="netns", hub=net.hub_addr, prefix=net.prefix,
                      rates_bps=rates)
        spec = prepare(cfg, run_dir, bind_host)
        console.print(f"model {spec.params:,} parameters; {spec.train_tokens:,} train / "
                      f"{spec.val_tokens:,} validation tokens; initial validation loss "
                      f"{spec.eval_loss_initial:.3f}")
        secret = (run_dir / "secret").read_text().strip()
        run.spawn("leader", ["_leader", "--run-dir", str(run_dir)])
        _wait_for(lambda: (run_dir / "leader.addr").exists() and
                         (run_dir / "leader.addr").read_text().strip(),
                         cfg.timeouts.startup_s, "leader address", run)
        client = leader_client(f"unix:{run_dir / 'leader.sock'}", secret)
        for i in range(cfg.followers):
            run.spawn(f"follower-{i}", ["_follower", "--run-dir", str(run_dir), "--index", str(i)])
        _wait_for(lambda: (s := _status(client)) and len(s.followers) == cfg.followers,
                  cfg.timeouts.startup_s, "followers registered", run)
        for c in cfg.clusters:
            run.spawn(f"cluster-{c.id}", ["_cluster", "--run-dir", str(run_dir), "--cluster-id", c.id])
        # Training starts when the first cluster has joined (it trains from there): fault
        # times, link schedules, transients and --max-time count from this moment, as the
        # time to the token budget does.
        _wait_for(lambda: (s := _status(client)) and len(s.clusters) > 0,
                  cfg.timeouts.startup_s, "first cluster joined", run)
        t_train = time.monotonic()
        (run_dir / "train_start").write_text(repr(time.time()))
        injector = None
        if faults is not None and faults.faults:
            injector = FaultInjector(faults, run.pid_of, run_dir / "failpoints", run.event,
                                     run.net)
        # Bandwidth schedules: tc tbf rate changes here (netns); the clusters' token buckets
        # follow them themselves on loopback (recorded here as events all the same).
        links = LinkSchedule(cfg.clusters, run.net, run.event)
        interrupted = _train(run, client, Progress(cfg, console), t_train, max_time_s, injector,
                             links)
        summary = _finish(run, client, spec, secret, t_start, t_train, interrupted)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/]")
        run.event("interrupt", "launcher")
        if spec is not None:
            summary = _finish(run, client, spec, (run_dir / "secret").read_text().strip(),
                              t_start, t_train, True)
    finally:
        run.stop(list(run.children), cfg.timeouts.shutdown_s)
        if client is not None:
            client.close()
        if run.net is not None:
            run.net.__exit__(None, None, None)
    return summary


def stop_reason(cfg: RunConfig, status: Any, elapsed_s: float,
                max_time_s: float | None) -> str | None:
    """Why the run stops now (None: it goes on): ``"token budget"`` once the leader's ledger
    counts ``cfg.token_budget`` accepted tokens (never what members report of themselves,
    which a faulty or hostile cluster could inflate), ``"max outer steps"``, ``"max time"``
    (``elapsed_s`` seconds of training >= ``max_time_s``). ``status``: the leader's
    ``StatusReply``, or None when it did not answer."""
    if status is not None and status.tokens_accepted >= cfg.token_budget:
        return "token budget"
    if status is not None and cfg.max_outer_steps is not None \
            and status.outer_steps >= cfg.max_outer_steps:
        return "max outer steps"
    if max_time_s is not None and elapsed_s >= max_time_s:
        return "max time"
    return None


def _train(run: Launch, client: Any, progress: Progress, t_train: float,
           max_time_s: float | None, injector: FaultInjector | None = None,
           links: LinkSchedule | None = None) -> bool:
    """Show progress, supervise the children, inject faults and apply link-rate changes until
    the token budget, ``cfg.max_outer_steps`` outer steps, the time limit or Ctrl-C. Returns
    whether it was interrupted."""
    cfg = run.cfg
    reason: str | None = None
    liveness_s = max(3.0, cfg.membership.missed_heartbeats * cfg.membership.heartbeat_interval_s)
    last_ok = time.monotonic()
    answered: int | None = None
    next_status = 0.0
    status = None
    try:
        with progress.live() as live:
            while True:
                time.sleep(0.1)
                elapsed = time.monotonic() - t_train
                if injector is not None:
                    injector.tick(elapsed)
                if links is not None:
                    links.tick(elapsed)
                run.supervise()
                if time.monotonic() < next_status:
                    continue
                next_status = time.monotonic() + 0.5
                status = _status(client)
                leader_pid = run.pid_of("leader")
                if status is not None:
                    last_ok, answered = time.monotonic(), leader_pid
                    live.update(progress.render(status, elapsed))
                elif (cfg.supervise and leader_pid is not None and answered == leader_pid
                      and time.monotonic() - last_ok > liveness_s):
                    # A leader that answered before and then stayed silent for 3 heartbeat
                    # intervals is hung: kill and restart it (a liveness probe, §12).
                    run.event("unresponsive", "leader", silent_s=round(time.monotonic() - last_ok, 2))
                    os.kill(leader_pid, signal.SIGKILL)
                reason = stop_reason(cfg, status, elapsed, max_time_s)
                if reason is not None:
                    break
                if all(run.children[f"cluster-{c.id}"].proc.poll() is not None for c in cfg.clusters):
                    reason = "all clusters exited"
                    break
    except KeyboardInterrupt:
        run.console.print("[yellow]interrupted: stopping every process[/]")
        run.event("interrupt", "launcher")
        return True
    run.event("stop", "launcher", reason=reason)
    run.console.print(f"stopping: {reason}")
    return False


def _finish(run: Launch, client: Any, spec: RunSpec, secret: str, t_start: float,
            t_train: float | None, interrupted: bool) -> dict[str, Any]:
    """Stop clusters, let the last round finish, export and evaluate the model, summarize."""
    from dips.emu.summary import export_and_summarize

    cfg = run.cfg
    clusters = [n for n in run.children if n.startswith("cluster-")]
    run.stop(clusters, cfg.timeouts.shutdown_s)
    status = None
    if client is not None:
        deadline = time.monotonic() + cfg.timeouts.push_s + cfg.timeouts.pull_s
        while time.monotonic() < deadline:
            status = _status(client)
            if status is None or status.phase == Phase.IDLE.value:
                break
            time.sleep(0.2)
    train_s = time.monotonic() - t_train if t_train is not None else 0.0
    summary = export_and_summarize(cfg, run.run_dir, spec, secret, status, t_start, train_s,
                                   interrupted)
    run.console.print(summary_table(summary))
    return summary


def summary_table(summary: dict[str, Any]) -> str:
    keys = ["outer_steps", "updates_pushed", "updates_rejected", "tokens_consumed",
            "tokens_accepted", "eval_loss_initial", "eval_loss_final", "wall_time_s", "tokens_per_s"]
    lines = [f"  {k:<18} {summary.get(k)}" for k in keys]
    return "summary (" + str(summary.get("run_dir")) + "/summary.json):\n" + "\n".join(lines)
