"""Layer attention threaded through the stages of a host ResNet.

:class:`KCLAResNetMixin` turns the ResNet of a host library (mmdet or mmseg)
into a layer-attention ResNet without copying it: the host builds the stem and
the stages with its own arguments and parameter names; the mixin adds one
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

from ...ops import (KCLA, BlockPosition, build_layer_attn, residual_norm_relu_pool_,
                    saved_output_hooks)

DEFAULT_LAYER_ATTN: Mapping = MappingProxyType({'type': 'KCLA'})


def _as_tuple(value, name: str) -> Tuple[int, ...]:
    if isinstance(value, int):
        return (value, )
    try:
        return tuple(int(v) for v in value)
    except TypeError:
        raise ValueError(f'{name} must be an int or a sequence of ints, got {name}={value!r}')


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


def _hooked(module: nn.Module) -> bool:
    """Whether a forward hook could hold on to ``module``'s output."""
    return bool(module._forward_hooks or nn.modules.module._global_forward_hooks)


def _any_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run a hook of its own or a global one."""
    m = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or m._global_forward_hooks
                or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


class KCLAResNetMixin:
    """Adds layer attention to a host ``ResNet`` subclass (put it first in the MRO).

    Args:
        depth: 18, 34 (BasicBlock), 50, 101 or 152 (Bottleneck).
        layer_attn: the layer-attention method of every block,
            ``dict(type='KCLA' | 'FullLayerAttention' | 'MRLALight', **kwargs)``,
            or ``None`` for exactly the host ResNet. Keyword arguments go to the
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
            Values are unchanged.
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

    #: the host's residual blocks whose forward :meth:`_block` may replay,
    #: ``{host forward function: 'bottleneck' | 'basic'}`` (set by the host
    #: subclasses; empty: always the host's forward)
    replayable_blocks: Mapping = MappingProxyType({})

    def __init__(self,
                 depth: int,
                 layer_attn: Optional[Mapping] = DEFAULT_LAYER_ATTN,
                 head_dim: Optional[int] = None,
                 channels_last: Optional[bool] = None,
                 recompute_attn_outputs: bool = True,
                 **kwargs) -> None:
        self._check_host_args(depth, kwargs)
        if not isinstance(recompute_attn_outputs, bool):
            raise ValueError('recompute_attn_outputs must be True or False, got '
                             f'recompute_attn_outputs={recompute_attn_outputs!r}')
        self.recompute_attn_outputs = recompute_attn_outputs
        self.layer_attn_cfg = None if layer_attn is None else dict(layer_attn)
        self.channels_last = (layer_attn is not None) if channels_last is None \
            else bool(channels_last)
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
        frozen = kwargs.get('frozen_stages', -1)
        if not -1 <= frozen <= num_stages:
            raise ValueError(f'frozen_stages must be in [-1, {num_stages}], '
                             f'got frozen_stages={frozen!r}')

    def _make_layer_attn(self, head_dim: Optional[int]) -> None:
        expansion = self.block.expansion
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

    def _block(self, block: nn.Module, attn: nn.Module,
               x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """``(block(x), its global average pool or None)``.

        KCLA's fused kernels pool every block output, a pass over the map of
        their own. For the host's own Bottleneck and BasicBlock (no plugins,
        no hooks, no checkpointing, forward not overridden), where a fused
        kernel computes the KCLA step (eager inference, or training with
        autograd), this calls the block's modules in the host's order, and
        its final residual add and in-place ReLU are
        :func:`kcla_mm.ops.residual_relu_pool_`, which also pools, in one
        pass where its kernel applies; the block's last norm and its
        shortcut's are passed on to
        :func:`kcla_mm.ops.residual_norm_relu_pool_`, which applies
        BatchNorms in that pass too. Elsewhere the host's forward runs.
        """
        if (torch.compiler.is_compiling() or torch.jit.is_tracing()
                or not isinstance(attn, KCLA) or attn.training != torch.is_grad_enabled()):
            return block(x), None  # (the kernels compute eval without, training with autograd)
        kind = self.replayable_blocks.get(getattr(type(block), 'forward', None))
        if (kind is None or 'forward' in vars(block) or getattr(block, 'with_plugins', False)
                or getattr(block, 'with_cp', False) or type(block.relu) is not nn.ReLU
                or _any_hooks(block) or _any_hooks(block.relu)):
            return block(x), None
        identity = x
        out = block.relu(block.norm1(block.conv1(x)))
        if kind == 'bottleneck':
            out = block.relu(block.norm2(block.conv2(out)))
            conv, norm = block.conv3, block.norm3
        else:
            conv, norm = block.conv2, block.norm2
        out = conv(out)
        # the last norms may be applied by the fused end of the block (plain
        # BatchNorms; the module calls they skip must not be hooked, and in
        # inference, where the convolution's output is overwritten, no hook
        # may hold it), else they run here
        if _any_hooks(norm) or (_hooked(conv) and not torch.is_grad_enabled()):
            out, norm = norm(out), None
        res_norm = None
        if block.downsample is not None:
            ds = block.downsample
            if (type(ds) is nn.Sequential and len(ds) > 1 and not _any_hooks(ds)
                    and not _any_hooks(ds[-1])):
                for m in list(ds)[:-1]:
                    identity = m(identity)
                res_norm = ds[-1]
            else:
                identity = ds(x)
        return residual_norm_relu_pool_(out, identity, norm, res_norm)

    def _attend(self, attn: nn.Module, x: Tensor, state, block: nn.Module,
                pooled: Optional[Tensor] = None):
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(attn, x, state, use_reentrant=False)
        if isinstance(attn, KCLA) and not torch.is_grad_enabled():
            # the backbone owns the states: the new one may take the old one's
            # memory; and the block output, unless a forward hook may have kept it
            return attn(x, state, reuse_state=True, reuse_input=not _hooked(block),
                        pooled=pooled)
        return attn(x, state) if pooled is None else attn(x, state, pooled=pooled)

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """Per-stage outputs for ``out_indices``; ``[B, C_s, H/2^(s+2), W/2^(s+2)]``.

        Raises:
            ValueError: ``x`` holds NaN or Inf (checked eagerly; skipped while
                tracing or compiling).
        """
        if not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
            _check_finite(x, type(self).__name__)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.layer_attn_cfg is None:
            outs = super().forward(x)
            return tuple(_to_nchw(o) for o in outs) if self.channels_last else outs
        x = self._stem(x)
        state = None
        outs = []
        for i, name in enumerate(self.res_layers):
            for block, attn in zip(getattr(self, name), getattr(self, f'{name}_attn')):
                # the block's saved copies of x (a KCLA output) are recomputed
                # in the backward pass instead of kept (no-op where inapplicable)
                recompute = self.recompute_attn_outputs and not self.with_cp
                with saved_output_hooks(x) if recompute else nullcontext():
                    x, pooled = self._block(block, attn, x)
                x, state = self._attend(attn, x, state, block, pooled)
            if i in self.out_indices:
                # NOTE: outputs leave NCHW-contiguous: mmcv's RoIAlign reads its
                # input as NCHW and silently returns scrambled features for a
                # channels-last tensor (Faster/Mask R-CNN then cannot learn).
                outs.append(_to_nchw(x) if self.channels_last else x.contiguous())
        return tuple(outs)

    def layer_attn_modules(self) -> Sequence[nn.Module]:
        """All layer-attention modules in block order (empty for a plain ResNet)."""
        return [m for name in self.layer_attn_names for m in getattr(self, name)]
