"""The synthetic classification data: official layouts, seeded, learnable."""
import os
import os.path as osp
import pickle
from collections import Counter

import numpy as np
import pytest

from kcla_mm.datasets import synthetic_cls
from kcla_mm.datasets.synthetic_cls import (CIFAR100_COARSE_NAMES, CIFAR100_FINE_TO_COARSE,
                                            make_cifar100, make_imagenet)

CIFAR_ARGS = dict(num_train=6, num_test=3, num_classes=4)
IMAGENET_ARGS = dict(num_train=3, num_val=2, num_classes=3, size=24)


def tree_bytes(root: str) -> dict:
    """``{relative path: file bytes}`` of every file under ``root``."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = osp.join(folder, name)
            with open(path, 'rb') as f:
                files[osp.relpath(path, root)] = f.read()
    return files


def load(path: str) -> dict:
    with open(path, 'rb') as f:
        return pickle.load(f, encoding='latin1')  # as mmpretrain and torchvision read them


def cifar_images(entry: dict) -> np.ndarray:
    """``[N, 32, 32, 3]`` from the official row layout (R, G, B planes)."""
    return entry['data'].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


@pytest.mark.parametrize('make,args', [(make_cifar100, CIFAR_ARGS),
                                       (make_imagenet, IMAGENET_ARGS)],
                         ids=['cifar100', 'imagenet'])
def test_same_seed_gives_identical_files_and_another_seed_other_images(tmp_path, make, args):
    first, again, other = (str(tmp_path / name) for name in ('a', 'b', 'c'))
    make(first, seed=3, **args)
    make(again, seed=3, **args)
    make(other, seed=4, **args)
    files = tree_bytes(first)
    assert files == tree_bytes(again)
    others = tree_bytes(other)
    assert sorted(others) == sorted(files)  # the same layout ...
    images = [p for p in files if p.endswith('.JPEG') or osp.basename(p) in ('train', 'test')]
    assert images and all(others[p] != files[p] for p in images)  # ... other images


def test_cifar100_files_have_the_official_layout(tmp_path):
    summary = make_cifar100(str(tmp_path), **CIFAR_ARGS)
    folder = tmp_path / 'cifar-100-python'
    assert sorted(os.listdir(folder)) == ['meta', 'test', 'train']
    assert summary['folder'] == str(folder)
    assert summary['files'] == {name: str(folder / name) for name in ('train', 'test', 'meta')}
    assert summary['counts'] == dict(train=24, test=12) and summary['num_classes'] == 4
    for split, per_class, batch_label in (('train', 6, 'training batch 1 of 1'),
                                          ('test', 3, 'testing batch 1 of 1')):
        entry = load(str(folder / split))
        assert set(entry) == {'data', 'fine_labels', 'coarse_labels', 'filenames', 'batch_label'}
        assert entry['data'].dtype == np.uint8 and entry['data'].shape == (4 * per_class, 3072)
        assert entry['batch_label'] == batch_label
        assert Counter(entry['fine_labels']) == {label: per_class for label in range(4)}
        assert entry['fine_labels'] != sorted(entry['fine_labels'])  # shuffled, as the original
        assert entry['coarse_labels'] == [CIFAR100_FINE_TO_COARSE[f] for f in entry['fine_labels']]
        assert all(isinstance(v, int) for v in entry['fine_labels'] + entry['coarse_labels'])
        assert len(set(entry['filenames'])) == len(entry['filenames'])
        assert all(name.endswith('.png') for name in entry['filenames'])
    meta = load(str(folder / 'meta'))
    from mmpretrain.datasets.categories import CIFAR100_CATEGORIES
    assert meta == dict(fine_label_names=list(CIFAR100_CATEGORIES),
                        coarse_label_names=list(CIFAR100_COARSE_NAMES))


def test_cifar100_superclasses_hold_five_fine_classes_each():
    assert len(CIFAR100_FINE_TO_COARSE) == 100 and len(CIFAR100_COARSE_NAMES) == 20
    assert Counter(CIFAR100_FINE_TO_COARSE) == {coarse: 5 for coarse in range(20)}
    names = synthetic_cls.cifar100_fine_names()
    coarse = {names[i]: CIFAR100_COARSE_NAMES[c] for i, c in enumerate(CIFAR100_FINE_TO_COARSE)}
    assert coarse['apple'] == 'fruit_and_vegetables' and coarse['worm'] == \
        'non-insect_invertebrates' and coarse['whale'] == 'aquatic_mammals'


def test_cifar100_rows_are_the_rgb_planes_of_the_rendered_images(tmp_path):
    make_cifar100(str(tmp_path), **CIFAR_ARGS, seed=1)
    entry = load(str(tmp_path / 'cifar-100-python' / 'train'))
    images, labels = synthetic_cls.split_images(1, 0, 4, 6, 32)
    assert entry['fine_labels'] == labels.tolist()
    np.testing.assert_array_equal(cifar_images(entry), images)
    # first 1024 values: the red plane, row-major
    np.testing.assert_array_equal(entry['data'][0, :1024], images[0, :, :, 0].reshape(-1))


def test_the_test_count_does_not_change_the_training_images(tmp_path):
    make_cifar100(str(tmp_path / 'a'), num_train=5, num_test=2, num_classes=3)
    make_cifar100(str(tmp_path / 'b'), num_train=5, num_test=7, num_classes=3)
    train = [(tmp_path / run / 'cifar-100-python' / 'train').read_bytes() for run in 'ab']
    assert train[0] == train[1]


def test_imagenet_files_have_the_annotation_file_layout(tmp_path):
    summary = make_imagenet(str(tmp_path), **IMAGENET_ARGS)
    wnids = summary['wnids']
    assert len(wnids) == 3 and wnids == sorted(wnids)  # labels in the order of the folders
    assert all(len(w) == 9 and w[0] == 'n' and w[1:].isdigit() for w in wnids)
    assert sorted(os.listdir(tmp_path / 'train')) == wnids
    assert summary['counts'] == dict(train=9, val=6)
    assert summary['ann_files'] == {split: str(tmp_path / 'meta' / f'{split}.txt')
                                    for split in ('train', 'val')}
    for split, per_class in (('train', 3), ('val', 2)):
        lines = (tmp_path / 'meta' / f'{split}.txt').read_text().splitlines()
        pairs = [line.rsplit(' ', 1) for line in lines]
        assert Counter(int(label) for _, label in pairs) == {0: per_class, 1: per_class,
                                                             2: per_class}
        for name, label in pairs:
            assert (tmp_path / split / name).is_file()
            if split == 'train':
                assert name.split('/')[0] == wnids[int(label)] and name.endswith('.JPEG')
        if split == 'val':
            assert [name for name, _ in pairs] == [
                f'ILSVRC2012_val_{i:08d}.JPEG' for i in range(1, 7)]
            assert sorted(os.listdir(tmp_path / 'val')) == [name for name, _ in pairs]


def test_classes_are_separable_from_their_mean_layout():
    """The task is learnable: a nearest-centroid rule on raw pixels, fit on 20
    images per class, classifies fresh images of 10 classes almost always."""
    train, train_labels = synthetic_cls.split_images(0, 0, 10, 20, 32)
    test, test_labels = synthetic_cls.split_images(0, 1, 10, 10, 32)
    flat = lambda x: x.reshape(len(x), -1).astype(np.float64)  # noqa: E731
    centroids = np.stack([flat(train[train_labels == c]).mean(0) for c in range(10)])
    dist = ((flat(test)[:, None] - centroids[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == test_labels).mean() >= 0.9
    # ... and no class is a flat colour: the layouts vary across the image
    assert train.reshape(len(train), -1, 3).std(1).mean() > 20


def test_command_line_writes_both_layouts(tmp_path, capsys):
    summary = synthetic_cls.main(['cifar100', '--out', str(tmp_path / 'c'), '--classes', '2',
                                  '--num-train', '3', '--num-test', '1', '--seed', '5'])
    assert summary['counts'] == dict(train=6, test=2)
    assert 'cifar100' in capsys.readouterr().out
    assert tree_bytes(str(tmp_path / 'c')) == tree_bytes(
        make_cifar100(str(tmp_path / 'd'), num_train=3, num_test=1, num_classes=2,
                      seed=5)['root'])
    summary = synthetic_cls.main(['imagenet', '--out', str(tmp_path / 'i'), '--classes', '2',
                                  '--num-train', '2', '--num-val', '1', '--size', '16'])
    assert summary['counts'] == dict(train=4, val=2)
    assert (tmp_path / 'i' / 'meta' / 'val.txt').is_file()


@pytest.mark.parametrize('kwargs', [dict(num_classes=0), dict(num_classes=101),
                                    dict(num_train=0), dict(num_test=0)])
def test_cifar100_rejects_impossible_counts(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make_cifar100(str(tmp_path), **kwargs)


@pytest.mark.parametrize('kwargs', [dict(num_classes=1001), dict(num_val=0), dict(size=4)])
def test_imagenet_rejects_impossible_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make_imagenet(str(tmp_path), **kwargs)
