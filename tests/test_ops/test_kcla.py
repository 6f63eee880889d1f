"""KCLA operator: parity with a naive re-statement of the reference, the
key-correlation property, numerics, gradients, state contract and errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from reference_kcla import as_reference, reference_step
from reference_kcla import seq as reference_inv_tau
from torch import nn
from utils import Doubled, assert_finite, params_without_grad, randomize_norms, state_bytes

import kcla_mm.ops as ops
from kcla_mm.ops import KCLA, BlockPosition, FullLayerAttention, KCLAState
from kcla_mm.ops.recompute import autograd_replay


# ---------------------------------------------------------------- reference
def naive_kcla(layer: KCLA, x, uz):
    """Spec sections 4-5 with raw sums u, z, as the reference code does."""
    return reference_step(as_reference(layer), x, uz, layer.renorm, layer.head_dim)


def make_network(widths, depths, head_dim, renorm_blocks=(0, 11), **kw):
    layers, prev = [], None
    for s, (c, n) in enumerate(zip(widths, depths)):
        for i in range(n):
            pos = BlockPosition(s, i, prev if i == 0 else c, 2 if (i == 0 and s > 0) else 1)
            layers.append(KCLA.for_position(c, pos, head_dim=head_dim,
                                            renorm_blocks=renorm_blocks, **kw))
        prev = c
    return nn.ModuleList(layers)


def block_inputs(widths, depths, batch=2, size=8, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    xs = []
    for s, (c, n) in enumerate(zip(widths, depths)):
        hw = size // 2**s
        xs += [torch.rand(batch, c, hw, hw, generator=g, dtype=torch.float64) * scale
               for _ in range(n)]
    return xs


@pytest.mark.parametrize('train', [True, False])
@pytest.mark.parametrize('scale', [1.0, 40.0])  # 40: key norms hit the clamp at 10
def test_parity_with_naive_reference(train, scale):
    # stages of 3 and 13 blocks: two stage transitions... one cross-stage and one
    # mid-stage re-normalisation (block 11), plus a third stage for a second transition.
    widths, depths = (16, 32, 64), (3, 13, 2)
    torch.manual_seed(0)
    net = make_network(widths, depths, head_dim=8).double()
    randomize_norms(net)
    net.train(train)
    xs = block_inputs(widths, depths, scale=scale)
    state, uz = None, None
    for t, (layer, x) in enumerate(zip(net, xs)):
        out, state = layer(x, state)
        ref, uz = naive_kcla(layer, x, uz)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9, msg=f'block {t}')
        u, z = uz
        torch.testing.assert_close(state.log_z, torch.log(z.flatten(1)), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(state.mean, (u / z).view_as(x), rtol=1e-9, atol=1e-9)
    assert sum(m.renorm for m in net) == 3  # stage 2 start, stage 2 block 11, stage 3 start


def test_first_block_and_renorm_layout():
    net = make_network((16, 32), (2, 12), head_dim=8)
    assert not net[0].renorm and net[0].adjust is None and net[0].wk_u is None
    assert net[2].renorm and net[2].adjust is not None  # width 16 -> 32, stride 2
    assert net[2 + 11].renorm and net[2 + 11].adjust is None  # same width: no adjust
    assert net[2].adjust.weight.shape == (32, 16 // 4, 1, 1)  # groups = G = 4


def test_key_correlation_property_matches_exact_layer_attention():
    # Spec section 3: with collinear keys k_s = r_s u and <q, u>/sqrt(d) = 1/tau_g,
    # the KCLA aggregate equals exact layer attention with the shared Wv.
    torch.manual_seed(0)
    c, d, b, T = 32, 8, 2, 6
    g = c // d
    kcla = [KCLA(c, head_dim=d, clamp=None).double() for _ in range(T)]
    full = [FullLayerAttention(c, head_dim=d, stage_start=(t == 0)).double() for t in range(T)]
    for f in full:
        f.wv = kcla[0].wv  # shared value transform
    u = F.normalize(torch.randn(b, g, d, dtype=torch.float64), dim=-1)
    tau = 1 / reference_inv_tau(g)
    q = u * (math.sqrt(d) / tau)[None, :, None]  # <q, u> / sqrt(d) = 1 / tau
    xs = [torch.randn(b, c, 5, 5, dtype=torch.float64) for _ in range(T)]
    radii = [torch.rand(b, g, 1, dtype=torch.float64) * 3 for _ in range(T)]
    ks, fs = None, None
    for t in range(T):
        kt = radii[t] * u
        kcla[t].keys = lambda x, kt=kt: (q, kt)
        full[t].keys = lambda x, kt=kt: (q, kt)
        _, ks = kcla[t](xs[t], ks)
        _, fs = full[t](xs[t], fs)
        torch.testing.assert_close(kcla[0].wv(ks.mean), full[t].aggregate(q, fs),
                                   rtol=1e-5, atol=1e-5)
    # and the property is not trivially true: a non-collinear key breaks it
    full[-1].keys = lambda x: (q, radii[-1] * F.normalize(torch.randn_like(u), dim=-1))
    _, fs2 = full[-1](xs[-1], FullLayerAttentionState_from(fs))
    assert not torch.allclose(kcla[0].wv(ks.mean), full[-1].aggregate(q, fs2), atol=1e-3)


def FullLayerAttentionState_from(fs):
    return type(fs)(fs.keys[:-1], fs.values[:-1])


def test_eps_and_clamp_in_output():
    # u / (z + eps): for a single block with w = exp(0) = 1 (zero keys) the
    # aggregate is x / (1 + 1e-3), not x.
    layer = KCLA(16, head_dim=8).double().eval()
    nn.init.zeros_(layer.wk.weight)
    x = torch.rand(1, 16, 4, 4, dtype=torch.float64)
    _, st = layer(x)
    torch.testing.assert_close(st.log_z, torch.zeros(1, 2, dtype=torch.float64))
    # (the naive reference divides by |k| = 0 in the gate: NaN; KCLA gives h = 0)
    h = torch.zeros(1, 2, dtype=torch.float64)
    a = torch.sigmoid(h @ layer.phi.weight.t())[..., None, None, None]
    v = layer.wv(x / (1 + 1e-3)).view(1, 2, 8, 4, 4)
    ref = x + F.relu(layer.norm((a * v).view(1, 16, 4, 4)))
    torch.testing.assert_close(layer(x)[0], ref)


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    net = make_network((16, 32), (2, 2), head_dim=8).train()
    xs = [x.float().requires_grad_() for x in block_inputs((16, 32), (2, 2))]
    state, loss = None, 0
    for layer, x in zip(net, xs):
        out, state = layer(x, state)
        loss = loss + out.square().mean()
    loss.backward()
    assert params_without_grad(net) == []
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in xs)


@pytest.mark.parametrize('train', [True, False])
def test_gradcheck(train):
    torch.manual_seed(0)
    first = KCLA(4, head_dim=2).double().train(train)
    init = KCLA(8, head_dim=2, renorm=True, prev_channels=4, stride=2).double().train(train)
    randomize_norms(first)
    randomize_norms(init)

    def f(x0, x1):
        out0, st = first(x0)
        out1, st = init(x1, st)
        return out0.sum() + out1, st.mean, st.log_z

    x0 = torch.rand(2, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    x1 = torch.rand(2, 8, 1, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x0, x1), eps=1e-6, atol=1e-5)


def _set_key_norm(layer: KCLA, target: float):
    """Make every key norm of a constant-1 input equal ``target`` (0 allowed)."""
    k = layer.wk.weight.shape[-1]
    with torch.no_grad():
        layer.wk.weight.zero_()
        layer.wk.weight[..., k // 2] = target / math.sqrt(layer.head_dim)


def _fp16_supported() -> bool:
    try:
        m = nn.Conv2d(4, 4, 3, padding=1, groups=4).half()
        m(torch.ones(1, 4, 4, 4, dtype=torch.float16))
        F.batch_norm(torch.ones(2, 4, 2, 2, dtype=torch.float16), None, None, training=True)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize('key_norm', [0.0, 1e4])
@pytest.mark.parametrize('mode', ['fp32', 'bf16-autocast', 'fp16'])
def test_no_overflow_for_extreme_key_norms(key_norm, mode):
    torch.manual_seed(0)
    net = make_network((16, 32), (20, 20), head_dim=8, renorm_blocks=(0, )).train()
    for layer in net:
        _set_key_norm(layer, key_norm)
        if layer.wk_u is not None:
            with torch.no_grad():
                layer.wk_u.weight.copy_(layer.wk.weight)
    x0 = [torch.ones(2, 16, 8, 8)] * 20 + [torch.ones(2, 32, 4, 4)] * 20
    dtype = torch.float32
    if mode == 'fp16':
        if not _fp16_supported():
            pytest.skip('this CPU build has no fp16 conv/batch-norm kernels')
        net, dtype = net.half(), torch.float16
        # keep the float32 parts float32 as AMP would (weights are tiny convs)
        for layer in net:
            layer.inv_tau = layer.inv_tau.float()
    ctx = torch.autocast('cpu', dtype=torch.bfloat16) if mode == 'bf16-autocast' \
        else torch.autocast('cpu', enabled=False)
    state = None
    with ctx:
        for t, (layer, x) in enumerate(zip(net, x0)):
            out, state = layer(x.to(dtype), state)
            assert_finite(out, f'{mode} output of block {t}')
            assert_finite(state.mean, f'{mode} state mean of block {t}')
            assert state.log_z.dtype == torch.float32
            assert_finite(state.log_z, f'{mode} log_z of block {t}')
            if t == 19:  # end of stage 1: z = 20 * exp(min(|k| / tau, 10))
                expect = (10.0 if key_norm > 0 else 0.0) + math.log(20)
                torch.testing.assert_close(state.log_z, torch.full_like(state.log_z, expect),
                                           rtol=1e-5, atol=1e-5)
    # ... a value the raw reference sum z cannot hold in fp16
    assert torch.tensor(20 * math.exp(10.0)).half().isinf()


def test_state_is_constant_size_while_exact_attention_grows():
    torch.manual_seed(0)
    c = 16
    kcla = [KCLA(c, head_dim=8) for _ in range(8)]
    full = [FullLayerAttention(c, head_dim=8, stage_start=(t == 0)) for t in range(8)]
    x = torch.rand(2, c, 8, 8)
    ks = fs = None
    kb, fb = [], []
    for t in range(8):
        _, ks = kcla[t](x, ks)
        _, fs = full[t](x, fs)
        kb.append(state_bytes(ks))
        fb.append(state_bytes(fs))
    assert len(set(kb)) == 1 and kb[0] == 2 * c * 64 * 4 + 2 * 2 * 4
    assert fb == [fb[0] * (t + 1) for t in range(8)]
    assert isinstance(ks, KCLAState) and ks.mean.shape == x.shape and ks.log_z.shape == (2, 2)


# ------------------------------------------------------------ bad arguments
@pytest.mark.parametrize('kwargs, match', [
    (dict(channels=48, head_dim=32), 'channels=48 is not divisible by head_dim=32'),
    (dict(channels=32, head_dim=0), 'head_dim=0'),
    (dict(channels=32, head_dim=8, temperature_range=(0.0, 1.4)), r'temperature_range=\(0.0'),
    (dict(channels=32, head_dim=8, temperature_range=(0.7, -1.0)), 'temperature_range'),
    (dict(channels=32, head_dim=8, clamp=0), 'clamp=0'),
    (dict(channels=32, head_dim=8, drop_path=1.5), 'drop_path=1.5'),
    (dict(channels=32, head_dim=8, renorm=True, prev_channels=10), 'prev_channels=10'),
])
def test_bad_arguments_name_the_value(kwargs, match):
    # every invalid argument is a ValueError that names the offending value
    with pytest.raises(ValueError, match=match):
        KCLA(**kwargs)


def test_state_of_another_batch_is_refused():
    # a state never crosses samples: a batch-size mismatch is an error
    layer = KCLA(16, head_dim=8)
    _, st = layer(torch.rand(3, 16, 4, 4))
    with pytest.raises(ValueError, match='batch size 3'):
        layer(torch.rand(2, 16, 4, 4), st)


def test_state_of_another_shape_needs_an_init_layer():
    layer = KCLA(16, head_dim=8)
    _, st = KCLA(8, head_dim=8)(torch.rand(2, 8, 4, 4))
    with pytest.raises(ValueError, match='only an init layer'):
        layer(torch.rand(2, 16, 4, 4), st)


def test_wrong_input_width():
    with pytest.raises(ValueError, match=r'\[B, 16, H, W\]'):
        KCLA(16, head_dim=8)(torch.rand(2, 8, 4, 4))


# ------------------------------------------------- memory-efficient training path
def _train_step(net, xs, recompute):
    state, loss = None, 0
    for layer in net:
        layer.recompute_tail = recompute
    for layer, x in zip(net, xs):
        with ops.fused_kernels(False):
            out, state = layer(x, state)
        loss = loss + (out * torch.linspace(0, 1, out.numel(), dtype=out.dtype)
                       .view_as(out)).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}, \
        [x.grad.clone() for x in xs], \
        {n: b.clone() for n, b in net.named_buffers() if 'running' in n}


def test_recomputed_tail_equals_plain_autograd():
    # same gradients, same BatchNorm running statistics (updated exactly once)
    torch.manual_seed(0)
    widths, depths = (16, 32), (3, 3)
    net = make_network(widths, depths, head_dim=8, drop_path=0.0).double().train()
    init = {k: v.clone() for k, v in net.state_dict().items()}
    results = []
    for recompute in (False, True):
        net.load_state_dict(init)
        net.zero_grad()
        xs = [x.requires_grad_() for x in block_inputs(widths, depths)]
        results.append(_train_step(net, xs, recompute))
    (g0, x0, b0), (g1, x1, b1) = results
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n)
    for a, b in zip(x0, x1):
        torch.testing.assert_close(b, a)
    for n in b0:
        torch.testing.assert_close(b1[n], b0[n], msg=n)
    assert not torch.equal(b0['0.norm.running_mean'], init['0.norm.running_mean'])


def test_drop_path_mask_is_the_same_in_recomputation():
    torch.manual_seed(0)
    net = make_network((16, ), (3, ), head_dim=8, drop_path=0.5).double().train()
    init = {k: v.clone() for k, v in net.state_dict().items()}
    grads = []
    for recompute in (False, True):
        net.load_state_dict(init)
        net.zero_grad()
        torch.manual_seed(1)
        xs = [x.requires_grad_() for x in block_inputs((16, ), (3, ))]
        grads.append(_train_step(net, xs, recompute)[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)


def test_channels_last_gives_the_same_values():
    torch.manual_seed(0)
    net = make_network((16, 32), (2, 2), head_dim=8).eval()
    randomize_norms(net)
    xs = [x.float() for x in block_inputs((16, 32), (2, 2))]
    outs = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        state, res = None, []
        for layer, x in zip(net, xs):
            out, state = layer(x.contiguous(memory_format=fmt), state)
            res.append(out)
        outs.append(res)
    assert outs[1][-1].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager():
    # no graph breaks (fullgraph=True), same values and gradients as eager;
    # aot_eager traces exactly what inductor would get, without its C++ build
    torch.manual_seed(0)
    net = make_network((16, 32), (2, 2), head_dim=8)
    xs = [x.float() for x in block_inputs((16, 32), (2, 2))]

    def run(inputs):
        state, out = None, 0
        for layer, x in zip(net, inputs):
            o, state = layer(x, state)
            out = out + o.square().mean()
        return out

    compiled = torch.compile(run, fullgraph=True, backend='aot_eager')
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(xs), run(xs), rtol=1e-5, atol=1e-6)
    net.train()
    grads = []
    for fn in (run, compiled):
        inputs = [x.clone().requires_grad_() for x in xs]
        fn(inputs).backward()
        grads.append([x.grad for x in inputs])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_eval_mode_norm_parameters_learn_in_the_recomputed_tail():
    # norm_eval=True keeps the BN in eval mode while the layer trains: its
    # weight and bias must still get the gradients of the plain path
    torch.manual_seed(0)
    net = make_network((16, ), (3, ), head_dim=8).double().train()
    for layer in net:
        layer.norm.eval()
    init = {k: v.clone() for k, v in net.state_dict().items()}
    grads = []
    for recompute in (False, True):
        net.load_state_dict(init)
        net.zero_grad()
        xs = [x.requires_grad_() for x in block_inputs((16, ), (3, ))]
        grads.append(_train_step(net, xs, recompute)[0])
    assert grads[1].keys() == grads[0].keys() and '0.norm.weight' in grads[1]
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)


def test_autograd_replay_of_the_tail_equals_plain_autograd():
    # the replay through autograd (what runs under autocast, where the
    # hand-derived backward does not apply) gives the plain gradients
    with autograd_replay():
        test_recomputed_tail_equals_plain_autograd()


def test_recomputed_tail_under_autocast_matches_plain_autograd():
    # bf16 autocast: same gradients up to bf16 rounding (summation order differs)
    torch.manual_seed(0)
    net = make_network((16, 32), (2, 2), head_dim=8).train()
    init = {k: v.clone() for k, v in net.state_dict().items()}
    results = []
    for recompute in (False, True):
        net.load_state_dict(init)
        net.zero_grad()
        xs = [x.float().requires_grad_() for x in block_inputs((16, 32), (2, 2))]
        with torch.autocast('cpu', dtype=torch.bfloat16):
            results.append(_train_step(net, xs, recompute))
    (g0, x0, _), (g1, x1, _) = results
    for n in g0:
        cos = F.cosine_similarity(g1[n].flatten(), g0[n].flatten(), dim=0)
        assert cos > 0.95, (n, float(cos))  # a wrong gradient would be far off
    for a, b in zip(x0, x1):
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_cached_eval_fold_follows_every_change_of_the_norm():
    # the folded BN affine is cached for inference; in-place parameter updates,
    # load_state_dict, new running statistics and .data swaps all invalidate it
    torch.manual_seed(0)
    layer = KCLA(16, head_dim=8).eval()
    randomize_norms(layer)
    x = torch.rand(2, 16, 4, 4)
    reference = KCLA(16, head_dim=8).eval()

    def check():
        reference.load_state_dict(layer.state_dict())
        with torch.no_grad():
            got, _ = layer(x)
        reference.norm.__dict__.pop('_kcla_folded_affine', None)
        want, _ = reference(x)  # with autograd on: never cached
        torch.testing.assert_close(got, want)
        return got

    first = check()
    assert '_kcla_folded_affine' in layer.norm.__dict__  # inference used the cache
    with torch.no_grad():
        layer.norm.weight.mul_(2)  # an optimiser step
    assert not torch.equal(check(), first)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    state['norm.running_var'] = state['norm.running_var'] * 3
    layer.load_state_dict(state)
    check()
    layer.train()
    layer(x)  # updates the running statistics in place
    layer.eval()
    check()
    layer.norm.bias.data = torch.randn(16)
    check()


def test_eval_fold_of_a_parametrized_norm_is_not_kept():
    # a parametrized weight is a new tensor at every read, possibly in a freed
    # one's storage at version 0: no cache key can hold it, so nothing is kept
    # and every forward folds the weight of that moment
    from torch.nn.utils import parametrize
    torch.manual_seed(0)
    layer = KCLA(16, head_dim=8).eval()
    randomize_norms(layer)
    parametrize.register_parametrization(layer.norm, 'weight', Doubled())
    x = torch.rand(2, 16, 4, 4)
    plain = KCLA(16, head_dim=8).eval()
    for step in range(3):
        with torch.no_grad():
            got, _ = layer(x)
            plain.load_state_dict({k.replace('parametrizations.weight.original', 'weight'): v
                                   for k, v in layer.state_dict().items()})
            plain.norm.weight.mul_(2)
            want, _ = plain(x)
            layer.norm.parametrizations.weight.original.add_(0.5)  # an optimiser step
        torch.testing.assert_close(got, want)
        assert '_kcla_folded_affine' not in layer.norm.__dict__


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
def test_global_pool_gradient_is_a_broadcast_view(dtype):
    # the gradient of the pooling is MeanBackward's, without writing a map
    from kcla_mm.ops.common import global_pool
    x = torch.rand(2, 8, 5, 3).contiguous(memory_format=torch.channels_last)
    x = x.to(dtype).requires_grad_()
    p = global_pool(x)
    assert p.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    g = torch.randn(p.shape, dtype=p.dtype)
    got, = torch.autograd.grad(p, x, g)
    want, = torch.autograd.grad(x.mean((2, 3), dtype=p.dtype), x, g)
    assert got.dtype == dtype and got.stride()[2:] == (0, 0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
