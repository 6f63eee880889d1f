"""The analysis tools end to end on tiny configs: outputs, checkpoints, errors, --help."""
import csv
import importlib
import json
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / 'tools' / 'analysis_tools'

BACKBONE = ("default_scope = 'mmdet'\n"
            "custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)\n"
            "model = dict(type='KCLAResNet', depth=18, base_channels=8, head_dim=8, "
            "layer_attn={layer_attn})\n")
DETECTOR = ("_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'\n"
            "custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)\n"
            "model = dict(\n"
            "    backbone=dict(type='KCLAResNet', depth=18, base_channels=8, head_dim=8,\n"
            "                  layer_attn=dict(type='KCLA'), init_cfg=None),\n"
            "    neck=dict(in_channels=[8, 16, 32, 64], out_channels=16),\n"
            "    rpn_head=dict(in_channels=16, feat_channels=16),\n"
            "    roi_head=dict(bbox_roi_extractor=dict(out_channels=16),\n"
            "                  bbox_head=dict(in_channels=16, fc_out_channels=32)),\n"
            "    test_cfg=dict(rpn=dict(nms_pre=50, max_per_img=20)))\n")


pytestmark = pytest.mark.usefixtures('one_thread')


def tool(name):
    """Import tools/analysis_tools/<name>.py as a module (the tools are scripts)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(name)


def config(tmp_path, text, name='cfg.py'):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def backbone_config(tmp_path, method='KCLA', name=None):
    layer_attn = 'None' if method is None else f"dict(type='{method}')"
    return config(tmp_path, BACKBONE.format(layer_attn=layer_attn), name or f'{method}.py')


def build(cfg_path):
    common = tool('_common')
    return common.build_backbone(common.load_config(cfg_path))


@pytest.fixture
def image_dir(tmp_path):
    d = tmp_path / 'images'
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        cv2.imwrite(str(d / f'{i}.png'), rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))
    return str(d)


def test_key_correlation_writes_outputs(tmp_path, image_dir, capsys):
    out = tmp_path / 'out'
    res = tool('key_correlation').main([backbone_config(tmp_path), '--images', image_dir,
                                        '--size', '32', '--out-dir', str(out)])
    m = np.array(res['matrix'])
    assert m.shape == (8, 8) and res['num_images'] == 3
    np.testing.assert_allclose(m, m.T)
    np.testing.assert_allclose(np.diag(m), 1, atol=1e-6)
    png = (out / 'key_correlation.png').read_bytes()
    assert png[:4] == b'\x89PNG' and len(png) > 5000
    with open(out / 'key_correlation.csv') as f:
        rows = list(csv.reader(f))
    assert rows[0] == ['block'] + res['blocks'] and len(rows) == 9
    np.testing.assert_allclose(np.array([r[1:] for r in rows[1:]], float), m, atol=1e-6)
    saved = json.loads((out / 'key_correlation.json').read_text())
    assert saved['summary'] == res['summary']
    stdout = capsys.readouterr().out
    assert res['summary_line'] in stdout and '3/3' in stdout  # summary and progress bar


def test_key_correlation_synthetic_images(tmp_path):
    res = tool('key_correlation').main([backbone_config(tmp_path, 'MRLALight'), '--synthetic',
                                        '2', '--size', '32', '--out-dir', str(tmp_path)])
    assert res['method'] == 'MRLALight' and res['num_images'] == 2


def test_checkpoint_is_loaded_in_either_layout(tmp_path, image_dir):
    cfg = backbone_config(tmp_path)
    torch.manual_seed(1)
    trained = build(cfg)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    sd = trained.state_dict()
    torch.save(sd, tmp_path / 'backbone.pth')
    torch.save({'meta': {}, 'state_dict': {f'backbone.{k}': v for k, v in sd.items()}},
               tmp_path / 'model.pth')
    kc = tool('key_correlation')
    args = ['--images', image_dir, '--size', '32', '--out-dir', str(tmp_path / 'o')]
    a = kc.main([cfg, str(tmp_path / 'backbone.pth')] + args)['matrix']
    b = kc.main([cfg, str(tmp_path / 'model.pth')] + args)['matrix']
    init = kc.main([cfg] + args)['matrix']
    np.testing.assert_allclose(a, b)
    assert not np.allclose(a, init)  # the checkpoint was used


def test_checkpoint_of_another_method_is_refused(tmp_path):
    # A FullLayerAttention checkpoint does not fit a KCLA config: name the keys.
    ckpt = tmp_path / 'full.pth'
    torch.save({'state_dict': build(backbone_config(tmp_path, 'FullLayerAttention')).state_dict()},
               ckpt)
    with pytest.raises(SystemExit) as e:
        tool('key_correlation').main([backbone_config(tmp_path), str(ckpt), '--synthetic', '1',
                                      '--out-dir', str(tmp_path)])
    msg = str(e.value)
    assert 'does not match' in msg and 'layer1_attn.0.phi.weight' in msg  # missing KCLA key
    assert 'missing in the checkpoint' in msg


def test_checkpoint_with_other_shapes_is_refused(tmp_path):
    # Another head_dim: same keys, other shapes; the message lists them.
    other = config(tmp_path, BACKBONE.format(layer_attn="dict(type='KCLA')").replace(
        'head_dim=8', 'head_dim=4'), 'hd4.py')
    ckpt = tmp_path / 'hd4.pth'
    torch.save(build(other).state_dict(), ckpt)
    with pytest.raises(SystemExit) as e:
        tool('layer_weights').main([backbone_config(tmp_path), str(ckpt), '--synthetic', '1',
                                    '--out-dir', str(tmp_path)])
    msg = str(e.value)
    assert 'shape mismatch' in msg and 'layer1_attn.1.phi.weight: (2, 2) vs (1, 1)' in msg


def test_plain_resnet_config_is_refused_by_key_correlation(tmp_path):
    with pytest.raises(SystemExit, match='no layer-attention modules'):
        tool('key_correlation').main([backbone_config(tmp_path, None), '--synthetic', '1',
                                      '--out-dir', str(tmp_path)])


def test_layer_weights_writes_outputs(tmp_path, capsys):
    out = tmp_path / 'out'
    results = tool('layer_weights').main([backbone_config(tmp_path), '--synthetic', '2',
                                          '--size', '32', '--out-dir', str(out)])
    assert [r.method for r in results] == ['KCLA', 'FullLayerAttention', 'MRLALight']
    png = (out / 'layer_weights.png').read_bytes()
    assert png[:4] == b'\x89PNG' and len(png) > 5000
    sums = {}
    with open(out / 'layer_weights.csv') as f:
        for row in csv.DictReader(f):
            key = (row['method'], int(row['t']))
            sums[key] = sums.get(key, 0.0) + float(row['weight'])
            assert int(row['s']) <= int(row['t'])
    for t in range(8):  # normalised methods: each row sums to 1
        assert sums[('KCLA', t)] == pytest.approx(1, abs=1e-4)
        assert sums[('FullLayerAttention', t)] == pytest.approx(1, abs=1e-4)
    with open(out / 'layer_weights_per_head.csv') as f:
        heads = {int(r['head']) for r in csv.DictReader(f) if r['block_t'] == 'layer4.1'}
    assert heads == set(range(8))
    assert 'all earlier stages' in capsys.readouterr().out


def test_layer_weights_compare_uses_the_given_config(tmp_path):
    ckpt = tmp_path / 'mrla.pth'
    mrla_cfg = backbone_config(tmp_path, 'MRLALight')
    model = build(mrla_cfg)
    with torch.no_grad():
        for m in model.layer_attn_modules():
            if m.lambda_t is not None:
                m.lambda_t.fill_(0.25)
    torch.save(model.state_dict(), ckpt)
    results = tool('layer_weights').main([backbone_config(tmp_path, None), '--compare', mrla_cfg,
                                          str(ckpt), '--methods', 'MRLALight', 'KCLA',
                                          '--synthetic', '1', '--size', '32',
                                          '--out-dir', str(tmp_path)])
    assert [r.method for r in results] == ['MRLALight', 'KCLA']
    m = results[0].matrix
    assert m[1, 0] == pytest.approx(0.25 * m[0, 0])  # gate of block 0 times lambda of block 1


def test_get_flops_backbone_config(tmp_path):
    res = tool('get_flops').main([backbone_config(tmp_path), '--shape', '32', '--out-dir',
                                  str(tmp_path)])
    rows = {r['part'].strip(): r for r in res['rows']}
    assert res['kind'] == 'model' and 'model' not in rows
    assert 0 < rows['backbone: layer attention']['flops'] < rows['backbone']['flops']
    assert (tmp_path / 'get_flops.md').read_text().count('\n|') >= 7


def test_get_flops_detector(tmp_path):
    res = tool('get_flops').main([config(tmp_path, DETECTOR), '--shape', '60', '64',
                                  '--out-dir', str(tmp_path)])
    assert res['kind'] == 'detector' and res['input_shape'] == [1, 3, 64, 64]  # padded to 32
    rows = {r['part'].strip(): r for r in res['rows']}
    assert rows['model']['flops'] > rows['backbone']['flops'] > 0
    assert rows['model']['params'] > rows['backbone']['params']
    attn = rows['backbone: layer attention']
    assert 0 < attn['params'] == sum(rows[f'layer{s}_attn']['params'] for s in range(1, 5))


@pytest.mark.parametrize('name, words', [
    ('key_correlation', ['cosine', '--images', '--synthetic', '--out-dir', '--max-images']),
    ('layer_weights', ['pseudo-layer', 'lambda', '--compare', '--methods']),
    ('get_flops', ['--shape', 'multiply-add', '--no-elementwise']),
])
def test_help_explains_the_tool(name, words, capsys):
    with pytest.raises(SystemExit) as e:
        tool(name).parse_args(['--help'])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for w in words:
        assert w in text


def test_swapped_method_takes_only_the_resnet_part(tmp_path):
    # Another method's layer-attention weights mean nothing here, even where names match.
    kcla = build(backbone_config(tmp_path))
    with torch.no_grad():
        for p in kcla.parameters():
            p.add_(1.0)
    torch.save(kcla.state_dict(), tmp_path / 'kcla.pth')
    mrla = build(backbone_config(tmp_path, 'MRLALight'))
    before = mrla.state_dict()['layer1_attn.1.wk.weight'].clone()
    tool('_common').load_backbone_checkpoint(mrla, str(tmp_path / 'kcla.pth'), strict=False)
    after = mrla.state_dict()
    assert torch.equal(after['layer1.0.conv1.weight'], kcla.state_dict()['layer1.0.conv1.weight'])
    assert torch.equal(after['layer1_attn.1.wk.weight'], before)
