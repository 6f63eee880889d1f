_base_ = './unet_kcla-r34_1xb8-300e_isic2017-256x256.py'
model = dict(backbone=dict(layer_attn=None))
