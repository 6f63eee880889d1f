"""Classification configs: names, the recipes they state, metafile, and every model runs."""
import glob
import os.path as osp
import re

import pytest
import torch
import yaml
from config_utils import LAYER_ATTN, ids, load, without_scope
from mmengine.hub import get_config
from mmengine.registry import DefaultScope
from mmpretrain.registry import MODELS

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
FOLDER = osp.join(ROOT, 'configs', 'kcla_resnet')
CONFIGS = sorted(glob.glob(osp.join(FOLDER, '*.py')))
IN1K = [p for p in CONFIGS if p.endswith('_in1k.py')]
CIFAR = [p for p in CONFIGS if p.endswith('_cifar100.py')]
NAME = re.compile(r'^(?P<attn>kcla-|mrla-light-|full-la-)?r(?P<depth>\d+)_'
                  r'(?P<recipe>8xb32-100e_in1k|8xb32_in1k|1xb128-300e_cifar100)\.py$')


def test_every_method_and_depth_has_a_config():
    names = [osp.basename(p) for p in CONFIGS]
    for depth in (50, 101):
        for attn in ('kcla-', 'mrla-light-', ''):
            assert f'{attn}r{depth}_8xb32-100e_in1k.py' in names
    assert 'kcla-r50_8xb32_in1k.py' in names  # mmpretrain's standard recipe
    for depth in (20, 56, 110):
        for attn in ('kcla-', 'mrla-light-', 'full-la-', ''):
            assert f'{attn}r{depth}_1xb128-300e_cifar100.py' in names
    assert len(CONFIGS) == 7 + 12


@pytest.mark.parametrize('path', CONFIGS, ids=ids(CONFIGS))
def test_name_matches_the_model(path):
    match = NAME.match(osp.basename(path))
    assert match, osp.basename(path)
    cfg = load(path)
    assert cfg.default_scope == 'mmpretrain'
    assert cfg.custom_imports == dict(imports=['kcla_mm', 'kcla_mm.host_fixes'],
                                      allow_failed_imports=False)
    backbone = cfg.model.backbone
    assert backbone.depth == int(match['depth'])
    assert backbone.type == ('CifarKCLAResNet' if path in CIFAR else 'KCLAResNet')
    attn = backbone.layer_attn
    assert (attn and attn['type']) == LAYER_ATTN[match['attn']]
    if attn:  # the papers' stochastic depth of the attention branch, for every method
        assert attn['drop_path'] == 0.2
    assert '://' not in cfg.pretty_text  # nothing downloads


@pytest.mark.parametrize('path', IN1K, ids=ids(IN1K))
def test_imagenet_recipe(path):
    cfg = load(path)
    assert cfg.train_dataloader.batch_size * 8 == 256 == cfg.auto_scale_lr.base_batch_size
    assert without_scope(cfg.optim_wrapper.optimizer) == dict(type='SGD', lr=0.1, momentum=0.9,
                                                              weight_decay=1e-4)
    assert cfg.train_cfg.max_epochs == 100
    assert cfg.model.head.num_classes == 1000 and cfg.train_dataloader.dataset.type == 'ImageNet'
    depth = cfg.model.backbone.depth
    assert cfg.model.head.in_channels == 2048
    assert get_config(f'mmpretrain::resnet/resnet{depth}_8xb32_in1k.py').model.backbone.depth \
        == depth
    sched = cfg.param_scheduler
    if '100e' in path:  # the authors' recipe: 3 warm-up epochs, then x0.1 at 30/60/90
        warmup, steps = sched
        assert (warmup.type, warmup.begin, warmup.end, warmup.by_epoch) == \
            ('LinearLR', 0, 3, True) and warmup.convert_to_iter_based
        assert (steps.type, steps.milestones, steps.gamma) == ('MultiStepLR', [30, 60, 90], 0.1)
    else:
        assert without_scope(sched) == without_scope(
            get_config('mmpretrain::resnet/resnet50_8xb32_in1k.py').param_scheduler)


def test_standard_variant_changes_only_the_backbone():
    cfg = without_scope(load(osp.join(FOLDER, 'kcla-r50_8xb32_in1k.py')).to_dict())
    base = without_scope(get_config('mmpretrain::resnet/resnet50_8xb32_in1k.py').to_dict())
    assert cfg.pop('custom_imports') and 'custom_imports' not in base
    ours, theirs = cfg['model'].pop('backbone'), base['model'].pop('backbone')
    assert cfg == base
    assert ours.pop('type') == 'KCLAResNet' and ours.pop('layer_attn') and theirs.pop('type')
    assert ours == theirs


@pytest.mark.parametrize('path', CIFAR, ids=ids(CIFAR))
def test_cifar_recipe(path):
    cfg = load(path)
    for loader in (cfg.train_dataloader, cfg.val_dataloader, cfg.test_dataloader):
        assert loader.dataset.type == 'OfflineCIFAR100' and loader.batch_size == 128
        assert 'check_md5' not in loader.dataset  # the official files are checked
    assert cfg.train_dataloader.dataset.split == 'train' and cfg.test_dataloader.dataset.split \
        == 'test'
    crop, flip, _ = cfg.train_dataloader.dataset.pipeline
    assert (crop.type, crop.crop_size, crop.padding) == ('RandomCrop', 32, 4)
    assert (flip.type, flip.prob, flip.direction) == ('RandomFlip', 0.5, 'horizontal')
    assert without_scope(cfg.optim_wrapper.optimizer) == dict(type='SGD', lr=0.1, momentum=0.9,
                                                              weight_decay=1e-4)
    assert cfg.train_cfg.max_epochs == 300
    assert (cfg.param_scheduler.type, cfg.param_scheduler.milestones) == \
        ('MultiStepLR', [150, 225])
    backbone = cfg.model.backbone
    assert backbone.block == 'Bottleneck' and cfg.model.head.in_channels == 256
    assert cfg.model.head.num_classes == 100


@pytest.mark.parametrize('path', CONFIGS, ids=ids(CONFIGS))
def test_model_trains_and_predicts(path):
    cfg = load(path).model.copy()
    if path in IN1K:  # the same network at a quarter of the width
        cfg.backbone.update(base_channels=16, head_dim=16)
        cfg.head.in_channels = 512
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        model = MODELS.build(cfg)
    model.init_weights()
    size = 32 if path in CIFAR else 64
    x = torch.rand(2, 3, size, size) * 255
    data = model.data_preprocessor({'inputs': list(x.to(torch.uint8)), 'data_samples': None})
    from mmpretrain.structures import DataSample
    samples = [DataSample().set_gt_label(i) for i in (1, 3)]
    losses = model(data['inputs'], samples, mode='loss')
    assert torch.isfinite(losses['loss']) and losses['loss'] > 0
    losses['loss'].backward()
    model.eval()
    with torch.no_grad():
        preds = model(data['inputs'], mode='predict')
    assert len(preds) == 2 and preds[0].pred_score.shape == (cfg.head.num_classes, )


def test_metafile_and_readme_list_every_config():
    with open(osp.join(FOLDER, 'metafile.yml')) as f:
        meta = yaml.safe_load(f)
    (collection, ) = meta['Collections']
    assert osp.isfile(osp.join(ROOT, collection['README']))
    names = sorted(osp.basename(m['Config']) for m in meta['Models'])
    assert names == ids(CONFIGS)
    for model in meta['Models']:
        assert model['In Collection'] == collection['Name']
        assert model['Name'] == osp.splitext(osp.basename(model['Config']))[0]
        # never an invented figure: results are the paper's, marked as such, or absent
        for result in model.get('Results') or []:
            assert 'reported by the paper' in result.get('Note', ''), model['Name']
    readme = open(osp.join(FOLDER, 'README.md')).read()
    for name in ids(CONFIGS):
        assert name in readme, name
