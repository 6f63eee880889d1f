"""Metrics registered in mmseg's ``METRICS``."""
from .foreground_iou_metric import (ForegroundIoUMetric, confusion_counts, foreground_scores,
                                    per_image_scores, pixel_scores)

__all__ = [
    'ForegroundIoUMetric', 'confusion_counts', 'foreground_scores', 'per_image_scores',
    'pixel_scores'
]
