"""Registration of kcla_mm's components in the mmdet, mmseg and mmpretrain scopes.

The only module that knows about host registries. ``import kcla_mm`` (or
``custom_imports=dict(imports=['kcla_mm'])``) calls :func:`register_all`, which
registers every component under its bare type name in each host that is
installed, so configs with ``default_scope`` ``'mmdet'``, ``'mmseg'`` or
``'mmpretrain'`` all find them. A host that is not installed is skipped:
segmentation needs nothing from mmdet, detection nothing from mmseg, neither
anything from mmpretrain. A host that is installed but fails to import (such as
mmpretrain beside a torchvision built for another torch) is skipped with a
warning that names the error.

Each entry is ``(registry name, 'module:attribute', registered name)``.
"""
import importlib
import importlib.util
import warnings
from typing import Dict, List, Tuple

Entry = Tuple[str, str, str]

#: mmdet scope (``mmdet.registry``).
DET_COMPONENTS: List[Entry] = [
    ('MODELS', 'kcla_mm.models.backbones.mmdet_kcla_resnet:KCLAResNet', 'KCLAResNet'),
    ('TRANSFORMS', 'kcla_mm.datasets.transforms:LoadImageFromFileNamingErrors',
     'LoadImageFromFileNamingErrors'),
    ('TRANSFORMS', 'kcla_mm.datasets.transforms:DetLoadAnnotationsNamingErrors',
     'LoadAnnotationsNamingErrors'),
]

#: mmseg scope (``mmseg.registry``).
SEG_COMPONENTS: List[Entry] = [
    ('MODELS', 'kcla_mm.models.backbones.mmseg_kcla_resnet:KCLAResNetSeg', 'KCLAResNet'),
    ('MODELS', 'kcla_mm.models.decode_heads.unet_head:UNetHead', 'UNetHead'),
    ('MODELS', 'kcla_mm.models.losses.binary_dice_loss:BinaryDiceLoss', 'BinaryDiceLoss'),
    ('DATASETS', 'kcla_mm.datasets.medical:ISIC2017Dataset', 'ISIC2017Dataset'),
    ('DATASETS', 'kcla_mm.datasets.medical:ISIC2018Dataset', 'ISIC2018Dataset'),
    ('DATASETS', 'kcla_mm.datasets.medical:KvasirSEGDataset', 'KvasirSEGDataset'),
    ('TRANSFORMS', 'kcla_mm.datasets.transforms:LoadImageFromFileNamingErrors',
     'LoadImageFromFileNamingErrors'),
    ('TRANSFORMS', 'kcla_mm.datasets.transforms:SegLoadAnnotationsNamingErrors',
     'LoadAnnotationsNamingErrors'),
    ('METRICS', 'kcla_mm.evaluation.metrics.foreground_iou_metric:ForegroundIoUMetric',
     'ForegroundIoUMetric'),
]

#: mmpretrain scope (``mmpretrain.registry``): classification pretraining.
CLS_COMPONENTS: List[Entry] = [
    ('MODELS', 'kcla_mm.models.backbones.mmpretrain_kcla_resnet:KCLAResNetCls', 'KCLAResNet'),
    ('MODELS', 'kcla_mm.models.backbones.cifar_kcla_resnet:CifarKCLAResNet', 'CifarKCLAResNet'),
    ('DATASETS', 'kcla_mm.datasets.cifar:OfflineCIFAR100', 'OfflineCIFAR100'),
]

HOSTS: Dict[str, List[Entry]] = {'mmdet': DET_COMPONENTS, 'mmseg': SEG_COMPONENTS,
                                 'mmpretrain': CLS_COMPONENTS}

_registered: Dict[str, List[str]] = {}


def _load(path: str):
    module, attr = path.split(':')
    return getattr(importlib.import_module(module), attr)


def register_all() -> Dict[str, List[str]]:
    """Register every component in every installed host; idempotent.

    Returns:
        ``{host: [registered names]}`` for the hosts that are installed.
    """
    for host, entries in HOSTS.items():
        if host in _registered:
            continue
        if importlib.util.find_spec(host) is None:
            continue  # not installed
        try:
            registry_module = importlib.import_module(f'{host}.registry')
        except Exception as e:  # installed but broken (e.g. its torchvision)
            warnings.warn(f'kcla_mm: {host} is installed but cannot be imported '
                          f'({type(e).__name__}: {e}); its configs cannot use kcla_mm components',
                          stacklevel=2)
            _registered[host] = []
            continue
        names = []
        for registry_name, path, name in entries:
            getattr(registry_module, registry_name).register_module(
                name=name, module=_load(path), force=True)
            names.append(name)
        _registered[host] = names
    return dict(_registered)
