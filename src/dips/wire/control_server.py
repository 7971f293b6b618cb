"""The control plane's gRPC server (§5 of the seed) on gRPC's asyncio stack, and what keeps one
member's calls from using what the others need (issue 13, review 25).

A call's request is received on the event loop; only a call whose request has arrived takes
one of the ``max_workers`` threads that run the (synchronous) servicers. Before that, every
call, from the moment its headers arrive, counts against its peer's
:class:`dips.wire.inflight.PeerCalls` (:data:`~dips.wire.inflight.PEER_CALLS` open calls per
certificate identity; refusal BUSY, RESOURCE_EXHAUSTED, at once) and must deliver its request
within :data:`FIRST_MESSAGE_S` (else DEADLINE_EXCEEDED); a server given
:class:`~dips.wire.inflight.RateGate` s refuses a peer's read calls
(:data:`~dips.wire.inflight.READS`) and heartbeats (:data:`~dips.wire.inflight.HEARTBEATS`)
beyond their rates there too, before a thread or the request is spent on them (BUSY).

Connections: at most :func:`connection_limit` open at once over all peers (gRPC Python has
no hook per connection or per peer: a connection that makes no call never reaches Python, so
one certificate's idle connections can only be bounded server-wide); closed after
:data:`IDLE_S` without a call, TLS handshakes after :data:`HANDSHAKE_S`, and connections
whose peer stops answering keepalive pings after :data:`KEEPALIVE_S` +
:data:`KEEPALIVE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import resource
import threading
from concurrent import futures
from typing import Any, Callable

import grpc
import grpc.aio

from dips.algo.refusal import Refusal, Refused
from dips.wire.control import _STATUS, MAX_MESSAGE_BYTES, REFUSAL_KEY, Malformed, _short
from dips.wire.inflight import HEARTBEATS, PEER_CALLS, READS, PeerCalls, RateGate
from dips.wire.security import caller

log = logging.getLogger("dips.wire.control")

#: Concurrent calls (HTTP/2 streams) one connection may have at a server: a member's calls
#: beyond this wait in its own client, not in the server's queue ahead of everyone else's
#: (issue 13, review of 2026-12-01: 2,000 outstanding calls of one member made honest
#: heartbeats wait 2.3 s and clusters were removed). Above CallGate's 6 calls per member, so
#: a client that exceeds the gate still gets its typed BUSY.
STREAMS_PER_CONNECTION = 8
#: Open calls over all peers beyond which gRPC refuses RESOURCE_EXHAUSTED (a memory bound only;
#: one peer is held to PEER_CALLS long before: review 25's 160 held calls of one member reached
#: the old bound of 8 per handler thread and every other call was refused).
SERVER_CALLS = 4096
#: Seconds a call may take from its headers to its request message (a control request is
#: under 1 KB; a slow writer's call ends here instead of holding its place).
FIRST_MESSAGE_S = 10.0
#: Seconds a connection without calls stays open (a client reconnects on its next call).
IDLE_S = 60.0
#: Seconds a connection may take for its TLS handshake (gRPC's default: 120).
HANDSHAKE_S = 10.0
#: Connections a server keeps open at once over all peers, at most (``connection_limit``):
#: review 30's 1,500 idle TLS connections of one certificate took the leader +128 MB, and the
#: file-descriptor limit (20,000 there) was the only bound; beyond this a new connection is
#: closed at once (existing ones keep working) until one closes (IDLE_S at the latest).
SERVER_CONNECTIONS = 4096
#: Keepalive: the server pings a connection after this many seconds without traffic, and
#: closes it when the ping is not answered within KEEPALIVE_TIMEOUT_S (a vanished peer).
KEEPALIVE_S = 30.0
KEEPALIVE_TIMEOUT_S = 10.0


def connection_limit(wanted: int = SERVER_CONNECTIONS) -> int:
    """Connections a server of this process may keep open: ``wanted``, at most half the
    process's file descriptors (``RLIMIT_NOFILE``, soft), so that a member's connections never
    take the files and sockets the process itself needs (its checkpoints, its own calls).

    Raises:
        ValueError: ``wanted`` below 1.
    """
    if wanted < 1:
        raise ValueError(f"connections {wanted} must be >= 1")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft // 2))


def _tolerant(parse: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # any bytes at all may arrive
            return Malformed(method, len(data), f"{type(exc).__name__}: {exc}")
    return deserialize


def peer_of(context: Any) -> str:
    """Whom a call's limits count it against: its caller's identity (the certificate's, or
    the claimed one on an insecure server), else the peer's address without its port."""
    try:
        return caller(context).name
    except Refused:
        address = context.peer() or "unknown"
        return "address " + address.rsplit(":", 1)[0]


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


async def _refuse(context: Any, exc: Refused) -> None:
    context.set_trailing_metadata(((REFUSAL_KEY, str(int(exc.code))),))
    await context.abort(_STATUS[exc.code], _short(exc.message))


class _Guarded(grpc.aio.ServerInterceptor):
    """Serves each unary method as a call that is counted against its peer from its headers
    on (:class:`PeerCalls`), waits at most ``first_message_s`` for its request, parses it so
    that bytes that are not the method's message reach the servicer as :class:`Malformed`
    (a typed refusal, not gRPC's bare INTERNAL), and runs a synchronous handler in the
    server's thread pool once its request has arrived.

    A unary method is served as stream-unary (the same bytes on the wire): gRPC's unary
    handlers start only after the request arrived, too late to count a call that never
    sends it. Only the first request message is read."""

    def __init__(self, pool: futures.ThreadPoolExecutor, peers: PeerCalls,
                 first_message_s: float, rates: dict[str, RateGate]) -> None:
        self._pool, self._peers, self._first_s = pool, peers, first_message_s
        self._rates = rates  # method -> its per-peer rate

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        deserializer = handler.request_deserializer
        if deserializer is not None:
            deserializer = _tolerant(deserializer, details.method)
        return grpc.stream_unary_rpc_method_handler(
            self._guarded(handler.unary_unary, details.method),
            request_deserializer=deserializer, response_serializer=handler.response_serializer)

    def _guarded(self, method: Callable, name: str) -> Callable:
        pool, peers, first_s = self._pool, self._peers, self._first_s
        in_loop = inspect.iscoroutinefunction(method)
        short = name.rsplit("/", 1)[-1]
        rate = self._rates.get(short)

        async def call(requests: Any, context: Any) -> Any:
            peer = peer_of(context)
            try:
                if rate is not None:
                    rate.take(peer, short)
                peers.open(peer)
            except Refused as exc:
                await _refuse(context, exc)
            try:
                try:
                    request = await asyncio.wait_for(context.read(), first_s)
                except asyncio.TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"{name}: no request message within {first_s:g} s of "
                                        "the call's start (FIRST_MESSAGE_S)")
                if request is grpc.aio.EOF:
                    await _refuse(context, Refused(Refusal.INVALID_ARGUMENT,
                                                   f"{name}: the call ended without a request"))
                if in_loop:
                    return await method(request, context)
                loop = asyncio.get_running_loop()
                ctx = _Context(context, loop)
                try:
                    return await loop.run_in_executor(pool, method, request, ctx)
                except asyncio.CancelledError:
                    ctx.gone.set()  # a waiting handler sees is_active() false and ends
                    raise
            finally:
                peers.close(peer)
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


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class ControlServer:
    """A gRPC server of the control plane with the interface of ``grpc.Server`` that dips
    uses (add handlers and ports, ``start``, ``stop(grace).wait(timeout)``), on gRPC's
    asyncio stack: a call's request is received on the event loop, and only a call whose
    request has arrived takes one of the ``max_workers`` threads that run its (synchronous)
    handler. A member that opens calls and never sends their messages holds no thread
    (issue 13, review 25: 24 such calls held every thread of the leader), at most
    ``peer_calls`` open calls, each for at most ``first_message_s``, read calls at the
    rate of ``reads`` and heartbeats at the rate of ``heartbeats`` (None: not limited); the
    server keeps at most ``connection_limit(connections)`` connections open.

    Raises:
        ValueError: ``max_workers``, ``peer_calls`` or ``connections`` below 1,
            ``first_message_s`` not > 0.
    """

    def __init__(self, max_workers: int, peer_calls: int = PEER_CALLS,
                 first_message_s: float = FIRST_MESSAGE_S,
                 reads: RateGate | None = None, heartbeats: RateGate | None = None,
                 connections: int = SERVER_CONNECTIONS) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers {max_workers} must be >= 1")
        if not first_message_s > 0:
            raise ValueError(f"first_message_s {first_message_s} must be > 0 seconds")
        self.peers = PeerCalls(peer_calls)
        self.connections = connection_limit(connections)
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers,
                                                thread_name_prefix="grpc")
        self._loop = _event_loop()
        self.reads, self.heartbeats = reads, heartbeats
        rates = {**({m: reads for m in READS} if reads else {}),
                 **({m: heartbeats for m in HEARTBEATS} if heartbeats else {})}
        guard = _Guarded(self._pool, self.peers, first_message_s, rates)

        async def build() -> grpc.aio.Server:
            return grpc.aio.server(
                migration_thread_pool=self._pool, interceptors=[guard],
                maximum_concurrent_rpcs=SERVER_CALLS,
                options=[("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
                         ("grpc.max_allowed_incoming_connections", self.connections),
                         ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.max_connection_idle_ms", _ms(IDLE_S)),
                         ("grpc.server_handshake_timeout_ms", _ms(HANDSHAKE_S)),
                         ("grpc.keepalive_time_ms", _ms(KEEPALIVE_S)),
                         ("grpc.keepalive_timeout_ms", _ms(KEEPALIVE_TIMEOUT_S)),
                         ("grpc.http2.max_pings_without_data", 0),
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


def make_server(max_workers: int = 32, peer_calls: int = PEER_CALLS,
                first_message_s: float = FIRST_MESSAGE_S,
                reads: RateGate | None = None,
                heartbeats: RateGate | None = None,
                connections: int = SERVER_CONNECTIONS) -> ControlServer:
    """A gRPC server (:class:`ControlServer`); bind it with
    :meth:`dips.wire.security.Credentials.add_port` (mutual TLS unless insecure), and have
    its servicers check :func:`dips.wire.security.caller`. A request that does not parse
    reaches the servicer as :class:`Malformed`. Each connection has at most
    :data:`STREAMS_PER_CONNECTION` calls in progress, each peer ``peer_calls`` (BUSY beyond),
    the server :data:`SERVER_CALLS`; a call holds a handler thread only once its request has
    arrived, and ends DEADLINE_EXCEEDED when it has not within ``first_message_s`` seconds.

    Args:
        max_workers: handler threads; leader handlers block (push admission), so give its
            servicer a :meth:`dips.wire.inflight.CallGate.for_server` of this number.
        peer_calls: open calls per peer (:class:`dips.wire.inflight.PeerCalls`).
        first_message_s: seconds from a call's headers to its request message.
        reads: each peer's rate of read calls (:data:`dips.wire.inflight.READS`; the
            leader's: ``membership.read_calls_per_s``); None: not limited.
        heartbeats: each peer's rate of heartbeats (:data:`dips.wire.inflight.HEARTBEATS`;
            the leader's: :func:`dips.algo.ratelimit.heartbeat_limit` of
            ``membership.heartbeat_interval_s``); None: not limited.
        connections: connections open at once over all peers (:func:`connection_limit`).
    """
    return ControlServer(max_workers, peer_calls, first_message_s, reads, heartbeats,
                         connections)
