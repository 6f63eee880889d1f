_base_ = './unet_kcla-r34_1xb8-300e_isic2018-256x256.py'
model = dict(backbone=dict(depth=18))
