_base_ = './unet_kcla-r34_1xb16-20k_kvasir-seg-512x512.py'
model = dict(backbone=dict(layer_attn=None))
