"""When the fused CPU kernels apply, and how a step is handed to them.

Every rule that decides between the fused kernels and the plain torch ops is
here, decided from the inputs of one call. Each entry point returns ``None``
where the kernels do not apply, and then the caller computes the plain way:

- :func:`kcla_step`: a whole :meth:`kcla_mm.ops.KCLA.forward`. Eval mode
  without autograd: ``torch.ops.kcla_mm.eval_step`` (with an init layer's
  adaptation folded in where it can be). Training with autograd:
  :class:`~.cpu_autograd.FusedAdapt` for an init layer's adaptation, then
  :class:`~.cpu_autograd.FusedStep`.
- :func:`residual_end`: a residual block's last norms, add and ReLU
  (:func:`kcla_mm.ops.residual.residual_end`): ``residual_bn_relu_pool_``
  without autograd in eval mode, :class:`~.cpu_autograd.BlockEnd` /
  :class:`~.cpu_autograd.ResidualReluPool` with autograd.

Common to all: float32 CPU maps in the channels-last layout, plain
``BatchNorm2d`` norms, no autocast, and kernels that built (:mod:`.build`);
``torch.compile`` and JIT tracing never reach here (the seam,
:func:`kcla_mm.ops.config.fused_call`, leaves them the plain ops).

The block-end kernels also return the global pool of the map they write,
which a KCLA step would compute in a pass of its own. The pool is kept here,
keyed by that map's identity and version, for the next :func:`kcla_step` of
the same thread: used once, and only while the map is unchanged, so it can
never stand for another map (:func:`_remember_pool`, :func:`_recall_pool`).
"""
import threading
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..common import _cached_norm_affine, member
from ..kcla_state import KCLAState
from . import build
from .cpu_autograd import (BlockEnd, FusedAdapt, FusedStep, ResidualReluPool, adapt_applicable,
                           applicable, block_end_applicable, plain_batchnorm)

CL = torch.channels_last


def _weight(layer: nn.Module, name: str) -> Tensor:
    """``getattr(layer, name).weight`` by :func:`~kcla_mm.ops.common.member`."""
    return member(member(layer, name), 'weight')


def _foldable(norm: nn.Module) -> bool:
    # an eval-mode BatchNorm with running statistics: one affine per channel
    return (isinstance(norm, nn.modules.batchnorm._BatchNorm) and not norm.training
            and member(norm, 'running_mean') is not None)


def _cpu_float_map(x: Tensor) -> bool:
    # (compiling and tracing are ruled out by the seam, kcla_mm.ops.config.fused_call)
    return (x.device.type == 'cpu' and x.dtype == torch.float32 and x.dim() == 4
            and x.is_contiguous(memory_format=CL))


_POOLS = threading.local()


def _remember_pool(x: Tensor, pooled: Tensor) -> None:
    """Keep ``pooled``, the global pool of ``x`` a block-end kernel computed."""
    _POOLS.last = (weakref.ref(x), x._version, pooled)


def _recall_pool(x: Tensor) -> Optional[Tensor]:
    """The pool kept for ``x`` if ``x`` is that map, unchanged; forgets it either way."""
    last = getattr(_POOLS, 'last', None)
    _POOLS.last = None
    if last is None:
        return None
    ref, version, pooled = last
    return pooled if ref() is x and x._version == version else None


def kcla_step(layer: nn.Module, x: Tensor, state: Optional[KCLAState],
              reuse_state: bool) -> Optional[Tuple[Tensor, KCLAState]]:
    """:meth:`kcla_mm.ops.KCLA.forward` by the fused kernels, or ``None``.

    The caller has checked the arguments' shapes.
    """
    pooled = _recall_pool(x)
    if not _cpu_float_map(x) or torch.is_grad_enabled() != layer.training:
        return None  # eval runs without autograd, training with it
    if not build.available():
        return None
    if state is not None and not state.log_z.is_contiguous():
        state = KCLAState(state.mean, state.log_z.contiguous())  # the kernels read it flat
    if layer.training:
        # a pool is used with the graph of the node that made x and it, whose
        # backward pass then takes the pool's gradient
        given = pooled is not None and pooled.grad_fn is not None and pooled.grad_fn is x.grad_fn
        return _train_step(layer, x, state, pooled if given else None)
    return _eval_step(layer, x, state, reuse_state, pooled)


# -- eval mode, no autograd ------------------------------------------------


def _eval_step(layer: nn.Module, x: Tensor, state: Optional[KCLAState], reuse_state: bool,
               pooled: Optional[Tensor] = None) -> Optional[Tuple[Tensor, KCLAState]]:
    if not _foldable(member(layer, 'norm')) or _weight(layer, 'wv').dtype != torch.float32:
        return None
    if state is not None and state.mean.dtype != torch.float32:
        return None
    if state is not None and not layer.renorm and state.log_z.dtype != torch.float32:
        return None
    if state is not None and layer.renorm:
        if _adapts_in_eval_step(layer, x, state.mean):
            return _call_eval_step(layer, x, state, False, pooled, adapt=True)
        # the plain adaptation (which names what is wrong with the state), then
        # the fused step on the new map, which is owned here
        state, reuse_state = layer.renormalize(state, x), True
        if state.mean.dtype != torch.float32 or state.mean.stride() != x.stride():
            return layer.step(x, state, reuse_state=True)
    elif state is not None and state.mean.stride() != x.stride():
        return None
    return _call_eval_step(layer, x, state, reuse_state, pooled)


def _adapts_in_eval_step(layer: nn.Module, x: Tensor, m: Tensor) -> bool:
    """Whether ``eval_step`` also computes the init layer's ``norm_u(adjust(m))``."""
    return (layer.adjust is not None and _foldable(layer.norm_u) and m.dim() == 4
            and m.shape[1] == layer.prev_channels and m.is_contiguous(memory_format=CL)
            and tuple((n - 1) // layer.stride + 1 for n in m.shape[2:]) == tuple(x.shape[2:]))


def _call_eval_step(layer: nn.Module, x: Tensor, state: Optional[KCLAState], reuse_prev: bool,
                    pooled: Optional[Tensor] = None,
                    adapt: bool = False) -> Tuple[Tensor, KCLAState]:
    """``torch.ops.kcla_mm.eval_step`` with the layer's weights."""
    weight, shift = _cached_norm_affine(member(layer, 'norm'), torch.float32)  # [1, C, 1, 1]
    prev = None if state is None else state.mean
    reuse_prev = reuse_prev and prev is not None and prev is not x
    adj_w = adj_b = wk_u = None
    if adapt:  # norm_u(adjust(m)) = (s_u W) m + b_u, one grouped 1x1 map
        s_u, adj_b = _cached_norm_affine(layer.norm_u, torch.float32)
        adj_w = layer.adjust.weight.flatten(1) * s_u.view(-1, 1)  # [C, C_prev / G]
        wk_u = layer.wk_u.weight
    out, mean, log_z = torch.ops.kcla_mm.eval_step(
        x, prev, None if state is None or adapt else state.log_z, _weight(layer, 'wq'),
        _weight(layer, 'wk'), member(layer, 'inv_tau'), _weight(layer, 'phi'),
        _weight(layer, 'wv'), weight, shift, adj_w, adj_b, wk_u, layer.stride,
        -1.0 if layer.clamp is None else layer.clamp, layer.eps, reuse_prev, False, pooled)
    return out, KCLAState(mean, log_z)


# -- training, with autograd ------------------------------------------------


def _train_step(layer: nn.Module, x: Tensor, state: Optional[KCLAState],
                pooled: Optional[Tensor] = None) -> Optional[Tuple[Tensor, KCLAState]]:
    norm, wv = member(layer, 'norm'), _weight(layer, 'wv')
    if _weight(layer, 'wq').dtype != torch.float32 or not applicable(norm, x, None, wv):
        return None
    if state is not None and layer.renorm:
        state = _train_adapt(layer, state, x)
    if state is not None and (state.log_z.dtype != torch.float32
                              or not applicable(norm, x, state.mean, wv)):
        return layer.step(x, state)
    out, mean, log_z = FusedStep.apply(
        layer, x, None if state is None else state.mean,
        None if state is None else state.log_z, _weight(layer, 'wq'), _weight(layer, 'wk'),
        _weight(layer, 'phi'), member(layer, 'drop_path').keep_mask(x), wv,
        member(norm, 'weight'), member(norm, 'bias'), pooled)
    return out, KCLAState(mean, log_z)


def _train_adapt(layer: nn.Module, state: KCLAState, x: Tensor) -> KCLAState:
    """An init layer's adaptation in training: :class:`FusedAdapt` where it applies."""
    m = state.mean
    if adapt_applicable(layer, m):  # adjust, norm_u and the pool in two passes
        ubar, pooled = FusedAdapt.apply(layer, m, layer.adjust.weight, layer.norm_u.weight,
                                        layer.norm_u.bias)
        return layer.rekey(ubar, x, pooled)
    return layer.renormalize(state, x)


# -- a residual block's end ---------------------------------------------------


def _hooked(*modules: Optional[nn.Module]) -> bool:
    """Whether calling one of ``modules`` would run a hook, its own or a global one.

    NOTE: torch has no public query for registered hooks; this reads the
    module's and torch's hook tables. A norm applied inside a kernel skips its
    module call, so a hooked norm is run as a module instead; a hooked
    producer of ``x`` may hold ``x``, which the eval kernel would overwrite.
    """
    m = nn.modules.module
    if (m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
            or m._global_backward_pre_hooks):
        return True
    return any(mod is not None and (mod._forward_hooks or mod._forward_pre_hooks
                                    or mod._backward_hooks or mod._backward_pre_hooks)
               for mod in modules)


def _fusable_maps(x: Tensor, res: Tensor) -> bool:
    # the block-end kernels' maps: float32 channels-last CPU maps of one shape
    return (_cpu_float_map(x) and res.device.type == 'cpu' and res.dtype == torch.float32
            and x.shape == res.shape and x.numel() > 0
            and res.is_contiguous(memory_format=CL) and x.data_ptr() != res.data_ptr())


def _batchnorm_tensors(norm: nn.Module) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return (member(norm, 'weight'), member(norm, 'bias'), member(norm, 'running_mean'),
            member(norm, 'running_var'))


def _eval_batchnorm(norm: Optional[nn.Module]) -> bool:
    return norm is not None and plain_batchnorm(norm) and not norm.training


def residual_end(x: Tensor, res: Tensor, norm: Optional[nn.Module],
                 res_norm: Optional[nn.Module], producer: Optional[nn.Module] = None
                 ) -> Optional[Tensor]:
    """:func:`kcla_mm.ops.residual.residual_end` by the fused kernels, or ``None``.

    - without autograd, eval-mode norms: one pass
      (``residual_bn_relu_pool_``), the torch ops' values bit for bit; ``x``
      (the last convolution's output) is overwritten, so not where
      ``producer``, the module that made ``x``, is hooked;
    - with autograd, in training or eval mode: :class:`BlockEnd` (values
      within float rounding: its batch statistics are summed otherwise),
      or :class:`ResidualReluPool` without norms; both keep the ReLU's
      one-bit mask instead of its output.
    """
    if not _fusable_maps(x, res) or not build.available():
        return None
    if _hooked(norm, res_norm):
        return None
    if not torch.is_grad_enabled():
        if (_eval_batchnorm(norm) and (res_norm is None or _eval_batchnorm(res_norm))
                and not _hooked(producer)):
            res_args = ((None, None, None, None, 1.0) if res_norm is None else
                        (*_batchnorm_tensors(res_norm), res_norm.eps))
            _remember_pool(x, torch.ops.kcla_mm.residual_bn_relu_pool_(
                x, res, *_batchnorm_tensors(norm), norm.eps, *res_args))
            return x
        if norm is None and res_norm is None and not _hooked(producer):
            _remember_pool(x, torch.ops.kcla_mm.residual_relu_pool_(x, res))
            return x
        return None
    out = pooled = None
    if norm is None and res_norm is None:
        if x.requires_grad or res.requires_grad:
            out, pooled = ResidualReluPool.apply(x, res)
    elif norm is not None and block_end_applicable(norm, res_norm, x):
        out, pooled = BlockEnd.apply(
            norm, res_norm, x, res, member(norm, 'weight'), member(norm, 'bias'),
            None if res_norm is None else member(res_norm, 'weight'),
            None if res_norm is None else member(res_norm, 'bias'))
    if out is not None:
        _remember_pool(out, pooled)
    return out
