"""``dips leader``: the leader process (§5, §12), on its own host with its own state directory.

On its first start it prepares the run (:func:`dips.train.prepare.prepare`) into the state
directory; later starts reuse that spec (and refuse a config that changed). Every start takes
a new term (fencing token, :mod:`dips.algo.fencing`), persisted before the leader acts, and
first takes the lease of every follower it knew: a follower still led by a live leader keeps
refusing, and this process then steps down (exit code 3) without having changed anything.
The state directory holds ``run.json``, ``term``, ``data_secret`` (0600), ``leader.json``,
``outer_steps.jsonl``, ``leader_events.jsonl`` and, with ``dips evaluate`` reporting,
``eval.jsonl`` (:mod:`dips.roles.leader_eval`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from dips.algo import fencing
from dips.algo.refusal import Refusal
from dips.node.common import RoleError, StateDir
from dips.roles.durable import fsync_path, write_atomic
from dips.spec import RunConfig, RunSpec
from dips.wire.control import refusal_of
from dips.wire.keys import SECRET_BYTES, new_secret
from dips.wire.pki import ISSUED, read_revoked
from dips.wire.security import Credentials

log = logging.getLogger(__name__)

EXIT_FENCED = 3


def next_term(state: Path) -> int:
    """Read the start counter in ``state/term``, write it + 1 (fsynced, atomically) and return
    this start's term: the counter in the high bits and 31 random bits below, so two leaders
    started from copies of one state directory never hold the same term (the lower one is
    refused as stale, :mod:`dips.algo.fencing`)."""
    path = state / "term"
    count = int(path.read_text().strip() or 0) + 1 if path.exists() else 1
    write_atomic(path, f"{count}\n".encode())
    return fencing.term_of(count, secrets.randbits(31))


def data_secret(state: Path) -> bytes:
    """The run's data secret, created once (0600, ``O_EXCL``, fsynced with its directory) in
    ``state/data_secret``."""
    path = state / "data_secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(new_secret())
            f.flush()
            os.fsync(f.fileno())
        fsync_path(state)
    secret = path.read_bytes()
    if len(secret) != SECRET_BYTES:
        raise RoleError(f"{path}: {len(secret)} bytes, expected {SECRET_BYTES}")
    return secret


def load_or_prepare(cfg: RunConfig, state: Path, cache_dir: Path | None) -> RunSpec:
    """The run spec in ``state/run.json``, or a new one prepared from ``cfg``. Raises
    RoleError if the state directory holds another config's spec (naming the fields)."""
    path = state / "run.json"
    if not path.exists():
        from dips.train.prepare import prepare

        return prepare(cfg, state, cache_dir)
    spec = RunSpec.read(path)
    if spec.config != cfg:
        old, new = spec.config.model_dump(), cfg.model_dump()
        fields = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise RoleError(f"{path} was prepared from another config (fields {fields} differ): "
                        "use a new --state-dir for a new run")
    return spec


def take_leases(endpoints: dict[int, str], connect: Any, lease_s: float,
                stop: threading.Event, version: int = 0) -> str | None:
    """Take the lease of every follower in ``endpoints`` (index -> control address) before
    acting. Returns None when done (a follower that does not answer is skipped: it takes the
    lease when it registers), or why this leader must step down: a follower follows a higher
    term or holds a newer version than this leader's state (``version``: a stale copy of a
    state directory), or stayed leased to another leader for 2 lease periods (a live one
    renews it)."""
    pending = dict(endpoints)
    held_since: float | None = None
    while pending and not stop.is_set():
        for index in list(pending):
            control = connect(index, pending[index])
            try:
                control.fence(version)
                del pending[index]
            except grpc.RpcError as exc:
                code = refusal_of(exc)
                if code is Refusal.STALE_TERM:
                    return f"follower {index}: {exc.details()}"
                if code is not Refusal.LEASE_HELD:
                    del pending[index]  # unreachable now: it takes the lease at registration
                    continue
                held_since = held_since if held_since is not None else time.monotonic()
                if fencing.give_up(held_since, time.monotonic(), lease_s):
                    return (f"follower {index} stays leased to another live leader: "
                            f"{exc.details()}")
            finally:
                control.close()
        if pending:
            stop.wait(min(0.25, lease_s / 4))
    return None


def run_leader(cfg: RunConfig, listen: str, state: Path, creds: Credentials,
               stop: threading.Event, *, advertise: str | None = None,
               cache_dir: Path | None = None, status_socket: Path | None = None,
               revoked_file: Path | None = None, metrics_port: int | None = None,
               metrics_host: str = "0.0.0.0") -> int:
    """Serve the leader until ``stop`` is set or it steps down; returns the exit code (0, or
    :data:`EXIT_FENCED`). ``metrics_port``: serve Prometheus metrics there
    (:mod:`dips.node.metrics`; 0: a free port, logged; None: none). Raises RoleError if it
    cannot start (state directory in use, a config that differs from the prepared spec, an
    address that cannot be bound)."""
    from dips.algo.ledger import ChunkLedger
    from dips.algo.ratelimit import heartbeat_limit
    from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
    from dips.roles.leader_types import Issued
    from dips.wire.control import make_server
    from dips.wire.inflight import CallGate, RateGate
    from dips.wire.pb import control_pb2_grpc as pbg
    from dips.wire.ratelog import Tally
    from dips.wire.services import FollowerControlClient, LeaderServicer

    StateDir(state).acquire()
    spec = load_or_prepare(cfg, state, cache_dir)
    term = next_term(state)
    issued = Issued(term=term, data_secret=data_secret(state), run_spec=spec.model_dump_json(),
                    fingerprint=spec.fingerprint.to_json() if spec.fingerprint else "",
                    encrypt=creds.secure and cfg.data_encryption == "aes-gcm")
    lease_s = fencing.lease_seconds(cfg.membership.heartbeat_interval_s,
                                    cfg.membership.missed_heartbeats)
    holder: dict[str, Leader] = {}

    def on_fenced(reason: str) -> None:
        if "leader" in holder:
            holder["leader"].step_down(reason)

    def connect(index: int, endpoint: str) -> FollowerControlClient:
        return FollowerControlClient(endpoint, creds, index, term, cfg.timeouts.rpc_s,
                                     on_fenced=on_fenced)

    previous, version = _known_followers(state / "leader.json")
    reason = take_leases(previous, connect, lease_s, stop, version)
    if reason is not None:
        log.error("leader term %d steps down before acting: %s", term, reason)
        return EXIT_FENCED
    ledger = ChunkLedger(cfg.data.num_chunks, spec.windows_per_chunk)
    leader = Leader(LeaderConfig.from_run(cfg), lambda e: connect(e.index, e.control_endpoint),
                    state, ledger=ledger, tokens_per_window=cfg.inner.seq_len, issued=issued)
    holder["leader"] = leader
    metrics = None
    refusals = Tally()  # refused calls by caller, method and code (dips_refusals_total)
    if metrics_port is not None:  # before the leader acts: no record is missed
        from prometheus_client import CollectorRegistry

        from dips.node.metrics import LeaderMetrics, serve_metrics

        registry = CollectorRegistry()
        observed = LeaderMetrics(registry)
        observed.replay(state)  # counters go on from the previous process's records
        observed.attach(leader, refusals=refusals)
        leader.observer = observed.observe
        metrics = serve_metrics(registry, metrics_port, metrics_host, state)

    def entry(info: Any) -> FollowerEntry:
        return FollowerEntry(info.index, info.data_endpoint, info.control_endpoint,
                             list(info.layers), list(info.layer_bytes), info.incarnation,
                             leader_term=info.leader_term, version=info.version,
                             data_plane_error=info.data_plane_error)

    def revoked() -> frozenset[str]:
        return read_revoked(revoked_file) if revoked_file is not None else frozenset()

    if revoked_file is not None:  # the clusters issued next to it, less the revoked ones
        issued_file = revoked_file.with_name(ISSUED)
        leader.roster = lambda: read_revoked(issued_file) - revoked()

    workers = 8 + 4 * len(cfg.clusters)
    beats = heartbeat_limit(cfg.membership.heartbeat_interval_s)  # issue 13, review 30
    server = make_server(max_workers=workers,
                         reads=RateGate(cfg.membership.read_calls_per_s, cfg.membership.read_burst),
                         heartbeats=RateGate(*beats, what="membership.heartbeat_interval_s"))
    # Waiting calls (push admission, verdicts) leave threads free for heartbeats (issue 13).
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, entry, revoked,
                                                    CallGate.for_server(workers), refusals),
                                     server)
    if creds.add_port(server, listen) == 0:
        if metrics is not None:
            metrics.close()
        raise RoleError(f"--listen {listen}: cannot bind (in use, or not an address of this host)")
    if status_socket is not None:  # for a local operator outside the servers' namespaces
        status_socket.unlink(missing_ok=True)
        creds.add_port(server, f"unix:{status_socket}")
    server.start()
    leader.start()
    log.info("leader term %d serving on %s (advertised as %s), version %d", term, listen,
             advertise or listen, leader.version)
    while not stop.is_set() and not leader.fenced.is_set():
        stop.wait(0.2)
    leader.stop()
    server.stop(grace=2.0).wait(5.0)
    if metrics is not None:
        metrics.close()
    if leader.fenced.is_set():
        log.error("leader term %d stepped down: %s", term, leader.fenced_reason)
        return EXIT_FENCED
    return 0


def _known_followers(path: Path) -> tuple[dict[int, str], int]:
    """(follower index -> control address, version) from a previous ``leader.json``."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, 0
    return ({int(i): str(ep) for i, ep in (state.get("followers") or {}).items()},
            int(state.get("version", 0)))
