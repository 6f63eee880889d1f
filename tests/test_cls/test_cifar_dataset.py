"""mmpretrain's own loaders read the synthetic layouts; OfflineCIFAR100 never downloads."""
import os.path as osp
import pickle

import mmcv
import numpy as np
import pytest

from kcla_mm.datasets.cifar import OfflineCIFAR100
from kcla_mm.datasets.synthetic_cls import make_cifar100, make_imagenet

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DEMO_CONFIG = osp.join(ROOT, 'configs', 'kcla_resnet', 'demo',
                       'kcla-r20_1xb32-300i_synthetic-cifar100.py')
OFFICIAL_URL = 'https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz'


@pytest.fixture(scope='module')
def cifar_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('cifar'))
    make_cifar100(root, num_train=5, num_test=2, num_classes=6, seed=0)
    return root


def pickled(root: str, split: str) -> dict:
    with open(osp.join(root, 'cifar-100-python', split), 'rb') as f:
        return pickle.load(f, encoding='latin1')


@pytest.mark.parametrize('split,num', [('train', 30), ('test', 12)])
def test_offline_cifar100_reads_the_synthetic_files(cifar_root, split, num):
    dataset = OfflineCIFAR100(data_root=cifar_root, split=split, check_md5=False)
    assert len(dataset) == num
    entry = pickled(cifar_root, split)
    images = entry['data'].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    for i in range(num):
        info = dataset.get_data_info(i)
        assert info['img'].shape == (32, 32, 3) and info['img'].dtype == np.uint8
        np.testing.assert_array_equal(info['img'], images[i])
        assert info['gt_label'] == entry['fine_labels'][i]
    assert sorted({dataset.get_data_info(i)['gt_label'] for i in range(num)}) == list(range(6))
    assert len(dataset.metainfo['classes']) == 100


def test_offline_cifar100_refuses_synthetic_files_by_default(cifar_root):
    with pytest.raises(ValueError, match='not the official CIFAR-100 file') as info:
        OfflineCIFAR100(data_root=cifar_root, split='train')
    assert osp.join(cifar_root, 'cifar-100-python') in str(info.value)
    assert 'check_md5=False' in str(info.value)


def test_missing_folder_names_the_folder_and_the_official_archive(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        OfflineCIFAR100(data_root=str(tmp_path / 'nowhere'), split='test', check_md5=False)
    message = str(info.value)
    assert osp.join(str(tmp_path / 'nowhere'), 'cifar-100-python') in message
    assert OFFICIAL_URL in message


def test_download_is_refused(cifar_root):
    with pytest.raises(ValueError, match='never downloads'):
        OfflineCIFAR100(data_root=cifar_root, split='train', check_md5=False, download=True)


def test_the_demo_config_builds_a_training_set_of_the_synthetic_files(cifar_root):
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import DATASETS

    import kcla_mm  # noqa: F401  (registers OfflineCIFAR100 in mmpretrain)
    cfg = Config.fromfile(DEMO_CONFIG).train_dataloader.dataset
    cfg.data_root = cifar_root
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        dataset = DATASETS.build(cfg)
    assert isinstance(dataset, OfflineCIFAR100) and not dataset.check_md5
    sample = dataset[0]  # the demo's training pipeline: random crop, flip, pack
    assert tuple(sample['inputs'].shape) == (3, 32, 32)
    assert int(sample['data_samples'].gt_label) == pickled(cifar_root, 'train')['fine_labels'][0]


@pytest.mark.parametrize('split,per_class', [('train', 4), ('val', 2)])
def test_mmpretrain_imagenet_reads_the_synthetic_layout(tmp_path, split, per_class):
    from mmpretrain.datasets import ImageNet
    summary = make_imagenet(str(tmp_path), num_train=4, num_val=2, num_classes=5, size=40)
    dataset = ImageNet(data_root=str(tmp_path), split=split)  # finds meta/{split}.txt itself
    assert dataset.ann_file == osp.join(str(tmp_path), 'meta', f'{split}.txt')
    assert len(dataset) == 5 * per_class
    with open(summary['ann_files'][split]) as f:
        expected = [line.split() for line in f]
    for i, (name, label) in enumerate(expected):
        info = dataset.get_data_info(i)
        assert info['img_path'] == osp.join(str(tmp_path), split, name)
        assert info['gt_label'] == int(label)
        if split == 'train':  # the class folder is the label's
            assert name.split('/')[0] == summary['wnids'][int(label)]
    img = mmcv.imread(dataset.get_data_info(0)['img_path'])
    assert img.shape == (40, 40, 3) and img.dtype == np.uint8
