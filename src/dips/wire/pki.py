"""The run PKI: one private CA per run and a certificate per role, for mutual TLS.

``dips init`` (:mod:`dips.pki_cli`) calls :func:`init_pki`, which writes::

    OUT/ca.crt, OUT/ca.key          the run CA (ca.key stays offline with the operator)
    OUT/leader/                     ca.crt, tls.crt, tls.key   -> the leader host
    OUT/follower-<i>/               ...                        -> follower host i
    OUT/cluster-<id>/               ...                        -> that cluster's site
    OUT/admin/                      ...                        -> the operator

Every certificate names its :class:`Identity` in the subject CN and in one DNS SAN, so a
client verifies a server with gRPC's ``grpc.ssl_target_name_override`` set to the role's name
(no real host names needed), and a server reads its peer's role from ``x509_common_name``.
Keys are EC P-256; private key files are created 0600 with ``O_EXCL`` (never overwritten).
Revocation is by cluster id: :func:`revoke` appends to ``OUT/revoked.txt`` and to
``OUT/leader/revoked.txt``, which the leader reads with :func:`read_revoked`. Every cluster
certificate issued (by :func:`init_pki` or :func:`add_cluster`) is listed the same way in
``OUT/clusters.txt`` and ``OUT/leader/clusters.txt``: the leader counts the run's clusters from
it (issue 13: a scale a minority cannot set needs to know how many members there are).
"""

from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("leader", "follower", "cluster", "admin")
# An X.509 CN holds at most 64 characters (RFC 5280 ub-common-name; cryptography refuses
# more), so a cluster id is at most 64 - len("cluster-") = 56 characters.
CLUSTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,55}")
_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")
_SKEW = dt.timedelta(minutes=5)  # not-before in the past: hosts' clocks disagree a little
_NAMES = "leader, admin, follower-<index>, cluster-<id>"
# role -> (the id's pattern, what a bad id is told)
_ID_RULES = {"leader": (re.compile(""), "takes no id"), "admin": (re.compile(""), "takes no id"),
             "follower": (_INDEX, "index must be a decimal int >= 0 without leading zeros"),
             "cluster": (CLUSTER_ID, "id must match " + CLUSTER_ID.pattern)}
_EXT = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
        "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")


class PkiError(ValueError):
    """A PKI file or request that cannot be used; the message names the file or value."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate belongs to: ``role`` in :data:`ROLES` and ``id`` ("" for leader and
    admin, the decimal index for a follower, the cluster id for a cluster).
    Raises ValueError for an unknown role or a malformed id."""

    role: str
    id: str = ""

    def __post_init__(self) -> None:
        if self.role not in _ID_RULES:
            raise ValueError(f"unknown role {self.role!r} (expected one of {', '.join(ROLES)})")
        pattern, rule = _ID_RULES[self.role]
        if not (isinstance(self.id, str) and pattern.fullmatch(self.id)):
            raise ValueError(f"{self.role} {rule}, not {self.id!r}")

    @property
    def name(self) -> str:
        """``leader``, ``admin``, ``follower-<index>`` or ``cluster-<id>``: the CN and SAN."""
        return self.role if self.id == "" else f"{self.role}-{self.id}"

    @property
    def index(self) -> int:
        """A follower's index; ValueError for any other role."""
        if self.role != "follower":
            raise ValueError(f"{self.name!r} is not a follower and has no index")
        return int(self.id)

    @classmethod
    def leader(cls) -> Identity:
        return cls("leader")

    @classmethod
    def admin(cls) -> Identity:
        return cls("admin")

    @classmethod
    def follower(cls, index: int) -> Identity:
        """Follower ``index`` (int >= 0); ValueError otherwise."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"follower index must be an int >= 0, not {index!r}")
        return cls("follower", str(index))

    @classmethod
    def cluster(cls, cluster_id: str) -> Identity:
        """Cluster ``cluster_id`` ([A-Za-z0-9][A-Za-z0-9._-]{0,55}); ValueError otherwise."""
        return cls("cluster", cluster_id)

    @classmethod
    def parse(cls, name: str) -> Identity:
        """The inverse of :attr:`name`; ValueError naming ``name`` for anything else."""
        role, sep, rest = str(name).partition("-")
        why = ""
        try:
            if not sep and role in ("leader", "admin"):
                return cls(role)
            if sep and role in ("follower", "cluster"):
                return cls(role, rest)
        except ValueError as exc:
            why = f": {exc}"
        raise ValueError(f"{name!r} is not a dips identity (expected {_NAMES}){why}")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PkiError(f"{path}: missing") from None
    except OSError as exc:
        raise PkiError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _cert(path: Path, data: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise PkiError(f"{path}: not a PEM certificate") from None


def _key(path: Path, data: bytes) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):  # TypeError: encrypted, needs a password
        raise PkiError(f"{path}: not an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{path}: not an EC private key")
    return key


def _write_secret(path: Path, data: bytes) -> None:
    """Create ``path`` 0600; never overwrite (O_EXCL), so a key cannot be silently replaced."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise PkiError(f"{path}: already exists; refusing to overwrite a private key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_public(path: Path, data: bytes) -> None:
    """Write a non-secret file 0644, atomically (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
             days: int, cap: dt.datetime | None = None) -> x509.CertificateBuilder:
    """Subject, issuer, key, random serial, validity now - skew .. now + days (<= cap)."""
    now = _now()
    until = now + dt.timedelta(days=days)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW).not_valid_after(min(until, cap or until))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False))


def _key_usage(*on: str) -> x509.KeyUsage:
    return x509.KeyUsage(**{name: name in on for name in _EXT})


def _check_int(what: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PkiError(f"{what} must be an int >= {least}, not {value!r}")


def _cluster(cluster_id: str) -> Identity:
    try:
        return Identity.cluster(cluster_id)
    except ValueError as exc:
        raise PkiError(str(exc)) from None


def identity_of_pem(cert_pem: bytes) -> Identity:
    """The :class:`Identity` in a PEM certificate's subject CN; PkiError if there is no single
    CN or it is not a dips identity name."""
    cns = _cert(Path("<certificate>"), cert_pem).subject.get_attributes_for_oid(
        NameOID.COMMON_NAME)
    if len(cns) != 1:
        raise PkiError(f"certificate has {len(cns)} subject CNs, expected 1")
    try:
        return Identity.parse(str(cns[0].value))
    except ValueError as exc:
        raise PkiError(f"certificate subject CN: {exc}") from None


@dataclass(frozen=True)
class TlsBundle:
    """One role's TLS material, PEM bytes: the run CA, its certificate and its private key."""

    ca: bytes
    cert: bytes
    key: bytes
    identity: Identity

    @classmethod
    def load(cls, directory: Path) -> TlsBundle:
        """Read ``ca.crt``, ``tls.crt``, ``tls.key`` from ``directory`` and check them.
        Raises PkiError naming the file: missing, not PEM, certificate not signed by that
        CA, key not matching the certificate, certificate (or CA) expired or not yet valid,
        or a CN that is not a dips identity."""
        directory = Path(directory)
        paths = [directory / n for n in ("ca.crt", "tls.crt", "tls.key")]
        ca_pem, cert_pem, key_pem = (_read(p) for p in paths)
        ca, cert = _cert(paths[0], ca_pem), _cert(paths[1], cert_pem)
        key = _key(paths[2], key_pem)
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            raise PkiError(f"{paths[1]}: not signed by the CA in {paths[0]}") from None
        der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(*der) != cert.public_key().public_bytes(*der):
            raise PkiError(f"{paths[2]}: key does not match the certificate {paths[1]}")
        now = _now()
        for path, c in ((paths[0], ca), (paths[1], cert)):
            if now > c.not_valid_after_utc:
                raise PkiError(f"{path}: expired on {c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
            if now < c.not_valid_before_utc:
                raise PkiError(f"{path}: not valid before "
                               f"{c.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
        try:
            identity = identity_of_pem(cert_pem)
        except PkiError as exc:
            raise PkiError(f"{paths[1]}: {exc}") from None
        return cls(ca=ca_pem, cert=cert_pem, key=key_pem, identity=identity)


def create_ca(out: Path, name: str, days: int) -> None:
    """Write ``out/ca.key`` (0600, refused with PkiError if it exists) and ``out/ca.crt``: a
    self-signed EC P-256 CA valid ``days`` days, CN "dips run CA <name>" (name cut to fit)."""
    _check_int("days", days, 1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    _write_secret(out / "ca.key", _pem_key(key))  # first: a second CA fails before any write
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dips run CA {name}"[:64])])
    cert = (_builder(subject, subject, key, days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage("key_cert_sign", "crl_sign"), critical=True)
            .sign(key, hashes.SHA256()))
    _write_public(out / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))


def issue(out: Path, identity: Identity, days: int) -> Path:
    """Issue ``identity`` a certificate from the CA in ``out`` (``ca.crt``, ``ca.key``): writes
    ``out/<identity.name>/`` with ``ca.crt``, ``tls.crt`` (valid ``days`` days, never past the
    CA) and ``tls.key`` (0600), and returns that directory. PkiError if the directory exists
    or the CA files are missing or unreadable."""
    _check_int("days", days, 1)
    out = Path(out)
    ca_pem = _read(out / "ca.crt")
    ca, ca_key = _cert(out / "ca.crt", ca_pem), _key(out / "ca.key", _read(out / "ca.key"))
    target = out / identity.name
    try:
        target.mkdir()  # atomic: two issuers of one identity cannot both proceed
    except FileExistsError:
        raise PkiError(f"{target}: already exists; {identity.name} was already issued") from None
    key = ec.generate_private_key(ec.SECP256R1())
    cn = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.name)])
    cert = (_builder(cn, ca.subject, key, days, cap=ca.not_valid_after_utc)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(identity.name)]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            # ECDHE: the certificate key only signs the handshake; no static key agreement.
            .add_extension(_key_usage("digital_signature"), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_secret(target / "tls.key", _pem_key(key))
    _write_public(target / "tls.crt", cert.public_bytes(serialization.Encoding.PEM))
    _write_public(target / "ca.crt", ca_pem)
    return target


def init_pki(out: Path, followers: int, cluster_ids: list[str], days: int = 365,
             run_name: str = "run") -> list[Identity]:
    """Create the run CA in ``out`` and issue leader, admin, follower-0..followers-1 and
    cluster-<id> for each id; returns the identities issued. Everything is checked before
    anything is written: PkiError if ``out/ca.key`` or an identity's directory exists, an id
    is malformed or repeated, ``followers`` < 0 or ``days`` < 1."""
    out = Path(out)
    _check_int("days", days, 1)
    _check_int("followers", followers, 0)
    if len(set(cluster_ids)) != len(cluster_ids):
        raise PkiError(f"cluster ids repeat: {list(cluster_ids)}")
    identities = ([Identity.leader(), Identity.admin()]
                  + [Identity.follower(i) for i in range(followers)]
                  + [_cluster(c) for c in cluster_ids])
    if (out / "ca.key").exists():
        raise PkiError(f"{out / 'ca.key'}: already exists; {out} already holds a run PKI")
    for identity in identities:
        if (out / identity.name).exists():
            raise PkiError(f"{out / identity.name}: already exists")
    create_ca(out, run_name, days)
    for identity in identities:
        issue(out, identity, days)
    for cid in cluster_ids:
        _list(out, ISSUED, cid)
    return identities


#: The file (in ``OUT`` and ``OUT/leader``) listing every cluster id a certificate was issued for.
ISSUED = "clusters.txt"


def read_revoked(path: Path) -> frozenset[str]:
    """The cluster ids listed in ``path`` (``revoked.txt``, or :data:`ISSUED`), one per line; a
    missing file is an empty set. Blank lines and lines starting with ``#`` are ignored;
    PkiError for an unreadable file or a line that is not a cluster id (naming the file and
    line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return frozenset()
    except (OSError, UnicodeDecodeError) as exc:
        raise PkiError(f"{path}: cannot read: {exc}") from None
    ids = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not CLUSTER_ID.fullmatch(line):
            raise PkiError(f"{path}:{lineno}: {line!r} is not a cluster id")
        ids.add(line)
    return frozenset(ids)


def add_cluster(out: Path, cluster_id: str, days: int = 365) -> Path:
    """Issue ``cluster-<cluster_id>`` with the existing CA in ``out``; returns its directory.
    PkiError if the id is malformed, already issued, or revoked (the leader refuses revoked
    ids by name, so a new certificate for one would be useless)."""
    identity = _cluster(cluster_id)
    if cluster_id in read_revoked(Path(out) / "revoked.txt"):
        raise PkiError(f"cluster {cluster_id!r} is revoked in {Path(out) / 'revoked.txt'}")
    target = issue(out, identity, days)
    _list(Path(out), ISSUED, cluster_id)
    return target


def _list(out: Path, name: str, cluster_id: str) -> None:
    """Add ``cluster_id`` to ``out/name`` and, where ``out/leader`` exists, to
    ``out/leader/name`` (idempotent)."""
    for path in (out / name, out / "leader" / name):
        if path.parent != out and not path.parent.is_dir():
            continue
        if cluster_id in read_revoked(path):
            continue
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        if text and not text.endswith("\n"):
            text += "\n"
        _write_public(path, (text + cluster_id + "\n").encode())


def revoke(out: Path, cluster_id: str) -> None:
    """Revoke cluster ``cluster_id``: add it to ``out/revoked.txt`` and ``out/leader/revoked.txt``
    (copy the latter to the leader host). Idempotent; an id not (yet) issued may be revoked.
    PkiError if the id is malformed or ``out/leader`` is missing."""
    out = Path(out)
    _cluster(cluster_id)
    if not (out / "leader").is_dir():
        raise PkiError(f"{out / 'leader'}: missing; the leader's revoked.txt belongs there")
    _list(out, "revoked.txt", cluster_id)
