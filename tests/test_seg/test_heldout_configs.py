"""configs/unet/heldout: the paper-protocol configs with a test split of their own."""
import glob
import os.path as osp
import re

import pytest
import yaml
from config_utils import load

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
UNET = osp.join(ROOT, 'configs', 'unet')
HELDOUT = sorted(glob.glob(osp.join(UNET, 'heldout', '*.py')))
NAME = re.compile(r'^(?P<stem>unet_.+_(isic2017|isic2018|kvasir-seg|synthetic-kvasir))'
                  r'-heldout-(?P<crop>\d+x\d+)\.py$')
LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')


def parent_of(path: str) -> str:
    """The paper-protocol config of the same model and dataset."""
    match = NAME.match(osp.basename(path))
    assert match, f'{osp.basename(path)} is not named unet_..._DATASET-heldout-CROP.py'
    return osp.join(UNET, f'{match["stem"]}-{match["crop"]}.py')


def without(cfg: dict, *keys: str) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


def test_every_dataset_has_a_heldout_config():
    names = [osp.basename(p) for p in HELDOUT]
    for dataset in ('isic2017', 'isic2018', 'kvasir-seg'):
        assert any(f'_{dataset}-heldout-' in n for n in names), dataset


@pytest.mark.parametrize('path', HELDOUT, ids=[osp.basename(p) for p in HELDOUT])
def test_selects_on_val_and_tests_on_test(path):
    cfg = load(path)
    folders = {loader: (cfg[loader].dataset.data_prefix.img_path,
                        cfg[loader].dataset.data_prefix.seg_map_path) for loader in LOADERS}
    assert folders == dict(train_dataloader=('images/train', 'masks/train'),
                           val_dataloader=('images/val', 'masks/val'),
                           test_dataloader=('images/test', 'masks/test'))
    # One dataset: the three loaders differ only in the split folder.
    datasets = {(cfg[loader].dataset.type, cfg[loader].dataset.data_root) for loader in LOADERS}
    assert len(datasets) == 1
    test, val = cfg.test_dataloader.to_dict(), cfg.val_dataloader.to_dict()
    assert without(test['dataset'], 'data_prefix') == without(val['dataset'], 'data_prefix')
    assert without(test, 'dataset') == without(val, 'dataset')
    checkpoint = cfg.default_hooks.checkpoint
    assert (checkpoint.save_best, checkpoint.rule) == ('fg_DSC', 'greater')
    assert cfg.train_cfg.val_interval < cfg.train_cfg.get('max_iters',
                                                          cfg.train_cfg.get('max_epochs'))
    assert cfg.test_evaluator == cfg.val_evaluator


@pytest.mark.parametrize('path', HELDOUT, ids=[osp.basename(p) for p in HELDOUT])
def test_same_training_as_the_paper_protocol_config(path):
    cfg, parent = load(path).to_dict(), load(parent_of(path)).to_dict()
    assert parent['test_dataloader'] == parent['val_dataloader']  # the paper protocol
    for key in ('model', 'optim_wrapper', 'param_scheduler', 'val_evaluator'):
        assert cfg[key] == parent[key], key
    for key in ('train_dataloader', 'val_dataloader'):
        assert cfg[key]['dataset']['pipeline'] == parent[key]['dataset']['pipeline'], key
    assert cfg['train_cfg']['type'] == parent['train_cfg']['type']


def test_metafile_lists_every_heldout_config():
    with open(osp.join(UNET, 'heldout', 'metafile.yml')) as f:
        meta = yaml.safe_load(f)
    assert sorted(osp.join(ROOT, m['Config']) for m in meta['Models']) == HELDOUT
    for model in meta['Models']:
        assert model['Name'] == osp.splitext(osp.basename(model['Config']))[0]
    readme = open(osp.join(UNET, 'README.md')).read()
    for path in HELDOUT:
        assert f'(heldout/{osp.basename(path)})' in readme, path
