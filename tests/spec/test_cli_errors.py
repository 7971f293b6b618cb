"""A broken YAML file given to ``dips launch`` or ``dips bench compare``: one line on stderr
naming the file and line:column (or the field), exit code 2, no traceback, nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dips.cli import app

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
BROKEN = "name: broken\nseed: 0\ninner:\n  H: 8\n  lr: 0.1: 2\n"  # 2nd colon at line 5, col 10


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dips.cli", *args], capture_output=True,
                          text=True, timeout=100, cwd=ROOT)


def _assert_one_line(stderr: str, expected: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert expected in lines[0], stderr
    assert "Traceback" not in stderr


def test_launch_with_a_yaml_syntax_error(tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(BROKEN)
    proc = _run(["launch", "--config", str(cfg), "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2, proc.stderr
    _assert_one_line(proc.stderr, f"{cfg}:5:10: mapping values are not allowed here")
    assert not (tmp_path / "run").exists()


def test_bench_compare_with_a_yaml_syntax_error(tmp_path: Path) -> None:
    sc = tmp_path / "scenario.yaml"
    sc.write_text(BROKEN)
    proc = _run(["bench", "compare", "--scenario", str(sc), "--out", str(tmp_path / "out")])
    assert proc.returncode == 2, proc.stderr
    _assert_one_line(proc.stderr, f"{sc}:5:10: mapping values are not allowed here")
    assert not (tmp_path / "out").exists()


def test_old_keys_are_named_by_both_commands(tmp_path: Path) -> None:
    cfg = tmp_path / "old.yaml"
    cfg.write_text("name: old\ngrace_window_s: 1.0\n")
    res = CliRunner().invoke(app, ["launch", "--config", str(cfg), "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2
    _assert_one_line(res.stderr, f"{cfg}: grace_window_s: unknown key")
    sc = tmp_path / "old-scenario.yaml"
    sc.write_text((ROOT / "configs/compare/tiny.yaml").read_text()
                  .replace("grace: {window_s: 2.0}", "grace_window_s: 2.0"))
    res = CliRunner().invoke(app, ["bench", "compare", "--scenario", str(sc), "--out",
                                   str(tmp_path / "o")])
    assert res.exit_code == 2
    _assert_one_line(res.stderr, f"{sc}: grace_window_s: unknown key")
    # A fault plan is read the same way.
    good = tmp_path / "good.yaml"
    good.write_text("name: ok\n")
    plan = tmp_path / "faults.yaml"
    plan.write_text("faults:\n  - {at_s: 1, action: explode, target: leader}\n")
    res = CliRunner().invoke(app, ["launch", "--config", str(good), "--run-dir", str(tmp_path / "r"),
                                   "--faults", str(plan)])
    assert res.exit_code == 2
    _assert_one_line(res.stderr, f"{plan}: faults.0.action = 'explode'")
