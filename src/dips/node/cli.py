"""The role commands: ``dips leader``, ``dips follower``, ``dips cluster`` (one per host), and
the operator's ``dips export`` and ``dips evaluate`` (the periodic evaluator, issue 15).

Each takes its own ``--state-dir`` (nothing is shared between hosts), its TLS bundle from
``dips init`` (``--tls DIR``) or ``--insecure``, and bind (``--listen``) and advertised
(``--advertise``) addresses, as torchft's lighthouse and Flower's superlink/supernode do.
SIGTERM or SIGINT stops a process cleanly. Exit codes: 0 stopped, 2 could not start (the
message names the option or file), 3 a leader that stepped down for a leader of a higher term.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from dips.algo.refusal import Refused
from dips.node.common import LOG_FORMATS, RoleError, Stopped, credentials, setup_logging

TLS_HELP = "directory of this process's bundle from `dips init` (ca.crt, tls.crt, tls.key)"
INSECURE_HELP = "no TLS: plaintext, identities are claimed, not proven (trusted networks only)"

Tls = Annotated[Optional[Path], typer.Option("--tls", help=TLS_HELP)]
Insecure = Annotated[bool, typer.Option("--insecure", help=INSECURE_HELP)]
StateDirOpt = Annotated[Path, typer.Option("--state-dir", help="this process's own directory")]
LeaderAddr = Annotated[str, typer.Option("--leader", help="HOST:PORT of the leader")]
MetricsPort = Annotated[Optional[int], typer.Option(
    "--metrics-port", min=0, max=65535,
    help="serve Prometheus metrics on this port (0: a free port, logged; default: none)")]
MetricsHost = Annotated[str, typer.Option("--metrics-host",
                                          help="address the metrics endpoint binds")]
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", help="cpu, cuda or cuda:N for the model and inner steps (under torchrun: "
                     "cuda:LOCAL_RANK); default: the cluster config's device, else cuda when "
                     "available")]
LogFormat = Annotated[str, typer.Option(
    "--log-format", help="text, or json: one JSON object per line (time, level, logger, "
                         "message, extra fields)")]


#: The --log-format this process logs in (set by :func:`_logging`): a refused start is
#: written in it too, so a log shipper reading JSON lines sees the one line that matters.
_FORMAT = {"value": "text"}


def _fail(command: str, exc: Exception) -> None:
    """Exit 2 after one line on stderr naming the problem (a JSON object with
    ``--log-format json``: time, level, logger, process, message, exit_code)."""
    message = f"dips {command}: {exc}"
    if _FORMAT["value"] == "json":
        import json
        import time

        message = json.dumps({"time": round(time.time(), 6), "level": "ERROR", "logger": "dips",
                              "process": command, "message": message, "exit_code": 2},
                             ensure_ascii=False)
    print(message, file=sys.stderr, flush=True)
    raise typer.Exit(2)


def _run(command: str, start: Callable[[], int],
         errors: tuple[type[Exception], ...] = (RoleError, OSError)) -> None:
    """Exit with ``start()``'s code: 0 when stopped before it could start (:class:`Stopped`),
    2 naming the problem for one of ``errors``."""
    try:
        code = start()
    except Stopped:
        code = 0
    except errors as exc:
        _fail(command, exc)
    raise typer.Exit(code)


def _logging(name: str, fmt: str) -> None:
    """Set up logging as ``name`` in ``fmt`` (exit 2 naming --log-format if unknown)."""
    if fmt not in LOG_FORMATS:
        print(f"dips: --log-format {fmt!r} is not one of {', '.join(LOG_FORMATS)}",
              file=sys.stderr, flush=True)
        raise typer.Exit(2)
    setup_logging(name, fmt)
    _FORMAT["value"] = fmt


def leader(config: Annotated[Path, typer.Option("--config", exists=True, dir_okay=False,
                                                help="YAML run config")],
           listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to bind")],
           state_dir: StateDirOpt,
           advertise: Annotated[Optional[str], typer.Option(
               "--advertise", help="HOST:PORT members reach (default: --listen)")] = None,
           tls: Tls = None, insecure: Insecure = False,
           cache_dir: Annotated[Optional[Path], typer.Option(
               "--cache-dir", help="tokenizer/corpus cache (default: the config's)")] = None,
           status_socket: Annotated[Optional[Path], typer.Option(
               "--status-socket", help="also serve on this unix socket (a local operator)")] = None,
           metrics_port: MetricsPort = None, metrics_host: MetricsHost = "0.0.0.0",
           log_format: LogFormat = "text",
           ) -> None:
    """The leader (§5): membership, grace windows, verdicts, the version (metadata only)."""
    from dips.node.leader import run_leader
    from dips.spec import SpecError, load_config
    from dips.train.run import stop_on_signals
    from dips.wire.pki import Identity

    _logging("leader", log_format)
    stop = stop_on_signals()
    _run("leader", lambda: run_leader(
        load_config(config), listen, state_dir.resolve(),
        credentials(tls, insecure, Identity.leader()), stop, advertise=advertise,
        cache_dir=cache_dir, status_socket=status_socket,
        revoked_file=tls / "revoked.txt" if tls is not None else None,
        metrics_port=metrics_port, metrics_host=metrics_host), (RoleError, SpecError, OSError))


def follower(leader_addr: LeaderAddr,
             index: Annotated[int, typer.Option("--index", min=0, help="this follower's index")],
             listen: Annotated[str, typer.Option("--listen", help="HOST:PORT of the control "
                                                                 "service (gRPC)")],
             data_listen: Annotated[str, typer.Option("--data-listen",
                                                      help="HOST:PORT of the data plane (ZeroMQ)")],
             state_dir: StateDirOpt,
             advertise: Annotated[Optional[str], typer.Option(
                 "--advertise", help="HOST:PORT the leader reaches the control service at")] = None,
             data_advertise: Annotated[Optional[str], typer.Option(
                 "--data-advertise", help="HOST:PORT clusters reach the data plane at")] = None,
             tls: Tls = None, insecure: Insecure = False,
             init: Annotated[Optional[Path], typer.Option(
                 "--init", exists=True,
                 help="version 0: a safetensors file or an HF checkpoint directory "
                      "(default: built from the config's seed)")] = None,
             data_ipc: Annotated[Optional[Path], typer.Option("--data-ipc", hidden=True)] = None,
             metrics_port: MetricsPort = None, metrics_host: MetricsHost = "0.0.0.0",
             log_format: LogFormat = "text",
             ) -> None:
    """A follower (§5): one shard of θ and its momentum; scores, aggregates, applies."""
    from dips.node.common import advertised
    from dips.node.follower import run_follower
    from dips.train.run import stop_on_signals
    from dips.wire.pki import Identity

    _logging(f"follower-{index}", log_format)
    stop = stop_on_signals()
    _run("follower", lambda: run_follower(
        leader_addr, index, listen, advertised(listen, advertise, "--advertise"), data_listen,
        advertised(data_listen, data_advertise, "--data-advertise"), state_dir.resolve(),
        credentials(tls, insecure, Identity.follower(index)), stop, init=init,
        data_ipc=data_ipc, metrics_port=metrics_port, metrics_host=metrics_host))


def cluster(leader_addr: LeaderAddr,
            cluster_id: Annotated[str, typer.Option("--cluster-id", help="this cluster's id")],
            state_dir: StateDirOpt, tls: Tls = None, insecure: Insecure = False,
            cache_dir: Annotated[Optional[Path], typer.Option(
                "--cache-dir", help="tokenizer/corpus cache (default: the config's)")] = None,
            stages: Annotated[Optional[int], typer.Option(
                "--stages", min=1, help="stage workers of a one-process cluster (default: the "
                                        "run config's; under torchrun: one per rank)")] = None,
            metrics_port: MetricsPort = None, metrics_host: MetricsHost = "0.0.0.0",
            log_format: LogFormat = "text", device: DeviceOpt = None,
            ) -> None:
    """A cluster's training loop (§3): H inner AdamW steps, push, verdict, pull; under
    torchrun (WORLD_SIZE > 1), DDP replicas, FSDP2 shards or pipeline stages whose ranks are
    the stage workers, rank 0 alone reading the TLS bundle and talking to the leader."""
    from dips.node.cluster import run_cluster
    from dips.train.run import stop_on_signals
    from dips.wire.pki import Identity

    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    _logging(f"cluster-{cluster_id}" + (f"-rank{rank}" if world > 1 else ""), log_format)
    stop = stop_on_signals()
    _run("cluster", lambda: run_cluster(
        leader_addr, cluster_id, state_dir.resolve(),
        credentials(tls, insecure, Identity.cluster(cluster_id)) if rank == 0 else None, stop,
        cache_dir=cache_dir, stages=stages, metrics_port=metrics_port,
        metrics_host=metrics_host, device=device),
        (RoleError, OSError, ValueError, RuntimeError, Refused))  # refused for good


def export(leader_addr: LeaderAddr,
           out: Annotated[Path, typer.Option("--out", help="directory for the HF checkpoint")],
           tls: Tls = None, insecure: Insecure = False,
           cache_dir: Annotated[Optional[Path], typer.Option(
               "--cache-dir", help="tokenizer/corpus cache (default: the config's)")] = None,
           timeout: Annotated[float, typer.Option("--timeout", min=1.0,
                                                  help="seconds to reach the leader")] = 60.0,
           log_format: LogFormat = "text",
           ) -> None:
    """Pull the global model (the final one once the run finished) as the operator (pki/admin),
    evaluate it and save it as an HF checkpoint with export.json."""
    import json

    from dips.node.export import run_export
    from dips.train.run import stop_on_signals
    from dips.wire.pki import Identity

    _logging("export", log_format)
    stop = stop_on_signals()
    try:
        creds = credentials(tls, insecure, Identity.admin())
        doc = run_export(leader_addr, creds, out.resolve(), stop, cache_dir=cache_dir,
                         timeout_s=timeout)
    except Stopped:
        raise typer.Exit(0) from None
    except (RoleError, OSError) as exc:
        _fail("export", exc)
    print(json.dumps(doc))


def evaluate(leader_addr: LeaderAddr,
             every: Annotated[int, typer.Option("--every", min=1,
                                                help="evaluate every N-th version (versions)")],
             tls: Tls = None, insecure: Insecure = False,
             state_dir: Annotated[Optional[Path], typer.Option(
                 "--state-dir", help="this process's own directory (locked; evaluate.json)")
             ] = None,
             cache_dir: Annotated[Optional[Path], typer.Option(
                 "--cache-dir", help="tokenizer/corpus cache (default: the config's)")] = None,
             timeout: Annotated[float, typer.Option(
                 "--timeout", min=1.0, help="seconds to wait for the leader at start")] = 180.0,
             metrics_port: MetricsPort = None, metrics_host: MetricsHost = "0.0.0.0",
             log_format: LogFormat = "text",
             ) -> None:
    """Pull every N-th version of the global model as the operator (pki/admin), compute its
    held-out loss and report it to the leader (its eval.jsonl, metrics and dips status)."""
    from dips.node.evaluate import run_evaluate
    from dips.train.run import stop_on_signals
    from dips.wire.pki import Identity

    _logging("evaluate", log_format)
    stop = stop_on_signals()
    _run("evaluate", lambda: run_evaluate(
        leader_addr, every, credentials(tls, insecure, Identity.admin()), stop,
        state=state_dir.resolve() if state_dir is not None else None, cache_dir=cache_dir,
        metrics_port=metrics_port, metrics_host=metrics_host, timeout_s=timeout))
