"""One rank of a cluster launched as a torchrun job: DDP replicas, FSDP2 shards or pipeline
stages (issue 14; §3, §5, §12).

``torchrun --nproc-per-node N -m dips.cluster --leader HOST:PORT --cluster-id ID ...`` (or
``dips cluster`` under torchrun) runs this on every rank when ``WORLD_SIZE > 1``:

1. ``init_process_group`` (torchrun's ``env://`` rendezvous on a store of this torchrun attempt
   alone, :mod:`dips.node.attempt`; ``cpu:gloo,cuda:nccl`` when CUDA is available, else gloo),
   bounded by ``BOOT_TIMEOUT_S``; the rank's device is
   ``cuda:LOCAL_RANK`` or ``cpu`` (``--device``, else the cluster config's ``device``, else
   cuda when available);
2. rank 0 checks its certificate, locks ``--state-dir``, fetches the run spec from the leader
   and broadcasts it (JSON); every rank builds the same model and its token data (local
   rank 0 first: it fills the node's cache);
3. the ranks split the layers into blocks balanced by bytes (:func:`dips.roles.cluster_ranks.
   rank_blocks`), wrap their replica in DDP (``parallel: ddp``) or shard it with
   ``fully_shard`` per decoder block (``parallel: fsdp2``) and train (:mod:`dips.train.ddp`);
   or (``parallel: pipeline``) rank r runs pipeline stage r and owns its layers
   (:mod:`dips.train.pipeline`);
   rank 0 joins, heartbeats and syncs for the cluster, every rank pushes and pulls its own
   block;
4. when the run finishes (or on SIGTERM/SIGINT on any rank) every rank leaves the loop at the
   same step and exits 0. Any failure (a rank killed, a collective timed out) exits non-zero;
   torchrun (``--max-restarts``: the ranks restart in place) or the operator restarts the
   cluster, which re-joins as the same cluster id and resumes its inner state.

Only rank 0 writes ``train.jsonl`` (the cluster's records; sync steps carry each rank's
pushed layers and the replicas' checksums) and serves metrics.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from dips.node.attempt import init_attempt_group
from dips.node.common import RoleError, StateDir, Stopped, fetch_spec, run_data
from dips.node.startup_exit import StartupExit
from dips.wire.pki import Identity
from dips.wire.security import Credentials

log = logging.getLogger(__name__)

#: Exit status of a rank whose cluster broke after it started (another rank lost).
EXIT_RANK_LOST = 1
#: Collective timeout while the ranks start (spec fetch, data preparation), seconds.
BOOT_TIMEOUT_S = 1800.0


def world_size() -> int:
    """torchrun's WORLD_SIZE (1 when unset)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


#: How often a rank checks that its torchrun agent is alive, seconds.
AGENT_POLL_S = 1.0


def exit_with_agent(poll_s: float = AGENT_POLL_S) -> threading.Thread:
    """Exit this rank (``os._exit(1)``, after an error log line) once the process that started
    it is gone: torchrun starts each rank in a session of its own, so a kill -9 of the agent
    (an OOM kill, a scheduler that stops only the launcher) would leave the ranks training
    and pushing as the cluster, a cluster nobody can restart (its state directory stays
    locked). Polls ``os.getppid()`` (reparented once the parent dies) every ``poll_s``
    seconds in a daemon thread, which it returns."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.error("the torchrun agent (pid %d) is gone: this rank (pid %d) exits", parent,
                  os.getpid())
        logging.shutdown()
        os._exit(1)

    t = threading.Thread(target=watch, name="agent-watch", daemon=True)
    t.start()
    return t


def run_cluster_ranks(leader_addr: str, cluster_id: str, state: Path, creds: Credentials | None,
                      stop: threading.Event, *, cache_dir: Path | None = None,
                      metrics_port: int | None = None, metrics_host: str = "0.0.0.0",
                      device: str | None = None) -> int:
    """Run this rank of cluster ``cluster_id`` (module docstring); returns the exit code.

    ``creds``: rank 0's credentials (other ranks never talk to the leader; may be None).
    Raises RoleError (rank 0: wrong certificate, no spec; others: rank 0 could not start),
    Stopped, or what training raises (RuntimeError when a peer rank fails).
    """
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    exit_with_agent()
    # Until the ranks train, SIGTERM ends this rank at once, even inside a C++ wait for a
    # peer that died (review 32): the stop event takes over once the ranks stop together.
    startup = StartupExit(f"cluster {cluster_id}, rank {rank}", stop).start()
    cuda = torch.cuda.is_available()
    if cuda and local < torch.cuda.device_count():  # issue 14 (device): the rank's GPU; the
        torch.cuda.set_device(local)  # device itself (cuda or cpu) is chosen after the spec
    # NCCL for CUDA tensors, gloo for host ones: the cluster's device (--device, else the
    # cluster config's) is known only once the spec is fetched.
    # On a store of this torchrun attempt alone: --max-restarts restarts the ranks in place.
    attempt = init_attempt_group("cpu:gloo,cuda:nccl" if cuda else "gloo", BOOT_TIMEOUT_S)
    if attempt and rank == 0:  # one line per restart, not one per rank
        log.info("cluster %s: rank %d: torchrun restart %d (of at most %s)", cluster_id, rank,
                 attempt, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))
    try:
        return _run(rank, world, local, device, leader_addr, cluster_id, state, creds, stop,
                    cache_dir, metrics_port, metrics_host, startup)
    finally:
        startup.done()
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group (a peer died): the process exits anyway
            pass


def collective_timeout(configured_s: float, timeouts: Any) -> float:
    """The control group's timeout (seconds): ``configured_s`` (the cluster's
    ``collective_timeout_s``), raised to the longest rank 0 may talk to the leader alone while
    the other ranks wait: a join (``timeouts.startup_s``) or a verdict (the leader's push
    timeout plus the cluster's own, both ``timeouts.push_s``), plus 60 s."""
    return max(configured_s, timeouts.startup_s + 60.0, 2 * timeouts.push_s + 60.0)


def _no_buffer_sync(ddp: Any) -> dict[str, bool]:
    """DDP's option not to broadcast buffers every forward (the models' buffers are constants
    built alike on every rank): ``forward_sync_buffers`` where torch has it, else the older
    ``broadcast_buffers``."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _spec(ranks: Any, leader_addr: str, cluster_id: str, state: Path | None,
          creds: Credentials | None, stop: threading.Event) -> Any:
    """Rank 0 locks ``state`` (unless None), fetches the run spec and broadcasts it (or why
    it cannot start) with its ``cluster_id``. Every rank runs the same command: a rank
    started with another ``--cluster-id`` than rank 0 raises RoleError naming both (it would
    take another cluster's settings: parallel mode, device, link)."""
    from dips.spec import RunSpec

    if not ranks.lead:
        msg = ranks.broadcast(None)
        if "stopped" in msg:
            raise Stopped(msg["stopped"])
        if "error" in msg:
            raise RoleError(f"rank 0 could not start: {msg['error']}")
        if msg.get("cluster_id") != cluster_id:
            raise RoleError(f"rank {ranks.rank} was started with --cluster-id {cluster_id!r}, "
                            f"rank 0 with {msg.get('cluster_id')!r}: every rank of a torchrun "
                            "cluster runs the same command")
        return RunSpec.model_validate_json(msg["spec"])
    try:
        if creds is None or creds.identity != Identity.cluster(cluster_id):
            raise RoleError(f"--cluster-id {cluster_id!r}, but the certificate is "
                            f"{creds.identity.name if creds else None!r}")
        if state is not None:
            StateDir(state).acquire()
        spec, _ = fetch_spec(leader_addr, creds, stop, 180.0)
    except Stopped as exc:
        ranks.broadcast({"stopped": str(exc)})
        raise
    except BaseException as exc:
        ranks.broadcast({"error": str(exc)})
        raise
    ranks.broadcast({"spec": spec.model_dump_json(), "cluster_id": cluster_id})
    return spec


def _run(rank: int, world: int, local: int, wanted: str | None, leader_addr: str, cluster_id: str,
         state: Path, creds: Credentials | None, stop: threading.Event,
         cache_dir: Path | None, metrics_port: int | None, metrics_host: str,
         startup: StartupExit) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dips.roles.cluster_ranks import RankWorker, rank_blocks
    from dips.roles.layers import group_layers
    from dips.roles.rank_comm import Ranks
    from dips.spec import ClusterConfig
    from dips.train.ddp import RankSampler, RankTrainer
    from dips.train.loop import make_inner_optimizer
    from dips.train.model import layer_namer
    from dips.train.trainer import build_trainer, resolve_device

    boot = Ranks.control_group(rank, world, BOOT_TIMEOUT_S, torch.device("cpu"))
    spec = _spec(boot, leader_addr, cluster_id, state, creds, stop)
    cfg = spec.config
    listed = [c for c in cfg.clusters if c.id == cluster_id]
    me = listed[0] if listed else ClusterConfig(id=cluster_id)
    device = resolve_device(wanted or me.device, local)  # issue 14 (device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    cache = (cache_dir or cfg.data.cache_dir).resolve()
    if local != 0:
        dist.barrier(group=boot.control)  # local rank 0 fills this node's cache first
    base = build_trainer(cluster_id, cfg.model, cfg.data, cfg.inner, cfg.seed, cache_dir=cache,
                         tokens=run_data(spec, cache, f"cluster {cluster_id}, rank {rank}"))
    if local == 0:
        dist.barrier(group=boot.control)
    fingerprint = ""
    if rank == 0:
        from dips.train.datasource import load_vocab
        from dips.train.model import fingerprint_of

        fingerprint = fingerprint_of(base.model, load_vocab(cfg.data, cache)).to_json()
    timeout_s = collective_timeout(me.collective_timeout_s, cfg.timeouts)
    ranks = Ranks.control_group(rank, world, timeout_s, device)
    model = base.model.to(device)
    layer_of = layer_namer(model, cfg.model.layer_pattern)
    if me.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from dips.roles.layers import blocks_prefix

        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))  # the cluster's device, not the default
        for block in model.get_submodule(blocks_prefix(model)):
            fully_shard(block, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)  # parameters become DTensors sharded over the ranks
    elif me.parallel == "ddp":
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                      else None, **_no_buffer_sync(DistributedDataParallel))
    layers = group_layers(model, layer_of)
    if me.parallel == "pipeline":  # rank r is stage r and the stage worker of its layers
        from dips.train.pipeline import pipeline_trainer

        trainer, blocks = pipeline_trainer(cluster_id, model, layers, base.batches, cfg.inner,
                                           ranks, me.microbatches)
        sampler = trainer.batches
    else:
        blocks = rank_blocks([sum(p.numel() * 4 for _, p in ps) for _, ps in layers], world)
        sampler = RankSampler(base.batches, rank, world)  # type: ignore[arg-type]
        trainer = RankTrainer(cluster_id, model, ddp, make_inner_optimizer(
            model, cfg.inner.lr, cfg.inner.weight_decay), sampler, cfg.inner.grad_clip, ranks)
    bucket = None
    if me.link is not None and cfg.network == "loopback":
        from dips.emu.link_schedule import ScheduledBucket

        bucket = ScheduledBucket(me)  # emulation: each stage rank's upload shaped alone
    worker = RankWorker(ranks, layers, blocks, bucket.consume if bucket else None,
                        cfg.outer.wire_dtype, stop)
    log.info("cluster %s: rank %d of %d (local rank %d, pid %d) on %s owns layers %s",
             cluster_id, rank, world, local, os.getpid(), device, sorted(worker.mine))
    startup.done()  # from here every rank is past its waits for the others: stop together
    try:
        return _train(cfg, me, trainer, ranks, worker, sampler, leader_addr, cluster_id,
                      creds, state, stop, fingerprint, bucket, layer_of, metrics_port,
                      metrics_host)
    finally:
        worker.close()


def _train(cfg: Any, me: Any, trainer: Any, ranks: Any, worker: Any, sampler: Any,
           leader_addr: str, cluster_id: str, creds: Credentials | None, state: Path,
           stop: threading.Event, fingerprint: str, bucket: Any, layer_of: Any,
           metrics_port: int | None, metrics_host: str) -> int:
    from dips.emu.pacing import Pacer
    from dips.roles.cluster_ranks import RankLeadClient
    from dips.train.ddp import NullLog, RankSync
    from dips.train.dips_sync import DiPSSync
    from dips.train.run import TrainLog, run_loop

    client = observed = metrics = None
    if ranks.lead:
        client = RankLeadClient(
            trainer.model, leader_addr, cluster_id, creds, worker=worker, H=cfg.inner.H,
            stages=len(worker.blocks), timeout_s=cfg.timeouts.push_s, layer_of=layer_of,
            admit_timeout_s=cfg.timeouts.admit_s,
            heartbeat_interval_s=cfg.membership.heartbeat_interval_s, data=sampler,
            limiter=bucket.consume if bucket is not None else None, stop=stop,
            fingerprint=fingerprint, wire_dtype=cfg.outer.wire_dtype,
            hold_after=cfg.inner.hold_after)
        assert client.stage_layers == [[k for k, _ in b] for b in worker.blocks]
        if metrics_port is not None:
            from prometheus_client import CollectorRegistry

            from dips.node.metrics import serve_metrics
            from dips.node.metrics_members import ClusterMetrics

            observed = ClusterMetrics(CollectorRegistry())
            observed.attach(client)
            metrics = serve_metrics(observed.registry, metrics_port, metrics_host, state)
    sync: Any = RankSync(ranks, worker, sampler, DiPSSync(client) if client is not None else None)
    if me.inner_checkpoint:  # issue 14: the inner AdamW state across restarts (every rank)
        from dips.roles.cluster_state import InnerStateStore
        from dips.train.dips_sync import InnerStateSync

        sync = InnerStateSync(sync, InnerStateStore(
            state / "inner", cluster_id, trainer.model, trainer.optimizer, me.parallel,
            ranks), trainer)
    try:
        if not sync.join(stop, cfg.timeouts.startup_s):
            log.info("cluster %s: nothing to do (the run finished or stopping)", cluster_id)
            if client is not None:
                client.close(leave=False)
            return 0
        pacer = Pacer(me.slowdown, cfg.step_s, me.transient_tuples())
        start_file = os.environ.get("DIPS_TRAIN_START")
        t_start = (float(Path(start_file).read_text()) if start_file and Path(start_file).exists()
                   else time.time())
        if bucket is not None:
            bucket.start(t_start)
        out: Any = NullLog()
        if client is not None:
            log.info("cluster %s joined at version %d, %d ranks, stages %s", cluster_id,
                     client.version, ranks.world, client.stage_layers)
            out = TrainLog(state / "train.jsonl", stamp=time.time, delay=False,
                           observer=observed.observe if observed is not None else None)
            out.write({"event": "join", "cluster": cluster_id, "version": client.version,
                       "ranks": ranks.world, "stages": client.stage_layers,
                       "replicas": {"version": client.version, "checksums": worker.checksums}})
            if getattr(sync, "resumed", None) is not None:
                out.write(sync.resumed)  # issue 14: the inner state resumed
        watch = None
        if ranks.lead and ranks.world > 1:  # a hung or stopped rank ends the cluster
            from dips.node.stepwatch import StepWatch

            watch = StepWatch(factor=me.stall_factor, floor_s=me.stall_floor_s,
                              first_s=collective_timeout(me.collective_timeout_s, cfg.timeouts))
            trainer.step = watch.wrap(trainer.step)  # type: ignore[method-assign]
            # A rank stopped while it paces or logs holds rank 0 in these instead (review 24).
            sync.before_step = watch.wrap(sync.before_step, "the ranks' agreement before an "
                                          "inner step", record=False)
            client.end = watch.wrap(client.end, "the end of an inner step's commands",
                                    record=False)
        try:
            run_loop(trainer, sync, stop, pacer, out, clock=lambda: time.time() - t_start)
        except RuntimeError as exc:  # a rank lost mid-run (a broken collective): exit 1, not
            # the 2 of a cluster that could not start (review 24, F4)
            log.error("cluster %s: rank %d: %s: the cluster stops; restart it to re-join",
                      cluster_id, ranks.rank, exc)
            return EXIT_RANK_LOST
        finally:
            out.close()
            if watch is not None:
                watch.close()
        if client is not None:
            log.info("cluster %s: %s: stopping after %d inner steps", cluster_id,
                     client.finished or "stopped", client.inner_step)
            client.close()
            client = None
        return 0
    finally:
        if client is not None:  # failed: stop heartbeating, keep the membership to re-join
            client.close(leave=False)
        if metrics is not None:
            metrics.close()
