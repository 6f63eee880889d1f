"""Evaluation for mmseg: binary segmentation scores, pooled over pixels and per image."""
from .metrics import (ForegroundIoUMetric, confusion_counts, foreground_scores, per_image_scores,
                      pixel_scores)

__all__ = [
    'ForegroundIoUMetric', 'confusion_counts', 'foreground_scores', 'per_image_scores',
    'pixel_scores'
]
