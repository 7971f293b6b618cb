"""Thin gRPC plumbing for the control plane (§5 of the seed): servers, clients, errors.

Control messages are small metadata (< 1 KB per cluster); bulk tensors never travel here.
Who may connect, and who called, is :mod:`dips.wire.security`'s (mutual TLS by default).
Domain errors raised by a role map to gRPC status codes in :func:`grpc_errors`, and every
client call has a deadline. The server (:func:`make_server`, :class:`ControlServer`) is
:mod:`dips.wire.control_server`'s; its names are importable from here too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import grpc

from dips.algo.refusal import Refusal, Refused
from dips.wire.pki import Identity
from dips.wire.security import Credentials

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20
REFUSAL_KEY = "dips-refusal"

#: The gRPC status each refusal travels with (the code itself rides in REFUSAL_KEY).
_STATUS = {
    Refusal.UNSPECIFIED: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.NOT_JOINED: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.PUSH_IN_FLIGHT: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.NOT_READY: grpc.StatusCode.UNAVAILABLE,
    Refusal.UNKNOWN_PUSH: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.VERSION_GONE: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.NOT_ADMITTED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.UNDECIDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.NO_LEDGER: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.LEDGER_CONFLICT: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.NOTHING_TRAINED: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    Refusal.STALE_TERM: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.LEASE_HELD: grpc.StatusCode.UNAVAILABLE,
    Refusal.MODEL_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.RUN_FINISHED: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.STALE_GRANT: grpc.StatusCode.FAILED_PRECONDITION,
    Refusal.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.NOT_LEADER: grpc.StatusCode.FAILED_PRECONDITION,
}

#: Longest status details sent (characters): a message quoting a huge field value must not
#: exceed gRPC's metadata limit (8 KiB), which the client would see as an INTERNAL error.
MAX_DETAILS = 1000


def refusal_of(exc: grpc.RpcError) -> Refusal | None:
    """The :class:`Refusal` a failed call carries, or None (a transport failure: the peer was
    unreachable, the deadline passed in flight, or it crashed)."""
    try:
        meta = exc.trailing_metadata() or ()
    except Exception:  # not a call error (e.g. a channel that never connected)
        return None
    for key, value in meta:
        if key == REFUSAL_KEY:
            try:
                return Refusal(int(value))
            except ValueError:
                return Refusal.UNSPECIFIED
    return None


def describe(exc: BaseException) -> str:
    """One line naming what failed, for logs and records: a gRPC error as its status code,
    refusal code and details (not its multi-line debug representation), anything else as
    ``Type: message``."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        refusal = refusal_of(exc)
        code = exc.code().name + (f" ({refusal.name})" if refusal is not None else "")
        return f"{code}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class Malformed:
    """What a servicer method receives instead of a request whose bytes do not parse as its
    message (:func:`grpc_errors` refuses it with INVALID_ARGUMENT)."""

    def __init__(self, method: str, size: int, error: str) -> None:
        self.method, self.size, self.error = method, size, error


def _short(message: str) -> str:
    if len(message) <= MAX_DETAILS:
        return message
    return f"{message[:MAX_DETAILS]}... ({len(message)} characters)"


def _refuse(context: grpc.ServicerContext, code: Refusal, message: str) -> None:
    context.set_trailing_metadata(((REFUSAL_KEY, str(int(code))),))
    context.abort(_STATUS[code], _short(message))


def _noted(servicer: Any, context: Any, method: str, code: Refusal, message: str) -> None:
    """Tell ``servicer.on_refused(context, method, code, message)``, where it has one, of a
    refusal (counted and logged by it, at most a line per member and reason per interval:
    review 21, F3). Its own failure never changes the refusal."""
    hook = getattr(servicer, "on_refused", None)
    if hook is not None:
        try:
            hook(context, method, code, message)
        except Exception:  # a bug of the hook: the call is still refused as it would be
            log.exception("on_refused of %s failed", method)


def grpc_errors(method: Callable) -> Callable:
    """Decorate a servicer method: every exception of one call ends that call only.

    :class:`Refused` -> its code's status (``_STATUS``) with the code in the ``dips-refusal``
    trailing metadata; ``ValueError`` -> INVALID_ARGUMENT (refusal INVALID_ARGUMENT), as is
    a :class:`Malformed` request; anything else -> INTERNAL (a bug; logged). Details longer
    than :data:`MAX_DETAILS` characters are cut. A servicer with an ``on_refused`` method is
    told of every refusal (:func:`_noted`) before it is sent.
    """

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if isinstance(request, Malformed):
                raise Refused(Refusal.INVALID_ARGUMENT, f"{request.method}: {request.size} "
                                                        f"bytes are not its request message "
                                                        f"({request.error})")
            return method(self, request, context)
        except Refused as exc:
            _noted(self, context, method.__name__, exc.code, exc.message)
            _refuse(context, exc.code, exc.message)
        except ValueError as exc:
            _noted(self, context, method.__name__, Refusal.INVALID_ARGUMENT, str(exc))
            _refuse(context, Refusal.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, _short(f"{type(exc).__name__}: {exc}"))

    return wrapper


#: How often a cancellable call checks whether its caller gave up (seconds).
CANCEL_POLL_S = 0.1


class CallCancelled(Exception):
    """A cancellable call (``Client.Method(..., cancel=f)``) was given up because ``f()``
    became true before the reply; nothing is known of its outcome at the server."""


class Client:
    """A stub wrapper adding credentials, metadata and a deadline to every call.

    ``Client(stub_cls, "10.0.0.5:7000", creds, Identity.leader()).Method(request, timeout=s)``;
    the server must prove it is ``peer`` (TLS); the default deadline is ``timeout_s`` seconds;
    ``metadata`` is sent with every call (e.g. the leader's term). Raises ``grpc.RpcError`` as
    gRPC does, and :class:`CallCancelled` when given ``cancel=f`` and ``f()`` turned true first.
    """

    def __init__(self, stub_cls: type, target: str, creds: Credentials, peer: Identity,
                 timeout_s: float = 30.0,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._channel = creds.channel(
            target, peer, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                   ("grpc.enable_http_proxy", 0),
                                   # Find a restarted leader within about a second (§12).
                                   # Not grpc.min_reconnect_backoff_ms: gRPC takes it as the
                                   # connect timeout too (100 ms failed every handshake over
                                   # a link of 50 ms a way; review 15, F1).
                                   ("grpc.initial_reconnect_backoff_ms", 100),
                                   ("grpc.max_reconnect_backoff_ms", 1000)])
        self._stub = stub_cls(self._channel)
        self._meta = (*creds.metadata(), *metadata)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        rpc = getattr(self._stub, name)

        def call(request: Any, timeout: float | None = None,
                 cancel: Callable[[], bool] | None = None) -> Any:
            deadline = self.timeout_s if timeout is None else timeout
            if cancel is None:
                return rpc(request, timeout=deadline, metadata=self._meta)
            # A long wait (a verdict, an admission) that the caller may give up early, e.g.
            # when its process is asked to stop: poll the call and cancel it.
            fut = rpc.future(request, timeout=deadline, metadata=self._meta)
            while True:
                try:
                    return fut.result(timeout=CANCEL_POLL_S)
                except grpc.FutureTimeoutError:
                    if cancel():
                        fut.cancel()
                        raise CallCancelled(f"{name} cancelled by the caller") from None

        return call

    def close(self) -> None:
        self._channel.close()


#: Names of :mod:`dips.wire.control_server` importable from here (it imports this module).
_SERVER_NAMES = frozenset({"ControlServer", "make_server", "STREAMS_PER_CONNECTION",
                           "SERVER_CALLS", "FIRST_MESSAGE_S"})


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        from dips.wire import control_server
        return getattr(control_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
