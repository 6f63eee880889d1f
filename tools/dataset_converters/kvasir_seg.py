"""Convert the Kvasir-SEG download to kcla_mm's layout.

Reads ``images/*.jpg`` and ``masks/*.jpg`` (1000 pairs) from SRC, the
unpacked ``Kvasir-SEG`` folder or the folder holding it. The masks are
JPEG-compressed, so they are thresholded (``--mask-threshold``, default 128)
rather than matched on 0/255. Writes ``images/{train,val}``, ``masks/{train,val}``
(0/1 PNGs), ``splits.txt`` and ``stats.json`` to ``--out`` (default
``data/kvasir_seg``).

Splits: ``--split random`` (default, the paper's protocol): 700/300 for
1000 images (``--ratio 0.7``) with ``--seed``. ``--split-file FILE``:
``NAME SPLIT`` lines.

Example::

    python tools/dataset_converters/kvasir_seg.py /data/downloads/kvasir-seg --out data/kvasir_seg
"""
import os.path as osp
import sys

from medical_common import (ConversionError, build_parser, convert, finish_args, list_files,
                            pair_up, run)

from kcla_mm.datasets.synthetic_medical import KVASIR_ROOT


def kvasir_root(src: str) -> str:
    """The folder with ``images/`` and ``masks/``: SRC or SRC/Kvasir-SEG."""
    for root in (src, osp.join(src, KVASIR_ROOT)):
        if osp.isdir(osp.join(root, 'images')) and osp.isdir(osp.join(root, 'masks')):
            return root
    raise ConversionError(f'no images/ and masks/ folders in {src} or '
                          f'{osp.join(src, KVASIR_ROOT)}')


def main(argv=None) -> int:
    """Run the converter; returns the exit status (1 on bad inputs)."""
    parser = build_parser('kvasir_seg', ('random', ), 'random', __doc__)

    def convert_fn(argv_):
        args = parser.parse_args(argv_)
        finish_args(args, parser)
        root = kvasir_root(args.src)
        images, p_img = list_files(osp.join(root, 'images'))
        masks, p_mask = list_files(osp.join(root, 'masks'))
        pairs, p_pair = pair_up(images, masks, KVASIR_ROOT)
        return convert(pairs, p_img + p_mask + p_pair, args, pool=[KVASIR_ROOT]), args.out

    return run(convert_fn, argv)


if __name__ == '__main__':
    sys.exit(main())
