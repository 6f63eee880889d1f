# Plain ResNet-101 (KCLAResNet with layer_attn=None: exactly mmpretrain's ResNet)
# on ImageNet-1k, on the KCLA authors' recipe (see the base file).
_base_ = './_base_/kcla-r50_8xb32-100e_in1k.py'

model = dict(backbone=dict(depth=101, layer_attn=None))
