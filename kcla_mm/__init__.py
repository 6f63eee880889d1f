"""kcla_mm: Key-Correlated Layer Attention for MMPretrain, MMDetection and MMSegmentation.

``import kcla_mm`` registers the backbones, heads, datasets, transforms and
metrics in the mmdet, mmseg and mmpretrain registries (see
:mod:`kcla_mm.registry`) and changes nothing else of the host libraries. The
fixes the host stack needs
(safe checkpoint loading under torch >= 2.6, atomic checkpoint writes,
distributed training on CPU) are in :mod:`kcla_mm.host_fixes`, which the
project's configs and tools import by name. The operators in
:mod:`kcla_mm.ops` are pure torch.
"""
from .registry import register_all
from .version import __version__

register_all()

__all__ = ['__version__', 'register_all']
