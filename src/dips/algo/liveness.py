"""Liveness judgements that do not blame a member for the judge's own stall (review 21, F2).

The leader removes a cluster, and marks a follower down, after ``missed_heartbeats`` silent
intervals (§12). When the leader itself could not run — its GIL held by one expensive call,
its lock held, the host's CPUs taken by others — heartbeats sent meanwhile wait in its
sockets, and a judge that only compares ``now - last_seen`` with the limit blames every
member for the leader's stall (review 21: one member's malformed fingerprint held the GIL
3.5 s per join; the monitor then removed every honest cluster and marked both followers
down, honest outer steps fell to 0.040×).

The rule: silence counts only the time the judge itself was running. The monitor ticks every
``period_s``; a tick later than two periods after the one before shows a stall of the judge
from one period after that tick to now (:func:`ticked`, on the clock the judge is scheduled
by), and a member's silence is the time
since its last heartbeat less the stalls inside it (:func:`silent_s`). A member that really
went silent is still removed, after the limit measured in the leader's running time.

The launcher's liveness probe of the leader follows the same idea (:func:`leader_hung`): a
leader that does not answer but uses CPU is busy, not hung, and is killed only after a much
longer bound. Pure: the clock and the CPU time are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUSY_CPU_FRACTION", "BUSY_FACTOR", "MAX_STALLS", "OwnLag", "leader_hung",
           "silent_s", "ticked"]

#: Stalls remembered (the oldest go first; a member silent across more is excused less).
MAX_STALLS = 64
#: A silent leader that used at least this fraction of one CPU while silent is busy.
BUSY_CPU_FRACTION = 0.1
#: A busy leader is killed once silent for this many liveness intervals (never sooner).
BUSY_FACTOR = 10.0

Stall = tuple[float, float]  # (start, end), seconds on the judge's clock


@dataclass(frozen=True)
class OwnLag:
    """The judge's record of its own ticks: the last one on its tick clock (None before the
    first) and the stalls found since the oldest silence still judged, oldest first, on the
    clock of its judgements."""

    last_tick: float | None = None
    stalls: tuple[Stall, ...] = ()


def ticked(lag: OwnLag, tick: float | None, now: float, period_s: float,
           since: float) -> tuple[OwnLag, float]:
    """The record after a tick of a judge that means to tick every ``period_s`` (> 0)
    seconds, and the stall this tick shows (seconds; 0.0: on time).

    ``tick`` is the time of this tick on the clock the judge is scheduled by (the process's
    monotonic clock: a stall is real time it could not run), ``now`` on the clock of its
    judgements (the same one, except in tests that move the latter by hand; None: no lag is
    measured, e.g. a test's clock moved by hand, and no stall is found). A tick more than
    ``2 × period_s`` after the previous one shows a stall of the judge: the time beyond one
    period, ending at ``now``. Stalls that ended before ``since`` (the oldest last-heard time
    of any member still judged) are forgotten, and at most :data:`MAX_STALLS` are kept."""
    stall = 0.0
    stalls = tuple(s for s in lag.stalls if s[1] > since)
    if tick is not None and lag.last_tick is not None and tick - lag.last_tick > 2 * period_s:
        stall = tick - lag.last_tick - period_s
        stalls = (*stalls, (now - stall, now))[-MAX_STALLS:]
    return OwnLag(tick, stalls), stall


def silent_s(last_seen: float, now: float, lag: OwnLag) -> float:
    """Seconds a member last heard at ``last_seen`` has been silent at ``now`` while the
    judge was running: ``now - last_seen`` less the judge's stalls inside that span (>= 0)."""
    silence = max(0.0, now - last_seen)
    for start, end in lag.stalls:
        silence -= max(0.0, min(end, now) - max(start, last_seen))
    return max(0.0, silence)


def leader_hung(silent: float, cpu_fraction: float | None, liveness_s: float) -> bool:
    """Whether a leader that has not answered the probe for ``silent`` seconds is hung (to be
    killed and restarted) rather than busy.

    Args:
        silent: seconds since it last answered (a typed refusal is an answer).
        cpu_fraction: CPU its process used over the last ``liveness_s`` seconds of the
            silence, in CPUs (CPU seconds per second; None: unknown, e.g. no /proc).
        liveness_s: the probe's bound (seconds): 3 heartbeat intervals, at least 3 s.

    Returns:
        True once silent beyond ``liveness_s`` while using less than
        :data:`BUSY_CPU_FRACTION` of a CPU (stopped, deadlocked, waiting forever) or an
        unknown amount; a leader that uses CPU is busy, and hung only once silent beyond
        :data:`BUSY_FACTOR` × ``liveness_s`` (review 21, F2: a member's 3.7 s of parsing got
        the leader SIGKILLed twice in 20 s, each restart reserving 64 new round numbers).
    """
    if silent <= liveness_s:
        return False
    if cpu_fraction is not None and cpu_fraction >= BUSY_CPU_FRACTION:
        return silent > BUSY_FACTOR * liveness_s
    return True
