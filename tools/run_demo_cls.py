"""Classification demo: train and evaluate KCLA CIFAR-ResNet-20 on synthetic CIFAR-100 data.

Runs on a CPU in a few minutes, with the same tools a user runs on the real
data:

1. ``python -m kcla_mm.datasets.synthetic_cls cifar100`` writes synthetic
   files in the official ``cifar-100-python/`` layout (the first ``--classes``
   classes);
2. ``tools/train.py`` trains the demo config (the CIFAR-100 KCLA-R20 config
   with a ``--classes``-way head, batch 32, a few hundred iterations);
3. ``tools/misc/init_checkpoint.py`` saves the same model untrained (its
   initial weights, the training seed);
4. ``tools/test.py`` evaluates both on the synthetic test split; their top-1
   and top-5 accuracies are printed side by side with chance level.

Usage::

    python tools/run_demo_cls.py [--work-dir work_dirs/demo_cls] [--iters 300] [--classes 10]
"""
import argparse
import functools
import json
import os
import os.path as osp
import shutil
import sys
from typing import List, Optional, Sequence

from _demo_common import ROOT, child_env, read_test_metrics, run_step

CONFIG = osp.join(ROOT, 'configs', 'kcla_resnet', 'demo',
                  'kcla-r20_1xb32-300i_synthetic-cifar100.py')
METRICS = ('accuracy/top1', 'accuracy/top5')
TAG = 'demo_cls'
test_metrics = functools.partial(read_test_metrics, tag=TAG)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='KCLA CIFAR-ResNet-20 demo on synthetic CIFAR-100 data')
    parser.add_argument('--work-dir', default='work_dirs/demo_cls',
                        help='everything is written here (default work_dirs/demo_cls)')
    parser.add_argument('--config', default=CONFIG, help='demo config')
    parser.add_argument('--classes', type=int, default=10,
                        help='classes used, 5 to 100 (default 10): labels 0..classes-1 and '
                        'a head of that many outputs')
    parser.add_argument('--num-train', type=int, default=200,
                        help='training images per class (default 200)')
    parser.add_argument('--num-test', type=int, default=50,
                        help='test images per class (default 50)')
    parser.add_argument('--iters', type=int, default=None,
                        help='training iterations (default: the config\'s max_iters)')
    parser.add_argument('--seed', type=int, default=0, help='data and training seed')
    parser.add_argument('--python', default=sys.executable, help='interpreter for the tools')
    args = parser.parse_args(argv)
    if not 5 <= args.classes <= 100:  # top-5 accuracy needs at least 5 classes
        parser.error(f'--classes must be in 5..100, got {args.classes}')
    return args


def config_options(data: str, classes: int, seed: int, iters: Optional[int]) -> List[str]:
    """``--cfg-options`` of every step: the data, the classes, the seed and the schedule."""
    opts = [f'{loader}.dataset.data_root={data}'
            for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    opts += [f'model.head.num_classes={classes}', f'data_preprocessor.num_classes={classes}',
             f'randomness.seed={seed}']
    if iters is not None:
        # the config's warm-up (a tenth of the schedule) and cosine decay, over ``iters``
        warmup = max(1, iters // 10)
        opts += [f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
                 f'default_hooks.checkpoint.interval={iters}',
                 f'param_scheduler.0.end={warmup}', f'param_scheduler.1.begin={warmup}',
                 f'param_scheduler.1.T_max={iters - warmup}', f'param_scheduler.1.end={iters}']
    return opts


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    work = osp.abspath(args.work_dir)
    data = osp.join(work, 'data')
    os.makedirs(work, exist_ok=True)
    shutil.rmtree(data, ignore_errors=True)
    py, env = args.python, child_env()
    step = functools.partial(run_step, tag=TAG, env=env)
    timings = {}
    timings['generate'] = step('synthetic CIFAR-100', [
        py, '-m', 'kcla_mm.datasets.synthetic_cls', 'cifar100', '--out', data,
        '--classes', str(args.classes), '--num-train', str(args.num_train),
        '--num-test', str(args.num_test), '--seed', str(args.seed)
    ], osp.join(work, 'generate.log'))

    opts = config_options(data, args.classes, args.seed, args.iters)
    train_dir = osp.join(work, 'train')
    shutil.rmtree(train_dir, ignore_errors=True)
    timings['train'] = step('train', [py, 'tools/train.py', args.config, '--work-dir', train_dir,
                                      '--cfg-options'] + opts, osp.join(work, 'train.log'))
    with open(osp.join(train_dir, 'last_checkpoint')) as f:
        trained = f.read().strip()
    untrained = osp.join(work, 'untrained.pth')
    timings['init'] = step('untrained model (iteration 0)', [
        py, 'tools/misc/init_checkpoint.py', args.config, untrained, '--cfg-options'] + opts,
        osp.join(work, 'init.log'))

    results = {}
    for name, ckpt in (('untrained', untrained), ('trained', trained)):
        test_dir = osp.join(work, f'test_{name}')
        shutil.rmtree(test_dir, ignore_errors=True)
        timings[f'test_{name}'] = step(f'test ({name})', [
            py, 'tools/test.py', args.config, ckpt, '--work-dir', test_dir, '--cfg-options'
        ] + opts, osp.join(work, f'test_{name}.log'))
        results[name] = test_metrics(test_dir)

    chance = {'accuracy/top1': 100 / args.classes, 'accuracy/top5': 500 / args.classes}
    print(f'\n[{TAG}] synthetic CIFAR-100 test split ({args.classes} classes, '
          f'{args.num_test * args.classes} images), KCLA CIFAR-ResNet-20')
    print('  model       ' + '  '.join(f'{m.split("/")[-1]:>6}' for m in METRICS))
    for name, metrics in list(results.items()) + [('chance', chance)]:
        print(f'  {name:<10}  ' + '  '.join(f'{metrics[m]:6.2f}' for m in METRICS))
    print('  (top-1/top-5 accuracy in %; chance: a uniform guess)')
    print('  timings: ' + ', '.join(f'{k} {v:.0f} s' for k, v in timings.items()))
    summary = dict(results=results, chance=chance, timings=timings, classes=args.classes)
    with open(osp.join(work, 'results.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    return summary


if __name__ == '__main__':
    main()
