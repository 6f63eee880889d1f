"""The memory-saving recomputation of KCLA's feature-map tail in training.

:class:`RecomputedTail` computes :meth:`kcla_mm.ops.KCLA.tail` (the state
update, ``Wv``, the gate, the norm, ReLU, drop path and the residual add)
keeping only its inputs for the backward pass, and recomputes the rest there:
about 2.5x less activation memory per block for one more depthwise
convolution. :func:`saved_output_hooks` goes one step further for the module
that consumes a step's output. Values and gradients are those of plain
autograd (tested against :mod:`kcla_mm.ops.kcla_reference`).

This is device-agnostic plain torch, used on every device where the norm is a
plain ``BatchNorm2d`` (see :func:`recomputable`). The hand-derived backward is
used on the CPU in float32/float64 without autocast; elsewhere the
recomputation is replayed through autograd. :func:`autograd_replay` forces the
replay (to check one against the other).
"""
import contextlib
import weakref
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import compiling

_ANALYTIC_BACKWARD = True


@contextlib.contextmanager
def autograd_replay() -> Iterator[None]:
    """Inside the block, recomputed tails replay their forward through autograd.

    The replay is what runs under autocast and on CUDA; on the CPU without
    autocast the hand-derived backward runs by default. Same values either way.
    """
    global _ANALYTIC_BACKWARD
    before, _ANALYTIC_BACKWARD = _ANALYTIC_BACKWARD, False
    try:
        yield
    finally:
        _ANALYTIC_BACKWARD = before


def recomputable(norm: nn.Module) -> bool:
    """Whether a tail with this output norm is recomputed in training."""
    # SyncBN would all-reduce again when recomputed, GroupNorm is cheap to keep
    return type(norm) is nn.BatchNorm2d and norm.affine


def _autocast_state(device_type: str):
    if hasattr(torch, 'get_autocast_dtype'):  # torch >= 2.4
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == 'cuda':
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()


def _like(grad: Optional[Tensor], t: Tensor) -> Optional[Tensor]:
    """``grad`` in the memory format of ``t`` (a copy only where they differ).

    Some backward kernels (the depthwise convolution's on small maps) return
    NCHW gradients for channels-last inputs; passed on, they make every later
    element-wise op of the backward pass mix layouts and run several times slower.
    """
    if (grad is not None and t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
            and not t.is_contiguous()):
        return grad.contiguous(memory_format=torch.channels_last)
    return grad


class RecomputedTail(torch.autograd.Function):
    """:meth:`KCLA.tail` that keeps only its inputs for the backward pass.

    The tail creates four feature maps per block (the new mean, ``Wv`` of it,
    the gated values and the normalised output); autograd would keep all of
    them until the backward pass. This keeps the inputs (the block output is
    kept by the block's own ReLU anyway, the incoming mean by the previous
    block) and recomputes the tail in the backward pass: one extra depthwise
    convolution and a few element-wise passes, for about 2.5x less activation
    memory per block. BatchNorm running statistics are updated once, in the
    forward pass; the recomputation uses the same batch statistics.
    """

    @staticmethod
    def forward(ctx, layer: nn.Module, *args):
        ctx.layer = layer
        ctx.kcla_recomputed_tail = True  # (found by saved_output_hooks through the output)
        ctx.device_type = args[0].device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        # the hand-derived backward (one recomputation, no autograd graph, few
        # temporaries); under autocast the dtype of every op would have to be
        # replayed, so there the recomputation goes through autograd instead
        # (CPU only: on CUDA the forward's BatchNorm is cuDNN's, whose batch
        # statistics the native kernels of the derivation would not reproduce
        # bit for bit; the replay calls the same kernels as the forward)
        ctx.analytic = (_ANALYTIC_BACKWARD and not ctx.autocast[0] and ctx.device_type == 'cpu'
                        and args[0].dtype in (torch.float32, torch.float64))
        ctx.bn_training = layer.norm.training
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return layer.tail(*args)

    @staticmethod
    def backward(ctx, grad_out, grad_mean):
        if ctx.analytic:
            return (None, ) + _analytic_backward(ctx, grad_out, grad_mean)
        inputs, out, mean = _recomputed(ctx)
        ctx.kcla_recomputed = None  # the graph of the recomputation is used once
        outs, grads = [out], [grad_out]
        if grad_mean is not None and mean.requires_grad:
            outs.append(mean)
            grads.append(grad_mean)
        differentiable = [t for t in inputs if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(outs, differentiable, grads, allow_unused=True))
        return (None, ) + tuple(_like(next(got), t) if t is not None and t.requires_grad
                                else None for t in inputs)


def _recomputed(ctx) -> Tuple[list, Tensor, Tensor]:
    """``(inputs, out, mean)`` of a :class:`RecomputedTail` node, recomputed with a graph.

    Computed once per backward pass: the first caller (the unpacking of a saved
    copy of ``out``, see :func:`saved_output_hooks`, or the node's own
    backward) computes, the node's backward releases it.
    """
    cached = getattr(ctx, 'kcla_recomputed', None)
    if cached is not None:
        return cached
    inputs = [None if t is None else t.detach().requires_grad_(t.requires_grad)
              for t in ctx.saved_tensors]
    enabled, dtype = ctx.autocast
    with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
        out, mean = ctx.layer.tail(*inputs, recompute=True)
    ctx.kcla_recomputed = (inputs, out, mean)
    return ctx.kcla_recomputed


class _SavedOutput:
    """Stands for a saved copy of a :class:`RecomputedTail` output (see below)."""

    __slots__ = ('node', )

    def __init__(self, node) -> None:
        self.node = node


def _unpack(saved):
    if isinstance(saved, _SavedOutput):
        ctx = saved.node
        recompute = getattr(ctx, 'kcla_recompute_output', None)
        if recompute is not None:
            # a fast path's own recomputation, done once for all saved copies
            # (a stage's first block saves its input for conv1 and the
            # downsample): kept from the first unpacking to the last
            out = getattr(ctx, 'kcla_output', None)
            if out is None:
                out = recompute(ctx)
            ctx.kcla_saved_copies -= 1
            ctx.kcla_output = out if ctx.kcla_saved_copies > 0 else None
            return out
        if ctx.analytic:
            return _parts(ctx).output()
        return _recomputed(ctx)[1].detach()
    return saved


class _TailParts:
    """The feature maps of a recomputed KCLA tail (no autograd graph).

    ``mean`` (the new state), ``v = Wv(mean)``, ``s = v * scale`` (the norm's
    input), ``o = norm(s)`` and the norm's saved statistics.
    """

    __slots__ = ('inputs', 'mean', 'v', 's', 'o', 'save_mean', 'save_invstd')

    def __init__(self, ctx) -> None:
        layer = ctx.layer
        x, prev, beta, scale, keep, wv_weight, weight, bias = self.inputs = ctx.saved_tensors
        norm = layer.norm
        with torch.no_grad():
            self.mean = x if prev is None else torch.lerp(prev, x, beta)
            self.v = F.conv2d(self.mean, wv_weight, padding=1, groups=layer.channels)
            self.s = self.v * scale
            if ctx.bn_training:  # the batch statistics of the forward pass
                self.o, self.save_mean, self.save_invstd = torch.ops.aten.native_batch_norm(
                    self.s, weight, bias, None, None, True, 0.0, norm.eps)
            else:
                self.o, self.save_mean, self.save_invstd = torch.ops.aten.native_batch_norm(
                    self.s, weight, bias, norm.running_mean, norm.running_var, False, 0.0,
                    norm.eps)

    def output(self) -> Tensor:
        """``x + keep * relu(o)``, the forward output (recomputed, not kept)."""
        x, keep = self.inputs[0], self.inputs[4]
        with torch.no_grad():
            r = F.relu(self.o)
            if keep is not None:
                r.mul_(keep)
            return r.add_(x)


def _parts(ctx) -> _TailParts:
    parts = getattr(ctx, 'kcla_parts', None)
    if parts is None:
        parts = ctx.kcla_parts = _TailParts(ctx)
    return parts


def _sum_hw(t: Tensor) -> Tensor:
    return t.sum((2, 3), keepdim=True)


def _analytic_backward(ctx, gy: Tensor, gmean: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
    """Gradients of :meth:`KCLA.tail` for the inputs of :class:`RecomputedTail`.

    ``mean = lerp(prev, x, beta)``, ``v = Wv * mean``, ``s = v scale``,
    ``o = BN(s)``, ``y = x + keep relu(o)``; every temporary is released (or
    reused in place) as soon as it is consumed.
    """
    p = _parts(ctx)
    ctx.kcla_parts = None
    x, prev, beta, scale, keep, wv_weight, weight, bias = p.inputs
    norm = ctx.layer.norm
    needs = ctx.needs_input_grad[1:]  # (x, prev, beta, scale, keep, wv_weight, weight, bias)
    gy = _like(gy, x)
    g = gy * keep if keep is not None else gy
    g = torch.ops.aten.threshold_backward(g, p.o, 0)  # d relu
    p.o = None
    train = ctx.bn_training
    gs, gw, gb = torch.ops.aten.native_batch_norm_backward(
        g, p.s, weight, None if train else norm.running_mean,
        None if train else norm.running_var, p.save_mean, p.save_invstd, train, norm.eps,
        [True, needs[6], needs[7]])
    del g
    p.s = None
    gscale = _sum_hw(p.v.mul_(gs)) if needs[3] else None  # d(v scale)/d scale
    p.v = None
    gv = gs.mul_(scale)
    gm, gwv, _ = torch.ops.aten.convolution_backward(
        gv, p.mean, wv_weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], ctx.layer.channels,
        [True, needs[5], False])
    del gv
    if gmean is not None:
        gm.add_(_like(gmean, x))
    if prev is None:  # mean = x
        return (gm.add_(gy), None, None, gscale, None, gwv, gw, gb)
    gbeta = _sum_hw(torch.sub(x, prev).mul_(gm)) if needs[2] else None
    gx = torch.addcmul(gy, gm, beta) if needs[0] else None
    gprev = gm.mul_(1 - beta) if needs[1] else None
    return (gx, gprev, gbeta, gscale, None, gwv, gw, gb)


def saved_output_hooks(y: Tensor):
    """Context for the module that consumes ``y``, the output of a KCLA step.

    The next block of a backbone saves its input ``y`` for its own backward pass
    (``conv1``, the downsample). When ``y`` comes from the recomputed training
    path, those saved copies are replaced by a reference to the KCLA node, and
    the backward pass recomputes ``y`` from the node's inputs (which stay saved
    anyway); the node's own backward then reuses that recomputation, so nothing
    is computed twice. Saves one feature map per block (the values and the
    gradients are those of plain autograd).

    Returns a null context where this does not apply: ``y`` is not such an
    output (eval mode, another operator, ``torch.compile``), the step keeps
    ``y`` itself (a fast path that keeps its output instead of its input),
    or other saved-tensor hooks are active
    (activation checkpointing, CPU offloading: an inner hook would hide
    their packing from them).
    """
    if compiling() or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    node = y.grad_fn
    # a node that can recompute its output: ours, or a fast path's that sets
    # ``kcla_recompute_output`` (a function of the node)
    if (getattr(node, 'kcla_recompute_output', None) is None
            and not getattr(node, 'kcla_recomputed_tail', False)):
        return contextlib.nullcontext()
    # NOTE: torch has no public query for active saved-tensor hooks; this
    # private one is read where it exists (a newer torch without it skips it)
    top = getattr(torch._C._autograd, '_top_saved_tensors_default_hooks', None)
    if top is not None and top(False) is not None:
        return contextlib.nullcontext()

    # weak references only: autograd keeps the hooks with every tensor they
    # pack, so a strong reference to y or its node here would keep y alive
    y_ref, node_ref, version = weakref.ref(y), weakref.ref(node), y._version

    def pack(t: Tensor):
        if t is y_ref() and t._version == version:
            node = node_ref()
            node.kcla_saved_copies = getattr(node, 'kcla_saved_copies', 0) + 1
            return _SavedOutput(node)
        # autograd re-attaches the graph on unpacking; the tensor itself would
        # make a reference cycle (an op's saved output -> its node -> the
        # output) that is never freed
        return t.detach()

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
