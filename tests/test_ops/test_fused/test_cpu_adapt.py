"""An init layer's adaptation of the incoming state by the fused CPU kernels.

``adapt_forward`` / ``adapt_backward`` (``kcla_mm.ops.fused.cpu_autograd.FusedAdapt``)
compute ``norm_u(adjust(m))`` and its global pool, and their gradients, in
place of the strided grouped convolution, BatchNorm and the pool
(``docs/method.md``, section 5). Reference: those torch modules under autograd
in float64; for a whole init layer's step, the plain step in float64.
"""
import copy

import pytest
import torch
from torch import nn
from utils import kernel_calls, randomize_norms

from kcla_mm.ops import KCLA, KCLAState, fused_kernels

# the fused kernels are optional: without their folder these tests skip
build = pytest.importorskip('kcla_mm.ops.fused.build')

CL = torch.channels_last

pytestmark = [
    pytest.mark.skipif(not build.available(),
                       reason=f'fused CPU kernels not built: {build.build_error()}'),
    pytest.mark.usefixtures('one_thread'),
]

#: the adaptation's kernels, forward and backward
ADAPT = ('adapt_forward', 'adapt_backward')


def relative_error(got, want):
    return float((got.double() - want.double()).abs().max() / (want.double().abs().max() + 1e-12))


def modules(c_prev, c, groups, stride, bn_train, momentum=0.1, seed=0):
    torch.manual_seed(seed)
    conv = nn.Conv2d(c_prev, c, 1, stride=stride, groups=groups, bias=False)
    norm = nn.BatchNorm2d(c, momentum=momentum)
    randomize_norms(norm, seed)
    return conv.to(memory_format=CL), norm.train(bn_train)


def eager(conv, norm, m, gu, gpool, dtype):
    """``(ubar, pooled, grads of m, w, gamma, beta, running stats)`` by torch modules."""
    conv, norm = copy.deepcopy(conv).to(dtype), copy.deepcopy(norm).to(dtype)
    m = m.to(dtype).requires_grad_()
    ubar = norm(conv(m))
    pooled = ubar.mean((2, 3))
    loss = (ubar * gu.to(dtype)).sum()
    if gpool is not None:
        loss = loss + (pooled * gpool.to(dtype)).sum()
    grads = torch.autograd.grad(loss, (m, conv.weight, norm.weight, norm.bias))
    return (ubar, pooled) + grads + (norm.running_mean, norm.running_var)


def fused(conv, norm, m, gu, gpool):
    norm = copy.deepcopy(norm)
    ubar, y, sums, pooled, mu, invstd = torch.ops.kcla_mm.adapt_forward(
        m, conv.weight.detach(), conv.stride[0], norm.weight.detach(), norm.bias.detach(),
        norm.running_mean, norm.running_var, norm.training,
        0.0 if not norm.training else norm.momentum, norm.eps)
    assert ubar.is_contiguous(memory_format=CL) and y.is_contiguous(memory_format=CL)
    gm, gw, gweight, gbias = torch.ops.kcla_mm.adapt_backward(
        gu, gpool, m, y, conv.weight.detach(), conv.stride[0], norm.weight.detach(), mu,
        invstd, norm.training)
    assert gm.is_contiguous(memory_format=CL) and gm.shape == m.shape
    # the weight's gradient as the (channels-last) weight: autograd's and DDP's
    # expectation, returned by FusedAdapt as it is
    w = conv.weight
    assert (gw.dtype, gw.shape, gw.stride()) == (w.dtype, w.shape, w.stride())
    return (ubar, pooled, gm, gw, gweight, gbias, norm.running_mean, norm.running_var)


NAMES = ('ubar', 'pooled', 'grad m', 'grad w', 'grad gamma', 'grad beta', 'running mean',
         'running var')


def assert_as_accurate_as_float32(conv, norm, m, gu, gpool):
    """The kernels' outputs, each within 4x (+1e-6) of float32 torch's error against float64's."""
    want = eager(conv, norm, m, gu, gpool, torch.float64)
    ref32 = eager(conv, norm, m, gu, gpool, torch.float32)
    got = fused(conv, norm, m, gu, gpool)
    for name, x, r, y in zip(NAMES, got, ref32, want):
        err, err32 = relative_error(x, y), relative_error(r, y)
        assert err <= 4 * err32 + 1e-6, (name, err, err32)
    return got


# (B, C_prev, H, W, C, groups, stride): the vector paths of 32 and 16 inputs
# per group (ResNet-50's init layers have 32), other group widths, odd sizes
# whose last row and column the stride reads, stride 1
@pytest.mark.parametrize('b,c_prev,h,w,c,groups,stride', [
    (2, 256, 12, 12, 512, 8, 2),
    (2, 64, 7, 9, 128, 4, 2),
    (3, 24, 5, 6, 48, 3, 2),
    (2, 40, 6, 5, 40, 5, 1),
    (2, 32, 9, 9, 64, 2, 3),
])
@pytest.mark.parametrize('bn_train', [True, False])
def test_adapt_equals_adjust_batchnorm_and_pool(b, c_prev, h, w, c, groups, stride, bn_train):
    conv, norm = modules(c_prev, c, groups, stride, bn_train)
    g = torch.Generator().manual_seed(1)
    m = (torch.randn(b, c_prev, h, w, generator=g) + 0.3).contiguous(memory_format=CL)
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    gu = torch.randn(b, c, ho, wo, generator=g).contiguous(memory_format=CL)
    gpool = torch.randn(b, c, generator=g)
    got = assert_as_accurate_as_float32(conv, norm, m, gu, gpool)
    # the convolution reads every stride-th pixel: the gradient is 0 elsewhere, exactly
    off = torch.ones(h, w, dtype=torch.bool)
    off[::stride, ::stride] = False
    assert torch.equal(got[2][:, :, off], torch.zeros_like(got[2][:, :, off]))
    if not bn_train:  # running statistics read, not updated
        assert torch.equal(got[6], norm.running_mean) and torch.equal(got[7], norm.running_var)


@pytest.mark.parametrize('offset', [10.0, 1000.0])
def test_adapt_accurate_where_the_adjusted_map_is_far_from_zero(offset):
    # a flat incoming state far from zero and a positive adjust: y's spread is
    # about 1e-6 of its mean or less, and BatchNorm's statistics and gradient
    # sums must be taken about the mean (sums of y and y^2 would cancel: the
    # variance came out wrong by 100%, the output by units, before they were)
    conv, norm = modules(64, 128, 4, 2, True)
    with torch.no_grad():
        conv.weight.uniform_(0.5, 1.5).div_(16)
    g = torch.Generator().manual_seed(1)
    m = (torch.rand(2, 64, 32, 32, generator=g) * 0.1 + offset).contiguous(memory_format=CL)
    gu = torch.randn(2, 128, 16, 16, generator=g).contiguous(memory_format=CL)
    gpool = torch.randn(2, 128, generator=g)
    assert_as_accurate_as_float32(conv, norm, m, gu, gpool)


def test_adapt_without_a_pool_gradient_is_with_a_zero_one():
    conv, norm = modules(64, 128, 2, 2, True)
    m = torch.randn(2, 64, 6, 6).contiguous(memory_format=CL)
    gu = torch.randn(2, 128, 3, 3).contiguous(memory_format=CL)
    got, zero = fused(conv, norm, m, gu, None), fused(conv, norm, m, gu, torch.zeros(2, 128))
    for name, a, z in zip(NAMES, got, zero):
        assert torch.equal(a, z), name
    want = eager(conv, norm, m, gu, None, torch.float64)
    assert relative_error(got[2], want[2]) < 1e-5


def make_init_layer(seed=0, momentum=0.1):
    torch.manual_seed(seed)
    layer = KCLA(128, head_dim=16, renorm=True, prev_channels=64, stride=2)
    layer.norm_u.momentum = momentum
    randomize_norms(layer, seed)
    return layer.train()


def init_step(layer, mean, log_z, x, dtype, fused):
    """Output, state and every gradient and buffer of an init layer's training step,
    and the fused kernels it called (a ``Counter``; ``None`` in float64, where
    the profiler would take seconds)."""
    layer = copy.deepcopy(layer).to(dtype)
    if dtype == torch.float64:  # plain autograd, no recomputation at all
        layer.recompute_tail = False
    mean = mean.to(dtype).contiguous(memory_format=CL).requires_grad_()
    log_z = log_z.clone().requires_grad_()
    x = x.to(dtype).contiguous(memory_format=CL).requires_grad_()

    def step():
        with fused_kernels(fused):
            out, new = layer(x, KCLAState(mean, log_z))
        g = torch.Generator().manual_seed(5)
        w_out, w_mean = (torch.randn(out.shape, generator=g).to(dtype) for _ in range(2))
        ((out * w_out).sum() + (new.mean * w_mean).sum() + new.log_z.float().sum()).backward()
        res = {'out': out, 'mean': new.mean, 'log_z': new.log_z, 'grad x': x.grad,
               'grad prev mean': mean.grad, 'grad prev log_z': log_z.grad}
        res.update({f'grad {n}': p.grad for n, p in layer.named_parameters()
                    if p.grad is not None})
        res.update({n: b for n, b in layer.named_buffers() if 'running' in n or 'tracked' in n})
        return res

    return kernel_calls(step) if dtype == torch.float32 else (step(), None)


@pytest.mark.parametrize('momentum,norm_u_train', [(0.1, True), (None, True), (0.1, False)])
def test_init_layer_training_step_adapts_by_the_kernels_as_accurately(momentum, norm_u_train):
    # norm_u_train=False: a frozen norm_u (e.g. mmdet's norm_eval) reads its
    # running statistics and neither updates them nor counts the batch
    layer = make_init_layer(momentum=momentum)
    layer.norm_u.train(norm_u_train)
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(2, 64, 8, 8, generator=g) + 0.5
    log_z = torch.randn(2, 4, generator=g)  # the previous stage's 4 heads of 16 channels
    x = torch.rand(2, 128, 4, 4, generator=g)
    want, _ = init_step(layer, mean, log_z, x, torch.float64, False)
    plain32, kernels = init_step(layer, mean, log_z, x, torch.float32, False)
    assert not kernels
    got, kernels = init_step(layer, mean, log_z, x, torch.float32, True)
    assert kernels == {'adapt_forward': 1, 'adapt_backward': 1, 'step_forward': 1,
                       'step_backward': 1}
    assert got.keys() == want.keys()
    for k in want:
        if want[k] is None:  # the incoming log z: replaced by the re-keying
            assert got[k] is None, k
            continue
        if 'tracked' in k:  # counted once, as nn.BatchNorm2d counts
            expected = 0 if k.startswith('norm_u') and not norm_u_train else 1
            assert int(got[k]) == int(want[k]) == expected, k
            continue
        err, err32 = relative_error(got[k], want[k]), relative_error(plain32[k], want[k])
        assert err <= 4 * err32 + 1e-5, (k, err, err32)


def test_backbone_training_adapts_at_each_stage_by_the_kernels():
    from kcla_mm.models.backbones.mmdet_kcla_resnet import KCLAResNet  # needs mmdet
    model = KCLAResNet(depth=50, base_channels=8, head_dim=8, norm_eval=False).train()
    init_layers = [m for m in model.layer_attn_modules() if m.adjust is not None]
    # a forward hook on each adjust convolution: called only where it runs as a module
    adjusted = []
    for m in init_layers:
        m.adjust.register_forward_hook(lambda *a: adjusted.append(1))

    def step():
        outs = model(torch.rand(2, 3, 64, 64))
        sum(o.sum() for o in outs).backward()

    _, kernels = kernel_calls(step)
    assert len(init_layers) == 3 and not adjusted
    assert kernels['adapt_forward'] == kernels['adapt_backward'] == 3
    assert all(m.adjust.weight.grad is not None and m.norm_u.weight.grad is not None
               for m in init_layers)


@pytest.mark.parametrize('case', ['float64', 'autocast', 'switched off', 'no_grad', 'nchw state'])
def test_adapt_kernels_not_used_where_they_do_not_apply(case):
    layer = make_init_layer()
    mean = torch.randn(2, 64, 8, 8).contiguous(memory_format=CL)
    log_z, x = torch.randn(2, 4), torch.rand(2, 128, 4, 4).contiguous(memory_format=CL)
    if case == 'float64':
        layer, mean, log_z, x = layer.double(), mean.double(), log_z, x.double()
    elif case == 'nchw state':
        mean = mean.contiguous()
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=case == 'autocast'), \
            torch.set_grad_enabled(case != 'no_grad'), fused_kernels(case != 'switched off'):
        _, kernels = kernel_calls(layer, x, KCLAState(mean, log_z))
    assert not kernels.keys() & set(ADAPT)


def test_adapt_kernels_reject_bad_arguments():
    conv, norm = modules(64, 128, 2, 2, True)
    m = torch.randn(2, 64, 6, 6).contiguous(memory_format=CL)
    args = (norm.weight.detach(), norm.bias.detach(), norm.running_mean.clone(),
            norm.running_var.clone(), True, 0.1, 1e-5)
    ops = torch.ops.kcla_mm
    with pytest.raises(RuntimeError, match='m must be channels-last'):
        ops.adapt_forward(m.contiguous(), conv.weight.detach(), 2, *args)
    with pytest.raises(RuntimeError, match=r'w must be .*\[128, 32, 3, 3\]'):
        ops.adapt_forward(m, torch.randn(128, 32, 3, 3), 2, *args)
    with pytest.raises(RuntimeError, match=r'w of shape \[128, 24, 1, 1\] .* 64 channels'):
        ops.adapt_forward(m, torch.randn(128, 24, 1, 1), 2, *args)
    with pytest.raises(RuntimeError, match='stride must be positive, got 0'):
        ops.adapt_forward(m, conv.weight.detach(), 0, *args)
    ubar, y, _, _, mu, invstd = ops.adapt_forward(m, conv.weight.detach(), 2, *args)
    with pytest.raises(RuntimeError, match=r'gu has shape \[2, 128, 2, 2\]'):
        ops.adapt_backward(torch.zeros(2, 128, 2, 2).contiguous(memory_format=CL), None, m, y,
                           conv.weight.detach(), 2, norm.weight.detach(), mu, invstd, True)
    with pytest.raises(RuntimeError, match='gpool must be'):
        ops.adapt_backward(torch.zeros_like(y), torch.zeros(3, 128), m, y, conv.weight.detach(),
                           2, norm.weight.detach(), mu, invstd, True)
