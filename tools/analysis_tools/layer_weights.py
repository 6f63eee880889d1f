"""Effective weight of every earlier block at every block, for three layer-attention methods.

For each block t and each earlier block s, the weight with which the output
of block s enters the aggregate that block t attends to, averaged over images:

* KCLA: ``w_s / sum w`` from the recurrent state (``w = exp(min(|k|/tau, 10))``).
  Through the stages the state passes init layers, which re-key the whole
  history as one pseudo-layer; that pseudo-layer's weight is split over the
  earlier blocks in proportion to their normalised weights before it (heads
  matched by channel span, the adjust/BatchNorm transform ignored: an
  approximation). Rows sum to 1.
* FullLayerAttention: its softmax over the blocks of the current stage (the
  history restarts at every stage). Rows sum to 1.
* MRLALight: ``|lambda_{s+1} ... lambda_t| * gate_s``, the coefficient of
  ``Wv(x_s)`` in the recurrence ``y_t = gate_t Wv(x_t) + lambda_t y_{t-1}``
  (restarted at every stage), averaged over channels; not normalised. It
  decays exponentially with t - s, whereas KCLA's weights do not.

The config's own method is analysed with CHECKPOINT. The other methods are
built from the same config with ``layer_attn`` swapped and only the ResNet part
of CHECKPOINT loaded (their layer-attention modules keep their
initialisation), unless ``--compare`` gives them their own config and
checkpoint.

Writes to --out-dir: ``layer_weights.png`` (the methods side by side, plus the
weights at the last block of the longest stage on a log axis),
``layer_weights.csv`` (method, t, s, head-averaged weight, for s <= t),
``layer_weights_per_head.csv`` (the same per head) and ``layer_weights.json``.

Examples::

    python tools/analysis_tools/layer_weights.py CONFIG work_dirs/x/iter_300.pth \\
        --images data/synthetic_coco/val2017 --size 128
    python tools/analysis_tools/layer_weights.py CONFIG_KCLA KCLA.pth \\
        --compare CONFIG_MRLA MRLA.pth --compare CONFIG_FULL FULL.pth
"""
import argparse
import csv
import json
import os.path as osp
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from mmengine.utils import ProgressBar

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from _common import (add_image_args, add_model_args, build_backbone, image_source,  # noqa: E402
                     load_backbone_checkpoint, load_config, make_out_dir)

from kcla_mm.analysis import METHODS, LayerWeights, backbone_method  # noqa: E402
from kcla_mm.analysis import layer_weights as compute_layer_weights  # noqa: E402
from kcla_mm.analysis import longest_stage_end, plot_layer_weights  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Effective layer weights of KCLA, FullLayerAttention and MRLALight for a '
        'config and checkpoint: one PNG with the three side by side, and the numbers as CSV.',
        epilog=__doc__[__doc__.index('For each block'):],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument(
        '--compare', nargs='+', action='append', default=[], metavar='PATH',
        help='CONFIG [CHECKPOINT] of another method, used instead of swapping that method '
        'into CONFIG; repeat for each method')
    parser.add_argument('--methods', nargs='+', default=list(METHODS), choices=METHODS,
                        metavar='METHOD',
                        help=f'methods to show, in this order: any of {", ".join(METHODS)} '
                        '(default: all three)')
    add_image_args(parser)
    args = parser.parse_args(argv)
    for c in args.compare:
        if len(c) > 2:
            parser.error(f'--compare takes CONFIG [CHECKPOINT], got {c}')
    return args


def _backbones(args: argparse.Namespace) -> Tuple[Dict[str, Tuple[object, str]], object]:
    """``{method: (backbone, description)}`` for the requested methods, and the main config."""
    cfg = load_config(args.config, args.cfg_options)
    out: Dict[str, Tuple[object, str]] = {}
    sources = [(args.config, args.checkpoint)] + [(c[0], c[1] if len(c) > 1 else None)
                                                  for c in args.compare]
    for i, (config, checkpoint) in enumerate(sources):
        c = cfg if i == 0 else load_config(config, args.cfg_options)
        backbone = build_backbone(c, device=args.device)
        if checkpoint:
            loaded = load_backbone_checkpoint(backbone, checkpoint, config,
                                              trust=args.trust_checkpoint)
        else:
            loaded = 'initialisation'
        try:
            method = backbone_method(backbone)
        except ValueError:
            if i > 0:
                raise SystemExit(f'--compare {config}: its backbone has no layer attention')
            continue  # a plain ResNet config: every method is swapped in below
        if method in out and i > 0:
            raise SystemExit(f'--compare {config}: {method} is given twice')
        out[method] = (backbone, f'{config}, {loaded}')
    for method in args.methods:
        if method in out:
            continue
        backbone = build_backbone(cfg, layer_attn=dict(type=method), device=args.device)
        loaded = 'initialisation'
        if args.checkpoint:
            loaded = load_backbone_checkpoint(backbone, args.checkpoint, args.config,
                                              strict=False, trust=args.trust_checkpoint)
        out[method] = (backbone, f'{args.config} with layer_attn={method}, {loaded}')
    return out, cfg


def _stage_summary(result: LayerWeights) -> str:
    """The weights at the last block of the longest stage, in words."""
    t = longest_stage_end(result.blocks)
    row = result.matrix[t]
    stage = result.blocks[t].stage
    first = next(b.index for b in result.blocks if b.stage == stage)
    earlier = float(row[:first].sum())
    return (f'{result.method:>18}: at {result.blocks[t].name} the stage\'s first block '
            f'{result.blocks[first].name} gets {row[first]:.3g}, the block itself {row[t]:.3g}, '
            f'all earlier stages {earlier:.3g}')


def _write_csv(results: List[LayerWeights], out: str) -> None:
    with open(osp.join(out, 'layer_weights.csv'), 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(['method', 't', 'block_t', 's', 'block_s', 'weight'])
        for r in results:
            m = r.matrix
            for bt in r.blocks:
                for bs in r.blocks[:bt.index + 1]:
                    writer.writerow([r.method, bt.index, bt.name, bs.index, bs.name,
                                     f'{m[bt.index, bs.index]:.6g}'])
    with open(osp.join(out, 'layer_weights_per_head.csv'), 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(['method', 't', 'block_t', 'head', 's', 'block_s', 'weight'])
        for r in results:
            for bt, w in zip(r.blocks, r.per_head):
                for g, row in enumerate(w):
                    for bs in r.blocks[:bt.index + 1]:
                        writer.writerow([r.method, bt.index, bt.name, g, bs.index, bs.name,
                                         f'{row[bs.index]:.6g}'])


def main(argv: Optional[Sequence[str]] = None) -> List[LayerWeights]:
    """Run the analysis; returns one :class:`LayerWeights` per method."""
    args = parse_args(argv)
    backbones, cfg = _backbones(args)
    batches, count, images = image_source(args, cfg)
    print(f'{images}; methods: {", ".join(args.methods)}')
    results = []
    for method in args.methods:
        backbone, what = backbones[method]
        print(f'{method}: {what}')
        bar = ProgressBar(count, file=sys.stdout)
        results.append(compute_layer_weights(backbone, batches(), progress=bar.update))
        print()
    out = make_out_dir(args.out_dir)
    _write_csv(results, out)
    with open(osp.join(out, 'layer_weights.json'), 'w') as f:
        json.dump(dict(config=args.config, checkpoint=args.checkpoint, images=images,
                       methods={r.method: dict(source=backbones[r.method][1],
                                               blocks=[b.name for b in r.blocks],
                                               weights=r.matrix.tolist(),
                                               through_pseudo=None if r.through_pseudo is None
                                               else r.through_pseudo.tolist())
                                for r in results}), f, indent=1)
    title = (f'effective weight of block s at block t: {osp.basename(args.config)}, '
             f'{osp.basename(args.checkpoint) if args.checkpoint else "initialisation"}')
    plot_layer_weights(results, osp.join(out, 'layer_weights.png'), title)
    for r in results:
        print(_stage_summary(r))
    print(f'wrote layer_weights.png, layer_weights.csv, layer_weights_per_head.csv and '
          f'layer_weights.json to {out}')
    return results


if __name__ == '__main__':
    main()
