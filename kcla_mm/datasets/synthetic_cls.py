"""Synthetic classification data in the layouts of CIFAR-100 and ImageNet.

For demos and tests without the real data. Every class is a fixed smooth
colour layout: per colour channel, a base level plus three plane waves of low
integer frequency (at most two cycles per image), drawn from a generator seeded
by ``(seed, class)``. An image of the class is that layout shifted by up to a
tenth of the image, with its waves' contrast, its brightness and its colour
balance jittered, one random low-frequency wave added as a distractor, and
pixel noise. The layouts are periodic and vary slowly, so a random crop with
padding keeps the class recognisable; a horizontal flip gives a layout no other
class has, which a small CNN learns along with the original.

``cifar100`` writes the files of the official ``cifar-100-python.tar.gz``::

    OUT/cifar-100-python/train   pickled dict: 'data' uint8 [N, 3072] (per row the
                                 32x32 R plane, then G, then B, each row-major),
                                 'fine_labels', 'coarse_labels', 'filenames',
                                 'batch_label'
    OUT/cifar-100-python/test    the same
    OUT/cifar-100-python/meta    'fine_label_names' (the 100 official names),
                                 'coarse_label_names' (the 20 official superclasses)

Labels are ``0 .. num_classes - 1`` (the first ``num_classes`` official fine
classes, their official superclasses); mmpretrain's ``CIFAR100`` loader (and
:class:`~kcla_mm.datasets.cifar.OfflineCIFAR100` with ``check_md5=False``)
reads them.

``imagenet`` writes the layout that mmpretrain's ``ImageNet`` reads with its
annotation files (``meta/{split}.txt`` is used automatically when it exists)::

    OUT/train/nXXXXXXXX/nXXXXXXXX_K.JPEG        one folder per class (WordNet-id-like names)
    OUT/val/ILSVRC2012_val_XXXXXXXX.JPEG        flat, classes interleaved, as in ILSVRC2012
    OUT/meta/train.txt                          lines "nXXXXXXXX/nXXXXXXXX_K.JPEG label"
    OUT/meta/val.txt                            lines "ILSVRC2012_val_XXXXXXXX.JPEG label"

With fewer than 1000 classes only the annotation files give the labels:
mmpretrain's folder layout requires 1000 class folders.

Images are seeded per split and class: the same arguments give byte-identical
files, and the test/val counts do not change the training images.

Usage::

    python -m kcla_mm.datasets.synthetic_cls cifar100 --out data/synthetic_cifar100 \
        --classes 10 --num-train 100 --num-test 20
    python -m kcla_mm.datasets.synthetic_cls imagenet --out data/synthetic_imagenet \
        --classes 10 --num-train 20 --num-val 5 --size 64
"""
import argparse
import os
import os.path as osp
import pickle
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np

#: the 20 CIFAR-100 superclasses, in the order of the official ``meta`` file.
CIFAR100_COARSE_NAMES: Tuple[str, ...] = (
    'aquatic_mammals', 'fish', 'flowers', 'food_containers', 'fruit_and_vegetables',
    'household_electrical_devices', 'household_furniture', 'insects', 'large_carnivores',
    'large_man-made_outdoor_things', 'large_natural_outdoor_scenes',
    'large_omnivores_and_herbivores', 'medium_mammals', 'non-insect_invertebrates', 'people',
    'reptiles', 'small_mammals', 'trees', 'vehicles_1', 'vehicles_2')
#: the superclass of each of the 100 fine classes (fine classes in alphabetical order).
CIFAR100_FINE_TO_COARSE: Tuple[int, ...] = (
    4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11,
    6, 11, 5, 10, 7, 6, 13, 15, 3, 15, 0, 11, 1, 10, 12, 14, 16, 9, 11, 5,
    5, 19, 8, 8, 15, 13, 14, 17, 18, 10, 16, 4, 17, 4, 2, 0, 17, 4, 18, 17,
    10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16, 12, 9, 13, 15, 13,
    16, 19, 2, 4, 6, 19, 5, 5, 8, 19, 18, 1, 2, 15, 6, 0, 17, 8, 14, 13)
CIFAR100_FOLDER = 'cifar-100-python'
CIFAR_SIZE = 32
_PICKLE_PROTOCOL = 4  # raw bytes for the image data (protocol 2 would inflate them)

IMAGENET_VAL_NAME = 'ILSVRC2012_val_{:08d}.JPEG'

# Class layouts: waves per channel, their amplitude range and the base levels.
_WAVES = 3
_MAX_FREQ = 2
_AMPLITUDE = (15.0, 45.0)
_BASE = (70.0, 185.0)
# Per-image jitter.
_MAX_SHIFT = 0.1  # fraction of the image
_CONTRAST = (0.7, 1.3)
_BRIGHTNESS = 25.0
_COLOUR_CAST = 8.0
_DISTRACTOR = 25.0
_NOISE = 10.0
_CHUNK = 64  # images rendered at once


def cifar100_fine_names() -> Tuple[str, ...]:
    """The 100 official fine class names (mmpretrain's ``CIFAR100_CATEGORIES``)."""
    from mmpretrain.datasets.categories import CIFAR100_CATEGORIES
    return tuple(CIFAR100_CATEGORIES)


def imagenet_wnid(label: int) -> str:
    """A WordNet-id-like folder name; sorted names follow the labels."""
    return f'n{1_000_000 + 1000 * label:08d}'


def class_layout(seed: int, label: int) -> Dict[str, np.ndarray]:
    """The fixed layout of class ``label``: base levels and waves of each channel.

    Returns:
        ``dict(base=[3], freq=[3, W, 2] (cycles per image, x then y),
        amplitude=[3, W], phase=[3, W])``.
    """
    rng = np.random.default_rng([seed, 0, label])
    freqs = [(fx, fy) for fx in range(-_MAX_FREQ, _MAX_FREQ + 1)
             for fy in range(0, _MAX_FREQ + 1) if fy > 0 or fx > 0]  # one of each +-pair
    choice = np.stack([rng.choice(len(freqs), _WAVES, replace=False) for _ in range(3)])
    return dict(base=rng.uniform(*_BASE, 3),
                freq=np.asarray(freqs, np.float64)[choice],
                amplitude=rng.uniform(*_AMPLITUDE, (3, _WAVES)),
                phase=rng.uniform(0, 2 * np.pi, (3, _WAVES)))


def _waves(freq: np.ndarray, amplitude: np.ndarray, phase: np.ndarray, shift: np.ndarray,
           size: int) -> np.ndarray:
    """Sums of plane waves, ``[N, 3, size, size]``.

    ``freq`` is ``[N or 1, 3, W, 2]`` (cycles per image), ``amplitude`` and
    ``phase`` ``[N or 1, 3, W]``, ``shift`` ``[N, 2]`` (fractions of the image).
    """
    grid = (np.arange(size) + 0.5) / size
    x = grid[None, None, None, None, :] + shift[:, 0, None, None, None, None]  # [N,1,1,1,S]
    y = grid[None, None, None, :, None] + shift[:, 1, None, None, None, None]  # [N,1,1,S,1]
    fx, fy = freq[..., 0, None, None], freq[..., 1, None, None]
    angle = 2 * np.pi * (fx * x + fy * y) + phase[..., None, None]
    return (amplitude[..., None, None] * np.cos(angle)).sum(axis=2)


def render_class(layout: Dict[str, np.ndarray], num: int, size: int,
                 rng: np.random.Generator) -> np.ndarray:
    """``num`` images of one class.

    Args:
        layout: the class's :func:`class_layout`.
        num: number of images.
        size: height and width in pixels.
        rng: the only source of the per-image randomness.

    Returns:
        ``[num, size, size, 3]`` uint8 RGB images.
    """
    shift = rng.uniform(-_MAX_SHIFT, _MAX_SHIFT, (num, 2))
    contrast = rng.uniform(*_CONTRAST, (num, 1, 1, 1))
    brightness = rng.uniform(-_BRIGHTNESS, _BRIGHTNESS, (num, 1, 1, 1))
    cast = rng.normal(0, _COLOUR_CAST, (num, 3, 1, 1))
    distractor = dict(freq=rng.integers(-_MAX_FREQ - 1, _MAX_FREQ + 2, (num, 3, 1, 2)),
                      amplitude=rng.uniform(0, _DISTRACTOR, (num, 3, 1)),
                      phase=rng.uniform(0, 2 * np.pi, (num, 3, 1)))
    img = np.empty((num, 3, size, size))
    for start in range(0, num, _CHUNK):  # bounded memory for large images
        part = slice(start, start + _CHUNK)
        signal = _waves(layout['freq'][None], layout['amplitude'][None], layout['phase'][None],
                        shift[part], size)
        clutter = _waves(distractor['freq'][part].astype(np.float64),
                         distractor['amplitude'][part], distractor['phase'][part],
                         np.zeros((len(signal), 2)), size)
        noise = rng.normal(0, _NOISE, signal.shape)
        img[part] = layout['base'][None, :, None, None] + contrast[part] * signal + clutter + noise
    img += brightness + cast
    return np.clip(np.rint(img), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def split_images(seed: int, split_index: int, num_classes: int, per_class: int,
                 size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Images and labels of one split, classes interleaved by a seeded permutation.

    Args:
        seed: the data seed (class layouts and images).
        split_index: 0 for the training split, 1 for the test/val split.
        num_classes: classes ``0 .. num_classes - 1``.
        per_class: images per class.
        size: height and width in pixels.

    Returns:
        ``([N, size, size, 3] uint8 RGB images, [N] int64 labels)``.
    """
    images, labels = [], []
    for label in range(num_classes):
        rng = np.random.default_rng([seed, 1 + split_index, label])
        images.append(render_class(class_layout(seed, label), per_class, size, rng))
        labels.append(np.full(per_class, label, np.int64))
    order = np.random.default_rng([seed, 100 + split_index]).permutation(num_classes * per_class)
    return np.concatenate(images)[order], np.concatenate(labels)[order]


def _check_counts(num_classes: int, max_classes: int, counts: Dict[str, int]) -> None:
    if not 1 <= num_classes <= max_classes:
        raise ValueError(f'num_classes must be in 1..{max_classes}, got {num_classes}')
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f'{name} must be >= 1, got {name}={value}')


def _dump(obj: dict, path: str) -> None:
    with open(path, 'wb') as f:
        pickle.dump(obj, f, protocol=_PICKLE_PROTOCOL)


def make_cifar100(out: str, num_train: int = 50, num_test: int = 10, num_classes: int = 100,
                  seed: int = 0) -> dict:
    """Write ``OUT/cifar-100-python/{train,test,meta}`` as in the official archive.

    Args:
        out: the data root (``OfflineCIFAR100(data_root=out)``); created.
        num_train: training images per class (500 in CIFAR-100).
        num_test: test images per class (100 in CIFAR-100).
        num_classes: classes used, labels ``0 .. num_classes - 1`` (at most 100).
        seed: random seed; the same arguments give byte-identical files.

    Returns:
        ``dict(root, folder, files=dict(train, test, meta), num_classes,
        counts=dict(train, test))``.
    """
    _check_counts(num_classes, 100, dict(num_train=num_train, num_test=num_test))
    fine_names = cifar100_fine_names()
    folder = osp.join(out, CIFAR100_FOLDER)
    os.makedirs(folder, exist_ok=True)
    files, counts = {}, {}
    for split_index, (split, per_class, batch_label) in enumerate(
            (('train', num_train, 'training batch 1 of 1'),
             ('test', num_test, 'testing batch 1 of 1'))):
        images, labels = split_images(seed, split_index, num_classes, per_class, CIFAR_SIZE)
        fine = [int(label) for label in labels]
        filenames = [f'{fine_names[label]}_s_{index:06d}.png' for index, label in enumerate(fine)]
        entry = dict(filenames=filenames, batch_label=batch_label, fine_labels=fine,
                     coarse_labels=[CIFAR100_FINE_TO_COARSE[label] for label in fine],
                     data=np.ascontiguousarray(images.transpose(0, 3, 1, 2)).reshape(
                         len(fine), 3 * CIFAR_SIZE * CIFAR_SIZE))
        files[split] = osp.join(folder, split)
        _dump(entry, files[split])
        counts[split] = len(fine)
    files['meta'] = osp.join(folder, 'meta')
    _dump(dict(fine_label_names=list(fine_names),
               coarse_label_names=list(CIFAR100_COARSE_NAMES)), files['meta'])
    return dict(root=out, folder=folder, files=files, num_classes=num_classes, counts=counts)


def _write_jpeg(path: str, img: np.ndarray, quality: int) -> None:
    if not cv2.imwrite(path, cv2.cvtColor(img, cv2.COLOR_RGB2BGR),
                       [cv2.IMWRITE_JPEG_QUALITY, quality]):
        raise OSError(f'could not write {path}')


def make_imagenet(out: str, num_train: int = 20, num_val: int = 5, num_classes: int = 10,
                  size: int = 64, seed: int = 0, jpeg_quality: int = 95) -> dict:
    """Write ``OUT/{train,val}`` and ``OUT/meta/{train,val}.txt`` as mmpretrain reads ImageNet.

    Args:
        out: the data root (``ImageNet(data_root=out, split=...)``); created.
        num_train: training images per class.
        num_val: validation images per class (50 in ILSVRC2012).
        num_classes: classes used, labels ``0 .. num_classes - 1`` (at most 1000).
        size: image height and width in pixels (at least 8).
        seed: random seed; the same arguments give byte-identical files.
        jpeg_quality: JPEG quality (OpenCV scale, 0-100).

    Returns:
        ``dict(root, ann_files=dict(train, val), wnids, num_classes,
        counts=dict(train, val))``.
    """
    _check_counts(num_classes, 1000, dict(num_train=num_train, num_val=num_val))
    if size < 8:
        raise ValueError(f'size must be >= 8, got size={size}')
    os.makedirs(osp.join(out, 'meta'), exist_ok=True)
    wnids = [imagenet_wnid(label) for label in range(num_classes)]
    ann_files, counts = {}, {}
    for split_index, (split, per_class) in enumerate((('train', num_train), ('val', num_val))):
        images, labels = split_images(seed, split_index, num_classes, per_class, size)
        lines: List[str] = []
        if split == 'train':
            index = [0] * num_classes  # images numbered within each class
            names = []
            for label in labels:
                index[label] += 1
                names.append(f'{wnids[label]}/{wnids[label]}_{index[label]}.JPEG')
            for wnid in wnids:
                os.makedirs(osp.join(out, split, wnid), exist_ok=True)
        else:
            names = [IMAGENET_VAL_NAME.format(i + 1) for i in range(len(labels))]
            os.makedirs(osp.join(out, split), exist_ok=True)
        for name, img, label in zip(names, images, labels):
            _write_jpeg(osp.join(out, split, name), img, jpeg_quality)
            lines.append(f'{name} {int(label)}\n')
        ann_files[split] = osp.join(out, 'meta', f'{split}.txt')
        with open(ann_files[split], 'w') as f:
            f.writelines(lines)
        counts[split] = len(lines)
    return dict(root=out, ann_files=ann_files, wnids=wnids, num_classes=num_classes,
                counts=counts)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = parser.add_subparsers(dest='task', required=True)
    cifar = sub.add_parser('cifar100', help='OUT/cifar-100-python/{train,test,meta}')
    cifar.add_argument('--classes', type=int, default=100, help='classes used (default 100)')
    cifar.add_argument('--num-train', type=int, default=50,
                       help='training images per class (default 50)')
    cifar.add_argument('--num-test', type=int, default=10,
                       help='test images per class (default 10)')
    imagenet = sub.add_parser('imagenet', help='OUT/{train,val}/ and OUT/meta/{train,val}.txt')
    imagenet.add_argument('--classes', type=int, default=10, help='classes used (default 10)')
    imagenet.add_argument('--num-train', type=int, default=20,
                          help='training images per class (default 20)')
    imagenet.add_argument('--num-val', type=int, default=5,
                          help='validation images per class (default 5)')
    imagenet.add_argument('--size', type=int, default=64, help='image height and width')
    for task in (cifar, imagenet):
        task.add_argument('--out', required=True, help='output directory (the data root)')
        task.add_argument('--seed', type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    if args.task == 'cifar100':
        summary = make_cifar100(args.out, num_train=args.num_train, num_test=args.num_test,
                                num_classes=args.classes, seed=args.seed)
    else:
        summary = make_imagenet(args.out, num_train=args.num_train, num_val=args.num_val,
                                num_classes=args.classes, size=args.size, seed=args.seed)
    counts = ', '.join(f'{split}: {n}' for split, n in summary['counts'].items())
    print(f'wrote synthetic {args.task} data ({summary["num_classes"]} classes; {counts} '
          f'images) to {args.out}')
    return summary


if __name__ == '__main__':
    main()
