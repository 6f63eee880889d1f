# Plain CIFAR-ResNet-20 (Bottleneck, depth 9n + 2) on CIFAR-100, the KCLA
# authors' recipe (see the base file).
_base_ = './_base_/cifar-r20_1xb128-300e_cifar100.py'

model = dict(backbone=dict(depth=20, layer_attn=None))
