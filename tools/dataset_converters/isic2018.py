"""Convert the ISIC 2018 task-1 (lesion boundary segmentation) download to kcla_mm's layout.

Reads the unpacked official archives in SRC::

    ISIC2018_Task1-2_{Training,Validation,Test}_Input/ISIC_XXXXXXX.jpg
    ISIC2018_Task1_{Training,Validation,Test}_GroundTruth/ISIC_XXXXXXX_segmentation.png

(LICENSE/ATTRIBUTION files are ignored) and writes ``images/{train,val,test}``,
``masks/{train,val,test}`` (0/1 PNGs), ``splits.txt`` and ``stats.json`` to
``--out`` (default ``data/isic2018``).

Splits: ``--split random`` (default, the paper's protocol): Training and
Validation (``--pool``) pooled and split 7:3 (``--ratio``) with ``--seed``;
Test, if present, becomes ``test``. ``--split official``: Training/
Validation/Test as train/val/test. ``--split-file FILE``: ``NAME SPLIT`` lines.
Without the Test set, ``--test-ratio`` holds out a seeded test split of the
pool (with it, the official Test set is the test split).

Example::

    python tools/dataset_converters/isic2018.py /data/downloads/isic2018 --out data/isic2018
"""
import sys

from medical_common import isic_main

from kcla_mm.datasets.synthetic_medical import ISIC_FOLDERS


def main(argv=None) -> int:
    """Run the converter; returns the exit status (1 on bad inputs)."""
    return isic_main('isic2018', ISIC_FOLDERS['isic2018'], __doc__, argv)


if __name__ == '__main__':
    sys.exit(main())
