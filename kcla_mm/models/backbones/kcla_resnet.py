"""Layer attention threaded through the stages of a host ResNet.

:class:`KCLAResNetMixin` turns the ResNet of a host library (mmdet, mmseg or
mmpretrain) into a layer-attention ResNet without copying it: the host builds
the stem and the stages with its own arguments and parameter names; the mixin adds one
layer-attention module per block (``layer{s}_attn.{i}``), threads the
operator state through all stages and keeps the host's semantics of
``out_indices``, ``frozen_stages``, ``norm_eval`` and ``with_cp``.
"""
from contextlib import nullcontext
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint as cp
from mmcv.cnn import build_norm_layer
from torch import Tensor, nn

from ...ops import (BlockPosition, build_layer_attn, get_layer_attn_class, residual_end,
                    saved_output_hooks)

DEFAULT_LAYER_ATTN: Mapping = MappingProxyType({'type': 'KCLA'})


def _as_tuple(value, name: str) -> Tuple[int, ...]:
    if isinstance(value, int):
        return (value, )
    try:
        return tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f'{name} must be an int or a sequence of ints, got {name}={value!r}')


def _layer_attn_cfg(layer_attn) -> Optional[dict]:
    """``layer_attn`` as a config dict: a type name is ``dict(type=name)``."""
    if layer_attn is None:
        return None
    if isinstance(layer_attn, str):
        get_layer_attn_class(layer_attn)  # names the choices if unknown
        return dict(type=layer_attn)
    if not isinstance(layer_attn, Mapping) or 'type' not in layer_attn:
        raise ValueError("layer_attn must be None, a type name such as 'KCLA', or a dict with "
                         f"a 'type', got layer_attn={layer_attn!r}")
    return dict(layer_attn)


def _check_finite(x: Tensor, name: str) -> None:
    """Raise if the backbone input holds NaN or Inf: one reduction in the normal case."""
    if torch.isfinite(x).all():
        return
    bad = ~torch.isfinite(x.detach())  # [B, C, H, W]
    samples = bad.flatten(1).any(1).nonzero().flatten().tolist()
    kinds = [k for k, m in (('NaN', torch.isnan), ('Inf', torch.isinf)) if m(x.detach()).any()]
    raise ValueError(
        f'{name} input x of shape {tuple(x.shape)} holds {int(bad.sum())} non-finite values '
        f'({"/".join(kinds)}) in batch samples {samples}; the features would be NaN. Check '
        'these images and the data preprocessor (mean/std)')


class _ToNCHW(torch.autograd.Function):
    """``x.contiguous()`` whose backward returns the gradient channels-last.

    The heads send NCHW gradients back; handed on as they are, every
    element-wise op of the backward pass would mix them with the channels-last
    tensors saved in the forward pass and run several times slower.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


def _to_nchw(x: Tensor) -> Tensor:
    if x.is_contiguous():  # nothing to convert (e.g. a 1x1 map)
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _ToNCHW.apply(x)
    return x.contiguous()


class ResidualBlockEnd:
    """A host residual block whose forward ends in :meth:`end` (put it first in the MRO).

    The same modules, called in the host's order, with the same values; only
    the last norm, the shortcut, the add and the ReLU go through
    :func:`kcla_mm.ops.residual_end`, where a fast path may fuse them.
    Subclasses name the block's last convolution and norm.
    """

    last_conv: str
    last_norm: str

    def uses_host_forward(self, x: Tensor) -> bool:
        """Whether the host's own forward runs instead: activation checkpointing,
        plugins, or the residual branch's stochastic depth in training
        (mmpretrain's ``drop_path_rate``, applied before the add)."""
        drop_path = getattr(self, 'drop_path', None)
        return ((self.with_cp and x.requires_grad) or getattr(self, 'with_plugins', False)
                or (self.training and drop_path is not None
                    and not isinstance(drop_path, nn.Identity)))

    def end(self, out: Tensor, x: Tensor) -> Tensor:
        """``relu(last_norm(out) + shortcut(x))``: the block's end, given its last conv's output."""
        identity = x if self.downsample is None else self.downsample(x)
        return residual_end(out, identity, getattr(self, self.last_norm),
                            producer=getattr(self, self.last_conv))


class BasicBlockEnd(ResidualBlockEnd):
    """A host ``BasicBlock`` ending in :meth:`end` (see :meth:`uses_host_forward`)."""

    last_conv, last_norm = 'conv2', 'norm2'

    def forward(self, x: Tensor) -> Tensor:
        if self.uses_host_forward(x):
            return super().forward(x)
        out = self.relu(self.norm1(self.conv1(x)))
        return self.end(self.conv2(out), x)


class BottleneckEnd(ResidualBlockEnd):
    """A host ``Bottleneck`` ending in :meth:`end` (see :meth:`uses_host_forward`)."""

    last_conv, last_norm = 'conv3', 'norm3'

    def forward(self, x: Tensor) -> Tensor:
        if self.uses_host_forward(x):
            return super().forward(x)
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.relu(self.norm2(self.conv2(out)))
        return self.end(self.conv3(out), x)


class KCLAResNetMixin:
    """Adds layer attention to a host ``ResNet`` subclass (put it first in the MRO).

    Args:
        depth: 18, 34 (BasicBlock), 50, 101 or 152 (Bottleneck).
        layer_attn: the layer-attention method of every block,
            ``dict(type='KCLA' | 'FullLayerAttention' | 'MRLALight', **kwargs)``
            or just the type name (``'KCLA'``), or ``None`` for exactly the
            host ResNet. Keyword arguments go to the
            operator (e.g. ``drop_path``, ``temperature_range``, ``clamp``,
            ``renorm_blocks`` for KCLA).
        head_dim: channels per head; default 64 for Bottleneck depths and 16
            for BasicBlock depths (whose first stage has only 64 channels).
        channels_last: run the whole backbone in the channels-last memory
            format (the outputs are returned NCHW-contiguous, as the host's
            necks and heads expect). Default ``None``: on when layer attention is
            used, whose depthwise value convolution is many times slower in
            NCHW on CPU; converting only around it would make BatchNorm and the
            element-wise state update slow instead. The convolution weights
            are stored channels-last too (loading a checkpoint keeps that).
            Values are unchanged. Off by default with deformable convolutions
            (``dcn``): mmcv's deformable kernels read their inputs as NCHW,
            so ``True`` with ``dcn`` is refused.
        check_finite: raise if the input holds NaN or Inf (one reduction).
            Default ``None``: on for CPU inputs, off for GPU inputs, where
            reading the result would wait for the device at every forward
            (and make the backbone impossible to capture in a CUDA graph).
        recompute_attn_outputs: in training on the eager path (CUDA, AMP,
            float64, a CPU without the fused kernels), the next block's saved
            copies of each KCLA output (for its ``conv1`` and downsample
            backward) are recomputed in the backward pass from what KCLA
            keeps anyway (its input and state), instead of kept: one feature
            map less per block for one more pass over it. ``False`` keeps
            them: faster, more memory. The fused CPU kernels need neither:
            there a step keeps its output, which the next block keeps anyway,
            instead of its input, which it recomputes where needed (and the
            block's last ReLU keeps a one-bit mask); only the first step,
            whose input is its state, has its output recomputed, or kept with
            ``False`` (one stage-1 map). Values and gradients are the same
            either way. No effect in inference, with ``with_cp`` or on other
            methods.
        **kwargs: the host ResNet's arguments, with their host semantics.
    """

    #: ``{host block class: its subclass ending in ``end``}`` (set by the host
    #: subclasses): the blocks of a layer-attention backbone; a plain one
    #: (``layer_attn=None``) keeps the host's blocks
    attn_blocks: Mapping = MappingProxyType({})

    def __init__(self,
                 depth: int,
                 layer_attn: Optional[Mapping] = DEFAULT_LAYER_ATTN,
                 head_dim: Optional[int] = None,
                 channels_last: Optional[bool] = None,
                 recompute_attn_outputs: bool = True,
                 check_finite: Optional[bool] = None,
                 **kwargs) -> None:
        self._check_host_args(depth, kwargs)
        if not isinstance(recompute_attn_outputs, bool):
            raise ValueError('recompute_attn_outputs must be True or False, got '
                             f'recompute_attn_outputs={recompute_attn_outputs!r}')
        self.recompute_attn_outputs = recompute_attn_outputs
        self.layer_attn_cfg = _layer_attn_cfg(layer_attn)
        dcn = kwargs.get('dcn') is not None
        if channels_last and dcn:
            raise ValueError('channels_last=True cannot be combined with dcn: mmcv\'s deformable '
                             'convolutions read their inputs as NCHW; leave channels_last=None')
        self.channels_last = (layer_attn is not None and not dcn) if channels_last is None \
            else bool(channels_last)
        if check_finite not in (None, True, False):
            raise ValueError(f'check_finite must be None, True or False, got {check_finite!r}')
        self.check_finite = check_finite
        self.layer_attn_names = []
        super().__init__(depth=depth, **kwargs)
        if self.layer_attn_cfg is not None:
            self._make_layer_attn(head_dim)
            self._freeze_stages()
        if self.channels_last:
            # the weights in the activations' layout: oneDNN otherwise reorders
            # them at every call (measured on KCLA-ResNet-50, 2 CPU threads:
            # eval 183 -> 175 ms, training step 720 -> 695 ms), and their
            # gradients come back with strides DDP's buckets do not match
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    m.to(memory_format=torch.channels_last)

    def _check_host_args(self, depth: int, kwargs: dict) -> None:
        # The host asserts or raises bare KeyErrors; name the argument instead.
        if depth not in self.arch_settings:
            raise ValueError(f'depth={depth!r} is not supported; choose one of '
                             f'{sorted(self.arch_settings)}')
        num_stages = kwargs.get('num_stages', 4)
        if not 1 <= num_stages <= 4:
            raise ValueError(f'num_stages must be in [1, 4], got num_stages={num_stages!r}')
        out_indices = _as_tuple(kwargs.get('out_indices', (0, 1, 2, 3)), 'out_indices')
        bad = [i for i in out_indices if not 0 <= i < num_stages]
        if bad:
            raise ValueError(f'out_indices={out_indices} has {bad} out of range for '
                             f'num_stages={num_stages} (valid: 0..{num_stages - 1})')
        for name in ('strides', 'dilations', 'stage_with_dcn'):
            value = kwargs.get(name)
            value = None if value is None else _as_tuple(value, name)
            if value is not None and len(value) != num_stages:
                raise ValueError(f'{name}={value!r} must have one entry per stage: '
                                 f'num_stages={num_stages} entries, got {len(value)}')
        frozen = kwargs.get('frozen_stages', -1)
        if not -1 <= frozen <= num_stages:
            raise ValueError(f'frozen_stages must be in [-1, {num_stages}], '
                             f'got frozen_stages={frozen!r}')

    def _make_layer_attn(self, head_dim: Optional[int]) -> None:
        # mmpretrain keeps the expansion on the backbone (an argument there),
        # mmdet and mmseg on the block class
        expansion = getattr(self, 'expansion', None) or self.block.expansion
        if head_dim is None:
            head_dim = 64 if expansion > 1 else 16
        norm_cfg = self.norm_cfg

        def norm_layer(channels: int) -> nn.Module:
            return build_norm_layer(norm_cfg, channels)[1]

        prev_channels = None
        for i, name in enumerate(self.res_layers):
            channels = self.base_channels * 2**i * expansion
            modules = []
            for j in range(len(getattr(self, name))):
                position = BlockPosition(
                    stage=i, block=j,
                    prev_channels=prev_channels if j == 0 else channels,
                    stride=self.strides[i] if j == 0 else 1)
                modules.append(build_layer_attn(self.layer_attn_cfg, channels, position,
                                                head_dim=head_dim, norm_layer=norm_layer))
            self.add_module(f'{name}_attn', nn.ModuleList(modules))
            self.layer_attn_names.append(f'{name}_attn')
            prev_channels = channels

    def _freeze_stages(self) -> None:
        super()._freeze_stages()
        for i in range(1, self.frozen_stages + 1):
            if f'layer{i}_attn' in self.layer_attn_names:
                m = getattr(self, f'layer{i}_attn')
                m.eval()
                for param in m.parameters():
                    param.requires_grad = False

    def train(self, mode: bool = True):
        """The host's ``train`` (frozen stages, ``norm_eval``), returning ``self``."""
        super().train(mode)
        return self

    def init_weights(self) -> None:
        """Host init (Kaiming/Pretrained), then the operators' own init.

        mmengine applies the host's ``init_cfg`` to the whole backbone; unless
        a checkpoint is loaded, the layer-attention modules are re-initialised
        with the reference scheme (Xavier for Wq/Wk/Phi/Wk_u), which the host's
        Kaiming-for-``Conv2d`` would not give. A ``Pretrained`` checkpoint of the
        KCLA reference trainer (``layer{s}.attention.{i}`` keys) is converted on
        the fly, as ``tools/model_converters/kcla_official_to_mmlab.py`` does.
        """
        pretrained = self._pretrained_cfg()
        if pretrained is not None and self._load_official(pretrained):
            return
        super().init_weights()
        if pretrained is None:
            for m in self.layer_attn_modules():
                m.reset_parameters()

    def _pretrained_cfg(self) -> Optional[dict]:
        init_cfg = self.init_cfg if isinstance(self.init_cfg, list) else [self.init_cfg]
        for c in init_cfg:
            if isinstance(c, Mapping) and c.get('type') == 'Pretrained':
                return c
        return None

    def _load_official(self, cfg: Mapping) -> bool:
        """Load a reference-layout checkpoint; ``False`` if it is not one."""
        if self.layer_attn_cfg is None or cfg.get('prefix'):
            return False
        from mmengine.logging import print_log
        from mmengine.runner.checkpoint import CheckpointLoader

        from ...utils.official_checkpoint import (convert_official_state_dict, extract_state_dict,
                                                  is_official_layout)
        ckpt = CheckpointLoader.load_checkpoint(cfg['checkpoint'], map_location='cpu')
        sd = extract_state_dict(ckpt)
        if not is_official_layout(sd):
            return False
        kw = {k: v for k, v in self.layer_attn_cfg.items() if k == 'temperature_range'}
        converted, report = convert_official_state_dict(sd, **kw)
        missing, unexpected = self.load_state_dict(converted, strict=False)
        print_log(f'loaded KCLA reference checkpoint {cfg["checkpoint"]}: '
                  f'{len(converted)} tensors, missing {missing}, unexpected {unexpected}, '
                  f'unmapped {report["unmapped"]}', logger='current')
        self._is_init = True
        return True

    def _stem(self, x: Tensor) -> Tensor:
        if self.deep_stem:
            x = self.stem(x)
        else:
            x = self.relu(self.norm1(self.conv1(x)))
        return self.maxpool(x)

    def make_res_layer(self, **kwargs) -> nn.Module:
        """The host's stage, of :attr:`attn_blocks` where layer attention is used."""
        if self.layer_attn_cfg is not None:
            kwargs['block'] = self.attn_blocks.get(kwargs['block'], kwargs['block'])
        return super().make_res_layer(**kwargs)

    def _attend(self, attn: nn.Module, x: Tensor, state, block_out_id: Optional[int] = None):
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(attn, x, state, use_reentrant=False)
        # without autograd the backbone owns the states: the new one may take
        # the old one's memory, unless that memory is the previous block's
        # output (``block_out_id``), which a forward hook may hold (the first
        # step's state is its block output)
        reuse = (not torch.is_grad_enabled() and state is not None
                 and not any(id(t) == block_out_id for t in state))
        return attn(x, state, reuse_state=reuse)

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """Per-stage outputs for ``out_indices``; ``[B, C_s, H/2^(s+2), W/2^(s+2)]``.

        Raises:
            ValueError: ``x`` holds NaN or Inf (see ``check_finite``; skipped
                while tracing or compiling).
        """
        check = x.device.type == 'cpu' if self.check_finite is None else self.check_finite
        if check and not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
            _check_finite(x, type(self).__name__)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.layer_attn_cfg is None:
            outs = super().forward(x)
            return tuple(_to_nchw(o) for o in outs) if self.channels_last else outs
        x = self._stem(x)
        state, prev_block_out = None, None  # (the id of the previous block's output)
        outs = []
        recompute = self.recompute_attn_outputs and not self.with_cp
        for i, name in enumerate(self.res_layers):
            for block, attn in zip(getattr(self, name), getattr(self, f'{name}_attn')):
                # the block's saved copies of x (an attention output) are
                # recomputed in the backward pass instead of kept (where the
                # operator can recompute them)
                with saved_output_hooks(x) if recompute else nullcontext():
                    x = block(x)
                block_out = id(x)
                x, state = self._attend(attn, x, state, prev_block_out)
                prev_block_out = block_out
            if i in self.out_indices:
                # NOTE: outputs leave NCHW-contiguous: mmcv's RoIAlign reads its
                # input as NCHW and silently returns scrambled features for a
                # channels-last tensor (Faster/Mask R-CNN then cannot learn).
                outs.append(_to_nchw(x) if self.channels_last else x.contiguous())
        return tuple(outs)

    def layer_attn_modules(self) -> Sequence[nn.Module]:
        """All layer-attention modules in block order (empty for a plain ResNet)."""
        return [m for name in self.layer_attn_names for m in getattr(self, name)]
