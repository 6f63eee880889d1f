"""Convert the Kvasir-SEG download to kcla_mm's layout.

Reads ``images/*.jpg`` and ``masks/*.jpg`` (1000 pairs) from SRC, the
unpacked ``Kvasir-SEG`` folder or the folder holding it. The masks are
JPEG-compressed, so they are thresholded (``--mask-threshold``, default 128)
rather than matched on 0/255. Writes ``images/{train,val,test}``, ``masks/{...}``
(0/1 PNGs), ``splits.txt`` and ``stats.json`` to ``--out`` (default
``data/kvasir_seg``).

Splits:

- ``--split random`` (default): 700/300 train/val for 1000 images
  (``--ratio 0.7``) with ``--seed``; ``--test-ratio`` holds out a test split
  too (``--ratio 0.7 --test-ratio 0.15``: 700/150/150).
- ``--split kcla-paper``: the KCLA authors' 700/300 train/val split, read from
  the name lists shipped in ``splits/kvasir_seg/kcla-paper/`` (see the
  README there for their source). Names listed but missing from the download
  and images the lists do not cover are reported by name.
- ``--split-file FILE``: ``NAME SPLIT`` lines (train, val or test).

Example::

    python tools/dataset_converters/kvasir_seg.py /data/downloads/kvasir-seg --out data/kvasir_seg \
        --split kcla-paper
"""
import os.path as osp
import sys
from typing import Dict

from medical_common import (SPLITS, ConversionError, build_parser, convert, finish_args, list_files,
                            pair_up, run)

from kcla_mm.datasets.synthetic_medical import KVASIR_ROOT

#: ``--split NAME`` -> folder of its name lists ``{train,val,test}.txt``.
NAMED_SPLITS = {
    'kcla-paper': osp.join(osp.dirname(osp.abspath(__file__)), 'splits', 'kvasir_seg',
                           'kcla-paper'),
}


def kvasir_root(src: str) -> str:
    """The folder with ``images/`` and ``masks/``: SRC or SRC/Kvasir-SEG."""
    for root in (src, osp.join(src, KVASIR_ROOT)):
        if osp.isdir(osp.join(root, 'images')) and osp.isdir(osp.join(root, 'masks')):
            return root
    raise ConversionError(f'no images/ and masks/ folders in {src} or '
                          f'{osp.join(src, KVASIR_ROOT)}')


def named_split_lists(split: str) -> Dict[str, str]:
    """``{split: path}`` of the name lists of ``--split NAME``.

    Raises:
        ConversionError: the lists are not in this checkout.
    """
    folder = NAMED_SPLITS[split]
    lists = {s: osp.join(folder, f'{s}.txt') for s in SPLITS
             if osp.isfile(osp.join(folder, f'{s}.txt'))}
    if 'train' not in lists or len(lists) < 2:
        raise ConversionError(f'--split {split}: its name lists are not shipped in this '
                              f'checkout (expected train.txt and val.txt in {folder})')
    return lists


def main(argv=None) -> int:
    """Run the converter; returns the exit status (1 on bad inputs)."""
    parser = build_parser('kvasir_seg', ('random', ) + tuple(NAMED_SPLITS), 'random', __doc__)

    def convert_fn(argv_):
        args = parser.parse_args(argv_)
        finish_args(args, parser)
        if args.split in NAMED_SPLITS:
            args.split_lists = named_split_lists(args.split)
        root = kvasir_root(args.src)
        images, p_img = list_files(osp.join(root, 'images'))
        masks, p_mask = list_files(osp.join(root, 'masks'))
        pairs, p_pair = pair_up(images, masks, KVASIR_ROOT)
        return convert(pairs, p_img + p_mask + p_pair, args, pool=[KVASIR_ROOT]), args.out

    return run(convert_fn, argv)


if __name__ == '__main__':
    sys.exit(main())
