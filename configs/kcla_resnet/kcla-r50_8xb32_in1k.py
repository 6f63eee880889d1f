# KCLA-ResNet-50 on mmpretrain's standard ResNet-50 recipe, unchanged (no warm-up):
# the one-line variant of kcla-r50_8xb32-100e_in1k.py, comparable with
# mmpretrain's own resnet50_8xb32_in1k.py results.
_base_ = 'mmpretrain::resnet/resnet50_8xb32_in1k.py'

custom_imports = dict(imports=['kcla_mm', 'kcla_mm.host_fixes'], allow_failed_imports=False)

model = dict(backbone=dict(type='KCLAResNet', layer_attn=dict(type='KCLA', drop_path=0.2)))
