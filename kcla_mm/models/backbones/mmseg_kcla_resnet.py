"""``KCLAResNet`` on mmseg's ResNet (segmentation defaults, ``contract_dilation``)."""
from types import MappingProxyType

from mmseg.models.backbones.resnet import BasicBlock, Bottleneck, ResNet

from .kcla_resnet import BasicBlockEnd, BottleneckEnd, KCLAResNetMixin


class KCLABasicBlock(BasicBlockEnd, BasicBlock):
    """mmseg's ``BasicBlock`` ending in :meth:`end` (the same modules and values)."""


class KCLABottleneck(BottleneckEnd, Bottleneck):
    """mmseg's ``Bottleneck`` ending in :meth:`end` (the same modules and values)."""


class KCLAResNetSeg(KCLAResNetMixin, ResNet):
    """Layer-attention ResNet on mmseg's ``ResNet``.

    Registered as ``KCLAResNet`` in mmseg's ``MODELS`` (so configs with
    ``default_scope='mmseg'`` use the same type name as detection configs).
    All arguments of :class:`mmseg.models.backbones.ResNet` keep their meaning
    (``norm_eval=False`` by default, ``multi_grid``, ``contract_dilation``);
    see :class:`KCLAResNetMixin` for ``layer_attn`` and ``head_dim``.

    Example:
        >>> import torch
        >>> from kcla_mm.models.backbones import KCLAResNetSeg
        >>> self = KCLAResNetSeg(depth=18, base_channels=16, stem_channels=16,
        ...                      strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4)).eval()
        >>> for out in self(torch.rand(1, 3, 64, 64)):
        ...     print(tuple(out.shape))
        (1, 16, 16, 16)
        (1, 32, 8, 8)
        (1, 64, 8, 8)
        (1, 128, 8, 8)
    """

    attn_blocks = MappingProxyType({BasicBlock: KCLABasicBlock, Bottleneck: KCLABottleneck})
