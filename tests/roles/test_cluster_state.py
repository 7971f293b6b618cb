"""The inner AdamW state of a cluster saved at its own site (issue 14): a round trip restores
every moment and step; a save is atomic (one payload in use, the pointer replaced last); a
corrupt, foreign or mismatched checkpoint is refused naming the file and field, and then
nothing changes — neither the optimizer nor the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dips.roles.cluster_state import (
    InnerStateError,
    InnerStateStore,
    read_saved,
    state_digest,
)
from dips.train.loop import make_inner_optimizer

pytestmark = pytest.mark.timeout(60)


def _model(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _trained(steps: int = 3, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(width)
    opt = make_inner_optimizer(model, lr=1e-2)
    for _ in range(steps):
        model(torch.randn(5, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_saved_state_loads_back_exactly_and_the_config_keeps_its_hyperparameters(tmp_path):
    model, opt = _trained()
    store = InnerStateStore(tmp_path / "inner", "a", model, opt)
    data = {"held": [[3, 17], [4, 0]], "drain": False}
    path = store.save(5, data, {"steps": 3, "tokens": 960})
    assert path is not None and path.parent == tmp_path / "inner"
    meta, saved = read_saved(tmp_path / "inner")
    assert meta["version"] == 5 and meta["data"] == data and meta["step"] == 3.0
    assert state_digest(saved) == store.digest()

    fresh_model = _model()
    fresh = make_inner_optimizer(fresh_model, lr=5e-3)  # a new config's lr
    loaded = InnerStateStore(tmp_path / "inner", "a", fresh_model, fresh).load()
    assert loaded["version"] == 5 and loaded["counters"] == {"steps": 3, "tokens": 960}
    by_name = dict(fresh_model.named_parameters())
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state[by_name[name]][key], opt.state[p][key]), (name, key)
    assert all(g["lr"] == 5e-3 for g in fresh.param_groups)
    assert InnerStateStore(tmp_path / "inner", "a", fresh_model, fresh).digest() == \
        state_digest(saved)


def test_each_save_replaces_the_last_atomically(tmp_path):
    model, opt = _trained()
    store = InnerStateStore(tmp_path / "inner", "a", model, opt)
    first = store.save(1, {"held": [], "drain": False}, {})
    second = store.save(2, {"held": [], "drain": False}, {})
    names = sorted(p.name for p in (tmp_path / "inner").iterdir())
    assert names == sorted(["current.json", second.name]) and not first.exists()
    assert json.loads((tmp_path / "inner" / "current.json").read_text())["payload"] == second.name


def test_nothing_saved_is_a_fresh_start(tmp_path):
    model, opt = _trained(0)
    assert InnerStateStore(tmp_path / "inner", "a", model, opt).load() is None
    assert not opt.state


@pytest.mark.parametrize("damage, words", [
    ("payload", "corrupt"),
    ("pointer", "not readable JSON"),
    ("cluster", "field 'cluster_id' = 'a', this cluster is 'b'"),
    ("shape", "field 'params' differs from this model at '0.weight'"),
    ("missing", "missing"),
])
def test_a_damaged_or_foreign_state_is_refused_and_changes_nothing(tmp_path, damage, words):
    model, opt = _trained()
    root = tmp_path / "inner"
    path = InnerStateStore(root, "a", model, opt).save(4, {"held": [], "drain": False}, {})
    payload = path / "optimizer.safetensors"
    if damage == "payload":
        raw = bytearray(payload.read_bytes())
        raw[-5] ^= 0xFF
        payload.write_bytes(bytes(raw))
    elif damage == "pointer":
        (root / "current.json").write_text('{"format": 1, "cluster')
    elif damage == "missing":
        payload.unlink()
    before = _files(root)
    cluster = "b" if damage == "cluster" else "a"
    other, other_opt = _trained(2, width=6 if damage == "shape" else 8)
    kept = {k: v.clone() for k, v in other_opt.state[next(other.parameters())].items()}
    with pytest.raises(InnerStateError, match="inner state .*" + words.replace("(", r"\(")):
        InnerStateStore(root, cluster, other, other_opt).load()
    assert _files(root) == before
    now = other_opt.state[next(other.parameters())]
    assert all(torch.equal(now[k], v) for k, v in kept.items())


class _Sync:
    """A sync whose steps return the given fields (the Di-PS sync's ``push`` record)."""

    grad_hook = None

    def __init__(self, fields: list[dict]) -> None:
        self.fields = fields

    counted: tuple[int, int] | None = None  # what count_from was given
    counted_at_join: tuple[int, int] | None = None

    def count_from(self, steps, tokens):
        self.counted = (steps, tokens)

    def join(self, stop, timeout_s):
        self.counted_at_join = self.counted
        return 7

    def before_step(self, trainer, stop):
        return True

    def after_step(self, trainer, result, stop):
        return self.fields.pop(0)

    def starved(self, trainer, stop):
        return self.fields.pop(0)


class _Batches:
    drain = False

    def positions(self):
        return {2: 11, 5: 0}


class _Trainer:
    def __init__(self, model, opt) -> None:
        self.model, self.optimizer, self.batches = model, opt, _Batches()
        self.steps, self.tokens = 16, 4096


def test_the_sync_saves_after_every_pull_and_resumes_before_the_join(tmp_path):
    from dips.train.dips_sync import InnerStateSync

    model, opt = _trained()
    trainer = _Trainer(model, opt)
    store = InnerStateStore(tmp_path / "inner", "a", model, opt)
    pushes = [{}, {"push": {"ok": False, "version": 3}}, {"push": {"ok": True, "version": 3}}]
    sync = InnerStateSync(_Sync(pushes), store, trainer)
    assert sync.after_step(trainer, None, None) == {}
    assert "inner_state" not in sync.after_step(trainer, None, None)  # no pull: no save
    assert not (tmp_path / "inner").exists()
    saved = sync.starved(trainer, None)["inner_state"]
    assert saved["version"] == 3 and (tmp_path / "inner" / saved["path"]).is_dir()

    fresh_model = _model()
    fresh = _Trainer(fresh_model, make_inner_optimizer(fresh_model, lr=1e-2))
    fresh.steps = fresh.tokens = 0
    again = InnerStateSync(_Sync([]), InnerStateStore(tmp_path / "inner", "a", fresh_model,
                                                      fresh.optimizer), fresh)
    assert again.join(None, 1.0) == 7
    assert (fresh.steps, fresh.tokens) == (16, 4096)
    assert again.inner.counted_at_join == (16, 4096)  # its heartbeats count on (review 28 #2)
    rec = again.resumed
    assert rec["version"] == 3 and rec["digest"] == store.digest() == rec["ranks"][0]
    assert rec["data"] == {"hint": [[2, 11], [5, 0]], "leased": [[2, 11], [5, 0]],
                           "kept": [2, 5], "refused": []}


def test_a_save_that_fails_is_reported_and_training_goes_on(tmp_path):
    from dips.train.dips_sync import InnerStateSync

    model, opt = _trained()
    trainer = _Trainer(model, opt)
    (tmp_path / "inner").write_text("a file where the folder should be")
    sync = InnerStateSync(_Sync([{"push": {"ok": True, "version": 2}}]),
                          InnerStateStore(tmp_path / "inner", "a", model, opt), trainer)
    fields = sync.after_step(trainer, None, None)
    assert fields["inner_state"]["version"] == 2 and "error" in fields["inner_state"]
