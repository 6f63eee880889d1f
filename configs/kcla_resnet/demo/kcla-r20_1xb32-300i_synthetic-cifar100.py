# CPU demo (tools/run_demo_cls.sh): KCLA CIFAR-ResNet-20 of the CIFAR-100
# config, unchanged, trained from scratch on synthetic data in the official
# cifar-100-python/ layout, made by
#   python -m kcla_mm.datasets.synthetic_cls cifar100 --out work_dirs/demo_cls/data \
#       --classes 10 --num-train 200 --num-test 50
# The first 10 classes only (labels 0-9, a 10-way head), batch 32, 300
# iterations of SGD with a linear warm-up and a cosine decay instead of 300
# epochs with steps. The synthetic files are not the official ones:
# check_md5=False.
_base_ = '../kcla-r20_1xb128-300e_cifar100.py'

data_root = 'work_dirs/demo_cls/data'
num_classes = 10
max_iters = 300
warmup_iters = 30

data_preprocessor = dict(num_classes=num_classes)
model = dict(head=dict(num_classes=num_classes))

# Two CPU cores: load in the main process.
train_dataloader = dict(
    batch_size=32,
    num_workers=0,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(data_root=data_root, check_md5=False))
val_dataloader = dict(
    batch_size=100,
    num_workers=0,
    dataset=dict(data_root=data_root, check_md5=False))
test_dataloader = val_dataloader

optim_wrapper = dict(optimizer=dict(lr=0.05))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=warmup_iters),
    dict(type='CosineAnnealingLR', T_max=max_iters - warmup_iters, eta_min=0.0, by_epoch=False,
         begin=warmup_iters, end=max_iters)
]
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters,
                 val_interval=max_iters)
default_hooks = dict(
    logger=dict(interval=25, log_metric_by_epoch=False),
    checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=1))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
