"""Chunked tensor streams for the data plane (§10, §12 of the seed).

A large transfer (one layer of a push, or the layers of a pull) travels as a sequence of
ZeroMQ messages on one connection, so the receiver can verify and consume chunk k while chunk
k+1 is still on the wire (a single multipart message is delivered only once complete):

* ``BEGIN  [b"B", head, mac]``: ``head`` is UTF-8 JSON ``{"v": 2, "op": ..., "xfer": hex,
  "chunk": bytes, "tensors": [{"name", "dtype", "shape"}, ...], ...}``;
  ``mac = HMAC-SHA256(key, b"dips/begin" + head)``.
* ``CHUNK  [b"C", meta, tag, data]``: ``meta = xfer (16 bytes) + seq (uint32 LE)``; ``data`` is
  1 chunk of raw little-endian tensor bytes. With ``"enc": 1`` in the header the chunk is
  ``[b"C", meta, b"", ciphertext + GCM tag]`` (AES-256-GCM under a key bound to the header,
  nonce = seq, associated data = meta; :mod:`dips.wire.seal`) and its tag is the GCM tag. Each tensor is cut on its own into pieces of
  ``chunk`` bytes (the last may be shorter; an empty tensor has none), in tensor order.
  ``tag = Poly1305(k_seq, data)`` with the one-time key ``k_seq = HMAC-SHA256(key,
  b"dips/chunk" + xfer + seq)``: the HMAC binds every chunk to its transfer and position, and
  Poly1305 (≈ 12 GB/s here, against 1.7 GB/s for HMAC-SHA256 itself) authenticates its bytes.
* ``END    [b"E", meta, mac]``: ``meta = xfer + count``; ``mac = HMAC-SHA256(key, b"dips/end"
  + xfer + count + tag_0 + ... + tag_{n-1})``, so the HMAC covers the header and every chunk.

:class:`StreamReader` refuses, with a :class:`~dips.wire.frames.FrameError` naming the field
and value, a header that is unauthenticated or malformed, a chunk that is out of order
(reordered or lost), of the wrong size, unauthenticated, surplus, or an END that comes before
all chunks (truncated). Nothing here allocates per chunk: data are memoryviews.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.poly1305 import Poly1305

from dips.wire import seal
from dips.wire.frames import (
    DTYPE_NAMES,
    DTYPES,
    MAX_HEADER_BYTES,
    FrameError,
    check_spec,
    load_json,
    tensor_bytes,
)

STREAM_VERSION = 2
BEGIN, CHUNK, END = b"B", b"C", b"E"
DEFAULT_CHUNK_BYTES = 2 << 20
MIN_CHUNK_BYTES = 256
MAX_CHUNK_BYTES = 4 << 20
_META = struct.Struct("<16sI")
#: Most chunks in one transfer: a chunk's position travels as a uint32.
MAX_CHUNKS = 2**32 - 1
#: Most tensors one stream header may announce.
MAX_TENSORS = 1 << 16


@dataclass(frozen=True)
class TensorSpec:
    """Name, wire dtype ("bf16" | "fp32") and shape of one streamed tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @staticmethod
    def of(name: str, t: torch.Tensor) -> "TensorSpec":
        """Spec of a CPU tensor. Raises FrameError for a dtype other than BF16/FP32."""
        if t.dtype not in DTYPE_NAMES:
            raise FrameError(f"tensor {name!r}: dtype {t.dtype} is not one of {sorted(DTYPES)}")
        return TensorSpec(name, DTYPE_NAMES[t.dtype], tuple(t.shape))


def check_chunk_bytes(chunk_bytes: Any) -> int:
    """Return ``chunk_bytes`` if it is an int in [256 B, 4 MiB] and a multiple of 4, else raise."""
    if (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
            or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % 4):
        raise FrameError(f"field 'chunk' = {repr(chunk_bytes)[:80]} must be a multiple of 4 in "
                         f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] bytes")
    return chunk_bytes


class ChunkPlan:
    """The chunks of a transfer in order, ``plan[seq] = (tensor index, byte offset, nbytes)``,
    computed on demand: O(tensors) memory and time whatever sizes the header declares (a
    hostile header must not make the receiver build a list of millions of chunks).

    Attributes:
        count: number of chunks. starts: the seq of each tensor's first chunk.
    """

    def __init__(self, specs: Sequence[TensorSpec], chunk_bytes: int) -> None:
        self._sizes = [s.nbytes for s in specs]
        self._chunk = chunk_bytes
        self.starts: list[int] = []
        n = 0
        for size in self._sizes:
            self.starts.append(n)
            n += -(-size // chunk_bytes)
        self.count = n

    def __getitem__(self, seq: int) -> tuple[int, int, int]:
        if not 0 <= seq < self.count:
            raise IndexError(f"chunk {seq} of {self.count}")
        # The last tensor starting at or before seq: empty tensors share their start with the
        # next tensor, so the one found is the non-empty tensor holding the chunk.
        i = bisect.bisect_right(self.starts, seq) - 1
        off = (seq - self.starts[i]) * self._chunk
        return i, off, min(self._chunk, self._sizes[i] - off)


def plan_chunks(specs: Sequence[TensorSpec], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """Chunks of a transfer in order: ``(tensor index, byte offset, nbytes)`` (a list; the
    codec itself uses :class:`ChunkPlan`)."""
    plan = ChunkPlan(specs, chunk_bytes)
    return [plan[k] for k in range(plan.count)]


def _chunk_key(key: bytes, xfer: bytes, seq: int) -> bytes:
    return hmac.digest(key, b"dips/chunk" + _META.pack(xfer, seq), "sha256")


def _end_mac(key: bytes, xfer: bytes, count: int) -> Any:
    """The END MAC's running state: each chunk's tag is added as it passes, so neither side
    keeps a list of tags (16 bytes per chunk, unbounded for a hostile chunk count)."""
    return hmac.new(key, b"dips/end" + _META.pack(xfer, count), hashlib.sha256)


class StreamWriter:
    """Builds the messages of one transfer (sender side).

    Args:
        key: the run secret. header: JSON fields (must contain ``op``; ``v``, ``xfer``,
            ``chunk`` and ``tensors`` are reserved). specs: the tensors, in sending order.
        chunk_bytes: piece size (see :func:`check_chunk_bytes`). xfer: 16-byte transfer id
            (default: random). encrypt: encrypt each chunk (see the module docstring).
        ring: where encrypted chunks are written (:class:`dips.wire.seal.SealRing`; the
            sender must :meth:`~dips.wire.seal.SealRing.track` each send); None: a fresh
            buffer per chunk.

    Raises:
        FrameError: a reserved or missing header field, a bad chunk size.
    """

    def __init__(self, key: bytes, header: dict[str, Any], specs: Sequence[TensorSpec],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, xfer: bytes | None = None,
                 encrypt: bool = False, ring: seal.SealRing | None = None) -> None:
        if "op" not in header:
            raise FrameError("header field 'op' is missing")
        reserved = {"v", "xfer", "chunk", "tensors", "enc", "nonce"} & set(header)
        if reserved:
            raise FrameError(f"header fields {sorted(reserved)} are reserved")
        self._key = key
        self.xfer = xfer or os.urandom(16)
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.specs = list(specs)
        self.plan = ChunkPlan(self.specs, self.chunk_bytes)
        if self.plan.count > MAX_CHUNKS:
            raise FrameError(f"transfer of {self.plan.count} chunks exceeds {MAX_CHUNKS}")
        sealed = {"enc": 1, "nonce": seal.fresh()} if encrypt else {}
        self.head = json.dumps({"v": STREAM_VERSION, **header, **sealed, "xfer": self.xfer.hex(),
                                "chunk": self.chunk_bytes,
                                "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}
                                            for s in self.specs]}, separators=(",", ":")).encode()
        self._sent = 0
        self._mac = _end_mac(key, self.xfer, self.plan.count)
        self._aead = seal.cipher(key, b"stream", self.head) if encrypt else None
        self._ring = ring

    @property
    def encrypted(self) -> bool:
        return self._aead is not None

    def begin(self) -> list[bytes]:
        return [BEGIN, self.head, hmac.digest(self._key, b"dips/begin" + self.head, "sha256")]

    def chunks(self, index: int, tensor: torch.Tensor) -> Iterator[list[Any]]:
        """Yield ``[b"C", meta, tag, data]`` for every piece of tensor ``index`` (in order).

        ``data`` is a zero-copy view of ``tensor``: keep it unchanged until it is sent.
        Raises FrameError if ``tensor`` does not match its spec or comes out of order.
        """
        spec = self.specs[index]
        if TensorSpec.of(spec.name, tensor) != spec or not tensor.is_contiguous():
            raise FrameError(f"tensor {spec.name!r}: {tensor.dtype} {tuple(tensor.shape)} does not "
                             f"match its spec {spec.dtype} {list(spec.shape)} (or not contiguous)")
        if self._sent != self.plan.starts[index]:
            raise FrameError(f"tensor {spec.name!r} sent out of order")
        raw = tensor_bytes(tensor)
        for seq in range(self.plan.starts[index], self.plan.count):
            i, off, n = self.plan[seq]
            if i != index:
                break
            data = raw[off:off + n]
            meta = _META.pack(self.xfer, seq)
            if self._aead is not None:
                sealed = (self._ring.take(n + seal.TAG_BYTES) if self._ring is not None
                          else bytearray(n + seal.TAG_BYTES))  # ZeroMQ holds it until sent
                self._aead.encrypt_into(seal.nonce(seq), data, meta, sealed)
                self._mac.update(bytes(sealed[n:]))
                self._sent += 1
                yield [CHUNK, meta, b"", sealed]
                continue
            tag = Poly1305.generate_tag(_chunk_key(self._key, self.xfer, seq), data)
            self._mac.update(tag)
            self._sent += 1
            yield [CHUNK, meta, tag, data]

    def end(self) -> list[bytes]:
        """The END message. Raises FrameError if some chunk was not produced."""
        if self._sent != self.plan.count:
            raise FrameError(f"stream ended after {self._sent} of {self.plan.count} chunks")
        return [END, _META.pack(self.xfer, self.plan.count), self._mac.copy().digest()]


class StreamReader:
    """Verifies one incoming transfer (receiver side); see the module docstring.

    Nothing here grows with the sizes the header declares: the chunk plan is computed on
    demand and the END MAC runs as chunks pass, so a receiver can check the declared tensors
    (e.g. against its shard) before it allocates anything for them.

    Args:
        key: the sender's member key. head, mac: the BEGIN message's JSON and MAC.
        require_encrypted: refuse a stream whose chunks are not encrypted.

    Attributes:
        header: JSON fields other than the reserved ones. specs: the announced tensors.
        plan: :class:`ChunkPlan` of the transfer. xfer: the 16-byte id.

    Raises:
        FrameError: unauthenticated or malformed header (field and value named).
    """

    def __init__(self, key: bytes, head: bytes, mac: bytes, require_encrypted: bool = False) -> None:
        if len(head) > MAX_HEADER_BYTES:
            raise FrameError(f"header length {len(head)} exceeds {MAX_HEADER_BYTES} bytes")
        if not hmac.compare_digest(hmac.digest(key, b"dips/begin" + head, "sha256"), mac):
            raise FrameError("begin mac does not match: stream unauthenticated or altered")
        h = load_json(head, "stream header")
        if not isinstance(h, dict) or h.get("v") != STREAM_VERSION:
            got = h.get("v") if isinstance(h, dict) else h
            raise FrameError(f"stream header field 'v' = {repr(got)[:80]}, expected {STREAM_VERSION}")
        xfer = h.pop("xfer", None)
        try:
            self.xfer = bytes.fromhex(xfer) if isinstance(xfer, str) else b""
        except ValueError:
            self.xfer = b""
        if len(self.xfer) != 16:
            raise FrameError(f"stream header field 'xfer' = {repr(xfer)[:80]} is not a 16-byte hex id")
        self.chunk_bytes = check_chunk_bytes(h.pop("chunk", None))
        self.specs = [TensorSpec(*check_spec(m)) for m in _list(h.pop("tensors", None))]
        if len({s.name for s in self.specs}) != len(self.specs):
            raise FrameError(f"stream header lists a tensor twice: {[s.name for s in self.specs][:20]}")
        h.pop("v")
        self.encrypted = h.pop("enc", 0) == 1
        h.pop("nonce", None)
        if require_encrypted and not self.encrypted:
            raise FrameError("stream chunks are not encrypted, and this member's must be")
        self.plan = ChunkPlan(self.specs, self.chunk_bytes)
        if self.plan.count > MAX_CHUNKS:
            raise FrameError(f"stream of {self.plan.count} chunks exceeds {MAX_CHUNKS}")
        self._aead = seal.cipher(key, b"stream", head) if self.encrypted else None
        self.header = h
        self._key = key
        self._seq = 0
        self._mac = _end_mac(key, self.xfer, self.plan.count)

    @property
    def received(self) -> int:
        return self._seq

    def expect(self, meta: bytes) -> tuple[int, int, int]:
        """Check a chunk's ``meta`` names this transfer and the next position; return its place
        ``(tensor index, byte offset, nbytes)``. Raises FrameError (reordered, lost, surplus)."""
        try:
            xfer, seq = _META.unpack(meta)
        except (struct.error, TypeError):
            raise FrameError(f"chunk meta is {len(meta)} bytes, expected {_META.size}") from None
        if xfer != self.xfer:
            raise FrameError(f"chunk of transfer {xfer.hex()} inside transfer {self.xfer.hex()}")
        if seq >= self.plan.count:
            raise FrameError(f"chunk seq {seq} beyond the {self.plan.count} chunks announced")
        if seq != self._seq:
            raise FrameError(f"chunk seq {seq} arrived where seq {self._seq} was expected "
                             f"(reordered or lost)")
        return self.plan[seq]

    def receive(self, meta: bytes, tag: bytes, data: memoryview,
                scratch: memoryview) -> tuple[int, int, memoryview]:
        """Verify (and decrypt into ``scratch``, at least :data:`MAX_CHUNK_BYTES`) the next
        chunk; return ``(tensor index, byte offset, plaintext)`` (``data`` itself when not
        encrypted). Raises FrameError as :meth:`verify` and :meth:`open_into`."""
        if self._aead is None:
            i, off = self.verify(meta, tag, data)
            return i, off, data
        i, off, n = self.expect(meta)
        out = scratch[:n]
        self.open_into(meta, data, out)
        return i, off, out

    def open_into(self, meta: bytes, data: memoryview | bytes, out: memoryview) -> tuple[int, int]:
        """Decrypt the next (encrypted) chunk ``data`` (ciphertext + tag) into ``out``; return
        ``(tensor index, byte offset)``. Raises FrameError: out of order, wrong size, tag
        mismatch (altered, or a chunk of another transfer or position)."""
        if self._aead is None:
            raise FrameError("an unencrypted stream's chunk must be verified, not opened")
        i, off, n = self.expect(meta)
        if len(data) != n + seal.TAG_BYTES or len(out) != n:
            raise FrameError(f"chunk {self._seq} of tensor {self.specs[i].name!r} is "
                             f"{len(data)} bytes, expected {n + seal.TAG_BYTES}")
        try:
            self._aead.decrypt_into(seal.nonce(self._seq), data, meta, out)
        except InvalidTag:
            raise FrameError(f"chunk {self._seq} of tensor {self.specs[i].name!r}: tag "
                             f"does not match (altered, or replayed from elsewhere)") from None
        self._mac.update(bytes(data[n:]))
        self._seq += 1
        return i, off

    def verify(self, meta: bytes, tag: bytes, data: memoryview | bytes) -> tuple[int, int]:
        """Verify the next (unencrypted) chunk; return ``(tensor index, byte offset)``.

        Raises FrameError: out of order, wrong size, or tag mismatch (unauthenticated/altered).
        """
        if self._aead is not None:
            raise FrameError("an encrypted stream's chunk must be opened, not verified")
        i, off, n = self.expect(meta)
        if len(data) != n:
            raise FrameError(f"chunk {self._seq} of tensor {self.specs[i].name!r} is "
                             f"{len(data)} bytes, expected {n}")
        seq = self._seq
        try:
            Poly1305.verify_tag(_chunk_key(self._key, self.xfer, seq), data, tag)
        except InvalidSignature:
            raise FrameError(f"chunk {seq} of tensor {self.specs[i].name!r}: tag does not match "
                             f"(unauthenticated or altered)") from None
        self._mac.update(bytes(tag))
        self._seq += 1
        return i, off

    def end(self, meta: bytes, mac: bytes) -> None:
        """Verify the END message. Raises FrameError if truncated or unauthenticated."""
        try:
            xfer, count = _META.unpack(meta)
        except (struct.error, TypeError):
            raise FrameError(f"end meta is {len(meta)} bytes, expected {_META.size}") from None
        if xfer != self.xfer:
            raise FrameError(f"end of transfer {xfer.hex()} inside transfer {self.xfer.hex()}")
        if count != self.plan.count or self._seq != self.plan.count:
            raise FrameError(f"stream truncated: {self._seq} of {self.plan.count} chunks "
                             f"received, end says {count}")
        if not hmac.compare_digest(self._mac.copy().digest(), mac):
            raise FrameError("end mac does not match: stream unauthenticated or altered")


def _list(x: Any) -> list:
    if not isinstance(x, list) or len(x) > MAX_TENSORS:
        raise FrameError(f"stream header field 'tensors' = {repr(x)[:80]} is not a list of at "
                         f"most {MAX_TENSORS} entries")
    return x
