"""Synthetic lesion/polyp images in the on-disk layouts of the official downloads.

For demos and tests without the real data: each image shows one lesion-like
blob (a star-shaped region with a perturbed Fourier boundary, its own colour
and texture, a soft edge) on a textured background, with its binary mask. The
files are written exactly as the public archives unpack, so that the
converters in ``tools/dataset_converters/`` run on them unchanged:

``isic2017``::

    ISIC-2017_{Training,Validation,Test_v2}_Data/ISIC_XXXXXXX.jpg
        (+ ISIC_XXXXXXX_superpixels.png, ISIC-2017_*_Data_metadata.csv)
    ISIC-2017_{Training,Validation,Test_v2}_Part1_GroundTruth/ISIC_XXXXXXX_segmentation.png

``isic2018``::

    ISIC2018_Task1-2_{Training,Validation,Test}_Input/ISIC_XXXXXXX.jpg (+ LICENSE.txt, ...)
    ISIC2018_Task1_{Training,Validation,Test}_GroundTruth/ISIC_XXXXXXX_segmentation.png

``kvasir``::

    Kvasir-SEG/images/NAME.jpg, Kvasir-SEG/masks/NAME.jpg (JPEG masks, not exactly 0/255),
    Kvasir-SEG/kavsir_bboxes.json

ISIC masks are 0/255 single-channel PNGs; Kvasir masks are 3-channel JPEGs,
so their values near the boundary are neither 0 nor 255, as in the real data.

Usage::

    python -m kcla_mm.datasets.synthetic_medical --layout kvasir --out data/synthetic_kvasir
"""
import argparse
import json
import os
import os.path as osp
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np

LAYOUTS = ('kvasir', 'isic2017', 'isic2018')

#: folder names of the official archives, per layout and split.
ISIC_FOLDERS: Dict[str, Dict[str, Tuple[str, str]]] = {
    'isic2017': {
        'Training': ('ISIC-2017_Training_Data', 'ISIC-2017_Training_Part1_GroundTruth'),
        'Validation': ('ISIC-2017_Validation_Data', 'ISIC-2017_Validation_Part1_GroundTruth'),
        'Test': ('ISIC-2017_Test_v2_Data', 'ISIC-2017_Test_v2_Part1_GroundTruth'),
    },
    'isic2018': {
        'Training': ('ISIC2018_Task1-2_Training_Input', 'ISIC2018_Task1_Training_GroundTruth'),
        'Validation': ('ISIC2018_Task1-2_Validation_Input',
                       'ISIC2018_Task1_Validation_GroundTruth'),
        'Test': ('ISIC2018_Task1-2_Test_Input', 'ISIC2018_Task1_Test_GroundTruth'),
    },
}
KVASIR_ROOT = 'Kvasir-SEG'

# RGB colour ranges of background and foreground, per style.
_STYLES = {
    'skin': dict(background=((190, 140, 110), (240, 200, 175)),
                 lesion=((70, 35, 20), (150, 95, 70))),
    'mucosa': dict(background=((150, 60, 50), (215, 120, 100)),
                   lesion=((210, 130, 110), (250, 190, 160))),
}


def _smooth_noise(rng: np.random.Generator, height: int, width: int, cells: int) -> np.ndarray:
    """``[H, W]`` float32 noise in about [-1, 1] varying over ``cells`` cells."""
    grid = rng.uniform(-1, 1, (cells, cells)).astype(np.float32)
    return cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC)


def blob_mask(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A star-shaped blob with a perturbed Fourier boundary.

    Returns:
        ``[H, W]`` uint8 mask in {0, 1}, covering roughly 5-35% of the image.
    """
    short = min(height, width)
    radius = rng.uniform(0.15, 0.32) * short
    cy = rng.uniform(0.35, 0.65) * height
    cx = rng.uniform(0.35, 0.65) * width
    theta = np.linspace(0, 2 * np.pi, 180, endpoint=False)
    r = np.ones_like(theta)
    for k in range(2, 6):
        r += rng.uniform(0, 0.25 / k) * np.cos(k * theta + rng.uniform(0, 2 * np.pi))
    aspect = rng.uniform(0.7, 1.3)
    pts = np.stack([cx + radius * r * np.cos(theta) * aspect,
                    cy + radius * r * np.sin(theta) / aspect], axis=1)
    mask = np.zeros((height, width), np.uint8)
    cv2.fillPoly(mask, [np.round(pts).astype(np.int32)], 1)
    return mask


def lesion_sample(rng: np.random.Generator, height: int, width: int,
                  style: str = 'skin') -> Tuple[np.ndarray, np.ndarray]:
    """One synthetic image and its mask.

    Args:
        rng: random generator (the only source of randomness).
        height: image height.
        width: image width.
        style: ``'skin'`` (dermoscopy-like) or ``'mucosa'`` (endoscopy-like).

    Returns:
        ``([H, W, 3] uint8 RGB image, [H, W] uint8 mask in {0, 1})``.
    """
    if style not in _STYLES:
        raise ValueError(f'style={style!r}; choose one of {sorted(_STYLES)}')
    colours = _STYLES[style]
    mask = blob_mask(rng, height, width)
    bg = rng.uniform(*colours['background']).astype(np.float32)
    fg = rng.uniform(*colours['lesion']).astype(np.float32)
    shade = 1 + 0.15 * _smooth_noise(rng, height, width, 3)[..., None]  # illumination
    texture = 12 * _smooth_noise(rng, height, width, 12)[..., None]
    # Soft lesion edge in the image only (the mask stays binary).
    alpha = cv2.GaussianBlur(mask.astype(np.float32), (0, 0), max(min(height, width) / 100, 0.5))
    inner = 20 * _smooth_noise(rng, height, width, 8)[..., None]
    img = (bg + texture) * (1 - alpha[..., None]) + (fg + inner) * alpha[..., None]
    img = img * shade + rng.normal(0, 6, (height, width, 1)).astype(np.float32)
    if style == 'skin':  # a few dark hair-like strokes as distractors
        for _ in range(int(rng.integers(0, 4))):
            p0 = (int(rng.integers(0, width)), int(rng.integers(0, height)))
            p1 = (int(rng.integers(0, width)), int(rng.integers(0, height)))
            cv2.line(img, p0, p1, (40.0, 25.0, 20.0), 1, cv2.LINE_AA)
    else:  # specular highlights
        for _ in range(int(rng.integers(1, 4))):
            c = (int(rng.integers(0, width)), int(rng.integers(0, height)))
            cv2.circle(img, c, int(rng.integers(1, 4)), (255.0, 255.0, 255.0), -1, cv2.LINE_AA)
    return np.clip(img, 0, 255).astype(np.uint8), mask


def _sizes(rng: np.random.Generator, size: int, jitter: float) -> Tuple[int, int]:
    h = int(round(size * rng.uniform(1 - jitter, 1 + jitter)))
    w = int(round(size * rng.uniform(1 - jitter, 1 + jitter) * 4 / 3))
    return max(h, 16), max(w, 16)


def _write_rgb(path: str, img: np.ndarray, quality: int = 90) -> None:
    ok = cv2.imwrite(path, cv2.cvtColor(img, cv2.COLOR_RGB2BGR),
                     [cv2.IMWRITE_JPEG_QUALITY, quality] if path.endswith('.jpg') else [])
    if not ok:
        raise OSError(f'could not write {path}')


def _write_isic(out: str, layout: str, counts: Dict[str, int], size: int,
                rng: np.random.Generator) -> Dict[str, List[str]]:
    written: Dict[str, List[str]] = {}
    index = 0
    for split, (img_folder, gt_folder) in ISIC_FOLDERS[layout].items():
        n = counts[split]
        if n == 0:
            continue
        img_dir, gt_dir = osp.join(out, img_folder), osp.join(out, gt_folder)
        os.makedirs(img_dir, exist_ok=True)
        os.makedirs(gt_dir, exist_ok=True)
        names = []
        for _ in range(n):
            name = f'ISIC_{index:07d}'
            index += 1
            h, w = _sizes(rng, size, 0.2)
            img, mask = lesion_sample(rng, h, w, 'skin')
            _write_rgb(osp.join(img_dir, f'{name}.jpg'), img)
            cv2.imwrite(osp.join(gt_dir, f'{name}_segmentation.png'), mask * 255)
            if layout == 'isic2017':  # the official data folders also hold superpixel maps
                cv2.imwrite(osp.join(img_dir, f'{name}_superpixels.png'),
                            np.zeros((h, w, 3), np.uint8))
            names.append(name)
        if layout == 'isic2017':
            with open(osp.join(img_dir, f'{img_folder}_metadata.csv'), 'w') as f:
                f.write('image_id,age_approximate,sex\n')
                f.writelines(f'{n},unknown,unknown\n' for n in names)
        else:
            for extra in ('LICENSE.txt', 'ATTRIBUTION.txt'):
                with open(osp.join(img_dir, extra), 'w') as f:
                    f.write('synthetic data generated by kcla_mm\n')
        written[split] = names
    return written


def _write_kvasir(out: str, num: int, size: int,
                  rng: np.random.Generator) -> Dict[str, List[str]]:
    root = osp.join(out, KVASIR_ROOT)
    os.makedirs(osp.join(root, 'images'), exist_ok=True)
    os.makedirs(osp.join(root, 'masks'), exist_ok=True)
    alphabet = np.array(list('abcdefghijklmnopqrstuvwxyz0123456789'))
    names, boxes = [], {}
    for _ in range(num):
        name = 'cj' + ''.join(rng.choice(alphabet, 23))
        h, w = _sizes(rng, size, 0.25)
        img, mask = lesion_sample(rng, h, w, 'mucosa')
        _write_rgb(osp.join(root, 'images', f'{name}.jpg'), img)
        # Kvasir-SEG ships its masks as 3-channel JPEGs.
        _write_rgb(osp.join(root, 'masks', f'{name}.jpg'),
                   np.repeat(mask[..., None] * 255, 3, axis=2), quality=75)
        ys, xs = np.nonzero(mask)
        boxes[name] = dict(height=h, width=w, bbox=[dict(
            label='polyp', xmin=int(xs.min()), ymin=int(ys.min()),
            xmax=int(xs.max()), ymax=int(ys.max()))])
        names.append(name)
    with open(osp.join(root, 'kavsir_bboxes.json'), 'w') as f:
        json.dump(boxes, f)
    return {'all': names}


def generate(layout: str,
             out: str,
             num: int = 40,
             size: int = 128,
             seed: int = 0,
             num_val: Optional[int] = None,
             num_test: Optional[int] = None) -> Dict[str, List[str]]:
    """Write a synthetic dataset in the layout of an official download.

    Args:
        layout: ``'kvasir'``, ``'isic2017'`` or ``'isic2018'``.
        out: directory to write into (created; the archive folders go inside).
        num: number of image/mask pairs (Kvasir) or of the ISIC Training set.
        size: typical image height; sizes vary by +-20-25% and images are 4:3.
        seed: random seed; the same arguments give the same files.
        num_val: ISIC Validation images (default ``num // 4``).
        num_test: ISIC Test images (default ``num // 4``).

    Returns:
        ``{split: [names]}`` (``{'all': [...]}`` for Kvasir, which has no splits).
    """
    if layout not in LAYOUTS:
        raise ValueError(f'layout={layout!r}; choose one of {LAYOUTS}')
    if num < 1 or size < 16:
        raise ValueError(f'need num >= 1 and size >= 16, got num={num}, size={size}')
    rng = np.random.default_rng(seed)
    os.makedirs(out, exist_ok=True)
    if layout == 'kvasir':
        return _write_kvasir(out, num, size, rng)
    counts = dict(Training=num,
                  Validation=num // 4 if num_val is None else num_val,
                  Test=num // 4 if num_test is None else num_test)
    return _write_isic(out, layout, counts, size, rng)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--layout', required=True, choices=LAYOUTS)
    parser.add_argument('--out', required=True, help='output directory')
    parser.add_argument('--num', type=int, default=40,
                        help='pairs (Kvasir) or ISIC Training pairs (default 40)')
    parser.add_argument('--num-val', type=int, default=None,
                        help='ISIC Validation pairs (default num // 4)')
    parser.add_argument('--num-test', type=int, default=None,
                        help='ISIC Test pairs (default num // 4)')
    parser.add_argument('--size', type=int, default=128, help='typical image height')
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    written = generate(args.layout, args.out, num=args.num, size=args.size, seed=args.seed,
                       num_val=args.num_val, num_test=args.num_test)
    summary = ', '.join(f'{split}: {len(names)}' for split, names in written.items())
    print(f'wrote synthetic {args.layout} data to {args.out} ({summary})')


if __name__ == '__main__':
    main()
