"""Entry points of the processes that ``dips launch`` starts on one machine (§5 of the seed).

Each reads ``RUN_DIR/run.json`` (written by the launcher: config, layer table, follower
ownership) and ``RUN_DIR/secret``; binds its sockets to free ports on 127.0.0.1 and
publishes them (the leader writes ``leader.addr``; followers register with the leader).
SIGTERM or SIGINT stops a process cleanly; every wait has a timeout.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import grpc
import torch

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
                        penalty=PenaltyConfig(alpha=pen.alpha, beta=pen.beta, warmup=pen.warmup,
                                              enabled=pen.enabled))
    leader = Leader(lcfg, lambda e: FollowerControlClient(e.control_endpoint, secret,
                                                          cfg.timeouts.rpc_s), run_dir)

    def entry(info: Any) -> FollowerEntry:
        return FollowerEntry(info.index, info.data_endpoint, info.control_endpoint,
                             list(info.layers), list(info.layer_bytes))

    server = make_server(secret, max_workers=8 + 4 * len(cfg.clusters))
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, entry), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    leader.start()
    tmp = run_dir / "leader.addr.tmp"
    tmp.write_text(f"127.0.0.1:{port}")
    tmp.replace(run_dir / "leader.addr")
    log.info("leader serving on 127.0.0.1:%d", port)
    stop.wait()
    leader.stop()
    server.stop(grace=2.0).wait(5.0)


def run_follower(run_dir: Path, index: int) -> None:
    """Serve follower ``index`` (its shard loaded from the run's initial checkpoint)."""
    from safetensors import safe_open

    from dips.config import RunConfig
    from dips.roles.follower import FollowerShard
    from dips.wire.control import make_server
    from dips.wire.dataplane import DataServer
    from dips.wire.pb import control_pb2 as pb
    from dips.wire.pb import control_pb2_grpc as pbg
    from dips.wire.services import FollowerServicer, leader_client

    _setup_logging(run_dir, f"follower-{index}")
    torch.set_num_threads(1)
    stop = _stop_event()
    spec, secret = read_spec(run_dir)
    cfg = RunConfig.model_validate(spec["config"])
    table = {layer: names for layer, names, _ in spec["layers"]}
    sizes = {layer: nbytes for layer, _, nbytes in spec["layers"]}
    owned = spec["follower_layers"][index]
    layers = {l: table[l] for l in owned}
    with safe_open(str(run_dir / spec["init"]), framework="pt") as f:
        params = {n: f.get_tensor(n).float() for names in layers.values() for n in names}
    shard = FollowerShard(index, layers, params, cfg.outer.lr, cfg.outer.momentum,
                          log_dir=run_dir / "followers" / str(index))
    data = DataServer(bytes.fromhex(secret), shard.handle).start()
    server = make_server(secret, max_workers=8)
    pbg.add_FollowerServicer_to_server(FollowerServicer(shard), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    leader = leader_client(_wait_leader(run_dir, stop, cfg.timeouts.startup_s), secret)
    info = pb.FollowerInfo(index=index, data_endpoint=data.endpoint,
                           control_endpoint=f"127.0.0.1:{port}", layers=owned,
                           layer_bytes=[sizes[l] for l in owned], version=shard.version)
    deadline = time.monotonic() + cfg.timeouts.startup_s
    while not stop.is_set():
        try:
            leader.RegisterFollower(info, timeout=5.0)
            break
        except grpc.RpcError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"follower {index}: leader unreachable: {exc.details()}") from None
            time.sleep(0.5)
    log.info("follower %d serving layers %s (data %s)", index, owned, data.endpoint)
    stop.wait()
    server.stop(grace=2.0).wait(5.0)
    data.stop()
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
    from dips.emu.slowdown import Slowdown
    from dips.roles.cluster import ClusterClient
    from dips.train.corpus import load_tokens
    from dips.train.sampler import BatchSampler, assign_chunks, make_chunks
    from dips.train.loop import inner_step, make_inner_optimizer
    from dips.train.model import build_model

    _setup_logging(run_dir, f"cluster-{cluster_id}")
    torch.set_num_threads(1)
    stop = _stop_event()
    spec, secret = read_spec(run_dir)
    cfg = RunConfig.model_validate(spec["config"])
    me = next(c for c in cfg.clusters if c.id == cluster_id)
    data = load_tokens(Path(spec["cache_dir"]), cfg.data.vocab_size, cfg.data.val_fraction,
                       cfg.data.max_train_tokens)
    chunks = make_chunks(len(data.train), cfg.data.num_chunks)
    mine = assign_chunks(cfg.data.num_chunks, [c.id for c in cfg.clusters])[cluster_id]
    sampler = BatchSampler(data.train, chunks, mine, cfg.inner.batch_size, cfg.inner.seq_len,
                           seed=cfg.seed * 7919 + zlib.crc32(cluster_id.encode()))
    model = build_model(cfg.model, cfg.seed)
    opt = make_inner_optimizer(model, cfg.inner.lr, cfg.inner.weight_decay)
    client = ClusterClient(model, _wait_leader(run_dir, stop, cfg.timeouts.startup_s), cluster_id,
                           secret, H=cfg.inner.H, stages=me.stages, timeout_s=cfg.timeouts.rpc_s,
                           heartbeat_interval_s=cfg.heartbeat_interval_s)
    client.join()
    slow = Slowdown(me.slowdown)
    out_dir = run_dir / "clusters" / cluster_id
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("cluster %s joined at version %d, stages %s", cluster_id, client.version,
             client.stage_layers)
    with open(out_dir / "train.jsonl", "a", buffering=1) as out:
        out.write(json.dumps({"event": "join", "version": client.version,
                             "stages": client.stage_layers, "time": time.time()}) + "\n")
        while not stop.is_set():
            t0 = time.monotonic()
            loss = inner_step(model, opt, sampler.next_batch(), cfg.inner.grad_clip)
            compute_s = time.monotonic() - t0
            stop.wait(slow.delay(compute_s))
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
    client.close()
