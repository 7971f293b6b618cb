"""The one cluster training loop (dips.train.run.run_loop) with fake syncs, the trainer's setup
(dips.train.trainer.build_trainer) and Di-PS as a sync (dips.train.dips_sync)."""

from __future__ import annotations

import json
import threading
import zlib

import numpy as np
import pytest
import torch

from dips.roles.cluster import SyncResult
from dips.spec import DataConfig, InnerConfig
from dips.train.corpus import TokenData
from dips.train.dips_sync import DiPSSync
from dips.train.lease import LeaseSampler, NoData
from dips.train.loop import inner_step, make_inner_optimizer
from dips.train.model import build_model
from dips.train.run import TrainLog, run_loop
from dips.train.sampler import BatchSampler, assign_chunks, make_chunks
from dips.train.trainer import ClusterTrainer, build_trainer, sampler_seed

B, T = 2, 16
TPB = B * T


@pytest.fixture(scope="module")
def tokens():
    """A synthetic stream over the tiny vocab (no corpus needed: the loop is not about text)."""
    return np.random.default_rng(0).integers(0, 512, 40_000).astype(np.int64)


def _trainer(tiny_cfg, tokens, cid: str = "a") -> ClusterTrainer:
    chunks = make_chunks(tokens.size, 8)
    batches = BatchSampler(tokens, chunks, assign_chunks(8, ["a", "b"])[cid], B, T,
                           seed=sampler_seed(0, cid))
    model = build_model(tiny_cfg, 0)
    return ClusterTrainer(cid, model, make_inner_optimizer(model, 3e-3), batches, 1.0)


class _Pacer:
    def __init__(self, calls: list, delay: float = 0.0, stop: threading.Event | None = None):
        self.calls, self.d, self.stop = calls, delay, stop

    def delay(self, compute_s: float, t: float) -> float:
        assert compute_s > 0
        self.calls.append("pace")
        if self.stop is not None:  # a long delay must still end at a stop request
            self.stop.set()
        return self.d


class _RoundSync:
    """DiLoCo-like: syncs before a step once H steps are done; ends after ``rounds`` syncs."""

    grad_hook = None

    def __init__(self, H: int, rounds: int) -> None:
        self.H, self.rounds = H, rounds
        self.synced_at: list[int] = []
        self.after: list[tuple[int, int, float]] = []

    def before_step(self, trainer, stop) -> bool:
        if trainer.steps and trainer.steps % self.H == 0 and trainer.steps // self.H > len(self.synced_at):
            self.synced_at.append(trainer.steps)
        return len(self.synced_at) < self.rounds

    def held(self, trainer, stop) -> None:
        return None

    def after_step(self, trainer, result, stop) -> dict:
        self.after.append((trainer.steps, trainer.tokens, result.tokens))
        return {"fake": trainer.steps % self.H == 0}

    def starved(self, trainer, stop) -> None:
        raise AssertionError("a BatchSampler never runs dry")


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_loop_syncs_every_H_steps_and_counts_tokens(tiny_cfg, tokens, tmp_path):
    trainer, sync, calls = _trainer(tiny_cfg, tokens), _RoundSync(H=3, rounds=2), []
    log = TrainLog(tmp_path / "train.jsonl", stamp=lambda: 1.5)
    steps = run_loop(trainer, sync, threading.Event(), _Pacer(calls), log, clock=lambda: 0.0)
    log.close()
    assert steps == 6 and sync.synced_at == [3, 6] and calls == ["pace"] * 6
    assert sync.after == [(k, k * TPB, TPB) for k in range(1, 7)]
    recs = _records(tmp_path / "train.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert [r["tokens"] for r in recs] == [k * TPB for k in range(1, 7)]
    assert [r["fake"] for r in recs] == [False, False, True] * 2
    assert set(recs[0]) == {"step", "loss", "tokens", "compute_s", "delay_s", "fake", "time"}
    assert recs[0]["time"] == 1.5 and recs[0]["delay_s"] == 0.0


def test_trainer_step_is_inner_step(tiny_cfg, tokens):
    """The trainer's step and dips.train.loop.inner_step give the same parameters, bit for bit."""
    trainer, twin = _trainer(tiny_cfg, tokens), _trainer(tiny_cfg, tokens)
    for _ in range(3):
        result = trainer.step()
        loss = inner_step(twin.model, twin.optimizer, twin.batches.next_batch(), 1.0)
        assert result.loss == loss and result.tokens == TPB and result.compute_s > 0
    assert all(torch.equal(a, b) for a, b in zip(trainer.params, twin.params))
    assert (trainer.steps, trainer.tokens) == (3, 3 * TPB)


class _GradSync:
    """DP-like: a gradient hook every step; ends after ``steps``."""

    def __init__(self, steps: int, calls: list) -> None:
        self.steps, self.calls = steps, calls
        self.seen: list[int] = []

    def grad_hook(self, params) -> None:
        assert all(p.grad is not None for p in params)
        self.calls.append("hook")
        for p in params:  # what an all-reduce does: replace the gradient in place
            p.grad.zero_()

    def before_step(self, trainer, stop) -> bool:
        return trainer.steps < self.steps

    def held(self, trainer, stop) -> None:
        return None

    def after_step(self, trainer, result, stop) -> dict:
        self.seen.append(trainer.steps)
        return {"sync": True}

    def starved(self, trainer, stop) -> None:
        raise AssertionError


def test_gradient_hook_once_per_step_after_the_delay(tiny_cfg, tokens, tmp_path):
    trainer, calls = _trainer(tiny_cfg, tokens), []
    trainer.optimizer.param_groups[0]["weight_decay"] = 0.0  # zero gradients: nothing moves
    before = [p.detach().clone() for p in trainer.params]
    sync = _GradSync(4, calls)
    log = TrainLog(tmp_path / "train.jsonl", stamp=lambda: 0.0, delay=False)
    assert run_loop(trainer, sync, threading.Event(), _Pacer(calls), log, clock=lambda: 0.0) == 4
    log.close()
    assert calls == ["pace", "hook"] * 4 and sync.seen == [1, 2, 3, 4]
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params))  # the hook's grads used
    recs = _records(tmp_path / "train.jsonl")
    assert all("delay_s" not in r and r["sync"] for r in recs)


def test_stop_ends_the_loop_and_cuts_the_delay_short(tiny_cfg, tokens, tmp_path):
    stop, calls = threading.Event(), []

    class Sync(_RoundSync):
        def before_step(self, trainer, stop) -> bool:
            return not stop.is_set()

    log = TrainLog(tmp_path / "train.jsonl", stamp=lambda: 0.0)
    # The pacer asks for 60 s and sets stop: the wait ends at once, the loop after the step.
    n = run_loop(_trainer(tiny_cfg, tokens), Sync(3, 1), stop, _Pacer(calls, 60.0, stop), log,
                 clock=lambda: 0.0)
    log.close()
    assert n == 1 and _records(tmp_path / "train.jsonl")[0]["delay_s"] == 60.0


def test_starved_is_called_without_training(tiny_cfg, tokens, tmp_path):
    trainer = _trainer(tiny_cfg, tokens)
    real = trainer.batches
    lease = LeaseSampler(tokens, make_chunks(tokens.size, 8), T, B, seed=0)
    trainer.batches = lease  # nothing held: NoData

    class Sync(_RoundSync):
        starvations = 0

        def before_step(self, trainer, stop) -> bool:
            return trainer.steps < 2

        def starved(self, trainer, stop) -> None:
            self.starvations += 1
            trainer.batches = real  # "leased": batches again

    sync = Sync(3, 1)
    log = TrainLog(tmp_path / "train.jsonl", stamp=lambda: 0.0)
    assert run_loop(trainer, sync, threading.Event(), None, log, clock=lambda: 0.0) == 2
    log.close()
    assert sync.starvations == 1 and trainer.steps == 2
    with pytest.raises(NoData):
        lease.next_batch()


def test_build_trainer_same_seed_and_batches_for_the_same_cluster(tiny_cfg, tokens):
    tiny_tokens = TokenData(train=tokens.astype(np.uint16), val=tokens[:1000].astype(np.uint16),
                            vocab_size=512)
    data, inner = DataConfig(vocab_size=512, num_chunks=24), InnerConfig(batch_size=B, seq_len=T)
    ids = ["a", "b", "c"]
    one = build_trainer("b", tiny_cfg, data, inner, 7, assignment=ids, tokens=tiny_tokens)
    two = build_trainer("b", tiny_cfg, data, inner, 7, assignment=ids, tokens=tiny_tokens)
    other = build_trainer("c", tiny_cfg, data, inner, 7, assignment=ids, tokens=tiny_tokens,
                          share=one)
    assert one.batches._seed == two.batches._seed == sampler_seed(7, "b") == 7 * 7919 + zlib.crc32(b"b")
    assert torch.equal(one.batches.next_batch(), two.batches.next_batch())
    assert all(torch.equal(a, b) for a, b in zip(one.params, two.params))
    assert other.model is one.model and other.optimizer is one.optimizer
    assert other.batches._seed == sampler_seed(7, "c") != sampler_seed(7, "b")
    # Di-PS: window order is a property of the chunk, the run's seed in every cluster.
    lease = build_trainer("b", tiny_cfg, data, inner, 7, tokens=tiny_tokens)
    assert isinstance(lease.batches, LeaseSampler) and lease.batches.seed == 7
    with pytest.raises(ValueError, match="not in the assignment"):
        build_trainer("z", tiny_cfg, data, inner, 7, assignment=ids, tokens=tiny_tokens)


class _Client:
    cluster_id = "a"

    def __init__(self, results: list) -> None:
        self.results, self.calls, self.maintained = results, [], 0
        self.flushed, self.flush_result = 0, None

    def step_done(self, tokens, loss, wait=True):
        assert not wait  # the loop holds between steps (DiPSSync.held), never inside one
        self.calls.append((tokens, loss))
        return self.results.pop(0)

    def sync_due_after_step(self):
        return bool(self.results) and self.results[0] is not None  # its next step_done syncs

    def hold_tick(self):
        return True, None

    def maintain(self):
        self.maintained += 1
        return True

    def flush(self):
        self.flushed += 1
        return self.flush_result


def test_dips_sync_reports_pushes_and_leases_when_starved(tiny_cfg, tokens, tmp_path):
    res = SyncResult(True, 4, 2, 3 * TPB, score=0.5, reason="ok", push_s=0.12345, wait_s=0.2,
                     pull_s=0.3)
    client = _Client([None, None, res])
    stop = threading.Event()
    trainer = _trainer(tiny_cfg, tokens)

    class ThreeSteps(DiPSSync):
        def before_step(self, trainer, stop) -> bool:
            return trainer.steps < 3

    sync = ThreeSteps(client)  # type: ignore[arg-type]
    log = TrainLog(tmp_path / "train.jsonl", stamp=lambda: 0.0, delay=False)
    run_loop(trainer, sync, stop, None, log, clock=lambda: 0.0)
    log.close()
    recs = _records(tmp_path / "train.jsonl")
    assert recs[2] == {"event": "sync_start", "inner_step": 3, "tokens": 3 * TPB, "time": 0.0}
    recs = [r for r in recs if "step" in r]
    assert [("push" in r) for r in recs] == [False, False, True]
    assert recs[2]["push"] == {"accepted": True, "ok": True, "version": 4, "round": 2,
                               "tokens": 3 * TPB, "score": 0.5, "reason": "ok", "push_s": 0.1235,
                               "wait_s": 0.2, "pull_s": 0.3}
    assert [t for t, _ in client.calls] == [TPB] * 3
    # Starved: push what was trained (fewer than H steps), lease more; with still nothing
    # held, wait (cut short here by stop).
    trainer.batches = LeaseSampler(tokens, make_chunks(tokens.size, 8), T, B, seed=0)
    stop.set()
    assert DiPSSync(client).starved(trainer, stop) == {}  # type: ignore[arg-type]
    assert client.maintained == 1 and client.flushed == 1
    client.flush_result = res
    assert DiPSSync(client).starved(trainer, stop)["push"]["version"] == 4  # type: ignore[arg-type]
    assert not DiPSSync(client).before_step(trainer, stop)  # type: ignore[arg-type]


def test_no_inner_step_while_the_sync_holds_and_its_records_are_written(tiny_cfg, tokens,
                                                                        tmp_path):
    """Review 15, #2: while a Di-PS cluster cannot sync, the loop trains nothing (the sync's
    ``held`` says so); the hold's start and end are event records of train.jsonl."""
    trainer = _trainer(tiny_cfg, tokens)
    ticks = [{"event": "hold", "reason": "sync overdue"}, {}, {}, {"event": "hold_end"}]

    class Holds(_RoundSync):
        def held(self, trainer, stop):
            if trainer.steps == 2 and ticks:  # after the 2nd step: four ticks of a hold
                return ticks.pop(0)
            return None

        def before_step(self, trainer, stop) -> bool:
            return trainer.steps < 4

    log = TrainLog(tmp_path / "train.jsonl", stamp=lambda: 0.0)
    assert run_loop(trainer, Holds(3, 1), threading.Event(), None, log, clock=lambda: 0.0) == 4
    log.close()
    recs = _records(tmp_path / "train.jsonl")
    assert [r.get("event", r.get("step")) for r in recs] == [1, 2, "hold", "hold_end", 3, 4]
    assert recs[2]["tokens"] == 2 * TPB and not ticks


class _DyingSync(_RoundSync):
    """Says a sync is due at step ``H``; the process "dies" in that sync (SystemExit)."""

    def sync_due(self, trainer) -> bool:
        return trainer.steps == self.H

    def after_step(self, trainer, result, stop) -> dict:
        if trainer.steps == self.H:
            raise SystemExit("killed in the pull")
        return {}


def test_a_process_killed_in_a_sync_leaves_the_step_before_it_counted(tiny_cfg, tokens,
                                                                       tmp_path):
    """Review 33 of issue 15, m5: the line of a sync step is written after the sync, so a
    cluster killed in its pull lost that step's tokens from summary.json."""
    from dips.algo.consumed import tokens_consumed_of

    log = TrainLog(tmp_path / "train.jsonl", stamp=lambda: 0.0)
    with pytest.raises(SystemExit):
        run_loop(_trainer(tiny_cfg, tokens), _DyingSync(H=3, rounds=9), threading.Event(),
                 None, log, lambda: 0.0)
    log.close()
    recs = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r.get("step", r.get("event")) for r in recs] == [1, 2, "sync_start"]
    assert recs[-1] == {"event": "sync_start", "inner_step": 3, "tokens": 3 * TPB, "time": 0.0}
    assert tokens_consumed_of(recs) == 3 * TPB
