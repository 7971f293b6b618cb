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
