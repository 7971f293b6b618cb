"""``dips export --cache-dir`` (review 21, minor: run where the config's cache is absent, the
export tokenised the corpus again, 61 s): the option reaches the held-out evaluation as the
leader's and the clusters' does, with the same default (the config's ``data.cache_dir``).
In process: the leader, its spec and the pull are stand-ins."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from dips.cli import app
from dips.node import export
from dips.spec import RunConfig

pytestmark = pytest.mark.timeout(60)


def test_the_cli_option_reaches_the_export(tmp_path, monkeypatch):
    seen: dict = {}
    monkeypatch.setattr(export, "run_export", lambda *a, **kw: seen.update(kw) or {"ok": 1})
    result = CliRunner().invoke(app, ["export", "--leader", "127.0.0.1:1", "--insecure",
                                      "--out", str(tmp_path / "final"),
                                      "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 0, result.output
    assert seen["cache_dir"] == tmp_path / "cache"


class Client:
    def GetStatus(self, request):  # noqa: N802  (the stub's names)
        return SimpleNamespace(followers=[], version=3, outer_steps=3, tokens_accepted=64,
                               finished="")

    def JoinCluster(self, request):  # noqa: N802
        return SimpleNamespace(key_id="admin/1", key=b"k" * 32, encrypt=False)

    def close(self):
        pass


@pytest.mark.parametrize("given", [True, False])
def test_the_held_out_data_is_read_from_the_cache_given_else_the_configs(tmp_path, monkeypatch,
                                                                          given):
    from dips.emu import summary
    from dips.wire import services
    from dips.wire.pki import Identity
    from dips.wire.security import Credentials

    cfg = RunConfig()
    spec = SimpleNamespace(config=cfg, eval_loss_initial=9.0)
    monkeypatch.setattr(export, "fetch_spec", lambda *a, **kw: (spec, ""))
    monkeypatch.setattr(services, "leader_client", lambda *a, **kw: Client())
    used: list[Path] = []

    def export_model(cfg, cache, source, key, out, attempts=1):
        used.append(cache)
        source()
        return 4.0, None

    monkeypatch.setattr(summary, "export_model", export_model)
    cache = tmp_path / "cache" if given else None
    doc = export.run_export("127.0.0.1:1", Credentials.insecure(Identity.admin()),
                            tmp_path / "final", threading.Event(), cache_dir=cache)
    assert doc["version"] == 3
    assert used == [(cache if given else Path(cfg.data.cache_dir)).resolve()]
