# Kvasir-SEG, the mmseg-style protocol (binary-seg_mmseg-512x512.py), on the
# 7:3 train/val split made by tools/dataset_converters/kvasir_seg.py (its
# train-split RGB statistics: data/kvasir_seg/stats.json).
_base_ = './binary-seg_mmseg-512x512.py'
dataset_type = 'KvasirSEGDataset'
data_root = 'data/kvasir_seg'
train_dataloader = dict(dataset=dict(type=dataset_type, data_root=data_root))
val_dataloader = dict(dataset=dict(type=dataset_type, data_root=data_root))
test_dataloader = val_dataloader
