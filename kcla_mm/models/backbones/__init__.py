"""Layer-attention ResNet backbones.

``KCLAResNet`` subclasses mmdet's ResNet, ``KCLAResNetSeg`` mmseg's; both are
registered as ``KCLAResNet`` in their host's registry. Each is imported only
when its host is installed.
"""
from .kcla_resnet import DEFAULT_LAYER_ATTN, KCLAResNetMixin

__all__ = ['DEFAULT_LAYER_ATTN', 'KCLAResNetMixin']

try:
    from .mmdet_kcla_resnet import KCLAResNet  # noqa: F401
    __all__.append('KCLAResNet')
except ImportError:  # mmdet not installed
    pass
try:
    from .mmseg_kcla_resnet import KCLAResNetSeg  # noqa: F401
    __all__.append('KCLAResNetSeg')
except ImportError:  # mmseg not installed
    pass
