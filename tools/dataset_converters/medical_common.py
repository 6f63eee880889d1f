"""Shared logic of the ISIC 2017/2018 and Kvasir-SEG converters.

A converter finds image/mask pairs in an official download, assigns each pair
to a split (the official one, a seeded random one, one read from a file, or
a published split shipped as name lists under ``splits/``), and writes the
prepared layout read by ``kcla_mm.datasets.medical``::

    OUT/images/{train,val,test}/NAME.png   (``--image-format jpg``: the original bytes)
    OUT/masks/{train,val,test}/NAME.png    uint8 0/1 (mask >= --mask-threshold)
    OUT/splits.txt                         "NAME SPLIT" per line (reusable as --split-file)
    OUT/stats.json                         counts, per-channel RGB mean/std of train images
    OUT/skipped.txt                        with --skip-bad: every pair left out, and why

Bad inputs (an image without a mask, a mask without an image, a mask whose
size differs from its image, an unreadable file, a name missing from or
unknown to the split file or lists) are all reported by name. By default any
of them fails the conversion (exit status 1); ``--skip-bad`` converts the rest
and lists the others in ``skipped.txt``.
"""
import argparse
import json
import os
import os.path as osp
import random
import shutil
import sys
from dataclasses import dataclass
from multiprocessing import Pool
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import cv2
import numpy as np

SPLITS = ('train', 'val', 'test')
IMAGE_EXTS = ('.jpg', '.jpeg', '.png')


@dataclass(frozen=True)
class Pair:
    """One image and its mask in a download; ``source`` names the official set."""

    name: str
    image: str
    mask: str
    source: str


@dataclass(frozen=True)
class Problem:
    """A bad input: the sample name, the file concerned and what is wrong."""

    name: str
    path: str
    reason: str

    def __str__(self) -> str:
        return f'{self.name}: {self.reason} ({self.path})'


class ConversionError(RuntimeError):
    """The download cannot be converted as asked; the message lists every problem."""


def list_files(folder: str, suffix: str = '', exts: Sequence[str] = IMAGE_EXTS,
               exclude_suffixes: Sequence[str] = ()) -> Tuple[Dict[str, str], List[Problem]]:
    """Files of ``folder`` whose stem ends with ``suffix`` and whose extension is in ``exts``.

    Args:
        folder: directory to list (not recursive).
        suffix: required end of the stem (e.g. ``'_segmentation'``); removed
            from the returned names.
        exts: accepted extensions (case-insensitive).
        exclude_suffixes: stems ending with these are expected extras and skipped.

    Returns:
        ``{name: path}`` and problems for image files that match nothing
        (unexpected files) or that share a name.
    """
    found: Dict[str, str] = {}
    problems = []
    for fname in sorted(os.listdir(folder)):
        stem, ext = osp.splitext(fname)
        path = osp.join(folder, fname)
        if ext.lower() not in exts or not osp.isfile(path):
            continue
        if any(stem.endswith(s) for s in exclude_suffixes):
            continue
        if suffix and not stem.endswith(suffix):
            problems.append(Problem(stem, path, f'unexpected file (expected NAME{suffix}'
                                    f'{exts[0]} files here)'))
            continue
        name = stem[:len(stem) - len(suffix)] if suffix else stem
        if name in found:
            problems.append(Problem(name, path, f'duplicate of {found[name]}'))
            continue
        found[name] = path
    return found, problems


def pair_up(images: Dict[str, str], masks: Dict[str, str],
            source: str) -> Tuple[List[Pair], List[Problem]]:
    """Pairs of equal names; an image without a mask or a mask without an image is a problem."""
    pairs = [Pair(n, images[n], masks[n], source) for n in sorted(images) if n in masks]
    problems = [Problem(n, images[n], f'image without mask in {source}')
                for n in sorted(images) if n not in masks]
    problems += [Problem(n, masks[n], f'mask without image in {source}')
                 for n in sorted(masks) if n not in images]
    return pairs, problems


def read_split_file(path: str) -> Dict[str, str]:
    """``{name: split}`` from lines ``NAME SPLIT`` (``#`` comments, extensions stripped)."""
    if not osp.isfile(path):
        raise ConversionError(f'split file {path!r} does not exist')
    assignment: Dict[str, str] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.split('#', 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2 or fields[1] not in SPLITS:
                raise ConversionError(f'{path}:{lineno}: expected "NAME SPLIT" with SPLIT one '
                                      f'of {SPLITS}, got {line!r}')
            name, ext = osp.splitext(osp.basename(fields[0]))
            if ext.lower() not in IMAGE_EXTS:  # a name with a dot, not a file name
                name = osp.basename(fields[0])
            if name in assignment and assignment[name] != fields[1]:
                raise ConversionError(f'{path}:{lineno}: {name} is listed in both '
                                      f'{assignment[name]} and {fields[1]}')
            assignment[name] = fields[1]
    return assignment


def _list_name(entry: str) -> str:
    """``NAME`` of a listed ``NAME.jpg`` (or of a bare name, which may contain dots)."""
    name, ext = osp.splitext(osp.basename(entry))
    return name if ext.lower() in IMAGE_EXTS else osp.basename(entry)


def read_name_lists(lists: Dict[str, str]) -> Dict[str, str]:
    """``{name: split}`` from one file of names per split (``{split: path}``).

    Each file holds one image file name per line (``cju0qkwl35piu0993l0dewei2.jpg``;
    extensions stripped, blank lines and ``#`` comments skipped), the form in
    which papers publish their splits.

    Raises:
        ConversionError: a missing file, a split other than train/val/test, or
            a name listed twice.
    """
    assignment: Dict[str, str] = {}
    where: Dict[str, str] = {}
    for split, path in lists.items():
        if split not in SPLITS:
            raise ConversionError(f'{path}: split {split!r} is not one of {SPLITS}')
        if not osp.isfile(path):
            raise ConversionError(f'name list {path!r} of the {split} split does not exist')
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                entry = line.split('#', 1)[0].strip()
                if not entry:
                    continue
                if len(entry.split()) != 1:
                    raise ConversionError(f'{path}:{lineno}: expected one file name, '
                                          f'got {entry!r}')
                name = _list_name(entry)
                if name in assignment:
                    raise ConversionError(f'{path}:{lineno}: {name} is also listed at '
                                          f'{where[name]}')
                assignment[name] = split
                where[name] = f'{path}:{lineno}'
    return assignment


def listed_assignment(pairs: Sequence[Pair], listed: Dict[str, str], source: str,
                      files: Dict[str, str]) -> Tuple[Dict[str, str], List[Problem]]:
    """Split of each pair as ``listed``; names the download lacks and pairs not listed.

    Args:
        pairs: all pairs found.
        listed: ``{name: split}`` of a split file or of name lists.
        source: what ``listed`` came from, for the messages.
        files: ``{split: file}`` the names of each split were read from.

    Returns:
        ``{name: split}`` of the listed pairs found, and one problem for each
        listed name missing from the download and each pair not listed.
    """
    by_name = {p.name: p for p in pairs}
    problems = [Problem(n, files[listed[n]], f'listed as {listed[n]} in {source} but not '
                        'found in the download (or it has a bad input reported above)')
                for n in sorted(listed) if n not in by_name]
    problems += [Problem(p.name, p.image, f'not listed in {source}')
                 for p in pairs if p.name not in listed]
    return {n: s for n, s in listed.items() if n in by_name}, problems


def random_split(names: Iterable[str], ratio: float, seed: int,
                 test_ratio: float = 0.0) -> Dict[str, str]:
    """Seeded train/val(/test) split.

    The names are sorted and shuffled by Python's ``random.Random(seed)``; the
    first ``round(ratio * n)`` go to train, the last ``round(test_ratio * n)``
    to test, the rest to val. The split depends only on the set of names and
    the arguments, and the train set does not depend on ``test_ratio``.
    """
    if not 0 < ratio < 1:
        raise ConversionError(f'--ratio must be in (0, 1), got {ratio}')
    if not 0 <= test_ratio or ratio + test_ratio > 1 - 1e-9:
        raise ConversionError(f'--test-ratio must be in [0, 1 - ratio) to leave a val split, '
                              f'got {test_ratio} with --ratio {ratio}')
    names = sorted(names)
    random.Random(seed).shuffle(names)
    n_train = int(round(ratio * len(names)))
    n_test = int(round(test_ratio * len(names)))
    return {n: ('train' if i < n_train else 'test' if i >= len(names) - n_test else 'val')
            for i, n in enumerate(names)}


Assignment = Tuple[Dict[str, str], List[Problem]]


def assign_splits(pairs: Sequence[Pair], args: argparse.Namespace, official: Dict[str, str],
                  pool: Sequence[str]) -> Assignment:
    """Split of every pair according to ``--split``.

    Args:
        pairs: all pairs found.
        args: parsed arguments (``split``, ``ratio``, ``test_ratio``, ``seed``,
            ``split_file``, and ``split_lists``: ``{split: path}`` of a named split).
        official: ``{source: split}`` of the official sets (ISIC), empty if none.
        pool: sources split at random in ``random`` mode; pairs of other
            sources keep their official split.

    Returns:
        ``{name: split}`` and problems (pairs not in / names unknown to a split
        file or named lists).
    """
    if args.split == 'file':
        return listed_assignment(pairs, read_split_file(args.split_file), 'the split file',
                                 {s: args.split_file for s in SPLITS})
    lists = getattr(args, 'split_lists', None)
    if lists is not None:
        return listed_assignment(pairs, read_name_lists(lists), f'--split {args.split}', lists)
    if args.split == 'official':
        return {p.name: official[p.source] for p in pairs}, []
    if args.test_ratio > 0:
        official_test = sorted({p.source for p in pairs
                                if p.source not in pool and official.get(p.source) == 'test'})
        if official_test:
            raise ConversionError(f'--test-ratio {args.test_ratio} would put part of the pool '
                                  f'into test beside the official {official_test}; leave out '
                                  '--test-ratio (the official set is the test split) or add '
                                  'the set to --pool')
    assignment = random_split([p.name for p in pairs if p.source in pool], args.ratio, args.seed,
                              args.test_ratio)
    for p in pairs:
        if p.source not in pool:
            assignment[p.name] = official[p.source]
    return assignment, []


def _convert_one(job: Tuple[Pair, str, str, str, int]) -> Tuple[str, str, Optional[str],
                                                                Optional[np.ndarray]]:
    """Read, check and write one pair; returns ``(name, split, error, RGB sums)``."""
    pair, split, out, image_format, threshold = job
    img = cv2.imread(pair.image, cv2.IMREAD_COLOR)
    if img is None:
        return pair.name, split, f'unreadable image ({pair.image})', None
    mask = cv2.imread(pair.mask, cv2.IMREAD_GRAYSCALE)
    if mask is None:
        return pair.name, split, f'unreadable mask ({pair.mask})', None
    if mask.shape != img.shape[:2]:
        return (pair.name, split, f'mask is {mask.shape[0]}x{mask.shape[1]} but the image is '
                f'{img.shape[0]}x{img.shape[1]} ({pair.mask})', None)
    img_out = osp.join(out, 'images', split, f'{pair.name}.{image_format}')
    if image_format == 'png':
        if not cv2.imwrite(img_out, img):
            return pair.name, split, f'could not write {img_out}', None
    else:
        shutil.copyfile(pair.image, img_out)
    mask_out = osp.join(out, 'masks', split, f'{pair.name}.png')
    if not cv2.imwrite(mask_out, (mask >= threshold).astype(np.uint8)):
        return pair.name, split, f'could not write {mask_out}', None
    rgb = img[..., ::-1].reshape(-1, 3).astype(np.float64)
    sums = np.concatenate([[rgb.shape[0]], rgb.sum(0), (rgb**2).sum(0)])
    return pair.name, split, None, sums


def _prepare_out(out: str, overwrite: bool) -> None:
    existing = [d for d in ('images', 'masks') if osp.isdir(osp.join(out, d))
                and any(os.scandir(osp.join(out, d)))]
    if existing and not overwrite:
        raise ConversionError(f'{out} already holds {existing}; pass --overwrite to replace '
                              'them (stale files would otherwise join the dataset)')
    for d in ('images', 'masks'):
        shutil.rmtree(osp.join(out, d), ignore_errors=True)
        for split in SPLITS:
            os.makedirs(osp.join(out, d, split), exist_ok=True)
    for f in ('splits.txt', 'stats.json', 'skipped.txt'):
        if osp.exists(osp.join(out, f)):
            os.remove(osp.join(out, f))


def _fail_or_skip(problems: List[Problem], skip_bad: bool, stage: str) -> None:
    if problems and not skip_bad:
        lines = '\n  '.join(str(p) for p in problems)
        raise ConversionError(f'{len(problems)} bad inputs {stage}:\n  {lines}\n'
                              'Fix them, or pass --skip-bad to convert the rest and list '
                              'these in skipped.txt.')


def convert(pairs: Sequence[Pair], problems: List[Problem], args: argparse.Namespace,
            official: Optional[Dict[str, str]] = None,
            pool: Sequence[str] = ()) -> Dict:
    """Split, check and write all pairs; returns the content of ``stats.json``.

    Raises:
        ConversionError: on any bad input unless ``args.skip_bad``; the
            message lists them all. Name-level problems (missing partner,
            split file) are found before anything is written.
    """
    assignment, split_problems = assign_splits(pairs, args, official or {}, pool)
    problems = list(problems) + split_problems
    _fail_or_skip(problems, args.skip_bad, 'found (nothing written)')
    _prepare_out(args.out, args.overwrite)
    jobs = [(p, assignment[p.name], args.out, args.image_format, args.mask_threshold)
            for p in pairs if p.name in assignment]
    if args.nproc > 1:
        with Pool(args.nproc) as pool_:
            results = pool_.map(_convert_one, jobs, chunksize=8)
    else:
        results = [_convert_one(job) for job in jobs]
    by_name = {p.name: p for p in pairs}
    read_problems = [Problem(name, by_name[name].image, error)
                     for name, _, error, _ in results if error is not None]
    problems += read_problems
    written = sorted((name, split) for name, split, error, _ in results if error is None)
    with open(osp.join(args.out, 'splits.txt'), 'w') as f:
        f.writelines(f'{name} {split}\n' for name, split in written)
    if problems:
        with open(osp.join(args.out, 'skipped.txt'), 'w') as f:
            f.writelines(f'{p}\n' for p in problems)
    _fail_or_skip(read_problems, args.skip_bad,
                  f'while reading (the output in {args.out} is incomplete)')
    train = [s for _, split, e, s in results if e is None and split == 'train']
    stats: Dict = dict(counts={s: sum(1 for _, split in written if split == s) for s in SPLITS},
                       skipped=len(problems), split=args.split, seed=args.seed,
                       ratio=args.ratio, test_ratio=args.test_ratio,
                       mask_threshold=args.mask_threshold)
    if train:
        total = np.sum(train, axis=0)
        mean = total[1:4] / total[0]
        std = np.sqrt(np.maximum(total[4:7] / total[0] - mean**2, 0))
        stats.update(mean_rgb=[round(float(v), 3) for v in mean],
                     std_rgb=[round(float(v), 3) for v in std])
    with open(osp.join(args.out, 'stats.json'), 'w') as f:
        json.dump(stats, f, indent=2)
    return stats


def build_parser(dataset: str, splits: Sequence[str], default_split: str,
                 description: str) -> argparse.ArgumentParser:
    """The command line shared by all converters.

    Args:
        dataset: the default output is ``data/DATASET``.
        splits: the ``--split`` modes of this converter besides ``file``.
        default_split: the default ``--split``.
        description: ``--help`` text.
    """
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('src', help='folder the official download unpacked to')
    parser.add_argument('--out', default=f'data/{dataset}',
                        help=f'output folder (default data/{dataset})')
    parser.add_argument('--split', choices=list(splits) + ['file'], default=default_split,
                        help=f'how to split (default {default_split}); "file" reads --split-file')
    parser.add_argument('--ratio', type=float, default=0.7,
                        help='train fraction of the random split (default 0.7)')
    parser.add_argument('--test-ratio', type=float, default=0.0,
                        help='test fraction of the random split (default 0: train/val only); '
                        'val gets the rest, e.g. --ratio 0.7 --test-ratio 0.15 for 70/15/15')
    parser.add_argument('--seed', type=int, default=0, help='seed of the random split')
    parser.add_argument('--split-file', default=None,
                        help='"NAME SPLIT" lines (e.g. a splits.txt written before); '
                        'implies --split file')
    parser.add_argument('--image-format', choices=('png', 'jpg'), default='png',
                        help='png: decode and write PNG; jpg: copy the original JPEG bytes')
    parser.add_argument('--mask-threshold', type=int, default=128,
                        help='mask pixels >= this are foreground (default 128)')
    parser.add_argument('--skip-bad', action='store_true',
                        help='convert the good pairs and list the bad ones in skipped.txt '
                        '(default: fail on any bad input)')
    parser.add_argument('--overwrite', action='store_true',
                        help='replace images/ and masks/ of an earlier conversion in --out')
    parser.add_argument('--nproc', type=int, default=1, help='worker processes')
    return parser


def finish_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check argument combinations (exits with a usage error naming them)."""
    if args.split_file is not None:
        if args.split not in ('file', parser.get_default('split')):
            parser.error(f'--split-file conflicts with --split {args.split}')
        args.split = 'file'
    elif args.split == 'file':
        parser.error('--split file needs --split-file')
    if not 0 < args.ratio < 1:
        parser.error(f'--ratio must be in (0, 1), got {args.ratio}')
    if not 0 <= args.test_ratio or args.ratio + args.test_ratio > 1 - 1e-9:
        parser.error(f'--test-ratio must be in [0, 1 - ratio) to leave a val split, got '
                     f'{args.test_ratio} with --ratio {args.ratio}')
    if args.test_ratio > 0 and args.split != 'random':
        parser.error(f'--test-ratio applies to --split random, not --split {args.split} '
                     '(a split file may list test names)')
    if not 1 <= args.mask_threshold <= 255:
        parser.error(f'--mask-threshold must be in [1, 255], got {args.mask_threshold}')
    if not osp.isdir(args.src):
        parser.error(f'{args.src} is not a directory')


def report(stats: Dict, out: str) -> None:
    """Print what was written and the normalisation constants to use."""
    counts = ', '.join(f'{s}: {n}' for s, n in stats['counts'].items())
    print(f'wrote {out} ({counts}; skipped: {stats["skipped"]})')
    if 'mean_rgb' in stats:
        mean, std = (','.join(str(v) for v in stats[k]) for k in ('mean_rgb', 'std_rgb'))
        print(f'train RGB mean=[{mean}] std=[{std}] (in {out}/stats.json); to normalise with '
              f'them: --cfg-options model.data_preprocessor.mean="[{mean}]" '
              f'model.data_preprocessor.std="[{std}]"')


def run(convert_fn, argv: Optional[Sequence[str]] = None) -> int:
    """Call ``convert_fn(argv) -> (stats, out)``; print errors instead of tracebacks."""
    try:
        stats, out = convert_fn(argv)
    except ConversionError as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    report(stats, out)
    return 0


#: official set -> split of ``--split official``.
ISIC_OFFICIAL_SPLITS = {'Training': 'train', 'Validation': 'val', 'Test': 'test'}


def find_isic_pairs(src: str,
                    folders: Dict[str, Tuple[str, str]]) -> Tuple[List[Pair], List[Problem]]:
    """Pairs of an ISIC download: ``ISIC_X.jpg`` with ``ISIC_X_segmentation.png``.

    Args:
        src: folder holding the unpacked archives.
        folders: ``{official set: (image folder, ground-truth folder)}``.

    Returns:
        Pairs of all sets found and the problems (a set with images but no
        ground-truth folder, unmatched files, a name in two sets).
    """
    pairs: List[Pair] = []
    problems: List[Problem] = []
    for source, (img_folder, gt_folder) in folders.items():
        img_dir, gt_dir = osp.join(src, img_folder), osp.join(src, gt_folder)
        if not osp.isdir(img_dir) and not osp.isdir(gt_dir):
            continue
        if not osp.isdir(img_dir) or not osp.isdir(gt_dir):
            have, lack = (img_dir, gt_dir) if osp.isdir(img_dir) else (gt_dir, img_dir)
            problems.append(Problem(source, lack, f'{have} exists but its partner folder '
                                    'does not; this set is left out'))
            continue
        images, p_img = list_files(img_dir, exclude_suffixes=('_superpixels', ))
        masks, p_mask = list_files(gt_dir, suffix='_segmentation', exts=('.png', ))
        found, p_pair = pair_up(images, masks, source)
        pairs += found
        problems += p_img + p_mask + p_pair
    if not pairs and not problems:
        expected = '\n  '.join(f for both in folders.values() for f in both)
        raise ConversionError(f'no ISIC folders in {src}; expected some of:\n  {expected}')
    seen: Dict[str, Pair] = {}
    unique = []
    for p in pairs:
        if p.name in seen:
            problems.append(Problem(p.name, p.image, f'also in {seen[p.name].source} '
                                    f'({seen[p.name].image})'))
        else:
            seen[p.name] = p
            unique.append(p)
    return unique, problems


def isic_main(dataset: str, folders: Dict[str, Tuple[str, str]], description: str,
              argv: Optional[Sequence[str]] = None) -> int:
    """Command line of the ISIC converters (2017 part 1, 2018 task 1)."""
    parser = build_parser(dataset, ('random', 'official'), 'random', description)
    parser.add_argument('--pool', default='Training,Validation',
                        help='official sets split at random by --split random, comma-separated '
                        '(default Training,Validation; Test, if present, stays test)')

    def convert_fn(argv_):
        args = parser.parse_args(argv_)
        finish_args(args, parser)
        pool = [s.strip() for s in args.pool.split(',') if s.strip()]
        unknown = [s for s in pool if s not in folders]
        if unknown:
            parser.error(f'--pool {args.pool}: unknown sets {unknown}; choose from '
                         f'{list(folders)}')
        pairs, problems = find_isic_pairs(args.src, folders)
        return convert(pairs, problems, args, ISIC_OFFICIAL_SPLITS, pool), args.out

    return run(convert_fn, argv)
