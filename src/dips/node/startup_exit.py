"""SIGTERM and SIGINT end a torchrun rank at once while it starts (issue 14, review 32 m4).

Python runs a signal handler in the main thread between bytecodes only. A rank that starts is
mostly inside C++ calls that wait for its peers: ``init_process_group`` (gloo connects to every
peer, bounded by :data:`dips.node.cluster_ddp.BOOT_TIMEOUT_S`, 1800 s), ``new_group``, the
boot barriers and broadcasts. When a peer died there (killed during start-up), rank 0 sat in
``init_process_group``, never ran its handler, and ignored torchrun's SIGTERM until torchrun
SIGKILLed it 30 s later (under a scheduler that sends only SIGTERM: up to 1800 s).

:class:`StartupExit` uses :func:`signal.set_wakeup_fd`: the interpreter's C-level handler
writes each signal's number to a pipe whatever the main thread is doing, and a daemon thread
reading it exits the process (status 0: stopped before it could start, as
:class:`dips.node.common.Stopped`) on SIGTERM or SIGINT, until :meth:`StartupExit.done`.
After that the ranks stop together at a step boundary (the stop event of
:func:`dips.train.run.stop_on_signals`). Nothing is lost by exiting then: the rank has not
joined, and the data cache is written by rename (a partial file never has its name).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

#: The signals that end a rank during start-up.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupExit:
    """While active (from :meth:`start`, in the main thread, to :meth:`done`), SIGTERM or
    SIGINT makes the process exit 0 at once, after one log line naming ``what``; so does
    :meth:`start` when ``stop`` (the handlers' event) was set before it.

    The signals' Python handlers must already be installed (a signal left at its default
    action ends the process anyway; an ignored one never reaches the pipe)."""

    def __init__(self, what: str, stop: threading.Event | None = None) -> None:
        self.what = what
        self._stop = stop
        self._active = threading.Event()
        self._old_fd: int | None = None
        self._write_fd: int | None = None

    def start(self) -> "StartupExit":
        """Begin (main thread only: :func:`signal.set_wakeup_fd`). Returns self."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        self._old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._write_fd = write_fd
        self._active.set()
        threading.Thread(target=self._watch, args=(read_fd,), name="startup-exit",
                         daemon=True).start()
        if self._stop is not None and self._stop.is_set():  # signalled before start()
            self._exit("a signal")
        return self

    def _exit(self, why: str) -> None:
        log.info("%s: %s during start-up: this rank (pid %d) exits now (it has not joined)",
                 self.what, why, os.getpid())
        logging.shutdown()
        os._exit(0)

    def _watch(self, read_fd: int) -> None:
        try:
            while True:
                data = os.read(read_fd, 64)
                if not data:  # done(): the write end closed
                    return
                got = [signal.Signals(b).name for b in data if b in STOP_SIGNALS]
                if got and self._active.is_set():
                    self._exit(got[0])
        finally:
            os.close(read_fd)

    def done(self) -> None:
        """Start-up is over: signals set the stop event only (main thread only). Idempotent."""
        if not self._active.is_set():
            return
        self._active.clear()
        if self._old_fd is not None:
            signal.set_wakeup_fd(self._old_fd)
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
