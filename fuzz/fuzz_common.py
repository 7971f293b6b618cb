"""What the atheris targets of fuzz/ share (issue 13): the input format, a member's key, and
seeds (valid messages in that format, so coverage starts from the real protocol).

An input is a flags byte followed by frames, each a 2-byte little-endian length and its
bytes (a tail shorter than its length is the last frame). The flags say what a member
holding a valid key would do with them: sign the header, complete the chunk tags, ...; each
target documents its own bits.
"""

from __future__ import annotations

import hmac
import struct

from dips.wire.keys import issue
from dips.wire.pki import Identity

SECRET = b"s" * 32
MEMBER = issue(SECRET, Identity.cluster("a"), False)
KEY = MEMBER.key


def split(data: bytes) -> tuple[int, list[bytes]]:
    """``(flags, frames)`` of a fuzz input (see the module docstring)."""
    if not data:
        return 0, []
    flags, frames, pos = data[0], [], 1
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 2], "little")
        frames.append(data[pos + 2:pos + 2 + n])
        pos += 2 + n
    return flags, frames


def join(flags: int, frames: list[bytes]) -> bytes:
    """The fuzz input of ``(flags, frames)`` (frames of at most 65535 bytes)."""
    return bytes([flags]) + b"".join(struct.pack("<H", len(f)) + bytes(f) for f in frames)


def mac(key: bytes, *parts: bytes) -> bytes:
    m = hmac.new(key, digestmod="sha256")
    for p in parts:
        m.update(p)
    return m.digest()


def write_seeds(corpus: str, inputs: list[bytes]) -> None:
    """Write ``inputs`` as files of the corpus directory ``corpus`` (created if missing)."""
    import hashlib
    import os

    os.makedirs(corpus, exist_ok=True)
    for data in inputs:
        with open(os.path.join(corpus, "seed-" + hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)
