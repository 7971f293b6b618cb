"""Admission tickets: a follower stages a push only for a (round, cluster) the leader admitted.

When the leader admits a push into a grace window (``RequestPush``, §7), it signs a ticket
naming the round, the cluster, the push id (a fresh random nonce per grant), the cluster's
T_j as the leader counts it (the data ledger's, §6) and the version the pseudo-gradient
started from. The cluster copies the ticket into the header of every push message (fields
``ticket`` and ``ticket_mac``); a follower verifies it before it allocates anything for the
push, so an authenticated member cannot open buffers for rounds or clusters the leader never
opened, and cannot name tokens of its own (issue 13: hostile peers).

The MAC is HMAC-SHA256 under the *admission key*, derived from the run's data secret (which
only the leader and the registered followers hold, :mod:`dips.wire.keys`); a cluster never
holds it, so it cannot mint or alter a ticket. Stateless: no extra call from leader to
followers on the admission path. Replay is refused by the follower (a ticket's round is
closed once decided or discarded; a push id is used for one transfer per layer).
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from dips.algo.refusal import Refusal, Refused
from dips.wire.pki import CLUSTER_ID

#: Longest ticket JSON accepted (bytes); a real one is about 120.
MAX_TICKET_BYTES = 512
INT64_MAX = 2**63 - 1
#: A push id: 16 hex digits, fresh per grant (``secrets.token_hex(8)``), the ticket's nonce.
PUSH_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Ticket:
    """What the leader admitted.

    Attributes:
        round: the round the push joins (0: sent ahead of any round, joined at scoring).
        cluster: the cluster id.
        push_id: 16 hex digits, fresh per grant (the nonce).
        tokens: T_j as the leader counts it (tokens, > 0).
        base_version: the version the cluster's pseudo-gradient started from (>= 0).
    """

    round: int
    cluster: str
    push_id: str
    tokens: int
    base_version: int

    def encode(self) -> str:
        """Canonical JSON (sorted keys, no spaces)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def admission_key(data_secret: bytes) -> bytes:
    """The followers' admission key (32 bytes) under the run's data secret. Raises ValueError
    for a secret shorter than 16 bytes."""
    if len(data_secret) < 16:
        raise ValueError(f"data secret is {len(data_secret)} bytes, need >= 16")
    return hmac.digest(data_secret, b"dips/admission", "sha256")


def sign(key: bytes, ticket: Ticket) -> tuple[str, bytes]:
    """``(ticket JSON, 32-byte MAC)`` for the grant (leader side). Raises ValueError if a field
    is out of range (see :func:`check`)."""
    check(ticket)
    body = ticket.encode()
    return body, hmac.digest(key, b"dips/ticket" + body.encode(), "sha256")


def _int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= INT64_MAX:
        raise Refused(Refusal.INVALID_ARGUMENT, f"ticket field {name!r} = {str(v)[:40]!r} is "
                                                f"not an int in [{lo}, 2**63 - 1]")
    return v


def check(t: Ticket) -> Ticket:
    """``t`` if every field is in range. Raises Refused(INVALID_ARGUMENT) naming the field."""
    _int("round", t.round, 0)
    _int("tokens", t.tokens, 1)
    _int("base_version", t.base_version, 0)
    if not isinstance(t.push_id, str) or not PUSH_ID.fullmatch(t.push_id):
        raise Refused(Refusal.INVALID_ARGUMENT, f"ticket field 'push_id' = {str(t.push_id)[:40]!r} "
                                                f"is not 16 hex digits")
    if not isinstance(t.cluster, str) or not CLUSTER_ID.fullmatch(t.cluster):
        raise Refused(Refusal.INVALID_ARGUMENT, f"ticket field 'cluster' = {str(t.cluster)[:80]!r} "
                                                f"is not a cluster id")
    return t


def granted_tokens(body: Any) -> int | None:
    """T_j as the leader counts it (tokens, the data ledger's, §6), read from a grant's ticket
    JSON on the cluster's side, which holds no admission key and so checks no MAC (the grant
    came from the leader over the control channel): None when ``body`` is empty, malformed
    or its ``tokens`` is not an int in [1, 2**63 - 1]. What the cluster logs and records for
    the push, not the count it claimed (review F9)."""
    if not isinstance(body, str) or not body or len(body) > MAX_TICKET_BYTES:
        return None
    try:
        tokens = json.loads(body).get("tokens")
    except (ValueError, AttributeError):
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= INT64_MAX:
        return None
    return tokens


def verify(key: bytes, body: Any, mac: Any) -> Ticket:
    """The ticket in a push header (follower side), checked before anything is allocated.

    Args:
        key: :func:`admission_key` of the run's data secret.
        body: the header's ``ticket`` (str, at most :data:`MAX_TICKET_BYTES`).
        mac: the header's ``ticket_mac`` (64 hex digits).

    Raises:
        Refused: FORBIDDEN (missing, altered or forged: the MAC does not match),
            INVALID_ARGUMENT (malformed, a field out of range).
    """
    if not isinstance(body, str) or not isinstance(mac, str):
        raise Refused(Refusal.FORBIDDEN, "push carries no admission ticket (fields 'ticket', "
                                         "'ticket_mac'): the leader did not admit it")
    if len(body) > MAX_TICKET_BYTES or len(mac) != 64:
        raise Refused(Refusal.INVALID_ARGUMENT, f"admission ticket of {len(body)} characters or "
                                                f"MAC of {len(mac)} is malformed")
    try:
        given = bytes.fromhex(mac)
    except ValueError:
        raise Refused(Refusal.INVALID_ARGUMENT, "field 'ticket_mac' is not hex") from None
    if not hmac.compare_digest(hmac.digest(key, b"dips/ticket" + body.encode(), "sha256"), given):
        raise Refused(Refusal.FORBIDDEN, "admission ticket MAC does not match: not issued by "
                                         "the leader, or altered")
    try:
        d = json.loads(body)
        t = Ticket(d["round"], d["cluster"], d["push_id"], d["tokens"], d["base_version"])
    except (ValueError, KeyError, TypeError):
        raise Refused(Refusal.INVALID_ARGUMENT, f"admission ticket {body[:80]!r} is malformed") from None
    return check(t)
