"""Telling a caller that the address it was given is not the leader's (review 15, #6).

A member (``dips cluster``, ``dips follower``, ``dips evaluate``, ``dips export``) or ``dips
status`` pointed at another port of the run — a follower's control port, say — used to see
gRPC's ``UNIMPLEMENTED: Method not found!`` (plaintext) or a bare ``UNAVAILABLE`` (TLS, whose
handshake fails: the server is not the leader the client asked for), and kept retrying. Two
typed outcomes say what was reached instead, never an error's text:

* a server that is not the leader answers every call of the Leader service with the refusal
  ``NOT_LEADER``, naming itself (:class:`NotLeaderServicer`: a follower's control server
  carries it);
* under TLS the call fails before any server code runs, so :func:`wrong_leader` does a TLS
  handshake of its own (:func:`dips.wire.security.server_certificate`) and reads whose
  certificate the server shows: another identity of the run (``follower-0``), or one no CA
  of this bundle signed (another run's ``pki/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from dips.algo.refusal import Refusal, Refused
from dips.wire.control import grpc_errors, refusal_of
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials, server_certificate

__all__ = ["NotLeaderServicer", "WrongPeer", "wrong_leader"]


class NotLeaderServicer(pbg.LeaderServicer):
    """The Leader service of a server that is not the leader: every call is refused
    ``NOT_LEADER`` (FAILED_PRECONDITION) with ``what`` in the details.

    Args:
        what: what this server is, for the caller, e.g. ``"follower 0's control service
            (its leader: 10.0.0.5:7000)"``.
    """

    def __init__(self, what: str) -> None:
        self.what = what


def _refuser(method: str) -> Any:
    def refuse(self: NotLeaderServicer, request: Any, context: grpc.ServicerContext) -> Any:
        raise Refused(Refusal.NOT_LEADER,
                      f"this is {self.what}, not the leader ({method} refused)")
    refuse.__name__ = method
    return grpc_errors(refuse)


for _method in pb.DESCRIPTOR.services_by_name["Leader"].methods_by_name:
    setattr(NotLeaderServicer, _method, _refuser(_method))


@dataclass(frozen=True)
class WrongPeer:
    """Why the server at an address is provably not the run's leader.

    Attributes:
        foreign_ca: its certificate is not signed by the CA of the caller's bundle (another
            run's PKI: the caller's credentials are wrong, not only the address).
        message: what was reached, for people (names the address and the identity).
    """

    foreign_ca: bool
    message: str


def wrong_leader(target: str, creds: Credentials, exc: grpc.RpcError,
                 timeout_s: float = 5.0) -> WrongPeer | None:
    """For a call to the leader at ``target`` (``HOST:PORT`` or ``unix:PATH``) that failed
    with ``exc``: a :class:`WrongPeer` when the failure shows the server is not this run's
    leader (the refusal NOT_LEADER; under TLS, UNAVAILABLE and a certificate of another
    identity or another CA, read by a handshake of our own waiting at most ``timeout_s``
    seconds), else None (the leader may just be down or restarting). Never raises."""
    if refusal_of(exc) is Refusal.NOT_LEADER:
        return WrongPeer(False, f"{target}: {exc.details()}")
    if (creds.bundle is None or target.startswith("unix:")
            or exc.code() != grpc.StatusCode.UNAVAILABLE):
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    cert = server_certificate(host.strip("[]"), int(port), creds.bundle.ca, timeout_s)
    if cert.signed is False:
        return WrongPeer(True, f"leader {target}: its certificate is not signed by the CA of "
                               "this --tls bundle (another run's pki/?)")
    if cert.signed and cert.identity is not None and cert.identity != Identity.leader():
        return WrongPeer(False, f"{target} holds the certificate of {cert.identity.name!r}, "
                                "not the leader's")
    return None
