"""Autograd functions of the fused CPU kernels: the training step, the adaptation, the block end.

:class:`FusedStep` computes :meth:`kcla_mm.ops.KCLA.forward` in training as one
autograd node: the pooling and the per-head math (``head_forward``, float64
inside), then :meth:`kcla_mm.ops.KCLA.tail` with a training-mode (or
eval-mode) BatchNorm as ``torch.ops.kcla_mm.train_*`` passes over the feature
maps (``csrc/kcla_train_cpu.cpp``), with the ``[B, C]``-sized algebra
(BatchNorm, gate and drop-path mask folded) in float64 by the ``tail_*`` ops::

    mean = lerp(prev, x, beta)      v = Wv * mean       s = scale v
    o = gamma (s - mu) / sigma + b  out = x + keep relu(o)

BatchNorm's batch statistics of ``s`` come from per-sample sums of ``v`` and
``v^2`` (``s`` is ``v`` times a per-sample, per-channel scale), so neither
``v`` nor ``s`` is ever stored: forward is one statistics pass (which writes
the new mean) and one output pass; backward one pass of gradient sums (batch
statistics only) and one pass that writes ``gx`` and ``gprev``. Saved for
backward: the output ``out``, ``prev`` and ``mean`` (which the neighbouring
blocks keep anyway: the next block saves its input ``out`` for ``conv1``) and
``[B, C]`` vectors, but not ``x``: the backward pass takes ``x`` as ``out``
minus ``keep relu(o)``, recomputed, where it needs it (``x - prev`` for the
gradient of ``beta``), and :class:`ResidualReluPool` (or :class:`BlockEnd`)
keeps a one-bit ReLU mask instead of ``x``. So a step keeps no feature map
beyond its state, and none is recomputed. The exception is the first step
(no ``prev``), whose state is ``x`` itself: it keeps ``x``, and the output is
recomputed by one pass where a later block saved it (see
:func:`kcla_mm.ops.recompute.saved_output_hooks`).

Each direction is one call from Python: ``step_forward`` and ``step_backward``
chain those ops in C++ (a test checks them against the ops called one by one,
bit for bit), which saves the dispatcher and the small ATen ops between them.

:class:`FusedAdapt` does an init layer's adaptation of the incoming state
(``norm_u(adjust(mean))`` and its pool, ``docs/method.md`` section 5) in two passes each way
(``adapt_forward``/``adapt_backward``). :class:`BlockEnd` does a residual
block's end, its last BatchNorm and its shortcut's, the add, the ReLU and
the pool (host ops, where :class:`ResidualReluPool` does the last three):
``block_end_forward``/``block_end_backward``.
"""
from typing import Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..common import member

CL = torch.channels_last


def _cpu_autocast() -> bool:
    if hasattr(torch, 'get_autocast_dtype'):  # torch >= 2.4
        return torch.is_autocast_enabled('cpu')
    return torch.is_autocast_cpu_enabled()


def applicable(norm: nn.Module, x: Tensor, prev: Optional[Tensor], wv_weight: Tensor) -> bool:
    """Whether :class:`FusedStep` computes this step (the caller checks the kernels are built).

    CPU float32 channels-last maps, no autocast, a plain ``BatchNorm2d`` with
    affine parameters and running statistics, and more than one value per
    channel in training mode (else BatchNorm's own error is raised).
    """
    if (x.device.type != 'cpu' or x.dtype != torch.float32 or x.dim() != 4
            or not x.is_contiguous(memory_format=CL) or wv_weight.dtype != torch.float32
            or _cpu_autocast()):
        return False
    if not plain_batchnorm(norm) or (norm.training and x.shape[0] * x.shape[2] * x.shape[3] < 2):
        return False
    return prev is None or (prev.dtype == torch.float32 and prev.shape == x.shape
                            and prev.stride() == x.stride())


def plain_batchnorm(norm: nn.Module) -> bool:
    """A ``BatchNorm2d`` itself (no subclass), affine, with running statistics, in float32."""
    if type(norm) is not nn.BatchNorm2d or not norm.affine:
        return False
    running_mean = member(norm, 'running_mean')
    return (running_mean is not None and member(norm, 'weight').dtype == torch.float32
            and running_mean.dtype == torch.float32)


def _momentum_factor(norm: nn.BatchNorm2d) -> float:
    """Counts the batch and returns the running statistics' update factor, as ``nn.BatchNorm2d``."""
    count = member(norm, 'num_batches_tracked')
    count.add_(1)
    if norm.momentum is None:  # cumulative moving average
        return 1.0 / float(count)
    return float(norm.momentum)


class FusedStep(torch.autograd.Function):
    """A whole KCLA training step by the fused CPU kernels: ``(out, mean, log z')``.

    Inputs: ``layer, x, prev, log_z, wq, wk, phi, keep, wv_weight, weight,
    bias, pooled`` (``prev`` and ``log_z`` ``None`` for the first block; ``keep``
    the drop-path mask ``[B, 1, 1, 1]`` or ``None``; ``pooled``: ``x``'s pool
    from the node that made ``x`` (:class:`BlockEnd` or
    :class:`ResidualReluPool`), or ``None`` to pool here). One autograd node for what
    :meth:`KCLA.forward` computes in training: the global pool of ``x``, the
    per-head math (``head_forward``: ``beta``, the gate times ``z / (z + eps)``
    and ``log z'``, float64 inside) and the tail (the ``train_*`` passes and
    the ``tail_*`` algebra). The backward pass runs the same ops in reverse and
    adds the pool's gradient to ``gx`` in place (or, for a given ``pooled``,
    returns it as ``pooled``'s gradient). One node instead of three
    (pool, per-head math, tail) per block: the autograd engine's and Python's
    fixed cost per node is a large part of a small map's step. The running
    statistics of ``layer.norm`` are updated as ``nn.BatchNorm2d`` does, once.
    """

    @staticmethod
    def forward(ctx, layer: nn.Module, x: Tensor, prev: Optional[Tensor], log_z: Optional[Tensor],
                wq: Tensor, wk: Tensor, phi: Tensor, keep: Optional[Tensor], wv_weight: Tensor,
                weight: Tensor, bias: Tensor, pooled: Optional[Tensor] = None):
        ctx.set_materialize_grads(False)
        norm = member(layer, 'norm')
        b, c, h, w = x.shape
        inv_tau, clamp, eps = (member(layer, 'inv_tau'),
                               -1.0 if layer.clamp is None else layer.clamp, layer.eps)
        running_mean, running_var = member(norm, 'running_mean'), member(norm, 'running_var')
        kv = None if keep is None else keep.reshape(b).float().contiguous()
        factor = _momentum_factor(norm) if norm.training else 0.0
        weight, bias = weight.detach(), bias.detach()
        # the pool and the per-head math (head_forward: beta, the gate times
        # z / (z + eps), log z'), then the tail: mean = lerp(prev, x, beta) and
        # out = x + keep relu(BN(scale Wv(mean))), BatchNorm (batch statistics
        # of s = scale v, or the running ones), gate and drop-path mask folded
        # into keep relu(o) = relu(a v + shift) (tail_coeffs, which updates the
        # running statistics in training): one call (step_forward)
        out, mean, log_z_new, p, flat, sc, sums, a, shift, mu, invstd = (
            torch.ops.kcla_mm.step_forward(x, prev, log_z, wq, wk, inv_tau, phi, clamp, eps,
                                           wv_weight, kv, weight, bias, running_mean,
                                           running_var, norm.training, factor, norm.eps,
                                           None if pooled is None else pooled.detach()))
        if prev is None:
            mean, flat = x, None
        ctx.layer, ctx.bn_training, ctx.pool_given = layer, norm.training, pooled is not None
        ctx.consts = (inv_tau, clamp, eps)
        ctx.vectors = (sums, sc, weight, mu, invstd, a, shift, flat, kv)
        # with a state: out, not x (the next block keeps out anyway; x - prev
        # is taken as out - keep relu(o) - prev in the backward pass); the
        # first step keeps x, its state, and out is recomputed where saved
        ctx.keeps_output = prev is not None
        # the protocol of kcla_mm.ops.recompute.saved_output_hooks: how to
        # recompute the output where a later block saved a copy of it
        ctx.kcla_recompute_output = None if ctx.keeps_output else recompute_output
        ctx.save_for_backward(out if ctx.keeps_output else x, prev, mean, wv_weight, p, log_z,
                              wq, wk, phi)
        return out, mean, log_z_new

    @staticmethod
    @once_differentiable  # the kernels are not differentiable: double backward raises
    def backward(ctx, gy: Optional[Tensor], gmean: Optional[Tensor], glog_z: Optional[Tensor]):
        # out, or x for the first step (see forward)
        x_or_out, prev, mean, wv_weight, p, log_z, wq, wk, phi = ctx.saved_tensors
        sums, sc, weight, mu, invstd, a, shift, flat, kv = ctx.vectors
        # (no gradient for out: the kernels take a zero map)
        gy = torch.zeros_like(mean) if gy is None else gy.contiguous(memory_format=CL)
        if gmean is not None:
            gmean = gmean.contiguous(memory_format=CL)
        if glog_z is not None:
            glog_z = glog_z.float().contiguous()
        # BatchNorm's backward (its batch statistics: sums of the gradient over
        # the batch first) and the gate folded into gv = alpha g + kappa + lam v;
        # gx, gprev and the parameters' gradients; the per-head math's backward,
        # then the pool's (gp / (H W) added to gx at every pixel): one call
        inv_tau, clamp, eps = ctx.consts
        has_prev, has_log_z, pool_given = prev is not None, log_z is not None, ctx.pool_given
        # (the weights' gradients come in their weights' shapes and strides:
        # as little Python as possible after the kernel, which leaves it cold)
        gx, gprev, glz, gwq, gwk, gphi, gwv, gweight, gbias, *gp = (
            torch.ops.kcla_mm.step_backward(
                gy, gmean, glog_z, x_or_out, prev, mean, p, log_z, wq, wk, inv_tau, phi, clamp,
                eps, wv_weight, kv, flat, sc, sums, weight, mu, invstd, a, shift,
                ctx.bn_training, not pool_given, ctx.keeps_output))
        return (None, gx, gprev if has_prev else None, glz if has_log_z else None, gwq, gwk,
                gphi, None, gwv, gweight, gbias, gp[0] if pool_given else None)


class ResidualReluPool(torch.autograd.Function):
    """``x = relu(out + res)`` in place in ``out``, and its global pool: ``(x, pooled)``.

    A residual block's last add and ReLU (``out += res; out.relu_()``, the
    same values) and KCLA's pooling of the block output in one pass
    (``residual_relu_pool_mask_``). The backward pass is one pass too
    (``relu_pool_backward``): ``(gx + gpooled / (H W))`` where ``x > 0``, the
    gradient of both ``out`` and ``res``; it replaces the ReLU's backward and
    the pass that adds the pool's gradient to ``gx``. Saves the ReLU's mask,
    one bit per value (``[B, H, W, ceil(C / 8)]`` uint8), not ``x``: the
    backward pass reads 1/32 of a map instead of one, and ``x`` need not
    outlive the forward pass (:class:`FusedStep` does not keep it either).
    CPU float32 channels-last maps of one shape
    (:func:`.cpu.residual_end` checks).
    """

    @staticmethod
    def forward(ctx, out: Tensor, res: Tensor):
        ctx.set_materialize_grads(False)
        pooled, mask = torch.ops.kcla_mm.residual_relu_pool_mask_(out, res)
        ctx.mark_dirty(out)
        ctx.save_for_backward(mask)
        ctx.shape = out.shape
        return out, pooled

    @staticmethod
    @once_differentiable
    def backward(ctx, gx: Optional[Tensor], gpooled: Optional[Tensor]):
        mask, = ctx.saved_tensors
        if gx is None:
            gx = torch.zeros(ctx.shape, dtype=torch.float32, memory_format=CL)
        g = torch.ops.kcla_mm.relu_pool_backward(
            gx.contiguous(memory_format=CL), None if gpooled is None else gpooled.contiguous(),
            mask)
        return g, g


class BlockEnd(torch.autograd.Function):
    """A residual block's end with its norms: ``(relu(norm(x) + res_norm(res)), its pool)``.

    Inputs: ``norm, res_norm, x, res, weight, bias, res_weight, res_bias``
    (``res_norm`` and its parameters ``None``: ``res`` added as it is). Both
    norms plain ``BatchNorm2d`` (:func:`plain_batchnorm`), in training or
    eval mode (batch statistics, the running ones updated as
    ``nn.BatchNorm2d`` does, once; or the running ones). One node and one pass
    over the map after each norm's statistics pass (``block_end_forward``),
    two passes backward (``block_end_backward``), where the host's BatchNorms,
    add and ReLU and :class:`ResidualReluPool` took nine (eleven with the
    shortcut's norm) forward and eight (eleven) backward. Saves what those
    kept: ``x`` (and ``res`` with its norm; the norms kept their inputs) and
    the ReLU's one-bit mask. The values are those of the torch ops within
    float rounding (the batch statistics are summed otherwise): not bit for
    bit.
    """

    @staticmethod
    def forward(ctx, norm: nn.Module, res_norm: Optional[nn.Module], x: Tensor, res: Tensor,
                weight: Tensor, bias: Tensor, res_weight: Optional[Tensor],
                res_bias: Optional[Tensor]):
        ctx.set_materialize_grads(False)
        factor = _momentum_factor(norm) if norm.training else 0.0
        if res_norm is None:
            res_args = (None, None, None, None, False, 0.0, 1.0)
        else:
            res_args = (res_weight.detach(), res_bias.detach(), member(res_norm, 'running_mean'),
                        member(res_norm, 'running_var'), res_norm.training,
                        _momentum_factor(res_norm) if res_norm.training else 0.0, res_norm.eps)
        out, pooled, mask, mu, invstd, res_mu, res_invstd = torch.ops.kcla_mm.block_end_forward(
            x, res, weight.detach(), bias.detach(), member(norm, 'running_mean'),
            member(norm, 'running_var'), norm.training, factor, norm.eps, *res_args)
        ctx.training = norm.training
        ctx.res_training = res_norm is not None and res_norm.training
        if res_norm is None:
            ctx.save_for_backward(mask, x, weight, mu, invstd)
        else:
            ctx.save_for_backward(mask, x, weight, mu, invstd, res, res_weight, res_mu,
                                  res_invstd)
        return out, pooled

    @staticmethod
    @once_differentiable
    def backward(ctx, gout: Optional[Tensor], gpooled: Optional[Tensor]):
        saved = ctx.saved_tensors
        mask, x, weight, mu, invstd = saved[:5]
        res, res_weight, res_mu, res_invstd = saved[5:] if len(saved) > 5 else (None, ) * 4
        gx, gw, gb, gres, grw, grb = torch.ops.kcla_mm.block_end_backward(
            None if gout is None else gout.contiguous(memory_format=CL),
            None if gpooled is None else gpooled.float().contiguous(), mask, x,
            weight.detach(), mu, invstd, ctx.training, res,
            None if res_weight is None else res_weight.detach(), res_mu, res_invstd,
            ctx.res_training)
        if res is None:
            grw = grb = None
        return None, None, gx, gres, gw, gb, grw, grb


def block_end_applicable(norm: nn.Module, res_norm: Optional[nn.Module], x: Tensor) -> bool:
    """Whether :class:`BlockEnd` computes the block's end (the maps checked elsewhere).

    Both norms plain ``BatchNorm2d`` with float32 parameters, no autocast,
    and in training mode more than one value per channel.
    """
    if _cpu_autocast():
        return False
    for n in (norm, res_norm):
        one_value = x.shape[0] * x.shape[2] * x.shape[3] < 2
        if n is not None and (not plain_batchnorm(n) or (n.training and one_value)):
            return False
    return True


def adapt_applicable(layer: nn.Module, m: Tensor) -> bool:
    """Whether :class:`FusedAdapt` adapts ``m`` for the init layer ``layer`` (kernels aside).

    A CPU float32 channels-last state, no autocast, the layer's ``adjust`` a
    bias-free grouped 1x1 convolution of ``m``'s channels with float32
    weights, and ``norm_u`` a plain ``BatchNorm2d`` as :func:`applicable`
    requires of the norm (more than one value per channel in training mode).
    """
    adjust, norm = layer.adjust, layer.norm_u
    if (adjust is None or m.device.type != 'cpu' or m.dtype != torch.float32 or m.dim() != 4
            or not m.is_contiguous(memory_format=CL) or _cpu_autocast()):
        return False
    if (type(adjust) is not nn.Conv2d or adjust.bias is not None or adjust.kernel_size != (1, 1)
            or adjust.padding != (0, 0) or adjust.dilation != (1, 1)
            or adjust.stride[0] != adjust.stride[1] or adjust.weight.dtype != torch.float32
            or adjust.padding_mode != 'zeros' or m.shape[1] != adjust.in_channels):
        return False
    if not plain_batchnorm(norm):
        return False
    s = adjust.stride[0]
    return not norm.training or m.shape[0] * ((m.shape[2] - 1) // s + 1) * (
        (m.shape[3] - 1) // s + 1) > 1


class FusedAdapt(torch.autograd.Function):
    """An init layer adapting the incoming state by the fused CPU kernels: ``(ubar, pooled)``.

    Inputs: ``layer, m, w, weight, bias`` (the incoming state's mean, the
    ``adjust`` weight, ``norm_u``'s affine parameters). ``ubar =
    norm_u(adjust(m))`` (``docs/method.md`` section 5; BatchNorm with batch statistics in
    training mode, updating the running ones as ``nn.BatchNorm2d`` does, once)
    and its global average pool ``[B, C]``, which the re-keying reads. One node
    and two passes each way (``adapt_forward``, ``adapt_backward``) for
    what took the strided grouped convolution, BatchNorm and the pool, forward
    and backward. Saves ``m`` (which the previous block keeps anyway) and the
    convolution's output ``y`` (as BatchNorm did).
    """

    @staticmethod
    def forward(ctx, layer: nn.Module, m: Tensor, w: Tensor, weight: Tensor, bias: Tensor):
        ctx.set_materialize_grads(False)
        norm = layer.norm_u
        factor = _momentum_factor(norm) if norm.training else 0.0
        stride = layer.adjust.stride[0]
        ubar, y, _, pooled, mu, invstd = torch.ops.kcla_mm.adapt_forward(
            m, w.detach(), stride, weight.detach(), bias.detach(), norm.running_mean,
            norm.running_var, norm.training, factor, norm.eps)
        ctx.stride, ctx.bn_training = stride, norm.training
        ctx.save_for_backward(m, y, w, weight, mu, invstd)
        return ubar, pooled

    @staticmethod
    @once_differentiable
    def backward(ctx, gu: Optional[Tensor], gpooled: Optional[Tensor]):
        m, y, w, weight, mu, invstd = ctx.saved_tensors
        gu = torch.zeros_like(y) if gu is None else gu.contiguous(memory_format=CL)
        if gpooled is not None:
            gpooled = gpooled.float().contiguous()
        # (gw comes as w: dtype, shape and strides)
        gm, gw, gweight, gbias = torch.ops.kcla_mm.adapt_backward(
            gu, gpooled, m, y, w.detach(), ctx.stride, weight.detach(), mu, invstd,
            ctx.bn_training)
        return None, gm, gw, gweight, gbias


def recompute_output(ctx) -> Tensor:
    """The forward output of a first :class:`FusedStep` (no state), recomputed (one pass)."""
    x, _, mean, wv_weight = ctx.saved_tensors[:4]
    a, shift = ctx.vectors[5:7]
    return torch.ops.kcla_mm.train_apply(x, mean, wv_weight, a, shift)
