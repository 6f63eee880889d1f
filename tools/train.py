"""Train a model of any OpenMMLab 2.x config with kcla_mm loaded.

The same script serves mmdet and mmseg configs: mmengine's ``Runner`` builds
everything from the config and the config's ``default_scope`` decides which
library's registries resolve the types. ``import kcla_mm`` registers the
kcla_mm components in both and makes checkpoint loading (``load_from``,
``--resume``, ``init_cfg=dict(type='Pretrained')``) safe.

Examples::

    python tools/train.py configs/kcla/faster-rcnn_kcla-r50_fpn_1x_coco.py
    python tools/train.py CONFIG --work-dir work_dirs/run1 --resume
    python tools/train.py CONFIG --cfg-options train_dataloader.batch_size=4
"""
import argparse
import logging
import os
import os.path as osp
from typing import Optional, Sequence

from mmengine.config import Config, DictAction
from mmengine.logging import print_log
from mmengine.registry import RUNNERS, init_default_scope
from mmengine.runner import Runner

import kcla_mm  # noqa: F401  (registers the components, installs the safe loader)
from kcla_mm.utils.checkpoint import TRUST_ENV
from kcla_mm.utils.dist import shutdown_distributed


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a model (mmdet or mmseg config)')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument('--amp', action='store_true',
                        help='enable automatic mixed precision training (needs a GPU)')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the learning rate by the total batch size '
                        '(the config\'s auto_scale_lr.base_batch_size)')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from this checkpoint; without a path, from the latest '
                        'checkpoint in the work dir')
    parser.add_argument('--trust-checkpoint', action='store_true',
                        help=f'load checkpoints with pickle (sets {TRUST_ENV}=1). Loading a '
                        'pickle can run arbitrary code: only for files you trust')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override settings of the config, key=value pairs merged into '
                        'it, e.g. train_cfg.max_iters=100 model.backbone.depth=101; a list '
                        'is written key="[a,b]" or key=a,b (quotes needed, no spaces)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    # torch.distributed launchers pass --local-rank (torch >= 2) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def build_config(args: argparse.Namespace) -> Config:
    """The config of ``args.config`` with the command-line settings applied."""
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    # work_dir: command line > config > ./work_dirs/<config name>
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
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


def build_runner(cfg: Config) -> Runner:
    """The default ``Runner``, or the config's ``runner_type`` from its scope."""
    if 'runner_type' not in cfg:
        return Runner.from_cfg(cfg)
    # A custom runner type lives in the registry of the config's library.
    init_default_scope(cfg.get('default_scope', 'mmengine'))
    return RUNNERS.build(cfg)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.trust_checkpoint:
        os.environ[TRUST_ENV] = '1'
    runner = build_runner(build_config(args))
    try:
        runner.train()
    finally:
        shutdown_distributed()


if __name__ == '__main__':
    main()
