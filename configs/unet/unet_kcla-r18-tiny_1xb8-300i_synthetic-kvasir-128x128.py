# CPU demo (tools/run_demo_seg.sh): a tiny KCLA-ResNet-18 UNet (base and stem
# width 16, 8 channels per head) on synthetic Kvasir-layout data made by
#   python -m kcla_mm.datasets.synthetic_medical --layout kvasir --out DL
#   python tools/dataset_converters/kvasir_seg.py DL --out work_dirs/demo_seg/data
# The paper's Kvasir-SEG protocol (AdamW, cosine to 1e-5, BCE + Dice, flips
# and rotations) at 128x128 and for 300 iterations instead of 300 epochs.
_base_ = './unet_kcla-r34_1xb8-300e_kvasir-seg-256x256.py'

data_root = 'work_dirs/demo_seg/data'
img_scale = (128, 128)
max_iters = 300

model = dict(
    data_preprocessor=dict(size=img_scale),
    backbone=dict(depth=18, base_channels=16, stem_channels=16, head_dim=8),
    decode_head=dict(in_channels=[16, 32, 64, 128], decoder_channels=[64, 32, 16, 16, 8]))

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
    dict(type='LoadAnnotationsNamingErrors'),
    dict(type='PackSegInputs')
]
# Two CPU cores: load in the main process.
train_dataloader = dict(
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(
    num_workers=0,
    persistent_workers=False,
    dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader

train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters,
                 val_interval=max_iters)
param_scheduler = [
    dict(type='CosineAnnealingLR', T_max=max_iters, eta_min=1e-5, begin=0, end=max_iters,
         by_epoch=False)
]
default_hooks = dict(
    logger=dict(interval=50, log_metric_by_epoch=False),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=1, save_best=None))
log_processor = dict(by_epoch=False)
