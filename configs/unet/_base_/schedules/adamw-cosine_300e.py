# The paper's protocol: AdamW (lr 1e-3, weight decay 1e-2), cosine annealing to
# 1e-5 over the whole run. 300 epochs and batch 8 (in the dataset configs) are
# the common choice of the medical-UNet line of work the paper compares with;
# the paper's own epoch count: see the paper.
max_epochs = 300
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2))
param_scheduler = [
    dict(type='CosineAnnealingLR', T_max=max_epochs, eta_min=1e-5, begin=0, end=max_epochs,
         by_epoch=True, convert_to_iter_based=True)
]
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=10)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50, log_metric_by_epoch=True),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=True, interval=10, max_keep_ckpts=2,
                    save_best='fg_DSC', rule='greater'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
