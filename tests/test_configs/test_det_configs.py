"""Detection configs: names, what they override, metafiles, and every model builds."""
import functools
import glob
import os.path as osp
import re

import pytest
import torch
import yaml
from config_utils import LAYER_ATTN, load, without_scope
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from mmdet.structures.mask import BitmapMasks
from mmengine.config import Config
from mmengine.hub import get_config
from mmengine.registry import DefaultScope
from mmengine.structures import InstanceData
from utils import assert_finite

from kcla_mm.datasets.synthetic_coco import CLASSES

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
#: the folders of detection configs (each with README.md and metafile.yml).
DET_DIRS = ('configs/kcla', 'configs/kcla/demo', 'configs/layer_attn_baselines')
COCO = sorted(glob.glob(osp.join(ROOT, 'configs', 'kcla', '*.py'))
              + glob.glob(osp.join(ROOT, 'configs', 'layer_attn_baselines', '*.py')))
DEMO = sorted(glob.glob(osp.join(ROOT, 'configs', 'kcla', 'demo', '*.py')))
ALL = COCO + DEMO
NAME = re.compile(r'^(?P<algo>faster|mask)-rcnn_(?P<attn>kcla-|mrla-light-|full-la-)?'
                  r'r(?P<depth>50|101)_fpn_1x_coco\.py$')


@functools.lru_cache(maxsize=None)
def base_of(path: str) -> Config:
    """The installed mmdet config that ``path`` inherits."""
    (base, ) = re.findall(r"^_base_ = '(mmdet::[^']+)'$", open(path).read(), re.M)
    return get_config(base)


def ids(paths):
    return [osp.relpath(p, osp.join(ROOT, 'configs')) for p in paths]


def build(cfg: Config):
    with DefaultScope.overwrite_default_scope('mmdet'):
        return MODELS.build(cfg)


def test_every_detection_config_is_tested():
    assert len(COCO) == 10 and len(DEMO) == 2
    others = [p for p in glob.glob(osp.join(ROOT, 'configs', '**', '*.py'), recursive=True)
              if '_base_' not in p and p not in ALL]
    # A new detection config elsewhere would escape the tests below.
    assert not [p for p in others if 'mmdet::' in open(p).read()]


@pytest.mark.parametrize('folder', DET_DIRS)
def test_folder_has_readme_and_metafile(folder):
    configs = sorted(osp.basename(p) for p in glob.glob(osp.join(ROOT, folder, '*.py')))
    with open(osp.join(ROOT, folder, 'metafile.yml')) as f:
        meta = yaml.safe_load(f)
    (collection, ) = meta['Collections']
    assert {'Name', 'Metadata', 'Paper', 'README'} <= set(collection)
    assert osp.isfile(osp.join(ROOT, collection['README']))
    models = meta['Models']
    names = [m['Name'] for m in models]
    assert len(set(names)) == len(names), 'model names must be unique'
    for model in models:
        assert model['In Collection'] == collection['Name']
        assert osp.isfile(osp.join(ROOT, model['Config'])), model['Config']
        assert model['Name'] == osp.splitext(osp.basename(model['Config']))[0]
    assert sorted(osp.basename(m['Config']) for m in models) == configs
    readme = open(osp.join(ROOT, folder, 'README.md')).read()
    for name in configs:
        assert name in readme, f'{name} is not documented in {folder}/README.md'


@pytest.mark.parametrize('path', COCO, ids=ids(COCO))
def test_coco_config_name_matches_backbone(path):
    match = NAME.match(osp.basename(path))
    assert match, f'{osp.basename(path)} does not follow {{algo}}-rcnn_{{backbone}}_fpn_1x_coco'
    cfg = load(path)
    backbone = cfg.model.backbone
    assert cfg.default_scope == 'mmdet'
    assert cfg.custom_imports == dict(imports=['kcla_mm', 'kcla_mm.host_fixes'],
                                      allow_failed_imports=False)
    assert cfg.model.type == {'faster': 'FasterRCNN', 'mask': 'MaskRCNN'}[match['algo']]
    assert backbone.type == 'KCLAResNet' and backbone.depth == int(match['depth'])
    attn = backbone.layer_attn
    assert (attn and attn['type']) == LAYER_ATTN[match['attn']]
    if attn:
        assert attn['drop_path'] == 0.0
    # A local, documented checkpoint path; nothing in the config downloads.
    assert backbone.init_cfg == dict(type='Pretrained',
                                     checkpoint=backbone.init_cfg.checkpoint)
    assert re.match(r'^checkpoints/[\w.-]+\.pth$', backbone.init_cfg.checkpoint)
    assert '://' not in cfg.pretty_text


@pytest.mark.parametrize('path', COCO, ids=ids(COCO))
def test_coco_config_changes_only_the_backbone(path):
    cfg, base = without_scope(load(path).to_dict()), without_scope(base_of(path).to_dict())
    assert cfg.pop('custom_imports') and 'custom_imports' not in base
    ours, theirs = cfg['model'].pop('backbone'), base['model'].pop('backbone')
    assert cfg == base, 'model, data, schedule and runtime must be the mmdet config\'s'
    for key in ('type', 'layer_attn', 'init_cfg'):
        ours.pop(key)
        theirs.pop(key, None)
    assert ours == theirs


@pytest.mark.parametrize('path', ALL, ids=ids(ALL))
def test_model_builds(path):
    cfg = load(path).model.copy()
    cfg.backbone.init_cfg = None
    model = build(cfg)
    attn = model.backbone.layer_attn_modules()
    assert (len(attn) > 0) == (cfg.backbone.get('layer_attn') is not None)


@pytest.mark.parametrize('path', DEMO, ids=ids(DEMO))
def test_demo_config_is_small_and_local(path):
    cfg = load(path)
    assert cfg.default_scope == 'mmdet' and 'kcla_mm' in cfg.custom_imports.imports
    backbone = cfg.model.backbone
    assert backbone.type == 'KCLAResNet' and backbone.layer_attn.type == 'KCLA'
    assert backbone.depth == 18 and backbone.init_cfg is None, 'trained from scratch'
    heads = [cfg.model.roi_head.bbox_head] + ([cfg.model.roi_head.mask_head]
                                              if 'mask_head' in cfg.model.roi_head else [])
    assert all(h.num_classes == len(CLASSES) for h in heads)
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        dataset = cfg[loader].dataset
        assert dataset.metainfo['classes'] == CLASSES
        assert dataset.data_root == 'data/synthetic_coco/'
        assert cfg[loader].num_workers <= 1
        (resize, ) = [t for t in dataset.pipeline if t.type == 'Resize']
        assert max(resize.scale) <= 160
    assert cfg.train_cfg.type == 'IterBasedTrainLoop'
    assert cfg.train_cfg.val_interval == cfg.train_cfg.max_iters
    assert cfg.default_hooks.checkpoint.interval == cfg.train_cfg.max_iters
    metrics = cfg.val_evaluator.metric
    expected = ['bbox', 'segm'] if 'mask_head' in cfg.model.roi_head else 'bbox'
    assert metrics == expected and cfg.val_evaluator.type == 'CocoMetric'
    assert '://' not in cfg.pretty_text


def samples(size: int, with_masks: bool):
    boxes = torch.tensor([[4., 6., 30., 28.], [34., 30., 60., 62.]])
    out = []
    for i in range(2):
        sample = DetDataSample(metainfo=dict(img_shape=(size, size), ori_shape=(size, size),
                                             scale_factor=(1., 1.)))
        gt = InstanceData(bboxes=boxes + i, labels=torch.tensor([0, 2]))
        if with_masks:
            masks = torch.zeros(2, size, size, dtype=torch.uint8)
            for j, (x1, y1, x2, y2) in enumerate((boxes + i).long().tolist()):
                masks[j, y1:y2, x1:x2] = 1
            gt.masks = BitmapMasks(masks.numpy(), size, size)
        sample.gt_instances = gt
        out.append(sample)
    return out


def reduced(path: str) -> Config:
    """The model of a COCO config at tiny widths (same structure)."""
    cfg = load(path).model.copy()
    width = 32
    cfg.backbone.update(init_cfg=None, base_channels=16, head_dim=16)
    cfg.neck.update(in_channels=[64, 128, 256, 512], out_channels=width)
    cfg.rpn_head.update(in_channels=width, feat_channels=width)
    cfg.roi_head.bbox_roi_extractor.out_channels = width
    cfg.roi_head.bbox_head.update(in_channels=width, fc_out_channels=64)
    return cfg


R50 = osp.join(ROOT, 'configs', 'kcla', 'faster-rcnn_kcla-r50_fpn_1x_coco.py')
MASK_DEMO = osp.join(ROOT, 'configs', 'kcla', 'demo', 'mask-rcnn_kcla-r18_fpn_synthetic.py')


def train_step(path: str, with_masks: bool):
    """``(model, data, losses)`` after one backward pass on two 64x64 images."""
    torch.manual_seed(0)
    model = build(reduced(path) if path in COCO else load(path).model.copy())
    model.init_weights()
    data = dict(inputs=[torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)
                        for _ in range(2)],
                data_samples=samples(64, with_masks))
    model.train()
    losses = model(**model.data_preprocessor(data, True), mode='loss')
    total = sum(sum(v) if isinstance(v, list) else v
                for k, v in losses.items() if k.startswith('loss'))
    assert_finite(total, 'loss')
    total.backward()
    return model, data, losses


@pytest.mark.parametrize('path, with_masks', [(R50, False), (MASK_DEMO, True)],
                         ids=['faster-rcnn_kcla-r50-reduced', 'mask-rcnn_kcla-r18-demo'])
def test_forward_loss_and_predict(path, with_masks):
    model, data, losses = train_step(path, with_masks)
    expected = {'loss_rpn_cls', 'loss_rpn_bbox', 'loss_cls', 'loss_bbox'}
    assert expected | ({'loss_mask'} if with_masks else set()) <= set(losses)
    model.eval()
    with torch.no_grad():
        preds = model(**model.data_preprocessor(data, False), mode='predict')
    assert len(preds) == 2
    for pred in preds:
        assert {'bboxes', 'scores', 'labels'} <= set(pred.pred_instances.keys())
        if with_masks:
            assert 'masks' in pred.pred_instances


@pytest.mark.parametrize('path, with_masks', [
    (R50, False),  # norm_eval=True, frozen_stages=1: the recomputed tail folds an eval BN
    (MASK_DEMO, True),  # norm_eval=False
], ids=['faster-rcnn_kcla-r50-reduced', 'mask-rcnn_kcla-r18-demo'])
def test_every_trainable_layer_attention_parameter_learns(path, with_masks):
    model, _, _ = train_step(path, with_masks)
    params = [(n, p) for n, p in model.backbone.named_parameters()
              if '_attn.' in n and p.requires_grad]
    assert params
    assert [n for n, p in params if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize('path', DEMO, ids=ids(DEMO))
def test_features_reach_roi_align_as_nchw(path):
    # mmcv's RoIAlign reads its input as NCHW-contiguous without checking; a
    # channels-last backbone must hand the neck and heads standard tensors.
    cfg = load(path).model.copy()
    model = build(cfg).eval()
    with torch.no_grad():
        x = torch.rand(2, 3, 64, 64)
        feats = model.backbone(x)
        assert all(f.is_contiguous() for f in feats)
        assert all(f.is_contiguous() for f in model.neck(feats))
