"""`dips leader --insecure` runs (plaintext, claimed identities) and says so on stderr; with
neither --tls nor --insecure, or with both, it refuses to start (exit 2, one line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from dips.emu.launcher import free_port
from dips.wire.pb import control_pb2 as pb
from dips.wire.pki import Identity
from dips.wire.security import INSECURE_WARNING, Credentials
from dips.wire.services import leader_client

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _leader(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dips.cli", "leader", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))


def test_insecure_works_and_warns_and_the_flag_is_required(tmp_path):
    cfg = str(ROOT / "configs" / "tiny.yaml")
    neither = _leader(["--config", cfg, "--listen", "127.0.0.1:1", "--state-dir", str(tmp_path / "x")])
    _, err = neither.communicate(timeout=60)
    assert neither.returncode == 2 and "exactly one of --tls DIR" in err
    addr = f"127.0.0.1:{free_port()}"
    proc = _leader(["--config", cfg, "--listen", addr, "--state-dir", str(tmp_path / "leader"),
                    "--insecure"])
    client = leader_client(addr, Credentials.insecure(Identity.admin()), timeout_s=5)
    try:
        deadline = time.monotonic() + 180
        status = None
        while status is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = client.GetStatus(pb.StatusRequest())
            except grpc.RpcError:
                time.sleep(0.2)
        assert status is not None and status.version == 0
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and INSECURE_WARNING in err
