"""Train a config with several seeds, test each best checkpoint, report mean ± std.

The medical segmentation papers KCLA compares with report every score as the
mean ± standard deviation of several runs (the EGE-UNet protocol: 5 runs).
This tool trains ``CONFIG`` once per seed (``randomness.seed=SEED``), each in
``WORK_DIR/seed_SEED``, takes the best checkpoint the config keeps
(``default_hooks.checkpoint.save_best``, chosen on the val split), evaluates
it on the config's test split with ``tools/test.py``, and prints a table of
every metric as mean ± std over the runs, with ``WORK_DIR/multi_run.json``
beside it. ``--gather DIR ...`` skips training and evaluates the best
checkpoints of finished work dirs instead.

The standard deviation is the sample one (``n - 1`` in the denominator). If
the config's test split is its val split (the paper protocol, which selects
and reports on the same images), the table says so: for scores on images that
took no part in selection, use a held-out config (``configs/unet/heldout/``).

Examples::

    python tools/analysis_tools/multi_run.py \\
        configs/unet/heldout/unet_kcla-r34_1xb8-300e_kvasir-seg-heldout-256x256.py \\
        --seeds 0 1 2 3 4 --work-dir work_dirs/kvasir_heldout_5runs
    python tools/analysis_tools/multi_run.py CONFIG --gather work_dirs/run_a work_dirs/run_b
"""
import argparse
import glob
import importlib.util
import json
import math
import os
import os.path as osp
from typing import Dict, List, Optional, Sequence

import numpy as np
from mmengine.config import Config, DictAction

TOOLS = osp.dirname(osp.dirname(osp.abspath(__file__)))
#: Metrics first in the table, in this order; any others follow alphabetically.
LEADING_METRICS = ('fg_IoU', 'fg_DSC', 'fg_Acc', 'fg_Sen', 'fg_Spe', 'img_mDice', 'img_mIoU')


def load_tool(name: str):
    """``tools/NAME.py`` as a module (the tools directory is not a package)."""
    spec = importlib.util.spec_from_file_location(f'kcla_tools_{name}',
                                                  osp.join(TOOLS, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_checkpoint(work_dir: str, pattern: str = 'best_*.pth') -> str:
    """The one checkpoint of ``work_dir`` matching ``pattern``.

    Raises:
        FileNotFoundError: none matches (the config keeps no best checkpoint).
        ValueError: several match; ``pattern`` must pick one.
    """
    found = sorted(glob.glob(osp.join(work_dir, pattern)))
    if not found:
        raise FileNotFoundError(
            f'no checkpoint {pattern!r} in {work_dir}: the config must keep the best one '
            "(default_hooks.checkpoint.save_best='fg_DSC'), or pass --checkpoint PATTERN")
    if len(found) > 1:
        names = ', '.join(osp.basename(f) for f in found)
        raise ValueError(f'{len(found)} checkpoints {pattern!r} in {work_dir} ({names}); pass '
                         '--checkpoint PATTERN to choose one')
    return found[0]


def summarize(runs: Sequence[Dict[str, float]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Mean and sample standard deviation of each metric present in every run.

    Args:
        runs: the metrics of each run.

    Returns:
        ``{metric: {'mean', 'std', 'n'}}``; ``std`` is ``None`` for one run,
        and a metric that is NaN in some run gets ``None`` for both.
    """
    if not runs:
        raise ValueError('no runs to summarize')
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    summary: Dict[str, Dict[str, Optional[float]]] = {}
    for key in order_metrics(keys):
        values = np.array([float(r[key]) for r in runs])
        finite = bool(np.isfinite(values).all())
        mean = float(values.mean()) if finite else None
        std = float(values.std(ddof=1)) if finite and len(values) > 1 else None
        summary[key] = dict(mean=mean, std=std, n=len(values))
    return summary


def order_metrics(keys: Sequence[str]) -> List[str]:
    """``LEADING_METRICS`` first, then the rest alphabetically."""
    lead = [k for k in LEADING_METRICS if k in keys]
    return lead + sorted(k for k in keys if k not in LEADING_METRICS)


def format_table(labels: Sequence[str], runs: Sequence[Dict[str, float]],
                 summary: Dict[str, Dict[str, Optional[float]]]) -> str:
    """One row per metric: ``mean ± std`` and the value of each run."""

    def num(value: Optional[float]) -> str:
        return 'nan' if value is None or not math.isfinite(value) else f'{value:.2f}'

    header = ['metric', 'mean ± std'] + list(labels)
    rows = [header]
    for key, stats in summary.items():
        cell = f'{num(stats["mean"])} ± {num(stats["std"])}'
        rows.append([key, cell] + [num(float(run[key])) for run in runs])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ['  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)


def split_of(loader: dict) -> str:
    """The image folder a dataloader of a kcla_mm medical config reads."""
    dataset = loader.get('dataset', {})
    prefix = dataset.get('data_prefix', {}).get('img_path', '?')
    return osp.join(str(dataset.get('data_root', '')), str(prefix))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n')[0], epilog=__doc__.split('\n\n', 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('config', help='mmseg config (e.g. configs/unet/heldout/...)')
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2, 3, 4],
                        help='train one run per seed (default 0 1 2 3 4: the 5 runs of the '
                        'EGE-UNet protocol)')
    source.add_argument('--gather', nargs='+', metavar='WORK_DIR',
                        help='do not train: evaluate the best checkpoint of these work dirs')
    parser.add_argument('--work-dir', help='parent of the runs\' work dirs and of '
                        'multi_run.json (default work_dirs/multi_run/CONFIG_NAME)')
    parser.add_argument('--checkpoint', default='best_*.pth',
                        help='file pattern of the checkpoint to test in each run\'s work dir '
                        '(default best_*.pth)')
    parser.add_argument('--cfg-options', nargs='+', default=[], metavar='KEY=VALUE',
                        help='settings merged into the config for training and testing, as '
                        'tools/train.py takes them, e.g. train_cfg.max_epochs=100')
    parser.add_argument('--trust-checkpoint', action='store_true',
                        help='passed to tools/test.py (load checkpoints with pickle)')
    args = parser.parse_args(argv)
    if not osp.isfile(args.config):
        parser.error(f'config {args.config} does not exist')
    if args.gather:
        missing = [d for d in args.gather if not osp.isdir(d)]
        if missing:
            parser.error(f'--gather: not a directory: {", ".join(missing)}')
    elif len(set(args.seeds)) != len(args.seeds):
        parser.error(f'--seeds must differ, got {args.seeds}')
    if args.work_dir is None:
        name = osp.splitext(osp.basename(args.config))[0]
        args.work_dir = osp.join('work_dirs', 'multi_run', name)
    return args


def parse_cfg_options(options: Sequence[str]) -> Dict:
    """``KEY=VALUE`` strings parsed as ``tools/train.py`` parses its ``--cfg-options``."""
    parser = argparse.ArgumentParser(prog='--cfg-options')
    parser.add_argument('options', nargs='*', action=DictAction)
    return parser.parse_args(list(options)).options or {}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run (or gather) the runs; returns what ``multi_run.json`` holds."""
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    cfg.merge_from_dict(parse_cfg_options(args.cfg_options))
    test_split, val_split = split_of(cfg.test_dataloader), split_of(cfg.val_dataloader)
    held_out = test_split != val_split
    options = list(args.cfg_options)
    name = osp.splitext(osp.basename(args.config))[0]
    train_tool, test_tool = load_tool('train'), load_tool('test')

    if args.gather:
        jobs = [(osp.basename(osp.normpath(d)), None, d) for d in args.gather]
    else:
        jobs = [(f'seed {s}', s, osp.join(args.work_dir, f'seed_{s}')) for s in args.seeds]
    runs = []
    for label, seed, work_dir in jobs:
        if seed is not None:
            print(f'[multi_run] training {label} in {work_dir}', flush=True)
            train_tool.main([args.config, '--work-dir', work_dir, '--cfg-options'] + options
                            + [f'randomness.seed={seed}', f'experiment_name={name}_seed{seed}'])
        checkpoint = best_checkpoint(work_dir, args.checkpoint)
        print(f'[multi_run] testing {checkpoint} on {test_split}', flush=True)
        test_argv = [args.config, checkpoint, '--work-dir', osp.join(work_dir, 'test'),
                     '--cfg-options'] + options + [f'experiment_name={name}_{label}_test'
                                                   .replace(' ', '')]
        if args.trust_checkpoint:
            test_argv.append('--trust-checkpoint')
        metrics = test_tool.main(test_argv)
        runs.append(dict(label=label, seed=seed, work_dir=work_dir, checkpoint=checkpoint,
                         metrics={k: float(v) for k, v in metrics.items()
                                  if isinstance(v, (int, float))}))

    summary = summarize([r['metrics'] for r in runs])
    result = dict(config=args.config, test_split=test_split, val_split=val_split,
                  held_out=held_out, std='sample standard deviation (n - 1)', runs=runs,
                  summary=summary)
    os.makedirs(args.work_dir, exist_ok=True)
    out = osp.join(args.work_dir, 'multi_run.json')
    with open(out, 'w') as f:
        json.dump(result, f, indent=2)
    print(f'\n{name}: {len(runs)} runs, best checkpoint of each (chosen on {val_split}) '
          f'tested on {test_split}')
    if not held_out:
        print('NOTE: the test split is the val split the checkpoints were chosen on (the paper '
              'protocol); these are not held-out scores.')
    print(format_table([r['label'] for r in runs], [r['metrics'] for r in runs], summary))
    print(f'(std: sample standard deviation; written to {out})')
    return result


if __name__ == '__main__':
    main()
