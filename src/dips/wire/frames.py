"""Tensor frame codec for the data plane (§5, §10, §12 of the seed).

A message is a ZeroMQ multipart: ``[header, mac, payload_0, ..., payload_{n-1}]``.

* ``header``: UTF-8 JSON object, small (< a few KB): ``{"v": 1, "op": str, ...,
  "tensors": [{"name": str, "dtype": "bf16"|"fp32", "shape": [int, ...]}, ...]}``.
* ``mac``: HMAC-SHA256 over the header and every payload, keyed with the sender's member key
  (:mod:`dips.wire.keys`), so an unauthenticated or altered message is refused before
  anything is decoded.
* ``payload_k``: the raw little-endian bytes of tensor k (contiguous, C order), or, with
  ``"enc": 1`` in the header, those bytes encrypted with AES-256-GCM (:mod:`dips.wire.seal`).

Nothing is ever unpickled. Decoding checks the frame count, the MAC, each dtype, each
shape against the byte length, and (optionally) that values are finite; any failure raises
:class:`FrameError` naming the field and the value, and nothing is returned.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from cryptography.exceptions import InvalidTag

from dips.wire import seal

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
#: Most dimensions of one tensor (torch allows 64; a model's parameters have 1 or 2).
MAX_DIMS = 16
#: Largest tensor a header may declare (bytes): beyond anything a host can hold, and small
#: enough that sizes derived from it stay within int64.
MAX_TENSOR_BYTES = 1 << 48
#: Longest tensor name (characters).
MAX_NAME_CHARS = 256

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class FrameError(ValueError):
    """A data-plane message that is malformed, unauthenticated or inconsistent."""


@dataclass
class Message:
    """One decoded data-plane message.

    Attributes:
        header: the JSON header fields other than ``tensors`` (``op``, ``cluster``, ...).
        tensors: name -> tensor, in the order they were sent; each tensor owns its memory.
    """

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _mac(key: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor as a flat memoryview (zero-copy if ``t`` is contiguous)."""
    # bf16 has no numpy dtype: view the storage as bytes without a copy.
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def encode(key: bytes, header: dict[str, Any],
           tensors: Sequence[tuple[str, torch.Tensor]] = (),
           encrypt: bool = False) -> list[bytes | memoryview]:
    """Encode a header and named tensors into multipart frames.

    Args:
        key: the sender's member key (bytes, >= 16; :mod:`dips.wire.keys`).
        header: JSON-serializable fields; must contain ``op``; must not contain ``tensors``,
            ``v``, ``enc`` or ``nonce``.
        tensors: (name, tensor) pairs; dtype BF16 or FP32, any shape, on CPU.
        encrypt: encrypt each payload (AES-256-GCM, :mod:`dips.wire.seal`; +16 bytes each);
            the header stays readable and authenticated.

    Returns:
        ``[header, mac, payload...]`` ready for ``socket.send_multipart(..., copy=False)``.

    Raises:
        FrameError: unsupported dtype, missing ``op``, or a reserved header field.
    """
    if "op" not in header:
        raise FrameError("header field 'op' is missing")
    if {"tensors", "v", "enc", "nonce"} & set(header):
        raise FrameError("header fields 'tensors', 'v', 'enc' and 'nonce' are reserved")
    meta = []
    payloads: list[memoryview] = []
    for name, t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise FrameError(f"tensor {name!r}: dtype {t.dtype} is not one of {sorted(DTYPES)}")
        meta.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)})
        payloads.append(tensor_bytes(t))
    sealed = {"enc": 1, "nonce": seal.fresh()} if encrypt else {}
    head = json.dumps({"v": PROTOCOL_VERSION, **header, **sealed, "tensors": meta},
                      separators=(",", ":")).encode()
    if encrypt:
        aead = seal.cipher(key, b"msg", head)
        payloads = [aead.encrypt(seal.nonce(i), p, None) for i, p in enumerate(payloads)]
    return [head, _mac(key, [head, *payloads]), *payloads]


def decode(key: bytes, frames: Sequence[bytes | memoryview], *,
           require_finite: bool = True, require_encrypted: bool = False) -> Message:
    """Decode and verify multipart frames produced by :func:`encode`.

    Args:
        key: the sender's member key.
        frames: the received frames (bytes, memoryviews or zmq.Frame buffers).
        require_finite: refuse NaN/Inf values in floating tensors.
        require_encrypted: refuse a message with payloads that are not encrypted (a
            header-only message, e.g. an ack or an error, needs no encryption).

    Returns:
        The :class:`Message`; tensors are fresh CPU tensors of the sent dtype and shape.

    Raises:
        FrameError: wrong frame count, bad MAC, bad JSON, unknown dtype, a shape that does not
            match the payload length, non-finite values, or a protocol version mismatch.
    """
    if len(frames) < 2:
        raise FrameError(f"frame count {len(frames)} < 2 (need header and mac)")
    head = bytes(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise FrameError(f"header length {len(head)} exceeds {MAX_HEADER_BYTES} bytes")
    payloads = [memoryview(f) for f in frames[2:]]
    if not hmac.compare_digest(_mac(key, [head, *payloads]), bytes(frames[1])):
        raise FrameError("mac does not match: message unauthenticated or altered")
    header = load_json(head, "header")
    if not isinstance(header, dict):
        raise FrameError(f"header is a {type(header).__name__}, expected an object")
    if header.get("v") != PROTOCOL_VERSION:
        raise FrameError(f"header field 'v' = {_show(header.get('v'))}, expected {PROTOCOL_VERSION}")
    meta = header.pop("tensors", [])
    header.pop("v")
    encrypted = header.pop("enc", 0) == 1
    header.pop("nonce", None)
    if require_encrypted and payloads and not encrypted:
        raise FrameError("message payloads are not encrypted, and this member's must be")
    if not isinstance(meta, list) or len(meta) != len(payloads):
        n = len(meta) if isinstance(meta, list) else _show(meta)
        raise FrameError(f"header lists {n} tensors but {len(payloads)} payload frames arrived")
    if encrypted:
        payloads = _open(key, head, payloads)
    tensors: dict[str, torch.Tensor] = {}
    for m, payload in zip(meta, payloads):
        name, t = _decode_tensor(m, payload)
        if require_finite and not bool(torch.isfinite(t).all()):
            raise FrameError(f"tensor {name!r} contains NaN or Inf")
        if name in tensors:
            raise FrameError(f"tensor {name!r} appears twice")
        tensors[name] = t
    return Message(header=header, tensors=tensors)


def load_json(raw: bytes, what: str) -> Any:
    """``raw`` parsed as JSON. Raises FrameError naming ``what``: not UTF-8, not JSON, nested too
    deeply (``[[[...`` raises RecursionError inside :mod:`json`) or an integer literal of more
    than 4300 digits."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise FrameError(f"{what} is not JSON: {str(exc)[:120]}") from None


def _show(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (a hostile value may be huge)."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def check_spec(meta: Any) -> tuple[str, str, tuple[int, ...]]:
    """``(name, dtype name, shape)`` of one header tensor entry ``{"name", "dtype", "shape"}``.

    Raises FrameError naming the field and its value: not an object, a name that is not a
    string of at most :data:`MAX_NAME_CHARS`, a dtype not in :data:`DTYPES`, a shape that is
    not a list of at most :data:`MAX_DIMS` non-negative ints (booleans are not sizes), or a
    tensor larger than :data:`MAX_TENSOR_BYTES`.
    """
    if not isinstance(meta, dict):
        raise FrameError(f"tensor entry {_show(meta)} is not an object")
    name, dtype_name, shape = meta.get("name"), meta.get("dtype"), meta.get("shape")
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        raise FrameError(f"tensor field 'name' = {_show(name)} is not a string of at most "
                         f"{MAX_NAME_CHARS} characters")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise FrameError(f"tensor {name!r}: field 'dtype' = {_show(dtype_name)} not in {sorted(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise FrameError(f"tensor {name!r}: field 'shape' = {_show(shape)} is not a list of at "
                         f"most {MAX_DIMS} sizes (non-negative ints)")
    nbytes = DTYPES[dtype_name].itemsize
    for d in shape:
        nbytes *= d
        if nbytes > MAX_TENSOR_BYTES:  # checked as it grows: no huge products computed
            raise FrameError(f"tensor {name!r}: shape {_show(shape)} exceeds "
                             f"{MAX_TENSOR_BYTES} bytes")
    return name, dtype_name, tuple(shape)


def _open(key: bytes, head: bytes, payloads: list[memoryview]) -> list[memoryview]:
    aead = seal.cipher(key, b"msg", head)
    out = []
    for i, p in enumerate(payloads):
        if p.nbytes < seal.TAG_BYTES:
            raise FrameError(f"encrypted payload {i} is {p.nbytes} bytes, shorter than a tag")
        try:
            out.append(memoryview(aead.decrypt(seal.nonce(i), p, None)))
        except InvalidTag:
            raise FrameError(f"encrypted payload {i}: tag does not match (altered)") from None
    return out


def _decode_tensor(meta: Any, payload: memoryview) -> tuple[str, torch.Tensor]:
    name, dtype_name, shape = check_spec(meta)
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if payload.nbytes != expected:
        raise FrameError(f"tensor {name!r}: payload is {payload.nbytes} bytes, shape {list(shape)} "
                         f"of {dtype_name} needs {expected}")
    out = torch.empty(shape, dtype=dtype)
    if expected:
        out.reshape(-1).view(torch.uint8).numpy()[:] = memoryview(payload).cast("B")
    return name, out
