"""A residual block's end: its last norms, the add and the ReLU.

:func:`residual_end` is what the host ResNets' ``BasicBlock`` and
``Bottleneck`` do after their last convolution (``norm(out) +
res_norm(identity)``, then an in-place ReLU). The layer-attention blocks of
:mod:`kcla_mm.models.backbones` end in it, so that a fast path can fuse the
norms, the add and the ReLU into one pass over the map
(:mod:`kcla_mm.ops.fused`); here it is the plain sequence of module calls.
"""
from typing import Optional

from torch import Tensor, nn

from .config import fused_call


def residual_end(x: Tensor, res: Tensor, norm: Optional[nn.Module] = None,
                 res_norm: Optional[nn.Module] = None,
                 producer: Optional[nn.Module] = None) -> Tensor:
    """``relu(norm(x) + res_norm(res))`` (``None``: a map is used as it is).

    Args:
        x: the residual branch after its last convolution, ``[B, C, H, W]``;
            may be overwritten.
        res: the shortcut, ``[B, C, H, W]`` (before ``res_norm``).
        norm: the branch's last norm (``norm3`` / ``norm2``), or ``None``.
        res_norm: the shortcut's norm (the downsample's last module), or ``None``.
        producer: a hint that never changes a value: the module that made
            ``x``. A fast path overwrites ``x`` only where no hook of it could
            hold ``x``.
    """
    fast = fused_call('residual_end', x, res, norm, res_norm, producer)
    if fast is not None:
        return fast
    if norm is not None:
        x = norm(x)
    if res_norm is not None:
        res = res_norm(res)
    x += res
    return x.relu_()
