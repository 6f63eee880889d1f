# ResNet-34 UNet baseline of the held-out test protocol on ISIC 2017.
_base_ = './unet_kcla-r34_1xb8-300e_isic2017-heldout-256x256.py'
model = dict(backbone=dict(layer_attn=None))
