"""FLOPs of a backbone, counted with mmengine's analyzer, and their breakdown by module."""
import math
from typing import Any, Callable, Dict, List, Mapping, Tuple

from torch import nn

from .blocks import ATTN_LIST

ELEMENTWISE_FLOPS: Dict[str, int] = {
    'aten::add': 1, 'aten::add_': 1, 'aten::sub': 1, 'aten::rsub': 1, 'aten::mul': 1,
    'aten::mul_': 1, 'aten::div': 1, 'aten::addcmul': 1, 'aten::lerp': 2, 'aten::lerp_': 2,
}


def flop_analyzer(model: nn.Module, inputs: Tuple[Any, ...], elementwise: bool = True):
    """mmengine's ``FlopAnalyzer`` (one multiply-add = one FLOP), warnings silenced.

    Args:
        model: traced as ``model(*inputs)``.
        inputs: its inputs.
        elementwise: also count the elementwise arithmetic of
            :data:`ELEMENTWISE_FLOPS`, which mmengine ignores by default, so that
            the aggregation of layer attention (e.g. FullLayerAttention's
            weighted sum over the stage's history) is not invisible.
    """
    from mmengine.analysis import FlopAnalyzer
    from mmengine.analysis.jit_handles import get_shape

    def per_output(scale: int):
        def handle(ins: List[Any], outs: List[Any]) -> int:
            shape = get_shape(outs[0])
            return 0 if shape is None else scale * math.prod(shape)
        return handle

    analyzer = FlopAnalyzer(model, inputs)
    if elementwise:
        analyzer.set_op_handle(**{op: per_output(s) for op, s in ELEMENTWISE_FLOPS.items()})
    return (analyzer.tracer_warnings('none').unsupported_ops_warnings(False)
            .uncalled_modules_warnings(False))


def complexity_breakdown(model: nn.Module, flops_by_module: Mapping[str, int],
                         backbone: str = 'backbone') -> List[Dict[str, Any]]:
    """Parameters and FLOPs of the whole model, its backbone and its layer attention.

    Args:
        model: the analysed model.
        flops_by_module: ``FlopAnalyzer.by_module()`` of ``model``.
        backbone: name of the backbone sub-module; ``''`` when ``model`` is the backbone.

    Returns:
        Rows ``dict(part, params, flops)``: ``model`` (if it is not the backbone),
        ``backbone``, ``backbone: layer attention`` and its share per stage
        (``layer{s}_attn``), ``backbone without layer attention``.
    """
    params = {n: p.numel() for n, p in model.named_parameters()}
    prefix = f'{backbone}.' if backbone else ''

    def param_sum(pred: Callable[[str], bool]) -> int:
        return sum(v for n, v in params.items() if pred(n))

    rows = []
    if backbone:
        rows.append(dict(part='model', params=sum(params.values()),
                         flops=int(flops_by_module.get('', 0))))
    bb_params = param_sum(lambda n: n.startswith(prefix))
    bb_flops = int(flops_by_module.get(backbone, 0))
    rows.append(dict(part='backbone', params=bb_params, flops=bb_flops))
    stages = sorted((name for name in flops_by_module
                     if name.startswith(prefix) and ATTN_LIST.search(name)
                     and name.count('.') == prefix.count('.')),
                    key=lambda s: int(ATTN_LIST.search(s).group(1)))
    attn_rows = [dict(part=f'  {name[len(prefix):]}',
                      params=param_sum(lambda n, s=name: n.startswith(s + '.')),
                      flops=int(flops_by_module[name])) for name in stages]
    attn_params = sum(r['params'] for r in attn_rows)
    attn_flops = sum(r['flops'] for r in attn_rows)
    rows.append(dict(part='backbone: layer attention', params=attn_params, flops=attn_flops))
    rows.extend(attn_rows)
    rows.append(dict(part='backbone without layer attention', params=bb_params - attn_params,
                     flops=bb_flops - attn_flops))
    return rows
