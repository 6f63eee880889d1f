"""The reference-checkpoint converter: full-size key sets, features, logits, refusals."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import DefaultScope
from mmengine.runner import load_checkpoint
from mmpretrain.registry import MODELS
from reference_kcla import RefKCLAResNet, eca_k
from utils import load_tool, randomize_norms

import kcla_mm.host_fixes  # noqa: F401  (the safe loader tools/test.py uses)
from kcla_mm.models.backbones import KCLAResNet
from kcla_mm.utils.official_checkpoint import (NotAnOfficialCheckpoint, convert_official_state_dict,
                                               to_classifier_state_dict)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / 'tools' / 'model_converters' / 'kcla_official_to_mmlab.py'
STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
IN1K_CONFIGS = {50: 'kcla-r50_8xb32-100e_in1k.py', 101: 'kcla-r101_8xb32-100e_in1k.py'}
#: The ImageNet classifier at a quarter of the width, with 10 classes.
NARROW = {'model.backbone.base_channels': 16, 'model.backbone.head_dim': 16,
          'model.head.in_channels': 512, 'model.head.num_classes': 10}


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT)


def imagenet_classifier(depth: int, overrides=None):
    """The ``ImageClassifier`` of the KCLA ImageNet config of ``depth`` (dotted overrides)."""
    cfg = Config.fromfile(str(ROOT / 'configs' / 'kcla_resnet' / IN1K_CONFIGS[depth]))
    cfg.merge_from_dict(overrides or {})
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        return MODELS.build(cfg.model)


def random_reference(num_classes: int = 1000, **host_kwargs):
    """A float64 reference ResNet-50 at a quarter of the width, weights and norms random."""
    torch.manual_seed(0)
    host = KCLAResNet(depth=50, base_channels=16, layer_attn=None, **host_kwargs)
    ref = RefKCLAResNet(host, head_dim=16, num_classes=num_classes).double()
    randomize_norms(ref)
    for name, p in ref.named_parameters():
        if 'norm_d' not in name and p.dim() > 1:  # fan-in scaled: values stay near 1
            torch.nn.init.normal_(p, std=p[0].numel()**-0.5)
    return ref


def reference_state_dict(depth: int, head_dim: int = 64):
    """A synthetic reference checkpoint laid out exactly as docs/method.md, section 8."""
    host = KCLAResNet(depth=depth, layer_attn=None).state_dict()
    sd = {}
    for k, v in host.items():
        if k.startswith('layer'):
            s, rest = k.split('.', 1)
            k = f'{s}.layers.{rest}'
        sd['module.' + k] = torch.randn_like(v.float()).to(v.dtype)
    for s, n in enumerate(STAGES[depth], start=1):
        c = 256 * 2**(s - 1)
        g, k = c // head_dim, eca_k(c)
        for i in range(n):
            p = f'module.layer{s}.attention.{i}.'
            sd[p + 'Wq.weight'] = torch.randn(1, 1, k)
            sd[p + 'Wk.weight'] = torch.randn(1, 1, k)
            sd[p + 'Wv.weight'] = torch.randn(c, 1, 3, 3)
            sd[p + 'head_att.weight'] = torch.randn(g, g)
            sd[p + 'norm_d'] = torch.exp(torch.linspace(math.log(0.7), math.log(1 / 0.7), g)
                                         ).view(1, g, 1, 1, 1)
            bns = ['bn_attention']
            if i in (0, 11):
                sd[p + 'adjust_channel.weight'] = torch.randn(c, c // (2 * g), 1, 1)
                sd[p + 'u_Wk.weight'] = torch.randn(1, 1, k)
                bns.append('u_bn')
            for bn in bns:
                sd[p + f'{bn}.weight'] = torch.rand(c)
                sd[p + f'{bn}.bias'] = torch.rand(c)
                sd[p + f'{bn}.running_mean'] = torch.rand(c)
                sd[p + f'{bn}.running_var'] = torch.rand(c) + 0.5
                sd[p + f'{bn}.num_batches_tracked'] = torch.tensor(7)
    sd['module.fc.weight'] = torch.randn(1000, 2048)
    sd['module.fc.bias'] = torch.randn(1000)
    return sd


def n_params(sd):
    return sum(v.numel() for k, v in sd.items()
               if not k.endswith(('running_mean', 'running_var', 'num_batches_tracked')))


@pytest.mark.parametrize('depth, total', [(50, 25_859_078), (101, 45_082_309)])
def test_full_size_reference_checkpoint_loads_without_missing_or_unexpected(depth, total):
    sd = reference_state_dict(depth)
    assert n_params(sd) == total  # the synthetic layout matches the reference totals
    converted, report = convert_official_state_dict(sd)
    assert report['unmapped'] == []
    missing, unexpected = KCLAResNet(depth=depth).load_state_dict(converted, strict=False)
    assert missing == [] and unexpected == []


def test_converted_model_gives_the_reference_features():
    ref = random_reference()
    sd = {'module.' + k: v for k, v in ref.state_dict().items()}
    converted, report = convert_official_state_dict(sd)
    assert report['unmapped'] == []
    ours = KCLAResNet(depth=50, base_channels=16, head_dim=16).double()
    missing, unexpected = ours.load_state_dict(converted, strict=False)
    assert missing == [] and unexpected == []
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    for a, b in zip(ours.eval()(x), ref.eval()(x)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


def test_cli_writes_an_mmengine_checkpoint(tmp_path):
    src, dst = tmp_path / 'r50.pth.tar', tmp_path / 'out' / 'r50.pth'
    torch.save({'state_dict': reference_state_dict(50), 'epoch': 100, 'best_acc1': 78.0}, src)
    r = run_tool(src, dst)
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(dst, weights_only=True)
    missing, unexpected = KCLAResNet(depth=50).load_state_dict(ckpt['state_dict'], strict=False)
    assert missing == [] and unexpected == []


@pytest.mark.parametrize('payload, match', [
    ({'state_dict': {'conv1.weight': torch.zeros(1)}}, 'not a checkpoint of the KCLA reference'),
    ([1, 2, 3], 'expected a dict'),
    ({'state_dict': {}}, 'no \\(non-empty\\) state_dict'),
])
def test_cli_refuses_other_files_and_writes_nothing(tmp_path, payload, match):
    src, dst = tmp_path / 'x.pth', tmp_path / 'y.pth'
    torch.save(payload, src)
    r = run_tool(src, dst)
    assert r.returncode != 0 and not dst.exists()
    assert re.search(match, r.stderr), r.stderr


def test_cli_reports_unmapped_keys(tmp_path):
    sd = reference_state_dict(50)
    sd['module.layer2.attention.1.mystery.weight'] = torch.zeros(3)
    sd['module.head.extra'] = torch.zeros(1)
    src, dst = tmp_path / 'x.pth', tmp_path / 'y.pth'
    torch.save({'state_dict': sd}, src)
    r = run_tool(src, dst)
    assert r.returncode == 1 and not dst.exists()
    assert 'layer2.attention.1.mystery.weight' in r.stderr and 'head.extra' in r.stderr


@pytest.mark.parametrize('depth', [50, 101])
def test_cli_writes_a_classifier_the_imagenet_config_loads_strictly(tmp_path, depth):
    sd = reference_state_dict(depth)
    src, dst = tmp_path / 'ref.pth.tar', tmp_path / 'out' / 'cls.pth'
    torch.save({'state_dict': sd, 'epoch': 100, 'best_acc1': 78.0}, src)
    r = run_tool('--to', 'classifier', src, dst)
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(dst, weights_only=True)
    assert ckpt['meta'] == {'converted_from': 'ref.pth.tar', 'epoch': 100, 'num_classes': 1000}
    model = imagenet_classifier(depth)
    missing, unexpected = model.load_state_dict(ckpt['state_dict'], strict=True)
    assert missing == [] and unexpected == []
    assert torch.equal(model.head.fc.weight, sd['module.fc.weight'])
    assert torch.equal(model.head.fc.bias, sd['module.fc.bias'])


def test_converted_classifier_gives_the_reference_logits(tmp_path):
    # mmpretrain's ResNet keeps a 64-channel stem whatever base_channels is
    ref = random_reference(num_classes=10, stem_channels=64)
    torch.nn.init.normal_(ref.fc.bias)
    src, dst = tmp_path / 'ref.pth.tar', tmp_path / 'cls.pth'
    torch.save({'state_dict': {'module.' + k: v for k, v in ref.state_dict().items()}}, src)
    r = run_tool('--to', 'classifier', '--num-classes', 10, src, dst)
    assert r.returncode == 0, r.stderr
    ours = imagenet_classifier(50, NARROW).double()
    load_checkpoint(ours, str(dst), map_location='cpu', strict=True)
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        logits = ours.eval()(x, mode='tensor')
        expected = ref.eval().logits(x)
    assert logits.shape == (2, 10)
    torch.testing.assert_close(logits, expected, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize('drop, args, match', [
    (('fc.weight', 'fc.bias'), [], r'no fc\.weight and fc\.bias: the checkpoint holds no '
                                   r'classifier'),
    (('fc.bias', ), [], r'no fc\.bias: the checkpoint holds no classifier'),
    ((), ['--num-classes', 10], r'1000 classes, not the 10 asked for'),
], ids=['no-fc', 'no-fc-bias', 'other-class-count'])
def test_cli_refuses_a_classifier_without_a_fitting_fc(tmp_path, drop, args, match):
    sd = reference_state_dict(50)
    for k in drop:
        del sd['module.' + k]
    src, dst = tmp_path / 'ref.pth.tar', tmp_path / 'cls.pth'
    torch.save({'state_dict': sd}, src)
    r = run_tool('--to', 'classifier', *args, src, dst)
    assert r.returncode == 1 and not dst.exists()
    assert re.search(match, r.stderr) and 'nothing written' in r.stderr, r.stderr


@pytest.mark.parametrize('depth, base_channels, width', [(50, 16, 512), (18, 8, 64)])
def test_classifier_keys_follow_the_backbone_and_its_width(depth, base_channels, width):
    backbone = KCLAResNet(depth=depth, base_channels=base_channels, head_dim=8).state_dict()
    weight, bias = torch.zeros(10, width), torch.zeros(10)
    out = to_classifier_state_dict(backbone, weight, bias, num_classes=10)
    assert list(out) == ['backbone.' + k for k in backbone] + ['head.fc.weight', 'head.fc.bias']
    assert out['head.fc.weight'] is weight and out['head.fc.bias'] is bias
    with pytest.raises(ValueError, match=rf'must be \[num_classes, {width}\]'):
        to_classifier_state_dict(backbone, torch.zeros(10, 2 * width), bias)
    with pytest.raises(ValueError, match=r'must be \[10\]'):
        to_classifier_state_dict(backbone, weight, torch.zeros(1000))
    with pytest.raises(ValueError, match='10 classes, not the 1000 asked for'):
        to_classifier_state_dict(backbone, weight, bias, num_classes=1000)


def test_cli_takes_num_classes_with_a_classifier_only(capsys):
    tool = load_tool(TOOL, 'kcla_official_to_mmlab')
    assert tool.parse_args(['a', 'b']).to == 'backbone'
    assert tool.parse_args(['--to', 'classifier', 'a', 'b']).num_classes == 1000
    with pytest.raises(SystemExit) as e:
        tool.parse_args(['--num-classes', '1000', 'a', 'b'])  # the default output: a backbone
    assert e.value.code == 2
    assert '--num-classes applies to --to classifier only' in capsys.readouterr().err


def test_temperatures_are_checked():
    sd = reference_state_dict(50)
    sd['module.layer1.attention.0.norm_d'] = torch.ones(1, 4, 1, 1, 1)
    with pytest.raises(ValueError, match='layer1.attention.0.norm_d'):
        convert_official_state_dict(sd)


def test_plain_state_dict_is_not_taken_for_a_reference_one():
    with pytest.raises(NotAnOfficialCheckpoint):
        convert_official_state_dict(KCLAResNet(depth=18, base_channels=8, head_dim=8)
                                    .state_dict())
