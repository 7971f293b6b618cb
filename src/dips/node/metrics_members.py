"""Prometheus metrics of ``dips follower``, ``dips cluster`` and ``dips evaluate`` (see
:mod:`dips.node.metrics` for the leader's, the endpoint and how metrics are fed). Their counters
count from the process start: these roles persist no counts (Prometheus' ``rate()`` handles
the reset).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dips.node.metrics import SECONDS

#: Follower calls timed by :class:`TimedShard` (``apply`` prepares an outer step, ``commit``
#: makes it current: together the update).
CALLS = ("score", "aggregate", "apply", "commit", "restore")
#: Step records the tokens/s gauge is measured over (a few syncs' worth at H = 8).
RATE_WINDOW = 32


class TimedShard:
    """A follower's shard as its control service sees it, with the duration of each call of
    :data:`CALLS` observed into ``histogram`` (label ``call``; None: no metrics) and added to
    ``busy`` as phase ``update`` (a :class:`dips.wire.workers.BusyTime`; None: not counted);
    every other attribute is the shard's own."""

    def __init__(self, shard: Any, histogram: Histogram | None, busy: Any = None) -> None:
        self._shard = shard
        self._histogram = histogram
        self._busy = busy

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._shard, name)
        if name not in CALLS:
            return attr
        child = self._histogram.labels(call=name) if self._histogram is not None else None

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return attr(*args, **kwargs)
            finally:
                took = time.monotonic() - started
                if child is not None:
                    child.observe(took)
                if self._busy is not None:
                    self._busy.add("update", took)

        return timed


class FollowerMetrics:
    """A follower's metrics: call and checkpoint durations (observed), and at scrape time its
    versions, data-plane bytes and streams, and checkpoint age.

    Args:
        registry: this process's registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.calls = Histogram("dips_follower_call_seconds", "Duration of a control call from "
                               "the leader (score, aggregate, apply = prepare the update, commit, "
                               "restore), seconds; the sum over calls is the busy time",
                               ["call"], buckets=SECONDS, registry=registry)
        self.checkpoint_s = Histogram("dips_checkpoint_seconds", "Duration of a shard checkpoint "
                                      "write (θ and momentum, fsynced), seconds",
                                      buckets=SECONDS, registry=registry)

    def timed(self, shard: Any, busy: Any = None) -> TimedShard:
        """``shard`` with its control calls timed (give this to the control service);
        ``busy``: a :class:`dips.wire.workers.BusyTime` they are also added to."""
        return TimedShard(shard, self.calls, busy)

    def on_checkpoint(self, version: int, seconds: float) -> None:
        """The checkpoint hook (``FollowerShard(on_checkpoint=...)``)."""
        self.checkpoint_s.observe(seconds)

    def attach(self, shard: Any, data: Any, ckpt_dir: Path | None) -> None:
        """Serve the state of ``shard`` (a FollowerShard), ``data`` (its
        :class:`dips.wire.dataplane.DataServer`) and its checkpoint directory."""
        self.registry.register(_FollowerState(shard, data, ckpt_dir))


class _FollowerState(Collector):
    def __init__(self, shard: Any, data: Any, ckpt_dir: Path | None) -> None:
        self.shard, self.data, self.ckpt_dir = shard, data, ckpt_dir

    def collect(self) -> Iterator[Any]:
        from dips.roles.checkpoint import complete_versions

        _, version, _ = self.shard.state()
        yield GaugeMetricFamily("dips_version", "The version this follower's shard holds "
                                "(committed)", value=version)
        yield GaugeMetricFamily("dips_prepared_version", "The outer step prepared and not yet "
                                "committed (-1: none)", value=self.shard.prepared_version)
        stats = self.data.pull_stats()
        yield CounterMetricFamily("dips_bytes_received", "Bytes received on the data plane "
                                  "(pushes and requests)", value=stats["bytes_received"])
        yield CounterMetricFamily("dips_bytes_sent", "Bytes sent on the data plane (pulls and "
                                  "replies)", value=stats["bytes_sent"])
        yield GaugeMetricFamily("dips_pushes_in_flight", "Push streams open on the data plane",
                                value=stats["push_streams"])
        yield GaugeMetricFamily("dips_pulls_in_flight", "Pull streams in flight on the data "
                                "plane", value=stats["streams"])
        refused = CounterMetricFamily("dips_data_plane_refused", "Data-plane messages refused "
                                      "or dropped, by reason (dips.wire.refusals.REASONS, or a "
                                      "refusal code's name)", labels=["reason"])
        for reason, n in sorted(self.data.refusals.counts().items()):
            refused.add_metric([reason], n)
        yield refused
        waits = GaugeMetricFamily("dips_data_plane_wait_seconds", "Seconds the connection "
                                  "waiting longest for its turn has waited, per data-plane "
                                  "worker (beyond starved_s the follower reports itself down)",
                                  labels=["worker"])
        for worker, wait in self.data.waits().items():
            waits.add_metric([worker], wait)
        yield waits
        queued = GaugeMetricFamily("dips_data_plane_queued_bytes", "Bytes of data-plane "
                                   "messages queued for a worker (chunks not counted)",
                                   labels=["worker"])
        queued.add_metric(["data-consumer"], stats["inq_bytes"])
        queued.add_metric(["data-producer"], stats["pullq_bytes"])
        yield queued
        busy = getattr(self.data, "busy", None)
        if busy is not None:
            yield GaugeMetricFamily("dips_follower_idle_ratio", "Fraction of the last "
                                    f"{busy.IDLE_WINDOW_S:.0f} s (or since the start) this "
                                    "follower was not busy with the leader's calls (update), "
                                    "pushes or pulls: 1 - busy / wall time",
                                    value=busy.idle_ratio())
            total = CounterMetricFamily("dips_follower_busy_seconds", "Seconds busy since the "
                                        "process started, by phase (update: the leader's "
                                        "calls; push; pull)", labels=["phase"])
            for phase, seconds in busy.totals().items():
                total.add_metric([phase], seconds)
            yield total
        saved = complete_versions(self.ckpt_dir) if self.ckpt_dir is not None else []
        if saved:
            yield GaugeMetricFamily("dips_checkpoint_version", "Newest complete checkpoint "
                                    "on disk (version)", value=saved[-1])
            meta = self.ckpt_dir / f"v{saved[-1]:06d}" / "meta.json"
            try:
                age = max(0.0, time.time() - meta.stat().st_mtime)
            except OSError:  # pruned between the listing and the look
                return
            yield GaugeMetricFamily("dips_checkpoint_age_seconds", "Seconds since the newest "
                                    "complete checkpoint was written", value=age)


class ClusterMetrics:
    """A cluster's metrics. :meth:`observe` is the observer hook of its ``train.jsonl``
    (:class:`dips.train.run.TrainLog`); :meth:`attach` adds its versions at scrape time.

    Args:
        registry: this process's registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.registry = registry
        self.steps = Counter("dips_inner_steps", "Inner steps trained by this process",
                             registry=r)
        self.step_s = Histogram("dips_inner_step_seconds", "Compute time of one inner step "
                                "(forward, backward, AdamW), seconds", buckets=SECONDS, registry=r)
        self.tokens = Counter("dips_tokens_trained", "Tokens trained on by this process "
                              "(tokens)", registry=r)
        self.rate = Gauge("dips_tokens_per_second", "Tokens trained per second over the last "
                          f"{RATE_WINDOW} inner steps, syncs and delays included (tokens/s)",
                          registry=r)
        self.loss = Gauge("dips_train_loss", "Training loss of the last inner step "
                          "(nats/token)", registry=r)
        self.syncs = Counter("dips_syncs", "Syncs (push, verdict, pull) by result: accepted, "
                             "rejected, failed (not completed: retried later)", ["result"],
                             registry=r)
        def sync_phase(name: str, what: str) -> Histogram:
            return Histogram(name, f"{what}, seconds (completed syncs)", buckets=SECONDS,
                             registry=r)
        self.push_s = sync_phase("dips_push_seconds", "Push of the pseudo-gradient to the "
                                 "followers")
        self.wait_s = sync_phase("dips_verdict_wait_seconds", "Wait for the leader's verdict "
                                 "after the push")
        self.pull_s = sync_phase("dips_pull_seconds", "Pull of the new version")
        self.score = Gauge("dips_push_score", "Penalty score E of this cluster's last scored "
                           "push (dimensionless)", registry=r)
        self.events = Counter("dips_cluster_events", "Event records of train.jsonl, by kind "
                              "(join, ...)", ["event"], registry=r)
        self.holding = Gauge("dips_holding", "1 while the cluster holds its training: it "
                             "cannot sync and trains nothing a push could not carry "
                             "(dips.algo.hold), else 0", registry=r)
        self.held_s = Counter("dips_hold_seconds", "Seconds the cluster held its training, "
                              "over the holds ended (s)", registry=r)
        self._tokens = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)

    def observe(self, rec: dict[str, Any]) -> None:
        """Fold one ``train.jsonl`` record (an inner step, maybe with its ``push``, or an
        event) into the metrics."""
        if "event" in rec:
            self.events.labels(event=str(rec["event"])).inc()
            if rec["event"] in ("hold", "hold_end"):
                self.holding.set(1 if rec["event"] == "hold" else 0)
            if rec["event"] == "hold_end" and isinstance(rec.get("held_s"), (int, float)):
                self.held_s.inc(max(0.0, rec["held_s"]))
            if rec["event"] == "resume" and isinstance(rec.get("tokens"), int):
                self._tokens = rec["tokens"]  # the saved count: trained by an earlier process
        if "step" in rec:
            self.steps.inc()
            if isinstance(rec.get("compute_s"), (int, float)):
                self.step_s.observe(max(0.0, rec["compute_s"]))
            if isinstance(rec.get("loss"), (int, float)):
                self.loss.set(rec["loss"])
            tokens = int(rec.get("tokens", self._tokens))
            self.tokens.inc(max(0, tokens - self._tokens))
            self._tokens = tokens
            self._recent.append((float(rec.get("time", time.time())), tokens))
            (t0, n0), (t1, n1) = self._recent[0], self._recent[-1]
            if t1 > t0:
                self.rate.set((n1 - n0) / (t1 - t0))
        push = rec.get("push")
        if isinstance(push, dict):
            ok = bool(push.get("ok", True))
            self.syncs.labels(result=("failed" if not ok else
                                      "accepted" if push.get("accepted") else "rejected")).inc()
            if ok:
                for hist, key in ((self.push_s, "push_s"), (self.wait_s, "wait_s"),
                                  (self.pull_s, "pull_s")):
                    if isinstance(push.get(key), (int, float)):
                        hist.observe(max(0.0, push[key]))
            if isinstance(push.get("score"), (int, float)):
                self.score.set(push["score"])

    def attach(self, client: Any) -> None:
        """Serve the versions of ``client`` (a :class:`dips.roles.client.ClusterClient`)."""
        self.registry.register(_ClusterState(client))


class _ClusterState(Collector):
    def __init__(self, client: Any) -> None:
        self.client = client

    def collect(self) -> Iterator[Any]:
        mine, leader = self.client.version, self.client.leader_version
        yield GaugeMetricFamily("dips_version", "The version this cluster's model was pulled "
                                "at (-1: not joined yet)", value=mine)
        if leader >= 0 and mine >= 0:
            yield GaugeMetricFamily("dips_base_version_lag", "Versions the global model is "
                                    "ahead of this cluster's base version (versions)",
                                    value=max(0, leader - mine))



class EvaluatorMetrics:
    """The metrics of ``dips evaluate`` (issue 15), fed by :class:`dips.node.evaluate.Evaluator`
    (the held-out loss itself is the leader's ``dips_heldout_loss``).

    Args:
        registry: this process's registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.evaluations = Counter("dips_evaluations", "Evaluations by result: reported "
                                   "(accepted by the leader), refused (by the leader), failed "
                                   "(a pull, join or report that did not complete: retried)",
                                   ["result"], registry=r)
        self.seconds = Histogram("dips_evaluation_seconds", "Pull of one version in FP32 and "
                                 "its held-out evaluation, seconds", buckets=SECONDS, registry=r)
        self.version = Gauge("dips_evaluated_version", "The last version whose held-out loss "
                             "the leader accepted from this evaluator (version)", registry=r)
