# ImageNet-1k pretraining with the KCLA authors' recipe, for every method:
# mmpretrain's ResNet-50 recipe (8 GPUs x 32 images = batch 256, SGD lr 0.1,
# momentum 0.9, weight decay 1e-4, 100 epochs, lr x0.1 at epochs 30, 60 and 90,
# RandomResizedCrop 224 + flip) with what the authors' trainer adds: a linear
# warm-up over the first 3 epochs and drop path 0.2 on the layer-attention
# branch. The method is the only thing the configs of this folder change.
_base_ = 'mmpretrain::resnet/resnet50_8xb32_in1k.py'

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

model = dict(backbone=dict(type='KCLAResNet', layer_attn=dict(type='KCLA', drop_path=0.2)))

param_scheduler = [
    # from 1% of the lr to the lr over the first 3 epochs, updated every iteration
    dict(type='LinearLR', start_factor=0.01, by_epoch=True, begin=0, end=3,
         convert_to_iter_based=True),
    dict(type='MultiStepLR', by_epoch=True, begin=0, end=100, milestones=[30, 60, 90],
         gamma=0.1),
]
