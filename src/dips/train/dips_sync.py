"""Di-PS as the sync of the training loop: the cluster client after every inner step (§5, §6, §12).

:class:`DiPSSync` plugs :class:`dips.roles.client.ClusterClient` into
:func:`dips.train.run.run_loop`: after every inner step it calls
:meth:`~dips.roles.client.ClusterClient.step_done`, which pushes, waits for the verdict and
pulls once H inner steps have passed since the last sync (and any retry backoff expired); the
outcome goes into that step's ``train.jsonl`` record as ``push``.  When the leased chunks are
used up it leases more (:meth:`~dips.roles.client.ClusterClient.maintain`); faults stay local:
training goes on with the local model while the leader or a follower is unreachable, for up
to ``inner.hold_after`` sync intervals; then, and while a verdict or a re-join is pending,
the cluster holds between steps (:meth:`DiPSSync.held`, :mod:`dips.algo.hold`) instead of
training what no push could carry.

:class:`InnerStateSync` wraps a cluster's sync (this one, or a torchrun cluster's
:class:`dips.train.ddp.RankSync`) to checkpoint its inner AdamW state and data position
after every pull and resume them before the join (issue 14; :mod:`dips.roles.cluster_state`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from dips.algo.refusal import Refusal, Refused
from dips.roles.client import FINAL_REFUSALS, ClusterClient
from dips.roles.cluster import SyncResult
from dips.train.trainer import ClusterTrainer, StepResult
from dips.wire.control import describe, refusal_of

log = logging.getLogger(__name__)

__all__ = ["DiPSSync", "InnerStateSync", "data_position", "push_record"]


def push_record(res: SyncResult) -> dict[str, Any]:
    """The ``push`` field of a sync step's record (seconds rounded to 0.1 ms); the cluster's
    log gets one line of it (a cluster's progress off its train.jsonl; review 24, F6)."""
    if res.round < 0:  # no round granted (the run finished, the leader unreachable)
        log.info("no push made (%s): version %s, %s tokens trained since the last sync",
                 res.reason or "not granted", res.version, res.tokens)
    else:
        log.info("push of round %s %s%s: version %s, %s tokens; push %.1f s, verdict %.1f s, "
                 "pull %.1f s", res.round, "accepted" if res.accepted else "not accepted",
                 "" if res.accepted or not res.reason else f" ({res.reason})", res.version,
                 res.tokens, res.push_s, res.wait_s, res.pull_s)
    return {"accepted": res.accepted, "ok": res.ok, "version": res.version, "round": res.round,
            "tokens": res.tokens, "score": res.score, "reason": res.reason,
            "push_s": round(res.push_s, 4), "wait_s": round(res.wait_s, 4),
            "pull_s": round(res.pull_s, 4)}


class DiPSSync:
    """The Di-PS sync of one cluster (module docstring); no gradient hook.

    Args:
        client: the cluster's client, built over the trainer's model with the trainer's
            LeaseSampler as its ledger-aware data source.
    """

    grad_hook = None

    def __init__(self, client: ClusterClient) -> None:
        self.client = client

    def count_from(self, steps: int, tokens: int) -> None:
        """The client counts on from a resumed state's counters
        (:meth:`dips.roles.client.ClusterClient.count_from`)."""
        self.client.count_from(steps, tokens)

    def join(self, stop: threading.Event, timeout_s: float, retry_s: float = 1.0) -> int:
        """Join (pull one complete model of a single version, lease data), retrying every
        ``retry_s`` seconds while the leader restarts or waits for its followers.

        Returns the version pulled.  Raises RuntimeError after ``timeout_s`` seconds without
        an answer that says to wait, or once ``stop`` is set, and at once when the leader
        refuses this cluster for good (its certificate, a revoked id, a model that differs from
        the run's); Refused(RUN_FINISHED) when the run has ended.  A NOT_READY answer (the
        leader waits for a follower that is down or still starting) restarts the ``timeout_s``
        count: a live leader that says "wait" is waited for, however long its follower is out.
        """
        deadline = time.monotonic() + timeout_s
        said = 0.0
        while True:
            try:
                return self.client.join()
            except (grpc.RpcError, RuntimeError) as exc:
                if isinstance(exc, grpc.RpcError) and refusal_of(exc) is Refusal.RUN_FINISHED:
                    self.client.finished = exc.details() or "run finished"
                    raise Refused(Refusal.RUN_FINISHED, self.client.finished) from None
                if isinstance(exc, grpc.RpcError) and refusal_of(exc) in FINAL_REFUSALS:
                    raise RuntimeError(f"cluster {self.client.cluster_id}: join refused: "
                                       f"{describe(exc)}") from None
                waiting = isinstance(exc, grpc.RpcError) and refusal_of(exc) is Refusal.NOT_READY
                if waiting:
                    deadline = time.monotonic() + timeout_s
                if stop.is_set() or (not waiting and time.monotonic() > deadline):
                    raise RuntimeError(f"cluster {self.client.cluster_id}: join failed: {exc}") from None
                if time.monotonic() - said >= 10.0:  # why it waits, not only gRPC's own log
                    said = time.monotonic()
                    log.warning("cluster %s: join not possible yet: %s", self.client.cluster_id,
                                describe(exc) if isinstance(exc, grpc.RpcError) else exc)
                stop.wait(retry_s)

    def before_step(self, trainer: ClusterTrainer, stop: threading.Event) -> bool:
        """Go on until stopped (a cluster may leave at any step, §12) or the run finished."""
        return not stop.is_set() and not self.client.finished

    def after_step(self, trainer: ClusterTrainer, result: StepResult,
                   stop: threading.Event) -> dict[str, Any]:
        """Count the step; sync when H steps have passed.  Returns ``{"push": ...}`` after a
        sync attempt, else nothing.  Never holds here (:meth:`held` does, between steps)."""
        res = self.client.step_done(result.tokens, result.loss, wait=False)
        return {} if res is None else {"push": push_record(res)}

    def sync_due(self, trainer: ClusterTrainer) -> bool:
        """Whether :meth:`after_step` of the step just trained may sync (H steps reached)."""
        return self.client.sync_due_after_step()

    def held(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any] | None:
        """One short step of the cluster's hold (:meth:`~dips.roles.client_hold.HoldMixin.
        hold_tick`, :mod:`dips.algo.hold`): None when it may train; else the fields of an
        event record to write (``{}``: none), and no inner step now. The hold's start is
        ``{"event": "hold", "reason", "steps_since_sync", "last_failure"}``, its end
        ``{"event": "hold_end", "reason", "held_s", "push": ...}`` (``push``: the sync that
        ended it, if one did)."""
        go, event = self.client.hold_tick()
        if event is None:
            return None if go else {}
        rec: dict[str, Any] = {"event": event.kind, "reason": event.reason,
                               "steps_since_sync": event.steps_since_sync}
        if event.kind == "hold":
            rec["last_failure"] = event.last_failure
        else:
            rec["held_s"] = round(event.held_s, 3)
            if event.sync is not None:
                rec["push"] = push_record(event.sync)
        return rec

    def starved(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any]:
        """Every leased window is trained: push what was trained since the last sync even if
        fewer than H steps (the chunks finish, and a new epoch begins, only once their windows
        are accepted; §12), then lease more; wait 0.5 s if the leader gave none. Returns
        ``{"push": ...}`` when it pushed, else nothing."""
        res = self.client.flush()
        self.client.maintain()
        batches = trainer.batches
        if batches.available() < batches.batch_size:  # type: ignore[attr-defined]
            # Nothing more to lease now: train the windows left even if fewer than a batch
            # (their chunks finish only then); with none left, wait for the others.
            batches.drain = True  # type: ignore[attr-defined]
            if batches.available() == 0:  # type: ignore[attr-defined]
                stop.wait(0.5)
        return {} if res is None else {"push": push_record(res)}


def data_position(batches: Any) -> dict[str, Any]:
    """A ledger-aware batch source's position (JSON): ``held`` [[chunk, window position]]
    and ``drain``."""
    return {"held": sorted([int(c), int(p)] for c, p in batches.positions().items()),
            "drain": bool(getattr(batches, "drain", False))}


class InnerStateSync:
    """A sync (:class:`DiPSSync`, or a multi-rank cluster's
    :class:`dips.train.ddp.RankSync`) whose cluster checkpoints its inner optimizer
    (:class:`dips.roles.cluster_state.InnerStateStore`, issue 14):

    * :meth:`join` first loads the saved state (refusing a corrupt or foreign one before
      anything is asked of the leader: InnerStateError), then joins; the join takes the
      data position from the leader's ledger, and :attr:`resumed` compares it with the
      saved hint (``kept``: chunks leased again at the saved position; ``refused``: chunks
      the ledger gave elsewhere or at another position — the ledger wins);
    * after every step whose sync pulled (``push.ok``: the local model is then one global
      version and the data position the ledger's accepted one) it saves the state, the
      position and the trainer's counters for that version. A save that fails is logged
      and reported in the step's record (``inner_state``); training goes on.

    Every rank of a multi-rank cluster calls it alike (the store's collectives).
    """

    def __init__(self, inner: Any, store: Any, trainer: ClusterTrainer) -> None:
        self.inner, self.store, self.trainer = inner, store, trainer
        self.grad_hook = inner.grad_hook
        #: The ``resume`` record after a join that loaded a saved state (else None).
        self.resumed: dict[str, Any] | None = None

    def join(self, stop: threading.Event, timeout_s: float) -> Any:
        meta = self.store.load()
        digests = self.store.digests() if meta is not None else None
        if meta is not None:
            counters = meta.get("counters") or {}
            self.trainer.steps = int(counters.get("steps", self.trainer.steps))
            self.trainer.tokens = int(counters.get("tokens", self.trainer.tokens))
            if (count_from := getattr(self.inner, "count_from", None)) is not None:
                count_from(self.trainer.steps, self.trainer.tokens)  # heartbeats: resumed
        joined = self.inner.join(stop, timeout_s)
        if meta is not None and joined is not False:
            hint = {int(c): int(p) for c, p in (meta.get("data") or {}).get("held", [])}
            leased = self.trainer.batches.positions()
            self.resumed = {
                "event": "resume", "version": meta["version"], "saved_step": meta["step"],
                "steps": self.trainer.steps, "tokens": self.trainer.tokens,
                "digest": digests[0], "ranks": digests,
                "data": {"hint": sorted([c, p] for c, p in hint.items()),
                         "leased": sorted([int(c), int(p)] for c, p in leased.items()),
                         "kept": sorted(c for c in hint if leased.get(c) == hint[c]),
                         "refused": sorted(c for c in hint if leased.get(c) != hint[c])}}
            log.info("cluster: inner AdamW state of version %s resumed (step %s); data: "
                     "chunks %s kept, %s given elsewhere by the ledger", meta["version"],
                     meta["step"], self.resumed["data"]["kept"], self.resumed["data"]["refused"])
        return joined

    def before_step(self, trainer: ClusterTrainer, stop: threading.Event) -> bool:
        return self.inner.before_step(trainer, stop)

    def held(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any] | None:
        """The inner sync's hold; a sync that ended it saves the state as after a step."""
        fields = self.inner.held(trainer, stop)
        return None if fields is None else self._saved(trainer, fields)

    def sync_due(self, trainer: ClusterTrainer) -> bool:
        due = getattr(self.inner, "sync_due", None)
        return bool(due is not None and due(trainer))

    def after_step(self, trainer: ClusterTrainer, result: StepResult,
                   stop: threading.Event) -> dict[str, Any]:
        return self._saved(trainer, self.inner.after_step(trainer, result, stop))

    def starved(self, trainer: ClusterTrainer, stop: threading.Event) -> dict[str, Any]:
        return self._saved(trainer, self.inner.starved(trainer, stop))

    def _saved(self, trainer: ClusterTrainer, fields: dict[str, Any] | None) -> dict[str, Any]:
        push = (fields or {}).get("push")
        if not push or not push.get("ok"):
            return fields or {}
        try:
            path = self.store.save(int(push["version"]), data_position(trainer.batches),
                                   {"steps": trainer.steps, "tokens": trainer.tokens})
            if path is not None:
                fields["inner_state"] = {"version": int(push["version"]), "path": path.name}
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("cluster: inner state of version %s not saved: %s", push["version"], exc)
            fields["inner_state"] = {"version": int(push["version"]), "error": str(exc)}
        return fields
