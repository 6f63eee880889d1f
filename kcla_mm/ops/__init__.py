"""Layer-attention operators, pure torch (no mmcv/mmengine/mmdet/mmseg)."""
from ._common import BlockPosition, DropPath, eca_kernel_size
from .factory import LAYER_ATTN, build_layer_attn, get_layer_attn_class
from .full_layer_attention import FullLayerAttention, FullLayerAttentionState
from .kcla import (KCLA, KCLAState, log_uniform_inverse_temperatures, residual_norm_relu_pool_,
                   residual_relu_pool_, saved_output_hooks)
from .mrla_light import MRLALight, MRLALightState

__all__ = [
    'BlockPosition', 'DropPath', 'eca_kernel_size', 'LAYER_ATTN', 'build_layer_attn',
    'get_layer_attn_class', 'KCLA', 'KCLAState', 'log_uniform_inverse_temperatures',
    'residual_norm_relu_pool_', 'residual_relu_pool_', 'saved_output_hooks',
    'FullLayerAttention', 'FullLayerAttentionState', 'MRLALight', 'MRLALightState'
]
