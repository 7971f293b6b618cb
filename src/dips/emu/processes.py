"""Entry points of the processes that ``dips launch`` starts on one machine (§5 of the seed).

Each reads ``RUN_DIR/run.json`` (a :class:`dips.spec.RunSpec` written by the launcher: config,
layer table, follower ownership, ports) and ``RUN_DIR/secret``; binds its sockets to free ports on 127.0.0.1 and
publishes them (the leader writes ``leader.addr``; followers register with the leader).
SIGTERM or SIGINT stops a process cleanly; every wait has a timeout. torch is imported only by
the processes that hold tensors, so the leader (metadata only) restarts in about a second.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from dips.spec import RunSpec
from dips.train.run import stop_on_signals

log = logging.getLogger(__name__)


def read_spec(run_dir: Path) -> tuple[RunSpec, str]:
    """(``run.json`` validated as a :class:`RunSpec`, secret hex string).

    Raises FileNotFoundError if absent, pydantic.ValidationError if malformed.
    """
    return RunSpec.read(run_dir / "run.json"), (run_dir / "secret").read_text().strip()


def _setup_logging(run_dir: Path, name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")


def run_leader(run_dir: Path) -> None:
    """Serve the leader until SIGTERM; write its address to ``RUN_DIR/leader.addr``."""
    from dips.algo.ledger import ChunkLedger
    from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
    from dips.wire.control import make_server
    from dips.wire.pb import control_pb2_grpc as pbg
    from dips.wire.services import FollowerControlClient, LeaderServicer

    _setup_logging(run_dir, "leader")
    stop = stop_on_signals()
    spec, secret = read_spec(run_dir)
    cfg = spec.config
    ledger = ChunkLedger(cfg.data.num_chunks, spec.windows_per_chunk)
    leader = Leader(LeaderConfig.from_run(cfg), lambda e: FollowerControlClient(e.control_endpoint, secret,
                                                          cfg.timeouts.rpc_s),
                    run_dir, ledger=ledger, tokens_per_window=cfg.inner.seq_len)

    def entry(info: Any) -> FollowerEntry:
        return FollowerEntry(info.index, info.data_endpoint, info.control_endpoint,
                             list(info.layers), list(info.layer_bytes), info.incarnation)

    server = make_server(secret, max_workers=8 + 4 * len(cfg.clusters))
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, entry), server)
    # A fixed port (chosen by the launcher) so a restarted leader is found at the same address.
    addr = spec.leader_addr
    if server.add_insecure_port(addr) == 0:
        raise RuntimeError(f"leader cannot bind {addr}")
    # The launcher reads status through a unix socket: it works from outside the servers'
    # network namespace too.
    server.add_insecure_port(f"unix:{run_dir / 'leader.sock'}")
    server.start()
    leader.start()
    tmp = run_dir / "leader.addr.tmp"
    tmp.write_text(addr)
    tmp.replace(run_dir / "leader.addr")
    log.info("leader serving on %s (version %d)", addr, leader.version)
    stop.wait()
    leader.stop()
    server.stop(grace=2.0).wait(5.0)


def run_follower(run_dir: Path, index: int) -> None:
    """Serve follower ``index`` (its shard loaded from the run's initial checkpoint)."""
    from safetensors import safe_open

    from dips.roles import failpoints
    from dips.roles.checkpoint import complete_versions, load_checkpoint
    from dips.roles.follower import FollowerShard
    from dips.wire.control import make_server
    from dips.wire.dataplane import DataServer
    from dips.wire.pb import control_pb2 as pb
    from dips.wire.pb import control_pb2_grpc as pbg
    from dips.wire.services import FollowerServicer, leader_client

    import torch

    _setup_logging(run_dir, f"follower-{index}")
    torch.set_num_threads(1)
    stop = stop_on_signals()
    spec, secret = read_spec(run_dir)
    cfg = spec.config
    table = {layer: names for layer, names, _ in spec.layers}
    sizes = {layer: nbytes for layer, _, nbytes in spec.layers}
    owned = spec.follower_layers[index]
    layers = {l: table[l] for l in owned}
    names = [n for ns in layers.values() for n in ns]
    ckpt_dir = run_dir / "followers" / str(index) / "checkpoints"
    saved = complete_versions(ckpt_dir)
    momenta, version = None, 0
    if saved:  # a restart: resume from the newest complete checkpoint (§12)
        params, momenta, _ = load_checkpoint(ckpt_dir, saved[-1], names)
        version = saved[-1]
    else:
        with safe_open(str(run_dir / spec.init), framework="pt") as f:
            params = {n: f.get_tensor(n).float() for n in names}
    shard = FollowerShard(index, layers, params, cfg.outer.lr, cfg.outer.momentum,
                          log_dir=run_dir / "followers" / str(index), version=version,
                          momenta=momenta, ckpt_dir=ckpt_dir, keep=cfg.checkpoint_keep)
    # Fixed ports (chosen by the launcher): a restarted follower keeps its addresses (§12).
    data_port, control_port = spec.follower_ports[index]
    host = spec.bind_host
    data = DataServer(bytes.fromhex(secret), shard.handle, host=host, port=data_port)
    data.bind(f"ipc://{run_dir / f'follower-{index}.ipc'}")  # the launcher's final pull
    data.start()
    server = make_server(secret, max_workers=8)
    pbg.add_FollowerServicer_to_server(FollowerServicer(shard), server)
    port = server.add_insecure_port(f"{host}:{control_port}")
    if port == 0:
        raise RuntimeError(f"follower {index} cannot bind {host}:{control_port}")
    server.start()
    leader = leader_client(_wait_leader(run_dir, stop, cfg.timeouts.startup_s), secret)
    incarnation = time.time_ns()
    log.info("follower %d serving layers %s at version %d (data %s)", index, owned,
             shard.version, data.endpoint)
    # Registration doubles as the heartbeat: the leader learns a restart from the incarnation,
    # and a restarted leader learns this follower again within one interval (§12).
    while not stop.is_set():
        failpoints.hit("idle")  # fault injection between transfers
        info = pb.FollowerInfo(index=index, data_endpoint=data.endpoint,
                               control_endpoint=f"{host}:{port}", layers=owned,
                               layer_bytes=[sizes[l] for l in owned], version=shard.version,
                               incarnation=incarnation)
        try:
            leader.RegisterFollower(info, timeout=max(1.0, cfg.membership.heartbeat_interval_s))
        except grpc.RpcError as exc:
            log.debug("heartbeat to leader failed: %s", exc.code().name)
        stop.wait(cfg.membership.heartbeat_interval_s)
    server.stop(grace=2.0).wait(5.0)
    data.stop()
    shard.close()
    leader.close()


def _wait_leader(run_dir: Path, stop: threading.Event, timeout_s: float) -> str:
    path = run_dir / "leader.addr"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if stop.is_set() or time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.1)
    return path.read_text().strip()


def run_cluster(run_dir: Path, cluster_id: str) -> None:
    """Train cluster ``cluster_id``: inner AdamW steps with its slowdown, sync every H steps.

    The one training loop (:func:`dips.train.run.run_loop`) with the Di-PS sync
    (:class:`dips.train.dips_sync.DiPSSync`).  Writes ``RUN_DIR/clusters/<id>/train.jsonl``
    (a ``join`` record, then one line per inner step; push outcomes on the steps that
    synced). Stops at SIGTERM, after the current inner step or sync.
    """
    from dips.emu.pacing import Pacer
    from dips.roles.client import ClusterClient
    from dips.train.dips_sync import DiPSSync
    from dips.train.run import TrainLog, run_loop
    from dips.train.trainer import build_trainer

    import torch

    _setup_logging(run_dir, f"cluster-{cluster_id}")
    torch.set_num_threads(1)
    stop = stop_on_signals()
    spec, secret = read_spec(run_dir)
    cfg = spec.config
    me = cfg.cluster(cluster_id)
    trainer = build_trainer(cluster_id, cfg.model, cfg.data, cfg.inner, cfg.seed,
                            cache_dir=spec.cache_dir)
    bucket = None
    # Application-level link shaping on loopback; in network namespaces the kernel's tbf
    # shapes the link (and the launcher follows link.schedule), so no second limit here.
    if me.link is not None and cfg.network == "loopback":
        from dips.emu.link_schedule import ScheduledBucket

        bucket = ScheduledBucket(me)
    client = ClusterClient(trainer.model, _wait_leader(run_dir, stop, cfg.timeouts.startup_s),
                           cluster_id, secret, H=cfg.inner.H, stages=me.stages,
                           timeout_s=cfg.timeouts.push_s, admit_timeout_s=cfg.timeouts.admit_s,
                           heartbeat_interval_s=cfg.membership.heartbeat_interval_s,
                           data=trainer.batches,
                           limiter=bucket.consume if bucket is not None else None, stop=stop)
    sync = DiPSSync(client)
    # The leader may be restarting or waiting for followers: the join is retried.
    sync.join(stop, cfg.timeouts.startup_s)
    # Injected delay per inner step (§13): proportional to the measured step, or padding to a
    # calibrated step_s; transient slowdowns are timed from the launcher's training start
    # (written once the first cluster joined: read it after the join).
    pacer = Pacer(me.slowdown, cfg.step_s, me.transient_tuples())
    start_file = run_dir / "train_start"
    t_start = float(start_file.read_text()) if start_file.exists() else time.time()
    if bucket is not None:
        bucket.start(t_start)  # link.schedule times count from the training start
    log.info("cluster %s joined at version %d, stages %s", cluster_id, client.version,
             client.stage_layers)
    out = TrainLog(run_dir / "clusters" / cluster_id / "train.jsonl", stamp=time.time, delay=False)
    out.write({"event": "join", "version": client.version, "stages": client.stage_layers})
    try:
        run_loop(trainer, sync, stop, pacer, out, clock=lambda: time.time() - t_start)
    finally:
        out.close()
    log.info("cluster %s: %d paced steps overran step_s", cluster_id, pacer.overruns)
    client.close()
