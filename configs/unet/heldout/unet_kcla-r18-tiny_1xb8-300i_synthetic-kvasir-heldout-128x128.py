# The CPU demo model (../unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py)
# under the held-out test protocol: validation every 100 iterations keeps the
# best checkpoint by fg_DSC on val; the test split is evaluated with it. Data:
#   python -m kcla_mm.datasets.synthetic_medical --layout kvasir --out DL --num 200
#   python tools/dataset_converters/kvasir_seg.py DL --out work_dirs/demo_seg_heldout/data \
#       --ratio 0.7 --test-ratio 0.15
_base_ = '../unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py'

data_root = 'work_dirs/demo_seg_heldout/data'
max_iters = 300
val_interval = 100

train_dataloader = dict(dataset=dict(data_root=data_root))
val_dataloader = dict(dataset=dict(data_root=data_root))
test_dataloader = dict(
    dataset=dict(
        data_root=data_root,
        data_prefix=dict(img_path='images/test', seg_map_path='masks/test')))
train_cfg = dict(val_interval=val_interval)
default_hooks = dict(
    checkpoint=dict(interval=max_iters, max_keep_ckpts=1, save_best='fg_DSC', rule='greater'))
