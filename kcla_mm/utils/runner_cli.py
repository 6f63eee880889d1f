"""The command line that ``tools/train.py`` and ``tools/test.py`` share.

Both tools build mmengine's ``Runner`` from any OpenMMLab 2.x config (mmdet or
mmseg: the config's ``default_scope`` picks the registries) and take the same
runner options, as the hosts' own tools do: ``--work-dir``,
``--trust-checkpoint``, ``--cfg-options``, ``--launcher`` and the
``--local-rank`` that ``torch.distributed`` launchers pass.
"""
import argparse
import os
import os.path as osp
from typing import Optional, Sequence

from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS, init_default_scope
from mmengine.runner import Runner

from kcla_mm.utils.checkpoint import TRUST_ENV


def add_runner_args(parser: argparse.ArgumentParser, work_dir_help: str,
                    cfg_options_example: str) -> None:
    """The options both tools take (positional arguments are the tool's own)."""
    parser.add_argument('--work-dir', help=work_dir_help)
    parser.add_argument('--trust-checkpoint', action='store_true',
                        help=f'load checkpoints with pickle (sets {TRUST_ENV}=1). Loading a '
                        'pickle can run arbitrary code: only for files you trust')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override settings of the config, key=value pairs merged into '
                        f'it, e.g. {cfg_options_example}; a list is written key="[a,b]" or '
                        'key=a,b (quotes needed, no spaces)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    # torch.distributed launchers pass --local-rank (torch >= 2) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def parse_runner_args(parser: argparse.ArgumentParser,
                      argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse; ``LOCAL_RANK`` comes from ``--local-rank`` where the launcher did not set it."""
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    if args.trust_checkpoint:
        os.environ[TRUST_ENV] = '1'
    return args


def load_runner_config(args: argparse.Namespace) -> Config:
    """``args.config`` with the launcher, ``--cfg-options`` and the work dir applied.

    The work dir: ``--work-dir`` > the config's ``work_dir`` >
    ``./work_dirs/<config name>``.
    """
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    return cfg


def build_runner(cfg: Config) -> Runner:
    """The default ``Runner``, or the config's ``runner_type`` from its scope."""
    if 'runner_type' not in cfg:
        return Runner.from_cfg(cfg)
    # A custom runner type lives in the registry of the config's library.
    init_default_scope(cfg.get('default_scope', 'mmengine'))
    return RUNNERS.build(cfg)
