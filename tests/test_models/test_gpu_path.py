"""What GPU users rely on, checked on the CPU: deformable convolutions,
torch.compile, SyncBN, forward hooks, meta-device init, no host synchronisation."""
import warnings

import pytest
import torch
from torch import nn
from utils import randomize_norms

import kcla_mm.ops as ops
from kcla_mm.models.backbones import KCLAResNet
from kcla_mm.ops import KCLA, log_uniform_inverse_temperatures


def tiny(**kw):
    kw.setdefault('head_dim', 8)
    kw.setdefault('layer_attn', dict(type='KCLA'))
    return KCLAResNet(depth=50, base_channels=8, **kw)


DCN = dict(dcn=dict(type='DCNv2', deform_groups=1, fallback_on_stride=False),
           stage_with_dcn=(False, True, True, True))


def test_deformable_stages_compute_in_nchw():
    # mmcv's deformable kernels read their input as NCHW: with DCN the
    # backbone's default layout is NCHW, and the values equal those of a
    # backbone told so explicitly; channels_last=True with DCN is refused
    torch.manual_seed(0)
    model = tiny(**DCN).eval()
    assert model.channels_last is False
    randomize_norms(model)
    for m in model.modules():  # offsets away from zero: the sampling matters
        if type(m).__name__ == 'ModulatedDeformConv2dPack':
            nn.init.normal_(m.conv_offset.weight, std=0.1)
    nchw = tiny(channels_last=False, **DCN).eval()
    nchw.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        for a, b in zip(model(x), nchw(x)):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match='channels_last=True cannot be combined with dcn'):
        tiny(channels_last=True, **DCN)


@pytest.mark.slow
@pytest.mark.parametrize('train', [False, True])
def test_backbone_compiles_to_one_graph(train):
    # eval, and training as the COCO configs run it (frozen stem and stage 1,
    # BatchNorms in eval mode): one graph, no breaks, the eager values
    torch.manual_seed(0)
    model = tiny(frozen_stages=1, norm_eval=True).train(train)
    randomize_norms(model)
    x = torch.rand(2, 3, 32, 32, requires_grad=train)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(model, backend='aot_eager')
    with torch.set_grad_enabled(train):
        got, want = compiled(x), model(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if train:
        g_got = torch.autograd.grad(sum(o.sum() for o in got), x)[0]
        g_want = torch.autograd.grad(sum(o.sum() for o in want), x)[0]
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)


class _SyncBatchNormOneProcess(nn.SyncBatchNorm):
    """SyncBatchNorm's class, BatchNorm's computation (one process, on the CPU)."""

    def forward(self, x):
        return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                        self.bias, self.training, self.momentum, self.eps)


def test_sync_batchnorm_warns_that_the_tail_is_kept():
    layer = KCLA(32, head_dim=8, norm_layer=_SyncBatchNormOneProcess).train()
    x = torch.rand(2, 32, 4, 4, requires_grad=True)
    with ops.fused_kernels(False), pytest.warns(RuntimeWarning, match='SyncBatchNorm'):
        out, _ = layer(x)
    plain = KCLA(32, head_dim=8).train()
    plain.load_state_dict(layer.state_dict())
    with ops.fused_kernels(False), warnings.catch_warnings():
        warnings.simplefilter('error')
        want, _ = plain(x)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize('fused', [True, False])
def test_forward_hooks_see_the_values_they_were_given(fused):
    # in inference the backbone reuses state memory; a hooked block's output
    # (the first step's state) is never overwritten
    torch.manual_seed(0)
    model = tiny().eval()
    randomize_norms(model)
    kept = []
    for block in (model.layer1[0], model.layer1[1], model.layer2[0]):
        block.register_forward_hook(lambda mod, inp, out: kept.append((out, out.clone())))
    with ops.fused_kernels(fused), torch.no_grad():
        model(torch.rand(2, 3, 64, 64))
    assert len(kept) == 3
    for out, copy in kept:
        assert torch.equal(out, copy)


def test_nan_check_is_cpu_only_by_default():
    # the finiteness check reads a bool on the host: on by default for CPU
    # inputs only (on CUDA it would wait for the device at every forward)
    x = torch.rand(1, 3, 32, 32)
    x[0, 0, 0, 0] = float('nan')
    with pytest.raises(ValueError, match='non-finite'):
        tiny().eval()(x)
    with torch.no_grad():
        tiny(check_finite=False).eval()(x)  # no error: NaN features, by request
    with pytest.raises(ValueError, match='check_finite'):
        tiny(check_finite='yes')


def test_meta_device_init_rebuilds_the_temperatures():
    # meta-device construction, to_empty() and a state dict (the FSDP route):
    # the temperatures are rebuilt, not read from uninitialised memory
    ref = tiny()
    with torch.device('meta'):
        model = tiny()
    model.to_empty(device='cpu')
    model.load_state_dict(ref.state_dict())
    for m, r in zip(model.layer_attn_modules(), ref.layer_attn_modules()):
        assert torch.equal(m.inv_tau, r.inv_tau)
        assert torch.equal(m.inv_tau, log_uniform_inverse_temperatures(m.num_heads, (0.7, 1 / 0.7)))
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        for a, b in zip(model.eval()(x), ref.eval()(x)):
            torch.testing.assert_close(a, b)
