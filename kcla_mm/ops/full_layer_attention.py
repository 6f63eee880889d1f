"""Exact (softmax) layer attention over the earlier blocks of a stage.

The baseline that KCLA approximates (``docs/method.md``, section 2)::

    o_t^g = sum_{s<=t} softmax_s(<q_t^g, k_s^g> / sqrt(d)) * v_s^g

Keys and values of every earlier block of the stage are kept, so block t costs
O(t) work and memory and a stage of D blocks O(D^2). Shipped for comparison
and for the key-correlation property test, not for efficiency.
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import (BlockPosition, DropPath, NormLayer, check_batch, check_drop_path, check_heads,
                     check_input, eca_conv, pooled_qk, value_conv)


class FullLayerAttentionState(NamedTuple):
    """History of the current stage.

    Attributes:
        keys: one ``[B, G, d]`` float32 tensor per earlier block.
        values: one ``[B, C, H, W]`` tensor per earlier block (``Wv`` of that
            block applied to its output).
    """

    keys: Tuple[Tensor, ...]
    values: Tuple[Tensor, ...]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class FullLayerAttention(nn.Module):
    """Exact layer attention for one block.

    Args:
        channels: width ``C`` of the block output.
        head_dim: channels per head ``d``.
        drop_path: stochastic-depth rate of the attention branch.
        norm_layer: builds the output norm.
        stage_start: the first block of a stage starts a new history; an
            incoming state (from the previous stage) is discarded.

    Shapes:
        x: ``[B, C, H, W]``; out: ``[B, C, H, W]``.
    """

    def __init__(self,
                 channels: int,
                 head_dim: int = 64,
                 drop_path: float = 0.0,
                 norm_layer: NormLayer = nn.BatchNorm2d,
                 stage_start: bool = False) -> None:
        super().__init__()
        self.channels = channels
        self.head_dim = head_dim
        self.num_heads = check_heads(channels, head_dim)
        self.stage_start = bool(stage_start)
        # NOTE: at a stage start the softmax runs over one block (weight 1), so
        # the query is never used; not creating Wq keeps DDP free of unused
        # parameters.
        self.wq = None if self.stage_start else eca_conv(channels)
        self.wk = eca_conv(channels)
        self.wv = value_conv(channels)
        self.norm = norm_layer(channels)
        self.drop_path = DropPath(check_drop_path(drop_path))
        self.reset_parameters()

    @classmethod
    def for_position(cls, channels: int, position: BlockPosition,
                     **kwargs) -> 'FullLayerAttention':
        return cls(channels, stage_start=position.stage_start, **kwargs)

    def reset_parameters(self) -> None:
        if self.wq is not None:
            nn.init.xavier_uniform_(self.wq.weight)
        nn.init.xavier_uniform_(self.wk.weight)
        nn.init.kaiming_normal_(self.wv.weight, mode='fan_out', nonlinearity='relu')

    def keys(self, x: Tensor) -> Tuple[Optional[Tensor], Tensor]:
        """Queries and keys of ``x``: each ``[B, G, d]`` float32 (no query at a stage start)."""
        q, k = pooled_qk(x, self.wq or self.wk, self.wk, self.num_heads)
        return (None if self.wq is None else q), k

    def attention(self, q: Tensor, keys: Tuple[Tensor, ...]) -> Tensor:
        """Softmax weights over the history: ``[B, G, T]`` float32."""
        k = torch.stack(keys, dim=-1)  # [B, G, d, T]
        return torch.softmax(torch.einsum('bgd,bgdt->bgt', q, k) / math.sqrt(self.head_dim),
                             dim=-1)

    def aggregate(self, q: Optional[Tensor], state: FullLayerAttentionState) -> Tensor:
        """``sum_s softmax_s(<q, k_s> / sqrt(d)) v_s`` per head: ``[B, C, H, W]``."""
        if len(state.values) == 1:  # one block: softmax weight 1
            return state.values[0]
        attn = self.attention(q, state.keys)  # [B, G, T]
        b, g, n = attn.shape
        v0 = state.values[0]
        # per-channel broadcast of every block's weights in one copy, no
        # [B, G, d, H, W] view of the values: keeps any memory format
        attn = attn.to(v0.dtype).unsqueeze(2).expand(b, g, self.head_dim, n)  # [B, G, d, T]
        attn = attn.reshape(b, g * self.head_dim, 1, 1, n)  # [B, C, 1, 1, T]
        agg = None
        for t, v in enumerate(state.values):
            a = attn[..., t]  # [B, C, 1, 1]
            agg = a * v if agg is None else torch.addcmul(agg, a, v)
        return agg

    def forward(self, x: Tensor, state: Optional[FullLayerAttentionState] = None, *,
                reuse_state: bool = False) -> Tuple[Tensor, FullLayerAttentionState]:
        """One step: ``(x + attention output, new state)``.

        ``reuse_state`` is the operators' common speed hint (see
        :meth:`kcla_mm.ops.KCLA.forward`); unused here.
        """
        check_input(x, self.channels, 'FullLayerAttention')
        if self.stage_start or state is None:
            state = FullLayerAttentionState((), ())
        else:
            check_batch(state.keys[0].shape[0], x, 'FullLayerAttention')
        q, k = self.keys(x)  # [B, G, d]
        state = FullLayerAttentionState(state.keys + (k,), state.values + (self.wv(x),))
        agg = self.aggregate(q, state)  # [B, C, H, W]
        o = F.relu(self.norm(agg), inplace=True)
        return x + self.drop_path(o), state

    def extra_repr(self) -> str:
        return f'channels={self.channels}, heads={self.num_heads}, stage_start={self.stage_start}'
