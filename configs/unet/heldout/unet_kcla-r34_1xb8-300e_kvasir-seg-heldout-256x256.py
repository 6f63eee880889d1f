# Held-out test protocol on Kvasir-SEG: the paper's protocol (300 epochs at 256x256,
# validation every 10 epochs), the best checkpoint (fg_DSC) chosen on the val
# split, then the test split evaluated with it and used for nothing else.
# Data: tools/dataset_converters/kvasir_seg.py with --test-ratio
# (e.g. --ratio 0.7 --test-ratio 0.15) or a --split-file listing test names.
_base_ = '../unet_kcla-r34_1xb8-300e_kvasir-seg-256x256.py'
test_dataloader = dict(
    dataset=dict(data_prefix=dict(img_path='images/test', seg_map_path='masks/test')))
