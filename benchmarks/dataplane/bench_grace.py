"""Benchmark 6 of issue 5: dynamic against fixed grace windows on heterogeneous clusters (§7).

Each run is a real Di-PS run on loopback: the real leader (in this process, gRPC, with
``grace_mode``), M follower processes (FollowerShard + DataServer + gRPC), and N cluster
processes, each training the configured LLaMA model on its own data chunks in the one training loop
(:func:`dips.train.run.run_loop`: real inner AdamW steps, an injected slowdown per inner step as
``dips launch`` does, and :class:`dips.train.dips_sync.DiPSSync` syncing every H steps). After ``--seconds`` of
training it reports, per grace setting:

* idle time of the fast clusters (slowdown 1.0): the share of their wall time spent in sync
  (push + waiting for the verdict, window included + pull);
* outer steps applied, and clusters per step;
* mean staleness of accepted pushes: outer steps applied between the version a cluster
  started from and the step that applied its push (``version − 1 − base_version``).

Usage: python benchmarks/dataplane/bench_grace.py [--config configs/quickstart.yaml
       --seconds 90 --windows fixed:1.0 dynamic]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

SLOWDOWNS = {"fast0": 1.0, "fast1": 1.0, "mid": 2.0, "slow": 4.0}


def _cluster_main(cid: str, slowdown: float, cfg_dict: dict, addr: str,
                  cache_dir: str, stop, out_path: str) -> None:
    """One cluster process: the one training loop of dips.train.run with the Di-PS sync
    (insecure credentials, as the harness's; its data-plane key comes from its join)."""
    import torch

    from dips.emu.pacing import Pacer
    from dips.roles.client import ClusterClient
    from dips.spec import RunConfig
    from dips.train.dips_sync import DiPSSync
    from dips.train.run import TrainLog, run_loop
    from dips.train.trainer import build_trainer
    from dips.wire.pki import Identity
    from dips.wire.security import Credentials

    torch.set_num_threads(1)
    cfg = RunConfig.model_validate(cfg_dict)
    trainer = build_trainer(cid, cfg.model, cfg.data, cfg.inner, cfg.seed,
                            assignment=list(SLOWDOWNS), cache_dir=Path(cache_dir))
    client = ClusterClient(trainer.model, addr, cid, Credentials.insecure(Identity.cluster(cid)),
                           H=cfg.inner.H, timeout_s=120,
                           admit_timeout_s=120, heartbeat_interval_s=1.0)
    sync = DiPSSync(client)
    sync.join(stop, 240)
    log = TrainLog(Path(out_path), stamp=time.monotonic, delay=False)
    log.write({"event": "join"})
    t0 = time.monotonic()
    run_loop(trainer, sync, stop, Pacer(slowdown), log, clock=lambda: time.monotonic() - t0)
    log.write({"event": "stop"})
    log.close()
    client.close()


def run_one(cfg, mode: str, window_s: float, seconds: float, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in run_dir.glob("*.jsonl"):
        f.unlink()
    spec = ("llama", cfg.model.model_dump(), cfg.seed)
    ps = harness.PS(spec, cfg.followers, grace_s=window_s, grace_mode=mode,
                    grace_max_s=cfg.grace.max_s, run_dir=run_dir)
    stop = harness.MP.Event()
    procs = [harness.MP.Process(target=_cluster_main, daemon=True, args=(
        cid, sd, cfg.model_dump(mode="json"), ps.addr, str(cfg.data.cache_dir), stop,
        str(run_dir / f"{cid}.jsonl"))) for cid, sd in SLOWDOWNS.items()]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 240
        while not all((run_dir / f"{c}.jsonl").exists() for c in SLOWDOWNS):
            if time.monotonic() > deadline or any(not p.is_alive() for p in procs):
                raise RuntimeError("clusters did not start")
            time.sleep(0.5)
        time.sleep(seconds)
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        ps.close()
    return summarize(run_dir)


def summarize(run_dir: Path) -> dict:
    per = {}
    for cid in SLOWDOWNS:
        recs = [json.loads(l) for l in (run_dir / f"{cid}.jsonl").read_text().splitlines()]
        t0 = next(r["time"] for r in recs if r.get("event") == "join")
        t1 = max(r["time"] for r in recs)
        syncs = [r["push"] for r in recs if "push" in r]
        idle = sum(r["push_s"] + r["wait_s"] + r["pull_s"] for r in syncs)
        per[cid] = {"wall_s": t1 - t0, "syncs": len(syncs), "idle_s": idle,
                    "idle_share": idle / max(t1 - t0, 1e-9),
                    "wait_s_mean": statistics.mean([r["wait_s"] for r in syncs]) if syncs else None}
    lines = [json.loads(l) for l in (run_dir / "outer_steps.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "event" not in r]  # one decision line per round
    ends = [r for r in lines if r.get("event") == "round_end"]  # its phases and §7 estimates
    applied = [s for s in steps if s.get("accepted")]
    stale = [s["version"] - 1 - s["base_versions"][c] for s in applied for c in s["accepted"]]
    taus = [s["window_s"] for s in steps if "window_s" in s]  # the window each round used
    fast = [v for c, v in per.items() if SLOWDOWNS[c] == 1.0]
    return {"clusters": per, "outer_steps": len(applied), "rounds": len(steps),
            "clusters_per_step": statistics.mean([len(s["accepted"]) for s in applied]) if applied else 0,
            "mean_staleness": statistics.mean(stale) if stale else None,
            "fast_idle_share": statistics.mean([v["idle_share"] for v in fast]),
            "fast_idle_s_per_sync": statistics.mean([v["idle_s"] / max(v["syncs"], 1) for v in fast]),
            "window_s_mean": statistics.mean(taus) if taus else None,
            "last_grace": ends[-1].get("grace") if ends else None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/quickstart.yaml"))
    ap.add_argument("--seconds", type=float, default=75.0)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--windows", nargs="+", default=["fixed:1.0", "dynamic"],
                    help="fixed:SECONDS or dynamic (starts from the config's grace.window_s)")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/bench-dataplane/grace"))
    args = ap.parse_args(argv)

    from dips.spec import load_config

    cfg = load_config(args.config)
    cfg = cfg.model_copy(update={"inner": cfg.inner.model_copy(update={"H": args.H})})
    print(f"{len(SLOWDOWNS)} clusters (slowdowns {list(SLOWDOWNS.values())}), "
          f"{cfg.followers} followers, H={args.H}, {args.seconds:.0f} s of training per setting",
          flush=True)
    results = {}
    for w in args.windows:
        mode, _, sec = w.partition(":")
        window = float(sec) if sec else cfg.grace.window_s
        results[w] = r = run_one(cfg, mode, window, args.seconds, args.run_dir / w.replace(":", "-"))
        print(f"  {w:12s}: fast clusters idle {r['fast_idle_share']:.1%} of wall time "
              f"({r['fast_idle_s_per_sync']:.2f} s per sync), {r['outer_steps']} outer steps "
              f"({r['clusters_per_step']:.2f} clusters each), mean staleness "
              f"{r['mean_staleness'] if r['mean_staleness'] is None else round(r['mean_staleness'], 2)}, "
              f"mean window {r['window_s_mean']:.3f} s; last estimate {r['last_grace']}", flush=True)
    print("RESULT " + json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    main()
