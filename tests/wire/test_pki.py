"""The run PKI (:mod:`dips.wire.pki`) and ``dips init``: files and modes, refusals, bundle
checks, revocation, and one real gRPC mutual-TLS handshake on 127.0.0.1 with two bundles."""

from __future__ import annotations

import datetime as dt
import stat
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding, load_pem_private_key
from typer.testing import CliRunner

from dips.cli import app
from dips.wire.pki import (
    ISSUED,
    ROLES,
    Identity,
    PkiError,
    TlsBundle,
    add_cluster,
    identity_of_pem,
    init_pki,
    read_revoked,
    revoke,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One PKI for the read-only tests: 2 followers, clusters a and b."""
    out = tmp_path_factory.mktemp("pki") / "pki"
    init_pki(out, followers=2, cluster_ids=["a", "b"], days=30, run_name="test")
    return out


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, unrelated run CA (the same names, a different CA)."""
    out = tmp_path_factory.mktemp("other") / "pki"
    init_pki(out, followers=0, cluster_ids=["a"], days=30)
    return out


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_init_writes_every_bundle_with_private_keys_0600(pki: Path) -> None:
    names = ["leader", "admin", "follower-0", "follower-1", "cluster-a", "cluster-b"]
    assert sorted(p.name for p in pki.iterdir()) == sorted(["ca.crt", "ca.key", ISSUED, *names])
    assert stat.S_IMODE((pki / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((pki / "ca.crt").stat().st_mode) == 0o644
    for name in names:
        listed = [ISSUED] if name == "leader" else []  # the clusters issued, for the leader
        assert sorted(p.name for p in (pki / name).iterdir()) == sorted(
            ["ca.crt", "tls.crt", "tls.key", *listed])
        assert stat.S_IMODE((pki / name / "tls.key").stat().st_mode) == 0o600
        assert stat.S_IMODE((pki / name / "tls.crt").stat().st_mode) == 0o644
        assert (pki / name / "ca.crt").read_bytes() == (pki / "ca.crt").read_bytes()
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = x509.load_pem_x509_certificate((pki / "cluster-a" / "tls.crt").read_bytes())
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cluster-a"]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert leaf.not_valid_before_utc < dt.datetime.now(dt.UTC) - dt.timedelta(minutes=4)


def test_a_second_init_refuses_and_changes_nothing(tmp_path: Path) -> None:
    init_pki(tmp_path, followers=1, cluster_ids=["a"])
    before = _snapshot(tmp_path)
    with pytest.raises(PkiError, match="ca.key"):
        init_pki(tmp_path, followers=3, cluster_ids=["a", "z"])
    assert _snapshot(tmp_path) == before


def test_init_refuses_bad_requests_before_writing(tmp_path: Path) -> None:
    for followers, ids in ((1, ["a", "a"]), (1, ["bad id"]), (-1, ["a"])):
        with pytest.raises(PkiError):
            init_pki(tmp_path / "x", followers=followers, cluster_ids=ids)
    assert not (tmp_path / "x").exists()


def test_bundles_load_with_their_identities(pki: Path) -> None:
    for ident in (Identity.leader(), Identity.admin(), Identity.follower(1),
                  Identity.cluster("b")):
        bundle = TlsBundle.load(pki / ident.name)
        assert bundle.identity == ident and identity_of_pem(bundle.cert) == ident
        assert bundle.ca == (pki / "ca.crt").read_bytes()
    assert TlsBundle.load(pki / "follower-1").identity.index == 1


def test_load_refuses_another_cas_cert_a_wrong_key_and_missing_files(
        pki: Path, other_pki: Path, tmp_path: Path) -> None:
    def bundle(ca: Path, cert: Path, key: Path) -> Path:
        d = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        for name, src in (("ca.crt", ca), ("tls.crt", cert), ("tls.key", key)):
            (d / name).write_bytes(src.read_bytes())
        return d

    ours, theirs = pki / "cluster-a", other_pki / "cluster-a"
    with pytest.raises(PkiError, match="not signed by the CA"):
        TlsBundle.load(bundle(ours / "ca.crt", theirs / "tls.crt", theirs / "tls.key"))
    with pytest.raises(PkiError, match="key does not match"):
        TlsBundle.load(bundle(ours / "ca.crt", ours / "tls.crt", pki / "leader" / "tls.key"))
    d = bundle(ours / "ca.crt", ours / "tls.crt", ours / "tls.key")
    (d / "tls.crt").write_bytes(b"not pem")
    with pytest.raises(PkiError, match="tls.crt: not a PEM certificate"):
        TlsBundle.load(d)
    (d / "ca.crt").unlink()
    with pytest.raises(PkiError, match="ca.crt: missing"):
        TlsBundle.load(d)


def test_load_refuses_an_expired_certificate(pki: Path, tmp_path: Path) -> None:
    ca_key = load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    leaf = x509.load_pem_x509_certificate((pki / "admin" / "tls.crt").read_bytes())
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    old = (x509.CertificateBuilder().subject_name(leaf.subject).issuer_name(ca.subject)
           .public_key(leaf.public_key()).serial_number(1).not_valid_before(past)
           .not_valid_after(past + dt.timedelta(days=1)).sign(ca_key, hashes.SHA256()))
    for name in ("ca.crt", "tls.key"):
        (tmp_path / name).write_bytes((pki / "admin" / name).read_bytes())
    (tmp_path / "tls.crt").write_bytes(old.public_bytes(Encoding.PEM))
    with pytest.raises(PkiError, match="tls.crt: expired"):
        TlsBundle.load(tmp_path)


def test_identity_names_round_trip_and_bad_names_are_refused() -> None:
    assert ROLES == ("leader", "follower", "cluster", "admin")
    for ident in (Identity.leader(), Identity.admin(), Identity.follower(0),
                  Identity.follower(12), Identity.cluster("a"), Identity.cluster("eu-1.x_y")):
        assert Identity.parse(ident.name) == ident
    assert Identity.follower(3).name == "follower-3" and Identity.cluster("a").name == "cluster-a"
    for bad in ("cluster-", "follower-01", "follower--1", "root", "cluster-a b", "leader-1",
                "follower-x", "cluster-.a", "", "admin-", "cluster-" + "a" * 57):
        with pytest.raises(ValueError, match="not a dips identity"):
            Identity.parse(bad)
    with pytest.raises(ValueError, match="no index"):
        _ = Identity.cluster("a").index
    with pytest.raises(ValueError):
        Identity.follower(-1)


def test_add_cluster_and_revoke(tmp_path: Path) -> None:
    init_pki(tmp_path, followers=1, cluster_ids=["a"])
    assert TlsBundle.load(add_cluster(tmp_path, "new")).identity == Identity.cluster("new")
    with pytest.raises(PkiError, match="already"):
        add_cluster(tmp_path, "new")
    # Every cluster issued is listed for the leader (issue 13, review 18: clusters added
    # later must count as members before they join).
    for where in (tmp_path, tmp_path / "leader"):
        assert (where / ISSUED).read_text() == "a\nnew\n"
    with pytest.raises(PkiError, match="cluster id must match"):
        revoke(tmp_path, "a b")
    revoke(tmp_path, "a")
    revoke(tmp_path, "a")
    revoke(tmp_path, "new")
    revoke(tmp_path, "later")  # revoked before it is ever issued: never issued
    assert (tmp_path / "revoked.txt").read_text() == "a\nnew\nlater\n"
    assert read_revoked(tmp_path / "leader" / "revoked.txt") == {"a", "new", "later"}
    with pytest.raises(PkiError, match="revoked"):
        add_cluster(tmp_path, "later")
    assert read_revoked(tmp_path / "nothing.txt") == frozenset()
    (tmp_path / "leader" / "revoked.txt").write_text("# comment\n\n a \n")
    assert read_revoked(tmp_path / "leader" / "revoked.txt") == {"a"}
    (tmp_path / "cluster-a").rename(tmp_path / "gone")  # a revoked id stays refused
    with pytest.raises(PkiError, match="revoked"):
        add_cluster(tmp_path, "a")


def test_cli_init_then_refuses_a_second_time(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["init", "--config", str(ROOT / "configs" / "tiny.yaml"), "--out", str(tmp_path / "p")]
    ok = runner.invoke(app, args)
    assert ok.exit_code == 0, ok.output
    for name in ("leader/", "admin/", "follower-1/", "cluster-c/", "ca.key"):
        assert name in ok.stdout
    again = runner.invoke(app, args)
    assert again.exit_code == 2
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "already" in lines[0] and "Traceback" not in again.output
    added = runner.invoke(app, ["init", "--out", str(tmp_path / "p"), "--add-cluster", "d"])
    assert added.exit_code == 0 and "cluster-d/" in added.stdout
    revoked = runner.invoke(app, ["init", "--out", str(tmp_path / "p"), "--revoke", "a",
                                  "--revoke", "zz"])
    assert revoked.exit_code == 0 and "does not exist" in revoked.stderr  # zz: a typo?
    assert read_revoked(tmp_path / "p" / "leader" / "revoked.txt") == {"a", "zz"}
    none = runner.invoke(app, ["init", "--out", str(tmp_path / "q")])
    assert none.exit_code == 2 and "--config" in none.stderr
    missing = runner.invoke(app, ["init", "--config", str(tmp_path / "no.yaml"), "--out",
                                  str(tmp_path / "q")])
    assert missing.exit_code == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()


def _whoami(request: bytes, context: grpc.ServicerContext) -> bytes:
    return context.auth_context()["x509_common_name"][0]


def _call(server: TlsBundle, client: TlsBundle, target: str | None = None) -> bytes:
    """One unary RPC from ``client`` to a server with ``server``'s bundle, verified as
    ``target`` (default: the server's own name); returns the client CN the server saw."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
        "WhoAmI": grpc.unary_unary_rpc_method_handler(
            _whoami, request_deserializer=lambda b: b, response_serializer=lambda b: b)}),))
    creds = grpc.ssl_server_credentials([(server.key, server.cert)],
                                        root_certificates=server.ca, require_client_auth=True)
    port = srv.add_secure_port("127.0.0.1:0", creds)
    srv.start()
    try:
        with grpc.secure_channel(
                f"127.0.0.1:{port}", grpc.ssl_channel_credentials(client.ca, client.key,
                                                                  client.cert),
                options=[("grpc.ssl_target_name_override", target or server.identity.name),
                         ("grpc.enable_http_proxy", 0)]) as channel:
            stub = channel.unary_unary("/t.T/WhoAmI", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            return stub(b"", timeout=10)
    finally:
        srv.stop(None)


def test_grpc_mutual_tls_with_two_bundles(pki: Path, other_pki: Path) -> None:
    leader = TlsBundle.load(pki / "leader")
    assert _call(leader, TlsBundle.load(pki / "cluster-a")) == b"cluster-a"
    # Another CA's client cert, even one that trusts our CA, is refused in the handshake.
    stranger = TlsBundle.load(other_pki / "cluster-a")
    stranger = TlsBundle(ca=leader.ca, cert=stranger.cert, key=stranger.key,
                         identity=stranger.identity)
    with pytest.raises(grpc.RpcError) as err:
        _call(leader, stranger)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # A valid certificate of the wrong role is refused by the client's name check.
    with pytest.raises(grpc.RpcError) as err:
        _call(TlsBundle.load(pki / "follower-0"), TlsBundle.load(pki / "cluster-a"), "leader")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
