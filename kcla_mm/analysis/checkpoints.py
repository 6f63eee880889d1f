"""Comparing a checkpoint's tensors with a model's."""
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple

from torch import Tensor


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
