"""Metrics registered in mmseg's ``METRICS``."""
from .foreground_iou_metric import ForegroundIoUMetric, confusion_counts, foreground_scores

__all__ = ['ForegroundIoUMetric', 'confusion_counts', 'foreground_scores']
