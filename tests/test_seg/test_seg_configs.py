"""configs/unet: names, the two protocols, and every model builds."""
import glob
import os.path as osp
import re

import pytest
import torch
import yaml
from config_utils import LAYER_ATTN, ids, load
from mmengine.registry import DefaultScope
from mmseg.registry import DATASETS, METRICS, MODELS

import kcla_mm  # noqa: F401

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', 'unet', '*.py')))
PAPER = [c for c in CONFIGS if c.endswith('-256x256.py') and 'synthetic' not in c]
MMSEG_STYLE = [c for c in CONFIGS if c.endswith('-512x512.py')]
NAME = re.compile(r'^unet_(kcla-|mrla-light-|full-la-)?r(18|34|50)(-tiny)?'
                  r'_1xb(8|16)-(300e|20k|\d+i)'
                  r'_(?P<dataset>isic2017|isic2018|kvasir-seg|synthetic-kvasir)'
                  r'-(?P<crop>\d+)x(?P=crop)\.py$')


def test_every_dataset_has_both_protocols():
    for dataset in ('isic2017', 'isic2018', 'kvasir-seg'):
        assert any(f'_{dataset}-256x256' in c for c in PAPER), dataset
        assert any(f'_{dataset}-512x512' in c for c in MMSEG_STYLE), dataset


@pytest.mark.parametrize('path', CONFIGS, ids=ids(CONFIGS))
def test_name_matches_model(path):
    match = NAME.match(osp.basename(path))
    assert match, f'{osp.basename(path)} does not follow unet_{{backbone}}_1xb{{n}}-...'
    cfg = load(path)
    backbone = cfg.model.backbone
    assert backbone.type == 'KCLAResNet' and backbone.depth == int(match[2])
    attn = backbone.layer_attn
    assert (attn and attn['type']) == LAYER_ATTN[match[1]]
    assert cfg.train_dataloader.batch_size == int(match[4])
    assert cfg.default_scope == 'mmseg'
    assert cfg.custom_imports == dict(imports=['kcla_mm', 'kcla_mm.host_fixes'],
                                      allow_failed_imports=False)
    # No download, no local checkpoint path in a shipped config.
    assert backbone.get('init_cfg') is None and cfg.get('load_from') is None


@pytest.mark.parametrize('path', CONFIGS, ids=ids(CONFIGS))
def test_components_are_registered(path):
    cfg = load(path)
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        assert DATASETS.get(cfg[loader].dataset.type) is not None
    for evaluator in cfg.val_evaluator:
        assert METRICS.get(evaluator.type) is not None
    assert {e.type for e in cfg.val_evaluator} == {'IoUMetric', 'ForegroundIoUMetric'}


DATASET = {'isic2017': ('ISIC2017Dataset', 'data/isic2017'),
           'isic2018': ('ISIC2018Dataset', 'data/isic2018'),
           'kvasir-seg': ('KvasirSEGDataset', 'data/kvasir_seg'),
           'synthetic-kvasir': ('KvasirSEGDataset', 'work_dirs/demo_seg/data')}


@pytest.mark.parametrize('path', CONFIGS, ids=ids(CONFIGS))
def test_loaders_read_the_named_dataset(path):
    """Each config's three loaders read the dataset its name says, val and test alike."""
    cfg = load(path)
    expected = DATASET[NAME.match(osp.basename(path)).group('dataset')]
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        assert (cfg[loader].dataset.type, cfg[loader].dataset.data_root) == expected, loader
    split = {loader: cfg[loader].dataset.data_prefix.img_path
             for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')}
    assert split == {'train_dataloader': 'images/train', 'val_dataloader': 'images/val',
                     'test_dataloader': 'images/val'}
    assert cfg.test_dataloader.to_dict() == cfg.val_dataloader.to_dict()


@pytest.mark.parametrize('path', PAPER, ids=ids(PAPER))
def test_paper_protocol(path):
    cfg = load(path)
    opt = cfg.optim_wrapper.optimizer
    assert (opt.type, opt.lr, opt.weight_decay) == ('AdamW', 1e-3, 1e-2)
    (sched, ) = cfg.param_scheduler
    assert sched.type == 'CosineAnnealingLR' and sched.eta_min == 1e-5
    assert sched.T_max == cfg.train_cfg.max_epochs
    types = [t.type for t in cfg.train_pipeline]
    assert types.count('RandomFlip') == 2 and 'RandomRotate' in types
    (resize, ) = [t for t in cfg.train_pipeline if t.type == 'Resize']
    assert tuple(resize.scale) == (256, 256) and not resize.keep_ratio
    head = cfg.model.decode_head
    assert (head.num_classes, head.out_channels, head.threshold) == (2, 1, 0.5)
    losses = {(loss.type, loss.get('use_sigmoid')) for loss in head.loss_decode}
    assert losses == {('CrossEntropyLoss', True), ('BinaryDiceLoss', None)}
    (fg, ) = [e for e in cfg.val_evaluator if e.type == 'ForegroundIoUMetric']
    assert fg.threshold == 0.5
    pre = cfg.model.data_preprocessor
    assert len(pre.mean) == len(pre.std) == 3 and tuple(pre.size) == (256, 256)


@pytest.mark.parametrize('path', MMSEG_STYLE, ids=ids(MMSEG_STYLE))
def test_mmseg_style_protocol(path):
    cfg = load(path)
    (crop, ) = [t for t in cfg.train_pipeline if t.type == 'RandomCrop']
    assert tuple(crop.crop_size) == (512, 512)
    (iou, ) = [e for e in cfg.val_evaluator if e.type == 'IoUMetric']
    assert iou.iou_metrics == ['mIoU', 'mDice']
    head = cfg.model.decode_head
    assert head.out_channels == 2
    assert [loss.type for loss in head.loss_decode] == ['CrossEntropyLoss']


def without_init_cfg(cfg):
    if isinstance(cfg, dict):
        return {k: without_init_cfg(v) for k, v in cfg.items() if k != 'init_cfg'}
    if isinstance(cfg, list):
        return [without_init_cfg(v) for v in cfg]
    return cfg


def model_without_preprocessor(path: str) -> dict:
    return {k: v for k, v in load(path).model.to_dict().items() if k != 'data_preprocessor'}


# The dataset configs differ only in data (checked below): build the ISIC 2017 ones.
UNIQUE = [c for c in CONFIGS if '_isic2017-' in c or '_synthetic-' in c]


@pytest.mark.parametrize('dataset', ['isic2018', 'kvasir-seg'])
def test_datasets_share_the_models(dataset):
    for path in CONFIGS:
        if f'_{dataset}-' in path:
            reference = path.replace(f'_{dataset}-', '_isic2017-')
            assert model_without_preprocessor(path) == model_without_preprocessor(reference)


@pytest.mark.parametrize('path', UNIQUE, ids=ids(UNIQUE))
def test_model_builds_and_predicts_full_resolution(path):
    with DefaultScope.overwrite_default_scope('mmseg'):
        model = MODELS.build(without_init_cfg(load(path).model.to_dict()))
    model.eval()
    with torch.no_grad():
        out = model(torch.rand(1, 3, 64, 64), mode='tensor')
    assert out.shape == (1, model.decode_head.out_channels, 64, 64)


def test_metafile_lists_every_config():
    with open(osp.join(ROOT, 'configs', 'unet', 'metafile.yml')) as f:
        meta = yaml.safe_load(f)
    listed = sorted(osp.join(ROOT, m['Config']) for m in meta['Models'])
    assert listed == CONFIGS
    for model in meta['Models']:
        assert model['Name'] == osp.splitext(osp.basename(model['Config']))[0]
        # Numbers only where they were measured here (the synthetic demo).
        assert ('Results' in model) == ('synthetic' in model['Name'])
