"""KCLAResNet on the three hosts: shapes, host semantics, keys, init, checkpoints."""
import pytest
import torch
from mmdet.models.backbones import ResNet as DetResNet
from mmpretrain.models.backbones import ResNet as ClsResNet
from mmseg.models.backbones import ResNet as SegResNet
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from utils import params_without_grad, randomize_norms

import kcla_mm.ops as ops
from kcla_mm.models.backbones import KCLAResNet, KCLAResNetSeg
from kcla_mm.models.backbones.mmpretrain_kcla_resnet import KCLAResNetCls
from kcla_mm.ops import KCLA, FullLayerAttention, MRLALight
from kcla_mm.ops.kcla_reference import kcla_step

METHODS = {'KCLA': KCLA, 'FullLayerAttention': FullLayerAttention, 'MRLALight': MRLALight}
HOSTS = [(KCLAResNet, DetResNet), (KCLAResNetSeg, SegResNet), (KCLAResNetCls, ClsResNet)]
CLASSES = [cls for cls, _ in HOSTS]


def tiny(cls=KCLAResNet, depth=50, method='KCLA', **kw):
    """Tiny widths: Bottleneck stages of 32..256 channels, BasicBlock 8..64."""
    base = 8
    kw.setdefault('head_dim', 8)
    layer_attn = None if method is None else dict(type=method)
    if cls is not KCLAResNet:  # mmdet's stem follows base_channels, the others' do not
        kw.setdefault('stem_channels', base)
    return cls(depth=depth, base_channels=base, layer_attn=layer_attn, **kw)


@pytest.mark.parametrize('depth', [18, 34, 50, 101, 152])
@pytest.mark.parametrize('method', list(METHODS) + [None])
def test_stage_shapes(depth, method):
    model = tiny(depth=depth, method=method).eval()
    outs = model(torch.rand(2, 3, 64, 64))
    exp = 1 if depth < 50 else 4
    assert [tuple(o.shape) for o in outs] == [(2, 8 * 2**i * exp, 16 >> i, 16 >> i)
                                              for i in range(4)]
    n_blocks = sum(len(getattr(model, n)) for n in model.res_layers)
    mods = model.layer_attn_modules()
    assert len(mods) == (0 if method is None else n_blocks)
    assert all(isinstance(m, METHODS[method]) for m in mods)


@pytest.mark.parametrize('out_indices', [(0, ), (3, ), (1, 3), (0, 1, 2, 3)])
@pytest.mark.parametrize('cls', CLASSES)
def test_out_indices(cls, out_indices):
    outs = tiny(cls, depth=18, out_indices=out_indices).eval()(torch.rand(1, 3, 32, 32))
    assert [o.shape[1] for o in outs] == [8 * 2**i for i in out_indices]


@pytest.mark.parametrize('cls, host', HOSTS)
def test_layer_attn_none_is_exactly_the_host(cls, host):
    ours = tiny(cls, depth=50, method=None)
    kw = {} if host is DetResNet else dict(stem_channels=8)
    ref = host(depth=50, base_channels=8, **kw)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = torch.rand(1, 3, 32, 32)
    ref.eval()  # the host's train() returns None
    for a, b in zip(ours.eval()(x), ref(x)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('cls, host', HOSTS)
@pytest.mark.parametrize('method', list(METHODS))
def test_resnet_part_keys_equal_the_host(cls, host, method):
    ours = tiny(cls, depth=50, method=method)
    kw = {} if host is DetResNet else dict(stem_channels=8)
    host_keys = set(host(depth=50, base_channels=8, **kw).state_dict())
    keys = set(ours.state_dict())
    assert keys - host_keys and all('_attn.' in k for k in keys - host_keys)
    assert host_keys <= keys
    # a host checkpoint loads, with only layer-attention keys missing
    missing, unexpected = ours.load_state_dict(
        host(depth=50, base_channels=8, **kw).state_dict(), strict=False)
    assert unexpected == [] and missing and all('_attn.' in k for k in missing)


@pytest.mark.parametrize('method', list(METHODS))
def test_frozen_stages_freeze_layer_attention(method):
    model = tiny(depth=18, method=method, frozen_stages=2, norm_eval=False)
    model.train()
    for name in ('layer1', 'layer1_attn', 'layer2', 'layer2_attn'):
        mod = getattr(model, name)
        assert all(not p.requires_grad for p in mod.parameters()), name
        assert all(not m.training for m in mod.modules() if isinstance(m, _BatchNorm)), name
    for name in ('layer3', 'layer3_attn'):
        assert all(p.requires_grad for p in getattr(model, name).parameters()), name
    assert not model.conv1.weight.requires_grad


def test_norm_eval_includes_layer_attention_norms():
    model = tiny(depth=18, norm_eval=True).train()
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    attn_bns = [m for a in model.layer_attn_modules() for m in a.modules()
                if isinstance(m, _BatchNorm)]
    assert attn_bns and all(not m.training for m in bns)
    model = tiny(depth=18, norm_eval=False).train()
    assert all(m.training for m in model.modules() if isinstance(m, _BatchNorm))


@pytest.mark.parametrize('method', list(METHODS))
def test_with_cp_equals_plain_path(method):
    torch.manual_seed(0)
    # float64: the tiny model's gradients are large and cancel in BN biases,
    # so float32 recomputation noise would hide real differences
    plain = tiny(depth=50, method=method, norm_eval=False).double().train()
    ckpt = tiny(depth=50, method=method, norm_eval=False, with_cp=True).double().train()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    outs = []
    for model in (plain, ckpt):
        xi = x.clone().requires_grad_()
        out = model(xi)
        sum(o.square().mean() for o in out).backward()
        outs.append((out, xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    for a, b in zip(outs[0][0], outs[1][0]):
        torch.testing.assert_close(a, b)

    torch.testing.assert_close(outs[0][1], outs[1][1])
    for n, g in outs[0][2].items():
        torch.testing.assert_close(g, outs[1][2][n], msg=n)


@pytest.mark.parametrize('method', list(METHODS))
def test_every_trainable_parameter_gets_a_gradient(method):
    model = tiny(depth=18, method=method, norm_eval=False).train()
    sum(o.mean() for o in model(torch.rand(2, 3, 32, 32))).backward()
    # no unused parameters: DDP needs no find_unused_parameters
    assert params_without_grad(model) == []


@pytest.mark.parametrize('cls', CLASSES)
@pytest.mark.parametrize('method', list(METHODS))
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])  # fused CPU kernels, autograd
def test_gradients_have_their_parameters_strides(cls, method, dtype):
    # DDP copies each gradient into a bucket view with its parameter's strides
    # and warns ("Grad strides do not match bucket view strides") where they
    # differ; autograd lets a size-1 dimension's stride differ, so nothing
    # else catches a channels-last gradient of an NCHW 1x1 weight (or the
    # reverse), or a [1, 1, k] slice of a concatenated weight's gradient
    model = tiny(cls, depth=18, method=method, norm_eval=False).to(dtype).train()
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    sum(o.square().mean() for o in model(torch.rand(2, 3, 32, 32, dtype=dtype))).backward()
    bad = {n: (p.grad.stride(), p.stride()) for n, p in model.named_parameters()
           if p.grad is not None and p.grad.stride() != p.stride()}
    assert bad == {}


@pytest.mark.parametrize('cls', [KCLAResNet, KCLAResNetSeg])
def test_dilated_stride_one_stages(cls):
    # dilated segmentation backbone: stages 3 and 4 keep the resolution
    model = tiny(cls, depth=50, strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4)).eval()
    outs = model(torch.rand(1, 3, 64, 64))
    assert [tuple(o.shape[2:]) for o in outs] == [(16, 16), (8, 8), (8, 8), (8, 8)]
    attn3 = model.layer3_attn[0]
    assert attn3.adjust.stride == (1, 1) and attn3.adjust.in_channels == 64


@pytest.mark.parametrize('norm_cfg, norm_type', [
    (dict(type='BN'), nn.BatchNorm2d),
    (dict(type='GN', num_groups=4), nn.GroupNorm),
    (dict(type='SyncBN'), nn.SyncBatchNorm),
])
def test_norm_cfg_applies_to_layer_attention(norm_cfg, norm_type):
    model = tiny(depth=18, norm_cfg=norm_cfg)
    assert isinstance(model.layer2_attn[0].norm, norm_type)
    assert isinstance(model.layer2_attn[0].norm_u, norm_type)
    if norm_type is nn.GroupNorm:
        assert all(torch.isfinite(o).all() for o in model.eval()(torch.rand(1, 3, 32, 32)))


def test_caffe_style_and_deep_stem():
    outs = tiny(depth=50, style='caffe', deep_stem=True, avg_down=True).eval()(
        torch.rand(1, 3, 32, 32))
    assert outs[-1].shape == (1, 256, 1, 1)


def test_init_weights_keeps_reference_initialisation():
    model = tiny(depth=50)
    for m in model.layer_attn_modules():
        for p in m.parameters():
            nn.init.zeros_(p)
    model.init_weights()
    layer = model.layer2_attn[0]
    for conv in (layer.wq, layer.wk, layer.wk_u, layer.phi):
        fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(conv.weight)
        bound = (6 / (fan_in + fan_out))**0.5  # xavier-uniform
        w = conv.weight.detach()
        assert w.abs().max() <= bound + 1e-6 and w.abs().max() > bound / 4
    c = layer.channels  # kaiming normal (fan_out = 9 C for a depthwise 3x3)
    std = layer.wv.weight.std().item()
    assert 0.7 * (2 / (9 * c))**0.5 < std < 1.3 * (2 / (9 * c))**0.5


def test_parameter_count_of_kcla_r50_against_the_reference():
    # The reference's KCLA layers of ResNet-50 hold 302,046 parameters, 236 of
    # them the frozen temperatures (a buffer here) and 8,709 the init modules
    # of the first block (adjust 256x32, u_Wk 5, u_bn 512), which never
    # receive a state and are not created here.
    model = KCLAResNet(depth=50)
    n = sum(p.numel() for m in model.layer_attn_modules() for p in m.parameters())
    assert n == 302_046 - 236 - (256 * 32 + 5 + 512)
    plain = sum(p.numel() for p in KCLAResNet(depth=50, layer_attn=None).parameters())
    assert plain + n + 236 + 8709 + 2_049_000 == 25_859_078


@pytest.mark.parametrize('cls', CLASSES)
def test_a_layer_attention_type_name_is_its_config(cls):
    # layer_attn='KCLA' builds exactly what dict(type='KCLA') builds
    torch.manual_seed(0)
    by_name = cls(depth=18, base_channels=8, head_dim=8, layer_attn='MRLALight')
    torch.manual_seed(0)
    by_dict = cls(depth=18, base_channels=8, head_dim=8, layer_attn=dict(type='MRLALight'))
    assert by_name.layer_attn_cfg == {'type': 'MRLALight'}
    assert all(isinstance(m, MRLALight) for m in by_name.layer_attn_modules())
    for (n, a), (_, b) in zip(by_name.state_dict().items(), by_dict.state_dict().items()):
        assert torch.equal(a, b), n


def test_doctest_examples_run():
    import doctest

    from kcla_mm.models.backbones import (mmdet_kcla_resnet, mmpretrain_kcla_resnet,
                                          mmseg_kcla_resnet)
    for mod in (mmdet_kcla_resnet, mmseg_kcla_resnet, mmpretrain_kcla_resnet):
        res = doctest.testmod(mod)
        assert res.attempted > 0 and res.failed == 0


@pytest.mark.parametrize('kwargs, match', [
    (dict(depth=19), 'depth=19'),
    (dict(depth=50, out_indices=(0, 4)), r'out_indices=\(0, 4\)'),
    (dict(depth=50, frozen_stages=7), 'frozen_stages=7'),
    (dict(depth=50, layer_attn=dict(type='Nope')), "'Nope'"),
    (dict(depth=50, head_dim=48), 'head_dim=48'),
    (dict(depth=50, layer_attn=dict(type='KCLA', temperature_range=(0, 1))),
     'temperature_range'),
    (dict(depth=50, layer_attn=dict(type='KCLA', bogus=1)), 'bogus'),
    (dict(depth=50, layer_attn='Nope'), "'Nope'"),
    (dict(depth=50, layer_attn=3), 'layer_attn=3'),
    (dict(depth=50, strides=(1, 2, 2)), r'strides=\(1, 2, 2\).*num_stages=4'),
    (dict(depth=50, dilations=(1, 1, 1, 1, 1)), r'dilations=.*5'),
])
@pytest.mark.parametrize('cls', CLASSES)
def test_bad_arguments_raise_at_build_time(cls, kwargs, match):
    # every invalid backbone argument names itself and its value
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize('training', [False, True])
@pytest.mark.parametrize('cls', CLASSES)
def test_backbone_equals_the_reference_step_by_step(cls, training):
    # the backbone's threading of the state (plain ops, eval-mode folding of
    # the attention BN, recomputation in training) against the paper's step
    # (kcla_reference) applied after each host block, in float64
    torch.manual_seed(0)
    model = tiny(cls, depth=50, norm_eval=False, out_indices=(0, 1, 2, 3)).double().train(training)
    randomize_norms(model)
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    with ops.fused_kernels(False):
        got = model(x)
        h, raw, want = model._stem(x.contiguous(memory_format=torch.channels_last)), None, []
        for name in model.res_layers:
            for block, attn in zip(getattr(model, name), getattr(model, f'{name}_attn')):
                h, raw = kcla_step(attn, block(h), raw)
            want.append(h)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('method', list(METHODS) + [None])
@pytest.mark.parametrize('channels_last', [None, True, False])
def test_outputs_are_nchw_contiguous(method, channels_last):
    # mmcv's RoIAlign reads its input as NCHW without checking: channels-last
    # features would silently give scrambled RoI features
    model = tiny(depth=18, method=method, channels_last=channels_last).eval()
    assert all(o.is_contiguous() for o in model(torch.rand(1, 3, 32, 32)))


# ------------------------------------------------ memory-saving training path
def _grads(model, x):
    xi = x.clone().requires_grad_()
    out = model(xi)
    sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum()
        for o in out).backward()
    return ([o.detach() for o in out], xi.grad,
            {n: p.grad for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers() if 'running' in n})


@pytest.mark.parametrize('channels_last', [True, False])
def test_recomputed_training_path_equals_plain_autograd(channels_last):
    # the recomputed KCLA tail (hand-derived backward) and the recomputed block
    # inputs give the gradients and BN statistics of plain autograd
    torch.manual_seed(0)
    model = tiny(depth=50, norm_eval=False, channels_last=channels_last).double().train()
    randomize_norms(model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    results = []
    for recompute in (False, True):
        model.load_state_dict(init)
        model.zero_grad()
        model.recompute_attn_outputs = recompute
        for m in model.layer_attn_modules():
            m.recompute_tail = recompute
        results.append(_grads(model, x))
    (o0, x0, g0, b0), (o1, x1, g1, b1) = results
    for a, b in zip(o0, o1):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(x1, x0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n)
    for n in b0:
        torch.testing.assert_close(b1[n], b0[n], msg=n)


def _kcla_outputs_alive_after_forward(model, x):
    import weakref
    refs = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: refs.append(weakref.ref(out[0])))
             for m in model.layer_attn_modules()]
    out = model(x)
    alive = [r() is not None for r in refs]
    sum(o.mean() for o in out).backward()
    for h in hooks:
        h.remove()
    return alive


def test_block_inputs_are_recomputed_not_kept():
    # plain path: the next block's saved copies of a KCLA output are
    # recomputed in the backward pass: after the forward pass no KCLA output
    # is alive (the returned stage output is a NCHW copy);
    # recompute_attn_outputs=False keeps all of them (all but the last one,
    # which nothing saves)
    model = tiny(depth=50, channels_last=True, norm_eval=False).train()
    x = torch.rand(2, 3, 64, 64)
    with ops.fused_kernels(False):
        assert _kcla_outputs_alive_after_forward(model, x) == [False] * 16
        model.recompute_attn_outputs = False
        assert _kcla_outputs_alive_after_forward(model, x) == [True] * 15 + [False]


def test_fused_training_keeps_the_outputs_of_steps_with_a_state():
    # the fused CPU kernels' steps with a state keep their outputs instead of
    # their inputs (nothing to recompute: the next block's copies are those
    # outputs); the first step keeps its input, its state, and its output is
    # recomputed, unless recompute_attn_outputs=False. (The last output's data
    # is kept by its own node, which keeps no reference to the tensor object.)
    build = pytest.importorskip('kcla_mm.ops.fused.build')
    if not build.available():
        pytest.skip('the fused CPU kernels are not built here')
    model = tiny(depth=50, channels_last=True, norm_eval=False).train()
    x = torch.rand(2, 3, 64, 64)
    assert _kcla_outputs_alive_after_forward(model, x) == [False] + [True] * 14 + [False]
    model.recompute_attn_outputs = False
    assert _kcla_outputs_alive_after_forward(model, x) == [True] * 15 + [False]


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_kept_attn_outputs_give_the_recomputed_values(dtype):
    # recompute_attn_outputs=False spends memory, not numerics: outputs, input
    # and parameter gradients and BN statistics bit for bit those of the
    # recomputing default (float32: the fused CPU kernels where built, whose
    # recomputation is the forward's kernel; float64: the eager tail)
    torch.manual_seed(0)
    ref = tiny(depth=50, norm_eval=False, channels_last=True).to(dtype).train()
    randomize_norms(ref)
    kept = tiny(depth=50, norm_eval=False, channels_last=True,
                recompute_attn_outputs=False).to(dtype).train()
    kept.load_state_dict(ref.state_dict())
    x = torch.rand(2, 3, 32, 32, dtype=dtype)
    (o0, x0, g0, b0), (o1, x1, g1, b1) = _grads(ref, x), _grads(kept, x)
    assert all(torch.equal(a, b) for a, b in zip(o0, o1))
    assert torch.equal(x0, x1)
    assert g0.keys() == g1.keys() and b0.keys() == b1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    for n in b0:
        assert torch.equal(b0[n], b1[n]), n


@pytest.mark.parametrize('value', [None, 0, 'no'])
def test_recompute_attn_outputs_must_be_a_bool(value):
    with pytest.raises(ValueError, match=f'recompute_attn_outputs={value!r}'):
        tiny(depth=18, recompute_attn_outputs=value)


def test_outer_saved_tensor_hooks_see_every_saved_tensor():
    # under a user's saved-tensor hooks (offloading, checkpointing) the
    # backbone steps aside: the outer hooks pack the block inputs themselves
    model = tiny(depth=18, channels_last=True, norm_eval=False).train()
    x = torch.rand(2, 3, 32, 32)
    ref = _grads(model, x)
    model.zero_grad()
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _grads(model, x)
    assert (2, 8, 8, 8) in packed  # a stage-1 block input
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], msg=n)


def test_gradients_return_to_the_backbone_channels_last():
    # the heads' NCHW gradients are handed back channels-last, so the backward
    # pass does not mix memory formats (several times slower on CPU)
    from kcla_mm.models.backbones.kcla_resnet import _to_nchw
    x = torch.rand(2, 8, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = _to_nchw(x)
    assert y.is_contiguous()
    y.backward(torch.rand(2, 8, 5, 5))
    assert x.grad.is_contiguous(memory_format=torch.channels_last)
    assert _to_nchw(y) is y


@pytest.mark.slow
def test_backbone_compiles_without_graph_breaks_in_training():
    # the training-only paths (recomputed tail, saved-input hooks) step aside
    # under torch.compile: fullgraph tracing works and gives the eager gradients
    torch.manual_seed(0)
    model = tiny(depth=18, channels_last=True, norm_eval=False).double().train()
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    ref = _grads(model, x)
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    got = _grads(compiled, x)
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(b, a)
    for n in ref[2]:
        name = '_orig_mod.' + n  # torch.compile's wrapper prefixes the names
        torch.testing.assert_close(got[2][name], ref[2][n], msg=n)


@pytest.mark.parametrize('fused', [True, False])
def test_inference_reuses_state_memory_without_changing_values(fused):
    # in inference the backbone lets each KCLA step overwrite the previous
    # state's map (reuse_state): the outputs equal the step-by-step
    # computation without reuse, and the operator leaves a caller's state
    # alone unless asked
    torch.manual_seed(0)
    model = tiny(depth=50, channels_last=True).eval()
    randomize_norms(model)
    x = torch.rand(2, 3, 64, 64)
    with ops.fused_kernels(fused), torch.no_grad():
        got = model(x)
        h, state = model._stem(x.contiguous(memory_format=torch.channels_last)), None
        for name in model.res_layers:
            for block, attn in zip(getattr(model, name), getattr(model, f'{name}_attn')):
                h, state = attn(block(h), state)
        torch.testing.assert_close(got[-1], h.contiguous(), rtol=0, atol=0)
        layer = model.layer1_attn[1]
        xs = torch.rand(2, 32, 16, 16).contiguous(memory_format=torch.channels_last)
        _, state = model.layer1_attn[0](xs)
        state = type(state)(state.mean.clone(), state.log_z)
        before = state.mean.clone()
        x2 = torch.rand_like(xs)
        layer(x2, state)
        assert torch.equal(state.mean, before)
        layer(x2, state, reuse_state=True)
        assert not torch.equal(state.mean, before)
