"""Key-Correlated Layer Attention (KCLA), the per-block operator.

Paper: "Enhancing Layer Interaction Using Key-Correlated Layer Attention"
(Xiong, Xie, Yu, He, He; arXiv 2606.28405). Numerics follow the authors'
reference code, so that their checkpoints load and give the same outputs; the
method and every deviation are in ``docs/method.md``, and the method written
plainly, in the paper's order, is :mod:`kcla_mm.ops.kcla_reference`.

Keys of different layers are nearly collinear, so the layer-attention logit
factors into ``(|q| cos theta) * |k|``. With the query term replaced by a fixed
per-head temperature, the softmax over layers is a running weighted mean of
the block outputs: constant memory, linear time. The value transform is
applied once to that mean, and a learnable map ``Phi`` of the per-head
query-key scores gates the heads.

State contract (see :class:`KCLAState`): ``forward(x, state) -> (out, state)``
with ``state=None`` for the very first block of the network. A layer built with
``renorm=True`` (the *init layer* of a stage, ``docs/method.md`` section 5)
re-normalises an incoming state, adapting its width and resolution, and
re-keys it as a single pseudo-layer.

This module computes in plain torch ops. ``forward`` first offers the step to
the fast paths (:func:`kcla_mm.ops.config.fused_call`), which return ``None``
where they do not apply.
"""
import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import (BlockPosition, DropPath, NormLayer, check_batch, check_drop_path, check_heads,
                     check_input, compiling, eca, eca_conv, fold_norm, global_pool, pooled_qk,
                     value_conv)
from .config import fused_call
from .kcla_state import KCLAState
from .recompute import RecomputedTail, recomputable

__all__ = ['KCLA', 'KCLAState', 'log_uniform_inverse_temperatures']

_SYNC_BN_NOTE = (
    'KCLA with SyncBatchNorm keeps autograd\'s intermediates of its tail (about 2.5x the '
    'activation memory of the tail per block): the memory-saving recomputation would need '
    'the forward pass\'s synchronised batch statistics, which SyncBatchNorm does not expose. '
    'Values are unaffected; use norm_cfg=dict(type=\'BN\') in the backbone to save the memory')


def log_uniform_inverse_temperatures(num_heads: int,
                                     temperature_range: Tuple[float, float]) -> Tensor:
    """``seq_g = 1 / tau_g``, log-uniform from ``lo`` to ``hi`` over the heads.

    With the default range ``(0.7, 1/0.7)``, ``tau_0 = 1/0.7`` and
    ``tau_{G-1} = 0.7`` (``docs/method.md``, section 4). Returns ``[G]`` float64.
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
        renorm: whether this is an init layer (``docs/method.md``, section 5) that
            re-normalises an incoming state.
        prev_channels: width of the state arriving at an init layer; when it
            differs from ``channels`` or ``stride != 1`` the layer owns the
            grouped 1x1 ``adjust`` convolution.
        stride: resolution change between the incoming state and ``x``.
        recompute_tail: in training with a plain ``BatchNorm2d``, keep only
            the feature-map tail's inputs and recompute the rest in the
            backward pass (:mod:`kcla_mm.ops.recompute`): about 2.5x less
            activation memory per block. ``False`` keeps autograd's
            intermediates. Same values and gradients either way; a public
            attribute of the same name may be changed later.

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
                 stride: int = 1,
                 recompute_tail: bool = True) -> None:
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
        self.recompute_tail = bool(recompute_tail)

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
        # A float32 copy (a plain attribute) serves the logits of float32 keys.
        self.register_buffer('inv_tau', None, persistent=False)
        self._set_temperatures()

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
        # NOTE: rebuilt, not converted: the temperatures are a function of
        # (G, temperature_range), so ``to_empty()`` after meta-device init
        # gives their values, not uninitialised memory, and ``.half()`` never
        # rounds them
        self._set_temperatures()
        return self

    def _set_temperatures(self) -> None:
        """``inv_tau`` (float64) and its float32 copy, on the parameters' device."""
        self.inv_tau = log_uniform_inverse_temperatures(
            self.num_heads, self.temperature_range).to(self.wq.weight.device)
        self.inv_tau_float32 = self.inv_tau.float()

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

    def logits(self, k: Tensor, k_norm: Optional[Tensor] = None) -> Tensor:
        """Weight logits ``min(|k_g| / tau_g, clamp)`` from keys ``[B, G, d]``: ``[B, G]``."""
        if k_norm is None:
            k_norm = torch.linalg.vector_norm(k, dim=-1)  # [B, G]
        if k_norm.dtype == torch.float32:  # (made with the float64 ones: no conversion here)
            inv_tau = self.inv_tau_float32  # [G]
        else:
            inv_tau = self.inv_tau.to(k_norm.dtype)  # [G]
        logit = k_norm * inv_tau  # [B, G]
        if self.clamp is None:
            return logit
        # min(logit, clamp); hardtanh's gradient is one kernel, clamp's three
        return F.hardtanh(logit, -math.inf, self.clamp)  # [B, G]

    def gate(self, q: Tensor, k: Tensor, k_norm: Optional[Tensor] = None) -> Tensor:
        """Per-head gate ``sigmoid(Phi(<q, k> / |k|))``: ``[B, G]`` in the dtype of ``q``."""
        # NOTE: |k| is clamped away from 0 (the reference divides by it as is),
        # so an all-zero key gives a score of 0 instead of NaN.
        if k_norm is None:
            k_norm = torch.linalg.vector_norm(k, dim=-1)  # [B, G]
        h = (q * k).sum(-1) / F.hardtanh(k_norm, 1e-12, math.inf)  # [B, G]
        with torch.autocast(device_type=q.device.type, enabled=False):
            return torch.sigmoid(F.linear(h, self.phi.weight.to(h.dtype)))  # [B, G]

    def check_state_width(self, mean: Tensor) -> None:
        """Raise unless ``mean`` has the width this init layer adapts."""
        if mean.shape[1] != self.prev_channels:
            raise ValueError(f'KCLA init layer expects a state of {self.prev_channels} '
                             f'channels, got {mean.shape[1]}')

    def renormalize(self, state: KCLAState, x: Tensor) -> KCLAState:
        """``docs/method.md`` section 5: adapt an incoming state, re-key it as one pseudo-layer."""
        ubar = state.mean  # [B, C_prev, H_prev, W_prev] = u / z, no epsilon
        if self.adjust is not None:
            self.check_state_width(ubar)
            ubar = self.norm_u(self.adjust(ubar))  # [B, C, H, W]
        else:
            ubar = self.norm_u(ubar)
        return self.rekey(ubar, x)

    def rekey(self, ubar: Tensor, x: Tensor, pooled: Optional[Tensor] = None) -> KCLAState:
        """Section 5, step 4: the adapted summary ``ubar`` as one pseudo-layer.

        ``pooled``: ``ubar``'s global pool ``[B, C]`` where the caller has it.
        """
        if ubar.shape[1:] != x.shape[1:]:
            raise ValueError(
                f'KCLA init layer: the adapted state has shape {tuple(ubar.shape[1:])} but '
                f'the block output has shape {tuple(x.shape[1:])}; check prev_channels='
                f'{self.prev_channels} and stride={self.stride}')
        b = ubar.shape[0]
        with torch.autocast(device_type=ubar.device.type, enabled=False):
            k_u, = eca(global_pool(ubar) if pooled is None else pooled, self.wk_u)
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
        b, g = logit.shape
        if torch.onnx.is_in_onnx_export():  # ONNX has no LogAddExp: the same, spelt out
            log_z = torch.maximum(state.log_z, logit) + torch.log1p(
                torch.exp(-(state.log_z - logit).abs()))  # [B, G]
        else:
            log_z = torch.logaddexp(state.log_z, logit)  # [B, G]
        # exp reads a per-channel view and writes per channel: no copy to broadcast
        beta = torch.exp((logit - log_z).unsqueeze(-1).expand(b, g, self.head_dim))  # [B, G, d]
        beta = beta.to(x.dtype).reshape(b, g * self.head_dim, 1, 1)  # [B, C, 1, 1], a view
        return log_z, state.mean.to(x.dtype), beta

    def tail(self, x: Tensor, prev: Optional[Tensor], beta: Optional[Tensor], scale: Tensor,
             keep: Optional[Tensor], wv_weight: Tensor, norm_weight: Optional[Tensor],
             norm_bias: Optional[Tensor], recompute: bool = False,
             reuse_prev: bool = False) -> Tuple[Tensor, Tensor]:
        """The feature-map part of the step: state update, ``Wv``, gate, norm, ReLU, add.

        Args:
            x: block output ``[B, C, H, W]``.
            prev: incoming mean ``[B, C, H, W]`` (``None`` for the first block).
            beta: ``w / z_new`` per channel ``[B, C, 1, 1]`` (``None`` with ``prev``).
            scale: gate times ``z / (z + eps)`` per channel, ``[B, C, 1, 1]``.
            keep: drop-path mask ``[B, 1, 1, 1]`` already divided by the keep
                probability, or ``None``.
            recompute: batch statistics only (the backward pass of
                :class:`~kcla_mm.ops.recompute.RecomputedTail`; running
                statistics were updated once).
            reuse_prev: write the new mean into ``prev`` (no autograd; see
                ``reuse_state`` of :meth:`forward`).

        Returns:
            ``(x + o, mean)``, both ``[B, C, H, W]``.
        """
        if prev is None:
            mean = x
        elif reuse_prev:
            mean = prev.lerp_(x, beta)  # no new feature map
        else:
            mean = torch.lerp(prev, x, beta)
        v = F.conv2d(mean, wv_weight, padding=1, groups=self.channels)  # [B, C, H, W]
        # eval-mode BN: one pass, in place when nothing differentiates through it
        # (not under torch.compile or tracing: dynamo gives up on an out= argument,
        # and the ONNX exporter has no translation for it)
        inplace = (not (torch.is_grad_enabled() and v.requires_grad) and not compiling()
                   and not torch.jit.is_tracing())
        o = fold_norm(self.norm, v, scale, norm_weight, norm_bias, inplace=inplace)
        if o is None:
            if torch.is_grad_enabled() and v.requires_grad:
                v = v * scale.to(v.dtype)
            else:
                v.mul_(scale.to(v.dtype))
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

    def forward(self, x: Tensor, state: Optional[KCLAState] = None, *,
                reuse_state: bool = False) -> Tuple[Tensor, KCLAState]:
        """One KCLA step: ``(x + attention output, new state)``.

        Args:
            x: block output ``[B, C, H, W]``.
            state: the previous block's state (``None`` for the first block).
            reuse_state: a hint that never changes a value: the caller will
                not read ``state`` again, so without autograd its feature map
                may be overwritten by the new state (saves allocating a map
                per block in inference). Ignored where autograd records.

        Raises:
            ValueError: ``x`` is not ``[B, C, H, W]``; the state's batch size
                differs; a state of another shape reaches a layer that is not
                an init layer.
        """
        check_input(x, self.channels, 'KCLA')
        if state is not None:
            check_batch(state.mean.shape[0], x, 'KCLA')
            if not self.renorm and state.mean.shape != x.shape:
                raise ValueError(
                    f'KCLA: state of shape {tuple(state.mean.shape)} does not match the '
                    f'block output {tuple(x.shape)}; only an init layer (renorm=True) '
                    'adapts a state of another width or resolution')
        fast = fused_call('kcla_step', self, x, state, reuse_state)
        if fast is not None:
            return fast
        if state is not None and self.renorm:
            # the adapted state is a new map, owned here
            return self.step(x, self.renormalize(state, x), reuse_state=True)
        return self.step(x, state, reuse_state=reuse_state)

    def step(self, x: Tensor, state: Optional[KCLAState] = None,
             reuse_state: bool = False) -> Tuple[Tensor, KCLAState]:
        """Sections 4.1-4.7 of ``docs/method.md`` for a state already adapted to ``x``.

        The plain implementation, rearranged for speed and memory (the same
        values as :func:`kcla_mm.ops.kcla_reference.kcla_step`):

        - the state is ``(mean, log z)`` and updated by the online softmax:
          ``mean <- lerp(mean, x, w / z_new)``;
        - ``xbar = u / (z + eps) = mean * z / (z + eps) = mean *
          sigmoid(log z - log eps)``, and since ``Wv`` is linear and per
          channel, that factor moves past it into the per-head gate;
        - in training with a plain ``BatchNorm2d`` the feature-map part is
          recomputed in the backward pass instead of kept
          (:mod:`kcla_mm.ops.recompute`); in eval mode the gate is folded
          into the norm's affine map.
        """
        q, k = self.keys(x)  # [B, G, d] each
        k_norm = torch.linalg.vector_norm(k, dim=-1)  # [B, G], for the weight and the gate
        log_z, prev, beta = self._merge(x, self.logits(k, k_norm), state)  # [B, G], beta per C
        b, g, d = q.shape
        shrink = torch.sigmoid(log_z - math.log(self.eps))  # [B, G] = z / (z + eps)
        gate = self.gate(q, k, k_norm)  # [B, G]
        # the product reads a per-channel view and writes per channel: no copy to broadcast
        scale = gate.unsqueeze(-1) * shrink.unsqueeze(-1).expand(b, g, d)  # [B, G, d]
        scale = scale.reshape(b, g * d, 1, 1)  # [B, C, 1, 1], a view
        keep = self.drop_path.keep_mask(x)
        args = (x, prev, beta, scale, keep, self.wv.weight,
                getattr(self.norm, 'weight', None), getattr(self.norm, 'bias', None))
        # NOTE: under torch.compile the plain path is traced instead: AOTAutograd's
        # partitioner makes its own recomputation choices, and dynamo cannot
        # trace the autograd.grad call inside RecomputedTail.backward.
        if self.training and torch.is_grad_enabled() and self.recompute_tail and not compiling():
            if recomputable(self.norm):
                out, mean = RecomputedTail.apply(self, *args)
                return out, KCLAState(mean, log_z)
            if isinstance(self.norm, nn.SyncBatchNorm):
                warnings.warn(_SYNC_BN_NOTE, RuntimeWarning)
        reuse = (reuse_state and prev is not None and not torch.is_grad_enabled()
                 and prev is not x and prev.stride() == x.stride() and not compiling())
        out, mean = self.tail(*args, reuse_prev=reuse)
        return out, KCLAState(mean, log_z)

    def extra_repr(self) -> str:
        return (f'channels={self.channels}, heads={self.num_heads}, head_dim={self.head_dim}, '
                f'renorm={self.renorm}, clamp={self.clamp}, eps={self.eps}')
