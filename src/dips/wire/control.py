"""Thin gRPC plumbing for the control plane (§5 of the seed): servers, clients, errors.

Control messages are small metadata (< 1 KB per cluster); bulk tensors never travel here.
Who may connect, and who called, is :mod:`dips.wire.security`'s (mutual TLS by default).
Domain errors raised by a role map to gRPC status codes in :func:`grpc_errors`, and every
client call has a deadline.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from concurrent import futures
from typing import Any, Callable

import grpc
import grpc.aio

from dips.algo.refusal import Refusal, Refused
from dips.wire.pki import Identity
from dips.wire.security import Credentials

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20
#: Concurrent calls (HTTP/2 streams) one connection may have at a server: a member's calls
#: beyond this wait in its own client, not in the server's queue ahead of everyone else's
#: (issue 13, review of 2026-12-01: 2,000 outstanding calls of one member made honest
#: heartbeats wait 2.3 s and clusters were removed). Above CallGate's 6 calls per member, so
#: a client that exceeds the gate still gets its typed BUSY.
STREAMS_PER_CONNECTION = 8
#: Calls accepted (running or queued) per handler thread over all connections; beyond it gRPC
#: refuses RESOURCE_EXHAUSTED at once, so the queue (and its memory) stays bounded.
CALLS_PER_WORKER = 8


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


def _tolerant(parse: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # any bytes at all may arrive
            return Malformed(method, len(data), f"{type(exc).__name__}: {exc}")
    return deserialize


class _Context:
    """The servicer context a synchronous handler gets on :class:`ControlServer`: the aio
    call's context, used from a pool thread. What reads the core call (auth context,
    metadata, peer) is read on the loop when the call starts: a handler still running after
    its call ended (cancelled; the call is then released) must not touch it (a segfault)."""

    def __init__(self, context: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._context, self._loop = context, loop
        self.gone = threading.Event()  # the caller cancelled, or the server stops
        self._auth = context.auth_context()
        self._metadata = context.invocation_metadata()
        self._peer = context.peer()

    def auth_context(self) -> Any:
        return self._auth

    def invocation_metadata(self) -> Any:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        async def abort() -> None:
            if self.gone.is_set():  # checked on the loop: the call is still held when not
                raise _Ended(details)
            await self._context.abort(code, details)
        asyncio.run_coroutine_threadsafe(abort(), self._loop).result()

    def is_active(self) -> bool:
        left = self._context.time_remaining()
        return not self.gone.is_set() and (left is None or left > 0)

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._context.set_trailing_metadata(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._context.set_code(code)

    def set_details(self, details: str) -> None:
        self._context.set_details(details)


class _Ended(Exception):
    """A handler's call ended (cancelled, server stopped) before it could refuse it."""


class _TolerantRequests(grpc.aio.ServerInterceptor):
    """Parses requests so that bytes that are not the method's message reach the servicer as
    :class:`Malformed` (a typed refusal) instead of failing inside gRPC with a bare INTERNAL
    status (issue 13: every decoder of network bytes refuses with a code), and runs each
    synchronous handler in the server's thread pool once its request has arrived."""

    def __init__(self, pool: futures.ThreadPoolExecutor) -> None:
        self._pool = pool

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        deserializer = handler.request_deserializer
        if deserializer is not None:
            deserializer = _tolerant(deserializer, details.method)
        return grpc.unary_unary_rpc_method_handler(
            self._in_pool(handler.unary_unary), request_deserializer=deserializer,
            response_serializer=handler.response_serializer)

    def _in_pool(self, method: Callable) -> Callable:
        if inspect.iscoroutinefunction(method):
            return method
        pool = self._pool

        async def call(request: Any, context: Any) -> Any:
            loop = asyncio.get_running_loop()
            ctx = _Context(context, loop)
            try:
                return await loop.run_in_executor(pool, method, request, ctx)
            except asyncio.CancelledError:
                ctx.gone.set()  # a waiting handler sees is_active() false and ends
                raise
        return call


_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for control servers (gRPC's aio stack is not made for a
    loop per thread), on a daemon thread of its own."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True).start()
            _loop = loop
        return _loop


class _Stopped:
    """What :meth:`ControlServer.stop` returns: ``wait(timeout)`` as ``threading.Event``'s."""

    def __init__(self, future: futures.Future) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout)
        except futures.TimeoutError:
            return False
        except Exception:  # stopping failed: it is stopped as far as it can be
            log.exception("stopping a control server failed")
        return True

    def is_set(self) -> bool:
        return self._future.done()


class ControlServer:
    """A gRPC server of the control plane with the interface of ``grpc.Server`` that dips
    uses (add handlers and ports, ``start``, ``stop(grace).wait(timeout)``), on gRPC's
    asyncio stack: a call's request is received on the event loop, and only a call whose
    request has arrived takes one of the ``max_workers`` threads that run its (synchronous)
    handler. A member that opens calls and never sends their messages holds no thread
    (issue 13, review 25: 24 such calls held every thread of the leader)."""

    def __init__(self, max_workers: int) -> None:
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers,
                                                thread_name_prefix="grpc")
        self._loop = _event_loop()

        async def build() -> grpc.aio.Server:
            return grpc.aio.server(
                migration_thread_pool=self._pool,
                interceptors=[_TolerantRequests(self._pool)],
                maximum_concurrent_rpcs=CALLS_PER_WORKER * max_workers,
                options=[("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
                         ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.so_reuseport", 0)])

        self._server = self._on_loop(build)

    def _on_loop(self, fn: Callable, *args: Any) -> Any:
        async def run() -> Any:
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._on_loop(self._server.add_generic_rpc_handlers, handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self._on_loop(self._server.add_registered_method_handlers, service, handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._on_loop(self._server.add_insecure_port, address)

    def add_secure_port(self, address: str, creds: grpc.ServerCredentials) -> int:
        return self._on_loop(self._server.add_secure_port, address, creds)

    def start(self) -> None:
        self._on_loop(self._server.start)

    def stop(self, grace: float | None) -> _Stopped:
        """Refuse new calls; end those in progress after ``grace`` seconds (None: now)."""
        async def stop() -> None:
            try:
                await self._server.stop(grace)
            finally:
                self._pool.shutdown(wait=False)
        return _Stopped(asyncio.run_coroutine_threadsafe(stop(), self._loop))

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        fut = asyncio.run_coroutine_threadsafe(self._server.wait_for_termination(), self._loop)
        try:
            return fut.result(timeout)
        except futures.TimeoutError:
            return False


def make_server(max_workers: int = 32) -> ControlServer:
    """A gRPC server (:class:`ControlServer`); bind it with
    :meth:`dips.wire.security.Credentials.add_port` (mutual TLS unless insecure), and have
    its servicers check :func:`dips.wire.security.caller`. A request that does not parse
    reaches the servicer as :class:`Malformed`. Each connection has at most
    :data:`STREAMS_PER_CONNECTION` calls in progress, and the server at most
    ``CALLS_PER_WORKER × max_workers`` (RESOURCE_EXHAUSTED beyond); a call holds a handler
    thread only once its request has arrived.

    Args:
        max_workers: handler threads; leader handlers block (push admission), so give its
            servicer a :meth:`dips.wire.inflight.CallGate.for_server` of this number.
    """
    return ControlServer(max_workers)


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
