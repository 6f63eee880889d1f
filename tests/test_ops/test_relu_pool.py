"""The block's last ReLU with KCLA's pooling folded in (``kcla_mm.ops.relu_pool_``).

Values against ``relu_`` and ``mean((2, 3))``, gradients against autograd of
the two (bit for bit: the same additions in the same order), the means
against ``eval_step``'s own pooling (bit for bit: handing them over changes
no output), and where it steps aside. In CI ``KCLA_MM_CPU_KERNELS=require``
turns a failed build into errors here instead of skips.
"""
import pytest
import torch

from kcla_mm.ops import KCLA, KCLAState, cpu_kernels, relu_pool_

CL = torch.channels_last

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f'fused CPU kernels not built: {cpu_kernels.build_error()}')

# 20 and 37 channels leave tails past the last full vector; 3136 pixels make
# two pooling chunks per sample
SHAPES = [(2, 32, 5, 7), (3, 20, 4, 4), (1, 37, 3, 2), (2, 16, 56, 56)]


def cl(t):
    return t.contiguous(memory_format=CL)


@pytest.mark.parametrize('shape', SHAPES)
def test_values_are_relu_and_its_mean(shape):
    torch.manual_seed(0)
    x = cl(torch.randn(shape))
    x[0, 1, 0, 0] = float('nan')  # relu_ keeps NaN
    x[-1, -1, -1, -1] = -0.0
    y, pooled = relu_pool_(x)
    assert y is x  # in place, as nn.ReLU(inplace=True)
    want = torch.relu(x.clone())
    assert torch.equal(y.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.isnan(y[0, 1, 0, 0]) and torch.isnan(pooled[0, 1])
    assert pooled.shape == shape[:2] and pooled.dtype == torch.float32
    torch.testing.assert_close(pooled, want.mean((2, 3)), rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize('shape', SHAPES[:3])
@pytest.mark.parametrize('uses', ['both', 'map', 'pool'])
def test_gradient_is_autograds_bit_for_bit(shape, uses):
    torch.manual_seed(1)
    base = cl(torch.randn(shape))
    wy, wp = torch.randn(shape), torch.randn(shape[:2])

    def loss(y, p):
        terms = []
        if uses in ('both', 'map'):
            terms.append((y * wy).sum())
        if uses in ('both', 'pool'):
            terms.append((p * wp).sum())
        return sum(terms)

    grads = []
    for fused in (True, False):
        x = base.clone().requires_grad_()
        s = x * 1.0  # a non-leaf, as the block's residual sum
        if fused:
            y, p = relu_pool_(s)
            assert p.grad_fn is not None
        else:
            y = torch.relu_(s)
            p = y.mean((2, 3))
        loss(y, p).backward()
        grads.append(x.grad)
    assert grads[0].is_contiguous(memory_format=CL)
    assert torch.equal(grads[0], grads[1])


def _step(layer, x, state, pooled=None):
    with torch.no_grad():
        return layer(x.clone(), state, pooled=pooled)


@pytest.mark.parametrize('init_layer', [False, True])
def test_eval_step_given_the_mean_gives_the_same_numbers(init_layer):
    torch.manual_seed(2)
    if init_layer:
        layer = KCLA(64, head_dim=16, renorm=True, prev_channels=32, stride=2).eval()
        state = KCLAState(cl(torch.randn(2, 32, 14, 14)), torch.zeros(2, 2))
    else:
        layer = KCLA(64, head_dim=16).eval()
        state = KCLAState(cl(torch.randn(2, 64, 7, 7)), torch.randn(2, 4))
    s = cl(torch.randn(2, 64, 7, 7))
    y, pooled = relu_pool_(s.clone())
    got_out, got_state = _step(layer, y, state, pooled)
    want_out, want_state = _step(layer, y, state)  # eval_step pools y itself
    assert torch.equal(got_out, want_out)
    assert torch.equal(got_state.mean, want_state.mean)
    assert torch.equal(got_state.log_z, want_state.log_z)
    # a mean that is not the block output's is used as given (no second pooling)
    other, _ = _step(layer, y, state, pooled + 1.0)
    assert not torch.equal(other, want_out)


def test_training_step_uses_the_given_mean():
    torch.manual_seed(3)
    layer = KCLA(32, head_dim=16).train()
    x = cl(torch.rand(2, 32, 6, 6))
    out_a, _ = layer(x, None, pooled=x.mean((2, 3)))
    out_b, _ = layer(x, None, pooled=x.mean((2, 3)) + 1.0)
    assert not torch.equal(out_a, out_b)


@pytest.mark.parametrize('bad, match', [
    (lambda x: torch.zeros(2, 31), r'\[2, 32\] torch.float32 mean of x.*\(2, 31\)'),
    (lambda x: torch.zeros(2, 32, dtype=torch.float64), 'torch.float64'),
    (lambda x: [0.0] * 32, 'list'),
])
def test_kcla_names_a_bad_mean(bad, match):
    layer = KCLA(32, head_dim=16).eval()
    x = cl(torch.rand(2, 32, 4, 4))
    with pytest.raises(ValueError, match=match):
        layer(x, None, pooled=bad(x))


@pytest.mark.parametrize('make', [
    lambda: torch.randn(2, 16, 4, 4),  # NCHW
    lambda: cl(torch.randn(2, 16, 4, 4, dtype=torch.float64)),
    lambda: torch.randn(2, 16, 4),  # not a map
])
def test_steps_aside_where_the_kernel_does_not_apply(make):
    x = make()
    want = torch.relu(x)
    y, pooled = relu_pool_(x)
    assert pooled is None and y is x and torch.equal(y, want)


def test_steps_aside_when_kernels_are_off(monkeypatch):
    monkeypatch.setenv('KCLA_MM_CPU_KERNELS', '0')
    x = cl(torch.randn(2, 16, 4, 4))
    y, pooled = relu_pool_(x)
    assert pooled is None and bool((y >= 0).all())


def test_kernels_reject_bad_arguments():
    with pytest.raises(RuntimeError, match='channels-last'):
        torch.ops.kcla_mm.relu_pool_(torch.randn(2, 32, 4, 4))
    y = cl(torch.rand(2, 32, 4, 4))
    with pytest.raises(RuntimeError, match='gy has shape'):
        torch.ops.kcla_mm.relu_pool_backward(cl(torch.rand(2, 32, 4, 3)), y, None)
    with pytest.raises(RuntimeError, match='gp must be'):
        torch.ops.kcla_mm.relu_pool_backward(y, y, torch.zeros(2, 31))
