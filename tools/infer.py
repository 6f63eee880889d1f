"""Run a trained kcla_mm model on a folder of images: overlays and machine-readable predictions.

Segmentation configs (mmseg, e.g. a KCLA-ResNet-UNet) run through mmseg's
``MMSegInferencer``, detection configs (mmdet, e.g. a KCLA Faster R-CNN)
through mmdet's ``DetInferencer``; both apply the config's test pipeline, so
images of any size are resized as in testing and predictions come back at
the original size. Written to ``--out-dir``::

    overlays/<image stem>.png   the image with its prediction drawn over it
    masks/<image stem>.png      segmentation: one uint8 class index per pixel
                                (binary configs: 0 background, 1 foreground)
    predictions.json            one record per image: segmentation, the mask's
                                file and each class's share of the pixels;
                                detection, the boxes ([x1, y1, x2, y2] in
                                pixels of the original image), class names
                                and scores at or above --score-thr

Usage (from the repository root)::

    python tools/infer.py CONFIG CHECKPOINT IMAGES [--out-dir DIR] [--score-thr 0.3]

``IMAGES`` is an image file or a folder (searched recursively for .jpg, .jpeg,
.png, .bmp). The demos' checkpoints and images::

    python tools/infer.py configs/unet/unet_kcla-r18-tiny_1xb8-300i_synthetic-kvasir-128x128.py \\
        work_dirs/demo_seg/train/iter_300.pth work_dirs/demo_seg/data/images/val \\
        --out-dir work_dirs/demo_seg/infer
    python tools/infer.py configs/kcla/demo/faster-rcnn_kcla-r18_fpn_synthetic.py \\
        work_dirs/demo_det/train/iter_200.pth data/synthetic_coco/val2017 \\
        --out-dir work_dirs/demo_det/infer
"""
import argparse
import copy
import glob
import json
import os
import os.path as osp
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence

import cv2
import numpy as np

IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Run a kcla_mm segmentor or detector on a folder of images')
    parser.add_argument('config', help='the model\'s config (mmseg or mmdet)')
    parser.add_argument('checkpoint', help='its checkpoint (tools/train.py)')
    parser.add_argument('images', help='an image file or a folder of images')
    parser.add_argument('--out-dir', default='work_dirs/infer',
                        help='where overlays, masks and predictions.json go '
                        '(default work_dirs/infer)')
    parser.add_argument('--device', default='cpu', help='torch device (default cpu)')
    parser.add_argument('--batch-size', type=int, default=1, help='images per forward')
    parser.add_argument('--score-thr', type=float, default=0.3,
                        help='detection: smallest score kept in predictions.json and drawn '
                        '(default 0.3)')
    parser.add_argument('--no-overlays', action='store_true', help='write no overlays')
    return parser.parse_args(argv)


def image_files(path: str) -> List[str]:
    """``path`` itself if it is a file, else the images under it, sorted."""
    if osp.isfile(path):
        return [path]
    if not osp.isdir(path):
        raise SystemExit(f'{path}: no such file or folder')
    files = sorted(f for f in glob.glob(osp.join(path, '**', '*'), recursive=True)
                   if f.lower().endswith(IMAGE_SUFFIXES))
    if not files:
        raise SystemExit(f'no images ({", ".join(IMAGE_SUFFIXES)}) under {path}')
    return files


def output_names(files: Sequence[str], root: str) -> List[str]:
    """One output stem per image: its path under ``root`` without suffix, '/' as '__'.

    Two images of one name in different sub-folders get different outputs.
    """
    base = root if osp.isdir(root) else osp.dirname(root)
    return [osp.splitext(osp.relpath(f, base))[0].replace(os.sep, '__') for f in files]


def task_of(cfg) -> str:
    """``'seg'`` for mmseg configs, ``'det'`` for mmdet configs."""
    scope = cfg.get('default_scope')
    if scope in ('mmseg', 'mmdet'):
        return scope[2:]
    return 'seg' if 'decode_head' in cfg.model else 'det'


def inference_pipeline(cfg, task: str) -> List[dict]:
    """The config's test pipeline for unlabelled images.

    Annotation loaders go; an image loader of another name that is mmcv's
    ``LoadImageFromFile`` underneath (e.g. kcla_mm's
    ``LoadImageFromFileNamingErrors``) becomes ``LoadImageFromFile``, the
    name the hosts' inferencers look for.
    """
    from mmcv.transforms import LoadAnnotations, LoadImageFromFile
    if task == 'seg':
        from mmseg.registry import TRANSFORMS
    else:
        from mmdet.registry import TRANSFORMS
    out = []
    for t in cfg.test_dataloader.dataset.pipeline:
        cls = TRANSFORMS.get(t['type']) if isinstance(t['type'], str) else t['type']
        if isinstance(cls, type) and issubclass(cls, LoadAnnotations):
            continue
        if isinstance(cls, type) and issubclass(cls, LoadImageFromFile):
            t = dict(t, type='LoadImageFromFile')
        out.append(dict(t))
    return out


def config_metainfo(cfg, task: str) -> Dict[str, Any]:
    """Class names and palette of the config's test dataset (its class's, then the config's)."""
    ds = cfg.test_dataloader.dataset
    if task == 'seg':
        from mmseg.registry import DATASETS
    else:
        from mmdet.registry import DATASETS
    meta = {}
    cls = DATASETS.get(ds.get('type')) if isinstance(ds.get('type'), str) else None
    if cls is not None:
        meta.update(getattr(cls, 'METAINFO', {}))
    meta.update(ds.get('metainfo') or {})
    return {k: v for k, v in meta.items() if k in ('classes', 'palette')}


def class_metainfo(cfg, checkpoint: str, task: str) -> Dict[str, Any]:
    """Class names and palette: the checkpoint's (tools/train.py stores the dataset's),
    else the config's dataset's."""
    from kcla_mm.utils.checkpoint import safe_load
    meta = (safe_load(checkpoint, map_location='cpu').get('meta') or {}).get('dataset_meta') or {}
    meta = {k: v for k, v in meta.items() if k in ('classes', 'palette')}
    return meta if meta.get('classes') else config_metainfo(cfg, task)


def build_inferencer(cfg, checkpoint: str, task: str, device: str):
    """The host's inferencer, its model and visualizer given :func:`class_metainfo`."""
    cfg = copy.deepcopy(cfg)
    cfg.test_dataloader.dataset.pipeline = inference_pipeline(cfg, task)
    meta = class_metainfo(cfg, checkpoint, task)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # "no class names in the checkpoint": set below
        if task == 'seg':
            # (without classes, MMSegInferencer draws with Cityscapes' names)
            from mmseg.apis import MMSegInferencer
            inferencer = MMSegInferencer(model=cfg, weights=checkpoint, device=device,
                                         classes=meta.get('classes'),
                                         palette=meta.get('palette'))
        else:
            from mmdet.apis import DetInferencer
            inferencer = DetInferencer(model=cfg, weights=checkpoint, device=device)
    if meta.get('classes'):
        inferencer.model.dataset_meta = dict(inferencer.model.dataset_meta or {}, **meta)
        inferencer.visualizer.dataset_meta = dict(inferencer.visualizer.dataset_meta or {},
                                                  **meta)
    inferencer.show_progress = False  # one bar over all images, below
    return inferencer


def label_map(pred) -> np.ndarray:
    """``[H, W]`` int64 class indices of a segmentation sample (binary heads give floats)."""
    return pred.pred_sem_seg.data[0].cpu().numpy().astype(np.int64)


def seg_record(pred, classes: Sequence[str], mask_file: str) -> Dict[str, Any]:
    mask = label_map(pred)  # [H, W]
    counts = np.bincount(mask.ravel(), minlength=len(classes))
    share = {str(classes[i]) if i < len(classes) else str(i): round(float(c) / mask.size, 6)
             for i, c in enumerate(counts)}
    return dict(mask=mask_file, height=int(mask.shape[0]), width=int(mask.shape[1]),
                pixel_share=share)


def det_record(pred, classes: Sequence[str], score_thr: float) -> Dict[str, Any]:
    inst = pred.pred_instances
    keep = inst.scores >= score_thr
    boxes = inst.bboxes[keep].cpu().numpy()
    labels = inst.labels[keep].cpu().numpy()
    scores = inst.scores[keep].cpu().numpy()
    h, w = pred.metainfo['ori_shape'][:2]
    return dict(height=int(h), width=int(w), detections=[
        dict(label=int(lab), **{'class': str(classes[lab]) if lab < len(classes) else str(lab)},
             score=round(float(s), 5), bbox=[round(float(v), 2) for v in box])
        for box, lab, s in zip(boxes, labels, scores)
    ])


def write_mask(pred, path: str) -> None:
    mask = label_map(pred)
    if mask.max(initial=0) > 255:
        raise SystemExit(f'{mask.max()} classes do not fit a uint8 PNG')
    if not cv2.imwrite(path, mask.astype(np.uint8)):
        raise SystemExit(f'could not write {path}')


def draw(inferencer, task: str, image_file: str, pred, out_file: str, score_thr: float) -> None:
    img = cv2.imread(image_file, cv2.IMREAD_COLOR)[:, :, ::-1]  # RGB for the visualizer
    kwargs = dict(draw_gt=False, draw_pred=True, show=False, out_file=out_file)
    if task == 'det':
        kwargs['pred_score_thr'] = score_thr
    inferencer.visualizer.add_datasample(osp.basename(image_file), img, pred, **kwargs)


def run(cfg, checkpoint: str, images: str, out_dir: str, device: str = 'cpu',
        batch_size: int = 1, score_thr: float = 0.3, overlays: bool = True) -> Dict[str, Any]:
    """Predict every image of ``images``; returns what ``predictions.json`` holds."""
    from rich.progress import track
    task = task_of(cfg)
    files = image_files(images)
    stems = output_names(files, images)
    inferencer = build_inferencer(cfg, checkpoint, task, device)
    classes = list(inferencer.model.dataset_meta.get('classes') or [])
    for sub in ['overlays'] * overlays + ['masks'] * (task == 'seg'):
        os.makedirs(osp.join(out_dir, sub), exist_ok=True)
    records = []
    batches = [range(i, min(i + batch_size, len(files))) for i in range(0, len(files), batch_size)]
    for batch in track(batches, description=f'{len(files)} images', transient=False):
        chunk = [files[i] for i in batch]
        preds = inferencer(chunk, return_datasamples=True, batch_size=batch_size)
        # DetInferencer: {'predictions': [...]}; MMSegInferencer: a sample or a list
        preds = preds['predictions'] if isinstance(preds, dict) else preds
        preds = preds if isinstance(preds, list) else [preds]
        for i, pred in zip(batch, preds):
            record = dict(image=files[i])
            if task == 'seg':
                mask_file = osp.join('masks', stems[i] + '.png')
                write_mask(pred, osp.join(out_dir, mask_file))
                record.update(seg_record(pred, classes, mask_file))
            else:
                record.update(det_record(pred, classes, score_thr))
            if overlays:
                record['overlay'] = osp.join('overlays', stems[i] + '.png')
                draw(inferencer, task, files[i], pred, osp.join(out_dir, record['overlay']),
                     score_thr)
            records.append(record)
    result = dict(task='segmentation' if task == 'seg' else 'detection', config=cfg.filename,
                  checkpoint=checkpoint, classes=classes, images=records)
    if task == 'det':
        result['score_thr'] = score_thr
    with open(osp.join(out_dir, 'predictions.json'), 'w') as f:
        json.dump(result, f, indent=1)
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    import kcla_mm  # noqa: F401  (registers kcla_mm's modules, installs the safe loader)
    if not osp.isfile(args.checkpoint):
        raise SystemExit(f'{args.checkpoint}: no such checkpoint')
    cfg = Config.fromfile(args.config)
    init_default_scope(cfg.get('default_scope', 'mmdet'))
    os.makedirs(args.out_dir, exist_ok=True)
    result = run(cfg, args.checkpoint, args.images, args.out_dir, args.device, args.batch_size,
                 args.score_thr, not args.no_overlays)
    what = 'masks/, ' if result['task'] == 'segmentation' else ''
    print(f'{len(result["images"])} images -> {args.out_dir}: {what}'
          f'{"overlays/, " * (not args.no_overlays)}predictions.json')


if __name__ == '__main__':
    sys.exit(main())
