_base_ = './unet_kcla-r34_1xb8-300e_kvasir-seg-256x256.py'
model = dict(
    backbone=dict(depth=50, layer_attn=None),
    decode_head=dict(in_channels=[256, 512, 1024, 2048]))
