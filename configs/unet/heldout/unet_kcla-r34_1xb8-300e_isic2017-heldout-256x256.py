# Held-out test protocol on ISIC 2017: the paper's protocol (300 epochs at 256x256,
# validation every 10 epochs), the best checkpoint (fg_DSC) chosen on the val
# split, then the test split evaluated with it and used for nothing else.
# Data: tools/dataset_converters/isic2017.py with the official Test
# set unpacked (it becomes the test split; --split official or random).
_base_ = '../unet_kcla-r34_1xb8-300e_isic2017-256x256.py'
test_dataloader = dict(
    dataset=dict(data_prefix=dict(img_path='images/test', seg_map_path='masks/test')))
