"""The real-time training loop of one cluster process, with the synchronisation plugged in.

Every real-time method runs the same loop (:func:`run_loop`): inner steps of a
:class:`~dips.train.trainer.ClusterTrainer` (§3), the injected delay of an emulated slower
cluster after each step (§13, a :class:`Pacer`), a data lease when the batch source runs dry
(§12), and one ``train.jsonl`` record per inner step (:class:`TrainLog`).  What differs
between methods is only how a cluster synchronises with the others, a :class:`Sync`, in the
way torchtitan plugs semi-synchronous training (torchft's LocalSGD / DiLoCo) into one train
step:

==========================================  ===================================================
sync                                        what it does
==========================================  ===================================================
:class:`dips.train.dips_sync.DiPSSync`      Di-PS: push / verdict / pull every H steps through
                                            :meth:`dips.roles.client.ClusterClient.step_done`
``dips.baselines.real_diloco``              barrier + all-reduce of Δ every H steps, Nesterov
``dips.baselines.real_async``               naive async gossip of Δ to every peer (§4)
``dips.baselines.real_dp``                  per-step gradient all-reduce (``grad_hook``)
==========================================  ===================================================

A sync's own start (join, start barrier) and end (leave, final snapshot) happen around the
loop, in the process's entry point.  This module imports only the standard library at import
time, so the leader's process can use :func:`stop_on_signals` without loading torch.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dips.train.trainer import ClusterTrainer, GradHook, StepResult

__all__ = ["Pacer", "Sync", "TrainLog", "run_loop", "stop_on_signals"]


class Pacer(Protocol):
    """The injected delay of an emulated cluster (e.g. :class:`dips.emu.pacing.Pacer`)."""

    def delay(self, compute_s: float, t: float) -> float:
        """Seconds to wait after a step whose compute took ``compute_s`` s, ending ``t`` s
        after the common start."""
        ...


class Sync(Protocol):
    """How a cluster synchronises with the others; the loop calls, for every inner step:

    1. :meth:`before_step` — may synchronise (H steps done) and says whether to go on;
    2. :meth:`held` — None to train now; else no inner step this time round (the fields of an
       event record to write, ``{}`` for none), e.g. Di-PS holding while it cannot sync
       (:mod:`dips.algo.hold`); it waits a little, never long, so the loop checks again;
    3. the inner step, with :attr:`grad_hook` (if not None) between backward and the optimizer
       step (after the step's injected delay);
    4. :meth:`after_step` — may synchronise; returns fields for the step's record.

    A sync may also have ``sync_due(trainer) -> bool`` (optional: the baselines have none):
    True when :meth:`after_step` of the step just trained may synchronise; the loop then
    writes a ``sync_start`` record (``inner_step``, ``tokens``) before it, so that a process
    killed in the middle of that sync leaves its last step counted
    (:mod:`dips.algo.consumed`).

    ``stop`` is the process's local stop request (signal, time limit).  A sync whose peers wait
    for it (an all-reduce) goes on until it has told them; the others end at once.
    """

    grad_hook: GradHook | None

    def before_step(self, trainer: ClusterTrainer, stop: threading.Event) -> bool:
        """False ends the loop (before this step)."""
        ...

    def held(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any] | None:
        """None: train the next step now; else skip it (fields of an event record, maybe
        empty). Waits at most a second or so."""
        ...

    def after_step(self, trainer: ClusterTrainer, result: StepResult,
                   stop: threading.Event) -> dict[str, Any]:
        """Fields to add to this step's ``train.jsonl`` record (may be empty)."""
        ...

    def starved(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any] | None:
        """The batch source has no batch left (NoData): lease more, or wait briefly. May
        synchronise (e.g. push fewer than H steps); returns fields for an event record."""
        ...


class TrainLog:
    """``clusters/<id>/train.jsonl``: one JSON line per inner step and per event.

    A step record holds ``step``, ``loss`` (nats/token, 5 decimals), ``tokens`` (tokens this
    cluster trained on so far), ``compute_s`` (seconds, 4 decimals), ``delay_s`` (the injected
    delay, seconds; only with ``delay=True``), the sync's fields and ``time``.

    Args:
        path: the file (appended to, line-buffered; its folder is created).
        stamp: the ``time`` of a record: epoch seconds for ``dips launch`` (``time.time``),
            seconds since the common start for the baselines.
        delay: record ``delay_s`` on step records (the baselines do, Di-PS never did).
        observer: called with every record once written (``dips cluster``'s metrics); it
            runs on the training thread, so it must be quick.
    """

    def __init__(self, path: Path, stamp: Callable[[], float], delay: bool = True,
                 observer: Callable[[dict[str, Any]], None] | None = None) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)
        self._stamp = stamp
        self._delay = delay
        self._observer = observer

    def write(self, rec: dict[str, Any]) -> None:
        """Append ``rec`` as one line (``time`` added unless present), then hand it to the
        observer (one that fails is logged, never raised into training)."""
        rec.setdefault("time", self._stamp())
        self._file.write(json.dumps(rec) + "\n")
        if self._observer is not None:
            try:
                self._observer(rec)
            except Exception:
                logging.getLogger(__name__).exception("the train.jsonl observer failed")

    def step(self, step: int, result: StepResult, tokens: int, delay_s: float,
             fields: dict[str, Any]) -> None:
        """Append the record of inner step ``step`` (1-based) with the sync's ``fields``."""
        rec: dict[str, Any] = {"step": step, "loss": round(result.loss, 5), "tokens": tokens,
                               "compute_s": round(result.compute_s, 4)}
        if self._delay:
            rec["delay_s"] = round(delay_s, 4)
        rec.update(fields)
        self.write(rec)

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set (call from the main thread)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def run_loop(trainer: ClusterTrainer, sync: Sync, stop: threading.Event, pacer: Pacer | None,
             log: TrainLog, clock: Callable[[], float]) -> int:
    """Train until ``sync`` says to stop; returns the inner steps run.

    Each step: unless :meth:`Sync.held` says not now, ``trainer.step`` (with the sync's
    gradient hook), the injected delay ``pacer.delay(compute_s, clock())`` waited on ``stop``
    (so a stop request cuts it short), the sync's :meth:`Sync.after_step`, one :meth:`TrainLog.step` record.  With a gradient
    hook the delay comes before the hook (after backward): a slow cluster reaches the
    all-reduce late, as its compute would.  When the batch source raises NoData nothing is
    trained and :meth:`Sync.starved` is called.

    Args:
        clock: seconds since the common start (the pacer's transient slowdowns count from it).

    Raises:
        FloatingPointError: a non-finite training loss (the step is not applied).
    """
    from dips.train.lease import NoData

    def pace(compute_s: float) -> float:
        delay = pacer.delay(compute_s, clock()) if pacer is not None else 0.0
        if delay > 0:
            stop.wait(delay)
        return delay

    steps = 0
    while sync.before_step(trainer, stop):
        held = sync.held(trainer, stop)
        if held is not None:  # no inner step now (e.g. a Di-PS cluster that cannot sync)
            if held:
                log.write({**held, "tokens": trainer.tokens})
            continue
        delay_s = 0.0
        hook = None
        if sync.grad_hook is not None:
            t0 = time.monotonic()

            def hook(params: Any, _t0: float = t0) -> None:
                nonlocal delay_s
                delay_s = pace(time.monotonic() - _t0)
                sync.grad_hook(params)

        try:
            result = trainer.step(hook)
        except NoData:
            fields = sync.starved(trainer, stop)
            if fields:  # e.g. a push of fewer than H steps (the data ran out)
                log.write({"event": "starved", "tokens": trainer.tokens, **fields})
            continue
        if hook is None:
            delay_s = pace(result.compute_s)
        due = getattr(sync, "sync_due", None)  # optional (a Di-PS sync has it)
        if due is not None and due(trainer):
            # The step's own line comes after its sync: a process killed in that sync (a
            # push, a pull) still leaves the step it trained counted (review 33, m5).
            log.write({"event": "sync_start", "inner_step": trainer.steps,
                       "tokens": trainer.tokens})
        fields = sync.after_step(trainer, result, stop)
        log.step(trainer.steps, result, trainer.tokens, delay_s, fields)
        steps += 1
    return steps
