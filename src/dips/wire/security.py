"""Who a process is on the control plane, and who called it (mutual TLS, or ``--insecure``).

Secure by default: every role holds a :class:`~dips.wire.pki.TlsBundle` made by ``dips init``
(the run CA, its certificate, its key). Its gRPC servers require a client certificate from
the same CA (``grpc.ssl_server_credentials(..., require_client_auth=True)``), and its clients
verify the server's certificate against the CA and against the identity they expect
(``grpc.ssl_target_name_override``: "leader", "follower-0"; no host names in certificates,
so a certificate works at any address). A server learns who called from the peer
certificate (``context.auth_context()``), never from the request body: :func:`caller`.

``--insecure`` (:meth:`Credentials.insecure`): plaintext gRPC; the caller's identity is
whatever it claims in the ``x-dips-identity`` metadata. For a trusted network only; the
commands print a warning (as Flower's ``--insecure`` does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc

from dips.algo.refusal import Refusal, Refused
from dips.wire.pki import Identity, TlsBundle

log = logging.getLogger(__name__)

IDENTITY_KEY = "x-dips-identity"
INSECURE_WARNING = ("running WITHOUT TLS (--insecure): anyone who can reach these ports can "
                    "read the model and act as any member. Use only on a trusted network.")


@dataclass(frozen=True)
class Credentials:
    """This process's identity and how it proves it.

    Attributes:
        identity: who this process is (leader, follower-i, cluster-ID, admin).
        bundle: its TLS bundle (PEM CA, certificate, key); None: insecure.

    Raises:
        ValueError: the identity differs from the certificate's.
    """

    identity: Identity
    bundle: TlsBundle | None = None

    def __post_init__(self) -> None:
        if self.bundle is not None and self.bundle.identity != self.identity:
            raise ValueError(f"identity {self.identity.name!r} does not match the certificate's "
                             f"{self.bundle.identity.name!r}")

    @classmethod
    def tls(cls, directory: Path | str) -> "Credentials":
        """Load the bundle in ``directory`` (``ca.crt``, ``tls.crt``, ``tls.key``; the identity
        is the certificate's). Raises :class:`dips.wire.pki.PkiError` naming the problem."""
        bundle = TlsBundle.load(Path(directory))
        return cls(bundle.identity, bundle)

    @classmethod
    def insecure(cls, identity: Identity) -> "Credentials":
        """Plaintext, claimed identity (see the module docstring)."""
        return cls(identity, None)

    @property
    def secure(self) -> bool:
        return self.bundle is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials requiring a client certificate from the run CA."""
        if self.bundle is None:
            raise ValueError("insecure credentials have no TLS server credentials")
        return grpc.ssl_server_credentials([(self.bundle.key, self.bundle.cert)],
                                           root_certificates=self.bundle.ca,
                                           require_client_auth=True)

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Bind ``server`` to ``address`` (``host:port`` or ``unix:PATH``) with these
        credentials; returns the port, 0 if it cannot bind (in use, not an address of this
        host), whether gRPC says so by returning 0 or by raising."""
        try:
            if self.bundle is None:
                return server.add_insecure_port(address)
            return server.add_secure_port(address, self.server_credentials())
        except RuntimeError:
            return 0

    def channel(self, target: str, peer: Identity, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        """A channel to ``target`` whose server must prove it is ``peer`` (TLS), on a connection
        of its own (servers limit calls per connection: :mod:`dips.wire.control`)."""
        options = [*options, ("grpc.use_local_subchannel_pool", 1)]
        if self.bundle is None:
            return grpc.insecure_channel(target, options=list(options))
        creds = grpc.ssl_channel_credentials(root_certificates=self.bundle.ca,
                                             private_key=self.bundle.key,
                                             certificate_chain=self.bundle.cert)
        return grpc.secure_channel(target, creds, options=[
            *options, ("grpc.ssl_target_name_override", peer.name)])

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the claimed identity when insecure (TLS proves it instead)."""
        return () if self.bundle is not None else ((IDENTITY_KEY, self.identity.name),)


def caller(context: grpc.ServicerContext) -> Identity:
    """The identity of the peer of a call: its certificate's (TLS), else the one it claims
    (an ``--insecure`` server; a TLS server never accepts a call without a certificate).

    Raises Refused(FORBIDDEN) when there is neither, or the name is not a dips identity.
    """
    auth = context.auth_context() or {}
    names = auth.get("x509_common_name")
    if names:
        raw = names[0]
    else:
        claimed = dict(context.invocation_metadata() or ()).get(IDENTITY_KEY)
        if claimed is None:
            raise Refused(Refusal.FORBIDDEN, "the call carries no certificate and no identity")
        raw = claimed.encode() if isinstance(claimed, str) else claimed
    try:
        return Identity.parse(raw.decode("utf-8", "replace"))
    except ValueError as exc:
        raise Refused(Refusal.FORBIDDEN, f"caller: {exc}") from None


def require(who: Identity, role: str, what: str) -> None:
    """Raise Refused(FORBIDDEN) unless ``who`` has ``role`` (``what``: the call, for the
    message)."""
    if who.role != role:
        raise Refused(Refusal.FORBIDDEN, f"{what}: only a {role} may call it, not {who.name!r}")


@dataclass(frozen=True)
class ServerCertificate:
    """What a TLS handshake of our own tells of a server (:func:`server_certificate`).

    Attributes:
        signed: True (the run CA signed its certificate chain), False (the handshake failed
            verifying it: a server of another run's PKI), None (cannot be told: no
            connection, not TLS, another handshake failure).
        identity: the dips identity its certificate names (only when ``signed``; None when
            the certificate names none).
    """

    signed: bool | None
    identity: Identity | None = None


def server_certificate(host: str, port: int, ca_pem: bytes,
                       timeout_s: float = 5.0) -> ServerCertificate:
    """Whose certificate the TLS server at ``host:port`` shows, checked against the CA
    ``ca_pem`` (PEM bytes): :class:`ServerCertificate`. Sends no client certificate and
    nothing after the handshake; for diagnosing a refused call by a typed outcome, never by an
    error's text (``ssl``; the server's name is not checked, dips checks identities, not host
    names). Waits at most ``timeout_s`` seconds; never raises."""
    import socket
    import ssl

    from dips.wire.pki import PkiError, identity_of_pem

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cadata=ca_pem.decode())
    except (ssl.SSLError, ValueError):
        return ServerCertificate(None)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with ctx.wrap_socket(raw, server_hostname=None, do_handshake_on_connect=False) as tls:
                tls.settimeout(timeout_s)
                tls.do_handshake()
                der = tls.getpeercert(binary_form=True)
    except ssl.SSLCertVerificationError:
        return ServerCertificate(False)
    except (OSError, ValueError):  # ssl.SSLError is an OSError: not a verdict on the chain
        return ServerCertificate(None)
    try:
        return ServerCertificate(True, identity_of_pem(ssl.DER_cert_to_PEM_cert(der).encode()))
    except (PkiError, ValueError, TypeError):
        return ServerCertificate(True)
