"""Soft Dice loss for binary segmentation with one sigmoid output channel.

Milletari, Navab, Ahmadi, "V-Net", 3DV 2016 (soft Dice); the smoothed,
per-image form ``1 - (2 |P*G| + s) / (|P| + |G| + s)`` is the one of the
BCE + Dice protocol used by the medical papers KCLA compares with.

NOTE: mmseg 1.2.2's ``DiceLoss`` one-hot encodes the label with as many
channels as the prediction; with ``out_channels=1`` that single channel is
the *background* indicator (``label == 0``), so combined with
``CrossEntropyLoss(use_sigmoid=True)`` it pushes the logit in the opposite
direction. This loss treats the one channel as the foreground (label 1).
"""
from typing import Optional

import torch
from torch import Tensor, nn


def binary_dice_loss(logits: Tensor,
                     label: Tensor,
                     weight: Optional[Tensor] = None,
                     smooth: float = 1.0,
                     ignore_index: Optional[int] = 255) -> Tensor:
    """Per-image soft Dice loss of sigmoid foreground probabilities.

    Args:
        logits: ``[N, 1, H, W]`` or ``[N, H, W]`` foreground logits.
        label: ``[N, H, W]`` labels in ``{0, 1}`` (and ``ignore_index``).
        weight: optional ``[N, H, W]`` pixel weights.
        smooth: added to numerator and denominator of every image's Dice.
        ignore_index: label value excluded from both sums.

    Returns:
        ``[N]`` losses, ``1 - Dice`` of each image.
    """
    if logits.dim() == 4:
        if logits.shape[1] != 1:
            raise ValueError(f'binary_dice_loss expects one channel, got logits of shape '
                             f'{tuple(logits.shape)}; use out_channels=1')
        logits = logits[:, 0]
    if logits.shape != label.shape:
        raise ValueError(f'logits {tuple(logits.shape)} and label {tuple(label.shape)} '
                         'must have the same [N, H, W] shape')
    valid = torch.ones_like(label, dtype=torch.bool) if ignore_index is None \
        else label != ignore_index
    mask = valid.to(logits.dtype) if weight is None else valid.to(logits.dtype) * weight
    prob = logits.float().sigmoid() * mask  # [N, H, W]
    target = (label == 1).to(prob.dtype) * mask  # [N, H, W]
    inter = (prob * target).flatten(1).sum(1)  # [N]
    denom = prob.flatten(1).sum(1) + target.flatten(1).sum(1)  # [N]
    return 1 - (2 * inter + smooth) / (denom + smooth)


class BinaryDiceLoss(nn.Module):
    """Soft Dice loss on one sigmoid logit per pixel, averaged over images.

    Use with a decode head with ``num_classes=2, out_channels=1``, e.g.
    next to ``CrossEntropyLoss(use_sigmoid=True)`` for BCE + Dice.

    Args:
        smooth: Laplace smoothing of each image's Dice (1 in the protocol).
        loss_weight: factor on the loss.
        loss_name: key in the loss dict; must start with ``loss_``.
    """

    def __init__(self,
                 smooth: float = 1.0,
                 loss_weight: float = 1.0,
                 loss_name: str = 'loss_dice') -> None:
        super().__init__()
        if smooth < 0:
            raise ValueError(f'smooth must be >= 0, got smooth={smooth!r}')
        self.smooth = smooth
        self.loss_weight = loss_weight
        self._loss_name = loss_name

    def forward(self,
                pred: Tensor,
                target: Tensor,
                weight: Optional[Tensor] = None,
                ignore_index: Optional[int] = 255,
                **kwargs) -> Tensor:
        """Loss of a batch.

        Args:
            pred: ``[N, 1, H, W]`` logits.
            target: ``[N, H, W]`` labels.
            weight: optional ``[N, H, W]`` pixel weights (mmseg's sampler).
            ignore_index: label value to ignore (the head passes its own).
            **kwargs: other arguments mmseg heads pass (unused).

        Returns:
            Scalar loss.
        """
        loss = binary_dice_loss(pred, target, weight, self.smooth, ignore_index)
        return self.loss_weight * loss.mean()

    @property
    def loss_name(self) -> str:
        """Name of the loss item in the loss dict."""
        return self._loss_name
