"""Which blocks of a backbone carry layer attention, and recording what they compute."""
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..ops import KCLA, FullLayerAttention, MRLALight

#: the layer-attention methods the analyses understand, in plotting order.
METHODS: Tuple[str, ...] = ('KCLA', 'FullLayerAttention', 'MRLALight')
_CLASSES = {'KCLA': KCLA, 'FullLayerAttention': FullLayerAttention, 'MRLALight': MRLALight}
#: name of a backbone's per-stage ModuleList of layer-attention modules.
ATTN_LIST = re.compile(r'(?:^|\.)layer(\d+)_attn$')

Progress = Optional[Callable[[], None]]


@dataclass(frozen=True)
class BlockInfo:
    """Where a layer-attention module sits and how wide it is.

    Attributes:
        index: block index in the network, 0-based.
        stage: stage index, 0-based (``layer{stage + 1}``).
        block: block index within the stage, 0-based.
        channels: width ``C`` of the block output.
        num_heads: ``G = C / head_dim``.
        head_dim: channels per head ``d``.
    """

    index: int
    stage: int
    block: int
    channels: int
    num_heads: int
    head_dim: int

    @property
    def name(self) -> str:
        """``layer{s}.{i}``, the host's name of the block."""
        return f'layer{self.stage + 1}.{self.block}'


def method_of(module: nn.Module) -> str:
    """The method name (one of :data:`METHODS`) of a layer-attention module."""
    for name, cls in _CLASSES.items():
        if isinstance(module, cls):
            return name
    raise TypeError(f'{type(module).__name__} is not a layer-attention module of kcla_mm '
                    f'(expected one of {list(METHODS)})')


def attention_blocks(backbone: nn.Module) -> List[Tuple[BlockInfo, nn.Module]]:
    """The layer-attention modules of a backbone, in block order, with their positions.

    Raises:
        ValueError: the backbone has no layer-attention modules (a plain ResNet,
            ``layer_attn=None``, or not a kcla_mm backbone).
    """
    names = list(getattr(backbone, 'layer_attn_names', None) or [])
    if not names:
        raise ValueError(
            f'{type(backbone).__name__} has no layer-attention modules: build it with '
            "layer_attn=dict(type='KCLA' | 'FullLayerAttention' | 'MRLALight') "
            '(layer_attn=None is a plain ResNet, which has no keys or layer weights)')
    out = []
    for name in names:
        stage = int(ATTN_LIST.search(name).group(1)) - 1
        for block, module in enumerate(getattr(backbone, name)):
            out.append((BlockInfo(len(out), stage, block, module.channels, module.num_heads,
                                  module.head_dim), module))
    return out


def backbone_method(backbone: nn.Module) -> str:
    """The single layer-attention method used by every block of ``backbone``."""
    methods = {method_of(m) for _, m in attention_blocks(backbone)}
    if len(methods) != 1:
        raise ValueError(f'the backbone mixes layer-attention methods {sorted(methods)}')
    return methods.pop()


# -- running a backbone with hooks on its layer-attention modules --

@torch.no_grad()
def record_blocks(backbone: nn.Module,
                  images: Iterable[Tensor],
                  record: Callable[[nn.Module, Tensor, Any], Any],
                  progress: Progress = None) -> Tuple[List[BlockInfo], List[List[Any]]]:
    """Run ``backbone`` in eval mode on each batch and record every block.

    A forward pre-hook on each layer-attention module calls
    ``record(module, x, state)`` with the block output ``x`` (``[B, C, H, W]``)
    and the incoming operator state (``None`` for the very first block).

    Args:
        backbone: a backbone with layer-attention modules.
        images: batches ``[B, 3, H, W]`` (on the backbone's device).
        record: what to keep of each block, computed from its inputs.
        progress: called once after each batch (e.g. a progress bar's ``update``).

    Returns:
        ``(blocks, records)`` with ``records[t]`` the list of what ``record``
        returned for block ``t``, one entry per batch.
    """
    blocks = attention_blocks(backbone)
    records: List[List[Any]] = [[] for _ in blocks]

    def make_hook(t: int):
        def hook(module: nn.Module, args: tuple) -> None:
            state = args[1] if len(args) > 1 else None
            records[t].append(record(module, args[0], state))
        return hook

    handles = [m.register_forward_pre_hook(make_hook(info.index)) for info, m in blocks]
    was_training = backbone.training
    backbone.eval()
    try:
        for batch in images:
            backbone(batch)
            if progress is not None:
                progress()
    finally:
        backbone.train(was_training)
        for h in handles:
            h.remove()
    if not records[0]:
        raise ValueError('no images: the image source yielded no batch')
    return [info for info, _ in blocks], records


# -- shared by the plots --

def stage_edges(blocks: Sequence[BlockInfo]) -> List[int]:
    return [b.index for b in blocks[1:] if b.block == 0]


def block_ticks(ax, blocks: Sequence[BlockInfo], axes: str = 'xy') -> None:
    if len(blocks) <= 24:
        ticks = list(range(len(blocks)))
        labels = [b.name for b in blocks]
    else:  # one label per stage, at its middle
        stages = sorted({b.stage for b in blocks})
        idx = [[b.index for b in blocks if b.stage == s] for s in stages]
        ticks = [(i[0] + i[-1]) / 2 for i in idx]
        labels = [f'layer{s + 1}' for s in stages]
    if 'x' in axes:
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
    if 'y' in axes:
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=6)
