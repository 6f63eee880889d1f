"""Foreground IoU and Dice (DSC) from one global confusion matrix.

The convention of the medical segmentation papers KCLA reports against
(e.g. MALUNet, EGE-UNet on ISIC2017/2018): every pixel of every validation
image is thresholded at 0.5 and counted in *one* binary confusion matrix;
then ``IoU = TP / (TP + FP + FN)`` and ``DSC = 2TP / (2TP + FP + FN)`` of the
foreground class. This differs from mmseg's ``IoUMetric`` ``mIoU``/``mDice``,
which average the per-class scores of background and foreground; configs
report both, under different names (``fg_IoU``/``fg_DSC`` here, ``mIoU``/
``mDice`` there).
"""
import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from mmengine.evaluator import BaseMetric
from mmengine.logging import MMLogger
from torch import Tensor

#: Order of the counts stored per image.
COUNT_NAMES = ('TP', 'FP', 'FN', 'TN')


def confusion_counts(fg_prob: Tensor,
                     label: Tensor,
                     threshold: float = 0.5,
                     ignore_index: Optional[int] = 255) -> np.ndarray:
    """Binary confusion counts of one image.

    Args:
        fg_prob: ``[H, W]`` foreground probabilities (or a ``{0, 1}`` mask).
        label: ``[H, W]`` labels in ``{0, 1}`` and ``ignore_index``.
        threshold: a pixel is predicted foreground if ``fg_prob > threshold``.
        ignore_index: label value excluded from all counts.

    Returns:
        ``int64`` array ``[TP, FP, FN, TN]``.
    """
    if fg_prob.shape != label.shape:
        raise ValueError(f'prediction {tuple(fg_prob.shape)} and label {tuple(label.shape)} '
                         'must have the same [H, W] shape')
    valid = torch.ones_like(label, dtype=torch.bool) if ignore_index is None \
        else label != ignore_index
    bad = torch.unique(label[valid & (label != 0) & (label != 1)])
    if bad.numel():
        raise ValueError(f'foreground metric is binary: labels must be 0, 1 or ignore_index='
                         f'{ignore_index}, found {bad.tolist()}')
    pred = fg_prob > threshold
    gt = label == 1
    tp = int((pred & gt & valid).sum())
    fp = int((pred & ~gt & valid).sum())
    fn = int((~pred & gt & valid).sum())
    tn = int((~pred & ~gt & valid).sum())
    return np.array([tp, fp, fn, tn], dtype=np.int64)


def foreground_scores(counts: np.ndarray) -> Dict[str, float]:
    """Foreground IoU and DSC (percent) of a confusion matrix.

    Args:
        counts: ``[TP, FP, FN, TN]``.

    Returns:
        ``{'fg_IoU': ..., 'fg_DSC': ...}`` in percent; NaN if there is neither
        a foreground pixel nor a foreground prediction (``TP + FP + FN = 0``).
    """
    tp, fp, fn, _ = (int(c) for c in counts)
    if tp + fp + fn == 0:
        return dict(fg_IoU=math.nan, fg_DSC=math.nan)
    return dict(fg_IoU=100.0 * tp / (tp + fp + fn), fg_DSC=100.0 * 2 * tp / (2 * tp + fp + fn))


class ForegroundIoUMetric(BaseMetric):
    """Foreground IoU and DSC over all pixels of the evaluation set.

    The foreground probability comes from the model's ``seg_logits`` (mmseg
    stores sigmoid probabilities for ``out_channels=1`` and raw logits for two
    channels, which are softmaxed here), thresholded at ``threshold``
    regardless of the decode head's own ``threshold``. Samples without
    ``seg_logits`` fall back to ``pred_sem_seg == 1``.

    Keys: ``fg_IoU`` and ``fg_DSC`` in percent (plus ``prefix/`` if set).

    Args:
        threshold: foreground if the probability is above it (0.5 in the papers).
        ignore_index: label value excluded from the counts.
        collect_device: ``'cpu'`` or ``'gpu'`` for collecting across ranks.
        prefix: prefix of the metric names.
    """

    def __init__(self,
                 threshold: float = 0.5,
                 ignore_index: int = 255,
                 collect_device: str = 'cpu',
                 prefix: Optional[str] = None) -> None:
        super().__init__(collect_device=collect_device, prefix=prefix)
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f'threshold must be in [0, 1), got threshold={threshold!r}')
        self.threshold = threshold
        self.ignore_index = ignore_index

    @staticmethod
    def foreground_prob(data_sample: dict) -> Tensor:
        """``[H, W]`` foreground probability of one predicted sample."""
        logits = data_sample.get('seg_logits', None)
        if logits is None:
            return (data_sample['pred_sem_seg']['data'][0] == 1).float()
        logits = logits['data']  # [C, H, W]
        if logits.shape[0] == 1:  # mmseg applied the sigmoid already
            return logits[0].float()
        if logits.shape[0] == 2:
            return logits.float().softmax(dim=0)[1]
        raise ValueError(f'foreground metric is binary; got seg_logits with '
                         f'{logits.shape[0]} channels for {data_sample.get("img_path")}')

    def process(self, data_batch: dict, data_samples: Sequence[dict]) -> None:
        """Count one batch.

        Args:
            data_batch: the batch from the dataloader (unused).
            data_samples: model outputs with ``seg_logits`` (or ``pred_sem_seg``)
                and ``gt_sem_seg``, each ``[C, H, W]``.
        """
        for sample in data_samples:
            prob = self.foreground_prob(sample)
            label = sample['gt_sem_seg']['data'][0].to(prob.device)
            try:
                counts = confusion_counts(prob, label, self.threshold, self.ignore_index)
            except ValueError as e:
                raise ValueError(f'{sample.get("img_path")}: {e}') from e
            self.results.append(counts)

    def compute_metrics(self, results: List[np.ndarray]) -> Dict[str, float]:
        """Scores of the summed confusion matrix.

        Args:
            results: per-image ``[TP, FP, FN, TN]``.

        Returns:
            ``fg_IoU`` and ``fg_DSC`` in percent.
        """
        counts = np.sum(np.stack(results), axis=0) if results else np.zeros(4, np.int64)
        scores = foreground_scores(counts)
        logger = MMLogger.get_current_instance()
        matrix = ', '.join(f'{n}={int(c)}' for n, c in zip(COUNT_NAMES, counts))
        logger.info(f'foreground confusion matrix over {len(results)} images at threshold '
                    f'{self.threshold}: {matrix}; fg_IoU={scores["fg_IoU"]:.2f}, '
                    f'fg_DSC={scores["fg_DSC"]:.2f}')
        return scores
