"""Di-PS as the sync of the training loop: the cluster client after every inner step (§5, §6, §12).

:class:`DiPSSync` plugs :class:`dips.roles.client.ClusterClient` into
:func:`dips.train.run.run_loop`: after every inner step it calls
:meth:`~dips.roles.client.ClusterClient.step_done`, which pushes, waits for the verdict and
pulls once H inner steps have passed since the last sync (and any retry backoff expired); the
outcome goes into that step's ``train.jsonl`` record as ``push``.  When the leased chunks are
used up it leases more (:meth:`~dips.roles.client.ClusterClient.maintain`); faults stay local:
training goes on with the local model while the leader or a follower is unreachable.
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

__all__ = ["DiPSSync", "push_record"]


def push_record(res: SyncResult) -> dict[str, Any]:
    """The ``push`` field of a sync step's record (seconds rounded to 0.1 ms)."""
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

    def join(self, stop: threading.Event, timeout_s: float, retry_s: float = 1.0) -> int:
        """Join (pull one complete model of a single version, lease data), retrying every
        ``retry_s`` seconds while the leader restarts or waits for its followers.

        Returns the version pulled.  Raises RuntimeError after ``timeout_s`` seconds or once
        ``stop`` is set, and at once when the leader refuses this cluster for good (its
        certificate, a revoked id, a model that differs from the run's); Refused(RUN_FINISHED)
        when the run has ended.
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
                if stop.is_set() or time.monotonic() > deadline:
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
        sync attempt, else nothing."""
        res = self.client.step_done(result.tokens, result.loss)
        return {} if res is None else {"push": push_record(res)}

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
