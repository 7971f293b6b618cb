"""Single-message requests of a data server (:mod:`dips.wire.dataplane`), answered on its
consumer thread: a push of one layer, or a pull whose whole reply is one message.

A single-message pull is admitted by its member's pull budget
(:class:`~dips.wire.serving.PullLedger`, BUSY beyond) and its reply counted against it until
libzmq wrote it. Its reply is built whole on the consumer thread, so it is capped
(:data:`~dips.wire.serving.SINGLE_REPLY_BYTES`, the member's pull budget; review 21: a
148-byte request for a 38 MB shard held 28 MB and 0.6 s of the consumer): a role refuses a
larger one before building it (a follower: INVALID_ARGUMENT naming ``layers``, to be pulled as
a stream), and a reply over the cap that a role built all the same is refused here.
"""

from __future__ import annotations

from collections import deque

import zmq

from dips.algo.refusal import Refusal, Refused
from dips.wire.dataclient import MSG
from dips.wire.frames import decode, encode
from dips.wire.keys import MemberKey
from dips.wire.refusals import Incidents
from dips.wire.serving import (
    REFUSED,
    SINGLE_REPLY_BYTES,
    Authorize,
    Handler,
    PullLedger,
    PushConnections,
    error_reply,
)


class SingleMessages:
    """Answers single messages (used by the consumer thread only).

    Args:
        handler: ``Message -> (reply header, tensors)`` (see :class:`DataServer`).
        authorize, check_member, incident: as for :class:`~dips.wire.pushstreams.PushStreams`.
        pulls: the members' pull budgets (shared with pull streams).
        push_conns: where an accepted push's connection is noted.
        reply_bytes: the largest single-message reply (bytes).
    """

    def __init__(self, handler: Handler, authorize: Authorize, check_member, incident: Incidents,
                 pulls: PullLedger, push_conns: PushConnections,
                 reply_bytes: int = SINGLE_REPLY_BYTES) -> None:
        self._handler, self._authorize, self._check_member = handler, authorize, check_member
        self._incident, self._pulls, self._push_conns = incident, pulls, push_conns
        self.reply_bytes = reply_bytes

    def answer(self, out: zmq.Socket, ident: bytes, mk: MemberKey, frames: list) -> None:
        """Answer ``frames`` (``[key id, header, mac, payloads...]``) from ``ident`` under
        ``mk``: the handler's reply, or a typed refusal (counted, never one log line each)."""
        pull = False
        try:
            msg = decode(mk.key, frames[1:], require_encrypted=mk.encrypt)
            self._check_member(mk)
            self._authorize(mk.identity, msg.header)
            if msg.header.get("op") == "pull":
                self._pulls.admit(mk.identity.name, stream=False)
                pull = True
            header, tensors = self._handler(msg)
            if pull:
                size = sum(t.numel() * t.element_size() for _, t in tensors)
                if size > self.reply_bytes:
                    raise Refused(Refusal.INVALID_ARGUMENT, f"a single-message pull of {size} "
                                  f"bytes exceeds {self.reply_bytes}: pull it as a stream")
            if msg.header.get("op") == "push":
                self._push_conns.note(ident, msg.header)
            reply = [ident, MSG, *encode(mk.key, header, tensors, encrypt=mk.encrypt)]
        except REFUSED as exc:
            if pull:  # admitted, then refused: nothing of it is held
                self._pulls.finish(mk.identity.name, deque(), stream=False)
            pull = False
            self._incident.refusals.refused(exc)
            reply = error_reply(mk.key, ident, exc)
        except Exception as exc:  # keep serving other peers; report the failure
            pull = False
            self._incident("request", exc)
            reply = error_reply(mk.key, ident, exc)
        if not pull:
            out.send_multipart(reply, copy=False)
            return
        nbytes = sum(memoryview(f).nbytes for f in reply[1:])
        last = zmq.Frame(reply[-1], track=True, copy=False)
        tracker = out.send_multipart([*reply[:-1], last], copy=False, track=True)
        del last, reply  # libzmq's reference alone keeps the reply: released once written
        self._pulls.handed(mk.identity.name, nbytes)
        self._pulls.finish(mk.identity.name, deque([(tracker, nbytes)]), stream=False)


__all__ = ["SingleMessages"]
