"""Encryption of tensor bytes on the data plane: AES-256-GCM per chunk (or per payload).

Chosen by measurement against CurveZMQ (``benchmarks/dataplane/bench_secure.py``): GCM runs
per chunk in the threads that already handle the chunk (the sender's queueing thread, the
follower's consumer, the puller), outside ZeroMQ's single I/O thread, and releases the GIL.
Each transfer gets its own key, ``HMAC-SHA256(member key, label + header)``, where the
header (authenticated by its HMAC) names the cluster, round, push id, layer, the transfer id
and a fresh random nonce; the GCM nonce is the chunk's position and its associated data the
chunk's meta (transfer id + position). So a chunk decrypts only in its own place of its own
transfer: captured, it cannot be replayed into another push or position. Source:
``cryptography``'s AESGCM (NIST SP 800-38D).
"""

from __future__ import annotations

import hmac
import os

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

#: Bytes a GCM tag adds to each encrypted chunk or payload.
TAG_BYTES = 16


def cipher(key: bytes, label: bytes, head: bytes) -> AESGCM:
    """The AES-256-GCM key of one transfer or message: bound to its authenticated header."""
    return AESGCM(hmac.digest(key, b"dips/aead/" + label + head, "sha256"))


def nonce(seq: int) -> bytes:
    """The 12-byte GCM nonce of position ``seq`` (unique within one transfer key)."""
    return seq.to_bytes(12, "little")


def fresh() -> str:
    """A random nonce for a header (hex), so no two transfers share a key."""
    return os.urandom(16).hex()


class SealRing:
    """Output buffers for encrypted chunks sent zero-copy, reused round-robin.

    ZeroMQ keeps a reference to a buffer sent with ``copy=False`` until its I/O thread has
    written it, so a buffer is reused only once the tracker of its last send is done
    (``send_multipart(..., track=True)``); reusing it earlier would alter a chunk still in
    flight. A slot whose buffer is still in flight (a slow link) gets a fresh buffer instead:
    nothing waits here. Reusing instead of allocating per chunk measured ~20% faster
    (``bench_secure.py``, modes 5a/5b). One ring per sending thread.

    The buffers alive are the ring's plus those still in flight: a sender that bounds what it
    has in flight (the data server's pull windows, :mod:`dips.wire.pullstreams`) bounds them.

    Args:
        slots: buffers in the ring.

    Attributes:
        allocated: buffers created so far.
    """

    def __init__(self, slots: int = 16) -> None:
        self._bufs: list[bytearray | None] = [None] * slots
        self._trackers: list[object | None] = [None] * slots
        self._next = 0
        self._last = -1
        self.allocated = 0

    def take(self, nbytes: int) -> memoryview:
        """A buffer of exactly ``nbytes`` that nothing else references."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        tracker, buf = self._trackers[i], self._bufs[i]
        if buf is None or len(buf) < nbytes or (tracker is not None and not tracker.done):
            buf = self._bufs[i] = bytearray(nbytes)  # the old one stays with ZeroMQ until sent
            self.allocated += 1
        self._trackers[i] = None
        self._last = i
        return memoryview(buf)[:nbytes]

    def track(self, tracker: object) -> None:
        """The tracker of the send of the buffer last taken."""
        self._trackers[self._last] = tracker
