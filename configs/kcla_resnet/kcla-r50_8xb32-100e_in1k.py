# KCLA-ResNet-50 on ImageNet-1k, the authors' recipe (see the base file).
_base_ = './_base_/kcla-r50_8xb32-100e_in1k.py'
