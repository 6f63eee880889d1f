"""Datasets and synthetic-data generators.

The medical segmentation datasets need mmseg and are imported only when it is
installed; the generators (``synthetic_medical``, ``synthetic_coco``) need only numpy
and OpenCV.
"""
__all__ = []

try:
    from .medical import (BinaryMedicalDataset, ISIC2017Dataset, ISIC2018Dataset,  # noqa: F401
                          KvasirSEGDataset)
    __all__ += ['BinaryMedicalDataset', 'ISIC2017Dataset', 'ISIC2018Dataset', 'KvasirSEGDataset']
except ImportError:  # mmseg not installed
    pass
