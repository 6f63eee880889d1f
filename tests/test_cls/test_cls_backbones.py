"""The mmpretrain backbones: the hand-off of a classifier's weights to the other
hosts, the CIFAR networks against an independent re-statement, drop path."""
import pytest
import torch
import torch.nn.functional as F
from mmpretrain.models.backbones import ResNet as ClsResNet
from mmpretrain.models.backbones.resnet import Bottleneck
from torch import nn
from utils import randomize_norms

from kcla_mm.models.backbones import KCLAResNet, KCLAResNetSeg
from kcla_mm.models.backbones.cifar_kcla_resnet import CifarKCLAResNet, cifar_stage_blocks
from kcla_mm.models.backbones.mmpretrain_kcla_resnet import KCLABottleneck, KCLAResNetCls

METHODS = ('KCLA', 'MRLALight', 'FullLayerAttention', None)
SMALL = dict(depth=50, stem_channels=8, base_channels=8, head_dim=8, out_indices=(0, 1, 2, 3))


@pytest.mark.parametrize('method', METHODS)
def test_a_classifier_checkpoint_initialises_the_detection_and_segmentation_backbones(
        tmp_path, method):
    # what a classification run writes: the classifier's state dict, backbone
    # under "backbone.", next to its head
    torch.manual_seed(0)
    cls = KCLAResNetCls(layer_attn=method, **SMALL)
    randomize_norms(cls)
    for p in cls.parameters():
        nn.init.normal_(p, std=0.1)
    state = {f'backbone.{k}': v for k, v in cls.state_dict().items()}
    state.update({'head.fc.weight': torch.rand(10, 256), 'head.fc.bias': torch.rand(10)})
    ckpt = tmp_path / 'epoch_1.pth'
    torch.save({'state_dict': state, 'meta': {}}, ckpt)
    init_cfg = dict(type='Pretrained', checkpoint=str(ckpt), prefix='backbone.')
    det = KCLAResNet(layer_attn=method, norm_eval=False, init_cfg=init_cfg, **SMALL)
    seg = KCLAResNetSeg(layer_attn=method, init_cfg=init_cfg, **SMALL)
    x = torch.rand(2, 3, 64, 64)
    want = cls.eval()(x)
    for model in (det, seg):
        model.init_weights()
        # every key of the backbone came from the checkpoint, none was left at its init
        got_state = model.state_dict()
        assert sorted(got_state) == sorted(cls.state_dict())
        for k, v in cls.state_dict().items():
            assert torch.equal(got_state[k], v), k
        for a, b in zip(model.eval()(x), want):
            torch.testing.assert_close(a, b)


def test_plain_classifier_backbone_is_exactly_mmpretrains_resnet():
    ours = KCLAResNetCls(depth=50, base_channels=8, layer_attn=None, drop_path_rate=0.1)
    host = ClsResNet(depth=50, base_channels=8, drop_path_rate=0.1)
    assert list(ours.state_dict()) == list(host.state_dict())
    host.load_state_dict(ours.state_dict())
    x = torch.rand(2, 3, 32, 32)
    host.eval()  # mmpretrain's train() returns None
    torch.testing.assert_close(ours.eval()(x), host(x))


def test_zero_init_residual_keeps_its_mmpretrain_meaning():
    model = KCLAResNetCls(depth=50, base_channels=8, head_dim=8)
    model.init_weights()
    blocks = [b for name in model.res_layers for b in getattr(model, name)]
    assert all(isinstance(b, KCLABottleneck) for b in blocks)
    assert all(torch.count_nonzero(b.norm3.weight) == 0 for b in blocks)
    # while the attention's own layers get their reference initialisation
    assert all(torch.count_nonzero(m.wv.weight) > 0 for m in model.layer_attn_modules())


def test_residual_drop_path_runs_the_hosts_block_in_training():
    # mmpretrain's drop_path_rate drops the residual branch before the add:
    # the block end must not skip it, and must not apply it in eval
    torch.manual_seed(0)
    model = KCLAResNetCls(depth=50, base_channels=8, head_dim=8, drop_path_rate=0.5)
    block = model.layer3[2]
    assert block.drop_path.drop_prob > 0
    x = torch.rand(4, 128, 8, 8)
    for training in (True, False):
        block.train(training)
        torch.manual_seed(1)
        got = block(x)
        torch.manual_seed(1)
        want = Bottleneck.forward(block, x)
        torch.testing.assert_close(got, want)
    block.train()
    torch.manual_seed(1)
    dropped = block(x)
    block.eval()
    assert not torch.allclose(dropped, block(x))  # the drop did happen in training


class RefCifarBottleneckNet(nn.Module):
    """The layer-attention papers' CIFAR ResNet (no attention), written out by hand:
    3x3 stem, three stages of n Bottlenecks (planes 16/32/64, expansion 4,
    the stride on the 3x3 conv, a 1x1 conv + BN shortcut where the shape changes)."""

    def __init__(self, n: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
        self.blocks = nn.ModuleList()
        cin = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                s = stride if i == 0 else 1
                b = nn.Module()
                b.c1, b.n1 = nn.Conv2d(cin, planes, 1, bias=False), nn.BatchNorm2d(planes)
                b.c2 = nn.Conv2d(planes, planes, 3, stride=s, padding=1, bias=False)
                b.n2 = nn.BatchNorm2d(planes)
                b.c3 = nn.Conv2d(planes, 4 * planes, 1, bias=False)
                b.n3 = nn.BatchNorm2d(4 * planes)
                b.short = None if (s == 1 and cin == 4 * planes) else nn.Sequential(
                    nn.Conv2d(cin, 4 * planes, 1, stride=s, bias=False),
                    nn.BatchNorm2d(4 * planes))
                self.blocks.append(b)
                cin = 4 * planes

    def forward(self, x):
        x = F.relu(self.stem(x))
        for b in self.blocks:
            out = F.relu(b.n1(b.c1(x)))
            out = F.relu(b.n2(b.c2(out)))
            out = b.n3(b.c3(out))
            x = F.relu(out + (x if b.short is None else b.short(x)))
        return x


@pytest.mark.parametrize('depth, n', [(20, 2), (56, 6)])
def test_cifar_network_equals_the_papers_network(depth, n):
    torch.manual_seed(0)
    ours = CifarKCLAResNet(depth=depth, layer_attn=None).double()
    ref = RefCifarBottleneckNet(n).double()
    randomize_norms(ours)
    # ours -> the reference, parameter by parameter in module order
    ours_tensors = [t for k, t in ours.state_dict().items() if 'num_batches' not in k]
    ref_keys = [k for k in ref.state_dict() if 'num_batches' not in k]
    assert len(ours_tensors) == len(ref_keys)
    ref.load_state_dict(dict(zip(ref_keys, ours_tensors)), strict=False)
    x = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    (got, ) = ours.eval()(x)
    torch.testing.assert_close(got, ref.eval()(x), rtol=1e-10, atol=1e-10)
    assert got.shape == (2, 256, 8, 8)


@pytest.mark.parametrize('depth, block, n, widths', [
    (20, 'Bottleneck', 2, (64, 128, 256)),
    (110, 'Bottleneck', 12, (64, 128, 256)),
    (20, 'BasicBlock', 3, (16, 32, 64)),
    (56, 'BasicBlock', 9, (16, 32, 64)),
])
def test_cifar_network_layout(depth, block, n, widths):
    model = CifarKCLAResNet(depth=depth, block=block, out_indices=(0, 1, 2))
    assert [len(getattr(model, name)) for name in model.res_layers] == [n] * 3
    assert isinstance(model.maxpool, nn.Identity)
    assert (model.conv1.kernel_size, model.conv1.stride) == ((3, 3), (1, 1))
    outs = model.eval()(torch.rand(1, 3, 32, 32))
    shapes = [(widths[0], 32, 32), (widths[1], 16, 16), (widths[2], 8, 8)]
    assert [tuple(o.shape[1:]) for o in outs] == shapes
    # head size 16: 1-16 heads per stage; the cross-stage step adapts with a
    # stride-2 grouped 1x1 convolution
    heads = [model.layer_attn_modules()[i * n].num_heads for i in range(3)]
    assert heads == [w // 16 for w in widths]
    adjust = getattr(model, 'layer2_attn')[0].adjust
    assert adjust.stride == (2, 2) and adjust.kernel_size == (1, 1) and adjust.groups == heads[1]


@pytest.mark.parametrize('depth, block', [(21, 'Bottleneck'), (8, 'Bottleneck'),
                                          (21, 'BasicBlock'), (20, 'Basic')])
def test_cifar_depth_must_fit_the_block(depth, block):
    with pytest.raises(ValueError, match=f'{depth}|{block}'):
        CifarKCLAResNet(depth=depth, block=block)
    with pytest.raises(ValueError):
        cifar_stage_blocks(depth, block)


def test_doctest_examples_run():
    import doctest

    from kcla_mm.models.backbones import cifar_kcla_resnet, mmpretrain_kcla_resnet
    for mod in (mmpretrain_kcla_resnet, cifar_kcla_resnet):
        res = doctest.testmod(mod)
        assert res.attempted > 0 and res.failed == 0
