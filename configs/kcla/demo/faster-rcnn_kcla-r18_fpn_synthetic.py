# Demo: Faster R-CNN with a small KCLA-ResNet-18 trained from scratch on the
# synthetic shapes dataset (kcla_mm/datasets/synthetic_coco.py) in a few CPU
# minutes. See configs/kcla/demo/README.md for the command and the measured numbers.
_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

data_root = 'data/synthetic_coco/'
metainfo = dict(
    classes=('circle', 'square', 'triangle'),
    palette=[(220, 20, 60), (0, 128, 255), (0, 200, 80)])
image_size = (128, 128)
max_iters = 200
width = 64  # FPN and RoI feature channels

model = dict(
    backbone=dict(
        type='KCLAResNet',
        depth=18,
        base_channels=16,
        head_dim=8,
        frozen_stages=-1,
        norm_eval=False,
        layer_attn=dict(type='KCLA', drop_path=0.0),
        init_cfg=None),
    neck=dict(in_channels=[16, 32, 64, 128], out_channels=width),
    rpn_head=dict(in_channels=width, feat_channels=width),
    roi_head=dict(
        bbox_roi_extractor=dict(roi_layer=dict(sampling_ratio=1), out_channels=width),
        bbox_head=dict(in_channels=width, fc_out_channels=256, num_classes=3)),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=500, max_per_img=200),
        rcnn=dict(sampler=dict(num=32))),
    test_cfg=dict(rpn=dict(nms_pre=300, max_per_img=100)))

train_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='LoadAnnotationsNamingErrors', with_bbox=True),
    dict(type='Resize', scale=image_size, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='Resize', scale=image_size, keep_ratio=True),
    dict(type='LoadAnnotationsNamingErrors', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator

train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters,
                 val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=50, end=max_iters, eta_min=1e-4)
]
optim_wrapper = dict(
    optimizer=dict(type='SGD', lr=0.02, momentum=0.9, weight_decay=1e-4),
    clip_grad=dict(max_norm=10, norm_type=2))

default_hooks = dict(
    logger=dict(interval=20),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=1))
log_processor = dict(by_epoch=False, window_size=20)
randomness = dict(seed=0)
