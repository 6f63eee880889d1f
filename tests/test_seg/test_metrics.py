"""ForegroundIoUMetric against hand-computed confusion matrices."""
import logging
import math

import pytest
import torch
from mmengine.logging import MMLogger
from mmseg.evaluation import IoUMetric

from kcla_mm.evaluation import ForegroundIoUMetric, confusion_counts, foreground_scores


def sample(label, logits=None, pred=None):
    """A data sample as mmseg's postprocess_result leaves it (``[C, H, W]`` fields)."""
    out = dict(gt_sem_seg=dict(data=torch.tensor(label)[None]), img_path='x.png')
    if logits is not None:
        out['seg_logits'] = dict(data=torch.tensor(logits, dtype=torch.float32))
    if pred is not None:
        out['pred_sem_seg'] = dict(data=torch.tensor(pred)[None])
    return out


# Image A (2x3): label and sigmoid probabilities (one output channel).
LABEL_A = [[1, 1, 0], [0, 0, 255]]
PROB_A = [[[0.9, 0.4, 0.6], [0.5, 0.1, 0.99]]]
# > 0.5 -> pred [[1, 0, 1], [0, 0, (ignored)]]: TP=1 FP=1 FN=1 TN=2
# Image B (2x2): all foreground, predicted [[1, 1], [1, 0]]: TP=3 FN=1
LABEL_B = [[1, 1], [1, 1]]
PROB_B = [[[0.7, 0.8], [0.51, 0.2]]]
# Global matrix: TP=4 FP=1 FN=2 TN=2 -> IoU = 4/7, DSC = 8/11.
GLOBAL_IOU = 100 * 4 / 7
GLOBAL_DSC = 100 * 8 / 11


def run_metric(samples, **kwargs):
    metric = ForegroundIoUMetric(**kwargs)
    metric.dataset_meta = dict(classes=('background', 'lesion'))
    metric.process({}, samples)
    return metric.compute_metrics(metric.results)


def test_counts_of_one_image_by_hand():
    counts = confusion_counts(torch.tensor(PROB_A[0]), torch.tensor(LABEL_A))
    assert counts.tolist() == [1, 1, 1, 2]  # TP, FP, FN, TN; the 255 pixel ignored


def test_global_matrix_over_all_pixels():
    scores = run_metric([sample(LABEL_A, PROB_A), sample(LABEL_B, PROB_B)])
    assert scores['fg_IoU'] == pytest.approx(GLOBAL_IOU)
    assert scores['fg_DSC'] == pytest.approx(GLOBAL_DSC)


def test_global_is_not_the_mean_of_per_image_scores():
    # Per image: IoU_A = 1/3, IoU_B = 3/4; their mean (54.17) differs from 4/7 (57.14).
    per_image = [foreground_scores(confusion_counts(torch.tensor(p[0]), torch.tensor(lab)))
                 for p, lab in ((PROB_A, LABEL_A), (PROB_B, LABEL_B))]
    mean_iou = sum(s['fg_IoU'] for s in per_image) / 2
    assert mean_iou == pytest.approx(100 * (1 / 3 + 3 / 4) / 2)
    assert abs(mean_iou - GLOBAL_IOU) > 1


def test_threshold_is_strict_and_configurable():
    # 0.5 exactly is background at threshold 0.5; at 0.45 the 0.5 pixel becomes FP.
    scores = run_metric([sample(LABEL_A, PROB_A)], threshold=0.45)
    # pred [[1, 0, 1], [1, 0, -]]: TP=1 FP=2 FN=1
    assert scores['fg_IoU'] == pytest.approx(100 * 1 / 4)


def test_two_channel_logits_use_softmax_foreground():
    # Foreground wins where logit[1] > logit[0]: pred [[1, 0], [0, 1]].
    logits = [[[0.0, 2.0], [1.0, -1.0]], [[1.0, 0.0], [0.5, 3.0]]]
    label = [[1, 1], [0, 1]]
    scores = run_metric([sample(label, logits)])
    assert scores['fg_IoU'] == pytest.approx(100 * 2 / 3)  # TP=2 FN=1
    assert scores['fg_DSC'] == pytest.approx(100 * 4 / 5)


def test_falls_back_to_pred_sem_seg():
    scores = run_metric([sample([[1, 0], [1, 0]], pred=[[1, 1], [0, 0]])])
    assert scores['fg_IoU'] == pytest.approx(100 / 3)


def test_matches_iou_metric_foreground_class():
    # mmseg's IoUMetric computes per-class IoU from global sums too: its
    # 'lesion' IoU is our fg_IoU; its mIoU also averages in the background.
    logits = [[[0.0, 2.0, 1.0], [1.0, -1.0, 0.0]], [[1.0, 0.0, 3.0], [0.5, 3.0, 0.0]]]
    label = [[1, 1, 0], [0, 1, 1]]
    pred = torch.tensor(logits).argmax(0)
    iou = IoUMetric(iou_metrics=['mIoU'])
    iou.dataset_meta = dict(classes=('background', 'lesion'))
    iou.process({}, [sample(label, logits, pred=pred.tolist())])
    counts = iou.results[0]  # (intersect, union, pred area, label area) per class
    lesion_iou = 100 * float(counts[0][1] / counts[1][1])
    ours = run_metric([sample(label, logits)])
    assert ours['fg_IoU'] == pytest.approx(lesion_iou)
    background_iou = 100 * float(counts[0][0] / counts[1][0])
    miou = iou.compute_metrics(iou.results)['mIoU']
    assert miou == pytest.approx((lesion_iou + background_iou) / 2, abs=0.01)


def test_no_foreground_anywhere_is_nan():
    scores = run_metric([sample([[0, 0]], [[[0.1, 0.2]]])])
    assert math.isnan(scores['fg_IoU']) and math.isnan(scores['fg_DSC'])


def test_non_binary_label_names_the_image():
    # Rule: the metric is binary; a label 2 must not be counted silently.
    with pytest.raises(ValueError, match=r'x\.png.*\[2\]'):
        run_metric([sample([[2, 0]], [[[0.9, 0.1]]])])


def test_more_than_two_channels_is_an_error():
    with pytest.raises(ValueError, match='3 channels'):
        run_metric([sample([[1, 0]], [[[0.0, 0.0]]] * 3)])


@pytest.mark.parametrize('threshold', [-0.1, 1.0])
def test_threshold_out_of_range(threshold):
    with pytest.raises(ValueError, match='threshold'):
        ForegroundIoUMetric(threshold=threshold)


# Per image: Dice_A = 2/4, Dice_B = 6/7; IoU_A = 1/3, IoU_B = 3/4.
IMG_MDICE = 100 * (1 / 2 + 6 / 7) / 2
IMG_MIOU = 100 * (1 / 3 + 3 / 4) / 2
# Empty masks (2x2): C is predicted empty (TP=FP=FN=0, TN=4); D has one
# false positive (FP=1, TN=3): Dice_D = IoU_D = 0.
LABEL_EMPTY = [[0, 0], [0, 0]]
PROB_C = [[[0.1, 0.2], [0.3, 0.5]]]
PROB_D = [[[0.1, 0.9], [0.3, 0.2]]]


def test_pooled_accuracy_sensitivity_specificity_by_hand():
    # A + B + D: TP=1+3+0, FP=1+0+1, FN=1+1+0, TN=2+0+3 (13 counted pixels).
    scores = run_metric([sample(LABEL_A, PROB_A), sample(LABEL_B, PROB_B),
                         sample(LABEL_EMPTY, PROB_D)])
    assert scores['fg_Acc'] == pytest.approx(100 * 9 / 13)
    assert scores['fg_Sen'] == pytest.approx(100 * 4 / 6)
    assert scores['fg_Spe'] == pytest.approx(100 * 5 / 7)
    assert scores['fg_IoU'] == pytest.approx(100 * 4 / 8)


def test_per_image_means_by_hand():
    scores = run_metric([sample(LABEL_A, PROB_A), sample(LABEL_B, PROB_B)])
    assert scores['img_mDice'] == pytest.approx(IMG_MDICE)
    assert scores['img_mIoU'] == pytest.approx(IMG_MIOU)
    # The two conventions differ on the same predictions.
    assert abs(scores['img_mIoU'] - scores['fg_IoU']) > 1
    assert abs(scores['img_mDice'] - scores['fg_DSC']) > 1


def test_empty_mask_and_empty_prediction_counts_as_perfect_by_default():
    samples = [sample(LABEL_A, PROB_A), sample(LABEL_EMPTY, PROB_C), sample(LABEL_EMPTY, PROB_D)]
    scores = run_metric(samples)
    assert scores['img_mDice'] == pytest.approx(100 * (1 / 2 + 1 + 0) / 3)
    assert scores['img_mIoU'] == pytest.approx(100 * (1 / 3 + 1 + 0) / 3)
    # Pooled: TP=1 FP=2 FN=1 TN=2+4+3; the empty images add their pixels.
    assert scores['fg_IoU'] == pytest.approx(100 * 1 / 4)
    assert scores['fg_Acc'] == pytest.approx(100 * 10 / 13)
    assert scores['fg_Sen'] == pytest.approx(100 * 1 / 2)
    assert scores['fg_Spe'] == pytest.approx(100 * 9 / 11)


def test_empty_mask_and_empty_prediction_can_be_excluded():
    samples = [sample(LABEL_A, PROB_A), sample(LABEL_EMPTY, PROB_C), sample(LABEL_EMPTY, PROB_D)]
    scores = run_metric(samples, empty_image='exclude')
    # C is left out; D (foreground predicted on an empty mask) still scores 0.
    assert scores['img_mDice'] == pytest.approx(100 * (1 / 2 + 0) / 2)
    assert scores['img_mIoU'] == pytest.approx(100 * (1 / 3 + 0) / 2)
    assert scores['fg_Spe'] == pytest.approx(100 * 9 / 11)  # pooled scores do not change


def test_only_empty_images():
    perfect = run_metric([sample(LABEL_EMPTY, PROB_C)])
    assert perfect['img_mDice'] == perfect['img_mIoU'] == 100
    assert perfect['fg_Spe'] == perfect['fg_Acc'] == 100
    assert math.isnan(perfect['fg_Sen']) and math.isnan(perfect['fg_IoU'])
    excluded = run_metric([sample(LABEL_EMPTY, PROB_C)], empty_image='exclude')
    assert math.isnan(excluded['img_mDice']) and math.isnan(excluded['img_mIoU'])


def test_ignored_pixels_are_left_out_of_every_score():
    # The 255 pixel of A (probability 0.99) would be an FP if counted.
    scores = run_metric([sample(LABEL_A, PROB_A)])
    assert scores['fg_Acc'] == pytest.approx(100 * 3 / 5)
    assert scores['fg_Spe'] == pytest.approx(100 * 2 / 3)
    assert scores['img_mDice'] == pytest.approx(100 * 1 / 2)


def test_pixel_scores_match_iou_metric_accuracies():
    # mmseg's aAcc is the pooled pixel accuracy; its per-class accuracies are
    # the background (specificity) and lesion (sensitivity) recalls.
    pairs = [(LABEL_A, PROB_A), (LABEL_B, PROB_B), (LABEL_EMPTY, PROB_D)]
    samples = [sample(label, prob) for label, prob in pairs]
    iou = IoUMetric(iou_metrics=['mIoU'])
    iou.dataset_meta = dict(classes=('background', 'lesion'))
    iou.process({}, [sample(label, pred=(torch.tensor(prob[0]) > 0.5).long().tolist())
                     for label, prob in pairs])
    theirs = iou.compute_metrics(iou.results)
    ours = run_metric(samples)
    assert ours['fg_Acc'] == pytest.approx(theirs['aAcc'], abs=0.01)
    assert (ours['fg_Sen'] + ours['fg_Spe']) / 2 == pytest.approx(theirs['mAcc'], abs=0.01)


def test_scores_are_logged_by_name():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        run_metric([sample(LABEL_A, PROB_A), sample(LABEL_EMPTY, PROB_C)])
    finally:
        logger.removeHandler(handler)
    text = '\n'.join(r.getMessage() for r in records)
    for key in ('fg_IoU', 'fg_DSC', 'fg_Acc', 'fg_Sen', 'fg_Spe', 'img_mDice', 'img_mIoU'):
        assert f'{key}=' in text, key
    assert 'over 2 images (1 with an empty mask' in text


def test_unknown_empty_image_rule():
    with pytest.raises(ValueError, match="empty_image.*'skip'"):
        ForegroundIoUMetric(empty_image='skip')
