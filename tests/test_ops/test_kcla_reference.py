"""Every plain implementation of KCLA against ``kcla_mm.ops.kcla_reference``, in float64.

The reference is the paper's order with raw sums; the operator keeps
``(mean, log z)`` and rearranges the tail. Eval and training, forward and
backward, init layers, drop path, the recomputed tail (hand-derived backward
and autograd replay). The fused kernels are checked against the same reference
in ``tests/test_ops/test_fused``.
"""
import pytest
import torch

import kcla_mm.ops as ops
from kcla_mm.ops import KCLA, KCLAState
from kcla_mm.ops.kcla_reference import as_raw, as_state, cross_stage_adapt, kcla_step
from kcla_mm.ops.recompute import autograd_replay

F64 = torch.float64


def _layers(drop_path=0.0, clamp=10.0, recompute_tail=True):
    """Three steps: a first block, a block with a state, a stage's init layer."""
    torch.manual_seed(0)
    kw = dict(head_dim=8, drop_path=drop_path, clamp=clamp, recompute_tail=recompute_tail)
    layers = [KCLA(32, **kw), KCLA(32, **kw),
              KCLA(64, renorm=True, prev_channels=32, stride=2, **kw)]
    for m in layers:
        for n in (m.norm, m.norm_u):
            if n is not None:  # non-trivial affine and running statistics
                n.weight.data.uniform_(0.5, 1.5)
                n.bias.data.uniform_(-0.2, 0.2)
                n.running_mean.uniform_(-0.1, 0.1)
                n.running_var.uniform_(0.5, 2.0)
    return [m.double() for m in layers]


def _inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.rand(2, 32, 6, 6, generator=g, dtype=F64) * 3,
            torch.rand(2, 32, 6, 6, generator=g, dtype=F64) * 2,
            torch.rand(2, 64, 3, 3, generator=g, dtype=F64)]


def _run_ops(layers, xs):
    outs, state = [], None
    for m, x in zip(layers, xs):
        torch.manual_seed(7)  # the same drop-path draws as the reference
        out, state = m(x, state)
        outs.append(out)
    return outs, state


def _run_reference(layers, xs):
    outs, raw = [], None
    for m, x in zip(layers, xs):
        torch.manual_seed(7)
        out, raw = kcla_step(m, x, raw)
        outs.append(out)
    return outs, raw


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('clamp', [10.0, None])
def test_eval_forward_equals_the_reference(clamp):
    layers = [m.eval() for m in _layers(clamp=clamp)]
    xs = _inputs()
    with ops.fused_kernels(False), torch.no_grad():
        outs, state = _run_ops(layers, xs)
    want, raw = _run_reference(layers, xs)
    for a, b in zip(outs, want):
        _close(a, b)
    _close(state.mean, as_state(raw).mean)
    _close(state.log_z, as_state(raw).log_z)


@pytest.mark.parametrize('recompute_tail', [True, False])
@pytest.mark.parametrize('drop_path', [0.0, 0.3])
def test_training_forward_and_gradients_equal_the_reference(recompute_tail, drop_path):
    results = []
    for use_ops in (True, False):
        layers = [m.train() for m in _layers(drop_path, recompute_tail=recompute_tail)]
        xs = [x.requires_grad_() for x in _inputs()]
        with ops.fused_kernels(False):
            outs, _ = (_run_ops if use_ops else _run_reference)(layers, xs)
        g = torch.Generator().manual_seed(3)
        loss = sum((o * torch.randn(o.shape, generator=g, dtype=F64)).sum() for o in outs)
        params = [p for m in layers for p in m.parameters()]
        grads = torch.autograd.grad(loss, xs + params, allow_unused=True)
        results.append((outs, grads))
    (outs, grads), (want, want_grads) = results
    for a, b in zip(outs, want):
        _close(a, b)
    for a, b in zip(grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            _close(a, b)


def test_autograd_replay_of_the_recomputed_tail_equals_the_reference():
    layers = [m.train() for m in _layers()]
    xs = [x.requires_grad_() for x in _inputs()]
    with ops.fused_kernels(False), autograd_replay():
        outs, _ = _run_ops(layers, xs)
        got = torch.autograd.grad(sum(o.square().sum() for o in outs), xs)
    layers = [m.train() for m in _layers()]
    xs = [x.detach().requires_grad_() for x in xs]
    want_outs, _ = _run_reference(layers, xs)
    want = torch.autograd.grad(sum(o.square().sum() for o in want_outs), xs)
    for a, b in zip(got, want):
        _close(a, b)


def test_cross_stage_adaptation_equals_the_reference():
    layers = [m.eval() for m in _layers()]
    xs = _inputs()
    with torch.no_grad():
        raw = kcla_step(layers[0], xs[0])[1]
        got = layers[2].renormalize(as_state(raw), xs[2])
        want = as_state(cross_stage_adapt(layers[2], raw, xs[2]))
    _close(got.mean, want.mean)
    _close(got.log_z, want.log_z)


def test_state_conversions_are_inverse():
    g = torch.Generator().manual_seed(0)
    state = KCLAState(torch.rand(2, 16, 3, 3, generator=g, dtype=F64),
                      torch.randn(2, 2, generator=g, dtype=F64) * 5)
    back = as_state(as_raw(state, head_dim=8))
    _close(back.mean, state.mean)
    _close(back.log_z, state.log_z)


def test_reference_overflows_where_the_operator_does_not():
    # the raw sums of the reference reach e^10 per block: float16 overflows
    # after a few blocks, the operator's (mean, log z) does not
    layer = KCLA(32, head_dim=8).eval()
    x = torch.full((1, 32, 4, 4), 30.0)
    with torch.no_grad():
        state, raw = None, None
        for _ in range(4):
            _, raw = kcla_step(layer, x, raw)
            _, state = layer(x, state)
    assert torch.isfinite(state.mean).all() and torch.isfinite(state.log_z).all()
    assert not torch.isfinite(raw[0].half()).all()
