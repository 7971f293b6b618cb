"""``dips follower``: one follower process (§5, §12), on its own host with its own state dir.

It asks the leader for the run spec, serves its shard (version 0 from ``--init`` or built
from the config's seed; after a restart, its newest complete checkpoint), binds its control
service (gRPC, mutual TLS) and its data plane (ZeroMQ), and registers with the leader at once,
then at a random offset within the heartbeat interval and every interval after it (issue 16).
The registration's reply carries the leader's term (its lease, see :mod:`dips.algo.fencing`)
and the data secret from which members' keys and the admission key of push tickets
(:mod:`dips.wire.admission`) derive. Each registration also says whether the data plane
still serves (``data_plane_error``: a thread died, or a peer has waited for its
turn beyond ``starved_s``, :meth:`dips.wire.dataplane.DataServer.health`): such a follower is
marked down by the leader instead of being believed to serve. The state directory holds
``checkpoints/``, ``applied.jsonl`` and ``leader_term``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

import grpc
import zmq

from dips.algo import fencing
from dips.algo.ratelimit import first_beat_delay
from dips.algo.refusal import Refusal
from dips.node.common import RoleError, StateDir, Unreachable, fetch_spec, split_address
from dips.wire.admission import admission_key
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.control import describe

log = logging.getLogger(__name__)


def _initial_params(spec, names: list[str], init: Path | None):
    """Version 0 of this shard: from ``init`` — a safetensors file (e.g. the preparing host's
    ``init/model.safetensors``) or an HF checkpoint directory (``save_pretrained``: one or
    several ``*.safetensors`` files) — or, without it, built from the config's seed. Raises
    RoleError naming the parameters missing or of another shape."""
    if init is not None:
        from safetensors import safe_open

        files = sorted(init.glob("*.safetensors")) if init.is_dir() else [init]
        params = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for n in set(names) & set(f.keys()):
                    params[n] = f.get_tensor(n).float().contiguous()
        missing = [n for n in names if n not in params]
        if missing:
            raise RoleError(f"--init {init}: parameters {missing[:3]} missing "
                            f"({len(missing)} in all)")
        want = {n: tuple(shape) for n, shape, _ in (spec.fingerprint.tensors
                                                     if spec.fingerprint else [])}
        wrong = [n for n in names if n in want and tuple(params[n].shape) != want[n]]
        if wrong:
            raise RoleError(f"--init {init}: {wrong[0]} has shape {tuple(params[wrong[0]].shape)}, "
                            f"the run's model {want[wrong[0]]}")
        return params
    from dips.train.model import build_model

    model = build_model(spec.config.model, spec.config.seed)
    params = dict(model.named_parameters())
    return {n: params[n].detach().float().contiguous() for n in names}


def run_follower(leader_addr: str, index: int, listen: str, advertise: str, data_listen: str,
                 data_advertise: str, state: Path, creds: Credentials, stop: threading.Event,
                 *, init: Path | None = None, data_ipc: Path | None = None,
                 metrics_port: int | None = None, metrics_host: str = "0.0.0.0") -> int:
    """Serve follower ``index`` until ``stop``; returns the exit code. ``metrics_port``: serve
    Prometheus metrics there (:mod:`dips.node.metrics_members`; 0: a free port, logged; None:
    none). Raises RoleError if it cannot start (see :mod:`dips.node.common`)."""
    import torch

    from dips.roles import failpoints
    from dips.roles.checkpoint import complete_versions, load_checkpoint
    from dips.roles.fence import Fence
    from dips.roles.follower import FollowerShard
    from dips.wire.control import make_server, refusal_of
    from dips.wire.dataplane import DataServer
    from dips.wire.keys import Keyring
    from dips.wire.not_leader import NotLeaderServicer
    from dips.wire.pb import control_pb2 as pb
    from dips.wire.pb import control_pb2_grpc as pbg
    from dips.wire.services import FollowerServicer, leader_client

    if creds.identity != Identity.follower(index):
        raise RoleError(f"--index {index}, but the certificate is {creds.identity.name!r}")
    torch.set_num_threads(1)
    StateDir(state).acquire()
    spec, _ = fetch_spec(leader_addr, creds, stop, 180.0)
    cfg = spec.config
    if not 0 <= index < cfg.followers:
        raise RoleError(f"--index {index}: the run has {cfg.followers} followers")
    table = {layer: names for layer, names, _ in spec.layers}
    sizes = {layer: nbytes for layer, _, nbytes in spec.layers}
    owned = spec.follower_layers[index]
    layers = {l: table[l] for l in owned}
    names = [n for ns in layers.values() for n in ns]
    ckpt_dir = state / "checkpoints"
    observed = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from dips.node.metrics_members import FollowerMetrics

        observed = FollowerMetrics(CollectorRegistry())
    saved = complete_versions(ckpt_dir)
    momenta, version = None, 0
    if saved:  # a restart: resume from the newest complete checkpoint (§12)
        params, momenta, _ = load_checkpoint(ckpt_dir, saved[-1], names)
        version = saved[-1]
    else:
        params = _initial_params(spec, names, init)
    shard = FollowerShard(index, layers, params, cfg.outer.lr, cfg.outer.momentum,
                          log_dir=state, version=version, momenta=momenta, ckpt_dir=ckpt_dir,
                          keep=cfg.checkpoint_keep, state_dtype=cfg.outer.state_dtype,
                          wire_dtype=cfg.outer.wire_dtype, require_tickets=True,
                          on_checkpoint=observed.on_checkpoint if observed else None)
    fence = Fence(state / "leader_term", fencing.lease_seconds(
        cfg.membership.heartbeat_interval_s, cfg.membership.missed_heartbeats))
    keyring = Keyring()
    data_host, data_port = split_address(data_listen, "--data-listen")
    try:
        data = DataServer(keyring, shard.handle, host=data_host, port=data_port,
                          authorize=shard.authorize)
    except zmq.ZMQError as exc:
        shard.close()  # its checkpoint writer thread must not outlive the failed start
        raise RoleError(f"--data-listen {data_listen}: cannot bind ({exc})") from None
    shard.push_connections = data.push_connections  # recorded in applied.jsonl
    shard.busy = data.busy.take  # and the busy time by phase since the last record
    if data_ipc is not None:  # a local reader outside the servers' network namespace
        data.bind(f"ipc://{data_ipc}")
    data.start()
    metrics = None
    if observed is not None:
        from dips.node.metrics import serve_metrics

        observed.attach(shard, data, ckpt_dir)
        try:
            metrics = serve_metrics(observed.registry, metrics_port, metrics_host, state)
        except RoleError:
            data.stop()
            shard.close()
            raise
    from dips.node.metrics_members import TimedShard

    server = make_server(max_workers=8)
    pbg.add_FollowerServicer_to_server(
        FollowerServicer(observed.timed(shard, data.busy) if observed
                         else TimedShard(shard, None, data.busy), fence), server)
    # A member or `dips status` given this port as the leader's is told what it reached.
    pbg.add_LeaderServicer_to_server(NotLeaderServicer(
        f"follower {index}'s control service (its leader: {leader_addr})"), server)
    if creds.add_port(server, listen) == 0:
        data.stop()
        if metrics is not None:
            metrics.close()
        raise RoleError(f"--listen {listen}: cannot bind (in use, or not an address of this "
                        "host)")
    server.start()
    leader = leader_client(leader_addr, creds)
    incarnation = time.time_ns()
    data_endpoint = f"tcp://{data_advertise}"
    log.info("follower %d serving layers %s at version %d (control %s, data %s)", index, owned,
             shard.version, advertise, data_endpoint)
    interval = cfg.membership.heartbeat_interval_s
    code = 0
    # Registration doubles as the heartbeat: the leader learns a restart from the incarnation,
    # a restarted leader learns this follower within one interval (§12), and the reply renews
    # the leader's lease on this follower. The first registers at once, the next at a random
    # offset within the interval, then every interval: followers started together do not
    # beat in the same second ever after (issue 16, dips.algo.ratelimit.first_beat_delay).
    wait_s = first_beat_delay(interval, random.SystemRandom().random())
    unreachable = Unreachable(f"follower {index}: leader {leader_addr}")
    while not stop.is_set():
        failpoints.hit("idle")  # fault injection between transfers
        info = pb.FollowerInfo(index=index, data_endpoint=data_endpoint,
                               control_endpoint=advertise, layers=owned,
                               layer_bytes=[sizes[l] for l in owned], version=shard.version,
                               incarnation=incarnation, leader_term=fence.term,
                               data_plane_error=data.health() or "")
        try:
            reply = leader.RegisterFollower(info, timeout=max(1.0, interval))
            # The ticket key first: no push is served under a secret whose tickets cannot be
            # checked yet (the shard refuses every push until it has the key).
            shard.set_admission_key(admission_key(reply.data_secret))
            keyring.set_secret(reply.data_secret, reply.encrypt)
            keyring.set_members(list(reply.member_keys), reply.next_key_seq)
            fence.heard(reply.term)
            unreachable.answered()
        except grpc.RpcError as exc:
            if refusal_of(exc) is Refusal.FORBIDDEN:  # another process serves this index
                log.error("follower %d stops: %s", index, exc.details())
                code = 3
                break
            unreachable.failed(describe(exc))
        stop.wait(wait_s)
        wait_s = interval
    server.stop(grace=2.0).wait(5.0)
    data.stop()
    shard.close()
    leader.close()
    if metrics is not None:
        metrics.close()
    return code
