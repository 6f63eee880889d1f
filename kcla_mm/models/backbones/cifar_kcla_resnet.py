"""CIFAR-style ResNet (depth ``6n + 2``) with layer attention, on mmdet's ResNet."""
from mmcv.cnn import build_conv_layer, build_norm_layer
from mmdet.models.backbones.resnet import BasicBlock
from torch import nn

from .mmdet_kcla_resnet import KCLAResNet


class CifarKCLAResNet(KCLAResNet):
    """CIFAR-style ResNet of depth ``6n + 2`` with layer attention.

    A 3x3 stride-1 stem (no max-pooling) and 3 stages of ``n`` BasicBlocks
    (He et al. 2016, section 4.2); otherwise exactly :class:`KCLAResNet`.

    Args:
        depth: ``6n + 2`` for ``n >= 1`` (20, 32, 44, 56, 110, 254, ...).
        base_channels: width of the first stage (16 in the paper).
        head_dim: channels per head (16: 1, 2 and 4 heads per stage).
        **kwargs: :class:`KCLAResNet` arguments.
    """

    arch_settings = {6 * n + 2: (BasicBlock, (n, n, n)) for n in range(1, 201)}

    def __init__(self, depth: int, base_channels: int = 16, head_dim: int = 16,
                 **kwargs) -> None:
        kwargs.setdefault('num_stages', 3)
        kwargs.setdefault('strides', (1, 2, 2))
        kwargs.setdefault('dilations', (1, 1, 1))
        kwargs.setdefault('out_indices', (2, ))
        kwargs.setdefault('norm_eval', False)
        super().__init__(depth=depth, base_channels=base_channels, head_dim=head_dim,
                         **kwargs)

    def _make_stem_layer(self, in_channels: int, stem_channels: int) -> None:
        self.conv1 = build_conv_layer(self.conv_cfg, in_channels, stem_channels, kernel_size=3,
                                      stride=1, padding=1, bias=False)
        self.norm1_name, norm1 = build_norm_layer(self.norm_cfg, stem_channels, postfix=1)
        self.add_module(self.norm1_name, norm1)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
