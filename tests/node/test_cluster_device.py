"""``--device`` of ``dips cluster`` (issue 14): a device this host cannot use is refused at
start, naming the value, before the leader is even asked (exit 2)."""

from __future__ import annotations

import pytest
import torch

from dips.emu.launcher import free_port

from .roles import dips

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("device, words", [
    pytest.param("cuda", "device = 'cuda', but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    ("gpu", "device = 'gpu': expected cpu, cuda or cuda:N"),
])
def test_a_device_that_cannot_be_used_is_refused_at_start(tmp_path, device, words):
    p = dips(["cluster", "--leader", f"127.0.0.1:{free_port()}", "--cluster-id", "a",
              "--state-dir", str(tmp_path / "a"), "--insecure", "--device", device])
    try:
        out, err = p.communicate(timeout=100)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode == 2 and f"dips cluster: {words}" in err, (out + err)[-2000:]
