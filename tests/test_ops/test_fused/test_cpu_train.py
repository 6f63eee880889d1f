"""The fused CPU training step of KCLA and of a residual block's end.

``kcla_mm.ops.fused.cpu_autograd``: ``FusedStep`` (a whole training step),
``BlockEnd`` and ``ResidualReluPool`` (a block's last norms, add and ReLU).
References: ``kcla_mm.ops.kcla_reference`` in float64, and plain autograd
through the plain operator (``kcla_mm.ops.fused_kernels(False)``) in float64.
The fused float32 step must be as accurate as the plain float32 step
(recomputed tail, the path it replaces), on outputs, the new state, every
gradient and BatchNorm's running statistics; at the backbone level it gives
the gradients of the plain path, with the first block output recomputed for
the next block's saved copies.
"""
import copy
import functools
import platform
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from utils import Doubled, kcla_layer, kernel_calls, kernels_called, randomize_norms

from kcla_mm.ops import KCLA, KCLAState, fused_kernels, residual_end
from kcla_mm.ops.kcla_reference import as_state, kcla_step

# the fused kernels are optional: without their folder these tests skip
build = pytest.importorskip('kcla_mm.ops.fused.build')
cpu_autograd = pytest.importorskip('kcla_mm.ops.fused.cpu_autograd')

CL = torch.channels_last

pytestmark = [
    pytest.mark.skipif(not build.available(),
                       reason=f'fused CPU kernels not built: {build.build_error()}'),
    pytest.mark.usefixtures('one_thread'),
]

#: the kernels of one fused training step, forward and backward
STEP = {'step_forward': 1, 'step_backward': 1}


def cl(t):
    return t.contiguous(memory_format=CL)


def train_step(layer, x, state, dtype, fused, seed=3):
    """Output, state and every gradient and buffer of one step on a copy of
    ``layer``, and the fused kernels it called (a ``Counter``; ``None`` in
    float64, where the profiler would take seconds)."""
    layer = copy.deepcopy(layer).to(dtype)
    if dtype == torch.float64:  # plain autograd, no recomputation at all
        layer.recompute_tail = False
    x = cl(x.to(dtype)).requires_grad_()
    if state is not None:
        state = KCLAState(cl(state.mean.to(dtype)).requires_grad_(),
                          state.log_z.clone().requires_grad_())

    def step():
        with fused_kernels(fused):
            torch.manual_seed(seed)  # the same drop-path masks
            out, new = layer(x, state)
        g = torch.Generator().manual_seed(5)
        w_out, w_mean = (torch.randn(out.shape, generator=g).to(dtype) for _ in range(2))
        w_z = torch.randn(new.log_z.shape, generator=g).to(new.log_z.dtype)
        ((out * w_out).sum() + (new.mean * w_mean).sum() + (new.log_z * w_z).sum()).backward()
        res = {'out': out, 'mean': new.mean, 'log_z': new.log_z, 'grad x': x.grad}
        if state is not None:
            res['grad prev mean'], res['grad prev log_z'] = state.mean.grad, state.log_z.grad
        res.update({f'grad {n}': p.grad for n, p in layer.named_parameters()})
        res.update({n: b for n, b in layer.named_buffers() if 'running' in n})
        return res

    return kernel_calls(step) if dtype == torch.float32 else (step(), None)


def relative_errors(got, want):
    return {k: float((got[k].detach().double() - w.detach().double()).abs().max()
                     / (w.detach().double().abs().max() + 1e-12)) for k, w in want.items()}


def make(channels, head_dim, drop_path=0.0, momentum=0.1, seed=0, **kw):
    layer = kcla_layer(channels, head_dim, seed, drop_path=drop_path, **kw)
    layer.norm.momentum = momentum
    return layer.train()


def test_training_step_reads_parametrized_weights_as_the_module_does():
    # the fused training step reads weights from the modules' own tables
    # (member()); a parametrized one (a property, not in _parameters) is read as
    # the module computes it, and its gradient flows back to the original (a
    # parametrized norm is another class, which the kernels leave to the plain path)
    layer, doubled = make(64, 16), make(64, 16)
    names = ('wv', 'wq', 'phi')
    for name in names:
        parametrize.register_parametrization(getattr(layer, name), 'weight', Doubled())
        with torch.no_grad():
            getattr(doubled, name).weight.mul_(2)
    g = torch.Generator().manual_seed(2)
    x = cl(torch.rand(2, 64, 5, 6, generator=g))
    state = KCLAState(cl(torch.randn(2, 64, 5, 6, generator=g)), torch.randn(2, 4, generator=g))
    w_out = torch.randn(2, 64, 5, 6, generator=g)

    def step(net):
        out, new = net(x, state)
        ((out * w_out).sum() + new.mean.sum()).backward()
        return out

    outs = []
    for net in (doubled, layer):
        out, kernels = kernel_calls(step, net)
        assert kernels == STEP
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    for name in names:  # w = 2 original: d/d original = 2 d/dw
        want = getattr(doubled, name).weight.grad * 2
        got = getattr(layer, name).parametrizations.weight.original.grad
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# (batch, channels, head_dim, H, W): batch 1 with many rows runs in bands;
# 20 channels leave a tail past the last 16-wide vector; 2x1 maps
SHAPES = [(2, 64, 16, 8, 8), (1, 32, 16, 23, 5), (3, 48, 16, 5, 7), (1, 20, 4, 3, 3),
          (4, 32, 16, 2, 1)]


@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('with_state', [False, True])
@pytest.mark.parametrize('bn_train,drop_path,momentum', [(True, 0.0, 0.1), (True, 0.4, None),
                                                         (False, 0.0, 0.1)])
def test_training_step_as_accurate_as_the_plain_step(shape, with_state, bn_train, drop_path,
                                                     momentum):
    b, c, d, h, w = shape
    layer = make(c, d, drop_path, momentum)
    layer.norm.train(bn_train)  # eval-mode BN in a training layer: norm_eval
    g = torch.Generator().manual_seed(1)
    x = torch.rand(b, c, h, w, generator=g) * 3
    state = KCLAState(torch.randn(b, c, h, w, generator=g),
                      torch.randn(b, c // d, generator=g) * 2 + 4) if with_state else None
    want, _ = train_step(layer, x, state, torch.float64, False)
    plain, kernels = train_step(layer, x, state, torch.float32, False)
    assert not kernels
    got, kernels = train_step(layer, x, state, torch.float32, True)
    assert kernels == STEP
    assert got.keys() == want.keys() and all(v is not None for v in got.values())
    err_fused, err_plain = relative_errors(got, want), relative_errors(plain, want)
    for k in want:
        # as accurate as float32 autograd (a wrong term would be off by far more)
        assert err_fused[k] <= 4 * err_plain[k] + 2e-6, (k, err_fused[k], err_plain[k])
        assert err_fused[k] < 2e-3, (k, err_fused[k])
    if bn_train:  # the running statistics moved, once
        assert not torch.equal(got['norm.running_mean'], layer.norm.running_mean)


def _reference_layers(drop_path):
    """A first block, a block with a state and a stage's init layer (``adjust``, stride 2)."""
    return [make(32, 8, drop_path, seed=0), make(32, 8, drop_path, seed=1),
            make(64, 8, drop_path, seed=2, renorm=True, prev_channels=32, stride=2)]


def _steps(layers, mode):
    """Three steps in a row, their loss's gradients and the running statistics.

    ``mode``: ``'fused'`` (float32), ``'plain'`` (float32 torch ops) or
    ``'reference'`` (:func:`kcla_mm.ops.kcla_reference.kcla_step` in float64).
    Returns the results and the fused kernels called (``None`` in float64).
    """
    dtype = torch.float64 if mode == 'reference' else torch.float32
    layers = [copy.deepcopy(m).to(dtype) for m in layers]
    g = torch.Generator().manual_seed(4)
    xs = [cl(torch.rand(2, 32, 8, 8, generator=g) * 3), cl(torch.rand(2, 32, 8, 8, generator=g)),
          cl(torch.rand(2, 64, 4, 4, generator=g) * 2)]
    xs = [x.to(dtype).requires_grad_() for x in xs]

    def run():
        outs, state, raw = [], None, None
        with fused_kernels(mode == 'fused'):
            for i, (layer, x) in enumerate(zip(layers, xs)):
                torch.manual_seed(10 + i)  # the drop-path draws of the float32 steps
                if mode == 'reference':
                    keep = layer.drop_path.keep_mask(x.float())
                    out, raw = kcla_step(layer, x, raw, None if keep is None else keep.double())
                else:
                    out, state = layer(x, state)
                outs.append(out)
        if mode == 'reference':
            state = as_state(raw)
        g = torch.Generator().manual_seed(5)
        loss = sum((t * torch.randn(t.shape, generator=g).to(t.dtype)).sum()
                   for t in outs + [state.mean, state.log_z])
        loss.backward()
        res = {f'out {i}': o for i, o in enumerate(outs)}
        res.update({'mean': state.mean, 'log_z': state.log_z})
        res.update({f'grad x {i}': x.grad for i, x in enumerate(xs)})
        for i, layer in enumerate(layers):
            res.update({f'grad {i}.{n}': p.grad for n, p in layer.named_parameters()})
            res.update({f'{i}.{n}': b for n, b in layer.named_buffers() if 'running' in n})
        return res

    return kernel_calls(run) if dtype == torch.float32 else (run(), None)


@pytest.mark.parametrize('drop_path', [0.0, 0.3])
def test_training_steps_and_gradients_match_the_reference_in_float64(drop_path):
    # a first block, a block with a state and an init layer by the kernels
    # (float32; the init layer's adaptation by adapt_forward/adapt_backward)
    # against kcla_mm.ops.kcla_reference on the same layers in float64: the
    # paper's raw sums u and z, the modules called one after the other, plain
    # autograd. Outputs, the last state, the gradients of every x and every
    # parameter, the running statistics: as accurate as the plain float32 steps.
    layers = _reference_layers(drop_path)
    want, _ = _steps(layers, 'reference')
    plain, kernels = _steps(layers, 'plain')
    assert not kernels
    got, kernels = _steps(layers, 'fused')
    assert kernels == {'step_forward': 3, 'step_backward': 3, 'adapt_forward': 1,
                       'adapt_backward': 1}
    assert got.keys() == want.keys() and all(v is not None for v in got.values())
    assert {'grad 2.adjust.weight', 'grad 2.wk_u.weight', 'grad 2.norm_u.bias'} <= want.keys()
    err_fused, err_plain = relative_errors(got, want), relative_errors(plain, want)
    for k in want:
        assert err_fused[k] <= 4 * err_plain[k] + 2e-6, (k, err_fused[k], err_plain[k])
        assert err_fused[k] < 2e-3, (k, err_fused[k])


@pytest.mark.parametrize('offset', [0.0, 1000.0])
def test_batch_statistics_accurate_on_large_maps_far_from_zero(offset):
    # a flat 200x200 map far from zero and a smoothing value convolution: the
    # batch variance is small against the mean squared, so the per-channel
    # sums lose digits to cancellation, and their float partial sums must stay
    # short (flush_after; every 8 rows of 200 pixels measured 4.5e-3 on the
    # running variance, ATen 1.4e-4); momentum 1: the running statistics are
    # the batch's
    layer = make(16, 16, momentum=1.0)
    with torch.no_grad():
        layer.wv.weight.fill_(1 / 9)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1, 16, 200, 200, generator=g) * 0.1 + offset
    state = KCLAState(torch.rand(1, 16, 200, 200, generator=g) * 0.1 + offset,
                      torch.randn(1, 1, generator=g) * 2 + 4)
    want, _ = train_step(layer, x, state, torch.float64, False)
    plain, _ = train_step(layer, x, state, torch.float32, False)
    got, kernels = train_step(layer, x, state, torch.float32, True)
    assert kernels == STEP
    err, err_plain = relative_errors(got, want), relative_errors(plain, want)
    assert err['norm.running_var'] < 1e-4 and err['norm.running_mean'] < 1e-6, err
    assert err['out'] < 1e-6, err
    for k in ('grad x', 'grad prev mean', 'grad norm.weight', 'grad wv.weight'):
        assert err[k] <= 4 * err_plain[k] + 1e-5, (k, err[k], err_plain[k])


def _backbone(**kwargs):
    # built lazily: only these tests need mmdet
    from kcla_mm.models.backbones.mmdet_kcla_resnet import KCLAResNet
    return KCLAResNet(**kwargs)


def test_backbone_training_step_as_accurate_as_float64():
    # every step of a training backbone, init layers (prev = the adapted state)
    # included; the steps with a state keep their output and take x as out
    # minus keep relu(o) in the backward pass, the first step (its state is x)
    # keeps x and its output is recomputed for the next block's saved copy.
    # Reference: the same backbone in float64 (where the kernels do not apply).
    torch.manual_seed(0)
    model = _backbone(depth=50, base_channels=8, head_dim=8, norm_eval=False,
                      layer_attn=dict(type='KCLA', drop_path=0.2)).train()
    randomize_norms(model)
    x = torch.rand(2, 3, 64, 64)
    results, first_nodes = [], []

    def step(net, dtype):
        torch.manual_seed(1)  # the same drop-path masks
        outs = net(x.to(dtype))
        sum((o * torch.linspace(-1, 1, o.numel(), dtype=dtype).view_as(o)).sum()
            for o in outs).backward()
        return outs

    for dtype, fused in ((torch.float64, False), (torch.float32, False), (torch.float32, True)):
        net = copy.deepcopy(model).to(dtype)
        net.layer_attn_modules()[0].register_forward_hook(
            lambda mod, inp, out: first_nodes.append(out[0].grad_fn))
        with fused_kernels(fused):
            # (the profiler: float32 only, it would take seconds in float64)
            outs, kernels = (kernel_calls(step, net, dtype) if dtype == torch.float32
                             else (step(net, dtype), None))
        res = {f'out {i}': o for i, o in enumerate(outs)}
        res.update({n: p.grad for n, p in net.named_parameters()})
        res.update({n: b for n, b in net.named_buffers() if 'running' in n})
        results.append(res)
        if fused:
            # every step and block end by the kernels, forward and backward;
            # and only the first step's output recomputed (train_apply), once
            assert kernels == {'step_forward': 16, 'step_backward': 16, 'adapt_forward': 3,
                               'adapt_backward': 3, 'block_end_forward': 16,
                               'block_end_backward': 16, 'train_apply': 1}
        elif dtype == torch.float32:
            assert not kernels
    first = first_nodes[-1]  # the fused first step: keeps x, its output released
    assert isinstance(first, cpu_autograd.FusedStep._backward_cls) and not first.keeps_output
    assert getattr(first, 'kcla_output', None) is None
    want, plain, got = results
    assert got.keys() == want.keys() and all(v is not None for v in got.values())
    err_fused, err_plain = relative_errors(got, want), relative_errors(plain, want)
    for k in want:
        assert err_fused[k] <= 4 * err_plain[k] + 1e-5, (k, err_fused[k], err_plain[k])
        # and under 1e-2 where the plain float32 step is well under it (where
        # rounding flips a ReLU mask, both float32 steps are off about as
        # much: layer4's BatchNorms see 8 values per channel at this size)
        if err_plain[k] < 5e-3:
            assert err_fused[k] < 1e-2, (k, err_fused[k], err_plain[k])


def _blocks(model):
    return [b for name in model.res_layers for b in getattr(model, name)]


def test_training_keeps_kcla_outputs_and_relu_masks_not_block_outputs():
    # after the forward pass of a training backbone, the block outputs x (the
    # ReLU's, KCLA's input) are gone but the first, which is the first state;
    # each step with a state keeps its output (the next block keeps it anyway),
    # each block's last ReLU a one-bit mask
    torch.manual_seed(0)
    model = _backbone(depth=50, base_channels=8, head_dim=8, norm_eval=False).train()
    steps, xs = [], []
    hooks = [m.register_forward_hook(lambda mod, inp, out: steps.append(out[0]))
             for m in model.layer_attn_modules()]
    hooks += [b.register_forward_hook(lambda mod, inp, out: xs.append(weakref.ref(out)))
              for b in _blocks(model)]
    outs = model(torch.rand(2, 3, 64, 64))
    for h in hooks:
        h.remove()
    assert len(xs) == len(steps) == 16
    assert [r() is not None for r in xs] == [True] + [False] * 15
    for i, y in enumerate(steps):
        node = y.grad_fn
        assert isinstance(node, cpu_autograd.FusedStep._backward_cls)
        assert node.keeps_output is (i > 0)
        kept = node.saved_tensors[0]
        assert (kept.data_ptr() == y.data_ptr()) is (i > 0)
        relu = node.next_functions[0][0]  # x's node
        assert isinstance(relu, cpu_autograd.BlockEnd._backward_cls)
        mask = relu.saved_tensors[0]  # (and the norms' inputs, as they kept them)
        b, c, h, w = y.shape
        assert mask.dtype == torch.uint8 and mask.shape == (b, h, w, c // 8)
    sum(o.sum() for o in outs).backward()


def test_training_block_end_leaves_a_hooked_convolutions_output():
    # in training BlockEnd writes a new map: a forward hook holding the last
    # convolution's output keeps the fused block end (unlike inference, where
    # the output is written in place and the norm then runs as a module)
    torch.manual_seed(0)
    model = _backbone(depth=50, base_channels=8, head_dim=8, norm_eval=False).train()
    kept = []
    model.layer2[1].conv3.register_forward_hook(
        lambda mod, inp, out: kept.append((out, out.clone())))
    _, kernels = kernel_calls(model, torch.rand(2, 3, 64, 64))
    assert kernels['block_end_forward'] == 16 and torch.equal(kept[0][0], kept[0][1])


@pytest.mark.parametrize('use_pool', [True, False])
def test_residual_relu_pool_gradients_are_torchs(use_pool):
    # ResidualReluPool (residual_end without norms, with autograd): out += res;
    # out.relu_() and the pool, one node; its backward, (gx + gpool / (H W))
    # where the output is positive, reaches out and res as torch's add, ReLU
    # and mean send it (bit for bit)
    g = torch.Generator().manual_seed(4)
    base = cl(torch.randn(2, 32, 5, 6, generator=g)).requires_grad_()
    res = cl(torch.randn(2, 32, 5, 6, generator=g)).requires_grad_()
    w1 = cl(torch.randn(2, 32, 5, 6, generator=g))
    w1[0, 0, 0, :2] = -0.0
    w2 = torch.randn(2, 32, generator=g)

    def end():
        if use_pool:  # the pool: from the autograd function itself
            x, pooled = cpu_autograd.ResidualReluPool.apply(base * 1.0, res)
        else:
            x, pooled = residual_end(base * 1.0, res), None
        assert isinstance(x.grad_fn, cpu_autograd.ResidualReluPool._backward_cls)
        loss = (x * w1).sum() + ((pooled * w2).sum() if use_pool else 0)
        return x, pooled, torch.autograd.grad(loss, (base, res))

    (x, pooled, got), kernels = kernel_calls(end)
    assert kernels == {'residual_relu_pool_mask_': 1, 'relu_pool_backward': 1}
    out = base * 1.0
    out += res
    xr = out.relu_()
    torch.testing.assert_close(x, xr, rtol=0, atol=0)
    if use_pool:
        torch.testing.assert_close(pooled, xr.mean((2, 3)), rtol=1e-6, atol=1e-6)
    ref = (xr * w1).sum() + ((xr.mean((2, 3)) * w2).sum() if use_pool else 0)
    want = torch.autograd.grad(ref, (base, res))
    for a, b in zip(got, want):
        assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def _bn(c, training, seed, momentum=0.1):
    norm = torch.nn.BatchNorm2d(c, momentum=momentum).train(training)
    randomize_norms(norm, seed)
    with torch.no_grad():  # a mean large against the spread, weights of both signs
        norm.weight.mul_(torch.randn(c, generator=torch.Generator().manual_seed(seed)).sign())
    return norm


def _block_end(x, res, norm, res_norm, use_pool):
    """``(out, pooled)`` of :class:`BlockEnd` (``pooled`` ``None`` through ``residual_end``)."""
    if use_pool:  # the pool: from the autograd function itself
        return cpu_autograd.BlockEnd.apply(
            norm, res_norm, x, res, norm.weight, norm.bias,
            None if res_norm is None else res_norm.weight,
            None if res_norm is None else res_norm.bias)
    return residual_end(x, res, norm, res_norm), None


@pytest.mark.parametrize('c, hw', [(64, (9, 10)), (20, (5, 6)), (256, (14, 14))])
@pytest.mark.parametrize('shortcut_norm', [False, True])
@pytest.mark.parametrize('mode', ['train', 'eval', 'cumulative'])
@pytest.mark.parametrize('use_pool', [True, False])
def test_block_end_is_the_torch_ops_within_rounding(c, hw, shortcut_norm, mode, use_pool):
    # BlockEnd: relu(bn(x) + bn_res(res)) (or + res) and its pool, one node:
    # values, every gradient and the running statistics (num_batches_tracked,
    # momentum None: a cumulative average) those of the modules, the add and
    # the ReLU; the output of eval-mode norms bit for bit (ATen's affine), the
    # gradient of a plain res bit for bit (relu_pool_backward's)
    g = torch.Generator().manual_seed(c)
    training, momentum = mode != 'eval', (None if mode == 'cumulative' else 0.1)
    norm = _bn(c, training, 1, momentum)
    res_norm = _bn(c, training, 2, momentum) if shortcut_norm else None
    ref_norm, ref_res_norm = copy.deepcopy(norm), copy.deepcopy(res_norm)
    x, res = (cl(torch.randn(3, c, *hw, generator=g) * 2 + 5).requires_grad_() for _ in range(2))
    w_out, w_pool = torch.randn(3, c, *hw, generator=g), torch.randn(3, c, generator=g)
    for _ in range(2 if mode == 'cumulative' else 1):
        (out, pooled), kernels = kernel_calls(_block_end, x, res, norm, res_norm, use_pool)
        assert kernels == {'block_end_forward': 1}
        assert isinstance(out.grad_fn, cpu_autograd.BlockEnd._backward_cls)
        x0, r0 = (t.detach().clone().requires_grad_() for t in (x, res))
        want = (ref_norm(x0) + (ref_res_norm(r0) if shortcut_norm else r0)).relu()
    loss = (out * w_out).sum() + ((pooled * w_pool).sum() if use_pool else 0)
    ref = (want * w_out).sum() + ((want.mean((2, 3)) * w_pool).sum() if use_pool else 0)
    params = [x, res, norm.weight, norm.bias] + (
        [res_norm.weight, res_norm.bias] if shortcut_norm else [])
    ref_params = [x0, r0, ref_norm.weight, ref_norm.bias] + (
        [ref_res_norm.weight, ref_res_norm.bias] if shortcut_norm else [])
    got_g, kernels = kernel_calls(torch.autograd.grad, loss, params)
    assert kernels == {'block_end_backward': 1}
    want_g = torch.autograd.grad(ref, ref_params)
    if training:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, want)
    if use_pool:
        torch.testing.assert_close(pooled, want.mean((2, 3)), rtol=1e-5, atol=1e-5)
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        if i == 1 and not shortcut_norm:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    for m, r in ((norm, ref_norm), (res_norm, ref_res_norm)):
        if m is not None:
            assert int(m.num_batches_tracked) == int(r.num_batches_tracked)
            torch.testing.assert_close(m.running_mean, r.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(m.running_var, r.running_var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('offset', [0.0, 300.0])
def test_block_end_statistics_hold_where_the_mean_dwarfs_the_spread(offset):
    # batch statistics from shifted sums: where the mean is 150 times the
    # standard deviation the output is as close to float64's as ATen's
    # two-pass statistics get it (closer, measured)
    g = torch.Generator().manual_seed(3)
    x = cl(torch.randn(3, 256, 14, 14, generator=g) * 2 + offset)
    res = cl(torch.randn(3, 256, 14, 14, generator=g))
    out, kernels = kernel_calls(residual_end, x.requires_grad_(), res, nn.BatchNorm2d(256))
    assert kernels == {'block_end_forward': 1}
    with torch.no_grad():
        aten = (nn.BatchNorm2d(256)(x) + res).relu()
        exact = (nn.BatchNorm2d(256).double()(x.double()) + res.double()).relu()
    err, err_aten = ((t.double() - exact).abs().max().item() for t in (out.detach(), aten))
    assert err <= max(2 * err_aten, 5e-6), (err, err_aten)


@pytest.mark.parametrize('offset', [0.0, 300.0])
def test_block_end_gradients_hold_where_the_mean_dwarfs_the_spread(offset):
    # the gradients of both inputs and of both norms' parameters, with an
    # upstream gradient whose sum is not small, where the norms' inputs sit 150
    # standard deviations from zero: within 1e-4 of float64's (measured 4e-5;
    # ATen's float32 backward is off by up to 68% there), 1e-5 at offset 0
    g = torch.Generator().manual_seed(4)
    x, res = (cl(torch.randn(3, 256, 14, 14, generator=g) * 2 + offset) for _ in range(2))
    # an upstream gradient with a mean of its own: sum g is not small
    w_out = torch.randn(3, 256, 14, 14, generator=g) * 0.1 + 1

    def grads(dtype, fused):
        norm, res_norm = _bn(256, True, 1, 0.1).to(dtype), _bn(256, True, 2, 0.1).to(dtype)
        xi, ri = (t.to(dtype).detach().requires_grad_() for t in (x, res))
        if fused:
            out = residual_end(xi, ri, norm, res_norm)
            assert isinstance(out.grad_fn, cpu_autograd.BlockEnd._backward_cls)
        else:
            out = (norm(xi) + res_norm(ri)).relu()
        params = (xi, ri, norm.weight, norm.bias, res_norm.weight, res_norm.bias)
        return torch.autograd.grad((out * w_out.to(dtype)).sum(), params)

    exact, aten, got = (grads(torch.float64, False), grads(torch.float32, False),
                        grads(torch.float32, True))
    for i, (e, a, f) in enumerate(zip(exact, aten, got)):
        scale = float(e.abs().max())
        err, err_aten = ((t.double() - e).abs().max().item() / scale for t in (f, a))
        assert err <= (1e-5 if offset == 0 else 1e-4), (i, err, err_aten)


def test_block_end_ops_name_bad_arguments():
    ops = torch.ops.kcla_mm
    x, res = cl(torch.rand(2, 8, 3, 3)), cl(torch.rand(2, 8, 3, 3))
    one, zero = torch.ones(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match='res_weight, res_bias, res_mean and res_var must be '
                       'given together.*got 2'):
        ops.block_end_forward(x, res, one, zero, zero.clone(), one.clone(), True, 0.1, 1e-5, one,
                              zero, None, None, True, 0.1, 1e-5)
    with pytest.raises(RuntimeError, match='training needs more than one value per channel'):
        ops.block_end_forward(x[:1, :, :1, :1], res[:1, :, :1, :1], one, zero, zero.clone(),
                              one.clone(), True, 0.1, 1e-5, None, None, None, None, False, 0.0,
                              1e-5)
    out, pooled, mask, mu, invstd, _, _ = ops.block_end_forward(
        x, res, one, zero, zero.clone(), one.clone(), True, 0.1, 1e-5, None, None, None, None,
        False, 0.0, 1e-5)
    with pytest.raises(RuntimeError, match=r'mask must be .*\[2, 3, 3, 1\].*\[2, 3, 3, 2\]'):
        ops.block_end_backward(out, None, torch.zeros(2, 3, 3, 2, dtype=torch.uint8), x, one, mu,
                               invstd, True, None, None, None, None, False)
    with pytest.raises(RuntimeError, match='res, res_weight, res_mu and res_invstd must be'):
        ops.block_end_backward(out, None, mask, x, one, mu, invstd, True, res, None, None, None,
                               False)


@pytest.mark.parametrize('depth', [50, 18])
def test_backbone_training_block_ends_are_the_host_blocks_within_rounding(depth):
    # with autograd each block's last BatchNorm, add and ReLU are one BlockEnd
    # node; where a hook on the norm must see its module call they run as
    # modules (the host block's ops). Outputs, every gradient and the running
    # statistics of the two agree within float rounding, the batch counts exactly.
    torch.manual_seed(0)
    width = 8 if depth == 50 else 16
    model = _backbone(depth=depth, norm_eval=False, base_channels=width, head_dim=width,
                      layer_attn=dict(type='KCLA', drop_path=0.2)).train()
    randomize_norms(model)
    x = torch.rand(2, 3, 64, 64)
    blocks = 16 if depth == 50 else 8
    results = []

    def step(net):
        torch.manual_seed(1)  # the same drop-path masks
        outs = net(x)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        return outs

    for hooked in (False, True):
        net = copy.deepcopy(model)
        if hooked:  # a (no-op) hook on each block's last norm: the module calls
            for b in _blocks(net):
                (b.norm3 if depth == 50 else b.norm2).register_forward_hook(lambda *a: None)
        outs, kernels = kernel_calls(step, net)
        ends = 0 if hooked else blocks
        assert kernels['step_forward'] == blocks and kernels['block_end_forward'] == ends
        assert kernels['block_end_backward'] == ends
        res = {f'out {i}': o.detach() for i, o in enumerate(outs)}
        res.update({n: p.grad for n, p in net.named_parameters()})
        res.update({n: b for n, b in net.named_buffers()})
        results.append(res)
    got, want = results
    assert got.keys() == want.keys()
    for k in want:
        if 'num_batches' in k:
            assert want[k] is not None and torch.equal(got[k], want[k]), k
            continue
        # BlockEnd's own values are checked tightly against the torch ops in
        # test_block_end_is_the_torch_ops_within_rounding; here outputs and
        # running statistics are within 1e-4, gradients within 0.1 (a ReLU
        # mask flipped by rounding, in layer4 whose BatchNorms see 8 values
        # per channel at this size, moves a weight's gradient by 5%)
        err = float((got[k] - want[k]).abs().max() / (want[k].abs().max() + 1e-12))
        assert err < (1e-4 if 'out' in k or 'running' in k else 0.1), (k, err)


def test_one_autograd_node_per_step():
    # the pooling, the per-head math and the tail are one node: x, the state
    # and the parameters feed it directly (each node costs the autograd engine
    # and Python a fixed time per block, which dominates on small maps)
    layer = make(32, 16)
    x = cl(torch.rand(2, 32, 6, 6)).requires_grad_()
    state = KCLAState(cl(torch.randn(2, 32, 6, 6)).requires_grad_(),
                      torch.randn(2, 2).requires_grad_())
    (out, new), kernels = kernel_calls(layer, x, state)
    assert kernels == {'step_forward': 1}
    node = out.grad_fn
    assert isinstance(node, cpu_autograd.FusedStep._backward_cls)
    assert new.mean.grad_fn is node and new.log_z.grad_fn is node
    inputs = {id(f.variable) for f, _ in node.next_functions if hasattr(f, 'variable')}
    wanted = [x, state.mean, state.log_z, layer.wq.weight, layer.wk.weight, layer.phi.weight,
              layer.wv.weight, layer.norm.weight, layer.norm.bias]
    assert {id(t) for t in wanted} == inputs


@pytest.mark.parametrize('case', ['float64', 'nchw', 'autocast', 'groupnorm', 'no_grad',
                                  'switched off', 'environment', 'one_value'])
def test_not_used_where_it_does_not_apply(case, monkeypatch):
    layer = make(32, 16)
    x = cl(torch.rand(2, 32, 6, 6)).requires_grad_()
    ctx = torch.enable_grad()
    if case == 'float64':
        layer, x = layer.double(), x.double()
    elif case == 'nchw':
        x = x.contiguous()
    elif case == 'autocast':
        ctx = torch.autocast('cpu', dtype=torch.bfloat16)
    elif case == 'groupnorm':
        layer = KCLA(32, head_dim=16, norm_layer=lambda c: torch.nn.GroupNorm(2, c)).train()
    elif case == 'no_grad':
        ctx = torch.no_grad()
    elif case == 'switched off':
        ctx = fused_kernels(False)
    elif case == 'environment':
        monkeypatch.setenv('KCLA_MM_CPU_KERNELS', '0')
    else:  # BatchNorm's own error for a single value per channel
        x = cl(torch.rand(1, 32, 1, 1)).requires_grad_()

        def step():
            with pytest.raises(ValueError, match='more than 1 value per channel'):
                layer(x, None)

        assert kernels_called(step) == set()
        return
    with ctx:
        assert kernels_called(layer, x, None) == set()


def test_kernels_reject_bad_arguments():
    ops = torch.ops.kcla_mm
    x = cl(torch.rand(2, 32, 4, 4))
    wv = torch.randn(32, 1, 3, 3)
    with pytest.raises(RuntimeError, match='channels-last'):
        ops.train_stats(x.contiguous(), None, None, wv)
    with pytest.raises(RuntimeError, match='prev and beta'):
        ops.train_stats(x, x.clone(), None, wv)
    with pytest.raises(RuntimeError, match='prev has shape'):
        ops.train_stats(x, cl(torch.rand(2, 32, 4, 5)), torch.rand(2, 32), wv)
    with pytest.raises(RuntimeError, match='shift must be'):
        ops.train_apply(x, x, wv, torch.rand(2, 32), torch.rand(2, 31))
    with pytest.raises(RuntimeError, match='gy has shape'):
        ops.train_grad_stats(cl(torch.rand(2, 32, 4, 3)), x, wv, torch.rand(2, 32),
                             torch.rand(2, 32), None)


@pytest.mark.parametrize('c', [3, 20, 256])  # lanes: one-channel only, vectors + rest, vectors
def test_state_update_is_torch_lerp_bit_for_bit(c):
    # the vectorised lerp takes torch.lerp's branch per weight (below 0.5 from
    # prev, else from x) and rounds like it, in float32
    g = torch.Generator().manual_seed(c)
    x, prev = (cl(torch.randn(2, c, 3, 5, generator=g)) for _ in range(2))
    beta = torch.rand(2, c, generator=g)
    beta[0, :2] = torch.tensor([0.5, 0.4999999])  # at the switch between the branches
    mean, _ = torch.ops.kcla_mm.train_stats(x, prev, beta, torch.randn(c, 1, 3, 3, generator=g))
    assert torch.equal(mean, torch.lerp(prev, x, beta[:, :, None, None]))


# 128, 256: rows staged with a padded pixel stride; 256 and 520: rows of several
# spans of the convolution (span_pixels in csrc/kcla_cpu.h: 16 and 7 pixels),
# the last one short, and two bands of rows per sample; 21 rows: bands of more
# than 8 rows, whose sums go into the partials more than once
@pytest.mark.parametrize('c,h,w', [(24, 5, 6), (128, 5, 6), (256, 9, 20), (520, 9, 17),
                                   (32, 21, 3)])
def test_kernels_equal_their_definitions(c, h, w):
    # each op against its formula, written out in torch (float64)
    ops = torch.ops.kcla_mm
    g = torch.Generator().manual_seed(0)
    b = 2
    x, prev, gy, gmean = (cl(torch.randn(b, c, h, w, generator=g)) for _ in range(4))
    beta, a, shift, alpha, kappa, lam = (torch.rand(b, c, generator=g) for _ in range(6))
    keep = torch.tensor([0.0, 2.0])
    wv = torch.randn(c, 1, 3, 3, generator=g)
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-4)
    d = {k: t.double() for k, t in dict(x=x, prev=prev, gy=gy, gmean=gmean, wv=wv).items()}
    bc = (lambda t: t.double()[:, :, None, None])
    mean = torch.lerp(d['prev'], d['x'], bc(beta))
    v = F.conv2d(mean, d['wv'], padding=1, groups=c)
    got_mean, sums = ops.train_stats(x, prev, beta, wv)
    close(got_mean.double(), mean)
    close(sums, torch.stack([v.sum((2, 3)), (v * v).sum((2, 3))], 1))
    z = bc(a) * v + bc(shift)
    close(ops.train_apply(x, got_mean, wv, a, shift).double(), d['x'] + z.relu())
    go = d['gy'] * keep.double()[:, None, None, None] * (z > 0)
    close(ops.train_grad_stats(gy, got_mean, wv, a, shift, keep),
          torch.stack([go.sum((2, 3)), (go * v).sum((2, 3))], 1))
    mean_ = mean.detach().requires_grad_()
    wv_ = d['wv'].detach().requires_grad_()
    gv = bc(alpha) * go + bc(kappa) + bc(lam) * v
    gm, gw = torch.autograd.grad(F.conv2d(mean_, wv_, padding=1, groups=c), (mean_, wv_), gv)
    gm = gm + d['gmean']
    gx, gprev, gbeta, gwv, stats = ops.train_backward(gy, gmean, x, prev, got_mean, beta, wv, a,
                                                      shift, keep, alpha, kappa, lam)
    close(gx.double(), d['gy'] + bc(beta) * gm)
    close(gprev.double(), (1 - bc(beta)) * gm)
    close(gbeta, (gm * (d['x'] - d['prev'])).sum((2, 3)))
    close(gwv, gw.view(c, 9))
    close(stats, torch.stack([go.sum((2, 3)), (go * v).sum((2, 3))], 1))
    # without a state the mean is x, and gx takes the whole gradient
    gx0, gprev0, *_ = ops.train_backward(gy, None, x, None, x, None, wv, a, shift, None, alpha,
                                         kappa, lam)
    v0 = F.conv2d(d['x'], d['wv'], padding=1, groups=c)
    go0 = d['gy'] * (bc(a) * v0 + bc(shift) > 0)
    gv0 = bc(alpha) * go0 + bc(kappa) + bc(lam) * v0
    gm0 = torch.autograd.grad(F.conv2d(d['x'].requires_grad_(), d['wv'], padding=1, groups=c),
                              d['x'], gv0)[0]
    close(gx0.double(), d['gy'] + gm0)
    assert gprev0.numel() == 0


@pytest.mark.parametrize('training', [True, False])
def test_tail_algebra_equals_batchnorm_and_its_autograd(training):
    # tail_coeffs, tail_grad_coeffs and tail_param_grads against nn.BatchNorm2d
    # (float64) on s = scale v, and its autograd, for a gradient G = dL/do
    ops = torch.ops.kcla_mm
    g = torch.Generator().manual_seed(0)
    b, c, h, w = 3, 8, 4, 5
    n = b * h * w
    v = torch.randn(b, c, h, w, generator=g, dtype=torch.float64)
    sc = torch.rand(b, c, generator=g) + 0.5
    keep = torch.tensor([1.0, 0.0, 2.0])
    weight, bias = torch.randn(c, generator=g), torch.randn(c, generator=g)
    rm, rv = torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5
    sums = torch.stack([v.sum((2, 3)), (v * v).sum((2, 3))], 1)
    rm_, rv_ = rm.clone(), rv.clone()
    a, shift, mu, invstd = ops.tail_coeffs(sums, sc, keep, weight, bias, rm_, rv_, training,
                                           0.1, 1e-5, n)
    bn = torch.nn.BatchNorm2d(c, momentum=0.1).double().train(training)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
        bn.running_mean.copy_(rm)
        bn.running_var.copy_(rv)
    bc = (lambda t: t.double()[:, :, None, None])
    s = (bc(sc) * v).requires_grad_()
    o = bn(s)
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
    close(bc(a) * v + bc(shift), keep.double()[:, None, None, None] * o)
    close(rm_, bn.running_mean.float())  # moved in training, untouched in eval
    close(rv_, bn.running_var.float())
    assert torch.equal(rm_, rm) != training
    G = torch.randn(b, c, h, w, generator=g, dtype=torch.float64)
    gs, gweight, gbias = torch.autograd.grad(o, (s, bn.weight, bn.bias), G)
    stats = torch.stack([G.sum((2, 3)), (G * v).sum((2, 3))], 1)
    alpha, kappa, lam, qr = ops.tail_grad_coeffs(stats if training else None, sc, weight, mu,
                                                 invstd, n)
    close(bc(alpha) * G + bc(kappa) + bc(lam) * v, gs * bc(sc))  # dL/dv
    got_w, got_b, got_scale = ops.tail_param_grads(stats, sums, sc, weight, mu, invstd, qr)
    close(got_w.double(), gweight)
    close(got_b.double(), gbias)
    close(got_scale.double(), (gs * v).sum((2, 3)))  # dL/dscale


def test_tail_algebra_rejects_bad_arguments():
    ops = torch.ops.kcla_mm
    sums, sc, wb = torch.rand(2, 2, 4, dtype=torch.float64), torch.rand(2, 4), torch.rand(4)
    with pytest.raises(RuntimeError, match='more than one value per channel, got 1'):
        ops.tail_coeffs(sums, sc, None, wb, wb, wb.clone(), wb.clone(), True, 0.1, 1e-5, 1)
    with pytest.raises(RuntimeError, match='sums must be'):
        ops.tail_coeffs(sums.float(), sc, None, wb, wb, wb.clone(), wb.clone(), True, 0.1,
                        1e-5, 8)
    with pytest.raises(RuntimeError, match='weight must be'):
        ops.tail_grad_coeffs(None, sc, torch.rand(5), sums[0, 0], sums[0, 0], 8)


def test_double_backward_raises_instead_of_being_wrong():
    layer = make(32, 16)
    x = cl(torch.rand(2, 32, 6, 6)).requires_grad_()
    (out, _), kernels = kernel_calls(layer, x, None)
    assert kernels == {'step_forward': 1}
    g, = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match='once_differentiable'):
        g.sum().backward()


# 20: vectors and one-channel lanes (VL = 8 or 16); 256: vectors, staged rows
@pytest.mark.parametrize('c,w', [(20, 6), (256, 20)])
def test_relu_masks_of_the_passes_agree_bit_for_bit(c, w):
    # train_apply's ReLU mask (the forward) and the masks train_grad_stats and
    # train_backward recompute must be the same bit for bit. Constant maps and
    # taps that sum to about zero make every v a rounding residue whose sign
    # depends on the order of the sums, so a pass that sums otherwise flips
    # the masks of whole channels.
    ops = torch.ops.kcla_mm
    g = torch.Generator().manual_seed(c)
    b, h = 2, 9
    mean = cl(torch.rand(b, c, 1, 1, generator=g).expand(b, c, h, w))
    wv = torch.randn(c, 9, generator=g)
    wv[:, 8] = -wv[:, :8].sum(1)
    wv = wv.view(c, 1, 3, 3)
    x = cl(torch.zeros(b, c, h, w))
    a, shift = torch.ones(b, c), torch.zeros(b, c)
    out = ops.train_apply(x, mean, wv, a, shift)  # relu(v)
    on = (out > 0).double().sum((2, 3))
    assert 0 < on.sum() < out.numel()  # both signs occur
    gy = cl(torch.ones(b, c, h, w))
    stats = ops.train_grad_stats(gy, mean, wv, a, shift, None)
    assert torch.equal(stats[:, 0], on)
    ones = torch.ones(b, c)
    *_, back_stats = ops.train_backward(gy, None, x, None, mean, None, wv, a, shift, None, ones,
                                        ones, ones)
    assert torch.equal(back_stats[:, 0], on)


def _check_relu_input_rounded_once(ops, c, w):
    # z = a v + shift with shift = -fl(a v): rounded once (a fused multiply-
    # add) z is the product's rounding error, of either sign; rounded twice it
    # is 0 everywhere. The forward's mask must be the fused one, the gradient
    # passes' masks the forward's, and train_backward's x taken from the
    # output (x_is_out) must subtract exactly the forward's addend.
    g = torch.Generator().manual_seed(c)
    b, h = 2, 7
    mean = cl(torch.rand(b, c, 1, 1, generator=g).add(0.5).expand(b, c, h, w))
    wv = torch.zeros(c, 1, 3, 3)
    wv[:, 0, 1, 1] = 1.0  # v = mean exactly
    a = torch.rand(b, c, generator=g).add(0.5)
    shift = -(a * mean[:, :, 0, 0])  # rounded: -fl(a v)
    x = cl(torch.zeros(b, c, h, w))
    out = ops.train_apply(x, mean, wv, a, shift)  # relu(a v - fl(a v))
    on = (out > 0).double().sum((2, 3))
    assert 0 < on.sum() < out.numel()  # both signs: rounded once
    gy = cl(torch.ones(b, c, h, w))
    assert torch.equal(ops.train_grad_stats(gy, mean, wv, a, shift, None)[:, 0], on)
    prev = cl(torch.rand(b, c, h, w, generator=g))
    beta = torch.rand(b, c, generator=g)
    gmean = cl(torch.randn(b, c, h, w, generator=g))
    coeffs = [torch.rand(b, c, generator=g) for _ in range(3)]
    args = (prev, mean, beta, wv, a, shift, None, *coeffs)
    given = ops.train_backward(gy, gmean, x, *args)
    from_out = ops.train_backward(gy, gmean, out, *args, True)
    assert torch.equal(given[4][:, 0], on)
    for want, got in zip(given, from_out):  # out - relu(z) is x = 0 exactly
        assert torch.equal(want, got)


@pytest.mark.parametrize('c,w', [(20, 6), (256, 20)])
def test_relu_input_is_rounded_once_in_every_pass(c, w):
    _check_relu_input_rounded_once(torch.ops.kcla_mm, c, w)


@pytest.mark.slow  # two more builds of the kernels (about a minute each on 2 cores)
@pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64'),
                    reason='x86-64 instruction sets')
@pytest.mark.parametrize('march', ['haswell', 'x86-64'])
def test_other_instruction_sets_round_alike_and_compute_the_same(march, tmp_path):
    # The fused multiply-adds are written out per instruction set (AVX-512,
    # AVX2 with FMA, else fmaf per lane): the builds for a CPU with AVX2 and
    # FMA and for one with neither, which this machine's -march=native build
    # never compiles, must round a v + shift once in every pass too, and
    # compute what the installed build computes.
    ns = build.build_variant(Path(build.__file__).with_name('csrc'), tmp_path,
                             f'kcla_isa_{march.replace("-", "_")}',
                             ['-O3', '-fopenmp', f'-march={march}'])
    ops, ref = getattr(torch.ops, ns), torch.ops.kcla_mm
    for c, w in [(20, 6), (256, 20)]:
        _check_relu_input_rounded_once(ops, c, w)
    g = torch.Generator().manual_seed(0)
    b, c, h, w = 2, 40, 6, 5
    x, prev, gy, gmean = (cl(torch.randn(b, c, h, w, generator=g)) for _ in range(4))
    beta, a, alpha, kappa, lam = (torch.rand(b, c, generator=g) for _ in range(5))
    shift = torch.randn(b, c, generator=g)
    wv = torch.randn(c, 1, 3, 3, generator=g) / 3
    mean, sums = ref.train_stats(x, prev, beta, wv)
    got_mean, got_sums = ops.train_stats(x, prev, beta, wv)
    torch.testing.assert_close(got_mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_sums, sums, rtol=1e-5, atol=1e-4)
    out = ref.train_apply(x, mean, wv, a, shift)
    torch.testing.assert_close(ops.train_apply(x, mean, wv, a, shift), out,
                               rtol=1e-5, atol=1e-5)
    args = (gy, gmean, out, prev, mean, beta, wv, a, shift, None, alpha, kappa, lam, True)
    for want, got in zip(ref.train_backward(*args), ops.train_backward(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # an init layer's adaptation at ResNet-50's groups (32 inputs, 64 outputs
    # each): register tiles sized per instruction set (4 x 2 vectors on AVX2,
    # 4 x 4 with AVX-512), and the weight gradient's sums of 4 AVX2 vectors
    m = cl(torch.randn(2, 256, 9, 7, generator=g))
    adj = torch.randn(512, 32, 1, 1, generator=g) / 6
    nw, nb = torch.rand(512, generator=g) + 0.5, torch.randn(512, generator=g)
    fwd = [o.adapt_forward(m, adj, 2, nw, nb, torch.zeros(512), torch.ones(512), True, 0.1, 1e-5)
           for o in (ref, ops)]
    for want, got in zip(*fwd):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    gu, gp = cl(torch.randn(2, 512, 5, 4, generator=g)), torch.randn(2, 512, generator=g)
    y, mu, invstd = fwd[0][1], fwd[0][4], fwd[0][5]
    bwd = [o.adapt_backward(gu, gp, m, y, adj, 2, nw, mu, invstd, True) for o in (ref, ops)]
    for want, got in zip(*bwd):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('with_state', [False, True])
@pytest.mark.parametrize('bn_train,with_keep', [(True, False), (True, True), (False, True)])
def test_step_ops_equal_the_ops_they_chain(with_state, bn_train, with_keep):
    # step_forward / step_backward (one call per block and direction) against
    # the ops they chain, called one by one as FusedStep did: bit for bit
    ops = torch.ops.kcla_mm
    g = torch.Generator().manual_seed(0)
    b, c, h, w, heads = 3, 128, 5, 7, 4
    x, prev, gy, gmean = (cl(torch.randn(b, c, h, w, generator=g)) for _ in range(4))
    log_z, glog_z = torch.randn(b, heads, generator=g), torch.randn(b, heads, generator=g)
    wq, wk = torch.randn(5, generator=g), torch.randn(5, generator=g)
    phi = torch.randn(heads, heads, generator=g)
    inv_tau = torch.linspace(0.7, 1 / 0.7, heads, dtype=torch.float64)
    wv = torch.randn(c, 1, 3, 3, generator=g)
    weight, bias = torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g)
    stats0 = (torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5)
    keep = torch.tensor([0.0, 2.0, 2.0]) if with_keep else None
    if not with_state:
        prev = log_z = gmean = glog_z = None
    consts = (10.0, 1e-3)
    running = [t.clone() for t in stats0]
    got = ops.step_forward(x, prev, log_z, wq, wk, inv_tau, phi, *consts, wv, keep, weight, bias,
                           *running, bn_train, 0.1, 1e-5)
    # the same, op by op; the pool is the kernels' own (the one residual_relu_pool_
    # and eval_step compute), the mean within float rounding
    running_ref = [t.clone() for t in stats0]
    p = got[3]
    torch.testing.assert_close(p, x.mean((2, 3)), rtol=1e-6, atol=1e-6)
    beta, sc, lz = ops.head_forward(p, log_z, wq, wk, inv_tau, phi, *consts)
    mean, sums = ops.train_stats(x, prev, beta if with_state else None, wv)
    a, shift, mu, invstd = ops.tail_coeffs(sums, sc, keep, weight, bias, *running_ref, bn_train,
                                           0.1, 1e-5, b * h * w)
    out = ops.train_apply(x, mean if with_state else x, wv, a, shift)
    want = [out, mean, lz, p, beta, sc, sums, a, shift, mu, invstd]
    assert len(got) == len(want)
    for i, (u, v) in enumerate(zip(got, want)):
        assert torch.equal(u, v), i
    assert all(torch.equal(u, v) for u, v in zip(running, running_ref))
    assert torch.equal(running[0], stats0[0]) == (not bn_train)  # updated in training only
    m = mean if with_state else x
    flat = beta if with_state else None
    got_b = ops.step_backward(gy, gmean, glog_z, x, prev, m, p, log_z, wq, wk, inv_tau, phi,
                              *consts, wv, keep, flat, sc, sums, weight, mu, invstd, a, shift,
                              bn_train)
    st = ops.train_grad_stats(gy, m, wv, a, shift, keep) if bn_train else None
    alpha, kappa, lam, qr = ops.tail_grad_coeffs(st, sc, weight, mu, invstd, b * h * w)
    gx, gprev, gbeta, gwv, r = ops.train_backward(gy, gmean, x, prev, m, flat, wv, a, shift, keep,
                                                  alpha, kappa, lam)
    gweight, gbias, gscale = ops.tail_param_grads(r, sums, sc, weight, mu, invstd, qr)
    gp, glz, gwq, gwk, gphi = ops.head_backward(p, log_z, wq, wk, inv_tau, phi, *consts,
                                                gbeta.float() if with_state else None, gscale,
                                                glog_z)
    gx.add_(gp.div_(h * w).view(b, c, 1, 1))
    # the weights' gradients in their weights' shapes (and strides: below)
    want_b = [gx, gprev, glz, gwq.view_as(wq), gwk.view_as(wk), gphi, gwv.float().view_as(wv),
              gweight, gbias]
    assert len(got_b) == len(want_b)
    for i, (u, v) in enumerate(zip(got_b, want_b)):
        assert u.dtype == torch.float32 and torch.equal(u, v), i
    # the layer's own weights: ECA [1, 1, K] and a channels-last Wv, whose
    # strides differ from a contiguous one's on its size-1 dimension
    wq3, wk3 = wq.view(1, 1, -1), wk.view(1, 1, -1)
    wv_cl = wv.to(memory_format=torch.channels_last)  # as the backbone stores it
    assert wv_cl.stride() != wv.stride()
    shaped = ops.step_backward(gy, gmean, glog_z, x, prev, m, p, log_z, wq3, wk3, inv_tau, phi,
                               *consts, wv_cl, keep, flat, sc, sums, weight, mu, invstd, a, shift,
                               bn_train)
    for i, param in ((3, wq3), (4, wk3), (5, phi), (6, wv_cl)):
        assert shaped[i].shape == param.shape and shaped[i].stride() == param.stride(), i
        assert torch.equal(shaped[i], want_b[i].view_as(param)), i
    # a pool given from outside (residual_relu_pool_): the same step, and its
    # gradient returned instead of added to gx
    running_given = [t.clone() for t in stats0]
    given = ops.step_forward(x, prev, log_z, wq, wk, inv_tau, phi, *consts, wv, keep, weight,
                             bias, *running_given, bn_train, 0.1, 1e-5, p.clone())
    assert all(torch.equal(u, v) for u, v in zip(given, got))
    got_g = ops.step_backward(gy, gmean, glog_z, x, prev, m, p, log_z, wq, wk, inv_tau, phi,
                              *consts, wv, keep, flat, sc, sums, weight, mu, invstd, a, shift,
                              bn_train, False)
    assert len(got_g) == len(want_b) + 1
    assert all(torch.equal(u, v) for u, v in zip(got_g[1:9], want_b[1:]))
    assert torch.equal(got_g[0] + got_g[9].div(h * w).view(b, c, 1, 1), want_b[0])
    # x_is_out (FusedStep with a state): the output in x's place, x taken as
    # out - relu(a v + shift) recomputed. Only the terms through gbeta (sum of
    # gm (x - prev)) move, by float rounding; without a state x is not read.
    # Taking out as x instead would be far off (the check that it is used).
    by_out = ops.step_backward(gy, gmean, glog_z, got[0], prev, m, p, log_z, wq, wk, inv_tau,
                               phi, *consts, wv, keep, flat, sc, sums, weight, mu, invstd, a,
                               shift, bn_train, True, True)
    exact = (1, 6, 7, 8) if with_state else range(9)  # gprev, gwv, gweight, gbias
    for i in range(9):
        if i in exact:
            assert torch.equal(by_out[i], want_b[i]), i
        else:
            torch.testing.assert_close(by_out[i], want_b[i], rtol=1e-5, atol=1e-5, msg=str(i))
    if with_state:
        wrong = ops.step_backward(gy, gmean, glog_z, got[0], prev, m, p, log_z, wq, wk, inv_tau,
                                  phi, *consts, wv, keep, flat, sc, sums, weight, mu, invstd, a,
                                  shift, bn_train, True, False)
        assert not torch.allclose(wrong[2], want_b[2], rtol=1e-2, atol=1e-2)


def test_train_backward_x_from_out_is_within_rounding_for_any_beta():
    # x_is_out: x - prev as out - relu(a v + shift) - prev, whatever beta
    # (near 0 and near 1, full vectors and the channels past them): within
    # float rounding of x - prev read from x; every other output bit for bit
    ops = torch.ops.kcla_mm
    g = torch.Generator().manual_seed(7)
    b, c, h, w = 2, 40, 6, 5
    x, prev, gy, gmean = (cl(torch.randn(b, c, h, w, generator=g)) for _ in range(4))
    u = torch.rand(b, c, generator=g)
    beta = torch.where(torch.arange(c) < 16, 1e-4 + 0.4 * u, 0.6 + (0.4 - 1e-4) * u)
    beta[:, 32:] = torch.where(torch.arange(8) % 2 == 0, 1e-4, 1 - 1e-4)
    wv = torch.randn(c, 1, 3, 3, generator=g)
    mean, _ = ops.train_stats(x, prev, beta, wv)
    a, shift = torch.randn(b, c, generator=g), torch.randn(b, c, generator=g)
    out = ops.train_apply(x, mean, wv, a, shift)
    alpha, kappa, lam = (torch.randn(b, c, generator=g) for _ in range(3))
    args = (wv, a, shift, None, alpha, kappa, lam)
    want = ops.train_backward(gy, gmean, x, prev, mean, beta, *args)
    got = ops.train_backward(gy, gmean, out, prev, mean, beta, *args, True)
    for i in (0, 1, 3, 4):  # gx, gprev, gwv, the sums
        assert torch.equal(got[i], want[i]), i
    scale = want[2].abs().max().item()
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5 * scale)
