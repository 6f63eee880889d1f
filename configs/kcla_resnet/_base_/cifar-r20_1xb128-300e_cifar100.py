# CIFAR-100 with the CIFAR ResNets of the layer-attention papers, the KCLA
# authors' recipe, for every method and depth: batch 128 on one GPU, SGD lr 0.1,
# momentum 0.9, weight decay 1e-4, 300 epochs with lr x0.1 at epochs 150 and 225
# (the defaults of their CIFAR trainer), random crop 32 with padding 4 and
# horizontal flip. The data are the official cifar-100-python/ files, never
# downloaded (OfflineCIFAR100 names the folder and the archive when they are
# missing). The method and the depth are the only things the configs change.
_base_ = [
    'mmpretrain::_base_/datasets/cifar100_bs16.py',
    'mmpretrain::_base_/schedules/cifar10_bs128.py',
    'mmpretrain::_base_/default_runtime.py',
]

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

model = dict(
    type='ImageClassifier',
    backbone=dict(
        type='CifarKCLAResNet',
        depth=20,  # 9n + 2 Bottleneck blocks: 20, 56, 110 for n = 2, 6, 12
        block='Bottleneck',
        layer_attn=dict(type='KCLA', drop_path=0.2)),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(
        type='LinearClsHead',
        num_classes=100,
        in_channels=256,
        loss=dict(type='CrossEntropyLoss', loss_weight=1.0),
        topk=(1, 5)))

train_dataloader = dict(batch_size=128, dataset=dict(type='OfflineCIFAR100'))
val_dataloader = dict(batch_size=128, dataset=dict(type='OfflineCIFAR100'))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, 5))
test_evaluator = val_evaluator

param_scheduler = dict(type='MultiStepLR', by_epoch=True, milestones=[150, 225], gamma=0.1)
train_cfg = dict(by_epoch=True, max_epochs=300, val_interval=1)
