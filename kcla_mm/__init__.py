"""kcla_mm: Key-Correlated Layer Attention for MMDetection and MMSegmentation.

``import kcla_mm`` registers the backbones, heads, datasets and metrics in the
mmdet and mmseg registries (see :mod:`kcla_mm.registry`) and makes mmengine's
checkpoint loading safe under torch >= 2.6 and its checkpoint saving atomic
(see :mod:`kcla_mm.utils.checkpoint`), and lets its ``pytorch`` launcher run
on machines without GPUs (gloo, see :mod:`kcla_mm.utils.dist`).
The operators in :mod:`kcla_mm.ops` are pure torch.
"""
from .registry import register_all
from .utils.checkpoint import install_atomic_save, install_safe_loader
from .utils.dist import install_cpu_distributed
from .version import __version__

install_safe_loader()
install_atomic_save()
install_cpu_distributed()
register_all()

__all__ = [
    '__version__', 'register_all', 'install_safe_loader', 'install_atomic_save',
    'install_cpu_distributed'
]
