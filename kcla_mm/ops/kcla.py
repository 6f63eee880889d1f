"""Key-Correlated Layer Attention (KCLA), the per-block operator.

Paper: "Enhancing Layer Interaction Using Key-Correlated Layer Attention"
(Xiong, Xie, Yu, He, He; arXiv 2606.28405). Numerics follow the authors'
reference code as fixed by ``shared/design/kcla.md`` (sections 4-6), so that
reference checkpoints load and give the same outputs.

Keys of different layers are nearly collinear, so the layer-attention logit
factors into ``(|q| cos theta) * |k|``. With the query term replaced by a fixed
per-head temperature, the softmax over layers is a running weighted mean of
the block outputs: constant memory, linear time. The value transform is
applied once to that mean, and a learnable map ``Phi`` of the per-head
query-key scores gates the heads.

State contract (see :class:`KCLAState`): ``forward(x, state) -> (out, state)``
with ``state=None`` for the very first block of the network. A layer built with
``renorm=True`` (the *init layer* of a stage, spec section 5) re-normalises an
incoming state, adapting its width and resolution, and re-keys it as a single
pseudo-layer.
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import (BlockPosition, DropPath, NormLayer, check_batch, check_drop_path, check_heads,
                      check_input, compute_dtype, eca, eca_conv, fold_norm, per_channel, pooled_qk,
                      value_conv)


class KCLAState(NamedTuple):
    """Recurrent state of KCLA, stored in a form that cannot overflow.

    The reference keeps raw sums ``u = sum_s w_s x_s`` and ``z = sum_s w_s``,
    which exceed the fp16 range after a few blocks (``w`` reaches ``e^10``).
    This state keeps the normalised mean and the log of the normaliser
    instead, updated with the online-softmax (log-sum-exp) rule; ``u`` and ``z``
    are recovered exactly as ``u = mean * exp(log_z)``, ``z = exp(log_z)``.

    Attributes:
        mean: ``u / z``, the softmax-weighted mean of block outputs,
            ``[B, C, H, W]`` in the dtype of the features.
        log_z: ``log z`` per head, ``[B, G]``, always float32.
    """

    mean: Tensor
    log_z: Tensor

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


def log_uniform_inverse_temperatures(num_heads: int,
                                     temperature_range: Tuple[float, float]) -> Tensor:
    """``seq_g = 1 / tau_g``, log-uniform from ``lo`` to ``hi`` over the heads.

    With the default range ``(0.7, 1/0.7)``, ``tau_0 = 1/0.7`` and
    ``tau_{G-1} = 0.7`` (spec section 4). Returns ``[G]`` float64.
    """
    lo, hi = temperature_range
    return torch.exp(torch.linspace(math.log(lo), math.log(hi), num_heads,
                                    dtype=torch.float64))


class KCLA(nn.Module):
    """KCLA layer for one block of ``channels`` channels.

    Args:
        channels: width ``C`` of the block output.
        head_dim: channels per head ``d``; ``C`` must be divisible by it.
        temperature_range: ``(lo, hi)`` of the log-uniform sequence of inverse
            temperatures ``1 / tau_g``; both positive and finite.
        clamp: upper bound on the logit ``|k| / tau`` before the exponential
            (reference: 10). ``None`` disables it (for the property tests).
        eps: the ``+eps`` in ``xbar = u / (z + eps)`` (reference: 1e-3).
        drop_path: stochastic-depth rate of the attention branch.
        norm_layer: builds the output norm (and ``norm_u``) for a width.
        renorm: whether this is an init layer (spec section 5) that
            re-normalises an incoming state.
        prev_channels: width of the state arriving at an init layer; when it
            differs from ``channels`` or ``stride != 1`` the layer owns the
            grouped 1x1 ``adjust`` convolution.
        stride: resolution change between the incoming state and ``x``.

    Shapes:
        x: ``[B, C, H, W]``; out: ``[B, C, H, W]``; state: :class:`KCLAState`.
    """

    def __init__(self,
                 channels: int,
                 head_dim: int = 64,
                 temperature_range: Tuple[float, float] = (0.7, 1 / 0.7),
                 clamp: Optional[float] = 10.0,
                 eps: float = 1e-3,
                 drop_path: float = 0.0,
                 norm_layer: NormLayer = nn.BatchNorm2d,
                 renorm: bool = False,
                 prev_channels: Optional[int] = None,
                 stride: int = 1) -> None:
        super().__init__()
        self.channels = channels
        self.head_dim = head_dim
        self.num_heads = check_heads(channels, head_dim)
        lo, hi = (float(v) for v in temperature_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi > 0):
            raise ValueError('temperature_range must hold two positive finite numbers, '
                             f'got temperature_range={tuple(temperature_range)!r}')
        if clamp is not None and not clamp > 0:
            raise ValueError(f'clamp must be positive or None, got clamp={clamp!r}')
        if not eps > 0:
            raise ValueError(f'eps must be positive, got eps={eps!r}')
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f'stride must be a positive int, got stride={stride!r}')
        self.temperature_range = (lo, hi)
        self.clamp = None if clamp is None else float(clamp)
        self.eps = float(eps)
        self.renorm = bool(renorm)
        self.prev_channels = channels if prev_channels is None else prev_channels
        self.stride = stride

        self.wq = eca_conv(channels)
        self.wk = eca_conv(channels)
        self.wv = value_conv(channels)
        self.norm = norm_layer(channels)
        self.phi = nn.Linear(self.num_heads, self.num_heads, bias=False)
        self.drop_path = DropPath(check_drop_path(drop_path))
        # NOTE: the reference stores the temperatures as a frozen Parameter
        # ``norm_d``; they are a fixed function of (G, temperature_range), so
        # here they are a non-persistent buffer and the converter checks them.
        # Kept in float64 whatever the module's dtype (see ``_apply``), so that
        # ``.half()``/``.float()`` never round the temperatures.
        self.register_buffer(
            'inv_tau', log_uniform_inverse_temperatures(self.num_heads, self.temperature_range),
            persistent=False)

        self.adjust = self.wk_u = self.norm_u = None
        if self.renorm:
            if self.prev_channels != channels or stride != 1:
                if self.prev_channels % self.num_heads:
                    raise ValueError(
                        f'prev_channels={self.prev_channels} is not divisible by the '
                        f'{self.num_heads} heads of a {channels}-channel KCLA layer')
                self.adjust = nn.Conv2d(self.prev_channels, channels, 1, stride=stride,
                                        groups=self.num_heads, bias=False)
            self.wk_u = eca_conv(channels)
            self.norm_u = norm_layer(channels)
        self.reset_parameters()

    @classmethod
    def for_position(cls, channels: int, position: BlockPosition,
                     renorm_blocks: Tuple[int, ...] = (0, 11), **kwargs) -> 'KCLA':
        """Build the layer for a block of a backbone.

        The first block of the network never receives a state, so it is not an
        init layer. NOTE: the reference also creates (unused) init modules
        there and an unused ``adjust_channel`` at block 11; they are not
        created here, so DDP sees no unused parameters, and the converter
        drops them.
        """
        renorm = position.prev_channels is not None and position.block in tuple(renorm_blocks)
        return cls(channels, renorm=renorm,
                   prev_channels=position.prev_channels if position.stage_start else channels,
                   stride=position.stride if position.stage_start else 1, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self.inv_tau = self.inv_tau.to(self.wq.weight.device, torch.float64)
        return self

    def reset_parameters(self) -> None:
        """Reference initialisation: Xavier for Wq, Wk, Phi, Wk_u; Kaiming for convs."""
        for m in (self.wq, self.wk, self.phi, self.wk_u):
            if m is not None:
                nn.init.xavier_uniform_(m.weight)
        nn.init.kaiming_normal_(self.wv.weight, mode='fan_out', nonlinearity='relu')
        if self.adjust is not None:
            nn.init.kaiming_normal_(self.adjust.weight, mode='fan_out', nonlinearity='relu')
        for n in (self.norm, self.norm_u):
            if n is not None and getattr(n, 'weight', None) is not None:
                nn.init.ones_(n.weight)
                nn.init.zeros_(n.bias)

    # -- the pieces, public so that tests and analysis tools can use them --

    def keys(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Queries and keys of ``x``: each ``[B, G, d]`` float32."""
        return pooled_qk(x, self.wq, self.wk, self.num_heads)

    def logits(self, k: Tensor) -> Tensor:
        """Weight logits ``min(|k_g| / tau_g, clamp)`` from keys ``[B, G, d]``: ``[B, G]``."""
        logit = k.norm(dim=-1) * self.inv_tau.to(k.dtype)
        return logit if self.clamp is None else logit.clamp(max=self.clamp)

    def gate(self, q: Tensor, k: Tensor) -> Tensor:
        """Per-head gate ``sigmoid(Phi(<q, k> / |k|))``: ``[B, G]`` in the dtype of ``q``."""
        # NOTE: |k| is clamped away from 0 (the reference divides by it as is),
        # so an all-zero key gives a score of 0 instead of NaN.
        h = (q * k).sum(-1) / k.norm(dim=-1).clamp_min(1e-12)  # [B, G]
        with torch.autocast(device_type=q.device.type, enabled=False):
            return torch.sigmoid(F.linear(h, self.phi.weight.to(h.dtype)))

    def renormalize(self, state: KCLAState, x: Tensor) -> KCLAState:
        """Spec section 5: adapt an incoming state and re-key it as one pseudo-layer."""
        ubar = state.mean  # [B, C_prev, H_prev, W_prev] = u / z, no epsilon
        if self.adjust is not None:
            if ubar.shape[1] != self.prev_channels:
                raise ValueError(
                    f'KCLA init layer expects a state of {self.prev_channels} channels, '
                    f'got {ubar.shape[1]}')
            ubar = self.adjust(ubar)  # [B, C, H, W]
        ubar = self.norm_u(ubar)
        if ubar.shape[1:] != x.shape[1:]:
            raise ValueError(
                f'KCLA init layer: the adapted state has shape {tuple(ubar.shape[1:])} but '
                f'the block output has shape {tuple(x.shape[1:])}; check prev_channels='
                f'{self.prev_channels} and stride={self.stride}')
        b = ubar.shape[0]
        with torch.autocast(device_type=ubar.device.type, enabled=False):
            k_u, = eca(ubar.mean((2, 3), dtype=compute_dtype(ubar.dtype)), self.wk_u)
        # u = ubar * z  =>  u / z = ubar
        return KCLAState(ubar, self.logits(k_u.view(b, self.num_heads, self.head_dim)))

    def accumulate(self, x: Tensor, logit: Tensor,
                   state: Optional[KCLAState]) -> KCLAState:
        """``u <- u + w x``, ``z <- z + w`` in the safe form (online softmax)."""
        log_z, prev, beta = self._merge(x, logit, state)
        return KCLAState(x if prev is None else torch.lerp(prev, x, beta), log_z)

    def _merge(self, x: Tensor, logit: Tensor, state: Optional[KCLAState]):
        """``(log z_new, incoming mean, beta = w / z_new per channel)``."""
        if state is None:
            return logit, None, None
        log_z = torch.logaddexp(state.log_z, logit)  # [B, G]
        beta = per_channel(torch.exp(logit - log_z), self.head_dim, x.dtype)  # [B, C, 1, 1]
        return log_z, state.mean.to(x.dtype), beta

    def tail(self, x: Tensor, prev: Optional[Tensor], beta: Optional[Tensor], scale: Tensor,
             keep: Optional[Tensor], wv_weight: Tensor, norm_weight: Optional[Tensor],
             norm_bias: Optional[Tensor], recompute: bool = False) -> Tuple[Tensor, Tensor]:
        """The feature-map part of the step: state update, ``Wv``, gate, norm, ReLU, add.

        Args:
            x: block output ``[B, C, H, W]``.
            prev: incoming mean ``[B, C, H, W]`` (``None`` for the first block).
            beta: ``w / z_new`` per channel ``[B, C, 1, 1]`` (``None`` with ``prev``).
            scale: gate times ``z / (z + eps)`` per channel, ``[B, C, 1, 1]``.
            keep: drop-path mask ``[B, 1, 1, 1]`` already divided by the keep
                probability, or ``None``.
            recompute: batch statistics only (the backward pass of
                :class:`_RecomputedTail`; running statistics were updated once).

        Returns:
            ``(x + o, mean)``, both ``[B, C, H, W]``.
        """
        mean = x if prev is None else torch.lerp(prev, x, beta)
        v = F.conv2d(mean, wv_weight, padding=1, groups=self.channels)  # [B, C, H, W]
        o = fold_norm(self.norm, v, scale, norm_weight, norm_bias)  # eval-mode BN: one pass
        if o is None:
            v = v * scale.to(v.dtype)
            if recompute:
                o = F.batch_norm(v, None, None, norm_weight, norm_bias, True, 0.0,
                                 self.norm.eps)
            else:
                o = self.norm(v)
        o = F.relu(o, inplace=True)
        if keep is not None:
            o = o * keep.to(o.dtype)
        if torch.is_grad_enabled():  # ReLU's backward needs its output
            return x + o, mean
        return o.add_(x), mean  # no new feature map

    def forward(self, x: Tensor,
                state: Optional[KCLAState] = None) -> Tuple[Tensor, KCLAState]:
        check_input(x, self.channels, 'KCLA')
        if state is not None:
            check_batch(state.mean.shape[0], x, 'KCLA')
            if self.renorm:
                state = self.renormalize(state, x)
            elif state.mean.shape != x.shape:
                raise ValueError(
                    f'KCLA: state of shape {tuple(state.mean.shape)} does not match the '
                    f'block output {tuple(x.shape)}; only an init layer (renorm=True) '
                    'adapts a state of another width or resolution')
        q, k = self.keys(x)  # [B, G, d] each
        log_z, prev, beta = self._merge(x, self.logits(k), state)
        # xbar = u / (z + eps) = mean * z / (z + eps) = mean * sigmoid(log z - log eps);
        # Wv is linear and per-channel, so the factor moves past it into the gate.
        shrink = torch.sigmoid(log_z - math.log(self.eps))  # [B, G]
        scale = per_channel(self.gate(q, k) * shrink, self.head_dim, q.dtype)  # [B, C, 1, 1]
        keep = self.drop_path.keep_mask(x)
        args = (x, prev, beta, scale, keep, self.wv.weight,
                getattr(self.norm, 'weight', None), getattr(self.norm, 'bias', None))
        # NOTE: under torch.compile the plain path is traced instead: AOTAutograd's
        # partitioner makes its own recomputation choices, and dynamo cannot
        # trace the autograd.grad call inside _RecomputedTail.backward.
        if (self.training and torch.is_grad_enabled() and _recomputable(self.norm)
                and not _compiling()):
            out, mean = _RecomputedTail.apply(self, *args)
        else:
            out, mean = self.tail(*args)
        return out, KCLAState(mean, log_z)

    def extra_repr(self) -> str:
        return (f'channels={self.channels}, heads={self.num_heads}, head_dim={self.head_dim}, '
                f'renorm={self.renorm}, clamp={self.clamp}, eps={self.eps}')


def _compiling() -> bool:
    compiler = getattr(torch, 'compiler', None)
    return bool(compiler is not None and compiler.is_compiling())


def _recomputable(norm: nn.Module) -> bool:
    # SyncBN would all-reduce again when recomputed, GroupNorm is cheap to keep
    return type(norm) is nn.BatchNorm2d and norm.affine


def _autocast_state(device_type: str):
    if hasattr(torch, 'get_autocast_dtype'):  # torch >= 2.4
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    if device_type == 'cuda':
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()


class _RecomputedTail(torch.autograd.Function):
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
    def forward(ctx, layer: KCLA, *args):
        ctx.layer = layer
        ctx.device_type = args[0].device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return layer.tail(*args)

    @staticmethod
    def backward(ctx, grad_out, grad_mean):
        inputs = [None if t is None else t.detach().requires_grad_(t.requires_grad)
                  for t in ctx.saved_tensors]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            out, mean = ctx.layer.tail(*inputs, recompute=True)
        outs, grads = [out], [grad_out]
        if grad_mean is not None and mean.requires_grad:
            outs.append(mean)
            grads.append(grad_mean)
        differentiable = [t for t in inputs if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(outs, differentiable, grads, allow_unused=True))
        return (None, ) + tuple(next(got) if t is not None and t.requires_grad else None
                                for t in inputs)
