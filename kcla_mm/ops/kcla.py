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
import contextlib
import math
import weakref
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels, fused_tail_cpu
from ._common import (BlockPosition, DropPath, NormLayer, _cached_norm_affine, check_batch,
                      check_drop_path, check_heads, check_input, eca, eca_conv, fold_norm,
                      global_pool, member, per_channel, pooled_qk, value_conv)


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

    def logits(self, k: Tensor, k_norm: Optional[Tensor] = None) -> Tensor:
        """Weight logits ``min(|k_g| / tau_g, clamp)`` from keys ``[B, G, d]``: ``[B, G]``."""
        k_norm = k.norm(dim=-1) if k_norm is None else k_norm
        logit = k_norm * self.inv_tau.to(k.dtype)
        return logit if self.clamp is None else logit.clamp(max=self.clamp)

    def gate(self, q: Tensor, k: Tensor, k_norm: Optional[Tensor] = None) -> Tensor:
        """Per-head gate ``sigmoid(Phi(<q, k> / |k|))``: ``[B, G]`` in the dtype of ``q``."""
        # NOTE: |k| is clamped away from 0 (the reference divides by it as is),
        # so an all-zero key gives a score of 0 instead of NaN.
        k_norm = k.norm(dim=-1) if k_norm is None else k_norm
        h = (q * k).sum(-1) / k_norm.clamp_min(1e-12)  # [B, G]
        with torch.autocast(device_type=q.device.type, enabled=False):
            return torch.sigmoid(F.linear(h, self.phi.weight.to(h.dtype)))

    def renormalize(self, state: KCLAState, x: Tensor) -> KCLAState:
        """Spec section 5: adapt an incoming state and re-key it as one pseudo-layer."""
        ubar = state.mean  # [B, C_prev, H_prev, W_prev] = u / z, no epsilon
        pooled = None
        if self.adjust is not None:
            if ubar.shape[1] != self.prev_channels:
                raise ValueError(
                    f'KCLA init layer expects a state of {self.prev_channels} channels, '
                    f'got {ubar.shape[1]}')
            if self._fused_adapt(ubar):  # adjust, norm_u and the pool in two passes
                ubar, pooled = fused_tail_cpu.FusedAdapt.apply(
                    self, ubar, self.adjust.weight, self.norm_u.weight, self.norm_u.bias)
            else:
                ubar = self.norm_u(self.adjust(ubar))  # [B, C, H, W]
        else:
            ubar = self.norm_u(ubar)
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
        log_z = torch.logaddexp(state.log_z, logit)  # [B, G]
        beta = per_channel(torch.exp(logit - log_z), self.head_dim, x.dtype)  # [B, C, 1, 1]
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
                :class:`_RecomputedTail`; running statistics were updated once).
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
        o = fold_norm(self.norm, v, scale, norm_weight, norm_bias,
                      inplace=not (torch.is_grad_enabled() and v.requires_grad))
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

    def forward(self, x: Tensor, state: Optional[KCLAState] = None,
                reuse_state: bool = False, reuse_input: bool = False,
                pooled: Optional[Tensor] = None) -> Tuple[Tensor, KCLAState]:
        """One KCLA step: ``(x + attention output, new state)``.

        Args:
            x: block output ``[B, C, H, W]``.
            state: the previous block's state (``None`` for the first block).
            reuse_state: the caller will not use ``state`` again, so without
                autograd its feature map may be overwritten by the new state
                (saves allocating a map per block; the backbone does this in
                inference). Ignored where autograd records.
            reuse_input: likewise for ``x``: without autograd the output may
                be written into it (only by the fused CPU kernel, and never
                where ``x`` becomes the state).
            pooled: ``x``'s global average pool ``[B, C]`` as
                :func:`residual_relu_pool_` returned it, which the fused
                kernels then do not compute again (ignored by the eager
                paths; in training used only where ``x`` and it come from
                one node of :func:`residual_relu_pool_` or
                :func:`residual_norm_relu_pool_` under autograd, whose
                backward pass then receives the pool's gradient).

        Raises:
            ValueError: ``pooled`` is not a float32 ``[B, C]`` tensor on
                ``x``'s device.
        """
        check_input(x, self.channels, 'KCLA')
        if pooled is not None:
            _check_pooled(pooled, x)
        renormed = False
        if state is not None:
            check_batch(state.mean.shape[0], x, 'KCLA')
            if self.renorm:
                if self._fusable(x, state, adapt=True):  # adjust and norm_u in the kernel
                    return self._fused_eval(x, state, False, reuse_input, pooled, adapt=True)
                state = self.renormalize(state, x)
                renormed = True  # a new map, owned here
            elif state.mean.shape != x.shape:
                raise ValueError(
                    f'KCLA: state of shape {tuple(state.mean.shape)} does not match the '
                    f'block output {tuple(x.shape)}; only an init layer (renorm=True) '
                    'adapts a state of another width or resolution')
        if self._fusable(x, state):
            return self._fused_eval(x, state, reuse_state or renormed, reuse_input, pooled)
        if self._fused_training(x, state):
            # a pool without the graph of the node that made x and pooled
            # (residual_relu_pool_'s or residual_norm_relu_pool_'s) would lose
            # the pool's gradient: pool here instead
            given = pooled is not None and _pooled_by_fused_node(pooled, x)
            return self._fused_train(x, state, pooled if given else None)
        q, k = self.keys(x)  # [B, G, d] each
        k_norm = k.norm(dim=-1)  # [B, G], shared by the weight and the gate
        log_z, prev, beta = self._merge(x, self.logits(k, k_norm), state)
        # xbar = u / (z + eps) = mean * z / (z + eps) = mean * sigmoid(log z - log eps);
        # Wv is linear and per-channel, so the factor moves past it into the gate.
        shrink = torch.sigmoid(log_z - math.log(self.eps))  # [B, G]
        gate = self.gate(q, k, k_norm)  # [B, G]
        scale = per_channel(gate * shrink, self.head_dim, q.dtype)  # [B, C, 1, 1]
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
            reuse = (reuse_state and prev is not None and not torch.is_grad_enabled()
                     and prev is not x and prev.stride() == x.stride())
            out, mean = self.tail(*args, reuse_prev=reuse)
        return out, KCLAState(mean, log_z)

    def _fused_training(self, x: Tensor, state: Optional[KCLAState]) -> bool:
        """Whether the fused CPU kernels compute this training step (see :mod:`.fused_tail_cpu`)."""
        norm = member(self, 'norm')
        return (FUSED_TRAINING and self.training and torch.is_grad_enabled()
                and _recomputable(norm) and not _compiling()
                and _weight(self, 'wq').dtype == torch.float32
                and (state is None or state.log_z.dtype == torch.float32)
                and fused_tail_cpu.applicable(norm, x, None if state is None else state.mean,
                                              _weight(self, 'wv'))
                and cpu_kernels.available())

    def _fused_adapt(self, m: Tensor) -> bool:
        """Whether :class:`~.fused_tail_cpu.FusedAdapt` adapts the incoming mean ``m``."""
        return (FUSED_TRAINING and torch.is_grad_enabled() and not _compiling()
                and not torch.jit.is_tracing() and fused_tail_cpu.adapt_applicable(self, m)
                and cpu_kernels.available())

    def _fused_train(self, x: Tensor, state: Optional[KCLAState],
                     pooled: Optional[Tensor] = None) -> Tuple[Tensor, KCLAState]:
        """:meth:`forward` in training by the fused CPU kernels (same numerics)."""
        norm = member(self, 'norm')
        out, mean, log_z = fused_tail_cpu.FusedStep.apply(
            self, x, None if state is None else state.mean,
            None if state is None else state.log_z, _weight(self, 'wq'), _weight(self, 'wk'),
            _weight(self, 'phi'), member(self, 'drop_path').keep_mask(x), _weight(self, 'wv'),
            member(norm, 'weight'), member(norm, 'bias'), pooled)
        return out, KCLAState(mean, log_z)

    def _fusable(self, x: Tensor, state: Optional[KCLAState], adapt: bool = False) -> bool:
        """Whether the fused CPU kernel computes this step (eval, float32, channels-last).

        ``adapt``: whether it also adapts the incoming state of an init layer
        (``adjust`` and ``norm_u``, spec section 5).
        """
        # (member(): nn.Module.__getattr__ is a large part of this path's cost)
        if (torch.is_grad_enabled() or self.training or x.device.type != 'cpu'
                or x.dtype != torch.float32 or _compiling() or torch.jit.is_tracing()
                or not x.is_contiguous(memory_format=torch.channels_last)
                or not _foldable(member(self, 'norm'))
                or _weight(self, 'wv').dtype != torch.float32):
            return False
        if state is not None:
            if state.mean.dtype != torch.float32:
                return False
            if adapt:
                p = state.mean
                if (self.adjust is None or not _foldable(self.norm_u) or p.dim() != 4
                        or p.shape[1] != self.prev_channels
                        or not p.is_contiguous(memory_format=torch.channels_last)
                        or tuple((n - 1) // self.stride + 1 for n in p.shape[2:])
                        != tuple(x.shape[2:])):
                    return False  # the eager path adapts it, or names what is wrong
            elif state.mean.stride() != x.stride():
                return False
        return cpu_kernels.available()

    def _fused_eval(self, x: Tensor, state: Optional[KCLAState], reuse_prev: bool,
                    reuse_input: bool, pooled: Optional[Tensor],
                    adapt: bool = False) -> Tuple[Tensor, KCLAState]:
        """:meth:`forward` in eval mode by ``torch.ops.kcla_mm.eval_step``."""
        weight, shift = _cached_norm_affine(member(self, 'norm'), torch.float32)  # [1, C, 1, 1]
        prev = None if state is None else state.mean
        reuse_prev = reuse_prev and prev is not None and prev is not x
        adj_w = adj_b = wk_u = None
        if adapt:  # norm_u(adjust(m)) = (s_u W) m + b_u, one grouped 1x1 map
            s_u, adj_b = _cached_norm_affine(self.norm_u, torch.float32)
            adj_w = self.adjust.weight.flatten(1) * s_u.view(-1, 1)  # [C, C_prev / G]
            wk_u = self.wk_u.weight
        out, mean, log_z = torch.ops.kcla_mm.eval_step(
            x, prev, None if state is None or adapt else state.log_z, _weight(self, 'wq'),
            _weight(self, 'wk'), member(self, 'inv_tau'), _weight(self, 'phi'),
            _weight(self, 'wv'), weight, shift, adj_w, adj_b, wk_u, self.stride,
            -1.0 if self.clamp is None else self.clamp, self.eps, reuse_prev,
            reuse_input and prev is not None, pooled)
        return out, KCLAState(mean, log_z)

    def extra_repr(self) -> str:
        return (f'channels={self.channels}, heads={self.num_heads}, head_dim={self.head_dim}, '
                f'renorm={self.renorm}, clamp={self.clamp}, eps={self.eps}')


def _weight(layer: nn.Module, name: str) -> Tensor:
    """``getattr(layer, name).weight`` by :func:`member`."""
    return member(member(layer, name), 'weight')


def _pooled_by_fused_node(pooled: Tensor, x: Tensor) -> bool:
    """Whether ``pooled`` and ``x`` are the two outputs of one fused block-end node.

    :class:`~kcla_mm.ops.fused_tail_cpu.ResidualReluPool` or
    :class:`~kcla_mm.ops.fused_tail_cpu.BlockEnd`: their backward passes add
    the pool's gradient in their own pass over the map, so the KCLA step
    need not pool ``x`` again nor add that gradient to ``gx`` in a pass of
    its own.
    """
    node = pooled.grad_fn
    return node is not None and node is x.grad_fn and isinstance(
        node, (fused_tail_cpu.ResidualReluPool._backward_cls,
               fused_tail_cpu.BlockEnd._backward_cls))


def _check_pooled(pooled: Tensor, x: Tensor) -> None:
    want = (x.shape[0], x.shape[1])
    if (not isinstance(pooled, Tensor) or tuple(pooled.shape) != want
            or pooled.dtype != torch.float32 or pooled.device != x.device):
        got = (f'{pooled.dtype} tensor of shape {tuple(pooled.shape)} on {pooled.device}'
               if isinstance(pooled, Tensor) else repr(pooled))
        raise ValueError(f'KCLA: pooled must be the float32 [B, C] = {list(want)} global pool '
                         f'of x (on {x.device}), got a {got}')


def _fusable_maps(x: Tensor, res: Tensor) -> bool:
    # the block-end kernels' maps: float32 channels-last CPU maps of one shape
    return (x.device.type == 'cpu' and x.dtype == torch.float32 and res.device.type == 'cpu'
            and res.dtype == torch.float32 and x.dim() == 4 and x.shape == res.shape
            and x.numel() > 0 and x.is_contiguous(memory_format=torch.channels_last)
            and res.is_contiguous(memory_format=torch.channels_last)
            and x.data_ptr() != res.data_ptr() and not _compiling()
            and not torch.jit.is_tracing() and cpu_kernels.available())


def residual_relu_pool_(x: Tensor, res: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """``x += res; x.relu_()`` (a residual block's end): ``(x, its pool or None)``.

    On float32 channels-last CPU maps of one shape, one fused kernel
    (``torch.ops.kcla_mm.residual_relu_pool_``) adds, applies the ReLU and
    sums the pixels in one pass, with the values of the two torch ops, and
    returns the global average pool ``[B, C]`` that the fused KCLA kernels
    would compute, bit for bit. Passed to :meth:`KCLA.forward` as ``pooled``
    it saves them their pooling pass over the map; under autograd
    (:class:`~kcla_mm.ops.fused_tail_cpu.ResidualReluPool`) the pool's
    gradient is then added in the ReLU's backward pass. Elsewhere it runs the
    two torch ops and returns ``(x, None)``.
    """
    if _fusable_maps(x, res):
        if torch.is_grad_enabled() and (x.requires_grad or res.requires_grad):
            return fused_tail_cpu.ResidualReluPool.apply(x, res)
        return x, torch.ops.kcla_mm.residual_relu_pool_(x, res)
    x += res
    return x.relu_(), None


def _batchnorm_tensors(norm: nn.Module) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(weight, bias, running_mean, running_var)`` of ``norm`` by :func:`member`."""
    return (member(norm, 'weight'), member(norm, 'bias'), member(norm, 'running_mean'),
            member(norm, 'running_var'))


def _eval_batchnorm(norm: Optional[nn.Module]) -> bool:
    return norm is not None and fused_tail_cpu._plain_batchnorm(norm) and not norm.training


def residual_norm_relu_pool_(x: Tensor, res: Tensor, norm: Optional[nn.Module] = None,
                             res_norm: Optional[nn.Module] = None
                             ) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`residual_relu_pool_` of ``norm(x)`` and ``res_norm(res)`` (``None``: as is).

    A residual block's end with its last norm and its shortcut's. Where
    each given norm is a plain ``nn.BatchNorm2d`` (affine, running
    statistics, float32) and the maps are those :func:`residual_relu_pool_`
    fuses, the norms are applied in that pass too:

    - without autograd, in eval mode: one kernel
      (``torch.ops.kcla_mm.residual_bn_relu_pool_``) with the torch ops'
      values bit for bit, two passes over the map fewer per norm; ``x`` (the
      last convolution's output) is overwritten;
    - with autograd (``FUSED_TRAINING``, no autocast), in training or eval
      mode: :class:`~kcla_mm.ops.fused_tail_cpu.BlockEnd`, one node whose
      values are the torch ops' within float rounding (batch statistics
      summed otherwise) and whose running statistics are updated as
      ``nn.BatchNorm2d`` does; it returns a new map and keeps ``x``.

    Elsewhere the norms run as modules, then :func:`residual_relu_pool_`.
    The caller checks that skipping the norms' module calls skips no hook.
    """
    if norm is not None and _fusable_maps(x, res):
        if not torch.is_grad_enabled():
            if _eval_batchnorm(norm) and (res_norm is None or _eval_batchnorm(res_norm)):
                res_args = ((None, None, None, None, 1.0) if res_norm is None else
                            (*_batchnorm_tensors(res_norm), res_norm.eps))
                pooled = torch.ops.kcla_mm.residual_bn_relu_pool_(
                    x, res, *_batchnorm_tensors(norm), norm.eps, *res_args)
                return x, pooled
        elif FUSED_TRAINING and fused_tail_cpu.block_end_applicable(norm, res_norm, x):
            return fused_tail_cpu.BlockEnd.apply(
                norm, res_norm, x, res, member(norm, 'weight'), member(norm, 'bias'),
                None if res_norm is None else member(res_norm, 'weight'),
                None if res_norm is None else member(res_norm, 'bias'))
    if norm is not None:
        x = norm(x)
    if res_norm is not None:
        res = res_norm(res)
    return residual_relu_pool_(x, res)


#: use the hand-derived backward of the recomputed tail where it applies
#: (tests switch it off to check the autograd replay that autocast uses).
ANALYTIC_BACKWARD = True
#: train with the fused CPU kernels where they apply (tests switch it off to
#: compare with the recomputed tail).
FUSED_TRAINING = True


def _compiling() -> bool:
    compiler = getattr(torch, 'compiler', None)
    return bool(compiler is not None and compiler.is_compiling())


def _foldable(norm: nn.Module) -> bool:
    # an eval-mode BatchNorm with running statistics: one affine per channel
    return (isinstance(norm, nn.modules.batchnorm._BatchNorm) and not norm.training
            and member(norm, 'running_mean') is not None)


def _recomputable(norm: nn.Module) -> bool:
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
        # the hand-derived backward (one recomputation, no autograd graph, few
        # temporaries); under autocast the dtype of every op would have to be
        # replayed, so there the recomputation goes through autograd instead
        # (CPU only: on CUDA the forward's BatchNorm is cuDNN's, whose batch
        # statistics the native kernels of the derivation would not reproduce
        # bit for bit; the replay calls the same kernels as the forward)
        ctx.analytic = (ANALYTIC_BACKWARD and not ctx.autocast[0] and ctx.device_type == 'cpu'
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
    """``(inputs, out, mean)`` of a :class:`_RecomputedTail` node, recomputed with a graph.

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
    """Stands for a saved copy of a :class:`_RecomputedTail` output (see below)."""

    __slots__ = ('node', )

    def __init__(self, node) -> None:
        self.node = node


def _unpack(saved):
    if isinstance(saved, _SavedOutput):
        ctx = saved.node
        if isinstance(ctx, fused_tail_cpu.FusedStep._backward_cls):
            # one recomputation for all saved copies (a stage's first block
            # saves its input for conv1 and the downsample): kept from the
            # first unpacking to the last
            out = getattr(ctx, 'kcla_output', None)
            if out is None:
                out = fused_tail_cpu.recompute_output(ctx)
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
    """Gradients of :meth:`KCLA.tail` for the inputs of :class:`_RecomputedTail`.

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
    ``y`` itself (the fused CPU kernels' step with a state, which keeps ``y``
    instead of its input), or other saved-tensor hooks are active
    (activation checkpointing, CPU offloading: an inner hook would hide
    their packing from them).
    """
    if _compiling() or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    node = y.grad_fn
    if isinstance(node, fused_tail_cpu.FusedStep._backward_cls):
        if node.keeps_output:
            return contextlib.nullcontext()
    elif not isinstance(node, _RecomputedTail._backward_cls):
        return contextlib.nullcontext()
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
