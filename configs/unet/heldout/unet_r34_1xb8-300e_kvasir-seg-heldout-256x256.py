# ResNet-34 UNet baseline of the held-out test protocol on Kvasir-SEG.
_base_ = './unet_kcla-r34_1xb8-300e_kvasir-seg-heldout-256x256.py'
model = dict(backbone=dict(layer_attn=None))
