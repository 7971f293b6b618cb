"""ZeroMQ data plane: stage workers <-> followers (§5, §10 of the seed).

Followers bind a ROUTER socket and answer each request with exactly one reply; a stage
worker holds one REQ socket per follower. Messages are the authenticated frames of
:mod:`dips.wire.frames` (raw tensor bytes + a JSON header; never pickle). Every blocking
call has a timeout: a REQ socket whose reply did not arrive in time is closed and recreated,
so a lost message never wedges the worker.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch
import zmq

from dips.wire.frames import FrameError, Message, decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[Message], tuple[dict[str, Any], Sequence[tuple[str, torch.Tensor]]]]


class DataPlaneError(RuntimeError):
    """The peer answered a data-plane request with an error (its text is the message)."""


class DataServer:
    """A ROUTER socket served by one thread; each request gets one reply from ``handler``.

    Args:
        key: run secret used to authenticate every frame.
        handler: ``Message -> (reply header, reply tensors)``; a raised ``ValueError``
            (including :class:`FrameError`) becomes an ``{"op": "error"}`` reply naming it.
        host: interface to bind (127.0.0.1 for local runs).
        port: TCP port, 0 picks a free one (see :attr:`endpoint`).
        poll_s: seconds between checks of the stop flag.
    """

    def __init__(self, key: bytes, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 poll_s: float = 0.1) -> None:
        self._key = key
        self._handler = handler
        self._poll_ms = int(poll_s * 1000)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="data-server", daemon=True)

    def start(self) -> "DataServer":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close(0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(self._poll_ms):
                continue
            frames = self._sock.recv_multipart(copy=False)
            # REQ peers prefix [identity, empty delimiter].
            if len(frames) < 2:
                continue
            envelope, body = frames[:2], [f.buffer for f in frames[2:]]
            try:
                msg = decode(self._key, body)
                header, tensors = self._handler(msg)
            except (ValueError, KeyError) as exc:
                log.warning("data-plane request refused: %s", exc)
                header, tensors = {"op": "error", "error": str(exc)}, ()
            except Exception as exc:  # keep serving other peers; report the failure
                log.exception("data-plane handler failed")
                header, tensors = {"op": "error", "error": f"internal: {exc}"}, ()
            reply = encode(self._key, header, tensors)
            self._sock.send_multipart([f.bytes for f in envelope] + reply, copy=False)


class DataClient:
    """A REQ socket to one follower's :class:`DataServer`.

    Not thread-safe: each stage worker owns its own clients.

    Args:
        key: run secret.
        endpoint: ``tcp://host:port`` of the follower.
        timeout_s: seconds to wait for each reply before raising ``TimeoutError``.
    """

    def __init__(self, key: bytes, endpoint: str, timeout_s: float = 60.0) -> None:
        self._key = key
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def request(self, header: dict[str, Any],
                tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> Message:
        """Send one request and return the verified reply.

        Raises:
            TimeoutError: no reply within ``timeout_s`` (the socket is reset).
            DataPlaneError: the follower replied with an error.
            FrameError: the reply failed verification.
        """
        sock = self._socket()
        try:
            sock.send_multipart(encode(self._key, header, tensors), copy=False)
            frames = sock.recv_multipart(copy=False)
        except zmq.Again:
            self.close()
            raise TimeoutError(f"no reply from {self.endpoint} within {self.timeout_s} s "
                               f"(op {header.get('op')!r})") from None
        msg = decode(self._key, [f.buffer for f in frames])
        if msg.header.get("op") == "error":
            raise DataPlaneError(f"{self.endpoint}: {msg.header.get('error')}")
        return msg

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None


__all__ = ["DataClient", "DataPlaneError", "DataServer", "FrameError"]
