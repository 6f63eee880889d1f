"""Parameters and FLOPs of a detector or segmentor, its backbone and its layer attention.

Builds the model of CONFIG (no weights are loaded or downloaded: the counts do
not depend on them), traces one forward pass of a ``1 x 3 x H x W`` input in
eval mode with mmengine's ``FlopAnalyzer`` and reports, as a markdown table
(printed and written to ``--out-dir/get_flops.md``, with ``get_flops.json``):

* the whole model (detectors: backbone, neck, RPN and RoI heads on the RPN's
  proposals, as mmdet's own get_flops does; segmentors: backbone and heads);
* the backbone alone;
* its layer-attention modules (``layer{s}_attn.*``: the share of KCLA,
  FullLayerAttention or MRLALight), in total and per stage;
* the backbone without them.

FLOPs follow mmengine's convention: one multiply-add is one FLOP; BatchNorm,
interpolation and pooling are counted, activations are not. By default the
elementwise arithmetic (add, sub, mul, div, addcmul: 1 per output element;
lerp: 2) is counted as well, because layer attention aggregates with it (e.g.
FullLayerAttention's weighted sum over the stage's history); ``--no-elementwise``
gives mmengine's default count. A detector's RoI-head FLOPs depend on the
number of proposals the RPN keeps for the (random) input.

Example::

    python tools/analysis_tools/get_flops.py configs/kcla/CONFIG.py --shape 800 1216
"""
import argparse
import json
import math
import os.path as osp
import sys
from functools import partial
from typing import Any, List, Optional, Sequence, Tuple

import torch
from mmengine.config import DictAction
from mmengine.model import revert_sync_batchnorm
from mmengine.registry import MODELS
from torch import nn

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from _common import drop_pretrained, load_config, make_out_dir, quiet_logs  # noqa: E402

from kcla_mm.analysis import complexity_breakdown, flop_analyzer  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Parameters and FLOPs of the model of a config, of its backbone and of '
        'the backbone\'s layer attention.',
        epilog=__doc__[__doc__.index('FLOPs follow'):],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('config', help='a kcla_mm (mmdet or mmseg) config file')
    parser.add_argument('--shape', type=int, nargs='+', default=[224, 224], metavar='PX',
                        help='input H W (one number: square); rounded up to the data '
                        'preprocessor\'s size divisor; default 224 224')
    parser.add_argument('--no-elementwise', action='store_true',
                        help='do not count elementwise arithmetic (mmengine\'s default count)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help='override config settings, e.g. model.backbone.depth=101')
    parser.add_argument('--out-dir', default='work_dirs/analysis',
                        help='folder for get_flops.md and get_flops.json')
    args = parser.parse_args(argv)
    if len(args.shape) not in (1, 2) or min(args.shape) < 1:
        parser.error(f'--shape takes one or two positive numbers, got {args.shape}')
    return args


def padded_shape(cfg: Any, h: int, w: int) -> Tuple[int, int]:
    """``(H, W)`` rounded up to the data preprocessor's size divisor (if any)."""
    pre = cfg.model.get('data_preprocessor') or {}
    div = pre.get('pad_size_divisor') or pre.get('size_divisor') or 1
    return (math.ceil(h / div) * div, math.ceil(w / div) * div)


def forward_inputs(model: nn.Module, h: int, w: int) -> Tuple[nn.Module, str]:
    """Make ``model(x)`` run the tensor-mode forward of a detector or segmentor.

    Returns:
        ``(model, kind)`` with ``kind`` one of ``detector``, ``segmentor``, ``model``.
    """
    meta = dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w),
                batch_input_shape=(h, w), scale_factor=(1.0, 1.0))
    kind, sample = 'model', None
    try:
        from mmdet.models.detectors import BaseDetector
        from mmdet.structures import DetDataSample
        if isinstance(model, BaseDetector):
            kind, sample = 'detector', DetDataSample(metainfo=meta)
    except ImportError:
        pass
    try:
        from mmseg.models.segmentors import BaseSegmentor
        from mmseg.structures import SegDataSample
        if isinstance(model, BaseSegmentor):
            kind, sample = 'segmentor', SegDataSample(metainfo=meta)
    except ImportError:
        pass
    if sample is not None:
        model.forward = partial(model.forward, data_samples=[sample], mode='tensor')
    return model, kind


def _fmt(n: int, unit: str) -> str:
    for scale, suffix in ((1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
        if abs(n) >= scale:
            return f'{n / scale:.3f} {suffix}{unit}'
    return f'{n} {unit}'.rstrip()


def table(rows: List[dict]) -> str:
    """The breakdown as a markdown table, shares relative to the first row."""
    top = rows[0]
    lines = ['| part | params | % | FLOPs | % |', '| --- | ---: | ---: | ---: | ---: |']
    for r in rows:
        pp = 100 * r['params'] / top['params'] if top['params'] else 0.0
        pf = 100 * r['flops'] / top['flops'] if top['flops'] else 0.0
        lines.append(f"| {r['part']} | {_fmt(r['params'], '')} | {pp:.2f} | "
                     f"{_fmt(r['flops'], 'FLOPs')} | {pf:.2f} |")
    return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Count; returns what ``get_flops.json`` holds."""
    args = parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    h, w = padded_shape(cfg, args.shape[0], args.shape[-1])
    try:
        with quiet_logs():
            model = MODELS.build(drop_pretrained(cfg.model))
    except Exception as e:  # the registry wraps the constructor's error
        raise SystemExit(f'cannot build the model of {args.config}: {e}') from e
    model = revert_sync_batchnorm(model).eval()
    model, kind = forward_inputs(model, h, w)
    backbone = 'backbone' if hasattr(model, 'backbone') else ''
    x = torch.rand(1, 3, h, w)
    with torch.no_grad():
        analyzer = flop_analyzer(model, (x, ), elementwise=not args.no_elementwise)
        by_module = analyzer.by_module()
    rows = complexity_breakdown(model, by_module, backbone)
    md = table(rows)
    head = (f'{args.config} ({kind}), input 1x3x{h}x{w}; FLOPs: one multiply-add = 1, '
            f'elementwise arithmetic {"not " if args.no_elementwise else ""}counted')
    print(head)
    print(md)
    out = make_out_dir(args.out_dir)
    with open(osp.join(out, 'get_flops.md'), 'w') as f:
        f.write(head + '\n\n' + md + '\n')
    result = dict(config=args.config, kind=kind, input_shape=[1, 3, h, w],
                  elementwise=not args.no_elementwise, rows=rows,
                  unsupported_ops=dict(analyzer.unsupported_ops()))
    with open(osp.join(out, 'get_flops.json'), 'w') as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == '__main__':
    main()
