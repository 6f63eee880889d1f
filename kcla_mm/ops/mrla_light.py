"""MRLA-light, the linear-cost layer attention of Fang et al. (ICLR 2023).

"Cross-Layer Retrospective Retrieving via Layer Attention". Per block::

    y_t = sigmoid(<q_t^g, k_t^g> / sqrt(d)) * Wv(x_t) + lambda_t * y_{t-1}
    o_t = BN(y_t),   out = x_t + DropPath(o_t)

so the contribution of block s to block t is scaled by the product
``lambda_{s+1} ... lambda_t`` and fades exponentially with depth: the
behaviour KCLA is designed to avoid (``docs/method.md``, sections 7 and 9).
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .common import (BlockPosition, DropPath, NormLayer, check_batch, check_drop_path, check_heads,
                     check_input, eca_conv, per_channel, pooled_qk, value_conv)


class MRLALightState(NamedTuple):
    """Attributes:
        prev: the previous block's accumulation ``y_{t-1}``, ``[B, C, H, W]``.
    """

    prev: Tensor

    @property
    def num_bytes(self) -> int:
        return self.prev.numel() * self.prev.element_size()


class MRLALight(nn.Module):
    """MRLA-light layer for one block.

    Args:
        channels: width ``C`` of the block output.
        head_dim: channels per head ``d``.
        drop_path: stochastic-depth rate of the attention branch.
        norm_layer: builds the output norm.
        stage_start: the first block of a stage starts a new recurrence.
        lambda_init: initial value of the per-channel decay ``lambda``.

    Shapes:
        x: ``[B, C, H, W]``; out: ``[B, C, H, W]``.
    """

    def __init__(self,
                 channels: int,
                 head_dim: int = 64,
                 drop_path: float = 0.0,
                 norm_layer: NormLayer = nn.BatchNorm2d,
                 stage_start: bool = False,
                 lambda_init: float = 0.5) -> None:
        super().__init__()
        self.channels = channels
        self.head_dim = head_dim
        self.num_heads = check_heads(channels, head_dim)
        self.stage_start = bool(stage_start)
        self.lambda_init = float(lambda_init)
        self.wq = eca_conv(channels)
        self.wk = eca_conv(channels)
        self.wv = value_conv(channels)
        self.norm = norm_layer(channels)
        # NOTE: a constant init (the MRLA code draws it at random); the first
        # block of a stage has no predecessor, so its lambda is not created.
        self.lambda_t = None if self.stage_start else nn.Parameter(torch.empty(1, channels, 1, 1))
        self.drop_path = DropPath(check_drop_path(drop_path))
        self.reset_parameters()

    @classmethod
    def for_position(cls, channels: int, position: BlockPosition, **kwargs) -> 'MRLALight':
        return cls(channels, stage_start=position.stage_start, **kwargs)

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.wq.weight)
        nn.init.xavier_uniform_(self.wk.weight)
        nn.init.kaiming_normal_(self.wv.weight, mode='fan_out', nonlinearity='relu')
        if self.lambda_t is not None:
            nn.init.constant_(self.lambda_t, self.lambda_init)

    def keys(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Queries and keys of ``x``: each ``[B, G, d]`` float32."""
        return pooled_qk(x, self.wq, self.wk, self.num_heads)

    def gate(self, q: Tensor, k: Tensor) -> Tensor:
        """``sigmoid(<q, k> / sqrt(d))`` per head: ``[B, G]`` float32."""
        return torch.sigmoid((q * k).sum(-1) / math.sqrt(self.head_dim))

    def forward(self, x: Tensor, state: Optional[MRLALightState] = None, *,
                reuse_state: bool = False) -> Tuple[Tensor, MRLALightState]:
        """One step: ``(x + attention output, new state)``.

        ``reuse_state`` is the operators' common speed hint (see
        :meth:`kcla_mm.ops.KCLA.forward`); unused here.
        """
        check_input(x, self.channels, 'MRLALight')
        q, k = self.keys(x)  # [B, G, d]
        y = self.wv(x) * per_channel(self.gate(q, k), self.head_dim, x.dtype)  # [B, C, H, W]
        if not self.stage_start and state is not None:
            check_batch(state.prev.shape[0], x, 'MRLALight')
            y = torch.addcmul(y, state.prev.to(y.dtype), self.lambda_t.to(y.dtype))
        return x + self.drop_path(self.norm(y)), MRLALightState(y)

    def extra_repr(self) -> str:
        return f'channels={self.channels}, heads={self.num_heads}, stage_start={self.stage_start}'
