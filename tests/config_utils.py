"""What the config tests of every task share: parsing once, the layer-attention
prefixes of config names, and comparing inherited dicts."""
import functools
import os.path as osp

from mmengine.config import Config

#: config-name prefix -> ``layer_attn`` type (no prefix: the plain ResNet)
LAYER_ATTN = {'kcla-': 'KCLA', 'mrla-light-': 'MRLALight', 'full-la-': 'FullLayerAttention',
              None: None}


@functools.lru_cache(maxsize=None)
def load(path: str) -> Config:
    """Each config is parsed once (about a second each); tests only read it."""
    return Config.fromfile(path)


def ids(paths):
    """Test ids: the configs' file names."""
    return [osp.basename(p) for p in paths]


def without_scope(value):
    """``value`` without the ``_scope_`` keys mmengine adds to inherited dicts."""
    if isinstance(value, dict):
        return {k: without_scope(v) for k, v in value.items() if k != '_scope_'}
    if isinstance(value, (list, tuple)):
        return type(value)(without_scope(v) for v in value)
    return value
