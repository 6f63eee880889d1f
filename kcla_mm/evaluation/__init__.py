"""Evaluation for mmseg: the paper's foreground IoU/DSC metric."""
from .metrics import ForegroundIoUMetric, confusion_counts, foreground_scores

__all__ = ['ForegroundIoUMetric', 'confusion_counts', 'foreground_scores']
