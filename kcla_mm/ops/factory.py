"""String -> operator factory: ``layer_attn=dict(type='KCLA', ...)``.

A new layer-attention method is one file plus one line in ``LAYER_ATTN``.
"""
from typing import Dict, Optional, Type

from torch import nn

from .common import BlockPosition
from .full_layer_attention import FullLayerAttention
from .kcla import KCLA
from .mrla_light import MRLALight

LAYER_ATTN: Dict[str, Type[nn.Module]] = {
    'KCLA': KCLA,
    'FullLayerAttention': FullLayerAttention,
    'MRLALight': MRLALight,
}


def get_layer_attn_class(name: str) -> Type[nn.Module]:
    """The operator class registered as ``name`` (a ValueError names the choices)."""
    if name not in LAYER_ATTN:
        raise ValueError(f'unknown layer_attn type {name!r}; choose one of '
                         f'{sorted(LAYER_ATTN)} or layer_attn=None for a plain ResNet')
    return LAYER_ATTN[name]


def build_layer_attn(cfg: Optional[dict], channels: int,
                     position: BlockPosition, **defaults) -> Optional[nn.Module]:
    """Build the layer-attention module of one block.

    Args:
        cfg: ``dict(type=NAME, **kwargs)`` or ``None`` (no layer attention).
        channels: block output width.
        position: where the block sits (decides init layers and stage starts).
        **defaults: keyword arguments used where ``cfg`` does not set them
            (the backbone passes ``norm_layer`` and ``head_dim`` this way).
    """
    if cfg is None:
        return None
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise ValueError(f"layer_attn must be None or a dict with a 'type', got {cfg!r}")
    kwargs = dict(defaults)
    kwargs.update({k: v for k, v in cfg.items() if k != 'type'})
    cls = get_layer_attn_class(cfg['type'])
    try:
        return cls.for_position(channels, position, **kwargs)
    except TypeError as e:
        raise ValueError(f"layer_attn={cfg!r}: invalid argument for {cfg['type']}: {e}") from e
