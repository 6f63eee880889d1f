"""Binary segmentation scores of the medical papers: pooled and per image.

Two conventions are in use for the same datasets, and they give different
numbers:

- **Pooled** (``fg_*``): every pixel of every evaluated image is thresholded
  and counted in *one* binary confusion matrix, then ``IoU = TP / (TP + FP +
  FN)``, ``DSC = 2TP / (2TP + FP + FN)``, ``Acc = (TP + TN) / N``, ``Sen =
  TP / (TP + FN)`` (recall of the foreground), ``Spe = TN / (TN + FP)``. This
  is the convention of the papers KCLA reports against on ISIC 2017/2018 and
  Kvasir-SEG (MALUNet, EGE-UNet, whose evaluation code KCLA's builds on).
- **Per image** (``img_*``): Dice and IoU of each image on its own, then
  averaged over images: the PraNet evaluation convention, under which most
  Kvasir-SEG tables report ``mDice``/``mIoU``.

Both differ from mmseg's ``IoUMetric`` ``mIoU``/``mDice``, which average the
pooled scores of the background and foreground classes; configs report all
of them, under different names.
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


def _percent(num: int, den: int) -> float:
    return 100.0 * num / den if den else math.nan


def pixel_scores(counts: np.ndarray) -> Dict[str, float]:
    """Accuracy, sensitivity and specificity (percent) of a confusion matrix.

    Args:
        counts: ``[TP, FP, FN, TN]``.

    Returns:
        ``fg_Acc = (TP + TN) / (TP + FP + FN + TN)``, ``fg_Sen = TP / (TP + FN)``
        (foreground recall) and ``fg_Spe = TN / (TN + FP)`` (background
        recall), each NaN where its denominator is 0.
    """
    tp, fp, fn, tn = (int(c) for c in counts)
    return dict(fg_Acc=_percent(tp + tn, tp + fp + fn + tn), fg_Sen=_percent(tp, tp + fn),
                fg_Spe=_percent(tn, tn + fp))


#: ``empty_image`` choices: how an image with no foreground in the mask and
#: none in the prediction enters the per-image means.
EMPTY_IMAGE_RULES = ('perfect', 'exclude')


def per_image_scores(counts: np.ndarray, empty_image: str = 'perfect') -> Dict[str, float]:
    """Mean over images of each image's own Dice and IoU (percent).

    Args:
        counts: ``[num_images, 4]`` per-image ``[TP, FP, FN, TN]``.
        empty_image: an image with an empty mask and an empty prediction
            (``TP + FP + FN = 0``) scores 100 (``'perfect'``: the prediction
            is exactly right) or is left out of both means (``'exclude'``).
            An empty mask with any predicted foreground scores 0 either way.

    Returns:
        ``img_mDice`` and ``img_mIoU``; NaN if no image is counted.
    """
    if empty_image not in EMPTY_IMAGE_RULES:
        raise ValueError(f'empty_image must be one of {EMPTY_IMAGE_RULES}, '
                         f'got {empty_image!r}')
    counts = np.asarray(counts, dtype=np.float64).reshape(-1, 4)
    tp, fp, fn = counts[:, 0], counts[:, 1], counts[:, 2]
    union = tp + fp + fn
    empty = union == 0
    keep = ~empty if empty_image == 'exclude' else np.ones_like(empty)
    if not keep.any():
        return dict(img_mDice=math.nan, img_mIoU=math.nan)
    safe = np.where(empty, 1.0, union)
    dice = np.where(empty, 1.0, 2 * tp / (safe + tp))
    iou = np.where(empty, 1.0, tp / safe)
    return dict(img_mDice=100.0 * float(dice[keep].mean()),
                img_mIoU=100.0 * float(iou[keep].mean()))


class ForegroundIoUMetric(BaseMetric):
    """Binary segmentation scores: pooled over all pixels and averaged per image.

    The foreground probability comes from the model's ``seg_logits`` (mmseg
    stores sigmoid probabilities for ``out_channels=1`` and raw logits for two
    channels, which are softmaxed here), thresholded at ``threshold``
    regardless of the decode head's own ``threshold``. Samples without
    ``seg_logits`` fall back to ``pred_sem_seg == 1``. Every score below
    comes from the same per-image confusion counts at that threshold, with
    ``ignore_index`` pixels left out.

    Keys (percent, plus ``prefix/`` if set):

    - ``fg_IoU``, ``fg_DSC``, ``fg_Acc``, ``fg_Sen``, ``fg_Spe``: pooled, from
      one confusion matrix summed over all pixels of all images (EGE-UNet's
      IoU, DSC, accuracy, sensitivity and specificity).
    - ``img_mDice``, ``img_mIoU``: each image's Dice/IoU, averaged over the
      images (PraNet's mDice/mIoU); see ``empty_image``.

    Args:
        threshold: foreground if the probability is above it (0.5 in the papers).
        ignore_index: label value excluded from the counts.
        empty_image: ``'perfect'`` (default): an image with an empty mask and
            an empty prediction scores 100 in the per-image means;
            ``'exclude'``: such images are left out of them. An empty mask
            with predicted foreground scores 0 either way.
        collect_device: ``'cpu'`` or ``'gpu'`` for collecting across ranks.
        prefix: prefix of the metric names.
    """

    def __init__(self,
                 threshold: float = 0.5,
                 ignore_index: int = 255,
                 empty_image: str = 'perfect',
                 collect_device: str = 'cpu',
                 prefix: Optional[str] = None) -> None:
        super().__init__(collect_device=collect_device, prefix=prefix)
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f'threshold must be in [0, 1), got threshold={threshold!r}')
        if empty_image not in EMPTY_IMAGE_RULES:
            raise ValueError(f'empty_image must be one of {EMPTY_IMAGE_RULES}, '
                             f'got empty_image={empty_image!r}')
        self.threshold = threshold
        self.ignore_index = ignore_index
        self.empty_image = empty_image

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
        """Pooled scores of the summed confusion matrix and per-image means.

        Args:
            results: per-image ``[TP, FP, FN, TN]``.

        Returns:
            ``fg_IoU``, ``fg_DSC``, ``fg_Acc``, ``fg_Sen``, ``fg_Spe``,
            ``img_mDice`` and ``img_mIoU`` in percent.
        """
        per_image = np.stack(results) if results else np.zeros((0, 4), np.int64)
        counts = per_image.sum(axis=0)
        scores = foreground_scores(counts)
        scores.update(pixel_scores(counts))
        scores.update(per_image_scores(per_image, self.empty_image))
        empty = int(((per_image[:, 0] + per_image[:, 2]) == 0).sum())
        logger = MMLogger.get_current_instance()
        matrix = ', '.join(f'{n}={int(c)}' for n, c in zip(COUNT_NAMES, counts))
        pooled = ', '.join(f'{k}={scores[k]:.2f}'
                           for k in ('fg_IoU', 'fg_DSC', 'fg_Acc', 'fg_Sen', 'fg_Spe'))
        logger.info(f'foreground confusion matrix over {len(results)} images at threshold '
                    f'{self.threshold}: {matrix}; pooled over all pixels: {pooled}')
        logger.info(f'per image, then averaged over {len(results)} images ({empty} with an '
                    f'empty mask, empty_image={self.empty_image!r}): '
                    f'img_mDice={scores["img_mDice"]:.2f}, img_mIoU={scores["img_mIoU"]:.2f}')
        return scores
