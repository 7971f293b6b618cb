"""Bandwidth schedules of a Di-PS run: ``clusters[].link.schedule`` (§13, §15 slow links).

A cluster's :class:`dips.spec.LinkConfig` holds its rate (``bps``, bits/s) and its changes
(``schedule``: ``{at_s, bps}``, seconds after the run's training start, the launcher's
``train_start``); a real-time scenario's links reach ``dips launch`` rescaled
(:func:`dips.bench.real.dips_run_config`).  The rate in force is always
:meth:`dips.spec.LinkConfig.rate_at`.  Two enforcers, one per shaping:

* ``network: netns`` (root): the launcher's :class:`LinkSchedule` changes the cluster veth's
  ``tc tbf`` rate (:meth:`dips.emu.netns.ShapedNetwork.set_rate`, both directions) when the
  change is due;
* ``network: loopback``: the cluster process's :class:`ScheduledBucket` (its data plane's
  upload token bucket) switches its rate before each message once the change is due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dips.emu.netns import tbf_burst
from dips.spec import ClusterConfig
from dips.wire.shaping import TokenBucket

__all__ = ["LinkSchedule", "ScheduledBucket"]


class LinkSchedule:
    """The run's pending link-rate changes, fired in time order (the launcher's side).

    Args:
        clusters: the run's clusters (their ``link.schedule``).
        net: a :class:`dips.emu.netns.ShapedNetwork` whose tbf rates to change, or None (the
            clusters' token buckets apply the changes themselves; only events are recorded).
        event: ``(kind, process, **extra)`` recorder (the launcher's events.jsonl), or None.
    """

    def __init__(self, clusters: Sequence[ClusterConfig], net: Any = None,
                 event: Callable[..., None] | None = None) -> None:
        self.pending = sorted((ch.at_s, c.id, ch.bps) for c in clusters if c.link is not None
                              for ch in c.link.schedule)
        self._net, self._event = net, event

    def tick(self, elapsed_s: float) -> list[tuple[str, float]]:
        """Apply every change due at ``elapsed_s`` seconds of training; returns them as
        ``(cluster id, bits/s)`` in order.  Raises NetnsError if tc fails (the change is dropped)."""
        fired = []
        while self.pending and self.pending[0][0] <= elapsed_s:
            at, cid, bps = self.pending.pop(0)
            if self._net is not None:
                self._net.set_rate(cid, bps)
            if self._event is not None:
                self._event("link_rate", f"cluster-{cid}", link_bps=bps, at_s=at,
                            applied_s=round(elapsed_s, 3),
                            how="tc-tbf" if self._net is not None else "token-bucket")
            fired.append((cid, bps))
        return fired


class ScheduledBucket:
    """A cluster's upload token bucket that follows its ``link.schedule`` (the cluster's side).

    Burst: 5 ms of traffic at the current rate, at least 32 KiB: the burst of the kernel's tbf
    (:func:`dips.emu.netns.tbf_params`), so that both shapings let the same bytes through
    unpaced after an idle link (a tiny model's push may fit in it whole).  A rate change
    replaces the bucket by a full one of the new rate and burst, as ``tc qdisc replace`` does.

    Args:
        spec: the cluster (``link`` must be set).
        clock: wall clock in seconds (``time.time``; injected in tests).
        sleep, monotonic: passed to the :class:`TokenBucket` (injected in tests).

    Raises:
        ValueError: ``spec.link`` is None (named with the cluster id).
    """

    def __init__(self, spec: ClusterConfig, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if spec.link is None:
            raise ValueError(f"cluster {spec.id!r}: link is None; nothing to shape")
        self.link = spec.link
        self.spec, self._clock, self._sleep, self._monotonic = spec, clock, sleep, monotonic
        self.t0: float | None = None
        self._lock = threading.Lock()
        self.bucket = self._bucket(self.link.rate_at(0.0) / 8)

    def _bucket(self, rate_bytes_per_s: float) -> TokenBucket:
        return TokenBucket(rate_bytes_per_s, float(tbf_burst(rate_bytes_per_s * 8)),
                           clock=self._monotonic, sleep=self._sleep)

    def start(self, t0: float) -> None:
        """Set the training start (``clock()`` seconds) the schedule's times count from."""
        self.t0 = float(t0)

    def rate_bps(self) -> float:
        """The link rate that applies now (bits/s); before :meth:`start`, the rate at time 0."""
        t = 0.0 if self.t0 is None else self._clock() - self.t0
        return self.link.rate_at(t)

    def consume(self, nbytes: int) -> float:
        """Apply the current scheduled rate, then block until ``nbytes`` may leave; returns the
        seconds slept.  Raises ValueError for a negative or non-integer ``nbytes``."""
        rate = self.rate_bps() / 8
        with self._lock:  # data-plane clients of several stages share this bucket
            if rate != self.bucket.rate_bytes_per_s:
                self.bucket = self._bucket(rate)
            bucket = self.bucket
        return bucket.consume(nbytes)
