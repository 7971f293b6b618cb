"""Per-member data-plane keys: never shared between members, never sent in clear under TLS.

The leader holds a random 32-byte *data secret* (kept 0600 in its state directory) and hands
it to followers only, in the reply to their registration over mutual TLS. When a cluster (or
an observer, such as the launcher's final pull) joins, the leader issues it a fresh key id
``"<identity>/<16 random hex bytes>"`` and its key ``HMAC-SHA256(data secret, "dips/member/"
+ key id)`` over the same TLS channel. A follower derives the key from the key id, which
travels in clear with each request, so it needs no list of members to serve one that joined a
moment ago; the identity in the key id is the one the leader issued it to, so a follower knows
who sent a push (a cluster cannot push as another) or a pull. Without TLS (``--insecure``)
these keys travel in clear: integrity against accidents only.

A key is believed only while its member is: each key id carries the leader's issue sequence
number, and every registration reply gives the followers the current members' key ids and
the next sequence number. A follower serves a key id that is current, or issued after the
last list it got (a member that joined a moment ago); the key of a member removed, departed,
revoked or re-joined (a new key) is refused with NOT_JOINED, and its holder must join again.

What a key id costs a follower (review 21, F1: a stranger's messages under a key id nobody was
issued were verified, logged and answered): :meth:`Keyring.lookup` is a dictionary look-up of
the current members' keys (derived once per list), of the keys retired by the last lists (the
newest :data:`RETIRED_KEYS`, so a departed member is still told NOT_JOINED) and, derived and
cached, of ids issued after the last list within :data:`FRESH_KEYS` sequence numbers (a
member that joined a moment ago). Any other id is refused by the data server before it reads
the message: no MAC, no reply, a count.
"""

from __future__ import annotations

import hmac
import os
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

from dips.wire.frames import FrameError
from dips.wire.pki import Identity

SECRET_BYTES = 32
#: Sequence numbers after a follower's last list of members whose key ids it serves
#: (members that joined since: at most this many joins between two registrations).
FRESH_KEYS = 256
#: Key ids of former members a follower remembers (answered NOT_JOINED, not dropped).
RETIRED_KEYS = 1024
#: Longest key id (characters).
MAX_KEY_ID_CHARS = 200


@dataclass(frozen=True)
class MemberKey:
    """One member's data-plane key.

    Attributes:
        key_id: ``"<identity name>/<32 hex>"``, sent in clear with each request.
        key: 32 bytes.
        encrypt: tensor bytes are encrypted (AES-GCM) as well as authenticated.
    """

    key_id: str
    key: bytes
    encrypt: bool = False

    @property
    def identity(self) -> Identity:
        return identity_of(self.key_id)


def new_secret() -> bytes:
    """A fresh data secret (32 random bytes)."""
    return os.urandom(SECRET_BYTES)


def derive(secret: bytes, key_id: str) -> bytes:
    """The key of ``key_id`` under the data ``secret`` (32 bytes). Raises ValueError for a
    secret shorter than 16 bytes."""
    if len(secret) < 16:
        raise ValueError(f"data secret is {len(secret)} bytes, need >= 16")
    return hmac.digest(secret, b"dips/member/" + key_id.encode(), "sha256")


def issue(secret: bytes, identity: Identity, encrypt: bool, seq: int = 0) -> MemberKey:
    """A new key for ``identity``, the leader's ``seq``-th (a fresh id at every join, so a
    re-joined member's old key names an old id)."""
    if not 0 <= seq < 2**64:
        raise ValueError(f"key sequence number {seq} is not in [0, 2**64)")
    key_id = f"{identity.name}/{seq:016x}{os.urandom(8).hex()}"
    return MemberKey(key_id, derive(secret, key_id), encrypt)


def seq_of(key_id: str) -> int:
    """The issue sequence number in a key id (see :func:`issue`). Raises FrameError."""
    identity_of(key_id)
    return int(key_id.rpartition("/")[2][:16], 16)


def identity_of(key_id: str) -> Identity:
    """The identity a key id was issued to. Raises FrameError naming the value."""
    name, sep, nonce = key_id.partition("/")
    if not sep or len(nonce) != 32 or any(c not in "0123456789abcdef" for c in nonce):
        raise FrameError(f"key id {key_id[:80]!r} is not '<identity>/<32 hex digits>'")
    try:
        return Identity.parse(name)
    except ValueError as exc:
        raise FrameError(f"key id {key_id[:80]!r}: {exc}") from None


class Keyring:
    """A follower's view of the members' keys (see the module docstring). Thread-safe for
    one writer (the registration loop) and any number of readers: each update swaps whole
    dictionaries.

    Args:
        secret: the data secret from the leader (None until the follower registered: every
            request is refused until then).
        encrypt: whether members encrypt (from the run spec).
    """

    def __init__(self, secret: bytes | None = None, encrypt: bool = False) -> None:
        self.encrypt = encrypt
        self._secret = secret
        self._lookup = lru_cache(maxsize=FRESH_KEYS)(self._derive)
        self._members: dict[str, MemberKey] | None = None  # None: every key (no list yet)
        self._retired: OrderedDict[str, MemberKey] = OrderedDict()
        self._next_seq = 0

    def set_members(self, key_ids: list[str], next_seq: int) -> None:
        """The leader's current members' key ids, and its next issue sequence number."""
        old = self._members or {}
        members = self._derived(key_ids, old)
        retired = OrderedDict(self._retired)
        for kid, mk in old.items():
            if kid not in members:
                retired[kid] = mk
                retired.move_to_end(kid)
        for kid in members:
            retired.pop(kid, None)
        while len(retired) > RETIRED_KEYS:
            retired.popitem(last=False)
        self._retired, self._members, self._next_seq = retired, members, next_seq

    def _derived(self, key_ids: list[str], known: dict[str, MemberKey]) -> dict[str, MemberKey]:
        """The keys of ``key_ids``, those in ``known`` reused; a malformed id (or any, with no
        secret yet) is left out: never served."""
        out = {}
        for kid in key_ids:
            try:
                out[kid] = known.get(kid) or self._derive(kid)
            except FrameError:
                continue
        return out

    def current(self, key_id: str) -> bool:
        """Whether ``key_id`` belongs to a current member (see the module docstring)."""
        members = self._members
        if members is None or key_id in members:
            return True
        return self._fresh(key_id)

    def _fresh(self, key_id: str) -> bool:
        """Whether ``key_id`` was issued after the last list, within :data:`FRESH_KEYS`."""
        try:
            return 0 <= seq_of(key_id) - self._next_seq < FRESH_KEYS
        except FrameError:
            return False

    def set_secret(self, secret: bytes, encrypt: bool | None = None) -> None:
        """Take the leader's data secret (a restarted leader keeps the same one) and whether
        members encrypt (None: unchanged)."""
        if secret != self._secret or (encrypt is not None and encrypt != self.encrypt):
            self._secret = secret
            self.encrypt = self.encrypt if encrypt is None else encrypt
            self._lookup.cache_clear()
            if self._members is not None:  # re-derived under the new secret
                self._members = self._derived(list(self._members), {})
                self._retired = OrderedDict()

    def _derive(self, key_id: str) -> MemberKey:
        identity_of(key_id)
        if self._secret is None:
            raise FrameError("this follower has no data secret yet (not registered)")
        return MemberKey(key_id, derive(self._secret, key_id), self.encrypt)

    def lookup(self, key_id: bytes | memoryview) -> tuple[MemberKey | None, str]:
        """``(key, "")`` for the key id frame of a request, or ``(None, reason)``: ``key_id``
        (not an ASCII key id), ``no_secret`` or ``unknown_key`` (no current, retired or fresh
        member's). Costs a dictionary look-up, or one key derivation (cached) for a fresh id;
        never raises."""
        raw = bytes(key_id[:MAX_KEY_ID_CHARS + 1])
        if self._secret is None:
            return None, "no_secret"
        try:
            kid = raw.decode("ascii")
        except UnicodeDecodeError:
            return None, "key_id"
        if len(kid) > MAX_KEY_ID_CHARS:
            return None, "key_id"
        members = self._members
        if members is not None:
            mk = members.get(kid) or self._retired.get(kid)
            if mk is not None:
                return mk, ""
            if not self._fresh(kid):
                try:
                    identity_of(kid)
                except FrameError:
                    return None, "key_id"
                return None, "unknown_key"
        try:
            return self._lookup(kid), ""
        except FrameError:
            return None, "key_id"

    def get(self, key_id: bytes | str) -> MemberKey:
        """The member key of ``key_id``, derived whoever it names (for trusted callers: the
        data server serves only what :meth:`lookup` finds). Raises FrameError (malformed id,
        no secret yet)."""
        if isinstance(key_id, (bytes, bytearray, memoryview)):
            try:
                key_id = bytes(key_id).decode("ascii")
            except UnicodeDecodeError:
                raise FrameError("key id is not ASCII") from None
        if len(key_id) > MAX_KEY_ID_CHARS:
            raise FrameError(f"key id of {len(key_id)} characters exceeds {MAX_KEY_ID_CHARS}")
        return self._lookup(key_id)
