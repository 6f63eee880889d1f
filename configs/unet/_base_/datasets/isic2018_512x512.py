# ISIC 2018 task 1, the mmseg-style protocol (binary-seg_mmseg-512x512.py), on
# the 7:3 train/val split made by tools/dataset_converters/isic2018.py (its
# train-split RGB statistics: data/isic2018/stats.json).
_base_ = './binary-seg_mmseg-512x512.py'
dataset_type = 'ISIC2018Dataset'
data_root = 'data/isic2018'
train_dataloader = dict(dataset=dict(type=dataset_type, data_root=data_root))
val_dataloader = dict(dataset=dict(type=dataset_type, data_root=data_root))
test_dataloader = val_dataloader
