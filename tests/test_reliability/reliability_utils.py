"""Tiny data sets, configs and evil checkpoints shared by the reliability tests.

Everything is written under a ``tmp_path``: a prepared-layout binary
segmentation set of 32x32 images, a synthetic COCO set of 64x64 images, and
configs that inherit the repository's configs and shrink them to models of a
few thousand parameters (widths 8, ResNet-18).
"""
import os
import os.path as osp
import sys
from typing import Dict, List, Optional

import cv2
import numpy as np
import torch
from utils import ROOT

SEG_BASE = osp.join(ROOT, 'configs/unet/unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py')
DET_BASE = osp.join(ROOT, 'configs/kcla/demo/faster-rcnn_kcla-r18_fpn_synthetic.py')
TRAIN = osp.join(ROOT, 'tools/train.py')
TEST = osp.join(ROOT, 'tools/test.py')
DIST_TRAIN = osp.join(ROOT, 'tools/dist_train.sh')


class Evil:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}', ))


def write_evil_checkpoint(path: str, marker: str) -> str:
    """A checkpoint that looks like mmengine's but runs code when unpickled."""
    torch.save({'meta': {'iter': 1}, 'state_dict': {}, 'payload': Evil(marker)}, path)
    return path


def write_seg_data(root: str, splits: Optional[Dict[str, int]] = None, size: int = 32,
                   seed: int = 0) -> str:
    """A prepared-layout binary set: ``images/SPLIT/i.png`` with a disc, its 0/1 mask."""
    splits = dict(train=4, val=2) if splits is None else splits
    rng = np.random.default_rng(seed)
    for split, n in splits.items():
        for d in ('images', 'masks'):
            os.makedirs(osp.join(root, d, split), exist_ok=True)
        for i in range(n):
            img = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            mask = np.zeros((size, size), np.uint8)
            c = rng.integers(size // 4, 3 * size // 4, 2)
            cv2.circle(mask, (int(c[0]), int(c[1])), int(rng.integers(3, size // 4)), 1, -1)
            img[mask > 0] = (200, 120, 80)
            cv2.imwrite(osp.join(root, 'images', split, f'{split}_{i:02d}.png'), img)
            cv2.imwrite(osp.join(root, 'masks', split, f'{split}_{i:02d}.png'), mask)
    return root


def write_det_data(root: str, num_train: int = 2, num_val: int = 1, size: int = 64) -> str:
    """A synthetic COCO set (:mod:`kcla_mm.datasets.synthetic_coco`), objects of 10-24 px."""
    from kcla_mm.datasets.synthetic_coco import generate
    generate(root, num_train=num_train, num_val=num_val, size=size, seed=0, min_object=10,
             max_object=24, max_objects=2)
    return root


SEG_CONFIG = '''
_base_ = {base!r}
data_root = {data_root!r}
img_scale = (32, 32)
max_iters = {max_iters}
model = dict(
    data_preprocessor=dict(size=img_scale),
    backbone=dict(base_channels=8, stem_channels=8, head_dim=8, norm_cfg={norm_cfg!r}),
    decode_head=dict(in_channels=[8, 16, 32, 64], decoder_channels=[16, 16, 8, 8, 8],
                     norm_cfg={norm_cfg!r}))
# no random transforms: a resumed run must see exactly the same batches
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='PackSegInputs')
]
test_pipeline = train_pipeline
train_dataloader = dict(
    batch_size={batch_size},
    sampler=dict(type='InfiniteSampler', shuffle=True, seed=0),
    dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
train_cfg = dict(max_iters=max_iters, val_interval=1000)
param_scheduler = [
    dict(type='CosineAnnealingLR', T_max=max_iters, eta_min=1e-5, begin=0, end=max_iters,
         by_epoch=False)
]
default_hooks = dict(
    logger=dict(interval=1),
    checkpoint=dict(interval={ckpt_interval}, max_keep_ckpts=-1))
randomness = dict(seed=0, deterministic=True)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
'''

DET_CONFIG = '''
_base_ = {base!r}
data_root = {data_root!r}
image_size = (64, 64)
max_iters = {max_iters}
width = 16
model = dict(
    backbone=dict(base_channels=8, head_dim=8),
    neck=dict(in_channels=[8, 16, 32, 64], out_channels=width),
    rpn_head=dict(in_channels=width, feat_channels=width),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=width),
        bbox_head=dict(in_channels=width, fc_out_channels=32)),
    train_cfg=dict(rpn_proposal=dict(nms_pre=100, max_per_img=20), rcnn=dict(sampler=dict(num=16))),
    test_cfg=dict(rpn=dict(nms_pre=100, max_per_img=20)))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale=image_size, keep_ratio=True),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=image_size, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(
    batch_size={batch_size},
    dataset=dict(data_root=data_root, ann_file='annotations/instances_train2017.json',
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    dataset=dict(data_root=data_root, ann_file='annotations/instances_val2017.json',
                 pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + '/annotations/instances_val2017.json')
test_evaluator = val_evaluator
train_cfg = dict(max_iters=max_iters, val_interval=1000)
param_scheduler = [dict(type='ConstantLR', factor=1.0, by_epoch=False, begin=0, end=max_iters)]
default_hooks = dict(logger=dict(interval=1),
                     checkpoint=dict(interval={ckpt_interval}, max_keep_ckpts=-1))
env_cfg = dict(dist_cfg=dict(backend='gloo'))
'''


def write_seg_config(path: str, data_root: str, max_iters: int = 6, ckpt_interval: int = 2,
                     batch_size: int = 2, norm_cfg: Optional[dict] = None,
                     extra: str = '') -> str:
    """The tiny UNet config (KCLA-ResNet-18, widths 8) for ``data_root``."""
    norm_cfg = dict(type='BN', requires_grad=True) if norm_cfg is None else norm_cfg
    with open(path, 'w') as f:
        f.write(SEG_CONFIG.format(base=SEG_BASE, data_root=data_root, max_iters=max_iters,
                                  ckpt_interval=ckpt_interval, batch_size=batch_size,
                                  norm_cfg=norm_cfg) + extra)
    return path


def write_det_config(path: str, data_root: str, max_iters: int = 2, ckpt_interval: int = 2,
                     batch_size: int = 1, extra: str = '') -> str:
    """The demo Faster R-CNN config shrunk to widths 8/16 on 64x64 images."""
    with open(path, 'w') as f:
        f.write(DET_CONFIG.format(base=DET_BASE, data_root=data_root, max_iters=max_iters,
                                  ckpt_interval=ckpt_interval, batch_size=batch_size) + extra)
    return path


def run_script(path: str, argv: List[str], monkeypatch) -> None:
    """Run a tool as ``python path argv`` inside this process (its ``__main__`` block)."""
    import runpy
    monkeypatch.setattr(sys, 'argv', [path] + list(argv))
    runpy.run_path(path, run_name='__main__')
