"""Registration of kcla_mm's components in the mmdet and mmseg scopes.

The only module that knows about host registries. ``import kcla_mm`` (or
``custom_imports=dict(imports=['kcla_mm'])``) calls :func:`register_all`, which
registers every component under its bare type name in each host that is
installed, so configs with ``default_scope='mmdet'`` and configs with
``default_scope='mmseg'`` both find them. A host that is not installed is
skipped: segmentation needs nothing from mmdet, detection nothing from mmseg.

Each entry is ``(registry name, 'module:attribute', registered name)``.
"""
import importlib
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

HOSTS: Dict[str, List[Entry]] = {'mmdet': DET_COMPONENTS, 'mmseg': SEG_COMPONENTS}

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
        try:
            registry_module = importlib.import_module(f'{host}.registry')
        except ImportError:
            continue
        names = []
        for registry_name, path, name in entries:
            getattr(registry_module, registry_name).register_module(
                name=name, module=_load(path), force=True)
            names.append(name)
        _registered[host] = names
    return dict(_registered)
