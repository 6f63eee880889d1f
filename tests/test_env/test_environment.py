"""The installed stack works: compiled mmcv ops, the three hosts, config inheritance."""
import pytest
import torch
from mmengine.config import Config


def test_mmcv_compiled_ops_run_on_cpu():
    from mmcv.ops import RoIAlign, nms
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7])
    dets, keep = nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    feat = torch.arange(16, dtype=torch.float32).view(1, 1, 4, 4)
    rois = torch.tensor([[0, 0, 0, 4, 4]], dtype=torch.float32)
    out = RoIAlign((2, 2), spatial_scale=1.0, sampling_ratio=2, aligned=True)(feat, rois)
    assert out.shape == (1, 1, 2, 2)
    # f(y, x) = 4y + x is linear, so bilinear sampling is exact: with aligned=True
    # the samples of bin (i, j) sit at y in {2i, 2i+1}, x in {2j, 2j+1}
    torch.testing.assert_close(out.flatten(), torch.tensor([2.5, 4.5, 10.5, 12.5]))


def test_versions_are_the_pinned_ones():
    import mmcv
    import mmdet
    import mmengine
    import mmpretrain
    import mmseg
    import numpy
    assert (mmcv.__version__, mmengine.__version__, mmdet.__version__, mmseg.__version__,
            mmpretrain.__version__) == ('2.1.0', '0.10.7', '3.3.0', '1.2.2', '1.2.0')
    assert int(numpy.__version__.split('.')[0]) < 2


def test_torchvision_loads_its_compiled_ops_beside_torch():
    # mmpretrain imports torchvision; a torchvision built for another torch
    # fails at import ("operator torchvision::nms does not exist")
    import torchvision
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], dtype=torch.float32)
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)
    assert keep.tolist() == [0, 2]


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_mmdet_config_inheritance_builds_a_kcla_detector(tmp_path):
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    cfg = Config.fromfile(_write(tmp_path, 'det.py', '''
_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'
custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)
model = dict(backbone=dict(type='KCLAResNet', depth=18, base_channels=16, init_cfg=None),
             neck=dict(in_channels=[16, 32, 64, 128]))
'''))
    init_default_scope(cfg.default_scope)
    model = MODELS.build(cfg.model)
    assert type(model.backbone).__name__ == 'KCLAResNet'
    assert type(model.backbone).__module__ == 'kcla_mm.models.backbones.mmdet_kcla_resnet'
    feats = model.extract_feat(torch.rand(1, 3, 64, 64))
    assert len(feats) == 5


def test_mmseg_config_inheritance_builds_a_kcla_segmentor(tmp_path):
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    cfg = Config.fromfile(_write(tmp_path, 'seg.py', '''
_base_ = 'mmseg::fcn/fcn_r50-d8_4xb2-40k_cityscapes-512x1024.py'
custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    data_preprocessor=dict(size=None),
    backbone=dict(type='KCLAResNet', depth=18, base_channels=16, stem_channels=16,
                  norm_cfg=norm_cfg),
    decode_head=dict(in_channels=128, channels=16, norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=64, channels=16, norm_cfg=norm_cfg))
'''))
    init_default_scope(cfg.default_scope)
    model = MODELS.build(cfg.model)
    assert type(model.backbone).__name__ == 'KCLAResNetSeg'
    out = model(torch.rand(1, 3, 64, 64), mode='tensor')
    assert out.shape[:2] == (1, 19)


def test_mmpretrain_config_inheritance_builds_a_kcla_classifier(tmp_path):
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    cfg = Config.fromfile(_write(tmp_path, 'cls.py', '''
_base_ = 'mmpretrain::resnet/resnet18_8xb32_in1k.py'
custom_imports = dict(imports=['kcla_mm'], allow_failed_imports=False)
model = dict(backbone=dict(type='KCLAResNet', base_channels=16, head_dim=16),
             head=dict(num_classes=7, in_channels=128))
'''))
    init_default_scope(cfg.default_scope)
    model = MODELS.build(cfg.model)
    assert type(model.backbone).__name__ == 'KCLAResNetCls'
    assert model.backbone.depth == 18 and model.backbone.layer_attn_cfg == {'type': 'KCLA'}
    logits = model(torch.rand(2, 3, 64, 64), mode='tensor')
    assert logits.shape == (2, 7)


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg', 'mmpretrain'])
def test_every_component_is_registered_in_each_scope(scope):
    import importlib

    from kcla_mm.registry import HOSTS
    reg = importlib.import_module(f'{scope}.registry')
    for registry_name, path, name in HOSTS[scope]:
        assert getattr(reg, registry_name).get(name) is not None, (scope, name)


def test_a_host_that_cannot_be_imported_is_skipped_with_a_warning(monkeypatch, tmp_path):
    # e.g. mmpretrain beside a torchvision built for another torch: detection
    # and segmentation must keep working, and the reason must be named
    from kcla_mm import registry
    pkg = tmp_path / 'brokenhost'
    pkg.mkdir()
    (pkg / '__init__.py').write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.HOSTS, 'brokenhost', [('MODELS', 'nowhere:Nothing', 'Nothing')])
    monkeypatch.setattr(registry, '_registered', dict(registry._registered))
    with pytest.warns(UserWarning, match='brokenhost .*RuntimeError: operator torchvision::nms'):
        result = registry.register_all()
    assert result['brokenhost'] == []
    assert 'KCLAResNet' in result['mmdet'] and 'KCLAResNet' in result['mmpretrain']
    # a host that is not installed at all is skipped silently
    monkeypatch.setitem(registry.HOSTS, 'absenthost', [('MODELS', 'nowhere:Nothing', 'Nothing')])
    assert 'absenthost' not in registry.register_all()
