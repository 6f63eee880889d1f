"""The synthetic COCO-format shapes dataset: files, annotations, determinism."""
import filecmp
import json
import os
import os.path as osp

import cv2
import numpy as np
import pytest
from pycocotools.coco import COCO

from kcla_mm.datasets.synthetic_coco import (CLASSES, COLOUR_JITTER, METAINFO, PALETTE, SPLITS,
                                             generate, main)

SIZE = 96
KW = dict(num_train=6, num_val=3, size=SIZE, seed=0, min_object=16, max_object=40)


def split_dirs(root: str):
    return [(osp.join(root, split), osp.join(root, 'annotations', f'instances_{split}.json'))
            for split in SPLITS]


@pytest.fixture(scope='module')
def dataset(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp('synthetic_coco'))
    generate(root, **KW)
    return root


@pytest.fixture(scope='module')
def cocos(dataset):
    return [COCO(ann) for _, ann in split_dirs(dataset)]


def test_layout_and_counts(dataset, cocos):
    for (img_dir, ann_file), coco, num in zip(split_dirs(dataset), cocos,
                                              (KW['num_train'], KW['num_val'])):
        assert len(coco.getImgIds()) == num
        assert sorted(os.listdir(img_dir)) == sorted(i['file_name'] for i in coco.imgs.values())
        assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == list(CLASSES)
    train, val = cocos
    assert not set(train.getImgIds()) & set(val.getImgIds()), 'image ids must be unique'


def test_every_image_has_objects(cocos):
    for coco in cocos:
        for img_id in coco.getImgIds():
            anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
            assert anns and all(a['iscrowd'] == 0 for a in anns)


def test_boxes_inside_images_with_the_requested_sizes(cocos):
    for coco in cocos:
        for ann in coco.anns.values():
            img = coco.imgs[ann['image_id']]
            x, y, w, h = ann['bbox']
            assert 0 <= x and 0 <= y and x + w <= img['width'] and y + h <= img['height']
            # An object of size s spans s (circle) to s*sqrt(2) (rotated square);
            # a triangle of side s is at least s*sqrt(3)/2 tall or wide.
            assert KW['min_object'] * np.sqrt(3) / 2 - 0.5 <= max(w, h)
            assert max(w, h) <= KW['max_object'] * np.sqrt(2) + 0.5


def test_masks_match_boxes_and_areas(cocos):
    for coco in cocos:
        for ann in coco.anns.values():
            mask = coco.annToMask(ann)
            ys, xs = np.nonzero(mask)
            x, y, w, h = ann['bbox']
            # The mask fills its box up to rasterisation (one pixel).
            assert xs.min() >= np.floor(x) - 1 and xs.max() <= np.ceil(x + w) + 1
            assert ys.min() >= np.floor(y) - 1 and ys.max() <= np.ceil(y + h) + 1
            assert xs.max() - xs.min() + 1 >= w - 2 and ys.max() - ys.min() + 1 >= h - 2
            assert mask.sum() == pytest.approx(ann['area'], rel=0.1)


def test_pixels_show_the_annotated_shapes(dataset, cocos):
    # The annotations describe the image: each shape is a solid colour that
    # differs from the background around it.
    for (img_dir, _), coco in zip(split_dirs(dataset), cocos):
        for img_info in coco.imgs.values():
            img = cv2.imread(osp.join(img_dir, img_info['file_name'])).astype(np.float32)
            anns = coco.loadAnns(coco.getAnnIds(imgIds=img_info['id']))
            union = np.zeros(img.shape[:2], bool)
            for ann in anns:
                union |= coco.annToMask(ann).astype(bool)
            background = img[~union].mean(0)
            for ann in anns:
                inner = cv2.erode(coco.annToMask(ann), np.ones((5, 5), np.uint8)).astype(bool)
                assert inner.any()
                assert img[inner].std(0).max() < 20, 'a shape is one colour (plus noise)'
                assert np.linalg.norm(img[inner].mean(0) - background) > 30


def shape_colours(root: str):
    """``[(label, mean RGB colour inside the shape)]`` of the validation images."""
    (img_dir, ann_file) = split_dirs(root)[1]
    coco = COCO(ann_file)
    out = []
    for ann in coco.anns.values():
        img = cv2.imread(osp.join(img_dir, coco.imgs[ann['image_id']]['file_name']))
        inner = cv2.erode(coco.annToMask(ann), np.ones((5, 5), np.uint8)).astype(bool)
        out.append((ann['category_id'] - 1, img[inner][:, ::-1].mean(0)))
    return out


def test_class_colours(dataset, tmp_path):
    # Default: each shape has its class colour, jittered (plus noise and JPEG).
    for label, colour in shape_colours(dataset):
        assert np.abs(colour - PALETTE[label]).max() <= COLOUR_JITTER + 10
    # class_colours=False: random colours, unrelated to the class.
    generate(str(tmp_path), **dict(KW, num_val=8, class_colours=False))
    assert max(np.abs(colour - PALETTE[label]).max()
               for label, colour in shape_colours(str(tmp_path))) > COLOUR_JITTER + 10


def test_images_are_real_jpegs(dataset):
    for img_dir, _ in split_dirs(dataset):
        for name in os.listdir(img_dir):
            path = osp.join(img_dir, name)
            with open(path, 'rb') as f:
                assert f.read(3) == b'\xff\xd8\xff', f'{name} is not a JPEG file'
            img = cv2.imread(path)
            assert img is not None and img.shape == (SIZE, SIZE, 3)


def test_same_seed_same_files_other_seed_other_files(dataset, tmp_path):
    generate(str(tmp_path / 'again'), **KW)
    for (img_a, ann_a), (img_b, ann_b) in zip(split_dirs(dataset),
                                              split_dirs(str(tmp_path / 'again'))):
        assert filecmp.cmp(ann_a, ann_b, shallow=False)
        names = os.listdir(img_a)
        match, mismatch, errors = filecmp.cmpfiles(img_a, img_b, names, shallow=False)
        assert match == names and not mismatch and not errors
    generate(str(tmp_path / 'other'), **dict(KW, seed=1))
    with open(split_dirs(dataset)[0][1]) as f, \
            open(split_dirs(str(tmp_path / 'other'))[0][1]) as g:
        assert json.load(f)['annotations'] != json.load(g)['annotations']


def test_training_images_do_not_depend_on_the_validation_count(dataset, tmp_path):
    generate(str(tmp_path), **dict(KW, num_val=1))
    assert filecmp.cmp(split_dirs(dataset)[0][1], split_dirs(str(tmp_path))[0][1],
                       shallow=False)


@pytest.mark.parametrize('kwargs, match', [
    (dict(num_train=0), 'num_train'),  # at least one training image
    (dict(num_val=-1), 'num_val'),
    (dict(min_object=30, max_object=20), 'min_object'),  # sizes must be ordered
    (dict(size=48, max_object=40), 'size=48'),  # the largest shape must fit
    (dict(max_objects=0), 'max_objects'),
])
def test_invalid_arguments_are_rejected(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(str(tmp_path), **dict(KW, **kwargs))


def test_command_line(tmp_path, capsys):
    main(['--out', str(tmp_path), '--num-train', '2', '--num-val', '1', '--size', '96',
          '--max-object', '40', '--seed', '3'])
    assert 'wrote synthetic COCO data' in capsys.readouterr().out
    assert len(COCO(split_dirs(str(tmp_path))[1][1]).getImgIds()) == 1


def test_mmdet_coco_dataset_reads_boxes_and_masks(dataset, cocos):
    from mmdet.datasets import CocoDataset
    from mmengine.registry import DefaultScope

    with DefaultScope.overwrite_default_scope('mmdet'):
        ds = CocoDataset(
            data_root=dataset, ann_file='annotations/instances_val2017.json',
            data_prefix=dict(img='val2017/'), metainfo=METAINFO,
            pipeline=[dict(type='LoadImageFromFile'),
                      dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                      dict(type='PackDetInputs')])
    assert len(ds) == KW['num_val'] and ds.metainfo['classes'] == CLASSES
    sample = ds[0]['data_samples']
    anns = cocos[1].loadAnns(cocos[1].getAnnIds(imgIds=sample.img_id))
    gt = sample.gt_instances
    assert len(gt) == len(anns)
    x, y, w, h = np.array([a['bbox'] for a in anns]).T
    np.testing.assert_allclose(gt.bboxes.tensor.numpy(), np.stack([x, y, x + w, y + h], 1),
                               atol=1e-3)
    assert gt.labels.tolist() == [a['category_id'] - 1 for a in anns]
    assert gt.masks.to_ndarray().shape == (len(anns), SIZE, SIZE)
