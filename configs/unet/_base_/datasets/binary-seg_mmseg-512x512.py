# The mmseg-style protocol of mmseg's projects/medical configs for the binary
# lesion/polyp datasets: random resize (0.5-2.0) of a 512x512 scale, 512x512
# crops, flip, photometric distortion, batch 16; mIoU/mDice over both classes
# (plus the paper's foreground IoU/DSC). The dataset configs beside this file
# (isic2017_512x512.py, ...) inherit it and name the dataset type and data
# root; this file alone builds no dataset.
dataset_type = None
data_root = None
img_scale = (512, 512)
crop_size = (512, 512)

# Normalisation constants (RGB, 0-255); see binary-seg_paper-256x256.py.
norm_mean = [123.675, 116.28, 103.53]
norm_std = [58.395, 57.12, 57.375]
data_preprocessor = dict(
    type='SegDataPreProcessor',
    mean=norm_mean,
    std=norm_std,
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=crop_size)

train_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='LoadAnnotationsNamingErrors'),
    dict(type='RandomResize', scale=img_scale, ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='LoadAnnotationsNamingErrors'),
    dict(type='PackSegInputs')
]
train_dataloader = dict(
    batch_size=16,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path='images/train', seg_map_path='masks/train'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path='images/val', seg_map_path='masks/val'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = [
    dict(type='IoUMetric', iou_metrics=['mIoU', 'mDice']),
    dict(type='ForegroundIoUMetric', threshold=0.5),
]
test_evaluator = val_evaluator
