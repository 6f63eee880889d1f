# The paper's protocol for the binary lesion/polyp datasets: 256x256 input,
# flips and rotations, batch 8, foreground IoU/DSC and mmseg's mIoU/mDice on
# the val split at the original image resolution. The dataset configs beside
# this file (isic2017_256x256.py, ...) inherit it and name the dataset type and
# data root; this file alone builds no dataset.
dataset_type = None
data_root = None
img_scale = (256, 256)

# Normalisation constants (RGB, 0-255 scale). The defaults are ImageNet's
# (what an ImageNet-pretrained encoder expects). Each converter prints its
# dataset's train-split statistics and writes them to DATA_ROOT/stats.json; to
# use them, set `data_preprocessor = dict(mean=[...], std=[...])` in the
# dataset config or pass
#   --cfg-options model.data_preprocessor.mean="[...]" model.data_preprocessor.std="[...]"
norm_mean = [123.675, 116.28, 103.53]
norm_std = [58.395, 57.12, 57.375]
data_preprocessor = dict(
    type='SegDataPreProcessor',
    mean=norm_mean,
    std=norm_std,
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=img_scale)

train_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='LoadAnnotationsNamingErrors'),
    dict(type='Resize', scale=img_scale, keep_ratio=False),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='RandomFlip', prob=0.5, direction='vertical'),
    dict(type='RandomRotate', prob=0.5, degree=180, pad_val=0, seg_pad_val=0),
    dict(type='PackSegInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFileNamingErrors'),
    dict(type='Resize', scale=img_scale, keep_ratio=False),
    # Loaded after Resize: metrics are computed at the original resolution.
    dict(type='LoadAnnotationsNamingErrors'),
    dict(type='PackSegInputs')
]
train_dataloader = dict(
    batch_size=8,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
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
# The protocol evaluates on the val split; for an official test split use
#   --cfg-options test_dataloader.dataset.data_prefix.img_path=images/test
#                 test_dataloader.dataset.data_prefix.seg_map_path=masks/test
test_dataloader = val_dataloader
# fg_IoU/fg_DSC: the paper's convention (foreground class, one confusion
# matrix over all pixels, threshold 0.5); mIoU/mDice: mmseg's, averaged over
# background and foreground.
val_evaluator = [
    dict(type='ForegroundIoUMetric', threshold=0.5),
    dict(type='IoUMetric', iou_metrics=['mIoU', 'mDice']),
]
test_evaluator = val_evaluator
