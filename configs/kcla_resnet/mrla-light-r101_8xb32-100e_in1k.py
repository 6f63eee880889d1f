# MRLA-light-ResNet-101 on ImageNet-1k, on the KCLA authors' recipe (see the base file).
_base_ = './_base_/kcla-r50_8xb32-100e_in1k.py'

model = dict(backbone=dict(depth=101, layer_attn=dict(type='MRLALight', drop_path=0.2)))
