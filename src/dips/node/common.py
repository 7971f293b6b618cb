"""What every role process shares: its state directory, its credentials, addresses, and the
run spec fetched from the leader (no shared filesystem between hosts).
"""

from __future__ import annotations

import faulthandler
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

import grpc

from dips.spec import RunSpec
from dips.wire.not_leader import wrong_leader
from dips.wire.pb import control_pb2 as pb
from dips.wire.pki import Identity
from dips.wire.security import INSECURE_WARNING, Credentials
from dips.wire.services import leader_client

log = logging.getLogger(__name__)


#: Locks of the state directories this process holds, kept open for its whole life (a lock
#: file closed by the garbage collector would release the flock).
_HELD: list[IO] = []


class Unreachable:
    """Says why the leader does not answer: a warning with gRPC's reason at the first failure
    and then every ``every_s`` seconds (a TLS handshake failure, e.g. one side running
    ``--insecure``, otherwise shows only in gRPC's own log), and once when it answers again."""

    def __init__(self, what: str, every_s: float = 10.0) -> None:
        self.what, self.every_s = what, every_s
        self._since: float | None = None
        self._said = 0.0

    def failed(self, reason: str) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._said >= self.every_s:
            self._said = now
            log.warning("%s: no answer for %.0f s: %s (is it running, at this address, with "
                        "the same --tls/--insecure choice?)", self.what, now - self._since, reason)

    def answered(self) -> None:
        if self._since is not None and self._said:
            log.info("%s answers again", self.what)
        self._since, self._said = None, 0.0


def _stderr_fd() -> int | None:
    """The process's stderr file descriptor (also where a test harness replaced sys.stderr by
    a buffer), or None when it has none."""
    try:
        return sys.__stderr__.fileno() if sys.__stderr__ is not None else None
    except (OSError, ValueError):  # closed, or no file behind it
        return None


#: Seconds a role process may take from the end of its role to its exit (a gRPC handler
#: still in a call, a finaliser); past it the stacks go to stderr and it exits anyway.
EXIT_BOUND_S = 15.0


def bounded_exit(code: int, bound_s: float | None = None) -> None:
    """Make the process end with exit status ``code`` within ``bound_s`` seconds from now,
    whatever still runs: interpreter shutdown joins every non-daemon thread (a gRPC server's
    handler threads among them, ``concurrent.futures``' exit hook), so one handler stuck in a
    call would hold a stopped role's exit for that call's whole timeout. Past the bound a
    daemon thread logs it, writes every thread's stack to stderr (:mod:`faulthandler`) and
    calls ``os._exit(code)`` (logging flushed first). ``bound_s`` None: :data:`EXIT_BOUND_S`.
    Returns at once."""
    bound_s = EXIT_BOUND_S if bound_s is None else bound_s

    def force() -> None:
        time.sleep(bound_s)
        log.error("exit still waits on threads after %g s (stacks below): exiting %d now",
                  bound_s, code)
        if _stderr_fd() is not None:
            faulthandler.dump_traceback(file=_stderr_fd(), all_threads=True)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=force, name="exit-bound", daemon=True).start()


def run_bounded(entry: Callable[[], object]) -> None:
    """Run a process's entry point (a typer app: it ends in SystemExit) and make the process
    exit within :data:`EXIT_BOUND_S` seconds of its end with the same status
    (:func:`bounded_exit`); only for a process's own main, never inside another program (a
    test runner): the process ends."""
    code = 1  # an exception's traceback: Python exits 1
    try:
        entry()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        raise
    finally:
        bounded_exit(code)


class Stopped(Exception):
    """SIGTERM or SIGINT arrived before the role could start: a clean stop (exit 0)."""


class RoleError(RuntimeError):
    """A role cannot start (locked state directory, bad address, no leader): the message
    names what and where; the command prints it and exits 2."""


#: Attributes every LogRecord has: what a JSON line adds beyond them are the ``extra`` fields.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}
LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (epoch seconds), ``level``, ``logger``, ``process``
    (the role, e.g. ``follower-0``), ``message``, every ``extra`` field (values that are not
    JSON become their ``repr``) and ``exc_info`` (the traceback) when there is one."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        doc: dict = {"time": round(record.created, 6), "level": record.levelname,
                     "logger": record.name, "process": self.process,
                     "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=repr, ensure_ascii=False)


def setup_logging(name: str, fmt: str = "text") -> None:
    """Log INFO and above to stderr as ``name``: ``text`` lines (time, name, level, message)
    or ``json`` lines (:class:`JsonFormatter`); SIGUSR1 then dumps every thread's stack to
    stderr (:mod:`faulthandler`). Raises ValueError for another format."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format {fmt!r} is not one of {LOG_FORMATS}")
    # ``kill -USR1 PID`` writes every thread's stack to stderr (a process that does not stop).
    if _stderr_fd() is not None:
        faulthandler.register(signal.SIGUSR1, file=_stderr_fd(), all_threads=True)
    if fmt == "text":
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s {name} %(levelname)s %(message)s")
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(name))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


@dataclass
class StateDir:
    """A role's own directory (nothing in it is read by another host), locked for the life
    of the process so that two processes never share one (``flock``; released on exit, also
    when killed)."""

    path: Path
    _lock: IO | None = None

    def acquire(self) -> "StateDir":
        """Create and lock the directory. Raises RoleError if another process holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.path / "lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise RoleError(f"state directory {self.path} is in use by another dips process "
                            f"(pid {holder})") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock = f
        _HELD.append(f)
        return self

    def release(self) -> None:
        """Give the directory up (tests; a process releases it by exiting)."""
        if self._lock is not None:
            _HELD.remove(self._lock)
            self._lock.close()
            self._lock = None


def credentials(tls: Path | None, insecure: bool, identity: Identity) -> Credentials:
    """The process's credentials: its TLS bundle (whose certificate must be ``identity``), or
    ``--insecure`` (a warning on stderr). Raises RoleError for neither or both, or a bundle of
    another identity."""
    if insecure == (tls is not None):
        raise RoleError("give exactly one of --tls DIR (a bundle from `dips init`) and "
                        "--insecure")
    if insecure:
        print(f"WARNING: {INSECURE_WARNING}", file=sys.stderr, flush=True)
        return Credentials.insecure(identity)
    try:
        creds = Credentials.tls(tls)
    except ValueError as exc:
        raise RoleError(f"--tls {tls}: {exc}") from None
    if creds.identity != identity:
        raise RoleError(f"--tls {tls} holds the certificate of {creds.identity.name!r}, this "
                        f"process is {identity.name!r}")
    return creds


def split_address(address: str, option: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``) -> (host, port). Raises RoleError naming the
    option and value."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RoleError(f"{option} = {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def advertised(listen: str, advertise: str | None, option: str) -> str:
    """The address others use: ``advertise``, or ``listen`` when it names a host (a wildcard
    bind such as 0.0.0.0 needs ``--advertise``). Raises RoleError."""
    host, _ = split_address(listen, option.replace("advertise", "listen"))
    if advertise is not None:
        split_address(advertise, option)
        return advertise
    if host in ("0.0.0.0", "::", "*"):
        raise RoleError(f"{option.replace('advertise', 'listen')} = {listen!r} binds every "
                        f"interface: give {option} HOST:PORT, the address others reach")
    return listen


def fetch_spec(leader: str, creds: Credentials, stop: threading.Event,
               timeout_s: float) -> tuple[RunSpec, str]:
    """(run spec, fingerprint JSON) from the leader at ``leader``, retried until it answers
    (it may be starting or restarting). Raises RoleError after ``timeout_s`` seconds, when
    the leader refuses this identity, and at once when ``leader`` is provably not the leader
    (another role's port, another run's certificate: :func:`dips.wire.not_leader.wrong_leader`,
    the message naming what it reached); Stopped when ``stop`` is set first."""
    client = leader_client(leader, creds, timeout_s=5.0)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    unreachable = Unreachable(f"{creds.identity.name}: leader {leader}")
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                reply = client.GetSpec(pb.SpecRequest(), timeout=5.0)
                return RunSpec.model_validate_json(reply.run_spec), reply.fingerprint
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    raise RoleError(f"leader {leader} refused {creds.identity.name!r}: "
                                    f"{exc.details()}") from None
                wrong = wrong_leader(leader, creds, exc)
                if wrong is not None:  # no retry reaches the leader there
                    raise RoleError(f"--leader {wrong.message}") from None
                last = f"{exc.code().name}: {exc.details()}"
                unreachable.failed(last)
            stop.wait(0.5)
    finally:
        client.close()
    if stop.is_set():
        raise Stopped(f"stopped while waiting for the leader at {leader}")
    raise RoleError(f"no run spec from the leader at {leader} within {timeout_s} s ({last})")


def run_data(spec: RunSpec, cache: Path, what: str) -> Any:
    """This host's copy of the run's token streams (a :class:`dips.train.corpus.TokenData`,
    from ``cache`` or ``spec.config.data``'s files), checked against what the preparing leader
    recorded (its train length and ``data_digest``: :func:`dips.train.datasource.
    check_run_data`). Hosts share no filesystem, so each reads its own copy. Raises RoleError
    naming ``what`` and both figures when the copy differs, and as
    :func:`dips.train.datasource.load_data` when it cannot be read."""
    from dips.train.datasource import check_run_data, load_data

    data = load_data(spec.config.data, cache)
    try:
        check_run_data(data, spec.train_tokens, spec.data_digest, what)
    except ValueError as exc:
        raise RoleError(str(exc)) from None
    return data
