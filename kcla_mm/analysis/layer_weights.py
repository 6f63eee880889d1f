"""Effective layer weights: the weight each earlier block's output gets at every block.

(``docs/method.md``, section 9.)
"""
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from ..ops import KCLA, FullLayerAttention, MRLALight
from .blocks import BlockInfo, Progress, backbone_method, block_ticks, record_blocks, stage_edges
from .key_correlation import head_overlap


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
        for e in stage_edges(r.blocks):
            ax.axhline(e - 0.5, color='0.5', lw=0.8)
            ax.axvline(e - 0.5, color='0.5', lw=0.8)
        block_ticks(ax, r.blocks)
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
    for e in stage_edges(blocks):
        if e <= t:
            ax.axvline(e - 0.5, color='0.6', lw=0.8, ls='--')
    block_ticks(ax, blocks[:t + 1], axes='x')
    ax.set_xlim(-0.5, t + 0.5)
    ax.set_xlabel(f'earlier block s; weights at block t = {blocks[t].name}, the last block '
                  'of the longest stage (dashed: stage starts)', fontsize=8)
    ax.set_ylabel('weight (log scale)', fontsize=8)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path)
