"""BinaryDiceLoss: the foreground Dice of one sigmoid channel."""
import pytest
import torch
from mmseg.models.losses import DiceLoss

from kcla_mm.models.losses import BinaryDiceLoss, binary_dice_loss

LABEL = torch.tensor([[[1, 1, 0, 0], [0, 0, 0, 255]]])  # [1, 2, 4]


def logits_for(prob):
    return torch.logit(torch.tensor(prob, dtype=torch.float32))[:, None]


def test_value_by_hand():
    prob = [[[0.8, 0.6, 0.2, 0.0], [0.4, 0.0, 0.0, 0.9]]]
    # ignored pixel dropped: inter = 0.8 + 0.6 = 1.4; |P| = 2.0; |G| = 2
    expected = 1 - (2 * 1.4 + 1) / (2.0 + 2 + 1)
    loss = BinaryDiceLoss()(logits_for(prob), LABEL)
    assert float(loss) == pytest.approx(expected, abs=1e-5)


def test_perfect_and_inverted_prediction():
    label = LABEL.clamp(max=1)
    perfect = (label.float() * 40 - 20)[:, None]
    assert float(BinaryDiceLoss(smooth=0)(perfect, label, ignore_index=None)) < 1e-6
    assert float(BinaryDiceLoss(smooth=0)(-perfect, label, ignore_index=None)) > 1 - 1e-6


def test_mean_over_images_and_weight():
    logits = torch.zeros(2, 1, 2, 4)
    label = torch.stack([LABEL[0], torch.zeros_like(LABEL[0])])
    per_image = binary_dice_loss(logits, label)
    assert per_image.shape == (2, )
    loss = BinaryDiceLoss(loss_weight=2.0)(logits, label)
    assert float(loss) == pytest.approx(float(per_image.mean()) * 2)


def test_mmseg_dice_loss_rewards_background_for_one_channel():
    # Why kcla_mm ships BinaryDiceLoss: mmseg 1.2.2's DiceLoss treats the one
    # channel as the background class, so a perfect foreground logit scores badly.
    label = LABEL.clamp(max=1)
    perfect = (label.float() * 40 - 20)[:, None]
    assert float(DiceLoss(ignore_index=None)(perfect, label)) > 0.9
    assert float(BinaryDiceLoss()(perfect, label)) < 0.01


def test_rules():
    # one channel only: two channels mean softmax outputs
    with pytest.raises(ValueError, match='one channel'):
        binary_dice_loss(torch.zeros(1, 2, 2, 4), LABEL)
    with pytest.raises(ValueError, match='same'):
        binary_dice_loss(torch.zeros(1, 1, 2, 3), LABEL)
    with pytest.raises(ValueError, match='smooth'):
        BinaryDiceLoss(smooth=-1)
