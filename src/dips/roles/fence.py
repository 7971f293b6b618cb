"""A follower's leader lease, persisted (the rules are :mod:`dips.algo.fencing`'s).

The highest term accepted is written to ``STATE_DIR/leader_term`` (atomically, fsynced)
before the call that raised it is acted on, so a restarted follower never goes back to a
lower term. The lease itself (when the leader was last heard from) is not persisted: a
restarted follower holds none and takes the first leader of at least that term.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from dips.algo import fencing
from dips.algo.refusal import Refusal, Refused
from dips.roles.durable import write_atomic

log = logging.getLogger(__name__)


class Fence:
    """Thread-safe leader lease of one follower.

    Args:
        path: where the highest term is kept (None: in memory only, for tests).
        lease_s: the lease (seconds; :func:`dips.algo.fencing.lease_seconds`).
        clock: monotonic seconds.
    """

    def __init__(self, path: Path | None, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._path = path
        self._lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        term = 0
        if path is not None and path.exists():
            try:
                term = int(path.read_text().strip() or 0)
            except ValueError:
                raise ValueError(f"{path}: not a leader term: {path.read_text()[:40]!r}") from None
        self._lease = fencing.LeaderLease(term)

    @property
    def term(self) -> int:
        """The highest leader term accepted (0: none yet)."""
        return self._lease.term

    def check(self, term: int) -> None:
        """Admit a control call of a leader of ``term`` (renewing or taking the lease).

        Raises Refused: STALE_TERM (a higher term leads), LEASE_HELD (another leader's lease
        has not expired), INVALID_ARGUMENT (no term, i.e. < 1).
        """
        if term < 1:
            raise Refused(Refusal.INVALID_ARGUMENT, f"leader term = {term}: the call carries no "
                                                    "valid 'dips-term'")
        with self._lock:
            out = fencing.offer(self._lease, term, self._clock(), self._lease_s)
            if out.refusal is Refusal.STALE_TERM:
                raise Refused(out.refusal, f"leader term {term} is stale: this follower follows "
                                           f"term {self._lease.term}")
            if out.refusal is Refusal.LEASE_HELD:
                raise Refused(out.refusal, f"the leader of term {self._lease.term} holds this "
                                           f"follower's lease for {out.left_s:.1f} s more "
                                           f"(offered term {term})")
            if out.adopted:
                self._persist(term)
                log.info("following leader term %d (was %d)", term, self._lease.term)
            self._lease = out.lease

    def heard(self, term: int) -> None:
        """The leader answered this follower's registration with ``term``: renew (same term)
        or take over (a higher term whose predecessor's lease expired); otherwise nothing
        (the leader learns this follower's term from the next registration)."""
        try:
            self.check(term)
        except Refused:
            pass

    def _persist(self, term: int) -> None:
        if self._path is None:
            return
        write_atomic(self._path, f"{term}\n".encode())
