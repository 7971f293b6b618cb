"""Entry points of the processes that ``dips launch`` starts on one machine (§5 of the seed).

Each reads ``RUN_DIR/run.json`` (written by the launcher: config, layer table, follower
ownership) and ``RUN_DIR/secret``; binds its sockets to free ports on 127.0.0.1 and
publishes them (the leader writes ``leader.addr``; followers register with the leader).
SIGTERM or SIGINT stops a process cleanly; every wait has a timeout. torch is imported only by
the processes that hold tensors, so the leader (metadata only) restarts in about a second.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)


def read_spec(run_dir: Path) -> tuple[dict[str, Any], str]:
    """(run.json as a dict, secret hex string). Raises FileNotFoundError if absent."""
    spec = json.loads((run_dir / "run.json").read_text())
    return spec, (run_dir / "secret").read_text().strip()


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _setup_logging(run_dir: Path, name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")


def run_leader(run_dir: Path) -> None:
    """Serve the leader until SIGTERM; write its address to ``RUN_DIR/leader.addr``."""
    from dips.algo import PenaltyConfig
    from dips.algo.ledger import ChunkLedger
    from dips.config import RunConfig
    from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
    from dips.wire.control import make_server
    from dips.wire.pb import control_pb2_grpc as pbg
    from dips.wire.services import FollowerControlClient, LeaderServicer

    _setup_logging(run_dir, "leader")
    stop = _stop_event()
    spec, secret = read_spec(run_dir)
    cfg = RunConfig.model_validate(spec["config"])
    pen = cfg.penalty
    lcfg = LeaderConfig(grace_window_s=cfg.grace_window_s, push_timeout_s=cfg.timeouts.push_s,
                        pull_timeout_s=cfg.timeouts.pull_s, max_norm=cfg.outer.max_norm,
                        uniform_weights=cfg.outer.uniform_weights,
                        heartbeat_interval_s=cfg.heartbeat_interval_s,
                        missed_heartbeats=cfg.missed_heartbeats, followers=cfg.followers,
                        grace_mode=cfg.grace_mode, grace_max_s=cfg.grace_max_s,
                        pull_barrier=cfg.pull_barrier,
                        penalty=PenaltyConfig(alpha=pen.alpha, beta=pen.beta, warmup=pen.warmup,
                                              enabled=pen.enabled))
    ledger = ChunkLedger(cfg.data.num_chunks, spec["windows_per_chunk"])
    leader = Leader(lcfg, lambda e: FollowerControlClient(e.control_endpoint, secret,
                                                          cfg.timeouts.rpc_s),
                    run_dir, ledger=ledger)

    def entry(info: Any) -> FollowerEntry:
        return FollowerEntry(info.index, info.data_endpoint, info.control_endpoint,
                             list(info.layers), list(info.layer_bytes), info.incarnation)

    server = make_server(secret, max_workers=8 + 4 * len(cfg.clusters))
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, entry), server)
    # A fixed port (chosen by the launcher) so a restarted leader is found at the same address.
    addr = spec["leader_addr"]
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

    from dips.config import RunConfig
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
    stop = _stop_event()
    spec, secret = read_spec(run_dir)
    cfg = RunConfig.model_validate(spec["config"])
    table = {layer: names for layer, names, _ in spec["layers"]}
    sizes = {layer: nbytes for layer, _, nbytes in spec["layers"]}
    owned = spec["follower_layers"][index]
    layers = {l: table[l] for l in owned}
    names = [n for ns in layers.values() for n in ns]
    ckpt_dir = run_dir / "followers" / str(index) / "checkpoints"
    saved = complete_versions(ckpt_dir)
    momenta, version = None, 0
    if saved:  # a restart: resume from the newest complete checkpoint (§12)
        params, momenta, _ = load_checkpoint(ckpt_dir, saved[-1], names)
        version = saved[-1]
    else:
        with safe_open(str(run_dir / spec["init"]), framework="pt") as f:
            params = {n: f.get_tensor(n).float() for n in names}
    shard = FollowerShard(index, layers, params, cfg.outer.lr, cfg.outer.momentum,
                          log_dir=run_dir / "followers" / str(index), version=version,
                          momenta=momenta, ckpt_dir=ckpt_dir, keep=cfg.checkpoint_keep)
    # Fixed ports (chosen by the launcher): a restarted follower keeps its addresses (§12).
    data_port, control_port = spec["follower_ports"][index]
    host = spec.get("bind_host", "127.0.0.1")
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
        info = pb.FollowerInfo(index=index, data_endpoint=data.endpoint,
                               control_endpoint=f"{host}:{port}", layers=owned,
                               layer_bytes=[sizes[l] for l in owned], version=shard.version,
                               incarnation=incarnation)
        try:
            leader.RegisterFollower(info, timeout=max(1.0, cfg.heartbeat_interval_s))
        except grpc.RpcError as exc:
            log.debug("heartbeat to leader failed: %s", exc.code().name)
        stop.wait(cfg.heartbeat_interval_s)
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

    Writes ``RUN_DIR/clusters/<id>/train.jsonl`` (one line per inner step; push outcomes on
    the steps that synced). Stops at SIGTERM, after the current inner step or sync.
    """
    from dips.config import RunConfig
    from dips.emu.pacing import Pacer
    from dips.roles.client import ClusterClient
    from dips.train.corpus import load_tokens
    from dips.train.lease import LeaseSampler, NoData
    from dips.train.sampler import make_chunks
    from dips.train.loop import inner_step, make_inner_optimizer
    from dips.train.model import build_model

    import torch

    _setup_logging(run_dir, f"cluster-{cluster_id}")
    torch.set_num_threads(1)
    stop = _stop_event()
    spec, secret = read_spec(run_dir)
    cfg = RunConfig.model_validate(spec["config"])
    me = next(c for c in cfg.clusters if c.id == cluster_id)
    data = load_tokens(Path(spec["cache_dir"]), cfg.data.vocab_size, cfg.data.val_fraction,
                       cfg.data.max_train_tokens)
    chunks = make_chunks(len(data.train), cfg.data.num_chunks)
    sampler = LeaseSampler(data.train, chunks, cfg.inner.seq_len, cfg.inner.batch_size,
                           seed=cfg.seed, ahead=cfg.lease_ahead)
    model = build_model(cfg.model, cfg.seed)
    opt = make_inner_optimizer(model, cfg.inner.lr, cfg.inner.weight_decay)
    bucket = None
    # Application-level link shaping on loopback; in network namespaces the kernel's tbf
    # shapes the link (and the launcher follows link_schedule), so no second limit here.
    if me.link_bps is not None and cfg.network == "loopback":
        from dips.emu.link_schedule import ScheduledBucket

        bucket = ScheduledBucket(me)
    client = ClusterClient(model, _wait_leader(run_dir, stop, cfg.timeouts.startup_s), cluster_id,
                           secret, H=cfg.inner.H, stages=me.stages, timeout_s=cfg.timeouts.push_s,
                           admit_timeout_s=cfg.timeouts.admit_s,
                           heartbeat_interval_s=cfg.heartbeat_interval_s, data=sampler,
                           limiter=bucket.consume if bucket is not None else None)
    deadline = time.monotonic() + cfg.timeouts.startup_s
    while True:  # the leader may be restarting or waiting for followers: retry the join
        try:
            client.join()
            break
        except (grpc.RpcError, RuntimeError) as exc:
            if stop.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"cluster {cluster_id}: join failed: {exc}") from None
            stop.wait(1.0)
    # Injected delay per inner step (§13): proportional to the measured step, or padding to a
    # calibrated step_s; transient slowdowns are timed from the launcher's training start.
    pacer = Pacer(me.slowdown, cfg.step_s, me.transient)
    start_file = run_dir / "train_start"
    t_start = float(start_file.read_text()) if start_file.exists() else time.time()
    if bucket is not None:
        bucket.start(t_start)  # link_schedule times count from the training start
    out_dir = run_dir / "clusters" / cluster_id
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("cluster %s joined at version %d, stages %s", cluster_id, client.version,
             client.stage_layers)
    with open(out_dir / "train.jsonl", "a", buffering=1) as out:
        out.write(json.dumps({"event": "join", "version": client.version,
                             "stages": client.stage_layers, "time": time.time()}) + "\n")
        while not stop.is_set():
            try:
                batch = sampler.next_batch()
            except NoData:  # every leased window trained: lease more (the leader may be down)
                client.maintain()
                if sampler.available() < sampler.batch_size:
                    stop.wait(0.5)
                continue
            t0 = time.monotonic()
            loss = inner_step(model, opt, batch, cfg.inner.grad_clip)
            compute_s = time.monotonic() - t0
            stop.wait(pacer.delay(compute_s, time.time() - t_start))
            res = client.step_done(sampler.tokens_per_batch, loss)
            rec: dict[str, Any] = {"step": client.inner_step, "loss": round(loss, 5),
                                   "tokens": client.tokens_total, "compute_s": round(compute_s, 4),
                                   "time": time.time()}
            if res is not None:
                rec["push"] = {"accepted": res.accepted, "ok": res.ok, "version": res.version,
                               "round": res.round, "tokens": res.tokens, "score": res.score,
                               "reason": res.reason, "push_s": round(res.push_s, 4),
                               "wait_s": round(res.wait_s, 4), "pull_s": round(res.pull_s, 4)}
            out.write(json.dumps(rec) + "\n")
    log.info("cluster %s: %d paced steps overran step_s", cluster_id, pacer.overruns)
    client.close()
