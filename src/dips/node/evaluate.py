"""``dips evaluate``: the periodic evaluator (issue 15), an optional role that makes the global
model's quality a time series instead of one number at the end.

With the operator's bundle (``pki/admin`` from ``dips init``, the identity ``dips export``
uses) it asks the leader for the run spec, loads the model and the held-out split once
(:class:`dips.emu.summary.HeldOut`, the evaluation of ``dips export``), and then looks at the
leader's status every ``poll_s`` seconds. When a version is due
(:class:`dips.algo.evaluation.Schedule`: every ``--every`` versions, and the final one once the
run finished) and every follower is ready, it joins as an observer (a pull-only data-plane
key, never a member: it cannot push and never leases data chunks), pulls that version in FP32
from the followers' data planes, computes the held-out loss (nats/token) and reports it to the
leader (``ReportEval``), which appends it to its ``eval.jsonl`` (:mod:`dips.roles.leader_eval`).

Faults: a pull that fails (a follower down or restarted, the run moved on during the pull) is
retried with a growing delay (0.5 s doubling to 30 s) at the then-current version, so the
evaluator skips to the newest; a leader that does not answer is asked again (gRPC reconnects
to a restarted one), and a report it could not take is sent again; a report the leader refuses
(INVALID_ARGUMENT, e.g. a version it rolled back) is logged and not retried. Every call has a
deadline (the run's ``timeouts.rpc_s``). It runs one torch thread at a lowered CPU priority
(:data:`NICE`): beside training, the scheduler favours the training. A restarted evaluator
continues after the last version the leader recorded (``GetStatus.last_eval``). After a
rollback (the leader's version below the last one evaluated) it goes on from the multiple of
``--every`` at or below the leader's version (:meth:`dips.algo.evaluation.Schedule.rolled_back`:
the versions above are made again, with other content, and the leader takes their reports).
SIGTERM/SIGINT stop it (exit 0); it keeps running after the run finished (having evaluated the
final version) until stopped. SIGUSR1 (:data:`FINAL_SIGNAL`) asks it to take the current
version as the final one (evaluated once, if not yet): ``dips launch`` sends it when its own
clock (``--max-time``) ends the run before the leader has; the handler is installed before the
state directory's lock file names this process, so a sender that sees its pid there is safe.
``--state-dir`` (optional) is locked for the process and holds ``evaluate.json``: the last
record the leader accepted from it, and its counts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from dips.algo.evaluation import EvalReport, Schedule
from dips.algo.refusal import Refusal
from dips.node.common import RoleError, StateDir, Unreachable, fetch_spec
from dips.roles.durable import write_atomic
from dips.wire import heldout
from dips.wire.control import describe, refusal_of
from dips.wire.keys import MemberKey
from dips.wire.pb import control_pb2 as pb
from dips.wire.status_msg import followers_total
from dips.wire.security import Credentials

log = logging.getLogger(__name__)

#: Seconds between looks at the leader's status.
POLL_S = 0.5
#: The signal that asks for the current version as the final one (see the module docstring).
FINAL_SIGNAL = signal.SIGUSR1
#: How much the evaluator lowers its CPU priority (``os.nice``): on a host shared with training
#: (``dips launch``) the scheduler favours the training.
NICE = 10



def eval_line(rec: dict[str, Any]) -> str:
    """The log line of a held-out record the leader accepted: loss to 4 decimals
    (nats/token), perplexity to 2 (review 28 of issue 15, #7: it was printed unrounded;
    "overflow" where exp overflowed, the record's null), tokens accepted ("unknown": null)."""
    ppl = rec.get("perplexity")
    ppl_s = f"{ppl:,.2f}" if isinstance(ppl, (int, float)) and math.isfinite(ppl) else "overflow"
    tok = rec.get("tokens_accepted")
    tok_s = f"{tok:,}" if isinstance(tok, int) and tok >= 0 else "unknown"
    return (f"version {rec['version']}: held-out loss {rec['eval_loss']:.4f} nats/token "
            f"(perplexity {ppl_s}), {tok_s} tokens accepted")

class Evaluator:
    """The evaluator's loop (see the module docstring); :meth:`step` is one look.

    Args:
        client: a :class:`dips.wire.control.Client` of the Leader service (the ``admin``
            identity).
        held: a :class:`dips.emu.summary.HeldOut` of the run (model and held-out split).
        schedule: which versions (:class:`dips.algo.evaluation.Schedule`).
        rpc_s: deadline of every call to the leader (seconds).
        metrics: a :class:`dips.node.metrics_members.EvaluatorMetrics`, or None.
        state_file: where the last accepted record and counts go (``evaluate.json``), or None.
    """

    def __init__(self, client: Any, held: Any, schedule: Schedule, rpc_s: float,
                 metrics: Any = None, state_file: Path | None = None, leader: str = "") -> None:
        self.client, self.held, self.schedule, self.rpc_s = client, held, schedule, rpc_s
        self.metrics, self.state_file = metrics, state_file
        self.key: MemberKey | None = None
        self.pending: EvalReport | None = None  # evaluated, not yet taken by the leader
        self.resumed = False
        self.counts = {"reported": 0, "refused": 0, "failed": 0}
        #: Set (e.g. by :data:`FINAL_SIGNAL`): the run ended outside the leader; evaluate its
        #: current version as the final one.
        self.final = threading.Event()
        self.last: dict[str, Any] | None = None
        self._unreachable = Unreachable(f"evaluator: leader {leader}")

    def step(self, now: float) -> float:
        """One look at the leader at ``now`` (monotonic seconds): pull, evaluate and report
        a due version, or retry a report. Returns the seconds to wait before the next look.
        Raises RoleError if the leader refuses this identity (FORBIDDEN: exit 2)."""
        try:
            status = self.client.GetStatus(pb.StatusRequest(), timeout=self.rpc_s)
        except grpc.RpcError as exc:
            self._forbidden(exc)
            self._unreachable.failed(describe(exc))
            self.key = None  # a restarted leader: join again
            return 1.0
        self._unreachable.answered()
        if not self.resumed:  # go on after what the leader recorded (a restarted evaluator)
            self.resumed = True
            rec = heldout.last_eval(status)
            if rec is not None:
                self.schedule.done(rec["version"])
                log.info("the leader has held-out losses up to version %d: going on from there",
                         rec["version"])
        if self.schedule.rolled_back(status.version):
            log.info("the leader rolled back to version %d: evaluating again from version %d",
                     status.version, self.schedule.last)
        if self.pending is not None:
            return self._report(now) if now >= self.schedule.not_before else \
                self.schedule.not_before - now
        total = followers_total(status)  # the run's, not those registered so far
        ready = total > 0 and status.followers_ready == total == len(status.followers)
        finished = bool(status.finished) or self.final.is_set()
        version = self.schedule.target(status.version, finished, ready, now)
        if version is None:
            return POLL_S
        return self._evaluate(status, version, now)

    def _evaluate(self, status: pb.StatusReply, version: int, now: float) -> float:
        if self.key is None:
            try:
                reply = self.client.JoinCluster(pb.JoinRequest(), timeout=self.rpc_s)
            except grpc.RpcError as exc:
                self._forbidden(exc)
                return self._failed(now, f"observer join: {describe(exc)}")
            self.key = MemberKey(reply.key_id, reply.key, reply.encrypt)
        t0 = time.monotonic()
        loss, got, error = self.held.pull_and_evaluate(
            lambda: (list(status.followers), version), self.key)
        if loss is None or got is None:
            self.key = None  # a restarted follower or leader may no longer take it
            return self._failed(now, f"pull of version {version}: {error}")
        if self.metrics is not None:
            self.metrics.seconds.observe(time.monotonic() - t0)
        self.pending = EvalReport(got, loss, self.held.eval_tokens)
        return self._report(now)

    def _report(self, now: float) -> float:
        report = self.pending
        assert report is not None
        try:
            rec = heldout.report_eval(self.client, report, self.rpc_s)
        except grpc.RpcError as exc:
            self._forbidden(exc)
            if refusal_of(exc) is not Refusal.INVALID_ARGUMENT:
                return self._failed(now, f"report of version {report.version}: {describe(exc)}")
            log.warning("the leader refused the report of version %d: %s", report.version,
                        exc.details())
            self._count("refused")
        else:
            self.last = rec
            self._count("reported")
            log.info("%s", eval_line(rec))
            if self.metrics is not None:
                self.metrics.version.set(rec["version"])
        self.schedule.done(report.version)
        self.pending = None
        self._save()
        return 0.0

    def _failed(self, now: float, what: str) -> float:
        delay = self.schedule.failed(now)
        self._count("failed")
        log.warning("%s; trying again in %.1f s (%d failures in a row)", what, delay,
                    self.schedule.failures)
        return delay

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        if self.metrics is not None:
            self.metrics.evaluations.labels(result=result).inc()

    def _forbidden(self, exc: grpc.RpcError) -> None:
        if refusal_of(exc) is Refusal.FORBIDDEN or exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            raise RoleError(f"the leader refused this identity: {exc.details()}")

    def _save(self) -> None:
        if self.state_file is None:
            return
        doc = {"last": self.last, "counts": self.counts, "every": self.schedule.every}
        try:
            write_atomic(self.state_file, json.dumps(doc, indent=1).encode())
        except OSError as exc:
            log.warning("cannot write %s: %s", self.state_file, exc)

    def run(self, stop: threading.Event) -> None:
        """Look at the leader until ``stop`` is set."""
        while not stop.is_set():
            stop.wait(self.step(time.monotonic()))


def run_evaluate(leader_addr: str, every: int, creds: Credentials, stop: threading.Event, *,
                 state: Path | None = None, cache_dir: Path | None = None,
                 metrics_port: int | None = None, metrics_host: str = "0.0.0.0",
                 timeout_s: float = 180.0) -> int:
    """Evaluate every ``every``-th version of the run led at ``leader_addr`` until ``stop``;
    returns the exit code (0). ``state``: the state directory (None: none); ``cache_dir``: the
    tokenizer/token cache (default: the config's); ``metrics_port``: serve Prometheus metrics
    there (0: a free port, logged); ``timeout_s``: seconds to wait for the leader's run spec.

    Raises:
        RoleError: not the operator's identity, ``every`` < 1, a state directory in use, no
            leader within ``timeout_s`` seconds, or the leader refuses this identity.
        Stopped: SIGTERM/SIGINT before the run spec arrived (a clean stop).
    """
    if creds.identity.role != "admin":
        raise RoleError(f"--tls: the certificate is {creds.identity.name!r}; dips evaluate needs "
                        "the operator's bundle (pki/admin)")
    if every < 1:
        raise RoleError(f"--every {every}: must be >= 1 (versions)")
    try:  # a background role: the CPU scheduler favours the training (also while importing)
        os.nice(NICE)
    except OSError:
        pass
    import torch

    from dips.emu.summary import HeldOut
    from dips.wire.services import leader_client

    torch.set_num_threads(1)  # one core at most, next to the training
    final = threading.Event()
    try:  # before the lock file names this process (see the module docstring)
        signal.signal(FINAL_SIGNAL, lambda *_: final.set())
    except ValueError:  # not the main thread (a test): no signal, the event only
        pass
    if state is not None:
        StateDir(state).acquire()
    spec, _ = fetch_spec(leader_addr, creds, stop, timeout_s)
    cfg = spec.config
    try:
        held = HeldOut(cfg, (cache_dir or cfg.data.cache_dir).resolve(), spec)
    except ValueError as exc:  # this host's copy of the data differs from the run's
        raise RoleError(str(exc)) from None
    metrics = server = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from dips.node.metrics import serve_metrics
        from dips.node.metrics_members import EvaluatorMetrics

        registry = CollectorRegistry()
        metrics = EvaluatorMetrics(registry)
        server = serve_metrics(registry, metrics_port, metrics_host, state)
    client = leader_client(leader_addr, creds, timeout_s=cfg.timeouts.rpc_s)
    evaluator = Evaluator(client, held, Schedule(every), cfg.timeouts.rpc_s, metrics,
                          state / "evaluate.json" if state is not None else None, leader_addr)
    evaluator.final = final
    log.info("evaluating every %d versions of the run at %s (%d held-out tokens per evaluation)",
             every, leader_addr, held.eval_tokens)
    try:
        evaluator.run(stop)
    finally:
        client.close()
        if server is not None:
            server.close()
    log.info("stopped: %d reports accepted, %d refused, %d failed tries", *evaluator.counts.values())
    return 0
