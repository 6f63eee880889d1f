"""Test (and evaluate) a checkpoint of any OpenMMLab 2.x config with kcla_mm loaded.

The same script serves mmdet and mmseg configs: mmengine's ``Runner`` builds
everything from the config and the config's ``default_scope`` decides which
library's registries resolve the types. The few options whose meaning is
host-specific follow the host's own ``tools/test.py``:

- ``--show-dir``: mmdet (``DetVisualizationHook``) writes one image per test
  sample to ``work_dir/<timestamp>/SHOW_DIR`` (an absolute path is used as
  is); other scopes (mmseg) make ``SHOW_DIR`` the visualizer's save dir.
- ``--out``: a ``.pkl`` file receives the raw predictions (mmdet: the format
  of ``DumpDetResults``, masks RLE-encoded; other scopes: mmengine's
  ``DumpResults``). For mmseg a directory instead receives the predicted
  masks as PNG files (``IoUMetric(output_dir=...)``).

The metrics are logged and written to ``work_dir/<timestamp>/<timestamp>.json``.

A checkpoint whose tensors do not fit the model (another config's, another
width or number of classes) is an error listing every mismatched key with
both shapes, before anything is evaluated; mmengine alone would only warn
and evaluate a partly random model. ``--allow-shape-mismatch`` makes it a
warning (for a checkpoint known to differ, e.g. in its head).

Examples::

    python tools/test.py configs/kcla/faster-rcnn_kcla-r50_fpn_1x_coco.py epoch_12.pth
    python tools/test.py CONFIG CKPT --out results.pkl --show-dir vis
"""
import argparse
from typing import Optional, Sequence

from mmengine.config import Config
from mmengine.evaluator import DumpResults

import kcla_mm  # noqa: F401  (registers the components)
import kcla_mm.host_fixes  # noqa: F401  (safe loading, atomic saving, CPU distributed)
from kcla_mm.utils.dist import shutdown_distributed
from kcla_mm.utils.hooks import CheckpointShapeCheckHook
from kcla_mm.utils.runner_cli import (add_runner_args, build_runner, load_runner_config,
                                      parse_runner_args)

PICKLE_EXTENSIONS = ('.pkl', '.pickle')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Test a checkpoint (mmdet or mmseg config)')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out', help='dump the predictions: a .pkl file (any config) or, for '
                        'mmseg configs, a directory for the predicted masks')
    parser.add_argument('--show', action='store_true', help='show the predictions in a window')
    parser.add_argument('--show-dir', help='save images with the predictions drawn here '
                        '(mmdet: relative to work_dir/<timestamp>)')
    parser.add_argument('--wait-time', type=float, default=2,
                        help='seconds each image is shown with --show')
    parser.add_argument('--allow-shape-mismatch', action='store_true',
                        help='warn instead of failing when tensors of the checkpoint have other '
                        'shapes than the model\'s (those keep their initial values)')
    add_runner_args(parser, 'the dir to save logs and the metrics file',
                    'test_dataloader.batch_size=4')
    return parse_runner_args(parser, argv)


def enable_visualization(cfg: Config, show: bool, show_dir: Optional[str],
                         wait_time: float) -> None:
    """Turn on the config's visualization hook, the way its host library does."""
    hook = cfg.get('default_hooks', {}).get('visualization')
    if hook is None:
        raise RuntimeError('--show/--show-dir need a visualization hook in the config: '
                           'default_hooks=dict(visualization=dict(type=...))')
    hook['draw'] = True
    if show:
        hook['show'] = True
        hook['wait_time'] = wait_time
    if show_dir:
        if cfg.get('default_scope') == 'mmdet':
            hook['test_out_dir'] = show_dir
        else:
            cfg.visualizer['save_dir'] = show_dir


def _seg_metrics_with_output_dir(cfg: Config) -> list:
    evaluators = cfg.test_evaluator
    evaluators = evaluators if isinstance(evaluators, (list, tuple)) else [evaluators]
    return [e for e in evaluators if e.get('type') == 'IoUMetric']


def build_config(args: argparse.Namespace) -> Config:
    """The config of ``args.config`` with the command-line settings applied."""
    cfg = load_runner_config(args)
    cfg.load_from = args.checkpoint
    if args.show or args.show_dir:
        enable_visualization(cfg, args.show, args.show_dir, args.wait_time)
    if args.out is not None and not args.out.endswith(PICKLE_EXTENSIONS):
        metrics = _seg_metrics_with_output_dir(cfg) if cfg.get('default_scope') == 'mmseg' \
            else []
        if not metrics:
            raise ValueError(f'--out {args.out}: must be a .pkl file (a directory is accepted '
                             'only for mmseg configs with an IoUMetric test evaluator)')
        for metric in metrics:
            metric['output_dir'] = args.out
            metric['keep_results'] = True
    return cfg


def dump_metric(scope: Optional[str], out_file: str):
    """The metric that pickles the raw predictions, in the host's format."""
    if scope == 'mmdet':
        from mmdet.evaluation import DumpDetResults
        return DumpDetResults(out_file_path=out_file)
    return DumpResults(out_file_path=out_file)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the test; returns the metrics."""
    args = parse_args(argv)
    cfg = build_config(args)
    runner = build_runner(cfg)
    runner.register_hook(CheckpointShapeCheckHook(strict=not args.allow_shape_mismatch))
    if args.out is not None and args.out.endswith(PICKLE_EXTENSIONS):
        runner.test_evaluator.metrics.append(dump_metric(cfg.get('default_scope'), args.out))
    try:
        return runner.test()
    finally:
        shutdown_distributed()


if __name__ == '__main__':
    main()
