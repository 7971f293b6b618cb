"""Regenerate the README's "Operating a run" images from a real short run (issue 15).

    .venv/bin/python docs/operating/make_screenshots.py [--run-dir runs/operating] [--max-time 60]

It launches configs/tiny.yaml (3 clusters, 2 followers) with ``evaluate: {every: 4}`` and a
small fault plan (cluster c killed, cluster b stopped long enough to be removed) for
``--max-time`` seconds of training; once the leader has recorded two faults, made 8 outer steps
and has a held-out loss, it takes one ``dips status`` screen over the operator's mutual-TLS
bundle (``RUN_DIR/pki/admin``), the same code as the command (rich ``Console(record=True)``,
``save_svg``), and converts it to PNG with ImageMagick when a working one is installed (the
project machine has none: the README shows the SVG). When the run has ended it runs ``dips report RUN_DIR`` and
copies its ``loss_vs_time.png`` and ``timeline.png``. Outputs, in this folder:
``status.svg``, ``status.png``, ``report_loss_vs_time.png``, ``report_timeline.png``,
``status.json`` (the ``--json`` object of the same look). It takes about two minutes on the
2-core project machine. Only the processes it started are stopped, by pid.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FAULTS = {"faults": [{"at_s": 12, "action": "kill", "target": "cluster-c"},
                     {"at_s": 20, "action": "stop", "target": "cluster-b", "duration_s": 5}]}


def _dips(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dips.cli", *args], cwd=ROOT, **kw)


def _look(run_dir: Path):
    """(the status screen's look function, close) over the leader's unix socket as admin."""
    from dips.node.status import Faults
    from dips.node.status_cli import looker
    from dips.wire.security import Credentials

    creds = Credentials.tls(run_dir / "pki" / "admin")
    return looker(f"unix:{run_dir / 'leader.sock'}", creds, 5.0, Faults())


def wait_for_screen(run_dir: Path, launcher: subprocess.Popen, deadline_s: float) -> dict:
    """The first status (polled every second) with two faults, 8 outer steps and a held-out
    loss; the last one seen if the run ends or ``deadline_s`` passes first."""
    from dips.node.status_cli import NoStatus

    doc, look, close = None, None, None
    deadline = time.monotonic() + deadline_s
    try:
        while time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(1.0)
            if not (run_dir / "leader.sock").exists() or not (run_dir / "pki" / "admin").exists():
                continue
            if look is None:
                look, close = _look(run_dir)
            try:
                doc = look()
            except NoStatus:
                continue
            if len(doc["faults"]) >= 2 and doc["outer_steps"] >= 8 and doc["heldout"]:
                break
    finally:
        if close is not None:
            close()
    if doc is None:
        raise SystemExit("the leader never answered: see the launcher's output")
    return doc


def offline_svg(text: str) -> str:
    """``text`` (rich's SVG export) without its ``@font-face`` rules, which fetch Fira Code
    from a CDN when the SVG is viewed: the page falls back to a local monospace font."""
    return re.sub(r"\s*@font-face\s*\{[^}]*\}", "", text)


def save_screen(doc: dict, out: Path) -> Path:
    """``status.svg`` (and ``status.png`` when ImageMagick is there) of ``doc``."""
    from rich.console import Console

    from dips.node.status_cli import render

    console = Console(record=True, width=132, force_terminal=True, color_system="truecolor",
                      file=open("/dev/null", "w"))
    console.print(render(doc))
    svg = out / "status.svg"
    svg.write_text(offline_svg(console.export_svg(title="dips status --leader … --tls pki/admin")))
    png = out / "status.png"
    png.unlink(missing_ok=True)
    convert = shutil.which("magick") or shutil.which("convert")
    if convert is not None and subprocess.run(
            [convert, "-density", "110", str(svg), str(png)], capture_output=True).returncode == 0:
        return png
    png.unlink(missing_ok=True)
    print("no working SVG-to-PNG converter (ImageMagick): the README shows status.svg")
    return svg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "operating")
    ap.add_argument("--max-time", type=float, default=60.0)
    args = ap.parse_args()
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["evaluate"] = {"every": 4}
    (run_dir.parent / "operating.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir.parent / "operating-faults.yaml").write_text(yaml.safe_dump(FAULTS))
    log = open(run_dir.parent / "operating-launch.log", "w")
    launcher = _dips("launch", "--config", str(run_dir.parent / "operating.yaml"),
                     "--run-dir", str(run_dir), "--max-time", str(args.max_time),
                     "--faults", str(run_dir.parent / "operating-faults.yaml"),
                     stdout=log, stderr=subprocess.STDOUT)
    try:
        doc = wait_for_screen(run_dir, launcher, deadline_s=args.max_time + 240.0)
        doc["leader"] = (run_dir / "leader.addr").read_text().strip()  # not the socket path
        (HERE / "status.json").write_text(json.dumps(doc, indent=1) + "\n")
        print("status screen:", save_screen(doc, HERE))
        code = launcher.wait(args.max_time + 300.0)
    finally:
        if launcher.poll() is None:  # ours: stop it (it stops its own children)
            launcher.send_signal(signal.SIGINT)
            launcher.wait(120)
        log.close()
    if code != 0:
        raise SystemExit(f"dips launch exited {code}: see {log.name}")
    subprocess.run([sys.executable, "-m", "dips.cli", "report", str(run_dir)], cwd=ROOT,
                   check=True)
    for name in ("loss_vs_time.png", "timeline.png"):
        shutil.copy(run_dir / "report" / name, HERE / f"report_{name}")
    print("report images:", *sorted(p.name for p in HERE.glob("report_*.png")))


if __name__ == "__main__":
    main()
