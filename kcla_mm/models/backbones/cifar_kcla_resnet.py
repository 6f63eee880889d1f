"""The CIFAR ResNets of the layer-attention papers, on mmpretrain's ResNet."""
from typing import Dict, Tuple

from mmcv.cnn import build_conv_layer, build_norm_layer
from mmpretrain.models.backbones.resnet import BasicBlock, Bottleneck
from torch import nn

from .mmpretrain_kcla_resnet import KCLAResNetCls

#: ``block`` argument -> (block class, layers one block adds to the depth over
#: the three stages: 3 x 3 convolutions for a Bottleneck, 3 x 2 for a BasicBlock)
CIFAR_BLOCKS: Dict[str, Tuple[type, int]] = {'Bottleneck': (Bottleneck, 9),
                                             'BasicBlock': (BasicBlock, 6)}


def cifar_stage_blocks(depth: int, block: str = 'Bottleneck') -> int:
    """``n``, the number of blocks per stage of a CIFAR ResNet of ``depth``.

    Bottleneck networks have depth ``9n + 2`` (ResNet-20/56/110: n = 2/6/12),
    BasicBlock networks ``6n + 2`` (ResNet-20/56/110: n = 3/9/18).
    """
    if block not in CIFAR_BLOCKS:
        raise ValueError(f'block={block!r}; choose one of {sorted(CIFAR_BLOCKS)}')
    unit = CIFAR_BLOCKS[block][1]
    if not isinstance(depth, int) or depth < unit + 2 or (depth - 2) % unit:
        raise ValueError(f'a CIFAR ResNet of {block}s has depth {unit}n + 2 '
                         f'({", ".join(str(unit * n + 2) for n in (1, 2, 6))}, ...), '
                         f'got depth={depth!r}')
    return (depth - 2) // unit


class CifarKCLAResNet(KCLAResNetCls):
    """The CIFAR ResNet of the layer-attention papers, with layer attention.

    A 3x3 stride-1 stem of ``stem_channels`` (no max-pooling) and three stages
    of ``n`` blocks with strides 1, 2, 2 (He et al. 2016, section 4.2). The
    papers' networks (MRLA, KCLA) use Bottleneck blocks: depth ``9n + 2``,
    16/32/64 planes with expansion 4 (stage widths 64/128/256), head size 16,
    so 4, 8 and 16 heads. ``block='BasicBlock'`` gives the original
    ``6n + 2`` networks of He et al. instead (stage widths 16/32/64). Otherwise
    exactly :class:`KCLAResNetCls` (registered as ``CifarKCLAResNet`` in
    mmpretrain's ``MODELS``); the KCLA papers train with
    ``layer_attn=dict(type='KCLA', drop_path=0.2)``.

    Args:
        depth: ``9n + 2`` for Bottleneck (20, 56, 110 for n = 2, 6, 12),
            ``6n + 2`` for BasicBlock.
        block: ``'Bottleneck'`` (default, the papers') or ``'BasicBlock'``.
        stem_channels: width of the stem (16).
        base_channels: planes of the first stage (16).
        head_dim: channels per head (16).
        **kwargs: :class:`KCLAResNetCls` arguments (``num_stages=3``,
            ``strides=(1, 2, 2)``, ``out_indices=(2,)`` by default).

    Example:
        >>> import torch
        >>> from kcla_mm.models.backbones.cifar_kcla_resnet import CifarKCLAResNet
        >>> self = CifarKCLAResNet(depth=20).eval()
        >>> [tuple(o.shape) for o in self(torch.rand(1, 3, 32, 32))]
        [(1, 256, 8, 8)]
    """

    def __init__(self, depth: int, block: str = 'Bottleneck', stem_channels: int = 16,
                 base_channels: int = 16, head_dim: int = 16, **kwargs) -> None:
        n = cifar_stage_blocks(depth, block)
        # one depth may be either network (20 = 9*2+2 = 6*3+2): the block decides
        self.arch_settings = {depth: (CIFAR_BLOCKS[block][0], (n, n, n))}
        self.cifar_block = block
        kwargs.setdefault('num_stages', 3)
        kwargs.setdefault('strides', (1, 2, 2))
        kwargs.setdefault('dilations', (1, 1, 1))
        kwargs.setdefault('out_indices', (2, ))
        super().__init__(depth=depth, stem_channels=stem_channels, base_channels=base_channels,
                         head_dim=head_dim, **kwargs)

    def _make_stem_layer(self, in_channels: int, stem_channels: int) -> None:
        self.conv1 = build_conv_layer(self.conv_cfg, in_channels, stem_channels, kernel_size=3,
                                      stride=1, padding=1, bias=False)
        self.norm1_name, norm1 = build_norm_layer(self.norm_cfg, stem_channels, postfix=1)
        self.add_module(self.norm1_name, norm1)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
