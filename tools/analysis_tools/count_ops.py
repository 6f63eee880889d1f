"""Count the ATen operators that would launch a kernel per step of a backbone.

On a GPU every ATen operator that computes something is at least one kernel
launch, a few microseconds of host time whatever its size; a layer-attention
block issues many of them on ``[B, G]`` and ``[B, C]`` tensors. This tool
counts them on the CPU, through a ``TorchDispatchMode``, for the plain torch
path that CUDA tensors run: the fused CPU kernels are switched off and the
recomputed tail of a KCLA block is replayed through autograd in the backward
pass, as on CUDA.

Counting rule (:func:`launches`): every ATen call is counted, except

- views and metadata: an operator whose tensor outputs all alias an input
  without writing it (``view``, ``_unsafe_view``, ``expand``, ``t``,
  ``detach``, ``unsqueeze``, ``slice``, ``unbind``, ``select``, ``permute``,
  ``as_strided``, ``unfold``, ``alias``, ...) or that returns no tensor
  (``sym_size``, ``is_same_size``, ...);
- allocations that write nothing (``empty``, ``empty_like``,
  ``empty_strided``, ``new_empty``).

In-place and ``out=`` operators (``add_``, ``copy_``, ``addcmul(out=)``)
write memory and count. One counted operator may launch more than one kernel
on a GPU (cuDNN convolutions, reductions in two passes); the count is a lower
bound of launches, the same for every method, so differences compare.

For each method and depth it reports the operators of one training step
(forward in train mode, backward of the mean of the outputs; no optimiser
step), split into forward and backward, and of one eval forward (no
autograd), after one step of each kind as warm-up; and per block, the extra
over the plain ResNet of the same depth divided by the number of residual
blocks.

Examples::

    python tools/analysis_tools/count_ops.py                    # ResNet-34 and -50
    python tools/analysis_tools/count_ops.py --depths 50 --methods KCLA none
    python tools/analysis_tools/count_ops.py --json ops.json    # also write JSON
"""
import argparse
import json
from collections import Counter
from typing import Callable, Dict, List, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kcla_mm.analysis.benchmark import num_blocks

METHODS = ('KCLA', 'MRLALight', 'FullLayerAttention', 'none')
#: allocations whose memory is not written: no kernel
ALLOCATIONS = frozenset({'empty', 'empty_like', 'empty_strided', 'new_empty',
                         'new_empty_strided'})
#: views whose schema does not say so (the result aliases the input's memory)
UNANNOTATED_VIEWS = frozenset({'_unsafe_view'})


def launches(func) -> bool:
    """Whether an ATen operator computes something (see the module docstring)."""
    schema = func._schema
    if func.__name__.split('.')[0] in ALLOCATIONS | UNANNOTATED_VIEWS:
        return False
    tensors = [r for r in schema.returns if 'Tensor' in str(r.type)]
    if not tensors:
        return False
    # a view returns an alias of an input that it does not write
    return not all(r.alias_info is not None and not r.alias_info.is_write for r in tensors)


class OpCounter(TorchDispatchMode):
    """Counts the launching ATen operators called inside the block, by name.

    Example:
        >>> with OpCounter() as ops:
        ...     torch.ones(3).exp().view(3, 1)
        >>> ops.total, dict(ops.counts)
        (2, {'ones': 1, 'exp': 1})
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches(func):
            self.counts[func.__name__.split('.')[0]] += 1
        return func(*args, **(kwargs or {}))


def count(fn: Callable[[], object]) -> OpCounter:
    """The launching operators of ``fn()``."""
    with OpCounter() as ops:
        fn()
    return ops


def _loss(out) -> torch.Tensor:
    outs = out if isinstance(out, (tuple, list)) else (out, )
    return sum(o.float().mean() for o in outs)


def count_step(model: nn.Module, x: torch.Tensor) -> Dict[str, int]:
    """Operators of one training step (forward, backward) and one eval forward.

    The recomputed tails are replayed through autograd, as on CUDA; the fused
    CPU kernels must be off (the caller's business, see :func:`main`).
    """
    from kcla_mm.ops.recompute import autograd_replay
    params = [p for p in model.parameters() if p.requires_grad]

    def train_step(counted: bool) -> Dict[str, int]:
        for p in params:
            p.grad = None
        with autograd_replay():
            if not counted:
                _loss(model(x)).backward()
                return {}
            with OpCounter() as fwd:
                loss = _loss(model(x))
            with OpCounter() as bwd:
                loss.backward()
        return {'forward': fwd.total, 'backward': bwd.total}

    model.train()
    train_step(False)  # warm-up
    result = train_step(True)
    model.eval()
    with torch.no_grad():
        model(x)  # warm-up
        result['eval'] = count(lambda: model(x)).total
    model.train()
    return result


def build(method: str, depth: int) -> nn.Module:
    """``KCLAResNet(depth, norm_eval=False)`` (mmdet) with the method's layer attention."""
    from kcla_mm.models.backbones.mmdet_kcla_resnet import KCLAResNet
    layer_attn = None if method == 'none' else dict(type=method)
    model = KCLAResNet(depth=depth, layer_attn=layer_attn, norm_eval=False, init_cfg=None)
    if method != 'none':
        for m in model.layer_attn_modules():
            m.reset_parameters()
    return model


def measure(depths: Sequence[int], methods: Sequence[str], batch: int,
            size: int) -> List[Dict]:
    """One row per depth and method, with per-block extras over the plain ResNet."""
    import kcla_mm.ops as ops
    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size)
    rows = []
    with ops.fused_kernels(False):
        for depth in depths:
            plain = None
            for method in ('none', ) + tuple(m for m in methods if m != 'none'):
                model = build(method, depth)
                row = dict(depth=depth, method=method, blocks=num_blocks(model),
                           **count_step(model, x))
                row['train'] = row['forward'] + row['backward']
                if method == 'none':
                    plain = row
                for key in ('forward', 'backward', 'train', 'eval'):
                    row[f'{key}_per_block'] = (row[key] - plain[key]) / row['blocks']
                if method in methods:
                    rows.append(row)
    return rows


def table(rows: List[Dict], batch: int, size: int) -> str:
    head = ('| depth | method | blocks | train fwd | train bwd | train total | eval | '
            'extra per block: fwd | bwd | train | eval |')
    lines = [f'ATen operators that launch a kernel (fused kernels off; input {batch}x3x'
             f'{size}x{size}; per block: extra over the plain ResNet / blocks)', '',
             head, '|' + '---|' * 11]
    for r in rows:
        lines.append(
            f"| {r['depth']} | {r['method']} | {r['blocks']} | {r['forward']} | "
            f"{r['backward']} | {r['train']} | {r['eval']} | {r['forward_per_block']:.1f} | "
            f"{r['backward_per_block']:.1f} | {r['train_per_block']:.1f} | "
            f"{r['eval_per_block']:.1f} |")
    return '\n'.join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog='Counting rule: every ATen call except views/metadata (outputs that alias an '
        'input without writing it, or no tensor output) and unwritten allocations (empty*); '
        'counted on CPU with the fused kernels off and the recomputed tail replayed through '
        'autograd, which is the path CUDA runs.')
    parser.add_argument('--depths', type=int, nargs='+', default=[34, 50],
                        choices=[18, 34, 50, 101, 152], help='ResNet depths (default: 34 50)')
    parser.add_argument('--methods', nargs='+', default=list(METHODS), choices=METHODS,
                        help='layer attention of the backbone; none: the plain ResNet '
                        '(always measured, for the per-block extras)')
    parser.add_argument('--batch', type=int, default=2, help='batch size (default: 2)')
    parser.add_argument('--size', type=int, default=64, help='input height and width '
                        '(default: 64; the counts do not depend on it)')
    parser.add_argument('--json', metavar='FILE', default=None,
                        help="also write the rows as JSON to FILE ('-': to stdout, no table)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = measure(args.depths, args.methods, args.batch, args.size)
    if args.json == '-':
        print(json.dumps(rows, indent=2))
        return
    print(table(rows, args.batch, args.size))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(batch=args.batch, size=args.size, rows=rows), f, indent=2)


if __name__ == '__main__':
    main()
