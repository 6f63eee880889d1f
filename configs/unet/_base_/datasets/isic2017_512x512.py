# ISIC 2017 part 1, the mmseg-style protocol (binary-seg_mmseg-512x512.py), on
# the 7:3 train/val split made by tools/dataset_converters/isic2017.py (its
# train-split RGB statistics: data/isic2017/stats.json).
_base_ = './binary-seg_mmseg-512x512.py'
dataset_type = 'ISIC2017Dataset'
data_root = 'data/isic2017'
train_dataloader = dict(dataset=dict(type=dataset_type, data_root=data_root))
val_dataloader = dict(dataset=dict(type=dataset_type, data_root=data_root))
test_dataloader = val_dataloader
