"""Tests of the pseudo-gradient and the Nesterov outer step (§6, §12 of the seed)."""

from __future__ import annotations

import math

import pytest
import torch

from dips.algo.outer import OuterConfig, nesterov_step, pseudo_gradient, round_state_

SHAPES = [(4, 3), (7,), (2, 3, 5), (), (1, 1)]


def make(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("lr,momentum,scales", [
    (0.7, 0.8, [1.0] * 5),
    (0.7, 0.8, [0.3, 1.0, 0.05, 0.9, 1.0]),
    (0.1, 0.0, [0.5] * 5),
])
def test_matches_torch_sgd_nesterov_over_five_steps(lr, momentum, scales, foreach):
    start = make(SHAPES, 0)
    ours = [p.clone() for p in start]
    bufs = [torch.zeros_like(p) for p in start]
    ref = [torch.nn.Parameter(p.clone()) for p in start]
    opt = torch.optim.SGD(ref, lr=lr, momentum=momentum, nesterov=momentum > 0,
                          dampening=0, weight_decay=0, foreach=foreach)
    for step, scale in enumerate(scales):
        grads = make(SHAPES, 100 + step)
        kept = [g.clone() for g in grads]
        nesterov_step(ours, bufs, grads, lr=lr, momentum=momentum, scale=scale)
        for g, k in zip(grads, kept):
            assert torch.equal(g, k)  # grads are read only
        for p, g in zip(ref, grads):
            p.grad = g * scale if scale != 1.0 else g.clone()
        opt.step()
        for k, (a, b) in enumerate(zip(ours, ref)):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0,
                                       msg=f"step {step} tensor {k}")
    for a, b in zip(bufs, ref):
        if momentum > 0:
            torch.testing.assert_close(a, opt.state[b]["momentum_buffer"], rtol=0, atol=0)


def test_first_step_hand_computed():
    p, m = [torch.tensor([1.0, 2.0])], [torch.zeros(2)]
    nesterov_step(p, m, [torch.tensor([0.5, -1.0])], lr=0.7, momentum=0.8, scale=0.5)
    # g = (0.25, -0.5); buf = g; θ -= 0.7*(g + 0.8 g) = 0.7*1.8*g
    torch.testing.assert_close(m[0], torch.tensor([0.25, -0.5]))
    torch.testing.assert_close(p[0], torch.tensor([1.0 - 1.26 * 0.25, 2.0 + 1.26 * 0.5]))


def test_step_errors_leave_inputs_untouched():
    p, m, g = [torch.ones(3)], [torch.zeros(3)], [torch.ones(3)]
    with pytest.raises(ValueError, match="length"):
        nesterov_step(p, m, g + g, lr=0.7, momentum=0.8)
    with pytest.raises(ValueError, match=r"grads\[0\].*bfloat16"):
        nesterov_step(p, m, [torch.ones(3, dtype=torch.bfloat16)], lr=0.7, momentum=0.8)
    with pytest.raises(ValueError, match=r"params\[0\].*float64"):
        nesterov_step([torch.ones(3, dtype=torch.float64)], m, g, lr=0.7, momentum=0.8)
    with pytest.raises(ValueError, match=r"tensor 0.*\(4,\)"):
        nesterov_step(p, m, [torch.ones(4)], lr=0.7, momentum=0.8)
    with pytest.raises(ValueError, match="momentum"):
        nesterov_step(p, m, g, lr=0.7, momentum=1.0)
    with pytest.raises(ValueError, match="scale"):
        nesterov_step(p, m, g, lr=0.7, momentum=0.8, scale=math.nan)
    with pytest.raises(ValueError, match="lr"):
        nesterov_step(p, m, g, lr=-1.0, momentum=0.8)
    assert torch.equal(p[0], torch.ones(3)) and torch.equal(m[0], torch.zeros(3))


def test_pseudo_gradient_bf16_local_against_current_server():
    server = torch.tensor([1.0, 2.0, 3.0])
    local = torch.tensor([0.5, 2.5, 3.0], dtype=torch.bfloat16)
    delta = pseudo_gradient(server, local)
    assert delta.dtype == torch.float32
    torch.testing.assert_close(delta, server - local.float(), rtol=0, atol=0)
    assert torch.equal(server, torch.tensor([1.0, 2.0, 3.0]))
    out = torch.empty(3)
    assert pseudo_gradient(server, local, out=out) is out
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0.0]), rtol=0, atol=0)
    # Writing into the server buffer itself is allowed (aliasing is elementwise-safe).
    s2 = server.clone()
    pseudo_gradient(s2, local, out=s2)
    torch.testing.assert_close(s2, torch.tensor([0.5, -0.5, 0.0]), rtol=0, atol=0)


def test_pseudo_gradient_errors():
    with pytest.raises(ValueError, match="server.*bfloat16"):
        pseudo_gradient(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))
    with pytest.raises(ValueError, match=r"local shape \(3,\) != server shape \(2,\)"):
        pseudo_gradient(torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError, match="local.*int64"):
        pseudo_gradient(torch.ones(2), torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="out.*float16"):
        pseudo_gradient(torch.ones(2), torch.ones(2), out=torch.empty(2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out shape \(3,\)"):
        pseudo_gradient(torch.ones(2), torch.ones(2), out=torch.empty(3))


def test_outer_config_defaults_and_validation():
    cfg = OuterConfig()
    assert (cfg.lr, cfg.momentum, cfg.max_norm) == (0.7, 0.8, 1.0)
    assert OuterConfig(max_norm=None).max_norm is None
    assert OuterConfig(max_norm=math.inf).max_norm == math.inf
    for kwargs, field in [({"lr": 0.0}, "lr"), ({"lr": math.nan}, "lr"),
                          ({"momentum": 1.0}, "momentum"), ({"momentum": -0.1}, "momentum"),
                          ({"max_norm": 0.0}, "max_norm"), ({"max_norm": math.nan}, "max_norm")]:
        with pytest.raises(ValueError, match=field):
            OuterConfig(**kwargs)


def test_fused_step_matches_sgd_reference_over_several_steps():
    import torch

    from dips.algo.outer import nesterov_step_fused

    g = torch.Generator().manual_seed(7)
    shapes = [(33, 7), (5,), (4, 3, 2)]
    ref = [torch.randn(s, generator=g) for s in shapes]
    ours = [t.clone() for t in ref]
    moms = [torch.zeros_like(t) for t in ref]
    opt = torch.optim.SGD([t.requires_grad_() for t in ref], lr=0.7, momentum=0.8, nesterov=True)
    for step in range(5):
        grads = [torch.randn(s, generator=g) for s in shapes]
        scale = [1.0, 0.37, 0.9, 0.5, 0.123][step]
        for r, gr in zip(ref, grads):
            r.grad = gr * scale
        opt.step()
        nesterov_step_fused(ours, moms, grads, 0.7, 0.8, scale=scale)
        for r, o in zip(ref, ours):
            torch.testing.assert_close(o, r.detach(), rtol=1e-6, atol=1e-6)


def test_fused_step_refuses_bad_scale():
    import pytest
    import torch

    from dips.algo.outer import nesterov_step_fused

    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="scale = 0"):
        nesterov_step_fused(p, [torch.zeros(3)], [torch.ones(3)], 0.7, 0.8, scale=0.0)
    assert torch.equal(p[0], torch.zeros(3))


def test_round_state_to_bf16_by_hand():
    # BF16 keeps 8 significant bits: the spacing above 1 is 2^-7. 1 + 2^-8 is half-way
    # between 1 and 1 + 2^-7 and rounds to the even one (1); 1 + 3·2^-8 is half-way between
    # 1 + 2^-7 and 1 + 2^-6 and rounds to the even one (1 + 2^-6); 0.1 -> 0.10009765625
    # (0x3DCD); 3.0 and -2^-20 are exact.
    t = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 0.1, 3.0, -2 ** -20], dtype=torch.float32)
    m = torch.tensor([1 + 2 ** -9], dtype=torch.float32)
    round_state_([t, m], "bf16")
    assert t.tolist() == [1.0, 1 + 2 ** -6, 0.10009765625, 3.0, -2 ** -20]
    assert m.tolist() == [1.0] and t.dtype == m.dtype == torch.float32


def test_round_state_fp32_changes_nothing_and_bad_input_is_named():
    t = torch.tensor([0.1, 1 + 2 ** -8])
    before = t.clone()
    round_state_([t], "fp32")
    assert torch.equal(t, before)
    with pytest.raises(ValueError, match="state_dtype = 'fp16'"):
        round_state_([t], "fp16")
    with pytest.raises(ValueError, match=r"tensors\[1\] must be a torch.float32"):
        round_state_([t, t.to(torch.bfloat16)], "bf16")
    assert torch.equal(t, before)  # refused before anything was rounded
