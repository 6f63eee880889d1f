_base_ = [
    './_base_/models/unet_kcla-r34.py', './_base_/datasets/isic2017_256x256.py',
    './_base_/schedules/adamw-cosine_300e.py', './_base_/default_runtime.py'
]
model = dict(data_preprocessor={{_base_.data_preprocessor}})
log_processor = dict(by_epoch=True)
