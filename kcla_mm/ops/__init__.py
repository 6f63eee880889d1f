"""Layer-attention operators, pure torch (no mmcv/mmengine/mmdet/mmseg).

- :mod:`.kcla_reference`: the KCLA method as the paper writes it (read this first);
- :mod:`.kcla` (:class:`KCLA`), :mod:`.kcla_state`, :mod:`.recompute`: the
  operator used in the backbones, its state and its memory-saving training path;
- :mod:`.full_layer_attention`, :mod:`.mrla_light`: the comparison methods;
- :mod:`.factory`: ``layer_attn=dict(type=...)`` -> operator class;
- :mod:`.residual`: a residual block's end (norms, add, ReLU);
- :mod:`.config`: the switch of the fused kernels and the seam to them;
- :mod:`.fused`: the fast paths (fused CPU kernels), optional.
"""
from .common import BlockPosition, DropPath, eca_kernel_size
from .config import fused_kernels, set_fused_kernels, use_fused_kernels
from .factory import LAYER_ATTN, build_layer_attn, get_layer_attn_class
from .full_layer_attention import FullLayerAttention, FullLayerAttentionState
from .kcla import KCLA, log_uniform_inverse_temperatures
from .kcla_state import KCLAState
from .mrla_light import MRLALight, MRLALightState
from .recompute import saved_output_hooks
from .residual import residual_end

__all__ = [
    'BlockPosition', 'DropPath', 'eca_kernel_size', 'fused_kernels', 'set_fused_kernels',
    'use_fused_kernels', 'LAYER_ATTN', 'build_layer_attn', 'get_layer_attn_class', 'KCLA',
    'KCLAState', 'log_uniform_inverse_temperatures', 'residual_end', 'saved_output_hooks',
    'FullLayerAttention', 'FullLayerAttentionState', 'MRLALight', 'MRLALightState'
]
