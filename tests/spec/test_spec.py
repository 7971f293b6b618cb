"""The typed run spec (dips.spec): one model per concept, YAML errors in one line, one rate lookup.

Checks: a YAML syntax error names the file and line:column in one line; a document that is not
a mapping is refused; an unknown key — in particular a key of the old layout — is refused with
its field path named; ``LinkConfig.rate_at`` and ``ClusterConfig.slowdown_at`` against hand
values; ``run.json`` (``RunSpec``) survives a JSON round trip; the package imports nothing but
pydantic, PyYAML and the standard library.
"""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from dips.spec.fingerprint import Fingerprint
from dips.spec import (ClusterConfig, GraceConfig, LeaderConfig, LinkConfig, RateChange, RunConfig,
                       RunSpec, Scenario, SpecError, Transient, load_config, load_scenario)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
SPEC_DIR = ROOT / "src" / "dips" / "spec"
SCENARIO = {"name": "t", "methods": ["di-ps"], "token_budget": 1000, "eval_every_tokens": 100}


def _write(tmp_path: Path, text: str, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: quick\nseed: 0\ninner:\n  H: 8\n  lr: 0.1: 2\n")
    with pytest.raises(SpecError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg == f"{path}:5:10: mapping values are not allowed here", msg  # the 2nd colon
    # An unclosed flow mapping, in a scenario: still one line naming the file and a position.
    bad = _write(tmp_path, "name: s\nclusters: [{id: a, slowdown: 1.0\n", "s.yaml")
    with pytest.raises(SpecError, match=rf"^{bad}:\d+:\d+: ") as info:
        load_scenario(bad)
    assert "\n" not in str(info.value)


def test_non_mapping_and_empty_documents(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"x\.yaml: expected a YAML mapping of RunConfig fields, "
                                        r"got a list"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))
    assert load_config(_write(tmp_path, "", "empty.yaml")) == RunConfig()  # all defaults


@pytest.mark.parametrize("text, field", [
    ("grace_window_s: 1.0\n", "grace_window_s"),                   # now grace.window_s
    ("heartbeat_interval_s: 0.5\n", "heartbeat_interval_s"),       # now membership.…
    ("lease_ahead: 2\n", "lease_ahead"),                           # now data.lease_ahead
    ("grace: {window_s: 1.0, grace_mode: dynamic}\n", "grace.grace_mode"),
    ("clusters: [{id: a, link_bps: 1.0e+6}]\n", "clusters.0.link_bps"),
    ("clusters: [{id: a, link: {bps: 1.0e+6, schedule: [[1.0, 2.0e+6]]}}]\n",
     "clusters.0.link.schedule.0"),
    ("penalty: {alpha: 0.02, betta: 3}\n", "penalty.betta"),
])
def test_unknown_or_old_key_is_refused_with_its_field(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_config(path)
    assert f"{path}: {field}" in str(info.value), str(info.value)


def test_old_scenario_keys_are_refused(tmp_path: Path) -> None:
    text = ("name: s\nmethods: [di-ps]\ntoken_budget: 100\neval_every_tokens: 10\n"
            "grace_window_s: 0.5\nbandwidth_pattern_gbit: [10]\n"
            "clusters: [{id: a, bandwidth_gbit: 10}]\ntiming: {server_gbit: 10}\n")
    with pytest.raises(SpecError) as info:
        load_scenario(_write(tmp_path, text))
    msg = str(info.value)
    for field in ("grace_window_s", "bandwidth_pattern_gbit", "clusters.0.bandwidth_gbit",
                  "timing.server_gbit"):
        assert f"{field}: unknown key" in msg, msg


def test_a_bad_value_names_field_and_value(tmp_path: Path) -> None:
    path = _write(tmp_path, "outer: {lr: 0.7, momentum: 1.5}\nclusters: [{id: a, slowdown: 0.5}]\n")
    with pytest.raises(SpecError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{path}: outer.momentum = 1.5: ")
    assert lines[1].startswith(f"{path}: clusters.0.slowdown = 0.5: ")


def test_link_rate_at_is_the_one_rate_lookup() -> None:
    link = LinkConfig(bps=1.0e10, schedule=[RateChange(at_s=200, bps=1e9),
                                            RateChange(at_s=100, bps=5e9)])
    assert [c.at_s for c in link.schedule] == [100, 200]  # kept sorted by at_s
    assert link.rate_at(0.0) == 1e10 and link.rate_at(99.9) == 1e10
    assert link.rate_at(100.0) == 5e9 and link.rate_at(199.0) == 5e9
    assert link.rate_at(200.0) == 1e9 and link.rate_at(1e9) == 1e9
    assert link.rates() == [1e10, 5e9, 1e9]
    # 10 Gbit/s written in YAML, with or without the exponent's sign, is exactly 1e10 bits/s.
    for text in ("1.0e+10", "1.0e10", "10000000000"):
        assert load_yaml_text(f"bps: {text}").bps == 10.0 * 1e9 == 1e10
    assert ClusterConfig(id="a").link is None  # no link: unshaped (real time)
    for bad in ({"bps": 0}, {"bps": math.nan}, {"bps": 1e6, "schedule": [{"at_s": -1, "bps": 1}]},
                {"bps": 1e6, "schedule": [{"at_s": 1, "bps": math.inf}]}):
        with pytest.raises(ValidationError):
            LinkConfig.model_validate(bad)
    # Rescaled to real time: times × scale, rates mapped.
    real = link.rescaled(0.5, lambda bps: bps / 1000)
    assert real.bps == 1e7 and [(c.at_s, c.bps) for c in real.schedule] == [(50, 5e6), (100, 1e6)]


def load_yaml_text(text: str) -> LinkConfig:
    import yaml

    return LinkConfig.model_validate(yaml.safe_load(text))


def test_cluster_slowdown_at_multiplies_active_transients() -> None:
    c = ClusterConfig(id="a", slowdown=1.5, transient=[
        Transient(start_s=10, end_s=20, factor=2), Transient(start_s=15, end_s=30, factor=3)])
    assert c.slowdown_at(0.0) == 1.5 and c.slowdown_at(9.99) == 1.5
    assert c.slowdown_at(10.0) == 3.0 and c.slowdown_at(15.0) == 9.0
    assert c.slowdown_at(20.0) == 4.5 and c.slowdown_at(30.0) == 1.5
    assert c.transient_tuples() == [(10, 20, 2), (15, 30, 3)]
    with pytest.raises(ValidationError, match="end_s"):
        Transient(start_s=5, end_s=1, factor=2)
    with pytest.raises(ValidationError, match="slowdown"):
        ClusterConfig(id="a", slowdown=0.5)
    scaled = c.rescaled(0.1, None)
    assert scaled.link is None and scaled.slowdown_at(1.5) == 9.0


def test_run_spec_round_trip(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    spec = RunSpec(config=cfg, cache_dir=tmp_path / "cache",
                   layers=[("embed", ["model.embed_tokens.weight"], 65536),
                           ("layers.0", ["model.layers.0.mlp.up_proj.weight"], 8192),
                           ("head", ["model.norm.weight"], 128)],
                   follower_layers=[["embed"], ["layers.0", "head"]], eval_loss_initial=6.25,
                   train_tokens=1000, val_tokens=20, params=18000, windows_per_chunk=3,
                   fingerprint=Fingerprint(architecture={"num_attention_heads": 4},
                                           vocab_sha256="ab" * 32,
                                           tensors=[("model.embed_tokens.weight", [512, 32],
                                                     "float32")]))
    spec.write(tmp_path / "run.json")
    back = RunSpec.read(tmp_path / "run.json")
    assert back == spec and back.config == cfg and back.fingerprint == spec.fingerprint
    assert back.cache_dir == tmp_path / "cache"
    assert back.config.grace.window_s == 0.5 and back.config.membership.heartbeat_interval_s == 0.5
    with pytest.raises(ValidationError, match="follower_layers"):
        RunSpec.model_validate({**spec.model_dump(), "follower_layers": [["embed"]]})


def test_leader_config_composes_the_run_config_and_one_grace_default() -> None:
    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    lead = LeaderConfig.from_run(cfg)
    assert lead.grace == cfg.grace and lead.penalty == cfg.penalty and lead.outer == cfg.outer
    assert lead.membership == cfg.membership and lead.timeouts == cfg.timeouts
    assert lead.followers == cfg.followers == 2
    # One default grace window (§11's example), wherever a grace section is omitted.
    assert GraceConfig().window_s == RunConfig().grace.window_s == 8.0
    assert Scenario.model_validate({**SCENARIO, "eta": 0, "n_clusters": 1}).grace.window_s == 8.0
    assert LeaderConfig().grace.window_s == 8.0
    assert (lead.token_budget, lead.max_outer_steps, lead.max_time_s) == \
        (cfg.token_budget, cfg.max_outer_steps, cfg.max_time_s)  # the leader ends the run
    assert set(LeaderConfig.model_fields) == {"grace", "penalty", "outer", "membership",
                                              "timeouts", "followers", "token_budget",
                                              "max_outer_steps", "max_time_s",
                                              "max_push_tokens", "push_tokens_weighed", "lease_ahead",
                                              "lease_timeout_s", "configured_clusters"}
    assert lead.configured_clusters == len(cfg.clusters)  # the robust scale's quorum (issue 13)


def test_every_field_has_a_description() -> None:
    import dips.spec as spec

    models = [v for v in vars(spec).values() if isinstance(v, type) and issubclass(v, spec.Strict)
              and v is not spec.Strict]
    assert len(models) >= 18, models
    missing = [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items()
               if not f.description]
    assert missing == []


def test_spec_imports_only_pydantic_yaml_and_the_standard_library() -> None:
    allowed = {"pydantic", "yaml", "dips"} | set(sys.stdlib_module_names)
    files = sorted(SPEC_DIR.glob("*.py"))
    assert len(files) >= 8
    problems = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else ["dips.spec"]
            for name in names:
                top = name.split(".")[0]
                if top not in allowed or (top == "dips" and not name.startswith("dips.spec")):
                    problems.append(f"{path.name}:{node.lineno}: {name}")
    assert problems == []


def test_netns_refuses_a_rate_below_what_tbf_accepts() -> None:
    data = {"network": "netns",
            "clusters": [{"id": "a", "link": {"bps": 1e6, "schedule": [{"at_s": 5, "bps": 4000}]}}]}
    with pytest.raises(ValidationError, match="cluster 'a': link rate 4000.0 bit/s is below"):
        RunConfig.model_validate(data)
    RunConfig.model_validate({**data, "network": "loopback"})  # a token bucket takes any rate


def test_max_outer_steps_is_an_optional_stop_of_at_least_one(tmp_path: Path) -> None:
    """`dips launch` stops on this event (the leader's outer steps), not on a duration."""
    assert RunConfig().max_outer_steps is None
    assert load_config(_write(tmp_path, "max_outer_steps: 12\n")).max_outer_steps == 12
    with pytest.raises(SpecError, match="max_outer_steps = 0"):
        load_config(_write(tmp_path, "max_outer_steps: 0\n"))
