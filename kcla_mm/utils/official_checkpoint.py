"""Conversion of the KCLA reference ImageNet checkpoints to kcla_mm's layout.

The reference trainer saves a ``.pth.tar`` dict with ``state_dict`` (plus
``epoch``, ``best_acc1``, ``optimizer``); keys may carry a ``module.`` prefix.
Blocks live under ``layer{s}.layers.{i}.*`` and the KCLA layers under
``layer{s}.attention.{i}.*`` (``docs/method.md``, section 8). kcla_mm keeps the host ResNet's
names for the blocks (``layer{s}.{i}.*``) and puts the layer-attention
modules under ``layer{s}_attn.{i}.*``.

Dropped on purpose (reported as ``dropped``): the classifier ``fc.*``; the
frozen temperatures ``norm_d`` (a fixed function of the head count that
kcla_mm recomputes; they are checked against the default range); the init
modules of the network's first block, which never receives a state; and the
``adjust_channel`` of same-width re-normalising blocks (block 11), which the
reference creates but never applies.

:func:`to_classifier_state_dict` puts a converted backbone and the
reference's ``fc`` together as the state dict of mmpretrain's
``ImageClassifier`` (``KCLAResNet`` backbone, ``GlobalAveragePooling`` neck,
``LinearClsHead``): the reference also classifies the global average of the
last stage with one linear layer.
"""
import math
import re
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Tuple

import torch

_ATTN_NAMES = {
    'Wq': 'wq', 'Wk': 'wk', 'Wv': 'wv', 'bn_attention': 'norm', 'head_att': 'phi',
    'adjust_channel': 'adjust', 'u_Wk': 'wk_u', 'u_bn': 'norm_u',
}
_BLOCK = re.compile(r'^layer(\d+)\.layers\.(\d+)\.(.+)$')
_ATTN = re.compile(r'^layer(\d+)\.attention\.(\d+)\.([A-Za-z_]+)(\..+)?$')
_CONV = re.compile(r'^layer(\d+)\.(\d+)\.conv(\d+)\.weight$')
_STEM = re.compile(
    r'^(conv1\.weight|bn1\.(weight|bias|running_mean|running_var|num_batches_tracked))$')


#: The reference classifier's keys and their names in mmpretrain's ``ImageClassifier``.
FC_KEYS = OrderedDict([('fc.weight', 'head.fc.weight'), ('fc.bias', 'head.fc.bias')])


class NotAnOfficialCheckpoint(ValueError):
    """The file is not a checkpoint of the KCLA reference trainer."""


def extract_state_dict(obj) -> Mapping[str, torch.Tensor]:
    """The ``state_dict`` of a reference checkpoint, ``module.`` stripped."""
    if not isinstance(obj, Mapping):
        raise NotAnOfficialCheckpoint(
            f'expected a dict with a "state_dict", got {type(obj).__name__}')
    sd = obj.get('state_dict', obj)
    if not isinstance(sd, Mapping) or not sd:
        raise NotAnOfficialCheckpoint('the checkpoint has no (non-empty) state_dict')
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise NotAnOfficialCheckpoint(f'state_dict entry {k!r} is not a tensor')
    return _strip_module(sd)


def _strip_module(sd: Mapping[str, torch.Tensor]) -> 'OrderedDict[str, torch.Tensor]':
    return OrderedDict((k[len('module.'):] if k.startswith('module.') else k, v)
                       for k, v in sd.items())


def is_official_layout(sd: Mapping[str, torch.Tensor]) -> bool:
    """Whether keys follow the reference layout (``layer{s}.attention.{i}``)."""
    return any(_ATTN.match(k) for k in sd) and any(_BLOCK.match(k) for k in sd)


def _check_temperatures(key: str, norm_d: torch.Tensor,
                        temperature_range: Tuple[float, float]) -> None:
    g = norm_d.numel()
    lo, hi = temperature_range
    seq = torch.exp(torch.linspace(math.log(lo), math.log(hi), g, dtype=torch.float64))
    got = norm_d.detach().double().flatten()
    # either the inverse temperatures (seq) or the temperatures (1/seq = seq reversed)
    if not (torch.allclose(got, seq, rtol=1e-4) or torch.allclose(got, seq.flip(0), rtol=1e-4)):
        raise ValueError(
            f'{key} holds temperatures {got.tolist()} that are not the log-uniform sequence '
            f'over temperature_range={temperature_range}; build the backbone with the '
            'matching layer_attn=dict(type="KCLA", temperature_range=...)')


def convert_official_state_dict(
        sd: Mapping[str, torch.Tensor],
        temperature_range: Tuple[float, float] = (0.7, 1 / 0.7)
) -> Tuple['OrderedDict[str, torch.Tensor]', Dict[str, List[str]]]:
    """Map reference keys (``module.`` prefix optional) to ``KCLAResNet`` keys.

    Returns:
        ``(state_dict, report)`` where ``report`` has ``dropped`` (keys left
        out on purpose) and ``unmapped`` (keys of unknown form).

    Raises:
        NotAnOfficialCheckpoint: the keys do not follow the reference layout.
    """
    sd = _strip_module(sd)
    if not is_official_layout(sd):
        raise NotAnOfficialCheckpoint(
            'no keys of the form layer{s}.attention.{i}.* and layer{s}.layers.{i}.*: '
            'this is not a checkpoint of the KCLA reference ImageNet trainer')
    out = OrderedDict()
    report: Dict[str, List[str]] = {'dropped': [], 'unmapped': []}
    for k, v in sd.items():
        if k.startswith('fc.'):
            report['dropped'].append(k)
        elif _STEM.match(k):
            out[k] = v
        elif _BLOCK.match(k):
            s, i, rest = _BLOCK.match(k).groups()
            out[f'layer{s}.{i}.{rest}'] = v
        elif _ATTN.match(k):
            s, i, name, rest = _ATTN.match(k).groups()
            rest = rest or ''
            if name == 'norm_d':
                _check_temperatures(k, v, temperature_range)
                report['dropped'].append(k)
            elif name not in _ATTN_NAMES:
                report['unmapped'].append(k)
            elif s == '1' and i == '0' and name in ('adjust_channel', 'u_Wk', 'u_bn'):
                report['dropped'].append(k)  # the first block never receives a state
            elif name == 'adjust_channel' and i != '0':
                report['dropped'].append(k)  # same-width re-normalisation: never applied
            else:
                out[f'layer{s}_attn.{i}.{_ATTN_NAMES[name]}{rest}'] = v
        else:
            report['unmapped'].append(k)
    return out, report


def backbone_width(backbone_sd: Mapping[str, torch.Tensor]) -> int:
    """Channels of a converted backbone's last stage: the last conv of its last block."""
    convs = {}  # (stage, block, conv) -> weight
    for k, v in backbone_sd.items():
        m = _CONV.match(k)
        if m:
            convs[tuple(int(n) for n in m.groups())] = v
    if not convs:
        raise ValueError('no layer{s}.{i}.conv{j}.weight keys: not a converted KCLAResNet')
    return convs[max(convs)].shape[0]


def to_classifier_state_dict(
        backbone_sd: Mapping[str, torch.Tensor],
        fc_weight: torch.Tensor,
        fc_bias: torch.Tensor,
        num_classes: Optional[int] = None) -> 'OrderedDict[str, torch.Tensor]':
    """The state dict of mmpretrain's ``ImageClassifier`` from a converted backbone and ``fc``.

    Args:
        backbone_sd: ``KCLAResNet`` keys (the first result of
            :func:`convert_official_state_dict`); they become ``backbone.<key>``.
        fc_weight, fc_bias: the reference's ``fc.weight`` ``[num_classes, width]``
            and ``fc.bias`` ``[num_classes]``; they become ``head.fc.*``.
        num_classes: the number of classes asked for; ``None`` takes fc's.

    Raises:
        ValueError: fc's shapes do not fit the backbone's width or ``num_classes``.
    """
    width = backbone_width(backbone_sd)
    if fc_weight.dim() != 2 or fc_weight.shape[1] != width:
        raise ValueError(f'fc.weight has shape {list(fc_weight.shape)}; the backbone\'s last '
                         f'stage has {width} channels, so it must be [num_classes, {width}]')
    if num_classes is not None and fc_weight.shape[0] != num_classes:
        raise ValueError(f'fc.weight has shape {list(fc_weight.shape)}: {fc_weight.shape[0]} '
                         f'classes, not the {num_classes} asked for')
    if tuple(fc_bias.shape) != (fc_weight.shape[0], ):
        raise ValueError(f'fc.bias has shape {list(fc_bias.shape)}; fc.weight has '
                         f'{fc_weight.shape[0]} classes, so it must be [{fc_weight.shape[0]}]')
    out = OrderedDict(('backbone.' + k, v) for k, v in backbone_sd.items())
    out[FC_KEYS['fc.weight']] = fc_weight
    out[FC_KEYS['fc.bias']] = fc_bias
    return out
