"""Analyses of layer-attention backbones: key correlation, effective layer weights, cost.

The logic behind ``tools/analysis_tools/`` (the tools are thin command lines
around it). Pure torch and numpy: matplotlib is imported inside the plotting
functions and mmengine inside :func:`flop_analyzer`, so importing this module
pulls in neither.

Two analyses of the paper (``docs/method.md``, section 9), for any backbone with
``layer_attn_modules()`` (``KCLAResNet`` with ``KCLA``, ``FullLayerAttention``
or ``MRLALight``):

* **Key correlation** (:func:`collect_keys`, :func:`key_cosine_matrix`): the
  key ``k_t = Wk(GAP(x_t))`` of every block, per head, and the mean cosine
  similarity of keys between every pair of blocks.
* **Effective layer weights** (:func:`layer_weights`): for every block ``t``
  the weight that the output of each earlier block ``s`` receives in the
  aggregate that block ``t`` attends to. KCLA: ``w_s / sum w`` from the
  recurrent state; FullLayerAttention: its softmax; MRLA-light: the product of
  the lambdas between ``s`` and ``t`` times the gate of ``s``.

Heads of blocks with different head counts (different stages) are matched by
their relative position in the channel axis (:func:`head_overlap`): head ``g``
of ``G`` covers channels ``[g/G, (g+1)/G)`` of the width. This is exactly the
grouping of KCLA's ``adjust`` convolution (``groups = G_new``), which feeds new
head ``g`` from the old channels in that span.
"""
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import KCLA, FullLayerAttention, MRLALight

#: the layer-attention methods the analyses understand, in plotting order.
METHODS: Tuple[str, ...] = ('KCLA', 'FullLayerAttention', 'MRLALight')
_CLASSES = {'KCLA': KCLA, 'FullLayerAttention': FullLayerAttention, 'MRLALight': MRLALight}
#: name of a backbone's per-stage ModuleList of layer-attention modules.
ATTN_LIST = re.compile(r'(?:^|\.)layer(\d+)_attn$')

Progress = Optional[Callable[[], None]]


@dataclass(frozen=True)
class BlockInfo:
    """Where a layer-attention module sits and how wide it is.

    Attributes:
        index: block index in the network, 0-based.
        stage: stage index, 0-based (``layer{stage + 1}``).
        block: block index within the stage, 0-based.
        channels: width ``C`` of the block output.
        num_heads: ``G = C / head_dim``.
        head_dim: channels per head ``d``.
    """

    index: int
    stage: int
    block: int
    channels: int
    num_heads: int
    head_dim: int

    @property
    def name(self) -> str:
        """``layer{s}.{i}``, the host's name of the block."""
        return f'layer{self.stage + 1}.{self.block}'


def method_of(module: nn.Module) -> str:
    """The method name (one of :data:`METHODS`) of a layer-attention module."""
    for name, cls in _CLASSES.items():
        if isinstance(module, cls):
            return name
    raise TypeError(f'{type(module).__name__} is not a layer-attention module of kcla_mm '
                    f'(expected one of {list(METHODS)})')


def attention_blocks(backbone: nn.Module) -> List[Tuple[BlockInfo, nn.Module]]:
    """The layer-attention modules of a backbone, in block order, with their positions.

    Raises:
        ValueError: the backbone has no layer-attention modules (a plain ResNet,
            ``layer_attn=None``, or not a kcla_mm backbone).
    """
    names = list(getattr(backbone, 'layer_attn_names', None) or [])
    if not names:
        raise ValueError(
            f'{type(backbone).__name__} has no layer-attention modules: build it with '
            "layer_attn=dict(type='KCLA' | 'FullLayerAttention' | 'MRLALight') "
            '(layer_attn=None is a plain ResNet, which has no keys or layer weights)')
    out = []
    for name in names:
        stage = int(ATTN_LIST.search(name).group(1)) - 1
        for block, module in enumerate(getattr(backbone, name)):
            out.append((BlockInfo(len(out), stage, block, module.channels, module.num_heads,
                                  module.head_dim), module))
    return out


def backbone_method(backbone: nn.Module) -> str:
    """The single layer-attention method used by every block of ``backbone``."""
    methods = {method_of(m) for _, m in attention_blocks(backbone)}
    if len(methods) != 1:
        raise ValueError(f'the backbone mixes layer-attention methods {sorted(methods)}')
    return methods.pop()


# -- running a backbone with hooks on its layer-attention modules --

@torch.no_grad()
def record_blocks(backbone: nn.Module,
                  images: Iterable[Tensor],
                  record: Callable[[nn.Module, Tensor, Any], Any],
                  progress: Progress = None) -> Tuple[List[BlockInfo], List[List[Any]]]:
    """Run ``backbone`` in eval mode on each batch and record every block.

    A forward pre-hook on each layer-attention module calls
    ``record(module, x, state)`` with the block output ``x`` (``[B, C, H, W]``)
    and the incoming operator state (``None`` for the very first block).

    Args:
        backbone: a backbone with layer-attention modules.
        images: batches ``[B, 3, H, W]`` (on the backbone's device).
        record: what to keep of each block, computed from its inputs.
        progress: called once after each batch (e.g. a progress bar's ``update``).

    Returns:
        ``(blocks, records)`` with ``records[t]`` the list of what ``record``
        returned for block ``t``, one entry per batch.
    """
    blocks = attention_blocks(backbone)
    records: List[List[Any]] = [[] for _ in blocks]

    def make_hook(t: int):
        def hook(module: nn.Module, args: tuple) -> None:
            state = args[1] if len(args) > 1 else None
            records[t].append(record(module, args[0], state))
        return hook

    handles = [m.register_forward_pre_hook(make_hook(info.index)) for info, m in blocks]
    was_training = backbone.training
    backbone.eval()
    try:
        for batch in images:
            backbone(batch)
            if progress is not None:
                progress()
    finally:
        backbone.train(was_training)
        for h in handles:
            h.remove()
    if not records[0]:
        raise ValueError('no images: the image source yielded no batch')
    return [info for info, _ in blocks], records


def _block_key(module: nn.Module, x: Tensor, state: Any) -> Tensor:
    return module.keys(x)[1].float().cpu()  # [B, G, d]


def collect_keys(backbone: nn.Module, images: Iterable[Tensor],
                 progress: Progress = None) -> Tuple[List[BlockInfo], List[Tensor]]:
    """The key ``Wk(GAP(x_t))`` of every block, per head.

    Args:
        backbone: a backbone with layer-attention modules (any of :data:`METHODS`).
        images: batches ``[B, 3, H, W]``.
        progress: called once per batch.

    Returns:
        ``(blocks, keys)``; ``keys[t]`` is ``[N, G_t, d]`` float32 over all N images.
    """
    blocks, records = record_blocks(backbone, images, _block_key, progress)
    return blocks, [torch.cat(r) for r in records]


# -- key correlation --

def head_overlap(num_to: int, num_from: int) -> Tensor:
    """How the heads of one width map onto the heads of another.

    ``M[g, h]`` is the fraction of head ``g``'s relative channel span
    ``[g/num_to, (g+1)/num_to)`` that lies in head ``h``'s span
    ``[h/num_from, (h+1)/num_from)``. Rows sum to 1; equal counts give the
    identity; for ``num_to = 2 * num_from`` (a ResNet stage transition) head
    ``g`` maps to head ``g // 2``.

    Returns:
        ``[num_to, num_from]`` float64.
    """
    g = torch.arange(num_to, dtype=torch.float64)[:, None]
    h = torch.arange(num_from, dtype=torch.float64)[None, :]
    lo = torch.maximum(g / num_to, h / num_from)
    hi = torch.minimum((g + 1) / num_to, (h + 1) / num_from)
    return (hi - lo).clamp_min(0) * num_to


def key_cosine(keys_a: Tensor, keys_b: Tensor) -> float:
    """Mean cosine similarity between the keys of two blocks.

    The cosine is taken per image and per head (heads matched with
    :func:`head_overlap`, iterating over the heads of the block that has
    more of them), then averaged over heads and images.

    Args:
        keys_a: ``[N, G_a, d]``.
        keys_b: ``[N, G_b, d]``.
    """
    if keys_a.shape[1] > keys_b.shape[1]:
        keys_a, keys_b = keys_b, keys_a
    if keys_a.shape[0] != keys_b.shape[0] or keys_a.shape[2] != keys_b.shape[2]:
        raise ValueError(f'key shapes {tuple(keys_a.shape)} and {tuple(keys_b.shape)} differ '
                         'in the number of images or the head dimension')
    a = F.normalize(keys_a.double(), dim=-1)  # [N, G_a, d]
    b = F.normalize(keys_b.double(), dim=-1)  # [N, G_b, d]
    cos = torch.einsum('ngd,nhd->ngh', b, a)  # [N, G_b, G_a]
    m = head_overlap(b.shape[1], a.shape[1])  # [G_b, G_a]
    return float((cos * m).sum(-1).mean())


def key_cosine_matrix(keys: Sequence[Tensor]) -> np.ndarray:
    """Pairwise mean key cosine similarity between all blocks (:func:`key_cosine`).

    Args:
        keys: per block ``[N, G_t, d]``, as returned by :func:`collect_keys`.

    Returns:
        ``[T, T]`` float64, symmetric, ones on the diagonal (for non-zero keys).
    """
    n = len(keys)
    out = np.empty((n, n), dtype=np.float64)
    for i in range(n):
        for j in range(i, n):
            out[i, j] = out[j, i] = key_cosine(keys[i], keys[j])
    return out


def correlation_summary(matrix: np.ndarray, blocks: Sequence[BlockInfo]) -> Dict[str, Any]:
    """Mean off-diagonal cosine within each stage, within all stages and across stages.

    Returns:
        ``dict(within_stage={'layer1': mean or None, ...}, within=..., across=...)``;
        a mean over no pairs (a stage of one block, a network of one stage) is ``None``.
    """
    stages = np.array([b.stage for b in blocks])
    off = ~np.eye(len(blocks), dtype=bool)
    same = stages[:, None] == stages[None, :]

    def mean(mask: np.ndarray) -> Optional[float]:
        return float(matrix[mask].mean()) if mask.any() else None

    within_stage = {f'layer{s + 1}': mean(off & same & (stages[:, None] == s))
                    for s in sorted(set(stages.tolist()))}
    return dict(within_stage=within_stage, within=mean(off & same), across=mean(~same))


def summary_line(summary: Mapping[str, Any]) -> str:
    """One line: ``mean off-diagonal key cosine: layer1 0.93, ... | within 0.9 | across 0.5``."""
    def fmt(v: Optional[float]) -> str:
        return 'n/a' if v is None else f'{v:.3f}'

    stages = ', '.join(f'{k} {fmt(v)}' for k, v in summary['within_stage'].items())
    return (f'mean off-diagonal key cosine: within stages ({stages}) | all within-stage pairs '
            f'{fmt(summary["within"])} | across stages {fmt(summary["across"])}')


# -- effective layer weights --

@dataclass
class LayerWeights:
    """Effective weight of every earlier block ``s`` at every block ``t``.

    Attributes:
        method: one of :data:`METHODS`.
        blocks: the blocks, in order.
        per_head: per block ``t``, ``[G_t, T]``: the weight of block ``s`` in
            head ``g`` of block ``t`` (zero for ``s > t``), averaged over images.
        through_pseudo: KCLA only, ``[T]``: the part of each row that reaches
            block ``t`` through the pseudo-layer of the last init layer (and is
            attributed to earlier blocks, see :func:`kcla_layer_weights`).
    """

    method: str
    blocks: List[BlockInfo]
    per_head: List[np.ndarray]
    through_pseudo: Optional[np.ndarray] = None

    @property
    def matrix(self) -> np.ndarray:
        """``[T, T]``: row ``t``, column ``s``, averaged over the heads of block ``t``."""
        return np.stack([w.mean(0) for w in self.per_head])


def kcla_layer_weights(logits: Sequence[Tensor],
                       pseudo_logits: Sequence[Optional[Tensor]]
                       ) -> Tuple[List[Tensor], List[Tensor]]:
    """KCLA's normalised layer weights ``w_s / sum w`` from the per-block logits.

    Within a segment that starts at block ``r`` (the network's first block or
    an init layer), the state of block ``t`` is the softmax-weighted mean of
    the block outputs ``x_r .. x_t`` and, after an init layer, of one
    pseudo-layer ``u`` (the re-normalised incoming state, logit
    ``pseudo_logits[r]``). NOTE: attribution through the pseudo-layer is an
    approximation: the weight of ``u`` is split over the earlier blocks in
    proportion to their normalised weights in the state that arrived at ``r``,
    mapping heads with :func:`head_overlap` (as ``adjust``'s groups do), and the
    ``adjust``/``norm_u`` transform itself (a 1x1 conv and a BatchNorm) is
    ignored. The ``+eps`` of ``u / (z + eps)`` (a factor of at least
    ``1 / (1 + 1e-3)``) is ignored as well, so every row sums to 1 exactly.

    Args:
        logits: per block, ``[B, G_t]``: ``layer.logits(k_t)``, the logit of its weight.
        pseudo_logits: per block, ``[B, G_t]`` for an init layer that received a
            state (``layer.renormalize(state, x).log_z``), else ``None``.

    Returns:
        ``(weights, through_pseudo)``: ``weights[t]`` is ``[B, G_t, T]`` float64,
        ``through_pseudo[t]`` ``[B, G_t]``, the weight that reaches block ``t``
        through pseudo-layers.
    """
    n = len(logits)
    weights: List[Tensor] = []
    through: List[Tensor] = []
    comp: Optional[Tensor] = None  # [B, G, T]: composition of the state
    log_z: Optional[Tensor] = None  # [B, G]
    start = 0  # first block of the current segment
    for t, (logit, pseudo) in enumerate(zip(logits, pseudo_logits)):
        logit = logit.double()
        b, g = logit.shape
        if comp is None:
            if pseudo is not None:
                raise ValueError('block 0 cannot re-normalise: no state arrives there')
            comp = logit.new_zeros(b, g, n)
            comp[:, :, t] = 1.0
            log_z = logit
        else:
            if pseudo is not None:
                m = head_overlap(g, comp.shape[1]).to(comp)  # [G, G_prev]
                comp = torch.einsum('gh,bhs->bgs', m, comp)  # pseudo-layer, split
                log_z = pseudo.double()  # the pseudo-layer is the whole history
                start = t
            elif comp.shape[1] != g:
                raise ValueError(f'block {t} has {g} heads but the state {comp.shape[1]}: '
                                 'only an init layer adapts the state')
            new_log_z = torch.logaddexp(log_z, logit)  # [B, G]
            comp = comp * torch.exp(log_z - new_log_z)[..., None]
            comp[:, :, t] = torch.exp(logit - new_log_z)
            log_z = new_log_z
        weights.append(comp.clone())
        through.append(comp[:, :, :start].sum(-1))
    return weights, through


def full_attention_layer_weights(attention: Sequence[Tensor], num_blocks: int) -> List[Tensor]:
    """FullLayerAttention's softmax placed on the network's block axis.

    Args:
        attention: per block ``t``, ``[B, G, T_t]``: the softmax over the
            ``T_t`` blocks of the current stage up to ``t`` (the history
            restarts at each stage start, so these are blocks
            ``t - T_t + 1 .. t``).
        num_blocks: ``T``, the number of blocks of the network.

    Returns:
        Per block, ``[B, G, T]`` float64, zero outside the current stage.
    """
    out = []
    for t, a in enumerate(attention):
        w = a.new_zeros(a.shape[0], a.shape[1], num_blocks, dtype=torch.float64)
        w[:, :, t - a.shape[-1] + 1:t + 1] = a.double()
        out.append(w)
    return out


def mrla_layer_weights(gates: Sequence[Tensor], lambdas: Sequence[Optional[Tensor]],
                       head_dim: int) -> List[Tensor]:
    """MRLA-light's coefficient of block ``s`` in the accumulation ``y_t``.

    ``y_t = g_t * Wv(x_t) + lambda_t * y_{t-1}``, restarted at each stage
    start, so ``Wv(x_s)`` enters ``y_t`` with the per-channel coefficient
    ``g_s * lambda_{s+1} * ... * lambda_t``. NOTE: the magnitude of the
    coefficient is taken (a learned lambda may be negative, and averaging
    signed products over channels would cancel), then averaged over the
    channels of each head. The BatchNorm after ``y_t`` is ignored. These
    coefficients are not normalised: they need not sum to 1.

    Args:
        gates: per block, ``[B, G_t]``: ``layer.gate(q_t, k_t)``.
        lambdas: per block, ``[C_t]``: ``layer.lambda_t`` flattened, or
            ``None`` where the recurrence restarts (a stage start).
        head_dim: channels per head.

    Returns:
        Per block, ``[B, G_t, T]`` float64.
    """
    n = len(gates)
    out = []
    coef: Optional[Tensor] = None  # [B, C, T]
    for t, (gate, lam) in enumerate(zip(gates, lambdas)):
        b, g = gate.shape
        per_channel = gate.double().repeat_interleave(head_dim, dim=1)  # [B, C]
        if lam is None or coef is None:
            coef = per_channel.new_zeros(b, per_channel.shape[1], n)
        else:
            coef = coef * lam.double().abs()[None, :, None]
        coef[:, :, t] = per_channel
        out.append(coef.view(b, g, head_dim, n).mean(2))
    return out


def _kcla_record(module: KCLA, x: Tensor, state: Any) -> Tuple[Tensor, Optional[Tensor]]:
    _, k = module.keys(x)
    pseudo = None
    if state is not None and module.renorm:
        pseudo = module.renormalize(state, x).log_z.float().cpu()  # [B, G]
    return module.logits(k).float().cpu(), pseudo


def _full_record(module: FullLayerAttention, x: Tensor, state: Any) -> Tensor:
    if module.stage_start or state is None:
        return x.new_ones(x.shape[0], module.num_heads, 1, dtype=torch.float32).cpu()
    q, k = module.keys(x)
    return module.attention(q, state.keys + (k, )).float().cpu()  # [B, G, T_t]


def _mrla_record(module: MRLALight, x: Tensor, state: Any) -> Tuple[Tensor, Optional[Tensor]]:
    q, k = module.keys(x)
    restart = module.stage_start or state is None
    lam = None if restart else module.lambda_t.detach().float().flatten().cpu()
    return module.gate(q, k).float().cpu(), lam


def layer_weights(backbone: nn.Module, images: Iterable[Tensor],
                  progress: Progress = None) -> LayerWeights:
    """The effective layer weights of a backbone, averaged over ``images``.

    Args:
        backbone: a backbone whose blocks all use one of :data:`METHODS`.
        images: batches ``[B, 3, H, W]``.
        progress: called once per batch.
    """
    method = backbone_method(backbone)
    record = {'KCLA': _kcla_record, 'FullLayerAttention': _full_record,
              'MRLALight': _mrla_record}[method]
    blocks, records = record_blocks(backbone, images, record, progress)
    through = None
    if method == 'KCLA':
        logits = [torch.cat([r[0] for r in rs]) for rs in records]
        pseudo = [None if rs[0][1] is None else torch.cat([r[1] for r in rs]) for rs in records]
        weights, via_pseudo = kcla_layer_weights(logits, pseudo)
        through = np.array([p.mean().item() for p in via_pseudo])
    elif method == 'FullLayerAttention':
        weights = full_attention_layer_weights([torch.cat(rs) for rs in records], len(blocks))
    else:  # the lambdas are parameters: the same for every batch
        gates = [torch.cat([r[0] for r in rs]) for rs in records]
        weights = mrla_layer_weights(gates, [rs[0][1] for rs in records], blocks[0].head_dim)
    per_head = [w.mean(0).numpy() for w in weights]
    return LayerWeights(method, blocks, per_head, through)


# -- checkpoints --

@dataclass
class StateDictMismatch:
    """How a checkpoint's state dict differs from a model's.

    Attributes:
        missing: keys of the model that the checkpoint lacks.
        unexpected: keys of the checkpoint that the model lacks.
        shapes: ``(key, checkpoint shape, model shape)`` for common keys whose shapes differ.
    """

    missing: List[str]
    unexpected: List[str]
    shapes: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.shapes)

    def describe(self, limit: int = 20) -> str:
        """A multi-line report naming the keys and shapes (``limit`` of each kind)."""
        lines = []

        def section(title: str, items: List[str]) -> None:
            if items:
                lines.append(f'{title} ({len(items)}):')
                lines.extend(f'  {i}' for i in items[:limit])
                if len(items) > limit:
                    lines.append(f'  ... and {len(items) - limit} more')

        section('missing in the checkpoint', self.missing)
        section('unexpected in the checkpoint (not in the model)', self.unexpected)
        section('shape mismatch (checkpoint vs model)',
                [f'{k}: {tuple(a)} vs {tuple(b)}' for k, a, b in self.shapes])
        attn_ckpt = any('_attn.' in k for k in self.unexpected)
        attn_model = any('_attn.' in k for k in self.missing)
        if attn_ckpt and not attn_model:
            lines.append('hint: the checkpoint has layer-attention weights the model lacks: '
                         'is layer_attn=None in the config, or is it another method?')
        elif attn_model and not attn_ckpt:
            lines.append('hint: the model has layer-attention weights the checkpoint lacks: '
                         'was the checkpoint trained with layer_attn=None or another method?')
        if self.shapes:
            lines.append('hint: check depth, base_channels, head_dim and layer_attn against '
                         'the config the checkpoint was trained with')
        return '\n'.join(lines)


def compare_state_dicts(model_sd: Mapping[str, Tensor],
                        ckpt_sd: Mapping[str, Tensor]) -> StateDictMismatch:
    """Missing and unexpected keys and shape mismatches of ``ckpt_sd`` against ``model_sd``."""
    missing = [k for k in model_sd if k not in ckpt_sd]
    unexpected = [k for k in ckpt_sd if k not in model_sd]
    shapes = [(k, tuple(v.shape), tuple(model_sd[k].shape)) for k, v in ckpt_sd.items()
              if k in model_sd and tuple(v.shape) != tuple(model_sd[k].shape)]
    return StateDictMismatch(missing, unexpected, shapes)


def unwrap_state_dict(obj: Any) -> Dict[str, Tensor]:
    """The tensors of a checkpoint: its ``state_dict`` entry if any, ``module.`` stripped."""
    sd = obj.get('state_dict', obj) if isinstance(obj, Mapping) else None
    if not isinstance(sd, Mapping):
        raise ValueError(f'not a checkpoint: expected a dict of tensors, got {type(obj).__name__}')
    return {(k[len('module.'):] if k.startswith('module.') else k): v
            for k, v in sd.items() if isinstance(v, Tensor)}


def sub_state_dict(sd: Mapping[str, Tensor], prefix: str) -> Dict[str, Tensor]:
    """The entries under ``prefix`` (e.g. ``'backbone.'``), with the prefix removed."""
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


# -- complexity --

#: elementwise arithmetic counted by :func:`flop_analyzer` with ``elementwise=True``:
#: FLOPs per output element.
ELEMENTWISE_FLOPS: Dict[str, int] = {
    'aten::add': 1, 'aten::add_': 1, 'aten::sub': 1, 'aten::rsub': 1, 'aten::mul': 1,
    'aten::mul_': 1, 'aten::div': 1, 'aten::addcmul': 1, 'aten::lerp': 2, 'aten::lerp_': 2,
}


def flop_analyzer(model: nn.Module, inputs: Tuple[Any, ...], elementwise: bool = True):
    """mmengine's ``FlopAnalyzer`` (one multiply-add = one FLOP), warnings silenced.

    Args:
        model: traced as ``model(*inputs)``.
        inputs: its inputs.
        elementwise: also count the elementwise arithmetic of
            :data:`ELEMENTWISE_FLOPS`, which mmengine ignores by default, so that
            the aggregation of layer attention (e.g. FullLayerAttention's
            weighted sum over the stage's history) is not invisible.
    """
    from mmengine.analysis import FlopAnalyzer
    from mmengine.analysis.jit_handles import get_shape

    def per_output(scale: int):
        def handle(ins: List[Any], outs: List[Any]) -> int:
            shape = get_shape(outs[0])
            return 0 if shape is None else scale * math.prod(shape)
        return handle

    analyzer = FlopAnalyzer(model, inputs)
    if elementwise:
        analyzer.set_op_handle(**{op: per_output(s) for op, s in ELEMENTWISE_FLOPS.items()})
    return (analyzer.tracer_warnings('none').unsupported_ops_warnings(False)
            .uncalled_modules_warnings(False))


def complexity_breakdown(model: nn.Module, flops_by_module: Mapping[str, int],
                         backbone: str = 'backbone') -> List[Dict[str, Any]]:
    """Parameters and FLOPs of the whole model, its backbone and its layer attention.

    Args:
        model: the analysed model.
        flops_by_module: ``FlopAnalyzer.by_module()`` of ``model``.
        backbone: name of the backbone sub-module; ``''`` when ``model`` is the backbone.

    Returns:
        Rows ``dict(part, params, flops)``: ``model`` (if it is not the backbone),
        ``backbone``, ``backbone: layer attention`` and its share per stage
        (``layer{s}_attn``), ``backbone without layer attention``.
    """
    params = {n: p.numel() for n, p in model.named_parameters()}
    prefix = f'{backbone}.' if backbone else ''

    def param_sum(pred: Callable[[str], bool]) -> int:
        return sum(v for n, v in params.items() if pred(n))

    rows = []
    if backbone:
        rows.append(dict(part='model', params=sum(params.values()),
                         flops=int(flops_by_module.get('', 0))))
    bb_params = param_sum(lambda n: n.startswith(prefix))
    bb_flops = int(flops_by_module.get(backbone, 0))
    rows.append(dict(part='backbone', params=bb_params, flops=bb_flops))
    stages = sorted((name for name in flops_by_module
                     if name.startswith(prefix) and ATTN_LIST.search(name)
                     and name.count('.') == prefix.count('.')),
                    key=lambda s: int(ATTN_LIST.search(s).group(1)))
    attn_rows = [dict(part=f'  {name[len(prefix):]}',
                      params=param_sum(lambda n, s=name: n.startswith(s + '.')),
                      flops=int(flops_by_module[name])) for name in stages]
    attn_params = sum(r['params'] for r in attn_rows)
    attn_flops = sum(r['flops'] for r in attn_rows)
    rows.append(dict(part='backbone: layer attention', params=attn_params, flops=attn_flops))
    rows.extend(attn_rows)
    rows.append(dict(part='backbone without layer attention', params=bb_params - attn_params,
                     flops=bb_flops - attn_flops))
    return rows


# -- plots (matplotlib imported here, on use) --

def _stage_edges(blocks: Sequence[BlockInfo]) -> List[int]:
    return [b.index for b in blocks[1:] if b.block == 0]


def _block_ticks(ax, blocks: Sequence[BlockInfo], axes: str = 'xy') -> None:
    if len(blocks) <= 24:
        ticks = list(range(len(blocks)))
        labels = [b.name for b in blocks]
    else:  # one label per stage, at its middle
        stages = sorted({b.stage for b in blocks})
        idx = [[b.index for b in blocks if b.stage == s] for s in stages]
        ticks = [(i[0] + i[-1]) / 2 for i in idx]
        labels = [f'layer{s + 1}' for s in stages]
    if 'x' in axes:
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
    if 'y' in axes:
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=6)


def plot_key_correlation(matrix: np.ndarray, blocks: Sequence[BlockInfo], path: str,
                         title: str = '') -> None:
    """Heatmap of the key cosine matrix with stage boundaries, written as a PNG."""
    from matplotlib.figure import Figure

    n = len(blocks)
    side = min(max(4.6, 0.18 * n + 2.5), 12.0)
    fig = Figure(figsize=(side + 1.2, side), dpi=100, layout='constrained')
    ax = fig.add_subplot()
    im = ax.imshow(matrix, cmap='RdBu_r', vmin=-1, vmax=1, interpolation='nearest')
    for e in _stage_edges(blocks):
        ax.axhline(e - 0.5, color='k', lw=0.8)
        ax.axvline(e - 0.5, color='k', lw=0.8)
    _block_ticks(ax, blocks)
    ax.set_xlabel('block s')
    ax.set_ylabel('block t')
    fig.colorbar(im, ax=ax, label='mean cosine similarity of keys')
    ax.set_title(title, fontsize=7)
    fig.savefig(path)


_COLOURS = {'KCLA': 'tab:red', 'FullLayerAttention': 'tab:blue', 'MRLALight': 'tab:green'}


def longest_stage_end(blocks: Sequence[BlockInfo]) -> int:
    """Index of the last block of the longest stage (the deepest such stage on ties)."""
    counts: Dict[int, int] = {}
    for b in blocks:
        counts[b.stage] = counts.get(b.stage, 0) + 1
    stage = max(counts, key=lambda s: (counts[s], s))
    return max(b.index for b in blocks if b.stage == stage)


def plot_layer_weights(results: Sequence[LayerWeights], path: str, title: str = '') -> None:
    """The effective layer weights of each method side by side, written as a PNG.

    Top row: one heatmap per method (row ``t``, column ``s``, log colour
    scale, stage boundaries marked). Bottom: the weights that the last block
    of the longest stage gives to every earlier block, on a log axis, where an
    exponential decay is a straight line.
    """
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    n = len(results)
    fig = Figure(figsize=(3.6 * n + 1.0, 6.6), dpi=100, layout='constrained')
    grid = fig.add_gridspec(2, n, height_ratios=(1.2, 1))
    positive = np.concatenate([r.matrix[r.matrix > 0] for r in results])
    vmin = max(float(positive.min()), 1e-6) if positive.size else 1e-6
    norm = LogNorm(vmin=vmin, vmax=max(1.0, float(positive.max())))
    im = None
    heatmaps = []
    for i, r in enumerate(results):
        ax = fig.add_subplot(grid[0, i])
        heatmaps.append(ax)
        m = np.ma.masked_less_equal(r.matrix, 0)
        im = ax.imshow(m, cmap='viridis', norm=norm, interpolation='nearest')
        for e in _stage_edges(r.blocks):
            ax.axhline(e - 0.5, color='0.5', lw=0.8)
            ax.axvline(e - 0.5, color='0.5', lw=0.8)
        _block_ticks(ax, r.blocks)
        ax.set_title(r.method, fontsize=9)
        ax.set_xlabel('earlier block s', fontsize=8)
        if i == 0:
            ax.set_ylabel('block t', fontsize=8)
    fig.colorbar(im, ax=heatmaps, shrink=0.9, label='weight of block s at block t')
    ax = fig.add_subplot(grid[1, :])
    blocks = results[0].blocks
    t = longest_stage_end(blocks)
    for r in results:
        row = r.matrix[t, :t + 1]
        s = np.arange(t + 1)
        keep = row > 0
        ax.semilogy(s[keep], row[keep], 'o-', ms=3, color=_COLOURS.get(r.method),
                    label=r.method)
    for e in _stage_edges(blocks):
        if e <= t:
            ax.axvline(e - 0.5, color='0.6', lw=0.8, ls='--')
    _block_ticks(ax, blocks[:t + 1], axes='x')
    ax.set_xlim(-0.5, t + 0.5)
    ax.set_xlabel(f'earlier block s; weights at block t = {blocks[t].name}, the last block '
                  'of the longest stage (dashed: stage starts)', fontsize=8)
    ax.set_ylabel('weight (log scale)', fontsize=8)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path)
