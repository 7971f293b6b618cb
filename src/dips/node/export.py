"""``dips export``: the operator takes the global model out of a running or finished run.

With the operator's bundle (``pki/admin`` from ``dips init``), it asks the leader for the run
spec and status, joins as an observer (pull-only, never a member: it cannot push), pulls the
current version in FP32 from every follower's data plane, evaluates it on the held-out split
and writes an HF checkpoint (safetensors, config, tokenizer) plus ``export.json``. A run the
leader has ended (its token budget, outer-step or time limit) keeps serving its final model
until its processes are stopped, so ``dips export`` after "run finished" takes that one.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from dips.node.common import RoleError, fetch_spec
from dips.wire.security import Credentials


def run_export(leader_addr: str, creds: Credentials, out: Path, stop: threading.Event, *,
               cache_dir: Path | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """Export the leader's current version to ``out``; returns what ``export.json`` holds
    (``version``, ``outer_steps``, ``tokens_accepted``, ``finished``, ``eval_loss`` in
    nats/token, ``model_dir``). Raises RoleError: the leader cannot be reached within
    ``timeout_s`` seconds, refuses this identity (only the ``admin`` bundle may observe), or
    the pull failed (a follower down: try again)."""
    from dips.emu.summary import export_model
    from dips.wire.keys import MemberKey
    from dips.wire.pb import control_pb2 as pb
    from dips.wire.services import leader_client

    if creds.identity.role != "admin":
        raise RoleError(f"--tls: the certificate is {creds.identity.name!r}; dips export needs "
                        "the operator's bundle (pki/admin)")
    spec, _ = fetch_spec(leader_addr, creds, stop, timeout_s)
    cfg = spec.config
    client = leader_client(leader_addr, creds, timeout_s=timeout_s)
    pulled: list[Any] = []

    def source() -> tuple[list[Any], int]:
        """The followers and the version now (a live run moves on while the data loads)."""
        status = client.GetStatus(pb.StatusRequest())
        pulled[:] = [status]
        return list(status.followers), status.version

    try:
        reply = client.JoinCluster(pb.JoinRequest())
        key = MemberKey(reply.key_id, reply.key, reply.encrypt)
        out.mkdir(parents=True, exist_ok=True)
        cache = (cache_dir or cfg.data.cache_dir).resolve()
        t0 = time.monotonic()
        loss, error = export_model(cfg, cache, source, key, out, attempts=5)
    except grpc.RpcError as exc:
        raise RoleError(f"leader {leader_addr}: {exc.code().name}: {exc.details()}") from None
    finally:
        client.close()
    status = pulled[0] if pulled else None
    if error is not None or status is None:
        raise RoleError(f"could not pull the model: {error}")
    doc = {"version": status.version, "outer_steps": status.outer_steps,
           "tokens_accepted": status.tokens_accepted, "finished": status.finished,
           "eval_loss": round(loss, 5), "eval_loss_initial": round(spec.eval_loss_initial, 5),
           "model_dir": str(out), "seconds": round(time.monotonic() - t0, 2)}
    (out / "export.json").write_text(json.dumps(doc, indent=1))
    return doc
