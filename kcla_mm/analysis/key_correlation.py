"""Key correlation: the keys of every block and their cosine similarity across blocks.

(``docs/method.md``, sections 3 and 9.)
"""
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .blocks import BlockInfo, Progress, block_ticks, record_blocks, stage_edges


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


def plot_key_correlation(matrix: np.ndarray, blocks: Sequence[BlockInfo], path: str,
                         title: str = '') -> None:
    """Heatmap of the key cosine matrix with stage boundaries, written as a PNG."""
    from matplotlib.figure import Figure

    n = len(blocks)
    side = min(max(4.6, 0.18 * n + 2.5), 12.0)
    fig = Figure(figsize=(side + 1.2, side), dpi=100, layout='constrained')
    ax = fig.add_subplot()
    im = ax.imshow(matrix, cmap='RdBu_r', vmin=-1, vmax=1, interpolation='nearest')
    for e in stage_edges(blocks):
        ax.axhline(e - 0.5, color='k', lw=0.8)
        ax.axvline(e - 0.5, color='k', lw=0.8)
    block_ticks(ax, blocks)
    ax.set_xlabel('block s')
    ax.set_ylabel('block t')
    fig.colorbar(im, ax=ax, label='mean cosine similarity of keys')
    ax.set_title(title, fontsize=7)
    fig.savefig(path)
