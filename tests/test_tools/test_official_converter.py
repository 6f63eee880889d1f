"""The reference-checkpoint converter: full-size key sets, features, refusals."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference_kcla import RefKCLAResNet, eca_k
from utils import randomize_norms

from kcla_mm.models.backbones import KCLAResNet
from kcla_mm.utils.official_checkpoint import NotAnOfficialCheckpoint, convert_official_state_dict

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / 'tools' / 'model_converters' / 'kcla_official_to_mmlab.py'
STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


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
    torch.manual_seed(0)
    host = KCLAResNet(depth=50, base_channels=16, layer_attn=None)
    ref = RefKCLAResNet(host, head_dim=16).double()
    randomize_norms(ref)
    for name, p in ref.named_parameters():
        if 'norm_d' not in name and p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
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
    r = subprocess.run([sys.executable, str(TOOL), str(src), str(dst)], capture_output=True,
                       text=True, cwd=ROOT)
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
    r = subprocess.run([sys.executable, str(TOOL), str(src), str(dst)], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode != 0 and not dst.exists()
    assert re.search(match, r.stderr), r.stderr


def test_cli_reports_unmapped_keys(tmp_path):
    sd = reference_state_dict(50)
    sd['module.layer2.attention.1.mystery.weight'] = torch.zeros(3)
    sd['module.head.extra'] = torch.zeros(1)
    src, dst = tmp_path / 'x.pth', tmp_path / 'y.pth'
    torch.save({'state_dict': sd}, src)
    r = subprocess.run([sys.executable, str(TOOL), str(src), str(dst)], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 1 and not dst.exists()
    assert 'layer2.attention.1.mystery.weight' in r.stderr and 'head.extra' in r.stderr


def test_temperatures_are_checked():
    sd = reference_state_dict(50)
    sd['module.layer1.attention.0.norm_d'] = torch.ones(1, 4, 1, 1, 1)
    with pytest.raises(ValueError, match='layer1.attention.0.norm_d'):
        convert_official_state_dict(sd)


def test_plain_state_dict_is_not_taken_for_a_reference_one():
    with pytest.raises(NotAnOfficialCheckpoint):
        convert_official_state_dict(KCLAResNet(depth=18, base_channels=8, head_dim=8)
                                    .state_dict())
