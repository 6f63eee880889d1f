# mmseg-style protocol (as mmseg's projects/medical): SGD, 20k iterations,
# two softmax outputs and cross-entropy.
_base_ = [
    './_base_/models/unet_kcla-r34.py', './_base_/datasets/isic2018_512x512.py',
    'mmseg::_base_/schedules/schedule_20k.py', './_base_/default_runtime.py'
]
model = dict(
    data_preprocessor={{_base_.data_preprocessor}},
    decode_head=dict(
        out_channels=2,
        threshold=None,
        loss_decode=[dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)]))
