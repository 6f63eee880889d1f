"""Losses for mmseg heads: the soft Dice loss on one sigmoid logit."""
from .binary_dice_loss import BinaryDiceLoss, binary_dice_loss

__all__ = ['BinaryDiceLoss', 'binary_dice_loss']
