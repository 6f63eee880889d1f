"""``KCLAResNet`` on mmpretrain's ResNet (classification defaults: ``out_indices=(3,)``,
``zero_init_residual=True``, ``drop_path_rate``)."""
from types import MappingProxyType

from mmpretrain.models.backbones.resnet import BasicBlock, Bottleneck, ResNet

from .kcla_resnet import BasicBlockEnd, BottleneckEnd, KCLAResNetMixin


class KCLABasicBlock(BasicBlockEnd, BasicBlock):
    """mmpretrain's ``BasicBlock`` ending in :meth:`end` (the same modules and values)."""


class KCLABottleneck(BottleneckEnd, Bottleneck):
    """mmpretrain's ``Bottleneck`` ending in :meth:`end` (the same modules and values)."""


class KCLAResNetCls(KCLAResNetMixin, ResNet):
    """Layer-attention ResNet on mmpretrain's ``ResNet``.

    Registered as ``KCLAResNet`` in mmpretrain's ``MODELS``, so classification
    configs (``default_scope='mmpretrain'``) use the same type name as the
    detection and segmentation ones. All arguments of
    :class:`mmpretrain.models.backbones.ResNet` keep their meaning (among them
    ``drop_path_rate``, the stochastic depth of the residual branches, and
    ``zero_init_residual``); see :class:`KCLAResNetMixin` for ``layer_attn``
    and ``head_dim``. The parameter names are those of the mmdet and mmseg
    backbones, so a classifier's checkpoint initialises them with
    ``init_cfg=dict(type='Pretrained', checkpoint=..., prefix='backbone.')``.

    Example:
        >>> import torch
        >>> from kcla_mm.models.backbones.mmpretrain_kcla_resnet import KCLAResNetCls
        >>> self = KCLAResNetCls(depth=18, base_channels=16, head_dim=16).eval()
        >>> for out in self(torch.rand(1, 3, 64, 64)):
        ...     print(tuple(out.shape))
        (1, 128, 2, 2)
    """

    attn_blocks = MappingProxyType({BasicBlock: KCLABasicBlock, Bottleneck: KCLABottleneck})
