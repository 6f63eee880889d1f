"""Pretrain, then detect and segment: the checkpoint of a classification run
through tools/train.py initialises a detector's and a UNet's backbone; the
classification configs run under tools/test.py and tools/dist_train.sh too."""
import os.path as osp
import re
import sys

import mmpretrain
import pytest
import torch
from mmengine.config import Config
from mmengine.registry import DefaultScope
from utils import ROOT, free_port, subprocess_env, subprocess_run

from kcla_mm.datasets.synthetic_cls import make_imagenet
from kcla_mm.utils.checkpoint import safe_load

CLS = osp.join(ROOT, 'configs/kcla_resnet/kcla-r50_8xb32-100e_in1k.py')
DET = osp.join(ROOT, 'configs/kcla/demo/faster-rcnn_kcla-r18_fpn_synthetic.py')
UNET = osp.join(ROOT, 'configs/unet/unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py')
TOOLS = osp.join(ROOT, 'tools')
UPSTREAM_TOOLS = osp.join(osp.dirname(mmpretrain.__file__), '.mim', 'tools')
NUM_CLASSES = 4

# The project's ImageNet config with the data paths on the synthetic set and the
# backbone at the widths of the detection and segmentation demo configs
# (ResNet-18, 16 channels, head size 8).
CLS_CONFIG = '''
_base_ = {base!r}
model = dict(
    backbone=dict(depth=18, stem_channels=16, base_channels=16, head_dim=8),
    head=dict(num_classes={classes}, in_channels=128, topk=(1, )))
data_preprocessor = dict(num_classes={classes})
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=56),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=64, edge='short'),
    dict(type='CenterCrop', crop_size=56),
    dict(type='PackInputs'),
]
loader = dict(batch_size=4, num_workers=0, persistent_workers=False)
train_dataloader = dict(**loader, dataset=dict(data_root={data!r}, pipeline=train_pipeline))
val_dataloader = dict(**loader, dataset=dict(data_root={data!r}, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator
train_cfg = dict(max_epochs={epochs})
default_hooks = dict(logger=dict(interval=1))
'''


@pytest.fixture(scope='module')
def classifier(tmp_path_factory):
    """A KCLA-ResNet classifier trained for one epoch on synthetic ImageNet-layout data."""
    root = tmp_path_factory.mktemp('handoff')
    data = make_imagenet(str(root / 'imagenet'), num_train=4, num_val=2,
                         num_classes=NUM_CLASSES, size=64, seed=0)
    cfg = root / 'kcla-r18_synthetic-in1k.py'
    cfg.write_text(CLS_CONFIG.format(base=CLS, classes=NUM_CLASSES, data=data['root'], epochs=1))
    work = root / 'work'
    subprocess_run([sys.executable, osp.join(TOOLS, 'train.py'), str(cfg), '--work-dir',
                    str(work)], timeout=600)
    return str(cfg), str(work / 'epoch_1.pth')


def build(scope: str, cfg: dict):
    import importlib
    registry = importlib.import_module(f'{scope}.registry')
    with DefaultScope.overwrite_default_scope(scope):
        return registry.MODELS.build(cfg)


@pytest.mark.slow
@pytest.mark.parametrize('tools', [TOOLS, UPSTREAM_TOOLS], ids=['kcla_mm', 'mmpretrain'])
def test_tools_test_evaluates_the_classifier(classifier, tools):
    cfg, ckpt = classifier
    out = subprocess_run([sys.executable, osp.join(tools, 'test.py'), cfg, ckpt],
                         timeout=300).stdout
    (top1, ) = re.findall(r'accuracy/top1: ([\d.]+)', out)
    assert 0 <= float(top1) <= 100


@pytest.mark.slow
def test_mmpretrains_own_train_tool_runs_the_config(classifier, tmp_path):
    cfg, _ = classifier
    subprocess_run([sys.executable, osp.join(UPSTREAM_TOOLS, 'train.py'), cfg, '--work-dir',
                    str(tmp_path)], timeout=600)
    state = safe_load(str(tmp_path / 'epoch_1.pth'))['state_dict']
    assert any(k.startswith('backbone.layer4_attn.') for k in state)


@pytest.mark.slow
def test_a_detector_and_a_unet_start_from_the_classifier(classifier):
    cfg, ckpt = classifier
    state = safe_load(ckpt)['state_dict']
    assert 'head.fc.weight' in state  # a whole classifier, not only its backbone
    backbone_state = {k[len('backbone.'):]: v for k, v in state.items()
                      if k.startswith('backbone.')}
    classifier_model = build('mmpretrain', Config.fromfile(cfg).model)
    classifier_model.load_state_dict(state, strict=True)
    cls_backbone = classifier_model.backbone
    cls_backbone.out_indices = (0, 1, 2, 3)
    init_cfg = dict(type='Pretrained', checkpoint=ckpt, prefix='backbone.')
    det = Config.fromfile(DET).model
    det.backbone.init_cfg = init_cfg
    unet = Config.fromfile(UNET).model
    unet.backbone.init_cfg = init_cfg
    x = torch.rand(2, 3, 64, 64)
    want = cls_backbone.eval()(x)
    for scope, cfg_model in (('mmdet', det), ('mmseg', unet)):
        model = build(scope, cfg_model)
        model.init_weights()
        got_state = model.backbone.state_dict()
        # no backbone key missing, none left as initialised
        assert sorted(got_state) == sorted(backbone_state), scope
        for k, v in backbone_state.items():
            assert torch.equal(got_state[k], v), (scope, k)
        got = model.backbone.eval()(x)
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_dist_train_runs_a_classification_config(classifier, tmp_path):
    cfg, _ = classifier
    work = tmp_path / 'dist'
    out = subprocess_run(['bash', osp.join(TOOLS, 'dist_train.sh'), cfg, '2', '--work-dir',
                          str(work), '--cfg-options', 'env_cfg.dist_cfg.backend=gloo'],
                         timeout=600, env=subprocess_env(PORT=str(free_port())))
    assert 'Distributed training: True' in out.stdout and 'GPU number: 2' in out.stdout
    ckpt = safe_load(str(work / 'epoch_1.pth'))
    # 16 images, 4 per process and step: 2 steps
    assert ckpt['meta']['epoch'] == 1 and ckpt['meta']['iter'] == 2
