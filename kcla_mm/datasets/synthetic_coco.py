"""A synthetic COCO-format detection/instance-segmentation dataset.

For demos and end-to-end tests without COCO: every image shows one to a few
solid-coloured shapes (circle, square, triangle; 20-60 px by default) on a
plain greyish background with mild noise, easy enough for a small detector to
learn in a few CPU minutes: by default each class has its own hue (red
circles, blue squares, green triangles, each colour jittered), so that the
classifier can learn from colour before it learns shape; with
``class_colours=False`` every shape has a random colour (a harder task). The
files are laid out like COCO2017, so mmdet's ``CocoDataset`` and
``CocoMetric`` and pycocotools read them unchanged::

    OUT/train2017/000000000001.jpg ...
    OUT/val2017/000001000001.jpg ...
    OUT/annotations/instances_train2017.json
    OUT/annotations/instances_val2017.json

Each annotation carries an ``[x, y, w, h]`` box, a polygon ``segmentation``
(the exact polygon that was filled into the image), its polygon ``area`` and
``iscrowd=0``. Shapes of one image do not overlap, so every mask is fully
visible. Images are seeded per split and index: the same arguments give the
same files, and changing ``num_val`` does not change the training images.

Usage::

    python -m kcla_mm.datasets.synthetic_coco --out data/synthetic_coco \
        --num-train 400 --num-val 50 --size 128 --seed 0
"""
import argparse
import json
import os
import os.path as osp
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np

#: category names; category ids are 1, 2, 3 in this order.
CLASSES: Tuple[str, ...] = ('circle', 'square', 'triangle')
#: RGB colours, one per class: the shapes' base colours and the visualisation palette.
PALETTE: Tuple[Tuple[int, int, int], ...] = ((220, 20, 60), (0, 128, 255), (0, 200, 80))
#: ``metainfo`` for mmdet's ``CocoDataset``.
METAINFO: Dict[str, tuple] = dict(classes=CLASSES, palette=PALETTE)

SPLITS: Tuple[str, ...] = ('train2017', 'val2017')
#: image and annotation ids of split ``i`` start at ``i * ID_STRIDE + 1``.
ID_STRIDE = 1_000_000
_SUBPIXEL_SHIFT = 4  # cv2.fillPoly works on fixed-point vertices: 1/16 px


def shape_polygon(kind: str, cx: float, cy: float, size: float, angle: float) -> np.ndarray:
    """Vertices of a shape.

    Args:
        kind: one of :data:`CLASSES`.
        cx: centre x in pixels.
        cy: centre y in pixels.
        size: diameter of the circle, side of the square, side of the
            (equilateral) triangle.
        angle: rotation in radians (ignored for circles).

    Returns:
        ``[P, 2]`` float64 ``(x, y)`` vertices, counter-clockwise in image
        coordinates. A circle is a 32-gon.
    """
    if kind == 'circle':
        theta = np.linspace(0, 2 * np.pi, 32, endpoint=False)
        radius = np.full_like(theta, size / 2)
    elif kind == 'square':
        theta = np.pi / 4 + np.arange(4) * np.pi / 2 + angle
        radius = np.full_like(theta, size / np.sqrt(2))
    elif kind == 'triangle':
        theta = -np.pi / 2 + np.arange(3) * 2 * np.pi / 3 + angle
        radius = np.full_like(theta, size / np.sqrt(3))
    else:
        raise ValueError(f'kind={kind!r}; choose one of {CLASSES}')
    return np.stack([cx + radius * np.cos(theta), cy + radius * np.sin(theta)], axis=1)


def polygon_area(points: np.ndarray) -> float:
    """Area of a simple polygon (shoelace formula)."""
    x, y = points[:, 0], points[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def _overlaps(box: np.ndarray, boxes: List[np.ndarray], gap: float) -> bool:
    for other in boxes:
        if (box[0] < other[2] + gap and other[0] < box[2] + gap
                and box[1] < other[3] + gap and other[1] < box[3] + gap):
            return True
    return False


#: per-channel jitter of the class colours
COLOUR_JITTER = 30


def _colour_far_from(rng: np.random.Generator, reference: np.ndarray, min_distance: float,
                     base: Optional[Sequence[int]] = None) -> np.ndarray:
    """An RGB colour at least ``min_distance`` (L2) from ``reference``.

    Random, or ``base`` jittered by up to :data:`COLOUR_JITTER` per channel.
    """
    for _ in range(100):
        if base is None:
            colour = rng.uniform(0, 255, 3)
        else:
            colour = np.clip(np.asarray(base) + rng.uniform(-COLOUR_JITTER, COLOUR_JITTER, 3),
                             0, 255)
        if np.linalg.norm(colour - reference) >= min_distance:
            return colour
    return 255 - reference


def synthetic_image(rng: np.random.Generator,
                    size: int,
                    min_object: int = 20,
                    max_object: int = 60,
                    max_objects: int = 3,
                    noise: float = 8.0,
                    class_colours: bool = True) -> Tuple[np.ndarray, List[dict]]:
    """One image and its objects.

    Args:
        rng: random generator (the only source of randomness).
        size: image height and width.
        min_object: smallest shape size (see :func:`shape_polygon`).
        max_object: largest shape size.
        max_objects: at most this many shapes (at least one); fewer when they
            do not fit without overlapping.
        noise: standard deviation of the Gaussian pixel noise.
        class_colours: colour each shape near its class colour in
            :data:`PALETTE`; otherwise in a random colour.

    Returns:
        ``([size, size, 3] uint8 RGB image, objects)``; each object is
        ``dict(label=class index, polygon=[P, 2] vertices, box=[x1, y1, x2, y2])``.
    """
    # Low saturation, so that every class colour stands out.
    background = rng.uniform(90, 170) + rng.uniform(-15, 15, 3)
    # A faint linear illumination gradient so the background is not constant.
    ramp = np.linspace(-1, 1, size, dtype=np.float32)
    direction = rng.uniform(-12, 12, 2)
    img = (background[None, None, :] + (direction[0] * ramp[None, :, None]
                                        + direction[1] * ramp[:, None, None]))
    objects: List[dict] = []
    boxes: List[np.ndarray] = []
    wanted = int(rng.integers(1, max_objects + 1))
    for _ in range(wanted * 20):  # rejection sampling of non-overlapping shapes
        if len(objects) == wanted:
            break
        label = int(rng.integers(len(CLASSES)))
        side = rng.uniform(min_object, max_object)
        half = side / 2 if CLASSES[label] == 'circle' else side / np.sqrt(2)
        if 2 * half + 2 > size:
            continue
        cx, cy = rng.uniform(half + 1, size - half - 1, 2)
        polygon = shape_polygon(CLASSES[label], cx, cy, side, rng.uniform(0, 2 * np.pi))
        box = np.concatenate([polygon.min(0), polygon.max(0)])
        if _overlaps(box, boxes, gap=2):
            continue
        colour = _colour_far_from(rng, background, min_distance=100,
                                  base=PALETTE[label] if class_colours else None)
        fixed = np.round(polygon * 2**_SUBPIXEL_SHIFT).astype(np.int32)
        cv2.fillPoly(img, [fixed], colour.tolist(), lineType=cv2.LINE_8, shift=_SUBPIXEL_SHIFT)
        objects.append(dict(label=label, polygon=polygon, box=box))
        boxes.append(box)
    img = img + rng.normal(0, noise, img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8), objects


def _annotation(obj: dict, ann_id: int, image_id: int) -> dict:
    x1, y1, x2, y2 = (round(float(v), 2) for v in obj['box'])
    return dict(
        id=ann_id,
        image_id=image_id,
        category_id=obj['label'] + 1,
        bbox=[x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)],
        area=round(polygon_area(obj['polygon']), 2),
        segmentation=[[round(float(v), 2) for v in obj['polygon'].reshape(-1)]],
        iscrowd=0)


def generate(out: str,
             num_train: int = 400,
             num_val: int = 50,
             size: int = 128,
             seed: int = 0,
             min_object: int = 20,
             max_object: int = 60,
             max_objects: int = 3,
             noise: float = 8.0,
             class_colours: bool = True,
             jpeg_quality: int = 95) -> Dict[str, str]:
    """Write the dataset.

    Args:
        out: directory to write into (created).
        num_train: images in ``train2017``.
        num_val: images in ``val2017``.
        size: image height and width in pixels.
        seed: random seed; the same arguments give the same files.
        min_object: smallest shape size in pixels.
        max_object: largest shape size in pixels.
        max_objects: at most this many shapes per image.
        noise: standard deviation of the pixel noise.
        class_colours: colour shapes by class (see :func:`synthetic_image`).
        jpeg_quality: JPEG quality (OpenCV scale, 0-100).

    Returns:
        ``{split: annotation file path}``.

    Raises:
        ValueError: counts or sizes that cannot give a valid dataset.
    """
    if num_train < 1 or num_val < 0:
        raise ValueError(f'need num_train >= 1 and num_val >= 0, got '
                         f'num_train={num_train}, num_val={num_val}')
    if not 4 <= min_object <= max_object:
        raise ValueError(f'need 4 <= min_object <= max_object, got '
                         f'min_object={min_object}, max_object={max_object}')
    if size < max_object * np.sqrt(2) + 2:
        raise ValueError(f'size={size} cannot hold a rotated square of max_object={max_object} '
                         f'px; use size >= {int(np.ceil(max_object * np.sqrt(2) + 2))}')
    if max_objects < 1:
        raise ValueError(f'max_objects must be >= 1, got max_objects={max_objects}')
    os.makedirs(osp.join(out, 'annotations'), exist_ok=True)
    categories = [dict(id=i + 1, name=name, supercategory='shape')
                  for i, name in enumerate(CLASSES)]
    written = {}
    for split_index, (split, num) in enumerate(zip(SPLITS, (num_train, num_val))):
        os.makedirs(osp.join(out, split), exist_ok=True)
        images, annotations = [], []
        for index in range(num):
            rng = np.random.default_rng([seed, split_index, index])
            img, objects = synthetic_image(rng, size, min_object, max_object, max_objects, noise,
                                           class_colours)
            image_id = split_index * ID_STRIDE + index + 1
            file_name = f'{image_id:012d}.jpg'
            path = osp.join(out, split, file_name)
            if not cv2.imwrite(path, cv2.cvtColor(img, cv2.COLOR_RGB2BGR),
                               [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality]):
                raise OSError(f'could not write {path}')
            images.append(dict(id=image_id, file_name=file_name, width=size, height=size))
            for obj in objects:
                ann_id = split_index * ID_STRIDE + len(annotations) + 1
                annotations.append(_annotation(obj, ann_id, image_id))
        ann_file = osp.join(out, 'annotations', f'instances_{split}.json')
        with open(ann_file, 'w') as f:
            json.dump(dict(info=dict(description='kcla_mm synthetic shapes', version='1.0'),
                           licenses=[], images=images, annotations=annotations,
                           categories=categories), f)
        written[split] = ann_file
    return written


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', required=True, help='output directory')
    parser.add_argument('--num-train', type=int, default=400, help='training images')
    parser.add_argument('--num-val', type=int, default=50, help='validation images')
    parser.add_argument('--size', type=int, default=128, help='image height and width')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--min-object', type=int, default=20, help='smallest shape (px)')
    parser.add_argument('--max-object', type=int, default=60, help='largest shape (px)')
    parser.add_argument('--max-objects', type=int, default=3, help='shapes per image, at most')
    parser.add_argument('--noise', type=float, default=8.0, help='pixel noise std')
    parser.add_argument('--random-colours', action='store_true',
                        help='random shape colours instead of one hue per class (harder)')
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    written = generate(args.out, num_train=args.num_train, num_val=args.num_val,
                       size=args.size, seed=args.seed, min_object=args.min_object,
                       max_object=args.max_object, max_objects=args.max_objects,
                       noise=args.noise, class_colours=not args.random_colours)
    print(f'wrote synthetic COCO data to {args.out}: {args.num_train} train, {args.num_val} val '
          f'images ({", ".join(written.values())})')


if __name__ == '__main__':
    main()
