"""Analyses of layer-attention backbones: key correlation, effective layer weights, cost.

The logic behind ``tools/analysis_tools/`` (the tools are thin command lines
around it), one module per analysis: :mod:`.blocks` (which blocks carry layer
attention), :mod:`.key_correlation`, :mod:`.layer_weights`,
:mod:`.complexity` (FLOPs), :mod:`.checkpoints` (comparing a checkpoint with a
model) and :mod:`.benchmark` (time and memory against the plain ResNet).
Pure torch and numpy: matplotlib is imported inside the plotting functions
and mmengine inside :func:`flop_analyzer`, so importing this package pulls in
neither.

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

from .blocks import (ATTN_LIST, METHODS, BlockInfo, attention_blocks, backbone_method, method_of,
                     record_blocks)
from .checkpoints import StateDictMismatch, compare_state_dicts, sub_state_dict, unwrap_state_dict
from .complexity import ELEMENTWISE_FLOPS, complexity_breakdown, flop_analyzer
from .key_correlation import (collect_keys, correlation_summary, head_overlap, key_cosine,
                              key_cosine_matrix, plot_key_correlation, summary_line)
from .layer_weights import (LayerWeights, full_attention_layer_weights, kcla_layer_weights,
                            layer_weights, longest_stage_end, mrla_layer_weights,
                            plot_layer_weights)

__all__ = [
    'ATTN_LIST', 'METHODS', 'BlockInfo', 'attention_blocks', 'backbone_method', 'method_of',
    'record_blocks', 'StateDictMismatch', 'compare_state_dicts', 'sub_state_dict',
    'unwrap_state_dict', 'ELEMENTWISE_FLOPS', 'complexity_breakdown', 'flop_analyzer',
    'collect_keys', 'correlation_summary', 'head_overlap', 'key_cosine', 'key_cosine_matrix',
    'plot_key_correlation', 'summary_line', 'LayerWeights', 'full_attention_layer_weights',
    'kcla_layer_weights', 'layer_weights', 'longest_stage_end', 'mrla_layer_weights',
    'plot_layer_weights'
]
