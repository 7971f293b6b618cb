"""``dips cluster``: one cluster's built-in training loop (§3, §5), at its own site.

It asks the leader for the run spec, builds the model and its data from it (the tokenizer
and token stream from the bundled corpora, cached in ``--cache-dir``), joins with its model's
fingerprint (a model that differs from the run's is refused at join, naming the fields), and
trains: inner AdamW steps, a push every H steps, the verdict, the pull, until the leader says
the run finished (its token budget, outer-step or time limit; exit 0). The model and the
inner step run on the cluster's device (``--device`` or ``ClusterConfig.device``; default
cuda when available). Its state directory holds ``train.jsonl`` (a ``join`` record, a
``resume`` record when it resumed a saved inner state, then one line per inner step, and a
``join`` record with ``rejoin`` at each later join of the process: :func:`record_joins`) and
``inner/``: the inner AdamW state and data position after the last pull
(:mod:`dips.roles.cluster_state`; ``inner_checkpoint: false`` turns it off). A user's own
training loop uses :class:`dips.roles.client.ClusterClient` with the same arguments.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from dips.algo.refusal import Refusal, Refused
from dips.node.common import RoleError, StateDir, fetch_spec, run_data
from dips.wire.pki import Identity
from dips.wire.security import Credentials

log = logging.getLogger(__name__)


def run_cluster(leader_addr: str, cluster_id: str, state: Path, creds: Credentials | None,
                stop: threading.Event, *, cache_dir: Path | None = None,
                stages: int | None = None, metrics_port: int | None = None,
                metrics_host: str = "0.0.0.0", device: str | None = None) -> int:
    """Train cluster ``cluster_id`` until ``stop``; returns the exit code. ``metrics_port``:
    serve Prometheus metrics there (:mod:`dips.node.metrics_members`; 0: a free port, logged;
    None: none). ``device``: cpu, cuda or cuda:N (None: the cluster config's). Raises
    RoleError if it cannot start, ValueError for a device that is not available, and
    InnerStateError (a ValueError) for a saved inner state it must not resume.

    Under torchrun with ``WORLD_SIZE > 1`` this process is one rank of a DDP cluster
    (:func:`dips.node.cluster_ddp.run_cluster_ranks`; its ranks are the stage workers, so
    ``stages`` is ignored; ``creds`` may be None on ranks other than 0)."""
    from dips.node.cluster_ddp import run_cluster_ranks, world_size
    from dips.train.trainer import resolve_device

    if device is not None:  # a device that cannot be used: refused before the leader is asked
        resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")) if world_size() > 1
                       else None)
    if world_size() > 1:
        if stages is not None:
            log.info("cluster %s: --stages ignored: each rank is a stage worker", cluster_id)
        return run_cluster_ranks(leader_addr, cluster_id, state, creds, stop,
                                 cache_dir=cache_dir, metrics_port=metrics_port,
                                 metrics_host=metrics_host, device=device)
    if creds is None:
        raise RoleError("a cluster of one process needs its credentials")
    import torch

    from dips.roles.client import ClusterClient
    from dips.spec import ClusterConfig
    from dips.train.datasource import load_vocab
    from dips.train.model import fingerprint_of, layer_namer
    from dips.train.trainer import build_trainer

    if creds.identity != Identity.cluster(cluster_id):
        raise RoleError(f"--cluster-id {cluster_id!r}, but the certificate is "
                        f"{creds.identity.name!r}")
    StateDir(state).acquire()
    spec, _ = fetch_spec(leader_addr, creds, stop, 180.0)
    cfg = spec.config
    listed = [c for c in cfg.clusters if c.id == cluster_id]
    me = listed[0] if listed else ClusterConfig(id=cluster_id)  # added later (dips init --add-cluster)
    if stages is not None:
        me = me.model_copy(update={"stages": stages})
    where = resolve_device(device or me.device)
    if where.type == "cpu":
        torch.set_num_threads(1)  # many emulated clusters share one host's cores
    else:
        torch.cuda.set_device(where)
    cache = (cache_dir or cfg.data.cache_dir).resolve()
    trainer = build_trainer(cluster_id, cfg.model, cfg.data, cfg.inner, cfg.seed, cache_dir=cache,
                            device=where, tokens=run_data(spec, cache, f"cluster {cluster_id}"))
    log.info("cluster %s: model and inner steps on %s", cluster_id, where)
    fingerprint = fingerprint_of(trainer.model, load_vocab(cfg.data, cache))
    bucket = None
    # Application-level link shaping on loopback (emulation); in network namespaces the
    # kernel's tbf shapes the link, so no second limit here.
    if me.link is not None and cfg.network == "loopback":
        from dips.emu.link_schedule import ScheduledBucket

        bucket = ScheduledBucket(me)
    client = ClusterClient(trainer.model, leader_addr, cluster_id, creds, H=cfg.inner.H,
                           stages=me.stages, timeout_s=cfg.timeouts.push_s,
                           layer_of=layer_namer(trainer.model, cfg.model.layer_pattern),
                           admit_timeout_s=cfg.timeouts.admit_s,
                           heartbeat_interval_s=cfg.membership.heartbeat_interval_s,
                           data=trainer.batches,
                           limiter=bucket.consume if bucket is not None else None, stop=stop,
                           fingerprint=fingerprint.to_json(), wire_dtype=cfg.outer.wire_dtype,
                           hold_after=cfg.inner.hold_after)
    observed = metrics = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from dips.node.metrics import serve_metrics
        from dips.node.metrics_members import ClusterMetrics

        observed = ClusterMetrics(CollectorRegistry())
        observed.attach(client)
        try:
            metrics = serve_metrics(observed.registry, metrics_port, metrics_host, state)
        except RoleError:
            client.close(leave=False)
            raise
    try:
        return _train(cluster_id, cfg, me, trainer, client, bucket, state, stop, observed)
    finally:
        if metrics is not None:
            metrics.close()


def join_record(cluster_id: str, client: Any, rejoin: bool = False) -> dict[str, Any]:
    """The ``train.jsonl`` record of a join of ``client`` (a :class:`dips.roles.client.
    ClusterClient` just joined): ``cluster``, ``version`` pulled, ``stages`` (layer keys per
    stage worker); ``rejoin: true`` for a later join of the same process, whose counts go
    on (:mod:`dips.algo.consumed`: no new process)."""
    rec: dict[str, Any] = {"event": "join", "cluster": cluster_id, "version": client.version,
                           "stages": client.stage_layers}
    if rejoin:
        rec["rejoin"] = True
    return rec


def record_joins(out: Any, cluster_id: str, client: Any) -> None:
    """Write the ``join`` record of ``client``'s join just made into ``out`` (a
    :class:`dips.train.run.TrainLog`), and one of every later join of this process (removed
    for missed heartbeats while stopped, the leader restarted without it: ``rejoin``), so
    that ``dips report`` shows the cluster back there (review 33 of issue 15: a re-join in
    the same process was in no figure)."""
    out.write(join_record(cluster_id, client))
    client.on_rejoin = lambda _version: out.write(join_record(cluster_id, client, rejoin=True))


def _train(cluster_id: str, cfg: Any, me: Any, trainer: Any, client: Any, bucket: Any,
           state: Path, stop: threading.Event, observed: Any) -> int:
    """Join, train until the run ends or ``stop`` (``train.jsonl`` fed to ``observed``, the
    ClusterMetrics or None), close the client; returns the exit code."""
    from dips.emu.pacing import Pacer
    from dips.roles.cluster_state import InnerStateStore
    from dips.train.dips_sync import DiPSSync, InnerStateSync
    from dips.train.run import TrainLog, run_loop

    sync: Any = DiPSSync(client)
    if me.inner_checkpoint:
        sync = InnerStateSync(sync, InnerStateStore(state / "inner", cluster_id, trainer.model,
                                                    trainer.optimizer), trainer)
    # The leader may be restarting or waiting for followers: the join is retried.
    try:
        sync.join(stop, cfg.timeouts.startup_s)
    except Refused as exc:
        if exc.code is not Refusal.RUN_FINISHED:
            raise
        log.info("cluster %s: nothing to do: %s", cluster_id, exc.message)
        client.close(leave=False)
        return 0
    except RuntimeError:
        if stop.is_set():  # asked to stop while waiting to join: a clean stop
            client.close()
            return 0
        raise
    except ValueError:  # a saved inner state refused: nothing was asked of the leader
        client.close(leave=False)
        raise
    # Injected delay per inner step (§13 emulation): transient slowdowns are timed from the
    # launcher's training start when it publishes one (DIPS_TRAIN_START, one machine only).
    pacer = Pacer(me.slowdown, cfg.step_s, me.transient_tuples())
    start_file = os.environ.get("DIPS_TRAIN_START")
    t_start = (float(Path(start_file).read_text()) if start_file and Path(start_file).exists()
               else time.time())
    if bucket is not None:
        bucket.start(t_start)  # link.schedule times count from the training start
    log.info("cluster %s joined at version %d, stages %s", cluster_id, client.version,
             client.stage_layers)
    out = TrainLog(state / "train.jsonl", stamp=time.time, delay=False,
                   observer=observed.observe if observed is not None else None)
    record_joins(out, cluster_id, client)
    if getattr(sync, "resumed", None) is not None:
        out.write(sync.resumed)
    try:
        run_loop(trainer, sync, stop, pacer, out, clock=lambda: time.time() - t_start)
    except BaseException:
        # The trainer failed (e.g. a NaN loss): stop heartbeating and exit non-zero, so the
        # orchestrator sees the failure and restarts the cluster (found by a review: the
        # process stayed alive and idle while its heartbeats kept it a member).
        client.close(leave=False)
        raise
    finally:
        out.close()
    if cfg.step_s is not None:
        log.info("cluster %s: %d paced steps overran step_s", cluster_id, pacer.overruns)
    if client.finished:
        log.info("cluster %s: %s: stopping after %d inner steps", cluster_id, client.finished,
                 client.inner_step)
    client.close()
    return 0
