"""``python -m dips.torchrun ARGS``: torchrun (``torch.distributed.run``, the same arguments)
that ends a Di-PS cluster cleanly on SIGTERM or SIGINT (issue 14, review 32).

Plain torchrun turns SIGTERM into a ``SignalException``: it SIGTERMs the ranks, waits up to
30 s, SIGKILLs what is left and exits 1 with a traceback, however cleanly the ranks stopped
(they leave the loop at the same step and exit 0). Here the agent does not handle SIGTERM
and SIGINT itself (they are taken out of its ``--signals-to-handle``); this process passes
the signal on to each rank (each leads a session of its own) and torchrun goes on watching
them: when they all exit 0 it exits 0, as it does when the run finishes.

It falls back to torchrun's own shutdown (SIGTERM, 30 s, SIGKILL, exit 1) on a second signal,
when the ranks are still running :data:`GRACE_S` seconds after the first, or when torchrun
started new ranks meanwhile (``--max-restarts``: a rank failed while stopping). When ranks
fail, torchrun's summary of the failures is printed without a traceback and the exit status
is 2 when every failed rank exited 2 (it could not start: a configuration error), else 1; a
rank that the passed-on signal ended before it had its handler (still importing) counts as
stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from dips.emu.proctree import children

#: Seconds the ranks have to stop after the first signal before torchrun's shutdown runs.
GRACE_S = 30.0
#: How often the watch checks the ranks after a signal (seconds).
POLL_S = 0.2
#: Signals the agent leaves to this process (the rest, SIGHUP and SIGQUIT, are torchrun's).
RELAYED = (signal.SIGTERM, signal.SIGINT)


class Relay:
    """The signal handler of the agent process (see the module docstring)."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.first: int | None = None
        self.ranks: list[int] = []

    def handler(self, signum: int, frame: object) -> None:
        """Pass the first signal on to the ranks; raise torchrun's SignalException on the
        next one (its shutdown follows)."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.first is not None:
            sig = signal.Signals(signum)
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        self.first = signum
        self.ranks = children(os.getpid())
        for pid in self.ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        print(f"dips.torchrun: {signal.Signals(signum).name} passed to the ranks "
              f"{self.ranks}; torchrun exits as they do", file=sys.stderr, flush=True)
        threading.Thread(target=self._watch, name="relay-watch", daemon=True).start()

    def _watch(self) -> None:
        """Signal this process again (torchrun's shutdown) once the grace is over or a rank
        not signalled appears (a restart); return when the ranks are gone."""
        deadline = time.monotonic() + self.grace_s
        while True:
            now = children(os.getpid())
            if not now and self.ranks:
                return
            if time.monotonic() >= deadline or set(now) - set(self.ranks):
                os.kill(os.getpid(), self.first or signal.SIGTERM)
                return
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); exits with its status (above)."""
    relay = Relay()
    for sig in RELAYED:
        signal.signal(sig, relay.handler)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.signals_to_handle = ",".join(  # the agent's own handlers: not for the relayed ones
        name for name in getattr(args, "signals_to_handle", "SIGHUP,SIGQUIT").split(",")
        if name.strip() not in {s.name for s in RELAYED}) or "SIGQUIT"
    try:
        run(args)
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        if relay.first is not None and codes == {-relay.first}:
            # Ended by the signal passed on, before they installed a handler (its default).
            print(f"dips.torchrun: ranks {sorted(exc.failures)} ended by the "
                  f"{signal.Signals(relay.first).name} passed on (still starting): stopped",
                  file=sys.stderr, flush=True)
            sys.exit(0)
        print(exc.format_msg(), file=sys.stderr, flush=True)
        sys.exit(2 if codes == {2} else 1)
    except SignalException as exc:
        print(f"dips.torchrun: {exc}: the ranks did not stop in time", file=sys.stderr,
              flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
