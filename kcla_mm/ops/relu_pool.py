"""A residual block's last ReLU that also pools its output (pure torch + torch.ops).

KCLA starts every step with the global average pool of the block output
``y = relu(s)``: a pass over the map of its own, and in training a second map
(the pool's gradient) added to ``y``'s gradient. :func:`relu_pool_` is the
block's in-place ReLU with the pool folded in
(``torch.ops.kcla_mm.relu_pool_``/``relu_pool_backward``,
``csrc/kcla_pool_cpu.cpp``): the same bytes as ``relu_`` forward and
``threshold_backward`` backward, and no pooling pass. The values are those of
``relu_`` then ``mean((2, 3))`` (the mean rounded as the eval kernel pools, so
``eval_step`` gives the same numbers whether it pools itself or is handed the
mean); the gradient is autograd's, added in the same order.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import cpu_kernels

CL = torch.channels_last


def applicable(x: Tensor) -> bool:
    """Whether the fused kernel computes ``relu_pool_(x)`` (CPU float32 channels-last, built)."""
    if (x.device.type != 'cpu' or x.dtype != torch.float32 or x.dim() != 4
            or not x.is_contiguous(memory_format=CL) or x.numel() == 0):
        return False
    compiler = getattr(torch, 'compiler', None)
    if (compiler is not None and compiler.is_compiling()) or torch.jit.is_tracing():
        return False
    return cpu_kernels.available()


class ReLUPool(torch.autograd.Function):
    """``(relu_(x), relu(x).mean((2, 3)))`` in one pass; backward in one pass."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tuple[Tensor, Tensor]:
        pooled = torch.ops.kcla_mm.relu_pool_(x)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        ctx.hw = x.shape[2] * x.shape[3]
        return x, pooled

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Optional[Tensor], gp: Optional[Tensor]) -> Tensor:
        y, = ctx.saved_tensors
        if gy is None:
            gy = torch.zeros_like(y)
        gy = gy.contiguous(memory_format=CL)
        if gp is not None:  # as the pool's own backward: grad / (H W) in the map's dtype
            gp = (gp / ctx.hw).to(y.dtype).contiguous()
        return torch.ops.kcla_mm.relu_pool_backward(gy, y, gp)


def relu_pool_(x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """``relu_(x)`` and, where the fused kernel applies, its global average pool.

    Args:
        x: ``[B, C, H, W]``; overwritten with ``relu(x)`` (as ``nn.ReLU(inplace=True)``).

    Returns:
        ``(relu(x), pooled)``: ``pooled`` is ``[B, C]`` float32, the mean over
        the pixels of ``relu(x)``, or ``None`` where the kernel does not apply
        (then only the ReLU was computed; the caller pools as before).
    """
    if not applicable(x):
        return F.relu(x, inplace=True), None
    if torch.is_grad_enabled() and x.requires_grad:
        return ReLUPool.apply(x)
    return x, torch.ops.kcla_mm.relu_pool_(x)
