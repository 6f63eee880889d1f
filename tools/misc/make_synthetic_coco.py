"""Write the synthetic COCO-format shapes dataset (see kcla_mm.datasets.synthetic_coco).

Example::

    python tools/misc/make_synthetic_coco.py --out data/synthetic_coco --num-train 400 \
        --num-val 50 --size 128 --seed 0
"""
from kcla_mm.datasets.synthetic_coco import main

if __name__ == '__main__':
    main()
