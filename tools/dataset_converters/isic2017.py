"""Convert the ISIC 2017 part-1 (lesion segmentation) download to kcla_mm's layout.

Reads the unpacked official archives in SRC::

    ISIC-2017_{Training,Validation,Test_v2}_Data/ISIC_XXXXXXX.jpg
    ISIC-2017_{Training,Validation,Test_v2}_Part1_GroundTruth/ISIC_XXXXXXX_segmentation.png

(superpixel maps and metadata CSVs are ignored) and writes
``images/{train,val,test}``, ``masks/{train,val,test}`` (0/1 PNGs),
``splits.txt`` and ``stats.json`` to ``--out`` (default ``data/isic2017``).

Splits: ``--split random`` (default, the paper's protocol): Training and
Validation (``--pool``) pooled and split 7:3 (``--ratio``) with ``--seed``;
Test, if present, becomes ``test``. ``--split official``: Training/
Validation/Test as train/val/test. ``--split-file FILE``: ``NAME SPLIT`` lines.
Without the Test set, ``--test-ratio`` holds out a seeded test split of the
pool (with it, the official Test set is the test split).

Example::

    python tools/dataset_converters/isic2017.py /data/downloads/isic2017 --out data/isic2017
"""
import sys

from medical_common import isic_main

from kcla_mm.datasets.synthetic_medical import ISIC_FOLDERS


def main(argv=None) -> int:
    """Run the converter; returns the exit status (1 on bad inputs)."""
    return isic_main('isic2017', ISIC_FOLDERS['isic2017'], __doc__, argv)


if __name__ == '__main__':
    sys.exit(main())
