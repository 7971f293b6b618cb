"""Prometheus metrics of the role processes (``--metrics-port``): every metric ``dips leader``,
``dips follower`` and ``dips cluster`` serve, in one place (the README's "Metrics" table).

Each process has its own :class:`prometheus_client.CollectorRegistry` (never the global one,
so several roles can live in one test process). Metrics are fed in two ways, never by calls
sprinkled through the state machines:

* **records**: one observer hook per role receives the records the role writes anyway — the
  leader's ``outer_steps.jsonl`` and ``leader_events.jsonl`` lines
  (:attr:`dips.roles.leader_records.Records.observer`), a cluster's ``train.jsonl`` lines
  (:class:`dips.train.run.TrainLog`'s ``observer``), a follower's checkpoint writes;
* **state at scrape time**: a collector reads the role's state when Prometheus scrapes
  (the leader's status and ledger, a follower's shard, data plane and checkpoints, a
  cluster's versions).

Counters survive restarts where the role persists state: the leader's outer steps, tokens and
restarts come from the counts it checkpoints in ``leader.json``, and before it starts the
records of its ``outer_steps.jsonl`` and ``leader_events.jsonl`` are replayed through the same
observer (:meth:`LeaderMetrics.replay`), so pushes by reason, rounds and phase histograms go
on from where the previous process left them. A follower's and a cluster's counters count
from the process start (Prometheus' ``rate()`` handles such resets).

Units are in the names: seconds, bytes, tokens, versions; "sq" is a squared norm (units of θ²).
No metric has a ``_created`` series (``prometheus_client.disable_created_metrics``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dips.algo.evaluation import perplexity
from dips.algo.faultlog import REASONS, cluster_member, follower_member, reason_class

# No ``*_created`` series (a counter's or histogram's creation time, one more series per label
# set): scrapes stay small and a counter is a plain count. Process-wide in prometheus_client:
# every process that serves dips metrics imports this module (metrics_members does too).
disable_created_metrics()

__all__ = ["LeaderMetrics", "MetricsServer", "REASONS", "reason_class", "serve_metrics"]

log = logging.getLogger(__name__)

#: Histogram buckets for durations, seconds (a few ms to minutes: a transfer on a slow link).
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0)
#: The phases of a round (``dips.algo.round``) whose durations ``outer_steps.jsonl`` records.
PHASES = ("window", "push", "update", "pull")


class MetricsServer:
    """The HTTP endpoint of one registry (``/metrics``, Prometheus text format).

    Args:
        registry: what to serve.
        port: TCP port; 0 picks a free one (:attr:`port` says which).
        host: address to bind (``0.0.0.0``: every interface, as exporters do).

    Raises:
        OSError: the address cannot be bound (e.g. the port is in use).
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket (waits up to ``timeout_s`` for the thread)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0",
                  state: Path | None = None) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (0: a free port), log the URL and, with a state
    directory ``state``, write ``HOST:PORT`` to its
    :data:`dips.roles.durable.METRICS_ADDR` (replaced whole: a
    scraper's discovery, and how ``dips launch`` learns the free port a role chose). Raises
    RoleError naming ``--metrics-port`` if it cannot bind."""
    from dips.node.common import RoleError
    from dips.roles.durable import METRICS_ADDR, write_atomic

    try:
        server = MetricsServer(registry, port, host)
    except OSError as exc:
        raise RoleError(f"--metrics-port {port}: cannot bind on {host} ({exc})") from None
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    if state is not None:
        write_atomic(state / METRICS_ADDR, f"{host}:{server.port}\n".encode())
    return server


def _set_per_cluster(gauge: Gauge, values: Any) -> None:
    for cluster, value in (values or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            gauge.labels(cluster=str(cluster)).set(float(value))


class LeaderMetrics:
    """The leader's metrics. :meth:`observe` is the observer hook (records), :meth:`attach`
    adds the collector of the leader's state (scrape time).

    Args:
        registry: this process's registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.registry = registry
        self.rounds = Counter("dips_rounds", "Rounds decided, by outcome (stepped: an outer step "
                              "was applied; nothing_accepted; failed)", ["outcome"], registry=r)
        self.pushes = Counter("dips_pushes", "Pushes the leader gave a verdict on, by result "
                              "(accepted, rejected) and reason of a rejection (its code: "
                              "penalty, not_delivered, invalid, followers_not_ready, "
                              "cluster_gone, round_failed, other; none if accepted)",
                              ["result", "reason"], registry=r)
        self.cluster_pushes = Counter("dips_cluster_pushes", "Pushes of one cluster the leader "
                                      "gave a verdict on, by result (accepted, rejected), over "
                                      "every process it ran as", ["cluster", "result"],
                                      registry=r)
        self.cluster_tokens = Counter("dips_cluster_tokens_pushed", "T_j of one cluster's "
                                      "pushes decided, the ledger's count (tokens)",
                                      ["cluster"], registry=r)
        self.staleness = Gauge("dips_cluster_staleness", "Versions between a cluster's base "
                               "version and the global version at its last push (versions)",
                               ["cluster"], registry=r)
        self.score = Gauge("dips_penalty_score", "Penalty score E of a cluster's last scored "
                           "push (dimensionless)", ["cluster"], registry=r)
        self.threshold = Gauge("dips_penalty_threshold", "Rejection threshold its last scored "
                               "push was tested against (dimensionless)", ["cluster"], registry=r)
        self.sq_norm = Gauge("dips_sq_norm", "‖Δ‖² of a cluster's last delivered push, summed "
                             "over the shards (θ²)", ["cluster"], registry=r)
        self.weight = Gauge("dips_token_weight", "Token weight of a cluster's last accepted push "
                            "in the mean (fraction)", ["cluster"], registry=r)
        self.push_tokens = Gauge("dips_push_tokens", "T_j of a cluster's last push, the "
                                 "ledger's count (tokens)", ["cluster"], registry=r)
        self.clip = Gauge("dips_clip_factor", "Clip factor of the last outer step (fraction, "
                          "1 = not clipped)", registry=r)
        self.delta_sq = Gauge("dips_delta_sq_norm", "‖δ‖² of the last outer step's weighted "
                              "mean before clipping (θ²)", registry=r)
        self.phase_s = Histogram("dips_phase_seconds", "Duration of a round's phase (window, "
                                 "push, update, pull), seconds", ["phase"], buckets=SECONDS,
                                 registry=r)
        self.grace = {key: Gauge(name, doc, registry=r) for key, name, doc in (
            ("window_s", "dips_grace_window_seconds", "Grace window the leader opens now (s)"),
            ("tau_star_s", "dips_grace_tau_star_seconds", "The §7 optimal window τ* (s)"),
            ("rate_per_s", "dips_grace_request_rate_per_second",
             "Estimated push-request rate λ (1/s)"),
            ("miss_cost_s", "dips_grace_miss_cost_seconds",
             "Estimated cost C_m of missing a round: update + pull (s)"))}
        self.events = Counter("dips_leader_events", "Events of leader_events.jsonl, by kind "
                              "(cluster_joined, cluster_removed, follower_down, reconciled, "
                              "...)", ["event"], registry=r)
        self.heldout = _HeldOut()  # absent until the first evaluation (review 35, F6)
        r.register(self.heldout)

    # ----- the observer hook -------------------------------------------------------------
    def observe(self, stream: str, rec: dict[str, Any]) -> None:
        """Fold one record of ``outer_steps.jsonl`` (``stream`` ``"outer_steps"``),
        ``leader_events.jsonl`` (``"leader_events"``) or ``eval.jsonl`` (``"eval"``) into the
        metrics."""
        if stream == "eval":
            self._heldout(rec)
        elif stream == "leader_events":
            self.events.labels(event=str(rec.get("event", "?"))).inc()
        elif "event" not in rec and "accepted" in rec:
            self._decision(rec)
        elif rec.get("event") == "round_end":
            for phase in PHASES:
                value = rec.get(f"{phase}_s")
                if isinstance(value, (int, float)) and value >= 0:
                    self.phase_s.labels(phase=phase).observe(value)
            for key, gauge in self.grace.items():
                value = (rec.get("grace") or {}).get(key)
                if isinstance(value, (int, float)):
                    gauge.set(value)

    def _decision(self, rec: dict[str, Any]) -> None:
        accepted = list(rec.get("accepted") or [])
        rejected = rec.get("rejected") or {}
        outcome = "failed" if rec.get("error") else "stepped" if accepted else "nothing_accepted"
        self.rounds.labels(outcome=outcome).inc()
        if accepted:
            self.pushes.labels(result="accepted", reason="none").inc(len(accepted))
        for why in rejected.values():
            self.pushes.labels(result="rejected", reason=reason_class(why)).inc()
        for cluster in accepted:
            self.cluster_pushes.labels(cluster=str(cluster), result="accepted").inc()
        for cluster in rejected:
            self.cluster_pushes.labels(cluster=str(cluster), result="rejected").inc()
        for cluster, tokens in (rec.get("tokens") or {}).items():
            if isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and tokens >= 0:
                self.cluster_tokens.labels(cluster=str(cluster)).inc(tokens)
        before = int(rec.get("version", 0)) - (1 if accepted else 0)
        _set_per_cluster(self.staleness, {c: max(0, before - int(b))
                                          for c, b in (rec.get("base_versions") or {}).items()})
        _set_per_cluster(self.score, rec.get("scores"))
        thresholds = rec.get("thresholds")
        if thresholds is None and isinstance(rec.get("threshold"), (int, float)):  # older lines
            thresholds = {c: rec["threshold"] for c in rec.get("scores") or {}}
        _set_per_cluster(self.threshold, thresholds)
        _set_per_cluster(self.sq_norm, rec.get("sq_norms"))
        _set_per_cluster(self.weight, rec.get("weights"))
        _set_per_cluster(self.push_tokens, rec.get("tokens"))
        if isinstance(rec.get("clip_factor"), (int, float)):
            self.clip.set(rec["clip_factor"])
        if isinstance(rec.get("delta_sq_norm"), (int, float)):
            self.delta_sq.set(rec["delta_sq_norm"])

    def _heldout(self, rec: dict[str, Any]) -> None:
        loss, version = rec.get("eval_loss"), rec.get("version")
        if isinstance(loss, (int, float)) and isinstance(version, int):
            self.heldout.last = (float(loss), version)

    def replay(self, state: Path) -> int:
        """Feed the records of ``state/outer_steps.jsonl``, ``state/leader_events.jsonl`` and
        ``state/eval.jsonl`` (a previous process's) through :meth:`observe`, before the leader
        starts: counters go on across restarts, the held-out gauges show the last report. A
        line that is not a JSON object is skipped. Returns the records replayed."""
        n = 0
        for stream in ("outer_steps", "leader_events", "eval"):
            path = state / f"{stream}.jsonl"
            if not path.exists():
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # e.g. a line cut by a crash
                    if isinstance(rec, dict):
                        self.observe(stream, rec)
                        n += 1
        return n

    def attach(self, leader: Any, clock: Callable[[], float] = time.monotonic,
               refusals: Any = None) -> None:
        """Serve the state of ``leader`` (a :class:`dips.roles.leader.Leader` on ``clock``)
        and the counts of ``refusals`` (the servicer's :class:`dips.wire.ratelog.Tally` of
        refused calls by caller, method and refusal; None: not served)."""
        self.registry.register(_LeaderState(leader, clock, refusals))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float | None = None,
           labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=labels)


class _LeaderState(Collector):
    """The leader's state at scrape time: counts from its status (checkpointed in
    ``leader.json``: they survive restarts), version, members, heartbeat ages, ledger."""

    def __init__(self, leader: Any, clock: Callable[[], float], refusals: Any = None) -> None:
        self.leader, self.clock, self.refusals = leader, clock, refusals

    def collect(self) -> Iterator[Any]:
        if self.refusals is not None:
            refused = CounterMetricFamily("dips_refusals", "Calls the leader refused, by caller "
                                          "(its certificate's name), method and refusal code; "
                                          "each (caller, code) is logged once a minute at "
                                          "most", labels=["member", "method", "reason"])
            for key, n in sorted(self.refusals.counts().items(), key=str):
                refused.add_metric([str(k) for k in (*key, "", "", "")[:3]], n)
            yield refused
        s = self.leader.status()
        c = s.counts
        lost = c.get("outer_steps_lost", 0)
        yield _counter("dips_outer_steps", "Outer steps decided and applied, including those "
                       "later rolled back (leader.json counts)", c.get("outer_steps", 0) + lost)
        yield _counter("dips_outer_steps_lost", "Outer steps rolled back when reconciling "
                       "followers", lost)
        yield _counter("dips_tokens_pushed", "Tokens behind every push decided (tokens)",
                       c.get("tokens_pushed", 0))
        yield _gauge("dips_tokens_accepted", "Tokens behind the accepted updates in the model "
                     "now, the ledger's count (tokens; drops if steps are rolled back)",
                     c.get("tokens_accepted", 0))
        yield _counter("dips_leader_restarts", "Times this leader resumed from leader.json",
                       c.get("restarts", 0))
        yield _gauge("dips_version", "The global version (outer steps in the model)", s.version)
        yield _gauge("dips_round", "The last round number opened", s.rounds)
        phase = _gauge("dips_phase", "1 for the round machine's current phase", labels=["phase"])
        for p in ("idle", *PHASES):
            phase.add_metric([p], 1.0 if s.phase == p else 0.0)
        yield phase
        yield _gauge("dips_run_finished", "1 once the run has ended (token budget, outer steps "
                     "or time limit)", 1.0 if s.finished else 0.0)
        members = _gauge("dips_members", "Members registered, by role", labels=["role"])
        members.add_metric(["cluster"], len(s.clusters))
        members.add_metric(["follower"], len(s.followers))
        yield members
        yield _gauge("dips_followers_up", "Followers up (registered and heard from)",
                     s.followers_ready)
        now = self.clock()
        age = _gauge("dips_heartbeat_age_seconds", "Seconds since a member's last heartbeat "
                     "(member: cluster-<id>, follower-<index>, as in dips status)",
                     labels=["role", "member"])
        for cl in s.clusters:
            age.add_metric(["cluster", cluster_member(cl.cluster_id)],
                           max(0.0, now - cl.last_seen))
        for fo in s.followers:
            age.add_metric(["follower", follower_member(fo.index)], max(0.0, now - fo.last_seen))
        yield age
        step = _gauge("dips_cluster_inner_step", "A member cluster's inner step as its last "
                      "heartbeat said, in its own numbering (a process that resumed a saved "
                      "inner state counts on from its step)", labels=["cluster"])
        accepted = _gauge("dips_cluster_tokens_accepted", "T_j of a member cluster's accepted "
                          "pushes still in the model, over every process it ran as (the "
                          "ledger's count, tokens; drops if steps are rolled back)",
                          labels=["cluster"])
        for cl in s.clusters:
            step.add_metric([cl.cluster_id], cl.inner_step)
            accepted.add_metric([cl.cluster_id], cl.tokens_accepted)
        yield step
        yield accepted
        ledger = self.leader.ledger_summary()
        if ledger is not None:
            chunks = _gauge("dips_ledger_chunks", "Data chunks by state (held: leased to a "
                            "cluster; free; finished: every window accepted)", labels=["state"])
            for state in ("held", "free", "finished"):
                chunks.add_metric([state], ledger[state])
            yield chunks
            yield _gauge("dips_ledger_accepted_windows", "Windows accepted over every epoch "
                         "(windows of seq_len tokens; drops if steps are rolled back)",
                         ledger["accepted_windows"])
            yield _gauge("dips_ledger_epoch", "Passes over the data started (0 = first)",
                         ledger["epoch"])
            counts = ledger.get("counts") or {}
            for key, doc in (("leased", "Data chunks handed to a cluster (a chunk taken from "
                                        "an idle holder too), over the run"),
                             ("accepted", "Data chunks whose every window was accepted, over "
                                          "every epoch"),
                             ("returned", "Data chunks returned to the pool: released by a "
                                          "cluster that left or was removed, or rolled back")):
                yield _counter(f"dips_ledger_chunks_{key}", doc, counts.get(key, 0))


class _HeldOut(Collector):
    """``dips_heldout_loss`` (nats/token), ``dips_heldout_loss_version`` and
    ``dips_heldout_perplexity`` of the last evaluation reported (``last``: (loss, version));
    absent before any: a gauge at 0 read as a perfect model on a run with no evaluator
    (review 35 of issue 15, F6)."""

    def __init__(self) -> None:
        self.last: tuple[float, int] | None = None

    def collect(self) -> Iterator[Any]:
        if self.last is None:
            return
        loss, version = self.last
        for name, doc, value in (
                ("dips_heldout_loss", "Held-out loss of the global model at the last version "
                 "`dips evaluate` reported (nats/token)", loss),
                ("dips_heldout_loss_version", "The version that loss is of (version)", version),
                ("dips_heldout_perplexity", "exp(dips_heldout_loss) (+Inf where it overflows)",
                 perplexity(loss))):
            yield GaugeMetricFamily(name, doc, value=value)
