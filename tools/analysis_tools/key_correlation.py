"""Cosine similarity of the layer-attention keys of all blocks of a backbone.

KCLA rests on the observation that the keys ``k_t = Wk(GAP(x_t))`` of
different blocks are nearly collinear (``docs/method.md``, section 3). This tool runs the
backbone of a config (with a checkpoint, or at its initialisation) on images,
collects every block's key per head and writes:

* ``key_correlation.png``: heatmap of the mean cosine similarity of keys
  between every pair of blocks, stage boundaries marked;
* ``key_correlation.csv``: the matrix, with block names as header and index;
* ``key_correlation.json``: the matrix, the blocks, the summary and the inputs;

and prints one summary line (mean off-diagonal cosine within each stage, over
all within-stage pairs and across stages).

The cosine is taken per image and per head, then averaged. Blocks of
different stages have different head counts; head ``g`` of the block with
more heads is compared with the head(s) covering the same relative channel
span of the other block (``g // 2`` across a stage transition, as KCLA's
grouped ``adjust`` convolution maps them). Works for KCLA, FullLayerAttention
and MRLALight backbones (each has ``Wk``).

Examples::

    python tools/analysis_tools/key_correlation.py CONFIG work_dirs/x/iter_300.pth \\
        --images data/synthetic_coco/val2017 --size 128 --out-dir work_dirs/analysis
    python tools/analysis_tools/key_correlation.py CONFIG --synthetic 16   # untrained
"""
import argparse
import csv
import json
import os.path as osp
import sys
from typing import Optional, Sequence

from mmengine.utils import ProgressBar

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from _common import (add_image_args, add_model_args, build_backbone, image_source,  # noqa: E402
                     load_backbone_checkpoint, load_config, make_out_dir)

from kcla_mm.analysis import (backbone_method, collect_keys, correlation_summary,  # noqa: E402
                              key_cosine_matrix, plot_key_correlation, summary_line)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0] + ' Writes key_correlation.{png,csv,json} '
        'to --out-dir and prints a summary line.',
        epilog=__doc__[__doc__.index('The cosine'):],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_image_args(parser)
    return parser.parse_args(argv)


def _fmt(value: Optional[float]) -> str:
    return 'n/a' if value is None else f'{value:.2f}'


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the analysis; returns what ``key_correlation.json`` holds."""
    args = parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    backbone = build_backbone(cfg, device=args.device)
    loaded = 'none (the model at its initialisation)'
    if args.checkpoint:
        loaded = load_backbone_checkpoint(backbone, args.checkpoint, args.config,
                                          trust=args.trust_checkpoint)
    try:
        method = backbone_method(backbone)
    except ValueError as e:
        raise SystemExit(f'{args.config}: {e}') from None
    batches, count, images = image_source(args, cfg)
    print(f'{method} backbone of {args.config}; checkpoint: {loaded}; {images}')
    bar = ProgressBar(count, file=sys.stdout)
    blocks, keys = collect_keys(backbone, batches(), progress=bar.update)
    print()
    matrix = key_cosine_matrix(keys)
    summary = correlation_summary(matrix, blocks)
    line = summary_line(summary)

    out = make_out_dir(args.out_dir)
    names = [b.name for b in blocks]
    with open(osp.join(out, 'key_correlation.csv'), 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(['block'] + names)
        for name, row in zip(names, matrix):
            writer.writerow([name] + [f'{v:.6f}' for v in row])
    result = dict(config=args.config, checkpoint=args.checkpoint, method=method,
                  images=images, num_images=count, blocks=names,
                  num_heads=[b.num_heads for b in blocks], head_dim=blocks[0].head_dim,
                  matrix=matrix.tolist(), summary=summary, summary_line=line)
    with open(osp.join(out, 'key_correlation.json'), 'w') as f:
        json.dump(result, f, indent=1)
    title = (f'{method}: {osp.basename(args.config)}, '
             f'{osp.basename(args.checkpoint) if args.checkpoint else "initialisation"}\n'
             f'mean off-diagonal cosine: within stages {_fmt(summary["within"])}, '
             f'across stages {_fmt(summary["across"])}')
    plot_key_correlation(matrix, blocks, osp.join(out, 'key_correlation.png'), title)
    print(line)
    print(f'wrote key_correlation.png, .csv and .json to {out}')
    return result


if __name__ == '__main__':
    main()
