"""Command-line plumbing shared by the analysis tools: config, checkpoint, images.

The analyses themselves live in :mod:`kcla_mm.analysis`; this module only
turns command-line arguments into a backbone (built from any kcla_mm config,
detection or segmentation), a checked checkpoint and batches of images.
Nothing here downloads anything: ``Pretrained`` ``init_cfg`` entries of the
config are dropped before the model is built.
"""
import argparse
import copy
import logging
import os
import os.path as osp
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import cv2
import numpy as np
import torch
from mmengine.config import Config, DictAction
from mmengine.logging import MMLogger
from mmengine.registry import init_default_scope
from torch import nn

import kcla_mm  # noqa: F401  (registers the components)
import kcla_mm.host_fixes  # noqa: F401  (safe loading, atomic saving, CPU distributed)
from kcla_mm.analysis import compare_state_dicts, sub_state_dict, unwrap_state_dict
from kcla_mm.utils.checkpoint import TRUST_ENV, UnsafeCheckpointError, safe_load
from kcla_mm.utils.official_checkpoint import convert_official_state_dict, is_official_layout

IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp')
#: ImageNet statistics in RGB order, used when the config has no data_preprocessor.
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def add_model_args(parser: argparse.ArgumentParser, checkpoint: bool = True) -> None:
    """``CONFIG [CHECKPOINT]``, ``--cfg-options``, ``--trust-checkpoint``, ``--device``."""
    parser.add_argument('config', help='a kcla_mm (mmdet or mmseg) config file')
    if checkpoint:
        parser.add_argument(
            'checkpoint', nargs='?', default=None,
            help='checkpoint of that config (a full-model checkpoint of tools/train.py, a '
            'backbone state dict or a KCLA reference ImageNet checkpoint); without it the '
            'model is analysed at its initialisation')
        parser.add_argument(
            '--trust-checkpoint', action='store_true',
            help=f'load a checkpoint that needs types outside the safe allow-list (sets '
            f'{TRUST_ENV}=1; only for files you trust)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                        help='override config settings, e.g. model.backbone.head_dim=16')
    parser.add_argument('--device', default='cpu', help='torch device (default: cpu)')
    parser.add_argument('--out-dir', default='work_dirs/analysis',
                        help='folder for the outputs (created if needed)')


def add_image_args(parser: argparse.ArgumentParser) -> None:
    """``--images DIR | --synthetic N``, ``--size``, ``--max-images``, ``--seed``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument('--images', metavar='DIR',
                       help='folder of .jpg/.png images (searched recursively, sorted by name)')
    group.add_argument('--synthetic', type=int, default=8, metavar='N',
                       help='without --images: N random-shape images generated in memory '
                       '(kcla_mm.datasets.synthetic_coco); default 8')
    parser.add_argument('--size', type=int, nargs='+', default=[224], metavar='PX',
                        help='resize every image to H W (one number: square); default 224')
    parser.add_argument('--max-images', type=int, default=100,
                        help='use at most this many images of --images (default 100)')
    parser.add_argument('--seed', type=int, default=0, help='seed of the synthetic images')


def load_config(path: str, cfg_options: Optional[dict] = None) -> Config:
    """The config with overrides applied, its default scope initialised."""
    if not osp.isfile(path):
        raise SystemExit(f'config file not found: {path}')
    cfg = Config.fromfile(path)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if 'model' not in cfg:
        raise SystemExit(f'{path} has no "model" entry')
    init_default_scope(cfg.get('default_scope', 'mmdet'))
    return cfg


def drop_pretrained(cfg: Any) -> Any:
    """A copy of a model config without ``Pretrained`` init entries.

    So that building and initialising the model downloads nothing.
    """
    if isinstance(cfg, dict):
        out = {}
        for k, v in cfg.items():
            if k == 'init_cfg' and _is_pretrained(v):
                out[k] = None
            elif k == 'pretrained' and isinstance(v, str):
                out[k] = None
            else:
                out[k] = drop_pretrained(v)
        return type(cfg)(out)
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(drop_pretrained(v) for v in cfg)
    return cfg


def _is_pretrained(init_cfg: Any) -> bool:
    items = init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]
    return any(isinstance(c, dict) and c.get('type') == 'Pretrained' for c in items)


def backbone_config(cfg: Config, layer_attn: Optional[dict] = None) -> dict:
    """The backbone's config (``model.backbone``, or ``model`` for a backbone-only config).

    Args:
        cfg: the loaded config.
        layer_attn: replace the layer-attention method (the backbone becomes a
            ``KCLAResNet`` with the host arguments of the config's backbone).
    """
    model = cfg.model
    bb = copy.deepcopy(dict(model.backbone if 'backbone' in model else model))
    if layer_attn is not None:
        if bb.get('type') not in ('KCLAResNet', 'ResNet', 'mmdet.ResNet', 'mmseg.ResNet'):
            raise SystemExit(f'cannot swap the layer attention of a {bb.get("type")} backbone: '
                             'only ResNet and KCLAResNet backbones are supported')
        bb['type'] = 'KCLAResNet'
        bb['layer_attn'] = dict(layer_attn)
    return drop_pretrained(bb)


@contextmanager
def quiet_logs() -> Iterator[None]:
    """Silence mmengine's INFO logs (``init_weights`` reports every parameter)."""
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def build_backbone(cfg: Config, layer_attn: Optional[dict] = None,
                   device: str = 'cpu') -> nn.Module:
    """Build and initialise the config's backbone (see :func:`backbone_config`), in eval mode."""
    from mmengine.registry import MODELS
    bb_cfg = backbone_config(cfg, layer_attn)
    try:
        backbone = MODELS.build(bb_cfg)
    except Exception as e:  # the registry wraps the constructor's error
        raise SystemExit(f'cannot build the backbone {bb_cfg.get("type")}: {e}') from e
    with quiet_logs():
        backbone.init_weights()
    return backbone.to(device).eval()


def read_state_dict(path: str, trust: bool = False) -> dict:
    """The tensors of a checkpoint file (safe loading; ``state_dict`` and ``module.`` unwrapped)."""
    if not osp.isfile(path):
        raise SystemExit(f'checkpoint not found: {path}')
    try:
        obj = safe_load(path, map_location='cpu', trust=trust or None)
    except UnsafeCheckpointError as e:
        raise SystemExit(str(e)) from None
    try:
        return unwrap_state_dict(obj)
    except ValueError as e:
        raise SystemExit(f'{path}: {e}') from None


def backbone_state_dict(sd: dict) -> Tuple[dict, str]:
    """The backbone part of a checkpoint's tensors and a word on where it came from."""
    if any(k.startswith('backbone.') for k in sd):
        return sub_state_dict(sd, 'backbone.'), 'the backbone.* entries of a model checkpoint'
    if is_official_layout(sd):
        converted, _ = convert_official_state_dict(sd)
        return dict(converted), 'a KCLA reference checkpoint (converted)'
    return sd, 'a backbone state dict'


def load_backbone_checkpoint(backbone: nn.Module, path: str, config: str = '',
                             strict: bool = True, trust: bool = False) -> str:
    """Load a checkpoint into ``backbone``; refuse one that does not match.

    Args:
        backbone: the built backbone.
        path: checkpoint file.
        config: the config's path, for the error message.
        strict: every key and shape must match. Else load only the ResNet part
            (keys outside ``layer{s}_attn``) where names and shapes match: for a
            backbone with another layer-attention method, whose attention
            modules keep their initialisation.
        trust: allow types outside the safe allow-list.

    Returns:
        A one-line description of what was loaded.

    Raises:
        SystemExit: ``strict`` and the checkpoint's keys or shapes differ from the
            backbone's; the message lists them.
    """
    sd, source = backbone_state_dict(read_state_dict(path, trust))
    model_sd = backbone.state_dict()
    mismatch = compare_state_dicts(model_sd, sd)
    if strict and mismatch:
        raise SystemExit(
            f'checkpoint {path} ({source}) does not match the backbone built from '
            f'{config or "the config"}:\n{mismatch.describe()}')
    if strict:
        backbone.load_state_dict(sd, strict=True)
        return f'loaded {len(sd)} tensors from {path} ({source})'
    matching = {k: v for k, v in sd.items() if '_attn.' not in k and k in model_sd
                and tuple(v.shape) == tuple(model_sd[k].shape)}
    backbone.load_state_dict(matching, strict=False)
    left = len(model_sd) - len(matching)
    return (f'loaded the {len(matching)} matching ResNet tensors from {path} ({source}); '
            f'{left} tensors (the layer attention) keep their initialisation')


def normalisation(cfg: Config) -> Tuple[np.ndarray, np.ndarray, bool]:
    """``(mean, std, bgr_to_rgb)`` of the config's data_preprocessor, else ImageNet's."""
    pre = cfg.model.get('data_preprocessor') or cfg.get('data_preprocessor') or {}
    if pre.get('mean') is not None and pre.get('std') is not None:
        return (np.asarray(pre['mean'], np.float32), np.asarray(pre['std'], np.float32),
                bool(pre.get('bgr_to_rgb', False)))
    return np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32), True


def image_size(size: Sequence[int]) -> Tuple[int, int]:
    """``(H, W)`` from ``--size H [W]``."""
    if len(size) not in (1, 2) or min(size) < 1:
        raise SystemExit(f'--size takes one or two positive numbers, got {list(size)}')
    return (size[0], size[-1])


def image_files(folder: str, max_images: int) -> List[str]:
    """Sorted image paths under ``folder`` (recursively), at most ``max_images``."""
    if not osp.isdir(folder):
        raise SystemExit(f'--images: {folder} is not a folder')
    files = sorted(osp.join(root, f) for root, _, names in os.walk(folder) for f in names
                   if f.lower().endswith(IMAGE_SUFFIXES))
    if not files:
        raise SystemExit(f'--images: no {"/".join(IMAGE_SUFFIXES)} files under {folder}')
    return files[:max_images]


def _synthetic_bgr(n: int, size: int, seed: int) -> Iterator[np.ndarray]:
    from kcla_mm.datasets.synthetic_coco import synthetic_image
    rng = np.random.default_rng(seed)
    for _ in range(n):
        rgb, _ = synthetic_image(rng, size, min_object=max(4, size // 8),
                                 max_object=max(8, size // 3))
        yield rgb[:, :, ::-1]


def image_source(args: argparse.Namespace, cfg: Config
                 ) -> Tuple[Callable[[], Iterator[torch.Tensor]], int, str]:
    """Batches of one normalised image ``[1, 3, H, W]``, re-iterable.

    Returns:
        ``(make_iterator, number of images, description)``.
    """
    h, w = image_size(args.size)
    mean, std, to_rgb = normalisation(cfg)
    if args.images:
        files = image_files(args.images, args.max_images)

        def arrays() -> Iterator[np.ndarray]:
            for f in files:
                img = cv2.imread(f, cv2.IMREAD_COLOR)
                if img is None:
                    raise SystemExit(f'cannot read image {f}')
                yield img
        count, what = len(files), f'{len(files)} images from {args.images}'
    else:
        if args.synthetic < 1:
            raise SystemExit('--synthetic needs at least one image')

        def arrays() -> Iterator[np.ndarray]:
            return _synthetic_bgr(args.synthetic, max(h, w), args.seed)
        count, what = args.synthetic, f'{args.synthetic} synthetic images (seed {args.seed})'

    def batches() -> Iterator[torch.Tensor]:
        for bgr in arrays():
            img = cv2.resize(bgr, (w, h), interpolation=cv2.INTER_LINEAR)
            if to_rgb:
                img = img[:, :, ::-1]
            img = (img.astype(np.float32) - mean) / std
            yield torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))[None].to(
                args.device)

    return batches, count, f'{what}, resized to {h}x{w}'


def make_out_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
