"""Di-PS in virtual time (dips.emu.virtual): it trains, its clock is exact, runs are bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dips.bench.runners import get_runner
from dips.emu.virtual import run_dips
from tests.emu.vt_helpers import ROOT, TOKENS_PER_STEP, one_second_scale, tiny

pytestmark = pytest.mark.timeout(120)
CACHE = ROOT / ".cache" / "dips"
TINY_PARAMS = 34976  # tiny.yaml's model


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny scenario run once through the bench's runner: (scenario, result, run dir),
    shared by the test of what it trained and the test that a second run is bit-identical."""
    s = tiny(CACHE)
    out = tmp_path_factory.mktemp("tiny-dips")
    return s, get_runner("virtual", "di-ps")(s, out), out


def test_dips_trains_and_accounts(tiny_run) -> None:
    s, r, tmp_path = tiny_run
    assert r.method == "di-ps" and r.mode == "virtual" and r.shaping == "virtual"
    assert r.curve[0].tokens == 0 and r.curve[-1].tokens == r.tokens >= s.token_budget
    assert r.final_eval_loss < r.curve[0].eval_loss - 0.5
    assert r.updates_pushed == r.updates_accepted + r.updates_rejected > 0
    # It ends as the real leader ends a run: once the accepted tokens reach the budget (issue
    # 12: the final model holds the budget, like synchronous DiLoCo's).
    assert s.token_budget <= r.tokens_accepted <= r.tokens
    assert r.tokens_per_s == pytest.approx(r.tokens / r.time_s)
    rounds = [json.loads(x) for x in _lines(tmp_path / "events.jsonl")]
    assert [x["round"] for x in rounds] == list(range(1, len(rounds) + 1))
    assert r.extra["rounds"] == len(rounds) and r.extra["mean_staleness"] >= 0
    # Versions advance by one per round with an accepted update, never otherwise.
    versions = [x["version"] for x in rounds]
    assert versions == [sum(1 for y in rounds[:i + 1] if y["accepted"]) for i in range(len(rounds))]


def test_same_seed_gives_a_bit_identical_run(tiny_run, tmp_path: Path) -> None:
    _, a, a_dir = tiny_run  # run a: the shared run (through the runner, as the bench runs it)
    b = run_dips(tiny(CACHE), tmp_path / "b")
    assert [(p.time_s, p.tokens, p.eval_loss) for p in a.curve] == \
           [(p.time_s, p.tokens, p.eval_loss) for p in b.curve]
    # Every round's squared norms, scores and clip factors are equal to the last bit.
    assert _lines(a_dir / "events.jsonl") == _lines(tmp_path / "b" / "events.jsonl")
    c = run_dips(tiny(CACHE, seed=1), tmp_path / "c")
    assert [p.eval_loss for p in c.curve[1:]] != [p.eval_loss for p in a.curve[1:]]


@pytest.mark.parametrize("grace, expected", [(0.0, 12.5), (0.5, 12.5), (2.0, 15.5)])
def test_virtual_clock_of_one_cluster(tmp_path: Path, grace: float, expected: float) -> None:
    # H = 2 steps of 1 s, push 1 s, update 0.5 s, pull 1 s; the run ends at the update that
    # brings the accepted tokens to the budget (3 pushes of 2 steps):
    # steps end at 1, 2 | push to 3, update to 3.5, pull to 4.5 | 5.5, 6.5 | push to 7.5,
    # update to 8, pull to 9 | 10, 11 | push to 12, update to 12.5: the end.
    # A grace window longer than the push (2 s) delays each update by 1 s.
    s = tiny(CACHE, clusters=[{"id": "a", "link": {"bps": 1e10}}], grace={"window_s": grace},
             inner={"H": 2}, token_budget=3 * 2 * TOKENS_PER_STEP,
             timing={"step_s": 1.0, "model_bytes_scale": one_second_scale(TINY_PARAMS),
                     "update_s": 0.5})
    r = run_dips(s, tmp_path)
    assert r.time_s == pytest.approx(expected, abs=1e-9)
    assert r.comm_s == pytest.approx(6.0, abs=1e-9)  # 3 x (push + pull): the last pull is charged as it starts
    assert r.updates_pushed == 3 and r.tokens_accepted == s.token_budget
    assert r.extra["clusters"]["a"]["idle_s"] == pytest.approx(expected - 6.0, abs=1e-9)


def test_fp32_on_the_wire_doubles_each_transfer(tmp_path: Path) -> None:
    # As above with grace 0, each push and pull now 2 s: steps end at 1, 2 | push to 4,
    # update to 4.5, pull to 6.5 | 7.5, 8.5 | push to 10.5, update to 11, pull to 13 | 14, 15 |
    # push to 17, update to 17.5: the end.
    s = tiny(CACHE, clusters=[{"id": "a", "link": {"bps": 1e10}}], grace={"window_s": 0.0},
             inner={"H": 2}, token_budget=3 * 2 * TOKENS_PER_STEP, outer={"wire_dtype": "fp32"},
             timing={"step_s": 1.0, "model_bytes_scale": one_second_scale(TINY_PARAMS),
                     "update_s": 0.5})
    r = run_dips(s, tmp_path)
    assert r.time_s == pytest.approx(17.5, abs=1e-9)
    assert r.comm_s == pytest.approx(12.0, abs=1e-9)


def test_one_cluster_with_fp32_wire_and_no_clip_is_synchronous_diloco(tmp_path: Path) -> None:
    """With one cluster, exact transfers and no clip, Di-PS's outer step is DiLoCo's (§3, §6):
    the same final model. With BF16 pulls (the default wire) the cluster restarts each round
    from the rounded θ and the final loss differs (issue 12's n = 1 gap). Evaluations in
    between fall at token counts where Di-PS's update may still be in flight, so only the end
    is compared."""
    common = dict(clusters=[{"id": "a", "link": {"bps": 1e10}}], penalty={"enabled": False})
    exact = {"clip": "seed", "max_norm": None, "wire_dtype": "fp32"}
    diloco = get_runner("virtual", "diloco")(tiny(CACHE, outer=exact, **common), tmp_path / "d")
    dips = run_dips(tiny(CACHE, outer=exact, **common), tmp_path / "p")
    rounded = run_dips(tiny(CACHE, outer={**exact, "wire_dtype": "bf16"}, **common), tmp_path / "b")
    assert dips.tokens_accepted == diloco.tokens == dips.tokens
    assert dips.extra["outer_steps"] == diloco.extra["rounds"] > 3
    assert dips.final_eval_loss == pytest.approx(diloco.final_eval_loss, rel=1e-5)
    assert rounded.final_eval_loss != pytest.approx(diloco.final_eval_loss, rel=1e-3)


def test_clusters_finishing_together_share_a_round(tmp_path: Path) -> None:
    clusters = [{"id": "a"}, {"id": "b"}, {"id": "c", "slowdown": 3.0}]
    s = tiny(CACHE, clusters=clusters, grace={"window_s": 0.0}, inner={"H": 2},
             token_budget=8 * 2 * TOKENS_PER_STEP, methods=["di-ps"])
    run_dips(s, tmp_path)
    rounds = [json.loads(x) for x in _lines(tmp_path / "events.jsonl")]
    # a and b always arrive together; c (3x slower) never at the same instant.
    assert all(set(x["clusters"]) in ({"a", "b"}, {"c"}) for x in rounds)
    assert any(x["clusters"] == ["c"] for x in rounds)


def test_dynamic_grace_uses_tau_star_in_virtual_time(tmp_path: Path) -> None:
    """§7 in virtual time: once λ and C_m are measured, each window is τ* = ln(C_m·λ)/λ of the
    estimates at its opening (the leader's own rule, dips.algo.grace); before, the fixed τ."""
    from dips.algo.grace import optimal_grace_s

    # A long update (C_m = 5 s) against ~0.4 requests/s makes waiting pay: C_m·λ > 1.
    s = tiny(CACHE, grace={"window_s": 2.0, "max_s": 30.0},
             timing={"step_s": 1.5, "model_bytes_scale": 2000.0, "update_s": 5.0})
    r = run_dips(s, tmp_path / "dyn", "di-ps-dynamic-grace")
    rounds = [json.loads(x) for x in _lines(tmp_path / "dyn" / "events.jsonl")]
    assert rounds[0]["grace"]["mode"] == "dynamic"
    windows = [x["window_close"] - x["window_open"] for x in rounds]
    assert windows[0] == 2.0  # nothing measured yet: the fixed window
    estimated = [(x, w) for x, w in zip(rounds, windows)
                 if x["grace"]["rate_per_s"] is not None and x["grace"]["miss_cost_s"] is not None]
    assert len(estimated) >= 3
    for x, w in estimated:
        g = x["grace"]
        tau = optimal_grace_s(g["rate_per_s"], g["miss_cost_s"], 30.0)
        assert w == pytest.approx(tau, abs=2e-3)  # the log rounds λ and C_m to 4 decimals
    assert any(0.0 < w != 2.0 for _, w in estimated)
    fixed = run_dips(s, tmp_path / "fixed", "di-ps")
    assert (r.time_s, r.extra["rounds"]) != (fixed.time_s, fixed.extra["rounds"])


def test_a_slow_link_sends_its_push_ahead_and_holds_no_round(tmp_path: Path) -> None:
    """Issue 10: c's link is 10x slower (a push takes 10 s, a and b's 1 s). Once its push time
    is known it is sent ahead of any round and joins one only when it has arrived: no round
    that includes c waits for its transfer, and every push of c is delivered and scored (the
    §8 penalty may still reject it as stale: a and b made several outer steps meanwhile)."""
    clusters = [{"id": "a", "link": {"bps": 1e10}}, {"id": "b", "link": {"bps": 1e10}},
                {"id": "c", "link": {"bps": 1e9}}]
    s = tiny(CACHE, clusters=clusters, grace={"window_s": 0.5}, inner={"H": 2},
             token_budget=40 * 2 * TOKENS_PER_STEP,
             timing={"step_s": 1.0, "model_bytes_scale": one_second_scale(TINY_PARAMS),
                     "update_s": 0.5})
    run_dips(s, tmp_path)
    rounds = [json.loads(x) for x in _lines(tmp_path / "events.jsonl")]
    with_c = [x for x in rounds if "c" in x["clusters"]]
    assert len(with_c) >= 3 and all("c" in x["scored"] for x in with_c)
    # The first push of c (not yet measured) holds its round; every later one arrived ahead.
    assert with_c[0]["push_phase_s"] >= 9.0
    assert all(x["push_phase_s"] < 2.0 for x in with_c[1:])
    assert all(x["push_phase_s"] < 2.0 for x in rounds if "c" not in x["clusters"])
