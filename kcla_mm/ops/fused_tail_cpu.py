"""The training step of KCLA's tail by the fused CPU kernels (pure torch + torch.ops).

:class:`FusedTail` computes :meth:`kcla_mm.ops.KCLA.tail` with a training-mode
(or eval-mode) BatchNorm as ``torch.ops.kcla_mm.train_*`` passes over the
feature maps (``csrc/kcla_train_cpu.cpp``), with the ``[B, C]``-sized algebra
(BatchNorm, gate and drop-path mask folded) in float64 by the ``tail_*`` ops::

    mean = lerp(prev, x, beta)      v = Wv * mean       s = scale v
    o = gamma (s - mu) / sigma + b  out = x + keep relu(o)

BatchNorm's batch statistics of ``s`` come from per-sample sums of ``v`` and
``v^2`` (``s`` is ``v`` times a per-sample, per-channel scale), so neither
``v`` nor ``s`` is ever stored: forward is one statistics pass (which writes
the new mean) and one output pass; backward one pass of gradient sums (batch
statistics only) and one pass that writes ``gx`` and ``gprev``. Saved for
backward: ``x``, ``prev`` and ``mean`` (which the neighbouring blocks keep
anyway) and ``[B, C]`` vectors; the output is recomputed by one pass where a
later block saved it (see :func:`kcla_mm.ops.kcla.saved_output_hooks`).
"""
from typing import Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

CL = torch.channels_last


def _cpu_autocast() -> bool:
    if hasattr(torch, 'get_autocast_dtype'):  # torch >= 2.4
        return torch.is_autocast_enabled('cpu')
    return torch.is_autocast_cpu_enabled()


def applicable(norm: nn.Module, x: Tensor, prev: Optional[Tensor], wv_weight: Tensor) -> bool:
    """Whether :class:`FusedTail` computes this tail (the caller checks the kernels are built).

    CPU float32 channels-last maps, no autocast, a plain ``BatchNorm2d`` with
    affine parameters and running statistics, and more than one value per
    channel in training mode (else BatchNorm's own error is raised).
    """
    if (x.device.type != 'cpu' or x.dtype != torch.float32 or x.dim() != 4
            or not x.is_contiguous(memory_format=CL) or wv_weight.dtype != torch.float32
            or _cpu_autocast()):
        return False
    if type(norm) is not nn.BatchNorm2d or not norm.affine or norm.running_mean is None:
        return False
    if norm.weight.dtype != torch.float32 or norm.running_mean.dtype != torch.float32:
        return False
    if norm.training and x.shape[0] * x.shape[2] * x.shape[3] < 2:
        return False
    return prev is None or (prev.dtype == torch.float32 and prev.shape == x.shape
                            and prev.stride() == x.stride())


def _momentum_factor(norm: nn.BatchNorm2d) -> float:
    """Counts the batch and returns the running statistics' update factor, as ``nn.BatchNorm2d``."""
    norm.num_batches_tracked.add_(1)
    if norm.momentum is None:  # cumulative moving average
        return 1.0 / float(norm.num_batches_tracked)
    return float(norm.momentum)


class FusedTail(torch.autograd.Function):
    """``(out, mean)`` of :meth:`KCLA.tail` in training, by the fused CPU kernels.

    Inputs as :meth:`KCLA.tail`: ``layer, x, prev, beta, scale, keep, wv_weight,
    weight, bias``; ``beta``, ``scale`` ``[B, C, 1, 1]``, ``keep`` ``[B, 1, 1, 1]``
    or ``None``. The running statistics of ``layer.norm`` are updated as
    ``nn.BatchNorm2d`` does, once.
    """

    @staticmethod
    def forward(ctx, layer: nn.Module, x: Tensor, prev: Optional[Tensor], beta: Optional[Tensor],
                scale: Tensor, keep: Optional[Tensor], wv_weight: Tensor, weight: Tensor,
                bias: Tensor):
        ops = torch.ops.kcla_mm
        norm = layer.norm
        b, c, h, w = x.shape
        n = b * h * w
        flat = None if beta is None else beta.reshape(b, c).contiguous()
        mean, sums = ops.train_stats(x, prev, flat, wv_weight)  # sums: [B, 2, C] float64
        if prev is None:
            mean = x
        sc = scale.detach().reshape(b, c).contiguous()
        kv = None if keep is None else keep.reshape(b).float().contiguous()
        weight = weight.detach()
        factor = _momentum_factor(norm) if norm.training else 0.0
        # BatchNorm (batch statistics of s = sc v, or the running ones), gate and
        # drop-path mask folded: keep relu(o) = relu(a v + shift); updates the
        # running statistics in training
        a, shift, mu, invstd = ops.tail_coeffs(sums, sc, kv, weight, bias.detach(),
                                               norm.running_mean, norm.running_var,
                                               norm.training, factor, norm.eps, n)
        ctx.layer, ctx.bn_training, ctx.n = layer, norm.training, n
        ctx.vectors = (sums, sc, weight, mu, invstd, a, shift, flat, kv)
        ctx.save_for_backward(x, prev, mean, wv_weight)
        out = ops.train_apply(x, mean, wv_weight, a, shift)
        return out, mean

    @staticmethod
    @once_differentiable  # the kernels are not differentiable: double backward raises
    def backward(ctx, gy: Tensor, gmean: Optional[Tensor]):
        ops = torch.ops.kcla_mm
        x, prev, mean, wv_weight = ctx.saved_tensors
        sums, sc, weight, mu, invstd, a, shift, flat, kv = ctx.vectors
        b, c = x.shape[:2]
        gy = gy.contiguous(memory_format=CL)
        if gmean is not None:
            gmean = gmean.contiguous(memory_format=CL)
        # gv = alpha g + kappa + lam v (BatchNorm's batch statistics: sums of the
        # gradient over the batch first)
        stats = (ops.train_grad_stats(gy, mean, wv_weight, a, shift, kv) if ctx.bn_training
                 else None)
        alpha, kappa, lam, qr = ops.tail_grad_coeffs(stats, sc, weight, mu, invstd, ctx.n)
        gx, gprev, gbeta, gwv, r = ops.train_backward(gy, gmean, x, prev, mean, flat, wv_weight,
                                                      a, shift, kv, alpha, kappa, lam)
        gweight, gbias, gscale = ops.tail_param_grads(r, sums, sc, weight, mu, invstd, qr)
        dt = x.dtype
        return (None, gx, gprev if prev is not None else None,
                None if prev is None else gbeta.to(dt).view(b, c, 1, 1),
                gscale.view(b, c, 1, 1), None, gwv.to(dt).view_as(wv_weight), gweight, gbias)


class HeadMath(torch.autograd.Function):
    """The per-head math of a KCLA step by ``torch.ops.kcla_mm.head_forward``.

    From the pooled block output ``p`` ``[B, C]`` and the incoming ``log z``
    ``[B, G]`` (``None`` for the first block): ``(beta, scale, log z')``, as
    :meth:`KCLA.forward` computes them (``beta`` and ``scale`` per channel,
    ``[B, C]``; ``beta`` is ``None`` without a state). Computed in float64 in
    one op each way instead of about 25 small autograd ops; gradients for
    ``p``, ``log z``, ``Wq``, ``Wk`` and ``Phi``.
    """

    @staticmethod
    def forward(ctx, layer: nn.Module, p: Tensor, log_z: Optional[Tensor], wq: Tensor,
                wk: Tensor, phi: Tensor):
        ctx.consts = (layer.inv_tau, -1.0 if layer.clamp is None else layer.clamp, layer.eps)
        ctx.save_for_backward(p, log_z, wq, wk, phi)
        inv_tau, clamp, eps = ctx.consts
        beta, scale, log_z_new = torch.ops.kcla_mm.head_forward(p, log_z, wq, wk, inv_tau, phi,
                                                                clamp, eps)
        return (None if log_z is None else beta), scale, log_z_new

    @staticmethod
    @once_differentiable
    def backward(ctx, gbeta: Optional[Tensor], gscale: Optional[Tensor],
                 glog_z: Optional[Tensor]):
        p, log_z, wq, wk, phi = ctx.saved_tensors
        inv_tau, clamp, eps = ctx.consts
        gp, glz, gwq, gwk, gphi = torch.ops.kcla_mm.head_backward(
            p, log_z, wq, wk, inv_tau, phi, clamp, eps,
            *(None if g is None else g.float().contiguous() for g in (gbeta, gscale, glog_z)))
        return (None, gp, None if log_z is None else glz, gwq.view_as(wq), gwk.view_as(wk),
                gphi.view_as(phi))


def recompute_output(ctx) -> Tensor:
    """The forward output of a :class:`FusedTail` node, recomputed (one pass)."""
    x, _, mean, wv_weight = ctx.saved_tensors
    a, shift = ctx.vectors[5:7]
    return torch.ops.kcla_mm.train_apply(x, mean, wv_weight, a, shift)
