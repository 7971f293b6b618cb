"""A stage worker's staging path is the same code on CPU and GPU (issue 14): a push image is
the parameters narrowed to the wire dtype in reused host buffers (pinned only where CUDA is
available), and a pull lands on each parameter's own device before it is widened there."""

from __future__ import annotations

import pytest
import torch

from dips.roles.cluster import DeviceLanding, StageWorker, host_buffer
from dips.wire.keys import MemberKey

pytestmark = pytest.mark.timeout(60)


def _worker(device: str, dtype: str = "bf16") -> tuple[StageWorker, list]:
    torch.manual_seed(0)
    params = [("l.w", torch.nn.Parameter(torch.randn(7, 5, device=device))),
              ("l.b", torch.nn.Parameter(torch.randn(5, device=device)))]
    key = MemberKey("k", bytes(32), False)
    return StageWorker(0, {"l": params}, key, {}, 5.0, dtype=dtype), params


def test_host_buffers_are_pinned_only_where_cuda_is_available():
    buf = host_buffer((3, 4), torch.bfloat16)
    assert buf.device.type == "cpu" and buf.dtype == torch.bfloat16 and buf.shape == (3, 4)
    assert buf.is_pinned() == torch.cuda.is_available()


@pytest.mark.parametrize("dtype, wire", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_a_push_image_is_the_parameters_in_the_wire_dtype_in_reused_host_buffers(dtype, wire):
    worker, params = _worker("cpu", dtype)
    image = worker._image("l")
    assert [n for n, _ in image] == ["l.w", "l.b"]
    for (n, t), (_, p) in zip(image, params):
        assert t.device.type == "cpu" and t.dtype == wire
        assert torch.equal(t, p.detach().to(wire))
    with torch.no_grad():
        params[0][1].add_(1.0)
    again = worker._image("l")
    assert again[0][1].data_ptr() == image[0][1].data_ptr()  # the same buffer, refilled
    assert torch.equal(again[0][1], params[0][1].detach().to(wire))


def test_a_pull_lands_on_each_parameters_device_and_widens_there():
    host = {"a": torch.randn(4).to(torch.bfloat16), "b": torch.randn(2).to(torch.bfloat16)}
    landing = DeviceLanding(host, {"a": torch.device("cpu")})
    assert set(landing) == {"a", "b"} and len(landing) == 2
    assert landing["a"] is host["a"] and landing["b"] is host["b"]  # host params: no copy
    p = torch.zeros(4)
    p.copy_(landing["a"])
    assert torch.equal(p, host["a"].float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_pushes_stage_through_pinned_buffers_and_pulls_land_on_the_gpu():
    worker, params = _worker("cuda")
    image = worker._image("l")
    for (_, t), (_, p) in zip(image, params):
        assert t.device.type == "cpu" and t.is_pinned() and t.dtype == torch.bfloat16
        assert torch.equal(t, p.detach().to(torch.bfloat16).cpu())
    landing = DeviceLanding(dict(image), worker._devices(["l.w", "l.b"]))
    with torch.no_grad():
        for n, p in params:
            got = landing[n]
            assert got.device == p.device and got.dtype == torch.bfloat16
            p.copy_(got)
            assert torch.equal(p.cpu(), dict(image)[n].float())
