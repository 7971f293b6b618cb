"""A second copy of a follower's committed state, refreshed off the update path (§6, §12).

The two-phase outer step prepares θ' and its momentum aside and leaves the current version
untouched until commit (pulls and the checkpoint writer read it meanwhile). Copying θ and the
momentum into the spare buffers inside the update made that copy — as much memory traffic as
the Nesterov step itself — part of every outer step the clusters wait for. :class:`SpareState`
copies the committed state into the spare buffers on a background thread right after each
commit, while the clusters train, so the next update finds them ready and runs the Nesterov
step in place on them. The copy thread runs at a lower CPU priority (nice 10), to leave the
cores to the pulls of the new version that start at the same moment (not measured separately). The buffers are reused across versions (fresh memory costs ~1 GB/s on
first touch here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class SpareState:
    """Spare θ/momentum buffers holding a copy of the committed version (or being refreshed).

    Args:
        timeout_s: how long :meth:`take` waits for a background refresh (seconds).

    Thread-safety: :meth:`refresh`, :meth:`take` and :meth:`recycle` are called by the
    follower under its lock; only the copy itself runs on the background thread, and it
    reads committed tensors that nobody modifies in place.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._buffers: tuple[Tensors, Tensors] | None = None
        self._version: int | None = None
        self._thread: threading.Thread | None = None
        self.background_s = 0.0  # last background copy's duration (for benchmarks)

    def recycle(self, params: Tensors, momenta: Tensors) -> None:
        """Adopt buffers that are no longer current (the previous version after a commit, or
        a dropped prepared step) as the spare buffers; their contents count as stale."""
        self._join()
        self._buffers, self._version = (params, momenta), None

    def refresh(self, version: int, params: Tensors, momenta: Tensors) -> None:
        """Start copying the committed ``version`` (``params``, ``momenta``) into the spare
        buffers in the background (allocating them on first use)."""
        self._join()
        dst_p, dst_m = self._fit(params, momenta)
        self._version = None

        def copy() -> None:
            t0 = time.perf_counter()
            with contextlib.suppress(OSError):  # yield the cores to pulls being served now
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            try:
                for n, t in params.items():
                    dst_p[n].copy_(t)
                    dst_m[n].copy_(momenta[n])
            except Exception:  # take() finds the version unset and copies itself
                log.exception("spare state refresh of version %d failed", version)
                return
            self.background_s = time.perf_counter() - t0
            self._version = version

        self._thread = threading.Thread(target=copy, name="spare-refresh", daemon=True)
        self._thread.start()

    def take(self, version: int, params: Tensors, momenta: Tensors) -> tuple[Tensors, Tensors]:
        """Return spare buffers equal to the committed ``version`` (``params``, ``momenta``),
        for an in-place step; they are the caller's until :meth:`recycle`.

        Waits for a pending refresh; if the buffers hold another version (or the refresh
        failed), copies now. Raises TimeoutError if a refresh does not finish in ``timeout_s``.
        """
        self._join()
        if self._version != version:
            dst_p, dst_m = self._fit(params, momenta)
            for n, t in params.items():
                dst_p[n].copy_(t)
                dst_m[n].copy_(momenta[n])
        out, self._buffers, self._version = self._buffers, None, None
        return out

    def _fit(self, params: Tensors, momenta: Tensors) -> tuple[Tensors, Tensors]:
        """The spare buffers, allocated on first use or when the shard's tensors differ."""
        if self._buffers is None or self._buffers[0].keys() != params.keys():
            self._buffers = ({n: torch.empty_like(t) for n, t in params.items()},
                             {n: torch.empty_like(t) for n, t in momenta.items()})
        return self._buffers

    def wait(self) -> None:
        """Block until a pending background refresh is done. Raises TimeoutError after
        ``timeout_s``."""
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"spare state refresh did not finish in {self.timeout_s} s")
            self._thread = None
