"""The fused CPU inference kernels of KCLA (``torch.ops.kcla_mm.eval_step``) and of a block's end.

Parity with the plain operator (``kcla_mm.ops.fused_kernels(False)``, itself
checked against ``kcla_mm.ops.kcla_reference``) on every path of the kernel:
first block, running state, init layer with ``adjust``, thread bands with halo
rows, channels past the last full vector; and with the reference itself in
float64. The in-place contracts; when the kernels are (not) used; a residual
block's end (``kcla_mm.ops.residual_end``: its last BatchNorm, the add and the
ReLU in one pass, the torch ops' values bit for bit); the fallback when the
kernels cannot be built. In CI ``KCLA_MM_CPU_KERNELS=require`` turns a failed
build into errors here instead of skips.
"""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from utils import Doubled, kcla_layer, kernel_calls, kernels_called, randomize_norms, torch_threads

import kcla_mm.ops as ops
from kcla_mm.ops import KCLAState, residual_end
from kcla_mm.ops.common import member
from kcla_mm.ops.kcla_reference import as_state, kcla_step

# the fused kernels are optional: without their folder these tests skip
build = pytest.importorskip('kcla_mm.ops.fused.build')

CL = torch.channels_last
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))

pytestmark = [
    pytest.mark.skipif(not build.available(),
                       reason=f'fused CPU kernels not built: {build.build_error()}'),
    pytest.mark.usefixtures('one_thread'),
]


def plain(layer, x, state, **kw):
    """The step by plain torch ops."""
    with ops.fused_kernels(False):
        return layer(x, state, **kw)


def cl(t):
    return t.contiguous(memory_format=CL)


def make(channels, head_dim=16, seed=0, **kw):
    return kcla_layer(channels, head_dim, seed, **kw).eval()


def calls_of(module):
    """A list that grows by one at each call of ``module`` (a forward hook)."""
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    return calls


# (batch, channels, head_dim, H, W): batch 1 with many rows runs in bands with
# halo rows; 20 channels leave a tail past the last 16-wide vector
SHAPES = [(2, 64, 16, 8, 8), (1, 32, 16, 23, 5), (3, 48, 16, 5, 7), (1, 20, 4, 3, 3),
          (4, 128, 64, 14, 14)]


@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('with_state', [False, True])
@pytest.mark.parametrize('clamp', [10.0, None])
def test_step_matches_the_plain_step(shape, with_state, clamp):
    b, c, d, h, w = shape
    layer = make(c, d, clamp=clamp)
    g = torch.Generator().manual_seed(1)
    x = cl(torch.rand(b, c, h, w, generator=g) * 3)
    state = KCLAState(cl(torch.randn(b, c, h, w, generator=g)),
                      torch.randn(b, c // d, generator=g) * 2 + 4) if with_state else None
    with torch.no_grad():
        want, want_state = plain(layer, x, state)
        (got, got_state), kernels = kernel_calls(layer, x, state)
    assert kernels == {'eval_step': 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.mean, want_state.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.log_z, want_state.log_z, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous(memory_format=CL) and got_state.mean.is_contiguous(memory_format=CL)
    if not with_state:
        assert got_state.mean is x  # the first block's state is its output, as in the plain step


def _reference_layers():
    """A first block, a block with a state and a stage's init layer (``adjust``, stride 2)."""
    return [make(32, 8, seed=0), make(32, 8, seed=1),
            make(64, 8, seed=2, renorm=True, prev_channels=32, stride=2)]


def _reference_inputs():
    g = torch.Generator().manual_seed(4)
    return [cl(torch.rand(2, 32, 8, 8, generator=g) * 3), cl(torch.rand(2, 32, 8, 8, generator=g)),
            cl(torch.rand(2, 64, 4, 4, generator=g) * 2)]


def test_steps_match_the_reference_in_float64():
    # three steps by the kernels (float32) against kcla_mm.ops.kcla_reference
    # on the same layers in float64: the paper's raw sums u and z, the modules
    # called one after the other; the init layer's adaptation folded into its step
    layers, xs = _reference_layers(), _reference_inputs()
    adjusted = calls_of(layers[2].adjust)
    got, state = [], None
    with torch.no_grad():
        for layer, x in zip(layers, xs):
            (out, state), kernels = kernel_calls(layer, x, state)
            assert kernels == {'eval_step': 1}
            got.append((out, state))
        assert adjusted == []  # adjust and norm_u applied inside eval_step
        raw = None
        for (out, state), layer, x in zip(got, layers, xs):
            want, raw = kcla_step(copy.deepcopy(layer).double(), x.double(), raw)
            want_state = as_state(raw)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state.mean.double(), want_state.mean, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state.log_z.double(), want_state.log_z, rtol=1e-5,
                                       atol=1e-5)


def test_fused_step_reads_parametrized_weights_as_the_module_does():
    # the inference path reads weights from the modules' own tables (member());
    # a parametrized one (a property, not in _parameters) is read as the module
    # computes it, in the fused kernel's arguments as in the plain path's
    layer, doubled = make(64), make(64)
    for name in ('wv', 'wq', 'phi'):
        parametrize.register_parametrization(getattr(layer, name), 'weight', Doubled())
        with torch.no_grad():
            getattr(doubled, name).weight.mul_(2)
    parametrize.register_parametrization(layer.norm, 'weight', Doubled())
    with torch.no_grad():
        doubled.norm.weight.mul_(2)
    g = torch.Generator().manual_seed(3)
    x = cl(torch.rand(2, 64, 6, 5, generator=g))
    state = KCLAState(cl(torch.randn(2, 64, 6, 5, generator=g)), torch.randn(2, 4, generator=g))
    with torch.no_grad():
        (want, want_state), kernels = kernel_calls(doubled, x, state)
        assert kernels == {'eval_step': 1}
        plain_out, _ = plain(layer, x, state)
        (got, got_state), kernels = kernel_calls(layer, x, state)
        assert kernels == {'eval_step': 1}
    torch.testing.assert_close(plain_out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, want) and torch.equal(got_state.mean, want_state.mean)


def test_member_reads_what_getattr_reads():
    conv = nn.Conv2d(4, 4, 3)
    bn = nn.BatchNorm2d(4, track_running_stats=False)  # running_mean: a None buffer
    seq = nn.Sequential(conv, bn)
    assert member(conv, 'weight') is conv.weight and member(seq, '0') is conv
    assert member(bn, 'running_mean') is None and member(bn, 'eps') == bn.eps
    parametrize.register_parametrization(conv, 'weight', Doubled())
    torch.testing.assert_close(member(conv, 'weight'), conv.weight, rtol=0, atol=0)
    assert member(conv, 'weight') is not conv.parametrizations.weight.original
    with pytest.raises(AttributeError, match='nope'):
        member(conv, 'nope')


@pytest.mark.parametrize('prev_hw, hw', [((16, 12), (8, 6)), ((9, 9), (5, 5)), ((7, 30), (4, 15))])
@pytest.mark.parametrize('batch', [1, 3])
def test_init_layer_adjust_matches_the_plain_step(prev_hw, hw, batch):
    # docs/method.md section 5 in the kernel: norm_u(adjust(state)) re-keyed, then the step
    layer = make(64, 16, renorm=True, prev_channels=32, stride=2)
    g = torch.Generator().manual_seed(2)
    x = cl(torch.rand(batch, 64, *hw, generator=g))
    state = KCLAState(cl(torch.randn(batch, 32, *prev_hw, generator=g)),
                      torch.randn(batch, 2, generator=g))
    with torch.no_grad():
        want, want_state = plain(layer, x, state)
        adjusted = calls_of(layer.adjust)
        (got, got_state), kernels = kernel_calls(layer, x, state, reuse_state=True)
    assert kernels == {'eval_step': 1} and adjusted == []  # the adaptation in the kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.mean, want_state.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.log_z, want_state.log_z, rtol=1e-5, atol=1e-5)


def test_state_written_in_place_only_when_asked():
    layer = make(32)
    g = torch.Generator().manual_seed(3)
    x = cl(torch.rand(2, 32, 6, 6, generator=g))
    state = KCLAState(cl(torch.randn(2, 32, 6, 6, generator=g)), torch.randn(2, 2, generator=g))
    x0, m0 = x.clone(), state.mean.clone()
    with torch.no_grad():
        want, want_state = plain(layer, x, state)
        out, new = layer(x, state)
        assert torch.equal(x, x0) and torch.equal(state.mean, m0)  # caller's maps untouched
        (out2, new2), kernels = kernel_calls(layer, x, state, reuse_state=True)
    assert kernels == {'eval_step': 1}
    assert new2.mean.data_ptr() == state.mean.data_ptr()  # the new state in the old one's memory
    assert torch.equal(x, x0) and out2.data_ptr() != x.data_ptr()  # x is the caller's
    torch.testing.assert_close(out2, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new2.mean, want_state.mean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('case', ['train', 'grad', 'float64', 'nchw', 'switched off'])
def test_not_used_where_it_does_not_apply(case):
    layer = make(32)
    x = cl(torch.rand(2, 32, 6, 6))
    ctx = torch.no_grad()
    if case == 'train':
        layer.train()
    elif case == 'grad':
        ctx = torch.enable_grad()
    elif case == 'float64':
        layer, x = layer.double(), x.double()
    elif case == 'nchw':
        x = x.contiguous()
    with ctx, ops.fused_kernels(case != 'switched off'):
        assert kernels_called(layer, x, None) == set()


def _end_producers(model):
    """Each block's last convolution, the producer of the map its end overwrites."""
    return [b.conv3 if hasattr(b, 'conv3') else b.conv2 for b in model.modules()
            if callable(getattr(b, 'end', None))]


def _build(name):
    # built lazily: only these tests need mmdet/mmseg
    if name == 'mmseg-bottleneck':
        from kcla_mm.models.backbones.mmseg_kcla_resnet import KCLAResNetSeg
        return KCLAResNetSeg(depth=50, base_channels=8, stem_channels=16, head_dim=8,
                             strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4))
    from kcla_mm.models.backbones.mmdet_kcla_resnet import KCLAResNet
    if name == 'mmdet-basic':
        return KCLAResNet(depth=18, base_channels=16, head_dim=16)
    return KCLAResNet(depth=50, base_channels=8, head_dim=8, layer_attn='KCLA')


def test_backbone_matches_the_plain_path_and_keeps_hooked_outputs():
    torch.manual_seed(0)
    model = _build('mmdet-bottleneck').eval()
    randomize_norms(model)
    init_layers = [m for m in model.layer_attn_modules() if m.adjust is not None]
    adjusted = [calls_of(m.adjust) for m in init_layers]
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        with ops.fused_kernels(False):
            want, kernels = kernel_calls(model, x)
        assert not kernels and all(len(a) == 1 for a in adjusted)
        got, kernels = kernel_calls(model, x)
    # every step, the three init layers' adaptations among them, and every block's end
    assert kernels == {'eval_step': 16, 'residual_bn_relu_pool_': 16}
    assert len(init_layers) == 3 and all(len(a) == 1 for a in adjusted)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # a forward hook's copy of a block output is not overwritten by the step
    kept = []
    model.layer2[1].register_forward_hook(lambda mod, inp, out: kept.append((out, out.clone())))
    with torch.no_grad():
        model(x)
    assert torch.equal(kept[0][0], kept[0][1])


@pytest.mark.parametrize('name', ['mmdet-bottleneck', 'mmdet-basic', 'mmseg-bottleneck'])
def test_backbone_ends_each_block_in_one_pass_with_the_host_blocks_values(name):
    """In inference each block's last BatchNorm, add and ReLU run as one pass
    over its last convolution's output: the same outputs bit for bit as the
    torch ops, which run instead where a hook on the norm or the convolution
    could see the difference."""
    torch.manual_seed(0)
    model = _build(name).eval()
    randomize_norms(model)
    x = torch.rand(2, 3, 64, 64)
    blocks = 16 if model.depth == 50 else 8
    with torch.no_grad():
        got, kernels = kernel_calls(model, x)
        assert kernels == {'eval_step': blocks, 'residual_bn_relu_pool_': blocks}
        # a (no-op) hook on each block's last convolution: the module calls
        handles = [m.register_forward_hook(lambda *a: None) for m in _end_producers(model)]
        want, kernels = kernel_calls(model, x)
        assert kernels == {'eval_step': blocks}
        for h in handles:
            h.remove()
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        # a hook on one block's last norm: that norm runs as a module, once
        last_block = model.layer2[1]
        norm = last_block.norm3 if hasattr(last_block, 'norm3') else last_block.norm2
        seen = calls_of(norm)
        # a hook holding one block's last convolution output: not overwritten
        kept = []
        _end_producers(model)[-1].register_forward_hook(
            lambda mod, inp, out: kept.append((out, out.clone())))
        hooked, kernels = kernel_calls(model, x)
    assert seen == [1] and kernels == {'eval_step': blocks, 'residual_bn_relu_pool_': blocks - 2}
    assert torch.equal(kept[0][0], kept[0][1])
    for a, b in zip(hooked, want):
        assert torch.equal(a, b)


def _step_args(layer, x, prev, log_z, adapt=None):
    """eval_step's arguments after (x, prev, log_z), up to (not with) the two flags."""
    g = torch.Generator().manual_seed(11)
    c = x.shape[1]
    adj = (None, None, None) if adapt is None else adapt
    return (x, prev, log_z, layer.wq.weight, layer.wk.weight, layer.inv_tau, layer.phi.weight,
            layer.wv.weight, torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g) * 0.3,
            *adj, 1 if adapt is None else 2, 10.0, 1e-3)


# (batch, channels, head_dim, H, W): channels a multiple of 16 (no tail lanes,
# whose scalar code GCC may contract differently per call site); batch 1 with
# many rows runs in bands with halo rows; 256 channels: where staging applies
@pytest.mark.parametrize('shape', [(1, 32, 16, 23, 5), (2, 64, 16, 9, 13), (4, 256, 64, 6, 7),
                                   (1, 128, 64, 16, 3)])
@pytest.mark.parametrize('threads', [1, 2])
def test_staged_and_unstaged_rows_compute_the_same(shape, threads, monkeypatch):
    """Rows staged in a ring (L1 with few ways) or read in place, state rows
    computed ahead of the convolution: the same numbers bit for bit, on every
    path (first block, running state in place or not, init layer)."""
    b, c, d, h, w = shape
    layer = make(c, head_dim=d)
    g = torch.Generator().manual_seed(1)
    x = cl(torch.randn(b, c, h, w, generator=g))
    prev = cl(torch.randn(b, c, h, w, generator=g))
    log_z = torch.randn(b, c // d, generator=g)
    prev_big = cl(torch.randn(b, c // 2, 2 * h, 2 * w, generator=g))
    adapt = (torch.randn(c, c // 2 // (c // d), generator=g) / 4, torch.randn(c, generator=g),
             torch.randn(layer.wk.weight.shape, generator=g))
    cases = {'first': (x, None, None, None, False, False),
             'state': (x, prev, log_z, None, False, False),
             'state in place': (x, prev, log_z, None, True, True),
             'init layer': (x, prev_big, None, adapt, False, True)}
    with torch_threads(threads):
        for name, (xx, pp, lz, ad, reuse, inplace) in cases.items():
            got = {}
            for stage in ('1', '0'):
                monkeypatch.setenv('KCLA_MM_CPU_STAGE_ROWS', stage)
                xs = xx.clone()
                ps = None if pp is None else pp.clone()
                got[stage] = [t.clone() for t in torch.ops.kcla_mm.eval_step(
                    *_step_args(layer, xs, ps, lz, ad), reuse, inplace)]
            for a, b_ in zip(got['1'], got['0']):
                assert torch.equal(a, b_), name


def test_residual_relu_pool_is_torchs_add_and_relu_and_eval_steps_pool():
    g = torch.Generator().manual_seed(2)
    ops_ = torch.ops.kcla_mm
    x = cl(torch.randn(3, 48, 7, 9, generator=g))
    res = cl(torch.randn(3, 48, 7, 9, generator=g))
    x[0, 0, 0, :3] = torch.tensor([-0.0, float('nan'), 1.0])
    res[0, 0, 0, :3] = torch.tensor([-0.0, 1.0, float('nan')])
    want = x.clone()
    want += res
    want.relu_()
    got = x.clone()
    pooled = ops_.residual_relu_pool_(got, res)
    assert pooled.shape == (3, 48)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 kept, as torch keeps it
    # the pool eval_step computes itself, bit for bit, where the map is finite
    y = cl(torch.randn(3, 48, 7, 9, generator=g))
    p = ops_.residual_relu_pool_(y, cl(torch.randn(3, 48, 7, 9, generator=g)))
    torch.testing.assert_close(p, y.mean((2, 3)), rtol=1e-6, atol=1e-6)
    layer = make(48)
    prev = cl(torch.randn(3, 48, 7, 9, generator=g))
    lz = torch.randn(3, 3, generator=g)
    own = ops_.eval_step(*_step_args(layer, y, prev, lz), False, False)
    given = ops_.eval_step(*_step_args(layer, y, prev, lz), False, False, p)
    for a, b in zip(own, given):
        assert torch.equal(a, b)


@pytest.mark.parametrize('c', [3, 8, 20, 48, 256])
def test_relu_masks_are_one_bit_per_value_and_pass_torchs_gradient(c):
    # residual_relu_pool_mask_: the values and pool of residual_relu_pool_, and
    # a mask with bit c % 8 of byte c / 8 of each pixel set where not x <= 0
    # (threshold_backward's test: NaN passes, -0 does not); relu_pool_backward
    # with it is threshold_backward of gx + gp / (H W), bit for bit. Channel
    # counts with and without a full vector and a partial byte.
    kernels = torch.ops.kcla_mm
    g = torch.Generator().manual_seed(c)
    b, h, w = 2, 5, 7
    x, res = (cl(torch.randn(b, c, h, w, generator=g)) for _ in range(2))
    x[0, :3, 0, 0] = torch.tensor([-0.0, float('nan'), 1.0])[:min(c, 3)]
    res[0, :3, 0, 0] = torch.tensor([-0.0, 1.0, 0.0])[:min(c, 3)]
    want = x.clone()
    want_pool = kernels.residual_relu_pool_(want, res)
    got = x.clone()
    pooled, mask = kernels.residual_relu_pool_mask_(got, res)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    torch.testing.assert_close(pooled, want_pool, rtol=0, atol=0, equal_nan=True)
    assert mask.dtype == torch.uint8 and mask.shape == (b, h, w, (c + 7) // 8)
    bits = (mask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    bits = bits.flatten(-2)[..., :c].permute(0, 3, 1, 2).bool()
    assert torch.equal(bits, ~(want <= 0))
    assert not bits[0, 0, 0, 0] and (c < 2 or bits[0, 1, 0, 0])  # -0 blocks, NaN passes
    gx = cl(torch.randn(b, c, h, w, generator=g))
    gp = torch.randn(b, c, generator=g)
    for gpool in (gp, None):
        ref = gx + gpool.view(b, c, 1, 1) / (h * w) if gpool is not None else gx
        expect = torch.ops.aten.threshold_backward(ref, want, 0)
        back = kernels.relu_pool_backward(gx, gpool, mask)
        assert torch.equal(back, expect) and torch.equal(back.signbit(), expect.signbit())


def test_relu_pool_backward_names_a_bad_mask():
    gx = cl(torch.rand(2, 20, 3, 4))
    with pytest.raises(RuntimeError, match=r'mask must be .*\[2, 3, 4, 3\].*\[2, 3, 4, 2\]'):
        torch.ops.kcla_mm.relu_pool_backward(gx, None, torch.zeros(2, 3, 4, 2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match='mask must be .*Float'):
        torch.ops.kcla_mm.relu_pool_backward(gx, None, gx)


def _eval_bn(c, seed):
    bn = nn.BatchNorm2d(c).eval()
    randomize_norms(bn, seed)
    with torch.no_grad():
        bn.weight.mul_(torch.randn(c, generator=torch.Generator().manual_seed(seed)).sign())
    return bn


@pytest.mark.parametrize('case', ['float64', 'nchw', 'res nchw', 'broadcast', 'same map'])
def test_residual_end_falls_back_to_torch(case):
    x = cl(torch.randn(2, 16, 5, 5))
    res = cl(torch.randn(2, 16, 5, 5))
    norm = _eval_bn(16, 0)
    if case == 'float64':
        x, res, norm = x.double(), res.double(), norm.double()
    elif case == 'nchw':
        x = x.contiguous()
    elif case == 'res nchw':
        res = res.contiguous()
    elif case == 'broadcast':
        res = torch.randn(1, 16, 1, 1)
    with torch.no_grad():
        want = (norm(x) + res).relu()
        got, kernels = kernel_calls(residual_end, x, x if case == 'same map' else res, norm)
    if case == 'same map':
        want = (norm(x) + x).relu()
    assert not kernels
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize('c', [20, 48, 256])
@pytest.mark.parametrize('shortcut_norm', [False, True])
def test_residual_end_is_the_torch_ops_bit_for_bit(c, shortcut_norm):
    # relu(bn(x) + bn_res(res)) (or + res): the values of the eval-mode
    # BatchNorm modules, the add and the ReLU bit for bit, in x; and the
    # kernel's pool that of residual_relu_pool_
    g = torch.Generator().manual_seed(c)
    x, res = (cl(torch.randn(2, c, 5, 7, generator=g) * 3) for _ in range(2))
    norm, res_norm = _eval_bn(c, 1), (_eval_bn(c, 2) if shortcut_norm else None)
    with torch.no_grad():
        want = norm(x) + (res_norm(res) if shortcut_norm else res)
        want.relu_()
        got = x.clone()
        out, kernels = kernel_calls(residual_end, got, res, norm, res_norm)
    assert kernels == {'residual_bn_relu_pool_': 1}
    assert out is got
    assert torch.equal(got, want)
    res_args = ((None, None, None, None, 1.0) if res_norm is None else
                (res_norm.weight, res_norm.bias, res_norm.running_mean, res_norm.running_var,
                 res_norm.eps))
    with torch.no_grad():
        pooled = torch.ops.kcla_mm.residual_bn_relu_pool_(
            x.clone(), res, norm.weight, norm.bias, norm.running_mean, norm.running_var,
            norm.eps, *res_args)
    want_pool = torch.ops.kcla_mm.residual_relu_pool_(want.clone(), torch.zeros_like(want))
    assert torch.equal(pooled, want_pool)


@pytest.mark.parametrize('case', ['training, no grad', 'no affine', 'subclass', 'autocast',
                                  'switched off', 'hooked'])
def test_residual_end_runs_the_modules_where_it_cannot_fold(case):
    torch.manual_seed(0)
    x, res = cl(torch.randn(2, 16, 4, 4)), cl(torch.randn(2, 16, 4, 4))
    norm = _eval_bn(16, 0)
    grad = case in ('autocast', 'switched off')
    if case == 'training, no grad':
        norm.train()
    elif case == 'no affine':
        norm = nn.BatchNorm2d(16, affine=False).eval()
    elif case == 'subclass':
        norm = nn.SyncBatchNorm(16).eval()
    elif case == 'hooked':
        calls = calls_of(norm)
    autocast = torch.autocast('cpu', dtype=torch.bfloat16, enabled=case == 'autocast')
    with torch.set_grad_enabled(grad), autocast, ops.fused_kernels(case != 'switched off'):
        want = (norm(x) + res).relu()
        got, kernels = kernel_calls(residual_end, x.clone(), res, norm)
    assert not kernels
    if case == 'hooked':
        assert calls == [1, 1]  # want's call and residual_end's
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_residual_bn_relu_pool_names_bad_norm_arguments():
    kernels = torch.ops.kcla_mm
    x, res = cl(torch.rand(2, 8, 3, 3)), cl(torch.rand(2, 8, 3, 3))
    one, zero = torch.ones(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match='res_weight, res_bias, res_mean and res_var must be '
                       'given together.*got 1'):
        kernels.residual_bn_relu_pool_(x, res, one, zero, zero, one, 1e-5, one, None, None, None,
                                       1e-5)
    with pytest.raises(RuntimeError, match='res_running_var must be .* of 8 elements'):
        kernels.residual_bn_relu_pool_(x, res, one, zero, zero, one, 1e-5, one, zero, zero,
                                       torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match='eps must be positive, got 0'):
        kernels.residual_bn_relu_pool_(x, res, one, zero, zero, one, 0.0, None, None, None, None,
                                       1.0)


def test_kernel_rejects_bad_arguments():
    layer = make(32)
    x = torch.rand(2, 32, 4, 4)  # NCHW
    w, s = torch.ones(32), torch.zeros(32)
    args = [None, None, layer.wq.weight, layer.wk.weight, layer.inv_tau, layer.phi.weight,
            layer.wv.weight, w, s, None, None, None, 1, 10.0, 1e-3, False, False]
    with pytest.raises(RuntimeError, match='channels-last'):
        torch.ops.kcla_mm.eval_step(x, *args)
    with pytest.raises(RuntimeError, match='norm_scale'):
        torch.ops.kcla_mm.eval_step(cl(x), *args[:7], torch.ones(31), *args[8:])
    with pytest.raises(RuntimeError, match='output cannot'):
        torch.ops.kcla_mm.eval_step(cl(x), *args[:-1], True)  # no state: out would be x
    with pytest.raises(RuntimeError, match='pooled'):
        torch.ops.kcla_mm.eval_step(cl(x), *args, torch.zeros(2, 31))
    with pytest.raises(RuntimeError, match='res has shape'):
        torch.ops.kcla_mm.residual_relu_pool_(cl(x), cl(torch.rand(2, 32, 4, 5)))
    with pytest.raises(RuntimeError, match='res must not be x'):
        y = cl(x)
        torch.ops.kcla_mm.residual_relu_pool_(y, y)


_FAILED_BUILD = textwrap.dedent('''
    import os, sys, warnings
    sys.modules['mmdet'] = sys.modules['mmseg'] = None  # the ops need neither: a faster start
    import torch
    from kcla_mm.ops import KCLA
    from kcla_mm.ops.fused import build
    layer = KCLA(32, head_dim=16).eval()
    x = torch.rand(2, 32, 4, 4).contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        first, second = build.available(), build.available()
        with torch.no_grad():
            out, _ = layer(x)  # the plain path
    print('available', first, second)
    print('warnings', len(caught), all('could not build' in str(w.message) for w in caught))
    print('finite', bool(torch.isfinite(out).all()))
    os.environ['KCLA_MM_CPU_KERNELS'] = 'require'
    try:
        build.available()
        print('require passed')
    except RuntimeError as e:
        print('require raised', 'require' in str(e))
    os.environ['KCLA_MM_CPU_KERNELS'] = '0'
    print('off', build.available())
''')


def test_failed_build_falls_back_with_one_warning(tmp_path):
    # a fresh extension cache and no working compiler: the build fails; the
    # plain path runs after one warning, and `require` makes it an error
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=str(tmp_path / 'no-compiler'),
               KCLA_MM_CPU_KERNELS='1', PYTHONPATH=ROOT, OMP_NUM_THREADS='1')
    run = subprocess.run([sys.executable, '-c', _FAILED_BUILD], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stdout.splitlines()
            if line.split(' ')[0] in ('available', 'warnings', 'finite', 'require', 'off')]
    assert said == ['available False False', 'warnings 1 True', 'finite True',
                    'require raised True', 'off False'], (run.stdout, run.stderr)


@pytest.mark.parametrize('log_z', ['float64', 'transposed'])
@pytest.mark.parametrize('training', [False, True])
def test_a_state_the_kernels_cannot_read_as_it_is_gives_the_plain_values(log_z, training):
    # a float64 or non-contiguous log z: the kernels take a copy or step aside
    layer = kcla_layer(32, 8, 0).train(training)
    x = torch.rand(2, 32, 6, 6).contiguous(memory_format=torch.channels_last)
    m = torch.randn(2, 32, 6, 6).contiguous(memory_format=torch.channels_last)
    lz = (torch.randn(2, 4, dtype=torch.float64) if log_z == 'float64'
          else torch.randn(4, 2).t())
    with torch.set_grad_enabled(training):
        got, _ = layer(x, KCLAState(m, lz))
        with ops.fused_kernels(False):
            want, _ = layer(x, KCLAState(m, lz.contiguous()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_block_end_pool_is_used_only_for_its_own_unchanged_map():
    # the block end's pool waits for the next step of this thread, keyed by
    # the map's identity and version: a changed map, another map or a second
    # step never receive it (the step then pools itself: the plain values)
    from kcla_mm.ops.fused import cpu
    layer = kcla_layer(32, 8, 0).eval()
    cl = torch.channels_last
    norm = nn.BatchNorm2d(32).eval()
    randomize_norms(norm)

    def block_end():
        x = torch.randn(2, 32, 6, 6).contiguous(memory_format=cl)
        res = torch.randn(2, 32, 6, 6).contiguous(memory_format=cl)
        return residual_end(x, res, norm)

    with torch.no_grad():
        x = block_end()
        torch.testing.assert_close(cpu._recall_pool(x), x.mean((2, 3)))
        assert cpu._recall_pool(x) is None  # used once
        x = block_end()
        x.mul_(2)  # changed after the block end: its pool no longer holds
        assert cpu._recall_pool(x) is None
        block_end()
        other = torch.randn(2, 32, 6, 6).contiguous(memory_format=cl)
        assert cpu._recall_pool(other) is None
        for change in (False, True):
            x = block_end()
            if change:
                x.add_(1)
            got, _ = layer(x)
            with ops.fused_kernels(False):
                want, _ = layer(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
