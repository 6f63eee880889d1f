"""Pieces shared by the layer-attention operators (pure torch).

Every operator in :mod:`kcla_mm.ops` uses the same projections as the
reference code: ECA-style 1-D convolutions over the pooled channel vector for
queries and keys, a depthwise 3x3 convolution for values.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NormLayer = Callable[[int], nn.Module]


def eca_kernel_size(channels: int) -> int:
    """ECA kernel size: ``t = int(|(log2(C) + 1) / 2|)``, made odd.

    Gives 5 for C = 256, 512, 1024 and 7 for C = 2048 (``docs/method.md``, section 4).
    """
    t = int(abs((math.log2(channels) + 1) / 2))
    return t if t % 2 else t + 1


def eca_conv(channels: int) -> nn.Conv1d:
    """``Conv1d(1, 1, k, padding=(k-1)//2, bias=False)`` over ``[B, 1, C]``."""
    k = eca_kernel_size(channels)
    return nn.Conv1d(1, 1, k, padding=(k - 1) // 2, bias=False)


def value_conv(channels: int) -> nn.Conv2d:
    """Depthwise ``Conv2d(C, C, 3, padding=1, groups=C, bias=False)``."""
    return nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)


def check_heads(channels: int, head_dim: int) -> int:
    """Return the number of heads ``G = channels / head_dim`` or raise."""
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f'head_dim must be a positive int, got head_dim={head_dim!r}')
    if not isinstance(channels, int) or channels <= 0:
        raise ValueError(f'channels must be a positive int, got channels={channels!r}')
    if channels % head_dim:
        raise ValueError(
            f'channels={channels} is not divisible by head_dim={head_dim}; '
            'choose a head_dim that divides every stage width')
    return channels // head_dim


def check_drop_path(drop_path: float) -> float:
    if not 0.0 <= float(drop_path) < 1.0:
        raise ValueError(f'drop_path must be in [0, 1), got drop_path={drop_path!r}')
    return float(drop_path)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, else the dtype itself (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def eca(p: Tensor, *convs: nn.Conv1d) -> Tuple[Tensor, ...]:
    """Apply ECA 1-D convolutions to pooled channel vectors, cheaply.

    Equal to ``conv(p[:, None])[:, 0]`` for each ``conv``, but computed as one
    small matrix product over a sliding window: a ``Conv1d`` call on a
    ``[B, 1, C]`` tensor costs milliseconds of kernel set-up on CPU, more than
    the whole element-wise part of a KCLA block. The ``Conv1d`` modules are kept
    for their parameters (and the reference checkpoint layout).

    Args:
        p: ``[B, C]``.

    Returns:
        one ``[B, C]`` tensor per convolution, in the dtype of ``p``.
    """
    k = convs[0].weight.shape[-1]
    pad = (k - 1) // 2
    if torch.onnx.is_in_onnx_export():
        # ONNX has no Unfold of a data-dependent size: the same product as a Conv1d
        weight = torch.cat([c.weight for c in convs]).to(p.dtype)  # [n, 1, k]
        return tuple(F.conv1d(p[:, None], weight, padding=pad).unbind(1))
    windows = F.pad(p, (pad, pad)).unfold(1, k, 1)  # [B, C, k]
    # [n, k] -> [k, n]: few ops, each costs more than its arithmetic here.
    # Concatenated along dim 0, each weight's gradient is a whole row, in the
    # weight's own strides; a [1, 1, k] slice of a concatenation along dim 1
    # has other strides (autograd accepts them: only a size-1 dim differs),
    # and DDP warns about those.
    weight = torch.cat([c.weight.view(1, k) for c in convs]).t().to(p.dtype)
    out = windows @ weight  # [B, C, n]
    return tuple(out.unbind(-1))


class _PoolHW(torch.autograd.Function):
    """``x.mean((2, 3))`` whose gradient stays a broadcast view.

    ``MeanBackward`` materialises ``grad.expand(x.shape) / (H W)``: a new map
    the size of ``x`` per pooled block, written once and then added to ``x``'s
    other gradient. Here the division is done on ``[B, C]`` (the same values)
    and the map is an expanded view, which the autograd engine adds in place.
    """

    @staticmethod
    def forward(ctx, x: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x.mean((2, 3), dtype=dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        b, c, h, w = ctx.shape
        return (grad / (h * w)).to(ctx.dtype)[:, :, None, None].expand(b, c, h, w), None


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing (the plain ops are traced there)."""
    compiler = getattr(torch, 'compiler', None)
    return bool(compiler is not None and compiler.is_compiling())


def global_pool(x: Tensor) -> Tensor:
    """``x.mean((2, 3))`` in :func:`compute_dtype`, ``[B, C]``; see :class:`_PoolHW`."""
    dtype = compute_dtype(x.dtype)
    if x.dim() != 4 or not (torch.is_grad_enabled() and x.requires_grad) or compiling():
        return x.mean((2, 3), dtype=dtype)
    return _PoolHW.apply(x, dtype)


def pooled_qk(x: Tensor, wq: nn.Module, wk: nn.Module, num_heads: int):
    """Queries and keys from the global average pool, in float32.

    Args:
        x: block output, ``[B, C, H, W]``.

    Returns:
        ``(q, k)``, each ``[B, G, d]`` in float32 or wider (``docs/method.md``, section 6:
        under AMP the weights and the gate are computed in float32).
    """
    b, c = x.shape[:2]
    p = global_pool(x)  # [B, C]
    with torch.autocast(device_type=x.device.type, enabled=False):
        q, k = eca(p, wq, wk)  # [B, C] each
    return q.view(b, num_heads, c // num_heads), k.view(b, num_heads, c // num_heads)


def per_channel(t: Tensor, head_dim: int, dtype: torch.dtype) -> Tensor:
    """Broadcast a per-head tensor ``[B, G]`` to ``[B, G*d, 1, 1]``."""
    b, g = t.shape
    return t.to(dtype).view(b, g, 1, 1, 1).expand(b, g, head_dim, 1, 1).reshape(
        b, g * head_dim, 1, 1)


def check_input(x: Tensor, channels: int, name: str) -> None:
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(
            f'{name} expects a [B, {channels}, H, W] tensor, got shape {tuple(x.shape)}')


def check_batch(state_batch: int, x: Tensor, name: str) -> None:
    if state_batch != x.shape[0]:
        raise ValueError(
            f'{name}: state has batch size {state_batch} but the input has batch size '
            f'{x.shape[0]}; a state never crosses samples, pass the state of this batch')


class DropPath(nn.Module):
    """Stochastic depth per sample (Huang et al. 2016), identity in eval."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = check_drop_path(p)

    def keep_mask(self, x: Tensor) -> Optional[Tensor]:
        """Per-sample mask ``[B, 1, ..., 1]`` scaled by ``1/keep``, or ``None`` (identity)."""
        if self.p == 0.0 or not self.training:
            return None
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return mask.div_(keep)

    def forward(self, x: Tensor) -> Tensor:
        mask = self.keep_mask(x)
        return x if mask is None else x * mask

    def extra_repr(self) -> str:
        return f'p={self.p}'


def member(module: nn.Module, name: str):
    """``getattr(module, name)`` for a parameter, buffer or submodule, read from
    the module's own tables (the order of ``nn.Module.__getattr__``).

    The inference path reads about 40 of them per block, and each plain
    attribute read of one fails the normal lookup first and then runs
    ``nn.Module.__getattr__`` in Python: 1.1-2.1 us warm (``layer.norm``,
    ``layer.wv.weight``) against 0.3 us here, several times that cold, right
    after a kernel. Anything else (a parametrized weight, which
    ``torch.nn.utils.parametrize`` turns into a property and removes from
    ``_parameters``, or a plain attribute) is read by ``getattr``.
    """
    d = module.__dict__
    for table in ('_parameters', '_buffers', '_modules'):
        value = d[table].get(name)
        if value is not None:
            return value
    return getattr(module, name)


def _norm_affine(norm: nn.Module, acc: torch.dtype, weight: Optional[Tensor],
                 bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(gamma / sigma, beta - gamma mu / sigma)`` of an eval-mode BatchNorm, ``[C]`` each."""
    inv_std = torch.rsqrt(norm.running_var.to(acc) + norm.eps)  # [C]
    if norm.affine:
        weight = norm.weight if weight is None else weight
        bias = norm.bias if bias is None else bias
    weight = weight.to(acc) * inv_std if norm.affine else inv_std
    shift = -norm.running_mean.to(acc) * weight
    if norm.affine:
        shift = shift + bias.to(acc)
    return weight, shift


def _cached_norm_affine(norm: nn.Module, acc: torch.dtype) -> Tuple[Tensor, Tensor]:
    """:func:`_norm_affine` of ``norm``'s own parameters, kept until any of them changes.

    Only used without autograd. The key holds every tensor's storage and
    version counter (bumped by optimiser steps, ``load_state_dict`` and any
    in-place write), and that of ``num_batches_tracked``: the BatchNorm kernel
    updates the running statistics without bumping their counters, but every
    training forward increments ``num_batches_tracked``. A tensor computed on
    every read (a parametrization) is a new tensor each time, whose storage
    may reuse a freed one's at version 0, so no key can hold it: then nothing
    is kept.
    """
    d = norm.__dict__
    params, buffers = d['_parameters'], d['_buffers']
    tensors = [buffers.get('running_mean'), buffers.get('running_var')] + (
        [params.get('weight'), params.get('bias')] if norm.affine else [])
    if any(t is None for t in tensors):  # not a registered tensor: computed on read
        weight, shift = _norm_affine(norm, acc, None, None)
        return weight[None, :, None, None], shift[None, :, None, None]
    nbt = buffers.get('num_batches_tracked')
    if nbt is not None:
        tensors.append(nbt)
    key = (acc, norm.eps) + tuple((t.data_ptr(), t._version, t.device) for t in tensors)
    cached = norm.__dict__.get('_kcla_folded_affine')
    if cached is None or cached[0] != key:
        weight, shift = _norm_affine(norm, acc, None, None)
        cached = (key, weight[None, :, None, None], shift[None, :, None, None])
        norm.__dict__['_kcla_folded_affine'] = cached
    return cached[1], cached[2]


def fold_norm(norm: nn.Module, v: Tensor, scale: Tensor, weight: Optional[Tensor] = None,
              bias: Optional[Tensor] = None, inplace: bool = False) -> Optional[Tensor]:
    """``norm(v * scale)`` as one per-sample, per-channel affine when possible.

    In eval mode a BatchNorm is an affine map per channel, so a per-sample
    per-channel gate folds into it: ``gamma * (s v - mu) / sigma + beta =
    (gamma s / sigma) v + (beta - gamma mu / sigma)``. One pass over ``v``
    instead of three. Returns ``None`` where the fold does not apply (training,
    GroupNorm, no running statistics); the caller then uses the plain path.

    Args:
        v: ``[B, C, H, W]``.
        scale: ``[B, C, 1, 1]``.
        weight, bias: the affine parameters to use instead of ``norm``'s own
            (the recomputation in a backward pass passes detached copies).
        inplace: write the result into ``v`` (nothing differentiates through
            it): a new feature map costs page faults on CPU, more than the pass.
    """
    if (norm.training or not isinstance(norm, nn.modules.batchnorm._BatchNorm)
            or norm.running_mean is None):
        return None
    acc = compute_dtype(v.dtype)
    own = (weight is None or weight is getattr(norm, 'weight', None)) and (
        bias is None or bias is getattr(norm, 'bias', None))
    if own and not torch.is_grad_enabled():
        weight, shift = _cached_norm_affine(norm, acc)  # [1, C, 1, 1] each
    else:
        weight, shift = (t[None, :, None, None] for t in _norm_affine(norm, acc, weight, bias))
    a = (scale.to(acc) * weight).to(v.dtype)  # [B, C, 1, 1]
    shift = shift.to(v.dtype)
    if inplace:
        return torch.addcmul(shift, v, a, out=v)
    return torch.addcmul(shift, v, a)


@dataclass(frozen=True)
class BlockPosition:
    """Where a layer-attention module sits in the backbone.

    Attributes:
        stage: stage index, 0-based.
        block: block index within the stage, 0-based.
        prev_channels: width of the previous block's output (the state that
            arrives at this block), ``None`` for the very first block of the
            network, where no state can arrive.
        stride: spatial stride between the previous block's output and this
            block's output (the stage stride at a stage's first block, else 1).
    """

    stage: int
    block: int
    prev_channels: Optional[int]
    stride: int = 1

    @property
    def stage_start(self) -> bool:
        return self.block == 0
