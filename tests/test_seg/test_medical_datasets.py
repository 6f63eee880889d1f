"""Medical datasets on the prepared layout, and the synthetic download generator."""
import os
import os.path as osp

import cv2
import numpy as np
import pytest
from mmengine.registry import DefaultScope

import kcla_mm  # noqa: F401
from kcla_mm.datasets import ISIC2017Dataset, ISIC2018Dataset, KvasirSEGDataset
from kcla_mm.datasets.synthetic_medical import ISIC_FOLDERS, KVASIR_ROOT, generate

PIPELINE = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
            dict(type='PackSegInputs')]


def write_prepared(root: str, names, split: str = 'train', img_ext: str = '.png') -> None:
    for d in ('images', 'masks'):
        os.makedirs(osp.join(root, d, split), exist_ok=True)
    for i, name in enumerate(names):
        img = np.full((12, 16, 3), 40 * i, np.uint8)
        mask = np.zeros((12, 16), np.uint8)
        mask[2:6, 3:9] = 1
        cv2.imwrite(osp.join(root, 'images', split, name + img_ext), img)
        cv2.imwrite(osp.join(root, 'masks', split, name + '.png'), mask)


def build(cls, root, split='train', **kwargs):
    with DefaultScope.overwrite_default_scope('mmseg'):
        return cls(data_root=root, pipeline=PIPELINE,
                   data_prefix=dict(img_path=f'images/{split}', seg_map_path=f'masks/{split}'),
                   **kwargs)


def paths(ds, key='img_path'):
    return [ds.get_data_info(i)[key] for i in range(len(ds))]


@pytest.mark.parametrize('cls, classes', [
    (ISIC2017Dataset, ('background', 'lesion')),
    (ISIC2018Dataset, ('background', 'lesion')),
    (KvasirSEGDataset, ('background', 'polyp')),
])
def test_reads_prepared_layout(tmp_path, cls, classes):
    write_prepared(str(tmp_path), ['b', 'a', 'c'])
    ds = build(cls, str(tmp_path))
    assert ds.metainfo['classes'] == classes
    assert [osp.basename(p) for p in paths(ds)] == ['a.png', 'b.png', 'c.png']
    item = ds[0]
    seg = item['data_samples'].gt_sem_seg.data
    assert seg.shape == (1, 12, 16) and set(seg.unique().tolist()) == {0, 1}


def test_jpeg_images_are_accepted(tmp_path):
    write_prepared(str(tmp_path), ['a', 'b'], img_ext='.jpg')
    assert len(build(KvasirSEGDataset, str(tmp_path))) == 2


def test_image_without_mask_is_an_error(tmp_path):
    # Rule: nothing is silently dropped.
    write_prepared(str(tmp_path), ['a', 'b'])
    os.remove(osp.join(tmp_path, 'masks', 'train', 'b.png'))
    with pytest.raises(FileNotFoundError, match=r'no mask .* b'):
        build(ISIC2017Dataset, str(tmp_path))


def test_mask_without_image_is_an_error(tmp_path):
    write_prepared(str(tmp_path), ['a', 'b'])
    os.remove(osp.join(tmp_path, 'images', 'train', 'a.png'))
    with pytest.raises(FileNotFoundError, match=r'no image .* a'):
        build(ISIC2017Dataset, str(tmp_path))


def test_two_images_for_one_mask_is_an_error(tmp_path):
    write_prepared(str(tmp_path), ['a'])
    write_prepared(str(tmp_path), ['a'], img_ext='.jpg')
    with pytest.raises(ValueError, match='same name'):
        build(ISIC2017Dataset, str(tmp_path))


def test_missing_split_names_the_converter(tmp_path):
    with pytest.raises(FileNotFoundError, match=r'tools/dataset_converters/kvasir_seg\.py'):
        build(KvasirSEGDataset, str(tmp_path), split='val')


def test_ann_file_selects_names(tmp_path):
    write_prepared(str(tmp_path), ['a', 'b', 'c'])
    (tmp_path / 'list.txt').write_text('c.png\na\n')
    ds = build(ISIC2018Dataset, str(tmp_path), ann_file='list.txt')
    assert [osp.basename(p) for p in paths(ds, 'seg_map_path')] == ['a.png', 'c.png']
    (tmp_path / 'list.txt').write_text('zz\n')
    with pytest.raises(FileNotFoundError, match='zz'):
        build(ISIC2018Dataset, str(tmp_path), ann_file='list.txt')


def test_reduce_zero_label_is_refused(tmp_path):
    # Rule: label 0 is the background class, not "ignore".
    write_prepared(str(tmp_path), ['a'])
    with pytest.raises(ValueError, match='reduce_zero_label'):
        build(ISIC2017Dataset, str(tmp_path), reduce_zero_label=True)


@pytest.mark.parametrize('layout', ['isic2017', 'isic2018'])
def test_generator_writes_isic_download_layout(tmp_path, layout):
    written = generate(layout, str(tmp_path), num=4, num_val=2, num_test=1, size=32, seed=1)
    assert {k: len(v) for k, v in written.items()} == dict(Training=4, Validation=2, Test=1)
    img_folder, gt_folder = ISIC_FOLDERS[layout]['Validation']
    name = written['Validation'][0]
    img = cv2.imread(str(tmp_path / img_folder / f'{name}.jpg'))
    mask = cv2.imread(str(tmp_path / gt_folder / f'{name}_segmentation.png'),
                      cv2.IMREAD_UNCHANGED)
    assert name.startswith('ISIC_') and len(name) == 12
    assert mask.ndim == 2 and mask.shape == img.shape[:2]
    assert set(np.unique(mask)) == {0, 255}


def test_generator_writes_kvasir_layout_with_jpeg_masks(tmp_path):
    written = generate('kvasir', str(tmp_path), num=3, size=64, seed=0)
    root = tmp_path / KVASIR_ROOT
    assert sorted(os.listdir(root)) == ['images', 'kavsir_bboxes.json', 'masks']
    name = written['all'][0]
    mask = cv2.imread(str(root / 'masks' / f'{name}.jpg'), cv2.IMREAD_UNCHANGED)
    assert mask.ndim == 3  # 3-channel JPEG, like the real masks
    values = np.unique(mask)
    assert len(values) > 2  # compression leaves values other than 0 and 255
    fg = (mask[..., 0] >= 128).mean()
    assert 0.03 < fg < 0.6


def test_generator_is_deterministic(tmp_path):
    a = generate('kvasir', str(tmp_path / 'a'), num=2, size=32, seed=3)
    b = generate('kvasir', str(tmp_path / 'b'), num=2, size=32, seed=3)
    assert a == b
    name = a['all'][0]
    read = [cv2.imread(str(tmp_path / d / KVASIR_ROOT / 'images' / f'{name}.jpg'))
            for d in 'ab']
    assert np.array_equal(*read)
