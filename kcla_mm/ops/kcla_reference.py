"""KCLA as the paper writes it: one block step and the cross-stage adaptation.

This is the method in one place, in the order and notation of
``docs/method.md`` (sections 4 and 5), written for reading, not for speed. It
keeps the raw sums of the paper, ``u = sum_s w_s x_s`` and ``z = sum_s w_s``,
calls the layer's modules one after the other and allocates freely. Every
other implementation of the operator (:class:`kcla_mm.ops.KCLA`'s optimised
eager path, its memory-saving recomputation, the fused CPU kernels of
:mod:`kcla_mm.ops.fused`, forward and backward) is tested against these two
functions, in float64 where the implementation supports it.

The raw sums overflow float16 after a few blocks (``w`` reaches ``e^10``);
:class:`kcla_mm.ops.KCLA` stores ``u / z`` and ``log z`` instead
(``docs/method.md``, section 6). :func:`as_state` converts.

Example:
    >>> import torch
    >>> from kcla_mm.ops import KCLA
    >>> layer = KCLA(64, head_dim=16).eval()
    >>> x = torch.rand(2, 64, 8, 8)
    >>> out, (u, z) = kcla_step(layer, x)
    >>> out2, _ = kcla_step(layer, x, (u, z))
    >>> tuple(out2.shape), tuple(z.shape)
    ((2, 64, 8, 8), (2, 4, 1, 1, 1))
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .kcla_state import KCLAState

#: ``(u, z)``: ``u`` ``[B, G, d, H, W]``, the weighted sum of block outputs;
#: ``z`` ``[B, G, 1, 1, 1]``, the sum of the weights.
RawState = Tuple[Tensor, Tensor]


def kcla_step(layer, x: Tensor, state: Optional[RawState] = None,
              keep: Optional[Tensor] = None) -> Tuple[Tensor, RawState]:
    """One KCLA step at block ``t`` (``docs/method.md``, section 4).

    Args:
        layer: a :class:`kcla_mm.ops.KCLA` whose modules and constants are used.
        x: ``x_t``, the block output after the residual add and ReLU,
            ``[B, C, H, W]``.
        state: ``(u, z)`` of the blocks before, or ``None`` at the first block.
            An init layer (``layer.renorm``) adapts it first (section 5).
        keep: the drop-path mask ``[B, 1, 1, 1]`` (already divided by the keep
            probability); ``None`` applies ``layer.drop_path`` itself.

    Returns:
        ``(x_t + o_t, (u, z))``.
    """
    b, c, h, w = x.shape
    g, d = layer.num_heads, layer.head_dim
    inv_tau = layer.inv_tau.to(x.dtype)  # [G], 1 / tau_g
    if state is not None and layer.renorm:
        state = cross_stage_adapt(layer, state, x)

    # 1. pool, then queries and keys by the ECA convolutions
    p = x.mean((2, 3))[:, None]  # [B, 1, C]
    q = layer.wq(p).view(b, g, d)  # [B, G, d]
    k = layer.wk(p).view(b, g, d)

    # 2. key-norm weights, the logit clamped before the exponential
    n = k.norm(dim=-1)  # [B, G]
    logit = n * inv_tau
    if layer.clamp is not None:
        logit = logit.clamp(max=layer.clamp)
    wgt = torch.exp(logit).view(b, g, 1, 1, 1)

    # 3. the running state, and the aggregate
    xg = x.view(b, g, d, h, w)
    if state is None:
        u, z = wgt * xg, wgt
    else:
        u, z = state[0] + wgt * xg, state[1] + wgt
    xbar = (u / (z + layer.eps)).view(b, c, h, w)

    # 4. the value transform, once, of the aggregate
    v = layer.wv(xbar)  # [B, C, H, W]

    # 5. the gate: |q| cos(theta) per head, mixed over heads by Phi
    score = (q * k).sum(-1) / n.clamp_min(1e-12)  # [B, G]
    a = torch.sigmoid(layer.phi(score))  # [B, G]

    # 6. norm, ReLU, drop path
    o = F.relu(layer.norm((a.view(b, g, 1, 1, 1) * v.view(b, g, d, h, w)).view(b, c, h, w)))
    o = layer.drop_path(o) if keep is None else o * keep

    # 7. the residual add; the state keeps x_t
    return x + o, (u, z)


def cross_stage_adapt(layer, state: RawState, x: Tensor) -> RawState:
    """An init layer's adaptation of the incoming state (``docs/method.md``, section 5).

    Args:
        layer: an init layer (``layer.renorm``).
        state: ``(u, z)`` at the previous block's width and resolution.
        x: the current block output (for its shape).

    Returns:
        ``(u, z)`` with the carried summary re-keyed as one pseudo-layer.
    """
    u, z = state
    b, c, h, w = x.shape
    g, d = layer.num_heads, layer.head_dim
    # 1. normalise (no epsilon)
    ubar = (u / z).reshape(b, -1, u.shape[-2], u.shape[-1])  # [B, C_prev, H_prev, W_prev]
    # 2. adapt width and resolution
    if layer.adjust is not None:
        ubar = layer.adjust(ubar)
    # 3. norm
    ubar = layer.norm_u(ubar)  # [B, C, H, W]
    # 4. re-key the summary as one pseudo-layer
    k_u = layer.wk_u(ubar.mean((2, 3))[:, None]).view(b, g, d)
    logit = k_u.norm(dim=-1) * layer.inv_tau.to(x.dtype)
    if layer.clamp is not None:
        logit = logit.clamp(max=layer.clamp)
    z = torch.exp(logit).view(b, g, 1, 1, 1)
    return ubar.view(b, g, d, h, w) * z, z


def as_state(raw: RawState) -> KCLAState:
    """The overflow-safe state of :class:`kcla_mm.ops.KCLA` for raw sums: ``(u / z, log z)``."""
    u, z = raw
    b, g, d, h, w = u.shape
    log_z = torch.log(z.reshape(b, g))
    return KCLAState((u / z).reshape(b, g * d, h, w),
                     log_z.to(torch.promote_types(log_z.dtype, torch.float32)))


def as_raw(state: KCLAState, head_dim: int) -> RawState:
    """Raw sums ``(u, z)`` of a :class:`kcla_mm.ops.KCLAState`."""
    mean, log_z = state
    b, c, h, w = mean.shape
    z = torch.exp(log_z.to(mean.dtype)).view(b, c // head_dim, 1, 1, 1)
    return mean.view(b, c // head_dim, head_dim, h, w) * z, z
