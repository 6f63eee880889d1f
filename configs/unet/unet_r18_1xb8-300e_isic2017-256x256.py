_base_ = './unet_kcla-r34_1xb8-300e_isic2017-256x256.py'
model = dict(backbone=dict(depth=18, layer_attn=None))
