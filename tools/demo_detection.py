"""End-to-end detection demo: synthetic data, training, evaluation, pictures.

Runs on a CPU in a few minutes:

1. writes the synthetic COCO-format shapes dataset
   (:mod:`kcla_mm.datasets.synthetic_coco`) to ``--data-root``;
2. trains the demo config (a small KCLA-ResNet-18 Faster R-CNN from scratch)
   with ``tools/train.py``;
3. evaluates the trained checkpoint with ``tools/test.py`` (COCO bbox AP) and
   draws its predictions next to the ground truth (``--show-dir``);
4. evaluates the same model at initialisation (random weights, the config's
   seed; ``tools/misc/init_checkpoint.py``) with ``tools/test.py``, to show
   that the AP comes from training;
5. prints both results side by side and writes them to ``summary.json``.

Everything goes to ``--work-dir`` (default ``work_dirs/demo_det``)::

    train/             training log and checkpoint (iter_<N>.pth)
    test/, untrained/  test logs (metrics in <timestamp>/<timestamp>.json)
    untrained/init.pth the initialised, untrained model
    vis/               the validation images: ground truth | prediction
    summary.json       APs and timings

Usage (from the repository root)::

    python tools/demo_detection.py
    python tools/demo_detection.py --max-iters 100 --num-train 200
"""
import argparse
import functools
import glob
import json
import os.path as osp
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from _demo_common import ROOT, child_env, read_test_metrics

TAG = 'demo_det'
test_metrics = functools.partial(read_test_metrics, tag=TAG)
DEFAULT_CONFIG = osp.join(ROOT, 'configs', 'kcla', 'demo', 'faster-rcnn_kcla-r18_fpn_synthetic.py')
#: metrics shown in the summary table when present (keys of mmdet's CocoMetric, after ``coco/``).
SHOWN_METRICS = ('bbox_mAP', 'bbox_mAP_50', 'bbox_mAP_75', 'bbox_mAP_s', 'bbox_mAP_m',
                 'segm_mAP', 'segm_mAP_50', 'segm_mAP_75')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--config', default=DEFAULT_CONFIG, help='demo config')
    parser.add_argument('--work-dir', default='work_dirs/demo_det')
    parser.add_argument('--data-root', default='data/synthetic_coco',
                        help='where the synthetic dataset is written')
    parser.add_argument('--num-train', type=int, default=400)
    parser.add_argument('--num-val', type=int, default=50)
    parser.add_argument('--size', type=int, default=128, help='image size in pixels')
    parser.add_argument('--seed', type=int, default=0, help='seed of the synthetic data')
    parser.add_argument('--max-iters', type=int, default=None,
                        help='training iterations (default: the config\'s)')
    parser.add_argument('--cfg-options', nargs='+', default=[],
                        help='extra key=value settings for both training and testing')
    return parser.parse_args(argv)


def data_options(data_root: str) -> List[str]:
    """``--cfg-options`` that point every dataloader and evaluator at ``data_root``."""
    root = data_root.rstrip('/') + '/'
    ann = root + 'annotations/instances_val2017.json'
    return [f'train_dataloader.dataset.data_root={root}',
            f'val_dataloader.dataset.data_root={root}',
            f'test_dataloader.dataset.data_root={root}',
            f'val_evaluator.ann_file={ann}', f'test_evaluator.ann_file={ann}']


def run(cmd: List[str], what: str) -> float:
    """Run a command with its output shown; its wall time in seconds."""
    print(f'\n=== {what}\n$ {" ".join(cmd)}', flush=True)
    start = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=child_env())
    return time.time() - start


def format_table(untrained: Dict[str, float], trained: Dict[str, float]) -> str:
    rows = [f'{"metric":<14}{"untrained":>11}{"trained":>11}']
    for key in SHOWN_METRICS:
        name = f'coco/{key}'
        if name not in trained:
            continue
        rows.append(f'{key:<14}{untrained.get(name, float("nan")):>11.3f}'
                    f'{trained.get(name, float("nan")):>11.3f}')
    return '\n'.join(rows)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    python = sys.executable
    work_dir = osp.abspath(args.work_dir)
    data_root = osp.abspath(args.data_root)
    options = data_options(data_root) + list(args.cfg_options)
    train_options = list(options)
    if args.max_iters is not None:
        train_options += [f'train_cfg.max_iters={args.max_iters}',
                          f'train_cfg.val_interval={args.max_iters}',
                          f'default_hooks.checkpoint.interval={args.max_iters}']
    timings = {}

    timings['data'] = run(
        [python, '-m', 'kcla_mm.datasets.synthetic_coco', '--out', data_root,
         '--num-train', str(args.num_train), '--num-val', str(args.num_val),
         '--size', str(args.size), '--seed', str(args.seed)], 'synthetic data')

    train_dir = osp.join(work_dir, 'train')
    timings['train'] = run(
        [python, osp.join(ROOT, 'tools', 'train.py'), args.config, '--work-dir', train_dir,
         '--cfg-options', *train_options], 'training')
    with open(osp.join(train_dir, 'last_checkpoint')) as f:
        checkpoint = f.read().strip()

    test_dir, vis_dir = osp.join(work_dir, 'test'), osp.join(work_dir, 'vis')
    timings['test'] = run(
        [python, osp.join(ROOT, 'tools', 'test.py'), args.config, checkpoint,
         '--work-dir', test_dir, '--show-dir', vis_dir, '--cfg-options', *options],
        'evaluation of the trained model')
    trained = test_metrics(test_dir)

    untrained_dir = osp.join(work_dir, 'untrained')
    init_checkpoint = osp.join(untrained_dir, 'init.pth')
    timings['init'] = run(
        [python, osp.join(ROOT, 'tools', 'misc', 'init_checkpoint.py'), args.config,
         init_checkpoint, '--cfg-options', *options], 'untrained model (iteration 0)')
    timings['test_untrained'] = run(
        [python, osp.join(ROOT, 'tools', 'test.py'), args.config, init_checkpoint,
         '--work-dir', untrained_dir, '--cfg-options', *options],
        'evaluation of the untrained model')
    untrained = test_metrics(untrained_dir)

    summary = dict(config=args.config, checkpoint=checkpoint, untrained=untrained,
                   trained=trained, seconds={k: round(v, 1) for k, v in timings.items()},
                   visualisations=vis_dir)
    with open(osp.join(work_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    images = sorted(glob.glob(osp.join(vis_dir, '*.jpg')) + glob.glob(osp.join(vis_dir, '*.png')))
    print(f'\n=== {osp.basename(args.config)}: COCO AP on {args.num_val} validation images '
          f'of the synthetic shapes\n{format_table(untrained, trained)}\n'
          f'training: {timings["train"]:.0f} s (tools/train.py wall time); '
          f'checkpoint {checkpoint}\n{len(images)} visualisations (ground truth | prediction) '
          f'in {vis_dir}\nsummary: {osp.join(work_dir, "summary.json")}', flush=True)
    return summary


if __name__ == '__main__':
    main()
