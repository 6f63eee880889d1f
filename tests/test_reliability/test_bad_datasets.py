"""Broken data sets name the broken file or folder.

A missing mask, a missing or empty split folder and a ``data_root`` without
``data_prefix`` are errors when the data set is built; a corrupted, truncated
or empty image or mask is an error when its sample is loaded. Each message
carries the file or folder name. The samples are loaded with the pipelines
of the project's configs, whose loading transforms
(:mod:`kcla_mm.datasets.transforms`) name the file in any decode error.
"""
import json
import os
import os.path as osp

import pytest
from mmengine.config import Config
from mmengine.registry import init_default_scope
from reliability_utils import ROOT, write_det_data, write_seg_data

import kcla_mm  # noqa: F401  (registers the medical data sets and the loading transforms)

SEG_CONFIG = osp.join(ROOT, 'configs/unet/_base_/datasets/kvasir-seg_256x256.py')
DET_CONFIG = osp.join(ROOT, 'configs/kcla/demo/faster-rcnn_kcla-r18_fpn_synthetic.py')
MEDICAL = {'KvasirSEGDataset': 'kvasir_seg', 'ISIC2017Dataset': 'isic2017',
           'ISIC2018Dataset': 'isic2018'}


@pytest.fixture(scope='module')
def seg_pipeline() -> list:
    """The test pipeline of the project's Kvasir-SEG config."""
    pipeline = Config.fromfile(SEG_CONFIG).test_pipeline
    assert {'LoadImageFromFileNamingErrors', 'LoadAnnotationsNamingErrors'} <= {
        t['type'] for t in pipeline}
    return pipeline


def build_seg(pipeline=(), **kwargs):
    init_default_scope('mmseg')
    from mmseg.registry import DATASETS
    kwargs.setdefault('type', 'KvasirSEGDataset')
    return DATASETS.build(dict(pipeline=list(pipeline), **kwargs))


def seg_dataset(root: str, pipeline):
    return build_seg(pipeline, data_root=root,
                     data_prefix=dict(img_path='images/train', seg_map_path='masks/train'))


@pytest.fixture
def seg_root(tmp_path) -> str:
    return write_seg_data(str(tmp_path / 'kvasir'), splits=dict(train=3))


def test_a_missing_mask_names_the_image_at_build_time(seg_root):
    os.remove(osp.join(seg_root, 'masks', 'train', 'train_01.png'))
    with pytest.raises(FileNotFoundError, match=r'no mask in .*masks/train.*train_01'):
        seg_dataset(seg_root, [])


def test_a_mask_deleted_after_the_build_is_named_when_loaded(seg_root, seg_pipeline):
    dataset = seg_dataset(seg_root, seg_pipeline)
    os.remove(osp.join(seg_root, 'masks', 'train', 'train_01.png'))
    with pytest.raises(FileNotFoundError, match=r'masks/train/train_01\.png'):
        dataset[1]


@pytest.mark.parametrize('dataset_type', list(MEDICAL))
def test_a_data_root_without_data_prefix_explains_the_layout(tmp_path, dataset_type):
    # the natural first try; mmengine alone fails with "need at least one array to concatenate"
    root = write_seg_data(str(tmp_path / 'data'), splits=dict(train=2, val=1))
    with pytest.raises(FileNotFoundError) as e:
        build_seg(type=dataset_type, data_root=root)
    message = str(e.value)
    assert f'no image (.png/.jpg/.jpeg) in {root + "/"!r}' in message
    assert 'images/{split}/NAME' in message and 'masks/{split}/NAME.png' in message
    assert "data_prefix=dict(img_path='images/train', seg_map_path='masks/train')" in message
    assert f'{root}/images holds the splits: train, val' in message
    assert f'tools/dataset_converters/{MEDICAL[dataset_type]}.py' in message


@pytest.mark.parametrize('dataset_type', list(MEDICAL))
def test_an_empty_split_names_the_folder_at_build_time(tmp_path, dataset_type):
    root = write_seg_data(str(tmp_path / 'data'), splits=dict(train=2, val=0))
    with pytest.raises(FileNotFoundError) as e:
        build_seg(type=dataset_type, data_root=root,
                  data_prefix=dict(img_path='images/val', seg_map_path='masks/val'))
    assert f"no image (.png/.jpg/.jpeg) in '{root}/images/val'" in str(e.value)
    assert f'tools/dataset_converters/{MEDICAL[dataset_type]}.py' in str(e.value)


def test_a_missing_split_names_the_folder_and_the_splits_there(tmp_path):
    root = write_seg_data(str(tmp_path / 'data'), splits=dict(train=2))
    with pytest.raises(FileNotFoundError) as e:
        build_seg(type='ISIC2018Dataset', data_root=root,
                  data_prefix=dict(img_path='images/test', seg_map_path='masks/test'))
    assert f"image directory '{root}/images/test' does not exist" in str(e.value)
    assert 'holds the splits: train' in str(e.value)


def test_a_data_root_that_does_not_exist_is_named(tmp_path):
    root = str(tmp_path / 'nowhere')
    with pytest.raises(FileNotFoundError, match=f'{root}/images/train.* does not exist'):
        build_seg(data_root=root,
                  data_prefix=dict(img_path='images/train', seg_map_path='masks/train'))


def corrupt(path: str, how: str) -> None:
    with open(path, 'rb') as f:
        data = f.read()
    with open(path, 'wb') as f:
        f.write({'garbage': b'\x00not an image at all', 'truncated': data[:len(data) // 2],
                 'empty': b''}[how])


@pytest.mark.parametrize('how', ['garbage', 'truncated', 'empty'])
def test_a_corrupted_image_is_named_when_loaded(seg_root, seg_pipeline, how):
    dataset = seg_dataset(seg_root, seg_pipeline)
    corrupt(osp.join(seg_root, 'images', 'train', 'train_02.png'), how)
    assert dataset[0]['inputs'].shape[0] == 3  # the others still load
    with pytest.raises(Exception, match=r'images/train/train_02\.png'):
        dataset[2]


@pytest.mark.parametrize('how', ['garbage', 'truncated', 'empty'])
def test_a_corrupted_mask_is_named_when_loaded(seg_root, seg_pipeline, how):
    dataset = seg_dataset(seg_root, seg_pipeline)
    corrupt(osp.join(seg_root, 'masks', 'train', 'train_02.png'), how)
    assert dataset[0]['data_samples'].gt_sem_seg.data.shape[0] == 1  # the others still load
    with pytest.raises(OSError, match=r'cannot read the mask .*masks/train/train_02\.png'):
        dataset[2]


@pytest.mark.parametrize('what', ['image', 'mask'])
def test_the_host_transforms_alone_do_not_name_the_file(seg_root, what):
    # the reason for the project's loading transforms: mmcv's image loader
    # (OpenCV) and mmseg's annotation loader (PIL) do not name the file
    pipeline = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations')]
    dataset = seg_dataset(seg_root, pipeline)
    corrupt(osp.join(seg_root, 'images' if what == 'image' else 'masks', 'train',
                     'train_02.png'), 'empty' if what == 'image' else 'garbage')
    with pytest.raises(Exception) as e:
        dataset[2]
    assert 'train_02' not in str(e.value)


def test_the_loading_transforms_keep_the_ignore_empty_option(seg_root):
    dataset = seg_dataset(seg_root, [dict(type='LoadImageFromFileNamingErrors',
                                          ignore_empty=True)])
    corrupt(osp.join(seg_root, 'images', 'train', 'train_02.png'), 'empty')
    assert dataset.pipeline(dataset.get_data_info(2)) is None


@pytest.fixture
def coco_dataset(tmp_path):
    root = write_det_data(str(tmp_path / 'coco'), num_train=2, num_val=1)
    cfg = Config.fromfile(DET_CONFIG)
    init_default_scope('mmdet')
    from mmdet.registry import DATASETS
    dataset = DATASETS.build(dict(
        type='CocoDataset', data_root=root, ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'), metainfo=cfg.metainfo, pipeline=cfg.test_pipeline))
    with open(osp.join(root, 'annotations', 'instances_train2017.json')) as f:
        names = [img['file_name'] for img in json.load(f)['images']]
    return dataset, osp.join(root, 'train2017'), names


@pytest.mark.parametrize('how', ['garbage', 'truncated', 'empty'])
def test_a_corrupted_detection_image_is_named_when_loaded(coco_dataset, how):
    dataset, folder, names = coco_dataset
    corrupt(osp.join(folder, names[1]), how)
    with pytest.raises(Exception, match=names[1].replace('.', r'\.')):
        dataset[1]


def test_a_missing_detection_image_is_named_when_loaded(coco_dataset):
    dataset, folder, names = coco_dataset
    os.remove(osp.join(folder, names[0]))
    with pytest.raises(FileNotFoundError, match=names[0].replace('.', r'\.')):
        dataset[0]
