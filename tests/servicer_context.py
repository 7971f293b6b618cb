"""A gRPC servicer context for calling a servicer method directly (insecure mode): who calls,
how long the call may wait, and what ``abort`` would end it with."""

from __future__ import annotations

import grpc

from dips.algo.refusal import Refusal
from dips.wire.control import REFUSAL_KEY
from dips.wire.security import IDENTITY_KEY
from dips.wire.services import TERM_KEY


class Aborted(Exception):
    """What the context raises where gRPC would end the call: its status code, details and
    the Refusal its trailing metadata carries (None: none; a value that is no Refusal raises
    ValueError, failing the test)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple) -> None:
        super().__init__(f"{code.name}: {details[:200]}")
        self.code, self.details = code, details
        self.refusal = next((Refusal(int(v)) for k, v in trailing if k == REFUSAL_KEY), None)


class FakeContext:
    """The caller ``identity`` (and a leader ``term`` for a follower's control calls); waits
    in the servicer end within ``time_left_s`` seconds."""

    def __init__(self, identity: str, term: str | None = None, time_left_s: float = 5.0) -> None:
        self._meta = ((IDENTITY_KEY, identity),) + (((TERM_KEY, term),) if term else ())
        self._left = time_left_s
        self._trailing: tuple = ()

    def auth_context(self):
        return {}

    def invocation_metadata(self):
        return self._meta

    def time_remaining(self):
        return self._left

    def is_active(self):
        return True

    def set_trailing_metadata(self, md):
        self._trailing = tuple(md)

    def abort(self, code, details):
        raise Aborted(code, details, self._trailing)
