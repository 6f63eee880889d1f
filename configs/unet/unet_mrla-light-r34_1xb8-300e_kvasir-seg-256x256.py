_base_ = './unet_kcla-r34_1xb8-300e_kvasir-seg-256x256.py'
model = dict(backbone=dict(layer_attn=dict(type='MRLALight')))
