"""Typed refusals: why a role turned a request down, as a code that control flow can test.

Every refusal a role raises is a :class:`Refused` carrying a :class:`Refusal` code and a
message for people. Control flow decides on the code, never on the message's text. The codes
mirror the ``dips.v1.Refusal`` enum of ``proto/dips/v1/control.proto`` (same names, same
numbers; a test keeps them equal): the control plane carries the number in the
``dips-refusal`` trailing metadata of a failed call, the data plane in the ``code`` field of
an error header (as hivemind and Flower carry typed error codes).
"""

from __future__ import annotations

import enum


class Refusal(enum.IntEnum):
    """Why a request was refused (the proto's ``dips.v1.Refusal``)."""

    UNSPECIFIED = 0
    #: The cluster is not a member (never joined, removed after missed heartbeats, or the
    #: leader restarted without it): re-join.
    NOT_JOINED = 1
    #: The cluster already has a push queued or in the current round.
    PUSH_IN_FLIGHT = 2
    #: Followers are missing, down or being reconciled: retry later.
    NOT_READY = 3
    #: The push id is not part of the current round and has no recorded verdict.
    UNKNOWN_PUSH = 4
    #: A follower no longer serves the requested version (a newer one was committed and the
    #: old snapshot recycled): re-join or pull the newer version.
    VERSION_GONE = 5
    #: The push was not admitted into a grace window before the caller's deadline.
    NOT_ADMITTED = 6
    #: The round was not decided before the caller's deadline; ask again by push id.
    UNDECIDED = 7
    #: A field of the request is malformed or out of range.
    INVALID_ARGUMENT = 8
    #: The run has no data-chunk ledger.
    NO_LEDGER = 9
    #: The request contradicts the data-chunk ledger (e.g. a position behind the accepted one).
    LEDGER_CONFLICT = 10
    #: A push with no window trained since the cluster's last accepted push (T_j would be 0).
    NOTHING_TRAINED = 11
    #: The caller's certificate does not allow this call, or names another member than the
    #: request does (a cluster acting as another, a cluster calling a follower's control).
    FORBIDDEN = 12
    #: A leader of a higher term leads this follower: the caller must step down.
    STALE_TERM = 13
    #: Another leader's lease on this follower has not expired yet: wait and try again.
    LEASE_HELD = 14
    #: The cluster's model does not match the run's fingerprint (architecture, tokenizer,
    #: parameter names, shapes or dtypes).
    MODEL_MISMATCH = 15
    #: The run reached its token budget, outer-step or time limit: nothing more is admitted
    #: (the cluster stops; :mod:`dips.algo.limits`).
    RUN_FINISHED = 16
    #: A push grant that can no longer be used: its round is closed (decided or discarded),
    #: its push id was already used for other bytes, or its base version is ahead of the
    #: follower's (a replay, or a grant from a leader the follower has not caught up with).
    STALE_GRANT = 17
    #: The member is over its limit of concurrent calls or in-flight pushes: retry later.
    BUSY = 18
    #: The server called is not the leader (a follower's control port given as the leader's
    #: address): no retry helps; the message names what was reached.
    NOT_LEADER = 19


class Refused(Exception):
    """A request refused for a reason named by ``code`` (:class:`Refusal`).

    Args:
        code: the refusal code.
        message: what happened, naming the field and value (for people and logs only).
    """

    def __init__(self, code: Refusal, message: str) -> None:
        super().__init__(message)
        self.code = Refusal(code)
        self.message = message

    def __reduce__(self) -> tuple:
        return (type(self), (self.code, self.message))
