"""``dips launch``: a whole Di-PS run on one machine, every role a separate OS process (§5).

A thin wrapper over the public role commands: it makes the run's certificates
(``RUN_DIR/pki``, as ``dips init`` does), prepares the data (tokenizer, token stream, chunks)
and the initial model once into the leader's state directory (``RUN_DIR``), and starts
exactly ``dips leader``, ``dips follower`` (state ``RUN_DIR/followers/<i>``) and ``dips
cluster`` (state ``RUN_DIR/clusters/<id>``), with ``evaluate:`` in the config also ``dips
evaluate`` (state ``RUN_DIR/evaluator``; the leader's held-out series goes to
``RUN_DIR/eval.jsonl``), on 127.0.0.1 (``network: netns``: each cluster in
its own network namespace, links shaped by tc tbf), each with its own certificate; shows live
progress; changes link rates on ``clusters[].link.schedule``; stops at the token budget,
``--max-outer-steps`` (the leader reports that many outer steps), ``--max-time``, SIGINT or
SIGTERM; pulls the final global model from the followers (as an observer with the operator's
certificate), evaluates it on the held-out split, saves it in HF format, and writes
``summary.json`` — at every phase, also when interrupted (``interrupted: true``,
``eval_loss_final: null`` when no complete model could be fetched).

Children run in their own sessions, so a signal reaches only the launcher, which then stops
them in order (clusters first, then followers and leader) with SIGTERM, and SIGKILL after
``timeouts.shutdown_s``. Only processes this launcher started are signalled, by pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from dips.algo import limits, liveness
from dips.algo.round import Phase
from dips.emu.children import EVALUATOR, CpuWindow, Interrupted, Launch, free_port, wait_for
from dips.emu.faults import FaultInjector, FaultPlan
from dips.emu.link_schedule import LinkSchedule
from dips.emu.metrics_targets import MetricsTargets
from dips.emu.preflight import check_clusters
from dips.emu.progress import Progress, summary_table
from dips.spec import RunConfig, RunSpec
from dips.wire.control import refusal_of
from dips.wire.pb import control_pb2 as pb
from dips.wire.pki import init_pki
from dips.wire.security import Credentials
from dips.wire.services import leader_client

__all__ = ["EVALUATOR", "Interrupted", "Launch", "free_port", "launch", "stop_reason",
           "summary_table"]

def _status(client: Any) -> pb.StatusReply | None:
    return _probe(client)[0]


def _probe(client: Any) -> tuple[pb.StatusReply | None, bool]:
    """(the leader's status or None, whether it answered at all). A typed refusal (e.g. BUSY)
    is an answer: only a leader that does not answer is hung, not one that refuses (issue 13:
    a status the leader failed to encode made the probe restart a live leader)."""
    try:
        return client.GetStatus(pb.StatusRequest(), timeout=1.0), True
    except grpc.RpcError as exc:
        return None, refusal_of(exc) is not None


def _role_args(run: Launch, spec_cfg: Path, host: str, leader_port: int,
               follower_ports: list[tuple[int, int]]) -> dict[str, list[str]]:
    """The public commands (and flags) of every process of the run."""
    d, pki = run.run_dir, run.run_dir / "pki"
    leader_addr = f"{host}:{leader_port}"
    args = {"leader": ["leader", "--config", str(spec_cfg), "--listen", leader_addr,
                       "--state-dir", str(d), "--tls", str(pki / "leader"),
                       "--status-socket", str(d / "leader.sock")]}
    for i, (data_port, control_port) in enumerate(follower_ports):
        args[f"follower-{i}"] = [
            "follower", "--leader", leader_addr, "--index", str(i),
            "--listen", f"{host}:{control_port}", "--data-listen", f"{host}:{data_port}",
            "--state-dir", str(d / "followers" / str(i)), "--tls", str(pki / f"follower-{i}"),
            "--init", str(d / "init" / "model.safetensors"),
            "--data-ipc", str(d / f"follower-{i}.ipc")]
    for c in run.cfg.clusters:
        args[f"cluster-{c.id}"] = [
            "cluster", "--leader", leader_addr, "--cluster-id", c.id,
            "--state-dir", str(d / "clusters" / c.id), "--tls", str(pki / f"cluster-{c.id}"),
            "--cache-dir", str(run.cfg.data.cache_dir.resolve())]
    if run.cfg.evaluate is not None:  # the periodic evaluator (issue 15): pull-only, as admin
        args[EVALUATOR] = ["evaluate", "--leader", leader_addr, "--every",
                           str(run.cfg.evaluate.every), "--state-dir", str(d / EVALUATOR),
                           "--tls", str(pki / "admin"),
                           "--cache-dir", str(run.cfg.data.cache_dir.resolve())]
    # Every process serves Prometheus metrics on a port it binds itself (README "Metrics");
    # metrics.json says where (dips.emu.metrics_targets).
    for name, argv in args.items():
        # With netns each cluster has its own address (dips.emu.netns), the servers the hub's.
        own = (run.net.addr(name[len("cluster-"):]) if run.net is not None
               and name.startswith("cluster-") else host)
        argv += ["--metrics-port", "0", "--metrics-host", own]
    run.metrics = MetricsTargets.from_args(d, args)
    return args


def launch(cfg: RunConfig, run_dir: Path, max_time_s: float | None = None,
           console: Console | None = None, faults: FaultPlan | None = None,
           max_outer_steps: int | None = None) -> dict[str, Any]:
    """Run Di-PS end to end; returns (and writes) the summary. See the module docstring.

    ``max_time_s`` and ``max_outer_steps`` (None: ``cfg.max_time_s``, ``cfg.max_outer_steps``)
    stop the run after that many seconds of training, or once the leader's status reports
    that many outer steps, whichever comes first (the token budget too). SIGINT and SIGTERM
    (even when inherited as ignored, e.g. started with ``&``) stop it at any phase; the
    summary is written all the same.

    Raises RuntimeError if a leader or follower process dies, TimeoutError on startup.
    """
    console = console or Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    # A re-used run directory starts empty of the previous run's outputs (they are appended to).
    for stale in ("leader.addr", "events.jsonl", "outer_steps.jsonl", "summary.json", "term",
                  "leader.json", "leader_events.jsonl", "train_start", "leader.sock", "run.json",
                  "config.json", "data_secret", "lock", "eval.jsonl",
                  *run_dir.glob("follower-*.ipc")):
        (run_dir / stale).unlink(missing_ok=True)  # a glob's path is absolute: itself
    for stale in ("followers", "clusters", "logs", "final", "init", "failpoints", "pki",
                  EVALUATOR):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    max_time_s = max_time_s if max_time_s is not None else cfg.max_time_s
    if max_time_s is not None:  # the leader ends the run at it too (clusters then exit 0)
        cfg = cfg.model_copy(update={"max_time_s": max_time_s})
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
    phase = "prepare"
    previous = {sig: signal.signal(sig, run.interrupts.handler)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        console.print(f"[bold]dips[/] preparing data and model for run {cfg.name!r} in {run_dir}")
        host = "127.0.0.1"
        if cfg.network == "netns":
            from dips.emu.netns import ShapedNetwork

            rates = {c.id: c.link.bps if c.link is not None else None for c in cfg.clusters}
            net = ShapedNetwork([c.id for c in cfg.clusters], rates)
            net.__enter__()
            run.net, host = net, net.hub_addr
            run.event("network", "launcher", mode="netns", hub=net.hub_addr, prefix=net.prefix,
                      rates_bps=rates)
        init_pki(run_dir / "pki", cfg.followers, [c.id for c in cfg.clusters], run_name=cfg.name)
        creds = Credentials.tls(run_dir / "pki" / "admin")
        from dips.train.prepare import prepare

        spec = prepare(cfg, run_dir)  # the leader finds it in its state directory
        check_clusters(cfg, [key for key, _, _ in spec.layers])  # before any process starts
        (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
        console.print(f"model {spec.params:,} parameters; {spec.train_tokens:,} train / "
                      f"{spec.val_tokens:,} validation tokens; initial validation loss "
                      f"{spec.eval_loss_initial:.3f}", soft_wrap=True)
        # Ports free here (the servers' namespace, with netns, is another: a heuristic there).
        args = _role_args(run, run_dir / "config.json", host, free_port(),
                          [(free_port(), free_port()) for _ in range(cfg.followers)])
        (run_dir / "leader.addr").write_text(args["leader"][args["leader"].index("--listen") + 1])
        phase = "start-up"
        run.spawn("leader", args["leader"])
        client = leader_client(f"unix:{run_dir / 'leader.sock'}", creds)
        wait_for(lambda: _status(client) is not None, cfg.timeouts.startup_s, "leader serving",
                  run)
        for i in range(cfg.followers):
            run.spawn(f"follower-{i}", args[f"follower-{i}"])
        wait_for(lambda: (s := _status(client)) and len(s.followers) == cfg.followers,
                  cfg.timeouts.startup_s, "followers registered", run)
        run.metrics.refresh()
        for c in cfg.clusters:
            run.spawn(f"cluster-{c.id}", args[f"cluster-{c.id}"])
        if EVALUATOR in args:
            run.spawn(EVALUATOR, args[EVALUATOR])
        # Training starts when the first cluster has joined (it trains from there): fault
        # times, link schedules, transients and --max-time count from this moment, as the
        # time to the token budget does.
        wait_for(lambda: (s := _status(client)) and len(s.clusters) > 0,
                  cfg.timeouts.startup_s, "first cluster joined", run)
        t_train, t0_wall = time.monotonic(), time.time()
        (run_dir / "train_start").write_text(repr(t0_wall))
        phase = "training"
        injector = None
        if faults is not None and faults.faults:
            injector = FaultInjector(faults, run.pid_of, run_dir / "failpoints", run.event,
                                     run.net)
        # Bandwidth schedules: tc tbf rate changes here (netns); the clusters' token buckets
        # follow them themselves on loopback (recorded here as events all the same).
        links = LinkSchedule(cfg.clusters, run.net, run.event)
        run.progress = Progress(cfg, console, run_dir, t0_wall)
        interrupted = _train(run, client, run.progress, t_train, max_time_s, injector, links)
        phase = "final export"
        summary = _finish(run, client, creds, spec, t_start, t_train, interrupted)
    except KeyboardInterrupt as exc:
        for sig in previous:  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        run.interrupts.handled()
        console.print(f"[yellow]interrupted ({exc or 'SIGINT'}) during {phase}: stopping every "
                      "process[/]")
        run.event("interrupt", "launcher", phase=phase)
        summary = _interrupted_summary(run, client, spec, t_start, t_train, phase)
    except (RuntimeError, TimeoutError) as exc:  # a child died or never came up: say so
        run.event("failed", "launcher", phase=phase, error=f"{type(exc).__name__}: {exc}")
        _interrupted_summary(run, None, spec, t_start, t_train, phase,
                             error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        run.stop(list(run.children), cfg.timeouts.shutdown_s)
        if client is not None:
            client.close()
        if run.net is not None:
            run.net.__exit__(None, None, None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return summary


def _interrupted_summary(run: Launch, client: Any, spec: RunSpec | None, t_start: float,
                         t_train: float | None, phase: str,
                         error: str | None = None) -> dict[str, Any]:
    """The summary of a run interrupted (or failed, ``error``) at ``phase``: the final model
    when the followers can still serve one, else ``eval_loss_final: null``."""
    if spec is not None and client is not None and phase in ("training", "final export"):
        try:
            return _finish(run, client, Credentials.tls(run.run_dir / "pki" / "admin"), spec,
                           t_start, t_train, True)
        except Exception as exc:  # keep going: a summary is written in every case
            run.event("export_failed", "launcher", error=f"{type(exc).__name__}: {exc}")
    summary = {"method": "di-ps", "run_dir": str(run.run_dir), "interrupted": error is None,
               "interrupted_phase": phase, "error": error, "clusters": len(run.cfg.clusters),
               "followers": run.cfg.followers, "outer_steps": 0, "eval_loss_final": None,
               "eval_loss_initial": spec.eval_loss_initial if spec else None,
               "wall_time_s": round(time.time() - t_start, 2), "model_dir": None}
    status = _status(client) if client is not None else None
    if status is not None:
        summary.update(outer_steps=status.outer_steps, final_version=status.version,
                       tokens_accepted=status.tokens_accepted)
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    run.console.print(summary_table(summary))
    return summary


def stop_reason(status: Any, elapsed_s: float, max_time_s: float | None) -> str | None:
    """Why the launcher stops the run now (None: it goes on): the leader's own verdict
    (``StatusReply.finished``: its token budget, counted by the ledger and never from what
    members report of themselves, its outer-step or time limit; :mod:`dips.algo.limits`), else
    the launcher's own time limit (``elapsed_s`` seconds of training >= ``max_time_s``), which
    holds even while the leader does not answer. ``status``: the leader's ``StatusReply``, or
    None."""
    if status is not None and status.finished:
        return status.finished
    return limits.stop_reason(tokens_accepted=0, outer_steps=0, training_s=elapsed_s,
                              token_budget=None, max_time_s=max_time_s)


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
    cpu = CpuWindow(liveness_s)
    next_status = 0.0
    status = None
    try:
        with progress.live() as live:
            while True:
                time.sleep(0.1)
                run.interrupts.check()
                elapsed = time.monotonic() - t_train
                if injector is not None:
                    injector.tick(elapsed)
                if links is not None:
                    links.tick(elapsed)
                run.supervise()
                if time.monotonic() < next_status:
                    continue
                next_status = time.monotonic() + 0.5
                status, alive = _probe(client)
                run.metrics.refresh()  # a role (re)started binds a port of its own
                leader_pid = run.pid_of("leader")
                busy = cpu.sample(leader_pid, time.monotonic())
                if alive:
                    last_ok, answered = time.monotonic(), leader_pid
                progress.log(status)
                if status is not None:
                    live.update(progress.render(status, elapsed))
                elif (cfg.supervise and leader_pid is not None and answered == leader_pid
                      and liveness.leader_hung(time.monotonic() - last_ok, busy, liveness_s)):
                    # Answered before, then hung by leader_hung's rule: kill and restart (§12).
                    run.event("unresponsive", "leader", cpu=busy,
                              silent_s=round(time.monotonic() - last_ok, 2))
                    os.kill(leader_pid, signal.SIGKILL)
                reason = stop_reason(status, elapsed, max_time_s)
                if reason is not None:
                    break
                if all(run.children[f"cluster-{c.id}"].proc.poll() is not None for c in cfg.clusters):
                    status = _status(client)  # clusters exit 0 when the leader ends the run
                    reason = (status.finished if status is not None and status.finished
                              else "all clusters exited")
                    break
    except KeyboardInterrupt as exc:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the clean-up runs to its end
            signal.signal(sig, signal.SIG_IGN)
        run.interrupts.handled()
        run.t_stop = time.monotonic()
        run.console.print(f"[yellow]interrupted ({exc or 'SIGINT'}): stopping every process[/]")
        run.event("interrupt", "launcher", phase="training")
        return True
    run.t_stop = time.monotonic()  # training ends here: not the shutdown, nor the final eval
    run.event("stop", "launcher", reason=reason)
    run.console.print(f"stopping: {reason}")
    return False


def _finish(run: Launch, client: Any, creds: Credentials, spec: RunSpec, t_start: float,
            t_train: float | None, interrupted: bool) -> dict[str, Any]:
    """Stop clusters, let the last round finish, export and evaluate the model, summarize."""
    from dips.emu.summary import export_and_summarize
    from dips.wire.keys import MemberKey

    cfg = run.cfg
    run.metrics.refresh()
    t_stop = run.t_stop if run.t_stop is not None else time.monotonic()
    run.stop([n for n in run.children if n.startswith("cluster-")], cfg.timeouts.shutdown_s)
    status = None
    if client is not None:
        deadline = time.monotonic() + cfg.timeouts.push_s + cfg.timeouts.pull_s
        while time.monotonic() < deadline:
            run.interrupts.check()
            status = _status(client)
            if status is None or status.phase == Phase.IDLE.value:
                break
            time.sleep(0.2)
    t_idle = time.monotonic()
    if status is not None and EVALUATOR in run.children and (status.finished or not interrupted):
        status = _final_eval(run, client, status)  # (Ctrl-C: only if the leader ended the run)
    if run.progress is not None:  # the last rounds' lines, before the summary
        run.progress.log(status, final=True)
    key = None
    if status is not None:  # the operator's pull-only data-plane key
        try:
            reply = client.JoinCluster(pb.JoinRequest(), timeout=10.0)
            key = MemberKey(reply.key_id, reply.key, reply.encrypt)
        except grpc.RpcError as exc:
            run.event("export_failed", "launcher", error=f"observer join: {exc.code().name}")
    times = {"train_time_s": t_stop - t_train if t_train is not None else 0.0,
             "shutdown_s": t_idle - t_stop, "final_eval_s": time.monotonic() - t_idle}
    summary = export_and_summarize(cfg, run.run_dir, spec, key, status, t_start, times,
                                   interrupted)
    run.console.print(summary_table(summary))
    return summary


def _final_eval(run: Launch, client: Any, status: Any) -> Any:
    """Let the evaluator report the final version (it does once it sees the run finished, or
    when told: the launcher's own clock ended the run), up to ``timeouts.rpc_s`` seconds; then
    stop it. Returns the latest status."""
    if not status.finished and not _ask_final(run):
        run.stop([EVALUATOR], run.cfg.timeouts.shutdown_s)
        return status
    deadline = time.monotonic() + run.cfg.timeouts.rpc_s
    while (time.monotonic() < deadline and run.pid_of(EVALUATOR) is not None
           and not (status.HasField("last_eval") and status.last_eval.version >= status.version)):
        time.sleep(0.2)
        run.interrupts.check()
        status = _status(client) or status
    run.stop([EVALUATOR], run.cfg.timeouts.shutdown_s)
    return status


def _ask_final(run: Launch) -> bool:
    """Send the evaluator SIGUSR1 (``dips.node.evaluate.FINAL_SIGNAL``: take the current
    version as the final one) if it is ready for it: its state directory's lock file names
    its pid (it installs the handler first). Returns whether it was sent."""
    pid = run.pid_of(EVALUATOR)
    try:
        ready = pid is not None and (run.run_dir / EVALUATOR / "lock").read_text().strip() == str(pid)
    except OSError:
        ready = False
    if ready:
        os.kill(pid, signal.SIGUSR1)
        run.event("final_eval_asked", EVALUATOR, pid=pid)
    return ready
