"""``KCLAResNet`` on mmdet's ResNet (detection defaults: ``norm_eval=True``)."""
from types import MappingProxyType

from mmdet.models.backbones.resnet import BasicBlock, Bottleneck, ResNet

from .kcla_resnet import BasicBlockEnd, BottleneckEnd, KCLAResNetMixin


class KCLABasicBlock(BasicBlockEnd, BasicBlock):
    """mmdet's ``BasicBlock`` ending in :meth:`end` (the same modules and values)."""


class KCLABottleneck(BottleneckEnd, Bottleneck):
    """mmdet's ``Bottleneck`` ending in :meth:`end` (the same modules and values)."""


class KCLAResNet(KCLAResNetMixin, ResNet):
    """Layer-attention ResNet on mmdet's ``ResNet``.

    Registered as ``KCLAResNet`` in mmdet's ``MODELS``. All arguments of
    :class:`mmdet.models.backbones.ResNet` keep their meaning; see
    :class:`KCLAResNetMixin` for ``layer_attn`` and ``head_dim``.

    Example:
        >>> import torch
        >>> from kcla_mm.models.backbones import KCLAResNet
        >>> self = KCLAResNet(depth=18, base_channels=16, head_dim=16).eval()
        >>> for out in self(torch.rand(1, 3, 64, 64)):
        ...     print(tuple(out.shape))
        (1, 16, 16, 16)
        (1, 32, 8, 8)
        (1, 64, 4, 4)
        (1, 128, 2, 2)
    """

    attn_blocks = MappingProxyType({BasicBlock: KCLABasicBlock, Bottleneck: KCLABottleneck})
