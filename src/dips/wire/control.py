"""Thin gRPC plumbing for the control plane (§5 of the seed): servers, clients, auth, errors.

Control messages are small metadata (< 1 KB per cluster); bulk tensors never travel here.
Every call carries the run token in the ``x-dips-token`` metadata; a server built by
:func:`make_server` refuses calls without it (``UNAUTHENTICATED``). Domain errors raised by a
role map to gRPC status codes in :func:`grpc_errors`, and every client call has a deadline.
"""

from __future__ import annotations

import functools
import hmac
import logging
from concurrent import futures
from typing import Any, Callable

import grpc

from dips.algo.refusal import Refusal, Refused

log = logging.getLogger(__name__)

TOKEN_KEY = "x-dips-token"
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
}


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


class _AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-dips-token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        meta = dict(details.invocation_metadata or ())
        given = str(meta.get(TOKEN_KEY, "")).encode()
        if hmac.compare_digest(given, self._token):
            return continuation(details)
        return self._deny


def describe(exc: BaseException) -> str:
    """One line naming what failed, for logs and records: a gRPC error as its status code,
    refusal code and details (not its multi-line debug representation), anything else as
    ``Type: message``."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        refusal = refusal_of(exc)
        code = exc.code().name + (f" ({refusal.name})" if refusal is not None else "")
        return f"{code}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def make_server(token: str, max_workers: int = 32) -> grpc.Server:
    """A gRPC server that authenticates every call with ``token``.

    Args:
        token: the run secret (hex string).
        max_workers: handler threads; leader handlers block (push admission), so keep it
            above the number of clusters times two.
    """
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[_AuthInterceptor(token)],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0)],
    )


def _refuse(context: grpc.ServicerContext, code: Refusal, message: str) -> None:
    context.set_trailing_metadata(((REFUSAL_KEY, str(int(code))),))
    context.abort(_STATUS[code], message)


def grpc_errors(method: Callable) -> Callable:
    """Decorate a servicer method: map domain errors to gRPC status codes.

    :class:`Refused` -> its code's status (``_STATUS``) with the code in the ``dips-refusal``
    trailing metadata; ``ValueError`` -> INVALID_ARGUMENT (refusal INVALID_ARGUMENT);
    anything else -> INTERNAL (a bug; logged).
    """

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Refused as exc:
            _refuse(context, exc.code, exc.message)
        except ValueError as exc:
            _refuse(context, Refusal.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return wrapper


#: How often a cancellable call checks whether its caller gave up (seconds).
CANCEL_POLL_S = 0.1


class CallCancelled(Exception):
    """A cancellable call (``Client.Method(..., cancel=f)``) was given up because ``f()``
    became true before the reply; nothing is known of its outcome at the server."""


class Client:
    """A stub wrapper adding the run token and a deadline to every call.

    ``Client(stub_cls, "127.0.0.1:5000", token).Method(request, timeout=s)``; the default
    deadline is ``timeout_s`` seconds. Raises ``grpc.RpcError`` as gRPC does, and
    :class:`CallCancelled` when given ``cancel=f`` and ``f()`` turned true first.
    """

    def __init__(self, stub_cls: type, target: str, token: str, timeout_s: float = 30.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(
            target, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                             ("grpc.enable_http_proxy", 0),
                             # Find a restarted leader within about a second (§12).
                             ("grpc.initial_reconnect_backoff_ms", 100),
                             ("grpc.min_reconnect_backoff_ms", 100),
                             ("grpc.max_reconnect_backoff_ms", 1000)])
        self._stub = stub_cls(self._channel)
        self._meta = ((TOKEN_KEY, token),)

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
