"""A hostile cluster with valid credentials in a real run (issue 13): one of three clusters
sends huge pseudo-gradients, claims 10^15 tokens per step, replays a push after its round
closed, pushes a misshaped layer under a valid grant, and holds an admitted push without
reporting it. The honest clusters' outer steps go on, the global model's held-out loss falls,
every applied step stays within one clipped outer step, and the penalty's statistics move no
further than one accepted push could move them.

The leader, both followers and the two honest clusters are the public role commands
(`--insecure` on 127.0.0.1); the hostile cluster is this process, driving the library API
(:class:`dips.roles.client.ClusterClient`) with a real trainer, with its control stub wrapped
to misbehave. Every wait is for an event (an outer step, a verdict), never for a duration.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from dips.algo.penalty import PenaltyConfig, PenaltyState, decide
from dips.algo.refusal import Refusal
from dips.emu.launcher import free_port
from dips.node.common import fetch_spec
from dips.roles.client import ClusterClient
from dips.train.corpus import load_tokenizer
from dips.train.dips_sync import DiPSSync
from dips.train.model import fingerprint_of
from dips.train.trainer import build_trainer
from dips.wire.dataclient import DataClient, DataPlaneError
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from tests.integration.runner import ROOT, jsonl_so_far
from tests.node.test_hand_deployed import _dips

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _wait(cond, what: str, procs: dict, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        dead = [n for n, p in procs.items() if p.poll() is not None]
        assert not dead, f"{dead} exited while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s} s")


class Stub:
    """The hostile cluster's control stub: the real one, with hooks on the push calls."""

    def __init__(self, real) -> None:
        self._real = real
        self.grants: list = []
        self.on_grant = None   # called with the grant before the stage workers push
        self.hold = None       # an Event PushDone waits for (the push is held, unreported)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def RequestPush(self, request, **kw):
        grant = self._real.RequestPush(request, **kw)
        self.grants.append(grant)
        if self.on_grant is not None:
            self.on_grant(grant)
        return grant

    def PushDone(self, request, **kw):
        if self.hold is not None:
            assert self.hold.wait(300), "the held push was never released"
            self.hold = None
        return self._real.PushDone(request, **kw)


def _steps(state: Path) -> list[dict]:
    return [r for r in jsonl_so_far(state / "outer_steps.jsonl") if "event" not in r]


def test_a_hostile_member_cannot_stall_steer_or_poison_the_run(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(clusters=[{"id": "a"}, {"id": "b"}, {"id": "h"}], max_time_s=None,
               max_outer_steps=400, token_budget=10**9)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    leader = f"127.0.0.1:{free_port()}"
    lstate = tmp_path / "leader"
    procs = {"leader": _dips(["leader", "--config", str(tmp_path / "run.yaml"), "--listen",
                              leader, "--state-dir", str(lstate), "--insecure"],
                             tmp_path / "leader.log")}
    for i in (0, 1):
        procs[f"f{i}"] = _dips(["follower", "--leader", leader, "--index", str(i), "--listen",
                                f"127.0.0.1:{free_port()}", "--data-listen",
                                f"127.0.0.1:{free_port()}", "--state-dir",
                                str(tmp_path / f"f{i}"), "--insecure"], tmp_path / f"f{i}.log")
    for c in ("a", "b"):
        procs[c] = _dips(["cluster", "--leader", leader, "--cluster-id", c, "--state-dir",
                          str(tmp_path / c), "--insecure"], tmp_path / f"{c}.log")
    client = None
    try:
        creds = Credentials.insecure(Identity.cluster("h"))
        spec, _ = fetch_spec(leader, creds, threading.Event(), 180.0)
        run = spec.config
        cache = (ROOT / run.data.cache_dir).resolve()
        trainer = build_trainer("h", run.model, run.data, run.inner, run.seed, cache_dir=cache)
        fp = fingerprint_of(trainer.model, load_tokenizer(cache, run.data.vocab_size).get_vocab())
        client = ClusterClient(trainer.model, leader, "h", creds, H=run.inner.H, stages=1,
                               timeout_s=60, admit_timeout_s=60,
                               heartbeat_interval_s=run.membership.heartbeat_interval_s,
                               data=trainer.batches, fingerprint=fp.to_json(),
                               wire_dtype=run.outer.wire_dtype)
        stub = client._leader = Stub(client._leader)
        # Joined as `dips cluster` joins: retried while the followers register.
        DiPSSync(client).join(threading.Event(), 180.0)

        def push(mutate=None, tokens=None):
            """H inner steps (real ones), then the sync the H-th triggers."""
            res = None
            while res is None:
                step = trainer.step()
                if mutate is not None and client.inner_step - client._last_sync_step == run.inner.H - 1:
                    with torch.no_grad():
                        mutate(trainer.model)
                res = client.step_done(tokens if tokens is not None else step.tokens, step.loss)
            return res

        # Past the penalty's warm-up: a history to judge the hostile pushes against.
        _wait(lambda: len([s for s in _steps(lstate) if s["accepted"]]) >= 4,
              "4 honest outer steps", procs)
        honest = push()
        assert honest.ok, honest

        # 1. A huge pseudo-gradient: rejected by the penalty, θ unmoved by it.
        huge = push(mutate=lambda m: [p.mul_(40.0) for p in m.parameters()])
        assert not huge.accepted and huge.score is not None and huge.score > huge.threshold

        # 2. 10^15 tokens claimed per inner step: T_j is the ledger's count (checked in the
        # leader's records below), and the client's own SyncResult shows the leader's count,
        # read off its grant's ticket, not its claim (review F9).
        claimed = push(tokens=10**15)
        assert claimed.tokens < 10**15

        # 3. A replay of the last push's layer, verbatim ticket, after its round closed.
        raw = {i: DataClient(client._key, ep, timeout_s=30) for i, ep in client._endpoints.items()}
        layers = dict(client._layers)

        def send(grant, tensors_of):
            """Push the grant's first scheduled layer to its follower, raw; the refusal."""
            t = grant.schedule[0].transfers[0]
            head = {"op": "push", "cluster": "h", "round": grant.round, "push_id": grant.push_id,
                    "layer": t.layer, "ticket": grant.ticket,
                    "ticket_mac": grant.ticket_mac.hex(), "stage": grant.round == 0}
            with pytest.raises(DataPlaneError) as refused:
                raw[t.follower].request(head, tensors_of(layers[t.layer]))
            return refused.value.code

        as_trained = lambda params: [(n, p.detach().to(torch.bfloat16)) for n, p in params]  # noqa: E731
        assert send(stub.grants[-1], as_trained) is Refusal.STALE_GRANT

        # 4. A misshaped layer under a valid grant: that push alone is invalid.
        codes = []
        misshape = lambda grant: codes.append(send(  # noqa: E731
            grant, lambda params: [(n, torch.zeros(3, 3, dtype=torch.bfloat16)) for n, _ in params]))
        stub.on_grant = misshape
        shaped = push()
        stub.on_grant = None
        assert codes == [Refusal.INVALID_ARGUMENT] and not shaped.accepted

        # 5. An admitted push held unreported: the others' rounds go on without it.
        before = len(_steps(lstate))
        release = stub.hold = threading.Event()
        waiter = threading.Thread(target=lambda: results.append(push()), daemon=True)
        results: list = []
        waiter.start()
        _wait(lambda: len([s for s in _steps(lstate)[before:] if s["accepted"]
                           and "h" not in s["accepted"]]) >= 2,
              "2 outer steps of the honest clusters while h holds its push", procs)
        release.set()
        waiter.join(120)
        assert results and not waiter.is_alive()
        for r in raw.values():
            r.close()

        n_before_end = len(_steps(lstate))
        _wait(lambda: len([s for s in _steps(lstate)[n_before_end:] if s["accepted"]]) >= 2,
              "2 more outer steps after the attacks", procs)
    finally:
        if client is not None:
            client.close()
        for name in ("a", "b", "f0", "f1", "leader"):
            if procs[name].poll() is None:
                procs[name].send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(60)
            except Exception:
                p.kill()
                p.wait(10)

    steps = _steps(lstate)
    applied = [s for s in steps if s["accepted"]]
    assert {"a", "b"} <= {c for s in applied for c in s["accepted"]}
    # The huge push was rejected by the penalty and no applied step carries a huge norm.
    assert any(s["rejected"].get("h", {}).get("reason") == "penalty" for s in steps)
    # Replay the leader's penalty over the records: every applied step is within one
    # clipped outer step (‖clip·δ‖ ≤ 0.4·√μ), and μ never rises beyond what an accepted
    # push could make it (the largest accepted G).
    state, pcfg, ratio = PenaltyState(), PenaltyConfig(), run.outer.clip_ratio
    largest_accepted = 0.0
    for s in steps:
        norms = {c: s["sq_norms"][c] for c in s["scored"]}
        if not norms or "error" in s:
            continue
        verdict, state = decide(state, norms, pcfg)
        assert verdict.accepted == sorted(s["accepted"]), s
        largest_accepted = max([largest_accepted] + [norms[c] for c in verdict.accepted])
        # Under §8 taken literally, the 40x push alone would lift μ far beyond this.
        assert state.mu <= 2 * largest_accepted, (s, state)
        if s["accepted"] and s["delta_sq_norm"]:
            step = s["clip_factor"] * math.sqrt(s["delta_sq_norm"])
            assert step <= ratio * math.sqrt(state.mu) * (1 + 1e-6), s
    # Every T_j the leader used is the ledger's, however much h claimed.
    per_push = 4 * run.inner.H * run.inner.batch_size * run.inner.seq_len
    assert all(t <= per_push for s in steps for t in s["tokens"].values())
    # ... and the T_j h's own SyncResult (its train.jsonl record) shows (review F9)
    assert [s["tokens"]["h"] for s in steps if s["round"] == claimed.round] == [claimed.tokens]
    # The global model learned: the honest clusters' training loss fell.
    losses = [json.loads(line)["loss"] for line in (tmp_path / "a" / "train.jsonl").read_text()
              .splitlines() if '"loss"' in line]
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8
