"""The fused CPU inference kernel of KCLA (``torch.ops.kcla_mm.eval_step``).

Parity with the eager operator (itself checked against the reference in
test_kcla.py) on every path of the kernel: first block, running state, init
layer with ``adjust``, thread bands with halo rows, channels past the last full
vector; the in-place contracts; when the kernel is (not) used; the fallback
when it cannot be built. In CI ``KCLA_MM_CPU_KERNELS=require`` turns a failed
build into errors here instead of skips.
"""
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from utils import Doubled, kcla_layer, randomize_norms, record_calls, torch_threads

import kcla_mm.models.backbones.kcla_resnet as kcla_resnet
import kcla_mm.ops.kcla as kcla_ops
from kcla_mm.models.backbones.mmdet_kcla_resnet import KCLAResNet
from kcla_mm.models.backbones.mmseg_kcla_resnet import KCLAResNetSeg
from kcla_mm.ops import KCLA, KCLAState, cpu_kernels, residual_norm_relu_pool_, residual_relu_pool_
from kcla_mm.ops._common import member

CL = torch.channels_last

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f'fused CPU kernels not built: {cpu_kernels.build_error()}')


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the steps the fused kernel computes."""
    return record_calls(monkeypatch, KCLA, '_fused_eval',
                        lambda args, kwargs, result: kwargs.get('adapt', False))


def eager(layer, x, state, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setenv('KCLA_MM_CPU_KERNELS', '0')
        return layer(x, state, **kw)


def cl(t):
    return t.contiguous(memory_format=CL)


def make(channels, head_dim=16, seed=0, **kw):
    return kcla_layer(channels, head_dim, seed, **kw).eval()


# (batch, channels, head_dim, H, W): batch 1 with many rows runs in bands with
# halo rows; 20 channels leave a tail past the last 16-wide vector
SHAPES = [(2, 64, 16, 8, 8), (1, 32, 16, 23, 5), (3, 48, 16, 5, 7), (1, 20, 4, 3, 3),
          (4, 128, 64, 14, 14)]


@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('with_state', [False, True])
@pytest.mark.parametrize('clamp', [10.0, None])
def test_step_matches_eager(shape, with_state, clamp, monkeypatch, fused_calls):
    b, c, d, h, w = shape
    layer = make(c, d, clamp=clamp)
    g = torch.Generator().manual_seed(1)
    x = cl(torch.rand(b, c, h, w, generator=g) * 3)
    state = KCLAState(cl(torch.randn(b, c, h, w, generator=g)),
                      torch.randn(b, c // d, generator=g) * 2 + 4) if with_state else None
    with torch.no_grad():
        want, want_state = eager(layer, x, state, monkeypatch)
        got, got_state = layer(x, state)
    assert fused_calls == [False]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.mean, want_state.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.log_z, want_state.log_z, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous(memory_format=CL) and got_state.mean.is_contiguous(memory_format=CL)
    if not with_state:
        assert got_state.mean is x  # the first block's state is its output, as eagerly


def test_fused_step_reads_parametrized_weights_as_the_module_does(monkeypatch, fused_calls):
    # the inference path reads weights from the modules' own tables (member());
    # a parametrized one (a property, not in _parameters) is read as the module
    # computes it, in the fused kernel's arguments as in the eager path's
    layer, plain = make(64), make(64)
    for name in ('wv', 'wq', 'phi'):
        parametrize.register_parametrization(getattr(layer, name), 'weight', Doubled())
        with torch.no_grad():
            getattr(plain, name).weight.mul_(2)
    parametrize.register_parametrization(layer.norm, 'weight', Doubled())
    with torch.no_grad():
        plain.norm.weight.mul_(2)
    g = torch.Generator().manual_seed(3)
    x = cl(torch.rand(2, 64, 6, 5, generator=g))
    state = KCLAState(cl(torch.randn(2, 64, 6, 5, generator=g)), torch.randn(2, 4, generator=g))
    with torch.no_grad():
        want, want_state = plain(x, state)
        eager_out, _ = eager(layer, x, state, monkeypatch)
        got, got_state = layer(x, state)
    assert fused_calls == [False, False]  # (plain's and layer's; the eager one is not fused)
    torch.testing.assert_close(eager_out, want, rtol=1e-5, atol=1e-5)
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
def test_init_layer_adjust_matches_eager(prev_hw, hw, batch, monkeypatch, fused_calls):
    # spec section 5 in the kernel: norm_u(adjust(state)) re-keyed, then the step
    layer = make(64, 16, renorm=True, prev_channels=32, stride=2)
    g = torch.Generator().manual_seed(2)
    x = cl(torch.rand(batch, 64, *hw, generator=g))
    state = KCLAState(cl(torch.randn(batch, 32, *prev_hw, generator=g)),
                      torch.randn(batch, 2, generator=g))
    with torch.no_grad():
        want, want_state = eager(layer, x, state, monkeypatch)
        got, got_state = layer(x, state, reuse_state=True, reuse_input=True)
    assert fused_calls == [True]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.mean, want_state.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state.log_z, want_state.log_z, rtol=1e-5, atol=1e-5)
    assert got.data_ptr() == x.data_ptr()  # written into x, as asked


def test_in_place_only_when_asked(monkeypatch):
    layer = make(32)
    g = torch.Generator().manual_seed(3)
    x = cl(torch.rand(2, 32, 6, 6, generator=g))
    state = KCLAState(cl(torch.randn(2, 32, 6, 6, generator=g)), torch.randn(2, 2, generator=g))
    x0, m0 = x.clone(), state.mean.clone()
    with torch.no_grad():
        want, want_state = eager(layer, x, state, monkeypatch)
        out, new = layer(x, state)
        assert torch.equal(x, x0) and torch.equal(state.mean, m0)  # caller's maps untouched
        out2, new2 = layer(x, state, reuse_state=True, reuse_input=True)
    assert out2.data_ptr() == x.data_ptr() and new2.mean.data_ptr() == state.mean.data_ptr()
    torch.testing.assert_close(out2, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new2.mean, want_state.mean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('case', ['train', 'grad', 'float64', 'nchw'])
def test_not_used_where_it_does_not_apply(case, fused_calls):
    layer = make(32)
    x = cl(torch.rand(2, 32, 6, 6))
    ctx = torch.no_grad()
    if case == 'train':
        layer.train()
    elif case == 'grad':
        ctx = torch.enable_grad()
    elif case == 'float64':
        layer, x = layer.double(), x.double()
    else:
        x = x.contiguous()
    with ctx:
        layer(x, None)
    assert fused_calls == []


def test_backbone_matches_eager_and_keeps_hooked_outputs(monkeypatch, fused_calls):
    torch.manual_seed(0)
    model = KCLAResNet(depth=50, base_channels=8, head_dim=8, layer_attn=dict(type='KCLA')).eval()
    randomize_norms(model)
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setenv('KCLA_MM_CPU_KERNELS', '0')
            want = model(x)
        assert fused_calls == []
        got = model(x)
    assert len(fused_calls) == 16 and sum(fused_calls) == 3  # three init layers adapt
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # a forward hook's copy of a block output is not overwritten by the step
    kept = []
    model.layer2[1].register_forward_hook(lambda mod, inp, out: kept.append((out, out.clone())))
    with torch.no_grad():
        model(x)
    assert torch.equal(kept[0][0], kept[0][1])


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
    x = cl(torch.randn(3, 48, 7, 9, generator=g))
    res = cl(torch.randn(3, 48, 7, 9, generator=g))
    x[0, 0, 0, :3] = torch.tensor([-0.0, float('nan'), 1.0])
    res[0, 0, 0, :3] = torch.tensor([-0.0, 1.0, float('nan')])
    want = x.clone()
    want += res
    want.relu_()
    with torch.no_grad():
        got, pooled = residual_relu_pool_(x.clone(), res)
    assert pooled is not None and pooled.shape == (3, 48)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 kept, as torch keeps it
    # the pool eval_step computes itself, bit for bit, where the map is finite
    y = cl(torch.randn(3, 48, 7, 9, generator=g))
    with torch.no_grad():
        y, p = residual_relu_pool_(y, cl(torch.randn(3, 48, 7, 9, generator=g)))
    torch.testing.assert_close(p, y.mean((2, 3)), rtol=1e-6, atol=1e-6)
    layer = make(48)
    prev = cl(torch.randn(3, 48, 7, 9, generator=g))
    lz = torch.randn(3, 3, generator=g)
    own = torch.ops.kcla_mm.eval_step(*_step_args(layer, y, prev, lz), False, False)
    given = torch.ops.kcla_mm.eval_step(*_step_args(layer, y, prev, lz), False, False, p)
    for a, b in zip(own, given):
        assert torch.equal(a, b)


@pytest.mark.parametrize('c', [3, 8, 20, 48, 256])
def test_relu_masks_are_one_bit_per_value_and_pass_torchs_gradient(c):
    # residual_relu_pool_mask_: the values and pool of residual_relu_pool_, and
    # a mask with bit c % 8 of byte c / 8 of each pixel set where not x <= 0
    # (threshold_backward's test: NaN passes, -0 does not); relu_pool_backward
    # with it is threshold_backward of gx + gp / (H W), bit for bit. Channel
    # counts with and without a full vector and a partial byte.
    ops = torch.ops.kcla_mm
    g = torch.Generator().manual_seed(c)
    b, h, w = 2, 5, 7
    x, res = (cl(torch.randn(b, c, h, w, generator=g)) for _ in range(2))
    x[0, :3, 0, 0] = torch.tensor([-0.0, float('nan'), 1.0])[:min(c, 3)]
    res[0, :3, 0, 0] = torch.tensor([-0.0, 1.0, 0.0])[:min(c, 3)]
    want = x.clone()
    want_pool = ops.residual_relu_pool_(want, res)
    got = x.clone()
    pooled, mask = ops.residual_relu_pool_mask_(got, res)
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
        back = ops.relu_pool_backward(gx, gpool, mask)
        assert torch.equal(back, expect) and torch.equal(back.signbit(), expect.signbit())


def test_relu_pool_backward_names_a_bad_mask():
    gx = cl(torch.rand(2, 20, 3, 4))
    with pytest.raises(RuntimeError, match=r'mask must be .*\[2, 3, 4, 3\].*\[2, 3, 4, 2\]'):
        torch.ops.kcla_mm.relu_pool_backward(gx, None, torch.zeros(2, 3, 4, 2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match='mask must be .*Float'):
        torch.ops.kcla_mm.relu_pool_backward(gx, None, gx)


@pytest.mark.parametrize('case', ['float64', 'nchw', 'res nchw', 'broadcast'])
def test_residual_relu_pool_falls_back_to_torch(case):
    x = cl(torch.randn(2, 16, 5, 5))
    res = cl(torch.randn(2, 16, 5, 5))
    if case == 'float64':
        x, res = x.double(), res.double()
    elif case == 'nchw':
        x = x.contiguous()
    elif case == 'res nchw':
        res = res.contiguous()
    else:
        res = torch.randn(1, 16, 1, 1)
    want = (x + res).relu()
    with torch.no_grad():
        got, pooled = residual_relu_pool_(x, res)
    assert pooled is None and got is x
    torch.testing.assert_close(x, want, rtol=0, atol=0)


@pytest.mark.parametrize('build', [
    lambda: KCLAResNet(depth=50, base_channels=8, head_dim=8),
    lambda: KCLAResNet(depth=18, base_channels=16, head_dim=16),
    lambda: KCLAResNetSeg(depth=50, base_channels=8, stem_channels=16, head_dim=8,
                          strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4)),
], ids=['mmdet-bottleneck', 'mmdet-basic', 'mmseg-bottleneck'])
def test_backbone_pools_in_each_blocks_last_add_and_relu(build, monkeypatch):
    """In inference the backbone replays the host's block and pools in its
    last add and ReLU: the same outputs bit for bit as the host's forward,
    and not where a hook on the block must see the host's call."""
    torch.manual_seed(0)
    model = build().eval()
    randomize_norms(model)
    x = torch.rand(2, 3, 64, 64)

    def record_pools():
        return record_calls(monkeypatch, kcla_resnet, 'residual_norm_relu_pool_',
                            lambda args, kwargs, result: result[1] is not None)

    pooled_by = record_pools()
    with torch.no_grad():
        got = model(x)
        assert len(pooled_by) == (16 if model.depth == 50 else 8)
        assert all(pooled_by)
        monkeypatch.setattr(type(model), 'replayable_blocks', {})
        want = model(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    monkeypatch.undo()
    pooled_by = record_pools()
    seen = []
    model.layer2[0].register_forward_pre_hook(lambda mod, inp: seen.append(1))
    with torch.no_grad():
        hooked = model(x)
    assert seen == [1] and len(pooled_by) == (15 if model.depth == 50 else 7)
    for a, b in zip(hooked, want):
        assert torch.equal(a, b)


def _eval_bn(c, seed):
    bn = nn.BatchNorm2d(c).eval()
    randomize_norms(bn, seed)
    with torch.no_grad():
        bn.weight.mul_(torch.randn(c, generator=torch.Generator().manual_seed(seed)).sign())
    return bn


@pytest.mark.parametrize('c', [20, 48, 256])
@pytest.mark.parametrize('shortcut_norm', [False, True])
def test_residual_norm_relu_pool_is_the_torch_ops_bit_for_bit(c, shortcut_norm):
    # relu(bn(x) + bn_res(res)) (or + res): the values of the eval-mode
    # BatchNorm modules, the add and the ReLU bit for bit, in x, and their pool
    g = torch.Generator().manual_seed(c)
    x, res = (cl(torch.randn(2, c, 5, 7, generator=g) * 3) for _ in range(2))
    norm, res_norm = _eval_bn(c, 1), (_eval_bn(c, 2) if shortcut_norm else None)
    with torch.no_grad():
        want = norm(x) + (res_norm(res) if shortcut_norm else res)
        want.relu_()
        got = x.clone()
        out, pooled = residual_norm_relu_pool_(got, res, norm, res_norm)
    assert out is got and pooled is not None
    assert torch.equal(got, want)
    _, want_pool = residual_relu_pool_(want.clone(), torch.zeros_like(want))
    assert torch.equal(pooled, want_pool)


@pytest.mark.parametrize('case', ['training, no grad', 'no affine', 'subclass', 'autocast',
                                  'fused training off'])
def test_residual_norm_relu_pool_runs_the_modules_where_it_cannot_fold(case, monkeypatch):
    torch.manual_seed(0)
    x, res = cl(torch.randn(2, 16, 4, 4)), cl(torch.randn(2, 16, 4, 4))
    norm = _eval_bn(16, 0)
    grad = case in ('autocast', 'fused training off')
    if case == 'training, no grad':
        norm.train()
    elif case == 'no affine':
        norm = nn.BatchNorm2d(16, affine=False).eval()
    elif case == 'subclass':
        norm = nn.SyncBatchNorm(16).eval()
    elif case == 'fused training off':
        monkeypatch.setattr(kcla_ops, 'FUSED_TRAINING', False)
    calls = []
    norm.register_forward_hook(lambda *a: calls.append(1))
    autocast = torch.autocast('cpu', dtype=torch.bfloat16, enabled=case == 'autocast')
    with torch.set_grad_enabled(grad), autocast:
        want = (norm(x) + res).relu()
        calls.clear()
        got, _ = residual_norm_relu_pool_(x.clone(), res, norm)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_backbone_applies_its_eval_blocks_last_norms_in_one_pass(monkeypatch):
    # inference: the blocks' last BatchNorms and the downsamples' are not called
    # as modules (the fused end of the block applies them), with the host's
    # outputs bit for bit; a hook on one of them keeps its module call
    torch.manual_seed(0)
    model = KCLAResNet(depth=50, base_channels=8, head_dim=8).eval()
    randomize_norms(model)
    x = torch.rand(2, 3, 64, 64)
    calls = []
    orig = nn.BatchNorm2d.forward

    def counting(self, inp):
        calls.append(self)
        return orig(self, inp)

    monkeypatch.setattr(nn.BatchNorm2d, 'forward', counting)
    with torch.no_grad():
        got = model(x)
        folded = {id(b.norm3) for b in model.modules() if hasattr(b, 'norm3')}
        folded |= {id(b.downsample[-1]) for b in model.modules()
                   if getattr(b, 'downsample', None) is not None}
        assert len(folded) == 20 and not folded & {id(m) for m in calls}
        n_fused = len(calls)
        with monkeypatch.context() as m:
            m.setattr(type(model), 'replayable_blocks', {})
            calls.clear()
            want = model(x)
        assert len(calls) == n_fused + 20
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        seen, kept = [], []
        model.layer3[0].downsample[-1].register_forward_hook(lambda *a: seen.append(1))
        model.layer1[1].norm3.register_forward_hook(lambda *a: seen.append(1))
        # a hook holding the last convolution's output: the norm runs as a
        # module, the output the hook holds is not overwritten
        model.layer2[1].conv3.register_forward_hook(
            lambda mod, inp, out: kept.append((out, out.clone())))
        calls.clear()
        hooked = model(x)
    assert seen == [1, 1] and len(calls) == n_fused + 3
    assert torch.equal(kept[0][0], kept[0][1])
    for a, b in zip(hooked, want):
        assert torch.equal(a, b)


def test_residual_bn_relu_pool_names_bad_norm_arguments():
    ops = torch.ops.kcla_mm
    x, res = cl(torch.rand(2, 8, 3, 3)), cl(torch.rand(2, 8, 3, 3))
    one, zero = torch.ones(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match='res_weight, res_bias, res_mean and res_var must be '
                       'given together.*got 1'):
        ops.residual_bn_relu_pool_(x, res, one, zero, zero, one, 1e-5, one, None, None, None, 1e-5)
    with pytest.raises(RuntimeError, match='res_running_var must be .* of 8 elements'):
        ops.residual_bn_relu_pool_(x, res, one, zero, zero, one, 1e-5, one, zero, zero,
                                   torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match='eps must be positive, got 0'):
        ops.residual_bn_relu_pool_(x, res, one, zero, zero, one, 0.0, None, None, None, None, 1.0)


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


def test_failed_build_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_kernels, '_STATE', {})

    def broken(verbose=False):
        raise OSError('no compiler here')

    monkeypatch.setattr(cpu_kernels, '_build', broken)
    monkeypatch.setenv('KCLA_MM_CPU_KERNELS', '1')
    with pytest.warns(RuntimeWarning, match='no compiler here'):
        assert cpu_kernels.available() is False
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert cpu_kernels.available() is False  # warned once
    monkeypatch.setenv('KCLA_MM_CPU_KERNELS', 'require')
    with pytest.raises(RuntimeError, match='require'):
        cpu_kernels.available()
    monkeypatch.setenv('KCLA_MM_CPU_KERNELS', '0')
    assert cpu_kernels.available() is False
