"""Train a model of any OpenMMLab 2.x config with kcla_mm loaded.

The same script serves mmdet and mmseg configs: mmengine's ``Runner`` builds
everything from the config and the config's ``default_scope`` decides which
library's registries resolve the types. ``import kcla_mm`` registers the
kcla_mm components in both; ``import kcla_mm.host_fixes`` makes checkpoint
loading (``load_from``, ``--resume``, ``init_cfg=dict(type='Pretrained')``)
safe, checkpoint saving atomic and ``--launcher pytorch`` work on CPU.

Examples::

    python tools/train.py configs/kcla/faster-rcnn_kcla-r50_fpn_1x_coco.py
    python tools/train.py CONFIG --work-dir work_dirs/run1 --resume
    python tools/train.py CONFIG --cfg-options train_dataloader.batch_size=4
"""
import argparse
import logging
from typing import Optional, Sequence

from mmengine.config import Config
from mmengine.logging import print_log

import kcla_mm  # noqa: F401  (registers the components)
import kcla_mm.host_fixes  # noqa: F401  (safe loading, atomic saving, CPU distributed)
from kcla_mm.utils.dist import shutdown_distributed
from kcla_mm.utils.runner_cli import (add_runner_args, build_runner, load_runner_config,
                                      parse_runner_args)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a model (mmdet or mmseg config)')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--amp', action='store_true',
                        help='enable automatic mixed precision training (needs a GPU)')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the learning rate by the total batch size '
                        '(the config\'s auto_scale_lr.base_batch_size)')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from this checkpoint; without a path, from the latest '
                        'checkpoint in the work dir')
    add_runner_args(parser, 'the dir to save logs and models',
                    'train_cfg.max_iters=100 model.backbone.depth=101')
    return parse_runner_args(parser, argv)


def build_config(args: argparse.Namespace) -> Config:
    """The config of ``args.config`` with the command-line settings applied."""
    cfg = load_runner_config(args)
    if args.amp:
        if cfg.optim_wrapper.get('type') == 'AmpOptimWrapper':
            print_log('AMP training is already enabled in the config.', logger='current',
                      level=logging.WARNING)
        else:
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'
    if args.auto_scale_lr:
        if 'base_batch_size' not in cfg.get('auto_scale_lr', {}):
            raise RuntimeError('--auto-scale-lr needs auto_scale_lr=dict(base_batch_size=...) '
                               f'in the config {args.config}')
        cfg.auto_scale_lr.enable = True
    # resume: an explicit checkpoint > the latest one in the work dir
    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    runner = build_runner(build_config(args))
    try:
        runner.train()
    finally:
        shutdown_distributed()


if __name__ == '__main__':
    main()
