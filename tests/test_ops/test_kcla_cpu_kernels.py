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
from utils import randomize_norms

from kcla_mm.models.backbones.mmdet_kcla_resnet import KCLAResNet
from kcla_mm.ops import KCLA, KCLAState, cpu_kernels

CL = torch.channels_last

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f'fused CPU kernels not built: {cpu_kernels.build_error()}')


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the steps the fused kernel computes."""
    calls = []
    orig = KCLA._fused_eval

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get('adapt', False))
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(KCLA, '_fused_eval', spy)
    return calls


def eager(layer, x, state, monkeypatch, **kw):
    with monkeypatch.context() as m:
        m.setenv('KCLA_MM_CPU_KERNELS', '0')
        return layer(x, state, **kw)


def cl(t):
    return t.contiguous(memory_format=CL)


def make(channels, head_dim=16, seed=0, **kw):
    torch.manual_seed(seed)
    layer = KCLA(channels, head_dim=head_dim, **kw)
    randomize_norms(layer, seed)
    with torch.no_grad():  # gates away from 0/1 and values of both signs after the norm
        layer.phi.weight.mul_(0.5)
    return layer.eval()


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
