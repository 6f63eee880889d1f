"""Segmentation demo: train and evaluate a KCLA-ResNet-UNet on synthetic Kvasir-SEG data.

Runs on a CPU in a few minutes, with the same tools a user runs on the real
data:

1. ``python -m kcla_mm.datasets.synthetic_medical --layout kvasir`` writes a
   download-shaped Kvasir-SEG folder (JPEG masks);
2. ``tools/dataset_converters/kvasir_seg.py`` converts it (seeded 7:3 split);
3. ``tools/train.py`` trains the demo config (a tiny KCLA-ResNet-18 UNet,
   the paper's protocol at 128x128 for a few hundred iterations);
4. ``tools/test.py`` evaluates the trained model and, for comparison, the
   same model untrained (its initial weights), printing foreground IoU/DSC
   (and mmseg's mIoU/mDice); overlays of the trained model's predictions go
   to ``WORK_DIR/overlays/``.

Usage::

    python tools/run_demo_seg.py [--work-dir work_dirs/demo_seg] [--iters 300]
"""
import argparse
import functools
import glob
import json
import os
import os.path as osp
import shutil
import sys
import warnings
from typing import Optional, Sequence

from _demo_common import ROOT, read_test_metrics, run_step

CONFIG = osp.join(ROOT, 'configs', 'unet',
                  'unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py')
METRICS = ('fg_IoU', 'fg_DSC', 'mIoU', 'mDice')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='KCLA-ResNet-UNet demo on synthetic Kvasir-SEG')
    parser.add_argument('--work-dir', default='work_dirs/demo_seg',
                        help='everything is written here (default work_dirs/demo_seg)')
    parser.add_argument('--config', default=CONFIG, help='demo config')
    parser.add_argument('--num', type=int, default=200, help='synthetic image/mask pairs')
    parser.add_argument('--size', type=int, default=128, help='synthetic image height')
    parser.add_argument('--iters', type=int, default=None,
                        help='training iterations (default: the config\'s max_iters)')
    parser.add_argument('--seed', type=int, default=0, help='data and training seed')
    parser.add_argument('--python', default=sys.executable, help='interpreter for the tools')
    return parser.parse_args(argv)


TAG = 'demo_seg'
step = functools.partial(run_step, tag=TAG)
test_metrics = functools.partial(read_test_metrics, tag=TAG)


def save_untrained(config: str, out: str, seed: int) -> None:
    """The demo model with its initial weights, as a checkpoint ``tools/test.py`` loads."""
    import torch
    from mmengine.config import Config
    from mmengine.logging import MMLogger
    from mmengine.registry import DefaultScope
    from mmengine.runner import set_random_seed
    from mmseg.registry import MODELS

    import kcla_mm  # noqa: F401
    import kcla_mm.host_fixes  # noqa: F401
    MMLogger.get_instance('demo_seg', log_level='WARNING')  # no per-parameter init report
    cfg = Config.fromfile(config)
    set_random_seed(seed)
    with DefaultScope.overwrite_default_scope('mmseg'), warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)  # mmseg's deprecation notes
        model = MODELS.build(cfg.model)
    model.init_weights()
    torch.save(dict(state_dict=model.state_dict(), meta=dict(note='untrained demo model')), out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    work = osp.abspath(args.work_dir)
    download, data = osp.join(work, 'download'), osp.join(work, 'data')
    os.makedirs(work, exist_ok=True)
    shutil.rmtree(download, ignore_errors=True)
    py = args.python
    timings = {}
    timings['generate'] = step('synthetic Kvasir-SEG download', [
        py, '-m', 'kcla_mm.datasets.synthetic_medical', '--layout', 'kvasir', '--out', download,
        '--num', str(args.num), '--size', str(args.size), '--seed', str(args.seed)
    ], osp.join(work, 'generate.log'))
    timings['convert'] = step('convert', [
        py, 'tools/dataset_converters/kvasir_seg.py', download, '--out', data, '--overwrite',
        '--seed', str(args.seed)
    ], osp.join(work, 'convert.log'))

    data_cfg = [f'{loader}.dataset.data_root={data}'
                for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    train_opts = data_cfg + [f'randomness.seed={args.seed}']
    if args.iters is not None:
        train_opts += [f'train_cfg.max_iters={args.iters}', f'train_cfg.val_interval={args.iters}',
                       f'default_hooks.checkpoint.interval={args.iters}',
                       f'param_scheduler.0.T_max={args.iters}',
                       f'param_scheduler.0.end={args.iters}']
    train_dir = osp.join(work, 'train')
    shutil.rmtree(train_dir, ignore_errors=True)
    timings['train'] = step('train', [py, 'tools/train.py', args.config, '--work-dir', train_dir,
                                      '--cfg-options'] + train_opts,
                            osp.join(work, 'train.log'))
    with open(osp.join(train_dir, 'last_checkpoint')) as f:
        trained = f.read().strip()

    untrained = osp.join(work, 'untrained.pth')
    save_untrained(args.config, untrained, args.seed)
    results = {}
    for name, ckpt, extra in (
            ('untrained', untrained, []),
            ('trained', trained, ['--show-dir', osp.join(work, 'overlays')])):
        test_dir = osp.join(work, f'test_{name}')
        shutil.rmtree(test_dir, ignore_errors=True)
        opts = data_cfg + ['default_hooks.visualization.interval=1']
        timings[f'test_{name}'] = step(f'test ({name})', [
            py, 'tools/test.py', args.config, ckpt, '--work-dir', test_dir] + extra +
            ['--cfg-options'] + opts, osp.join(work, f'test_{name}.log'))
        results[name] = test_metrics(test_dir)

    print('\n[demo_seg] synthetic Kvasir-SEG val split, KCLA-ResNet-18 (tiny) UNet')
    print('  model       ' + '  '.join(f'{m:>7}' for m in METRICS))
    for name, metrics in results.items():
        print(f'  {name:<10}  ' + '  '.join(f'{metrics[m]:7.2f}' for m in METRICS))
    print('  (fg_IoU/fg_DSC: foreground, one confusion matrix over all pixels at 0.5; '
          'mIoU/mDice: mmseg, mean over both classes)')
    print('  timings: ' + ', '.join(f'{k} {v:.0f} s' for k, v in timings.items()))
    overlays = sorted(glob.glob(osp.join(work, 'overlays', '**', '*.png'), recursive=True))
    print(f'  {len(overlays)} overlays (left: ground truth, right: prediction) under '
          f'{osp.join(work, "overlays")}')
    with open(osp.join(work, 'results.json'), 'w') as f:
        json.dump(dict(results=results, timings=timings), f, indent=2)


if __name__ == '__main__':
    main()
